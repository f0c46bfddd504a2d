// Token sampling from logits: argmax (lowest id wins ties) or top-k -> top-p -> min-p -> temperature -> draw.
//
// The draw uses a uniform number derived only from (seed, absolute position of the sampled token), so a
// seeded run gives the same tokens in any process, tool or restart:
//   u = (splitmix64(seed ^ splitmix64(position)) >> 11) * 2^-53,   u in [0, 1)
// All probability arithmetic is in double, in a fixed order.
//
// The definition (Sampler::full, unchanged since before issue 18): sort every non-NaN candidate by logit
// (descending, ties by lower id), keep the top k, softmax at temperature 1 over them (sum in that order),
// keep the shortest prefix whose cumulative probability reaches top_p, then those with probability >=
// min_p * the top one's, softmax at the temperature over what is left, and return the first candidate whose
// cumulative probability exceeds u * their total. Nothing is dropped from it: the token is exactly this one.
//
// The fast path (issue 18) reaches the same token without sorting the vocabulary or a softmax over it:
// * top_k < candidates (k <= 8192): the candidates within a window below the max (widened until it holds k)
//   are partially sorted, and the definition runs on those k.
// * top_p / min_p: the temperature-1 mass is summed per ring of (max - logit) (rings 1/16 wide, any order
//   within a ring, exp vectorised); only the rings up to the one where the mass reaches top_p, and the
//   logits within -ln(min_p) of the max, are sorted. The cuts are decided on those sums, and the definition
//   then draws from the kept prefix exactly.
// * no truncation: u * mass locates the ring; only that ring is sorted and walked.
// Each decision compares sums computed in another order than the definition's, so each is taken only when
// it is more than 1e-9 of the total mass from its boundary (min-p: 1e-12 relative); the rounding errors of
// both orders are below 1e-10 for 128256 candidates. Otherwise, and for +-inf maxima or top_k > 8192, the
// definition itself runs. Cost at 128256 candidates: docs/PERFORMANCE.md, "Sampling".
#pragma once

#include <pp/core/error.hpp>
#include <pp/kernels/simd.hpp>

#include <algorithm>
#include <bit>
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
// Two passes: the max (a compare-select the compiler vectorizes; NaN never wins `v > m`), then its first index.
inline int32_t argmax(std::span<const float> logits) {
  float m = -INFINITY;
  for (const float v : logits) m = v > m ? v : m;
  for (std::size_t i = 0; i < logits.size(); ++i)
    if (logits[i] == m) return int32_t(i);
  return 0;
}

class Sampler {
 public:
  // The token that will occupy absolute position `pos` (one past the row whose logits these are).
  int32_t sample(std::span<const float> logits, const SamplingParams& p, int64_t pos) {
    if (p.greedy()) return argmax(logits);
    const double u = sample_uniform(p.seed, pos);
    if (const auto t = fast(logits, p, u)) return *t;
    return full(logits, p, u);
  }

 private:
  // --- The definition: sort every candidate, full softmaxes (the sampler before issue 18; the fallback). ---
  int32_t full(std::span<const float> logits, const SamplingParams& p, double u) {
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
    return after_top_k(logits, p, u);
  }
  // cand_: the top-k candidates (or all), sorted.
  int32_t after_top_k(std::span<const float> logits, const SamplingParams& p, double u) {
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
    return draw(logits, p.temperature.value_or(1.0), u);
  }
  // cand_: the final candidates, sorted. The temperature softmax over them and the draw.
  int32_t draw(std::span<const float> logits, double temperature, double u) {
    probs(logits, temperature);
    u *= std::accumulate(prob_.begin(), prob_.end(), 0.0);
    double cum = 0;
    for (std::size_t i = 0; i < cand_.size(); ++i) {
      cum += prob_[i];
      if (u < cum) return cand_[i];
    }
    return cand_.back();
  }
  // prob_[i] = softmax(logits[cand_] / temperature), unnormalised past the max-subtraction.
  void probs(std::span<const float> logits, double temperature) {
    prob_.resize(cand_.size());
    const double mx = logits[cand_[0]];
    double sum = 0;
    for (std::size_t i = 0; i < cand_.size(); ++i) sum += prob_[i] = std::exp((double(logits[cand_[i]]) - mx) / temperature);
    for (double& v : prob_) v /= sum;
  }

  // --- The fast path: the same draw, or nullopt when a decision is within kMargin of its boundary. ---
  static constexpr double kMargin = 1e-9;       // of the total mass: > 10x every rounding error involved
  static constexpr double kMinPMargin = 1e-12;  // relative, for e_k vs min_p (4 roundings apart at most)
  static constexpr std::size_t kRings = 4096;   // rings of (max - logit), min(1, T) / 16 wide; the last holds the rest
  static constexpr double kNegligible = 45.0;   // x above this: weight < e^-45, left out of ring masses
  static constexpr std::size_t kMaxFastTopK = 8192;

  // The ring of a candidate at distance d = max - logit below the max, given ring_scale(T).
  static double ring_scale(double temperature) { return 16.0 / std::min(1.0, temperature); }
  static std::size_t ring(double d, double scale) {
    const double y = d * scale;
    return y < double(kRings - 1) ? std::size_t(y) : kRings - 1;
  }
  // Sort key: ascending key = logit descending, then id ascending (-0 counts as +0, as == does).
  static uint64_t key(float l, std::size_t id) {
    const uint32_t b = std::bit_cast<uint32_t>(l + 0.0f);
    const uint32_t asc = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return (uint64_t(~asc) << 32) | uint64_t(id);
  }
  void sort_keys_into_cand() {
    if (!std::is_sorted(keys_.begin(), keys_.end())) std::sort(keys_.begin(), keys_.end());
    cand_.resize(keys_.size());
    for (std::size_t i = 0; i < keys_.size(); ++i) cand_[i] = int32_t(uint32_t(keys_[i]));
  }
  // mass_[r]: the sum of exp(-x) over the candidates in ring r (x <= kNegligible); returns their total.
  double ring_masses(std::span<const float> logits, double mx, double temperature) {
    mass_.assign(kRings, 0.0);
    const double scale = ring_scale(temperature);
    // The weights, vectorised: exp's error (an ulp or two) is far inside kMargin.
    using B = xsimd::batch<double, simd::Best>;
    const std::size_t n = logits.size();
    dist_.resize(n + B::size);
    for (std::size_t i = 0; i < n; ++i) dist_[i] = mx - double(logits[i]);
    weight_.resize(n + B::size);
    const B neg_inv_t(-1.0 / temperature);
    for (std::size_t i = 0; i < n; i += B::size)
      xsimd::exp(B::load_unaligned(&dist_[i]) * neg_inv_t).store_unaligned(&weight_[i]);
    for (std::size_t i = 0; i < n; ++i) {
      const double d = dist_[i];
      if (d / temperature <= kNegligible) mass_[ring(d, scale)] += weight_[i];  // NaN: false
    }
    return std::accumulate(mass_.begin(), mass_.end(), 0.0);
  }

  std::optional<int32_t> fast(std::span<const float> logits, const SamplingParams& p, double u) {
    float mf = -INFINITY;
    for (const float v : logits) mf = v > mf ? v : mf;
    if (!std::isfinite(mf)) return std::nullopt;  // no candidates, all -inf, or +inf: the definition decides
    const double mx = mf, temperature = p.temperature.value_or(1.0);
    std::size_t n_valid = 0;
    for (const float v : logits) n_valid += v == v;

    if (p.top_k && std::size_t(*p.top_k) < n_valid) {
      // The top k by a window below the max, widened until it holds k; then the definition on those k.
      const std::size_t k = std::size_t(*p.top_k);
      if (k > kMaxFastTopK) return std::nullopt;
      for (double window = 8.0;; window *= 4.0) {
        if (window > 4096.0) window = INFINITY;  // every non-NaN (-inf included)
        keys_.clear();
        for (std::size_t i = 0; i < logits.size(); ++i)
          if (mx - double(logits[i]) <= window) keys_.push_back(key(logits[i], i));  // NaN: false
        if (keys_.size() >= k) break;
      }
      std::partial_sort(keys_.begin(), keys_.begin() + std::ptrdiff_t(k), keys_.end());
      keys_.resize(k);
      sort_keys_into_cand();
      return after_top_k(logits, p, u);
    }

    const bool top_p = p.top_p && *p.top_p < 1.0, min_p = p.min_p && *p.min_p > 0.0;
    if (!top_p && !min_p) return draw_untruncated(logits, mx, temperature, u);

    // The prefix (in sorted order) that can hold the top-p and min-p cuts: rings up to the one where the
    // temperature-1 mass reaches top_p, and logits within -ln(min_p) (+1e-6) of the max.
    std::size_t last_ring = kRings - 1;
    double total = 0;
    if (top_p) {
      total = ring_masses(logits, mx, 1.0);
      double cum = 0;
      for (last_ring = 0; last_ring < kRings - 1; ++last_ring)
        if ((cum += mass_[last_ring]) >= (*p.top_p + 2 * kMargin) * total) break;
    }
    const double window = min_p ? -std::log(*p.min_p) + 1e-6 : INFINITY;
    keys_.clear();
    std::size_t cut_by_ring = 0;  // candidates within the min-p window left out by the ring bound
    for (std::size_t i = 0; i < logits.size(); ++i) {
      const double x = mx - double(logits[i]);
      if (!(x <= window)) continue;  // NaN too
      if (ring(x, ring_scale(1.0)) <= last_ring) keys_.push_back(key(logits[i], i));
      else ++cut_by_ring;
    }
    sort_keys_into_cand();
    std::size_t keep = cand_.size();
    bool top_p_cut = false;
    if (top_p) {
      const double lo = (*p.top_p - kMargin) * total, hi = (*p.top_p + kMargin) * total;
      double cum = 0;
      for (std::size_t i = 0; i < cand_.size(); ++i) {
        cum += std::exp(double(logits[cand_[i]]) - mx);
        if (cum >= hi) {
          keep = i + 1, top_p_cut = true;
          break;
        }
        if (cum > lo) return std::nullopt;
      }
      if (!top_p_cut && (!min_p || cut_by_ring > 0)) return std::nullopt;
    }
    if (min_p) {
      // prob_k >= min_p * prob_0 of the definition is e_k >= min_p (e_0 = 1, the sum cancels) up to roundings.
      const double mp = *p.min_p;
      std::size_t k = 1;
      for (; k < keep; ++k) {
        const double e = std::exp(double(logits[cand_[k]]) - mx);
        if (e >= mp * (1 + kMinPMargin)) continue;
        if (e <= mp * (1 - kMinPMargin)) break;
        return std::nullopt;
      }
      // All of the prefix passes: the candidates past it must fail (outside the window, not a ring cut).
      if (k == cand_.size() && !top_p_cut && cut_by_ring > 0) return std::nullopt;
      keep = k;
    }
    cand_.resize(keep);
    return draw(logits, temperature, u);
  }

  // No truncation: locate u in the mass by rings (any order within a ring), then sort only that ring.
  std::optional<int32_t> draw_untruncated(std::span<const float> logits, double mx, double temperature, double u) {
    const double total = ring_masses(logits, mx, temperature);
    const double t = u * total, margin = kMargin * total;
    double before = 0;
    std::size_t r = 0;
    for (; r < kRings - 1; ++r) {
      if (t < before + mass_[r]) break;
      before += mass_[r];
    }
    if (r == kRings - 1 || t < before + margin || t > before + mass_[r] - margin) return std::nullopt;
    keys_.clear();
    const double scale = ring_scale(temperature);
    for (std::size_t i = 0; i < logits.size(); ++i) {
      const double d = mx - double(logits[i]), x = d / temperature;
      if (x <= kNegligible && ring(d, scale) == r) keys_.push_back(key(logits[i], i));
    }
    sort_keys_into_cand();
    double cum = before;
    for (const int32_t id : cand_) {
      cum += std::exp((double(logits[id]) - mx) / temperature);
      if (t < cum - margin) return id;
      if (t < cum + margin) return std::nullopt;
    }
    return std::nullopt;
  }

  std::vector<int32_t> cand_;
  std::vector<double> prob_;
  std::vector<uint64_t> keys_;
  std::vector<double> mass_;
  std::vector<double> dist_, weight_;  // [n_vocab + one batch]: max - logit, exp(-(max - logit) / T)
};

}  // namespace pp
