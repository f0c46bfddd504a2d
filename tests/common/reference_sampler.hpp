// The oracle of the sampler tests: pp::Sampler::sample as it was before issue 18 (a full sort of the
// candidates and full softmaxes in double), kept verbatim so the fast sampler's draws can be compared with it.
#pragma once

#include <pp/text/sampler.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace pp::test {

class ReferenceSampler {
 public:
  // The token that will occupy absolute position `pos` (one past the row whose logits these are).
  int32_t sample(std::span<const float> logits, const SamplingParams& p, int64_t pos) {
    if (p.greedy()) return pp::argmax(logits);
    // Candidates sorted by logit, descending; ties by lower id. NaN logits are dropped.
    cand_.clear();
    for (std::size_t i = 0; i < logits.size(); ++i)
      if (!std::isnan(logits[i])) cand_.push_back(int32_t(i));
    if (cand_.empty()) return 0;
    auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    std::size_t k = cand_.size();
    if (p.top_k && std::size_t(*p.top_k) < k) {
      k = std::size_t(*p.top_k);
      std::partial_sort(cand_.begin(), cand_.begin() + k, cand_.end(), by_logit);
      cand_.resize(k);
    } else {
      std::sort(cand_.begin(), cand_.end(), by_logit);
    }
    // Probabilities at temperature 1 for top-p and min-p.
    probs(logits, 1.0);
    if (p.top_p && *p.top_p < 1.0) {
      double cum = 0;
      std::size_t keep = 0;
      while (keep < cand_.size()) {
        cum += prob_[keep++];
        if (cum >= *p.top_p) break;
      }
      cand_.resize(keep);
      prob_.resize(keep);
    }
    if (p.min_p && *p.min_p > 0.0) {
      const double floor = *p.min_p * prob_[0];
      std::size_t keep = 1;
      while (keep < cand_.size() && prob_[keep] >= floor) ++keep;
      cand_.resize(keep);
    }
    probs(logits, p.temperature.value_or(1.0));
    const double u = sample_uniform(p.seed, pos) * std::accumulate(prob_.begin(), prob_.end(), 0.0);
    double cum = 0;
    for (std::size_t i = 0; i < cand_.size(); ++i) {
      cum += prob_[i];
      if (u < cum) return cand_[i];
    }
    return cand_.back();
  }

 // The same computation split in two for tests that draw many times from one (logits, params): everything
  // but the draw once, then each draw by binary search over the same cumulative sums (cum is non-decreasing,
  // so the first i with u < cum[i] is upper_bound). Checked against sample() by the tests.
  void prepare(std::span<const float> logits, const SamplingParams& p) {
    prepared_ = !p.greedy();
    if (!prepared_) {
      greedy_ = pp::argmax(logits);
      return;
    }
    cand_.clear();
    for (std::size_t i = 0; i < logits.size(); ++i)
      if (!std::isnan(logits[i])) cand_.push_back(int32_t(i));
    if (cand_.empty()) {
      prepared_ = false, greedy_ = 0;
      return;
    }
    auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    std::size_t k = cand_.size();
    if (p.top_k && std::size_t(*p.top_k) < k) {
      k = std::size_t(*p.top_k);
      std::partial_sort(cand_.begin(), cand_.begin() + k, cand_.end(), by_logit);
      cand_.resize(k);
    } else {
      std::sort(cand_.begin(), cand_.end(), by_logit);
    }
    probs(logits, 1.0);
    if (p.top_p && *p.top_p < 1.0) {
      double cum = 0;
      std::size_t keep = 0;
      while (keep < cand_.size()) {
        cum += prob_[keep++];
        if (cum >= *p.top_p) break;
      }
      cand_.resize(keep);
      prob_.resize(keep);
    }
    if (p.min_p && *p.min_p > 0.0) {
      const double floor = *p.min_p * prob_[0];
      std::size_t keep = 1;
      while (keep < cand_.size() && prob_[keep] >= floor) ++keep;
      cand_.resize(keep);
    }
    probs(logits, p.temperature.value_or(1.0));
    total_ = std::accumulate(prob_.begin(), prob_.end(), 0.0);
    cum_.resize(prob_.size());
    double cum = 0;
    for (std::size_t i = 0; i < prob_.size(); ++i) cum_[i] = cum += prob_[i];
  }
  int32_t draw(uint64_t seed, int64_t pos) const {
    if (!prepared_) return greedy_;
    const double u = sample_uniform(seed, pos) * total_;
    const auto it = std::upper_bound(cum_.begin(), cum_.end(), u);
    return it == cum_.end() ? cand_.back() : cand_[std::size_t(it - cum_.begin())];
  }

 private:
  // prob_[i] = softmax(logits[cand_] / temperature), unnormalised past the max-subtraction.
  void probs(std::span<const float> logits, double temperature) {
    prob_.resize(cand_.size());
    const double mx = logits[cand_[0]];
    double sum = 0;
    for (std::size_t i = 0; i < cand_.size(); ++i) sum += prob_[i] = std::exp((double(logits[cand_[i]]) - mx) / temperature);
    for (double& v : prob_) v /= sum;
  }
  std::vector<int32_t> cand_;
  std::vector<double> prob_;
  std::vector<double> cum_;
  double total_ = 0;
  bool prepared_ = false;
  int32_t greedy_ = 0;
};

}  // namespace pp::test
