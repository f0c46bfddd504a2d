// Token sampling from logits: argmax (lowest id wins ties) or top-k -> top-p -> min-p -> temperature -> draw.
//
// The draw uses a uniform number derived only from (seed, absolute position of the sampled token), so a
// seeded run gives the same tokens in any process, tool or restart:
//   u = (splitmix64(seed ^ splitmix64(position)) >> 11) * 2^-53,   u in [0, 1)
// All probability arithmetic is in double, in a fixed order.
#pragma once

#include <pp/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace pp {

struct SamplingParams {
  std::optional<double> temperature;  // > 0
  std::optional<int64_t> top_k;       // >= 1
  std::optional<double> top_p;        // (0, 1]
  std::optional<double> min_p;        // [0, 1)
  uint64_t seed = 0;
  // Argmax unless a sampling field is set; a seed alone does not turn sampling on.
  bool greedy() const { return !temperature && !top_k && !top_p && !min_p; }

  void validate() const {
    if (temperature && !(*temperature > 0.0 && std::isfinite(*temperature)))
      throw RequestError("temperature must be > 0, got " + std::to_string(*temperature));
    if (top_k && *top_k < 1) throw RequestError("top_k must be >= 1, got " + std::to_string(*top_k));
    if (top_p && !(*top_p > 0.0 && *top_p <= 1.0))
      throw RequestError("top_p must be in (0, 1], got " + std::to_string(*top_p));
    if (min_p && !(*min_p >= 0.0 && *min_p < 1.0))
      throw RequestError("min_p must be in [0, 1), got " + std::to_string(*min_p));
  }
};

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The uniform number in [0, 1) used to draw the token at absolute position `pos`.
inline double sample_uniform(uint64_t seed, int64_t pos) {
  return double(splitmix64(seed ^ splitmix64(uint64_t(pos))) >> 11) * 0x1.0p-53;
}

// Index of the largest logit; the lowest index wins ties; NaNs are never chosen (unless all are NaN: 0).
inline int32_t argmax(std::span<const float> logits) {
  int32_t best = 0;
  float bv = -INFINITY;
  bool found = false;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const float v = logits[i];
    if (std::isnan(v)) continue;
    if (!found || v > bv) {
      bv = v;
      best = int32_t(i);
      found = true;
    }
  }
  return best;
}

class Sampler {
 public:
  // The token that will occupy absolute position `pos` (one past the row whose logits these are).
  int32_t sample(std::span<const float> logits, const SamplingParams& p, int64_t pos) {
    if (p.greedy()) return argmax(logits);
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
};

}  // namespace pp
