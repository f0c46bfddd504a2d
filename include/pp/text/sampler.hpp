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
// The fast path reaches the same token without sorting the vocabulary or a softmax over it. Every pass
// over the logits is vectorised (xsimd, pp/kernels/simd.hpp); buffers live in the Sampler; x denotes
// (max - logit) / T, computed in f32 (monotone in the logit, so any x-threshold splits the sorted order
// into a prefix and the rest).
// * One pass: the max, the count of non-NaN logits, the smallest finite one (argmax: the max, then its first
//   index).
// * top_k < candidates (k <= 8192): one pass counts the logits within 3, 6, 10, 16 of the max; those of the
//   smallest window holding k are collected, partially sorted, and the definition runs on those k.
// * min_p: the logits within -ln(min_p) of the max (window widened past f32 rounding) are collected and
//   sorted; everything outside fails min-p by far. A top-p cut, if any, is found in them by exact f64 sums
//   against top_p * total; the definition then draws from what is kept.
// * Untruncated and top-p: the total weight E = sum e^-x in one f32 pass (a Cody-Waite exp, each weight
//   widened to f64 before it is summed). The "head" (weights >= E / 4096: at most 4096 candidates) is
//   collected, sorted, and its exact f64 weights cumulated: a draw (u * E) or a top-p cut (top_p * E) that
//   falls inside it is decided there; with a top-p cut past the head (T = 1) the draw is still decided
//   there when its whole possible interval [u top_p E, u (top_p E + max tail weight)] is inside one head
//   candidate's. Only the total's error enters these decisions: the margin is eps_f32 * E, with
//     eps_f32 = 2^-24 (k R + kExpUlps) + n 2^-50,   R = 1.1354 (ln n + 2),
//   k = 1 (x = fl(max - l)) or 3 (with 1/T and the product rounded), kExpUlps = 8 (the f32 exp's error is
//   1.32 units at most over every float in [0, 64]; the tests check half the bound on each build), and
//   sum e x <= R E (elements with x <= L = ln n + 2 give at most L E, the rest at most n L e^-L = 0.135 L).
//   For 128256 candidates at T = 1 that is 1.4e-6 of E.
// * Otherwise (the draw or the cut in the tail, or too near a head boundary): f64 weights (a degree-12
//   exp, 3.3 units of 2^-53 measured, 8 assumed) summed below 8 thresholds of x (1, 2, 4, ..., 16; or
//   the finite range in 8 equal parts when it is below 16) in one pass; the bin holding the target is
//   collected and split by the same sums over its members (their range in 8 parts, so each level has fewer
//   members) until at most 32 are left, which are sorted and walked with exact weights. Each decision
//   compares a sum of another order with the target and is taken only more than
//     margin = (2.01 eps + n 2^-50) E,   eps = 2^-53 (3.003 R + 8) + n 2^-50   (1.7e-10 of E at 128256)
//   from its boundary; n 2^-50 E covers the definition's own roundings (its sums in sorted order, the
//   normalisations), the f64 lane sums and the weights above x = 64 that are left out (n e^-64).
// Within a margin, for +-inf maxima, T whose f32 reciprocal is not normal, top_k > 8192 or fewer than 64
// logits, the definition itself runs. Cost at 128256 candidates: docs/PERFORMANCE.md, "Sampling".
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
#include <utility>
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

namespace detail {
using SA = simd::Best;
using SF = xsimd::batch<float, SA>;
using SD = xsimd::batch<double, SA>;
inline constexpr std::size_t kSW = SF::size;

// Over the logits: the largest non-NaN one (-inf when there is none) and the number of non-NaN ones; one
// vectorised pass (max(v, m) is m when v is NaN, as `v > m ? v : m`: simd::max_x86).
struct LogitStats {
  float max;
  std::size_t count;
};
inline LogitStats max_count(std::span<const float> l) {
  const std::size_t n = l.size(), nv = n / kSW * kSW;
  SF m0(-INFINITY), m1 = m0;
  std::size_t count = 0;
  std::size_t i = 0;
  for (; i + 2 * kSW <= nv; i += 2 * kSW) {
    const SF a = SF::load_unaligned(&l[i]), b = SF::load_unaligned(&l[i + kSW]);
    m0 = simd::max_x86<SA>(a, m0), m1 = simd::max_x86<SA>(b, m1);
    count += std::size_t(std::popcount(simd::bitmask<SA>(a == a))) + std::size_t(std::popcount(simd::bitmask<SA>(b == b)));
  }
  for (; i < nv; i += kSW) {
    const SF a = SF::load_unaligned(&l[i]);
    m0 = simd::max_x86<SA>(a, m0), count += std::size_t(std::popcount(simd::bitmask<SA>(a == a)));
  }
  alignas(64) float mm[kSW];
  xsimd::max(m1, m0).store_aligned(mm);
  LogitStats r{-INFINITY, count};
  for (const float v : mm) r.max = v > r.max ? v : r.max;
  for (; i < n; ++i) r.max = l[i] > r.max ? l[i] : r.max, r.count += l[i] == l[i];
  return r;
}
// The smallest finite logit (+inf when there is none).
inline float min_finite(std::span<const float> l) {
  const std::size_t n = l.size(), nv = n / kSW * kSW;
  const SF inf(INFINITY), ninf(-INFINITY);
  SF m0 = inf;
  std::size_t i = 0;
  for (; i < nv; i += kSW) {
    const SF a = SF::load_unaligned(&l[i]);
    m0 = simd::min_x86<SA>(xsimd::select(a == ninf, inf, a), m0);  // NaN: m0
  }
  alignas(64) float mm[kSW];
  m0.store_aligned(mm);
  float r = INFINITY;
  for (const float v : mm) r = v < r ? v : r;
  for (; i < n; ++i)
    if (l[i] < r && l[i] != -INFINITY) r = l[i];
  return r;
}

// e^-x in float for x >= 0 (0 above 64 and for NaN): Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, a
// degree-7 Taylor polynomial of e^-r, and 2^-n into the exponent. Relative error at most kExpUlps * 2^-24
// against e^-x of the float x itself (measured over every float in [0, 64]: 1.6 units with FMA; the
// tests check a dense sample on each build, FMA or not).
inline constexpr float kMaxX = 64.0f;
inline constexpr double kExpUlps = 8.0;
template <class A>
inline xsimd::batch<float, A> exp_neg(const xsimd::batch<float, A>& x) {
  using F = xsimd::batch<float, A>;
  using I = xsimd::batch<int32_t, A>;
  const F xc = xsimd::min(x, F(kMaxX));
  const F n = xsimd::nearbyint(xc * F(1.44269504088896341f));
  F r = simd::fma<A>(-n, F(0.693145751953125f), xc);  // n * ln2_hi exact (n < 2^7, ln2_hi: 16 bits)
  r = simd::fma<A>(-n, F(1.428606820309417232e-6f), r);
  const F y = -r;
  F p(1.f / 5040.f);
  p = simd::fma<A>(p, y, F(1.f / 720.f));
  p = simd::fma<A>(p, y, F(1.f / 120.f));
  p = simd::fma<A>(p, y, F(1.f / 24.f));
  p = simd::fma<A>(p, y, F(1.f / 6.f));
  p = simd::fma<A>(p, y, F(0.5f));
  p = simd::fma<A>(p, y, F(1.f));
  p = simd::fma<A>(p, y, F(1.f));
  const I e = xsimd::bitwise_cast<I>(p) - (xsimd::to_int(n) << 23);
  return xsimd::select(x <= F(kMaxX), xsimd::bitwise_cast<F>(e), F(0.f));
}

// e^-x in f64 for x >= 0 (0 above 64 and for NaN): the same reduction, a degree-12 Taylor polynomial
// (remainder < 2.5e-16 relative at |r| = ln2/2). Relative error at most kExpUlpsD * 2^-53 (the tests
// check a dense sample against long double).
inline constexpr double kExpUlpsD = 8.0;
template <class A>
inline xsimd::batch<double, A> exp_neg_d(const xsimd::batch<double, A>& x) {
  using D = xsimd::batch<double, A>;
  using I = xsimd::batch<int64_t, A>;
  const D xc = xsimd::min(x, D(double(kMaxX)));
  const D n = xsimd::nearbyint(xc * D(1.4426950408889634074));
  D r = simd::fma<A>(-n, D(6.93147180369123816490e-01), xc);  // ln2_hi: 32 bits, n * ln2_hi exact
  r = simd::fma<A>(-n, D(1.90821492927058770002e-10), r);
  const D y = -r;
  constexpr double c[13] = {1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
                            1.0 / 5040,      1.0 / 720,      1.0 / 120,     1.0 / 24,     1.0 / 6,
                            0.5,             1.0,            1.0};
  D p(c[0]);
  for (int k = 1; k < 13; ++k) p = simd::fma<A>(p, y, D(c[k]));
  const I e = xsimd::bitwise_cast<I>(p) - (xsimd::to_int(n) << 52);
  return xsimd::select(x <= D(double(kMaxX)), xsimd::bitwise_cast<D>(e), D(0.0));
}
}  // namespace detail

// Index of the largest logit; the lowest index wins ties; NaNs are never chosen (unless all are NaN: 0).
// Two passes: the max (vectorised; NaN never wins `v > m`), then its first index.
inline int32_t argmax(std::span<const float> logits) {
  using detail::SF, detail::kSW;
  const float m = detail::max_count(logits).max;
  const std::size_t n = logits.size();
  std::size_t i = 0;
  for (; i + kSW <= n; i += kSW)
    if (const uint32_t b = simd::bitmask(SF::load_unaligned(&logits[i]) == SF(m)))
      return int32_t(i + std::size_t(std::countr_zero(b)));
  for (; i < n; ++i)
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

  // --- The fast path: the same draw, or nullopt when a decision is within the margin of its boundary. ---
  using SF = detail::SF;
  using SD = detail::SD;
  static constexpr std::size_t W = detail::kSW;
  static constexpr std::size_t kMinFast = 64;           // fewer candidates: the definition (cheap there)
  static constexpr double kMinPMargin = 1e-12;          // relative, for e_k vs min_p (4 roundings apart at most)
  static constexpr std::size_t kMaxFastTopK = 8192;
  static constexpr double kHead = 0x1p-12;             // head: weight >= kHead * total
  static constexpr std::size_t kLeaf = 32;              // members of a bin walked one by one
  static constexpr int kBins = 8;                       // thresholds a pass sums below
  // Level-1 thresholds of x = (max - logit) / T; the last bin is [16, inf).
  static constexpr float kThresholds[kBins] = {1.f, 2.f, 4.f, 6.f, 8.f, 10.f, 12.f, 16.f};
  // Windows of max - logit for top-k (counted in one pass; the smallest holding k is collected).
  static constexpr int kWindows = 4;
  static constexpr float kTopKWindows[kWindows] = {3.f, 6.f, 10.f, 16.f};

  // x of logits: fl(fl(mx - l) * s), or fl(mx - l) at T = 1; monotone in l, so any x-threshold splits the
  // sorted order into a prefix and the rest. NaN logits give NaN (below and above no threshold).
  struct XOf {
    SF mx, s;
    bool scaled;
    SF operator()(const SF& l) const { return scaled ? (mx - l) * s : mx - l; }
  };

  // The error bound of the sums of f64 weights, relative to the exact total E = sum of e^-x_i over the set
  // (the max in it, e = 1). Each weight: |w - e| <= e (3 x 2^-53 + kExpUlpsD 2^-53) (x = (mx - l) * (1/T):
  // three roundings); sum e x <= R E with R = 1.1354 (ln n + 2) (elements with x <= L = ln n + 2 give at
  // most L E; the rest at most n L e^-L = 0.1354 L <= 0.1354 L E, as e^-x x falls for x > 1 and E >= 1).
  // The f64 lane sums (n 2^-53 of their terms at most), the adds of parts and the weights left out above
  // kMaxX (n e^-64) are inside the n 2^-50 term. A sum over any part of the set, or over several disjoint
  // parts, is within eps * E of its exact value.
  static double sum_eps(std::size_t n) {
    const double R = 1.1354 * (std::log(double(n)) + 2.0);
    return 0x1p-53 * (3.003 * R + detail::kExpUlpsD) + double(n) * 0x1p-50;
  }
  // The margin of every decision against sums of weights: the fast target (u or top_p times the fast
  // total) and the fast sum it is compared with are each within eps * E of their exact values, and the
  // definition's own roundings (its sums in another order, the normalisations) are below n 2^-50 of E.
  static double margin_of(std::size_t n, double total) {
    return (2.01 * sum_eps(n) + double(n) * 0x1p-50) * total;
  }

  // sums[j] = sum of w over x < thr[j] (j < kBins), sums[kBins] = sum of w; load(v, x, w_lo, w_hi) gives
  // vector v's x (f32, compared with the thresholds) and its f64 weights (widen()'s halves).
  template <class Load>
  static void masses(std::size_t n_vec, Load load, const float* thr, double* sums) {
    SD lo[kBins + 1], hi[kBins + 1];
    for (int j = 0; j <= kBins; ++j) lo[j] = SD(0.0), hi[j] = SD(0.0);
    SF th[kBins];
    for (int j = 0; j < kBins; ++j) th[j] = SF(thr[j]);
    for (std::size_t v = 0; v < n_vec; ++v) {
      SF x;
      SD wl, wh;
      load(v, x, wl, wh);
      lo[kBins] += wl, hi[kBins] += wh;
      for (int j = 0; j < kBins; ++j) simd::add_where<detail::SA>(x < th[j], wl, wh, lo[j], hi[j]);
    }
    for (int j = 0; j <= kBins; ++j) sums[j] = xsimd::hadd(lo[j] + hi[j]);
  }
  // The level-1 loader: x of the logits, weights e^-((mx - l) / T) in f64.
  auto logit_loader(std::span<const float> logits, const XOf& xof, double mx, double temperature) const {
    const SD vmx(mx), s(1.0 / temperature);
    const bool scaled = temperature != 1.0;
    return [this, logits, xof, vmx, s, scaled](std::size_t v, SF& x, SD& wl, SD& wh) {
      const SF l = logit_vec(logits, v);
      x = xof(l);
      SD ll, lh;
      simd::widen<detail::SA>(l, ll, lh);
      ll = vmx - ll, lh = vmx - lh;
      if (scaled) ll *= s, lh *= s;
      wl = detail::exp_neg_d<detail::SA>(ll), wh = detail::exp_neg_d<detail::SA>(lh);
    };
  }

  // The first try, in f32: the total of the weights exp_neg(f32 x), each widened to f64 and summed there.
  // Each weight is within e (k x 2^-24 + kExpUlps 2^-24) of e = e^-x (k = 1: x = fl(mx - l); k = 3 with
  // the 1/T product), so with R as above the total is within eps_f32 * E.
  static double sum_eps_f32(std::size_t n, bool scaled) {
    const double R = 1.1354 * (std::log(double(n)) + 2.0);
    return 0x1p-24 * ((scaled ? 3.0 : 1.0) * 1.001 * R + detail::kExpUlps) + double(n) * 0x1p-50;
  }
  double total_f32(std::span<const float> logits, const XOf& xof) {
    const std::size_t nv = prepare_tail(logits);
    SD a(0.0), b(0.0), c(0.0), d(0.0);
    std::size_t v = 0;
    for (; v + 2 <= nv; v += 2) {
      SD l, h;
      simd::widen<detail::SA>(detail::exp_neg<detail::SA>(xof(logit_vec(logits, v))), l, h);
      a += l, b += h;
      simd::widen<detail::SA>(detail::exp_neg<detail::SA>(xof(logit_vec(logits, v + 1))), l, h);
      c += l, d += h;
    }
    for (; v < nv; ++v) {
      SD l, h;
      simd::widen<detail::SA>(detail::exp_neg<detail::SA>(xof(logit_vec(logits, v))), l, h);
      a += l, b += h;
    }
    return xsimd::hadd((a + b) + (c + d));
  }

  // The logits as whole vectors: the last partial one from tail_ (NaN padded).
  std::size_t prepare_tail(std::span<const float> logits) {
    const std::size_t n = logits.size(), full = n / W;
    for (std::size_t k = 0; k < W; ++k) tail_[k] = full * W + k < n ? logits[full * W + k] : NAN;
    return (n + W - 1) / W;
  }
  SF logit_vec(std::span<const float> logits, std::size_t v) const {
    return (v + 1) * W <= logits.size() ? SF::load_unaligned(&logits[v * W]) : SF::load_unaligned(tail_);
  }
  // Calls f(id, x) for each logit with lo <= x < hi (lo <= x <= hi when `closed`), in id order.
  template <class F>
  void each_in(std::span<const float> logits, const XOf& xof, float lo, float hi, bool closed, F f) {
    const std::size_t nv = prepare_tail(logits);
    const SF vlo(lo), vhi(hi);
    alignas(64) float xs[W];
    for (std::size_t v = 0; v < nv; ++v) {
      const SF x = xof(logit_vec(logits, v));
      uint32_t b = simd::bitmask<detail::SA>((x >= vlo) & (closed ? x <= vhi : x < vhi));
      if (!b) continue;
      x.store_aligned(xs);
      for (; b; b &= b - 1) {
        const std::size_t k = std::size_t(std::countr_zero(b));
        f(v * W + k, xs[k]);
      }
    }
  }

  // The candidate at which the cumulative weight e^-x in the sorted order passes t: {id, cumulative weight
  // through it}. sums1: masses() of the candidates below thr1_ (level 1); the bin holding t is collected
  // and narrowed, then walked with exact weights. nullopt when t is within `margin` of a boundary it is
  // compared with.
  std::optional<std::pair<int32_t, double>> locate(std::span<const float> logits, const XOf& xof, double mx,
                                                   double temperature, const double* sums1, double t,
                                                   double margin) {
    int j = 0;
    while (j <= kBins && !(t < sums1[j])) ++j;
    if (j > kBins) return std::nullopt;
    double base = j ? sums1[j - 1] : 0.0;
    if (t < base + margin || t > sums1[j] - margin) return std::nullopt;
    float lo = j ? thr1_[j - 1] : 0.f, hi = j < kBins ? thr1_[j] : INFINITY;
    xs_.clear(), ids_.clear();
    each_in(logits, xof, lo, hi, false, [&](std::size_t id, float x) { xs_.push_back(x), ids_.push_back(int32_t(id)); });
    bool weighed = false;  // wd_ holds the members' f64 weights
    for (int depth = 0; ids_.size() > kLeaf && depth < 48; ++depth) {
      // Split the members' range [min x, max x] in kBins, the last part up to hi: the first part holds the
      // smallest member and the last the largest, so each level has fewer members.
      float xmin = INFINITY, xmax = -INFINITY;
      for (const float x : xs_) xmin = x < xmin ? x : xmin, xmax = x > xmax ? x : xmax;  // members are finite
      float thr[kBins];
      bool ok = xmax > xmin;
      for (int k = 0; k + 1 < kBins; ++k) {
        thr[k] = xmin + (xmax - xmin) * (float(k + 1) / float(kBins));
        ok = ok && thr[k] > (k ? thr[k - 1] : xmin) && thr[k] <= xmax;
      }
      thr[kBins - 1] = hi;
      if (!ok) break;  // no room to split (ties): walk them all
      const std::size_t m = xs_.size(), padded = (m + W - 1) / W * W;
      xs_.resize(padded, INFINITY);
      if (!weighed) {  // e^-((mx - l) / T) of the members, as logit_loader() (x > kMaxX: 0, as there)
        wd_.resize(padded);
        const double s = 1.0 / temperature;
        for (std::size_t i = 0; i < m; ++i) {
          const double x = mx - double(logits[std::size_t(ids_[i])]);
          wd_[i] = temperature != 1.0 ? x * s : x;
        }
        for (std::size_t i = m; i < padded; ++i) wd_[i] = INFINITY;
        for (std::size_t i = 0; i < padded; i += W / 2)
          detail::exp_neg_d<detail::SA>(SD::load_unaligned(&wd_[i])).store_unaligned(&wd_[i]);
        weighed = true;
      }
      wd_.resize(padded, 0.0);
      double s[kBins + 1];
      masses(padded / W, [&](std::size_t v, SF& x, SD& wl, SD& wh) {
        x = SF::load_unaligned(&xs_[v * W]);
        wl = SD::load_unaligned(&wd_[v * W]), wh = SD::load_unaligned(&wd_[v * W + W / 2]);
      }, thr, s);
      int k = 0;
      while (k < kBins && !(t < base + s[k])) ++k;
      if (k == kBins) return std::nullopt;  // past the members' mass (their sum disagrees with the level above)
      const double b = k ? base + s[k - 1] : base;
      if (t < b + margin || t > base + s[k] - margin) return std::nullopt;
      const float nlo = k ? thr[k - 1] : lo, nhi = thr[k];
      std::size_t w = 0;
      for (std::size_t i = 0; i < m; ++i) {  // branch-free: members fall either side unpredictably
        const float x = xs_[i];
        xs_[w] = x, wd_[w] = wd_[i], ids_[w] = ids_[i];
        w += std::size_t(x >= nlo) & std::size_t(x < nhi);
      }
      xs_.resize(w), wd_.resize(w), ids_.resize(w);
      base = b, lo = nlo, hi = nhi;
    }
    keys_.clear();
    for (const int32_t id : ids_) keys_.push_back(key(logits[std::size_t(id)], std::size_t(id)));
    sort_keys_into_cand();
    double cum = base;
    for (const int32_t id : cand_) {
      cum += std::exp((double(logits[std::size_t(id)]) - mx) / temperature);
      if (t < cum - margin) return std::pair{id, cum};
      if (t < cum + margin) return std::nullopt;
    }
    return std::nullopt;
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
  // keys_ of the logits with max - logit <= window (f32; a prefix of the sorted order), sorted into cand_.
  void collect_window(std::span<const float> logits, float mf, float window) {
    keys_.clear();
    const XOf d{SF(mf), SF(1.f), false};
    each_in(logits, d, -INFINITY, window, true, [&](std::size_t id, float) { keys_.push_back(key(logits[id], id)); });
  }

  // No truncation, f64 sums: u * total located among all candidates at the temperature.
  std::optional<int32_t> precise_untruncated(std::span<const float> logits, const XOf& xt, double mx,
                                             double temperature, std::size_t n_valid, double u) {
    double sums[kBins + 1];
    masses(prepare_tail(logits), logit_loader(logits, xt, mx, temperature), thr1_, sums);
    const double total = sums[kBins];
    const auto r = locate(logits, xt, mx, temperature, sums, u * total, margin_of(n_valid, total));
    if (!r) return std::nullopt;
    return r->first;
  }

  std::optional<int32_t> fast(std::span<const float> logits, const SamplingParams& p, double u) {
    const std::size_t n = logits.size();
    if (n < kMinFast) return std::nullopt;
    const auto stats = detail::max_count(logits);
    const float mf = stats.max;
    const std::size_t n_valid = stats.count;
    if (!std::isfinite(mf)) return std::nullopt;  // no candidates, all -inf, or +inf: the definition decides
    const double mx = mf, temperature = p.temperature.value_or(1.0);

    if (p.top_k && std::size_t(*p.top_k) < n_valid) {
      // The top k from the smallest window below the max that holds k; then the definition on those k.
      const std::size_t k = std::size_t(*p.top_k);
      if (k > kMaxFastTopK) return std::nullopt;
      const std::size_t nv = prepare_tail(logits);
      std::size_t cnt[kWindows] = {};
      SF th[kWindows];
      for (int j = 0; j < kWindows; ++j) th[j] = SF(kTopKWindows[j]);
      const SF vmx(mf);
      for (std::size_t v = 0; v < nv; ++v) {
        const SF d = vmx - logit_vec(logits, v);
        for (int j = 0; j < kWindows; ++j) cnt[j] += std::size_t(std::popcount(simd::bitmask<detail::SA>(d <= th[j])));
      }
      float window = INFINITY;  // every non-NaN (-inf included)
      for (int j = 0; j < kWindows; ++j)
        if (cnt[j] >= k) {
          window = kTopKWindows[j];
          break;
        }
      collect_window(logits, mf, window);
      std::partial_sort(keys_.begin(), keys_.begin() + std::ptrdiff_t(k), keys_.end());
      keys_.resize(k);
      sort_keys_into_cand();
      return after_top_k(logits, p, u);
    }

    const bool top_p = p.top_p && *p.top_p < 1.0, min_p = p.min_p && *p.min_p > 0.0;
    const float inv_t = float(1.0 / temperature);
    if (!(inv_t > 0.f && std::isnormal(inv_t))) return std::nullopt;
    const XOf x1{SF(mf), SF(1.f), false}, xt{SF(mf), SF(inv_t), temperature != 1.0};
    // Level-1 thresholds: kThresholds, or when every finite x at the temperature is below 16, that range
    // in kBins equal parts (the weights are then within e^16 of each other: the mass is spread).
    const auto set_thresholds = [&](double temp) {
      const double range = (double(mf) - double(detail::min_finite(logits))) / temp;
      for (int j = 0; j < kBins; ++j)
        thr1_[j] = range < 16.0 ? float(range * double(j + 1) / kBins) * (1 + 0x1p-20f) : kThresholds[j];
    };
    // The total weight in f32 (temperature 1 for top-p and min-p, else the temperature): every decision
    // against it alone is taken only more than `margin` from its boundary.
    const XOf& xw = top_p || min_p ? x1 : xt;
    const double total = top_p || !min_p ? total_f32(logits, xw) : 0.0;  // min-p alone: not used
    const double margin = (1.01 * sum_eps_f32(n_valid, xw.scaled) + double(n_valid) * 0x1p-50) * total;
    if (min_p) {
      // The candidates within -ln(min_p) of the max (f32 max - logit is within 2^-23 of it relative: the
      // window is wider than that plus 1e-6), sorted: every candidate past them fails min-p by far.
      const double mp = *p.min_p, xmp = -std::log(mp);
      collect_window(logits, mf, float(xmp * (1 + 0x1p-21) + 1e-6));
      sort_keys_into_cand();
      // Top-p first: its cut within the window (exact sums against p * total), or past it.
      std::size_t keep = cand_.size();
      if (top_p) {
        // The cut's index in the window (its size: past it), or nullopt within the margin.
        const auto cut = [&](double tot, double mar) -> std::optional<std::size_t> {
          const double lo = *p.top_p * tot - mar, hi = *p.top_p * tot + mar;
          double cum = 0;
          for (std::size_t i = 0; i < cand_.size(); ++i) {
            cum += std::exp(double(logits[std::size_t(cand_[i])]) - mx);
            if (cum > hi) return i;
            if (cum >= lo) return std::nullopt;
          }
          return cand_.size();
        };
        auto i = cut(total, margin);
        if (!i) {  // the f64 total
          set_thresholds(1.0);
          double sums[kBins + 1];
          masses(prepare_tail(logits), logit_loader(logits, x1, mx, 1.0), thr1_, sums);
          i = cut(sums[kBins], margin_of(n_valid, sums[kBins]));
          if (!i) return std::nullopt;
        }
        if (*i < cand_.size()) keep = *i + 1;
      }
      // prob_k >= min_p * prob_0 of the definition is e_k >= min_p (e_0 = 1, the sum cancels) up to roundings.
      std::size_t k = 1;
      for (; k < keep; ++k) {
        const double e = std::exp(double(logits[std::size_t(cand_[k])]) - mx);
        if (e >= mp * (1 + kMinPMargin)) continue;
        if (e <= mp * (1 - kMinPMargin)) break;
        return std::nullopt;
      }
      cand_.resize(k);
      return draw(logits, temperature, u);
    }

    // The head: candidates with weight >= kHead * total (x <= ln(1 / (kHead * total))), at most 1 / kHead of
    // them, sorted; every other candidate weighs less than w_tail (its f32 x is within 3 2^-24 of x).
    const float xh = float(std::log(1.0 / (kHead * total)));
    const double w_tail = xh > 0.f ? std::exp(-double(xh) * (1 - 0x1p-22)) : 1.0;
    keys_.clear();
    each_in(logits, xw, -INFINITY, xh, true, [&](std::size_t id, float) { keys_.push_back(key(logits[id], id)); });
    sort_keys_into_cand();
    const double temp_w = top_p ? 1.0 : temperature;  // the head's exact weights e^((l - mx) / temp_w)
    prob_.resize(cand_.size());
    for (std::size_t i = 0; i < cand_.size(); ++i)
      prob_[i] = std::exp((double(logits[std::size_t(cand_[i])]) - mx) / temp_w);
    // The first head candidate whose cumulative weight passes every t in [t_lo, t_hi] (exact sums from 0,
    // so only the total's error counts: `margin`); -1: past the head; -2: too close to a boundary.
    auto in_head = [&](double t_lo, double t_hi) -> std::ptrdiff_t {
      double cum = 0;
      for (std::size_t i = 0; i < cand_.size(); ++i) {
        cum += prob_[i];
        if (t_hi < cum - margin) return std::ptrdiff_t(i);
        if (t_lo < cum + margin) return -2;
      }
      return -1;
    };
    if (!top_p) {  // no truncation: u * total in the head, or the f64 sums
      if (const auto i = in_head(u * total, u * total); i >= 0) return cand_[std::size_t(i)];
      set_thresholds(temperature);
      return precise_untruncated(logits, xt, mx, temperature, n_valid, u);
    }
    // Top-p: its cut c in the head, then the definition's draw from the prefix through c.
    const double target = *p.top_p * total;
    if (const auto c = in_head(target, target); c >= 0) {
      cand_.resize(std::size_t(c) + 1);
      return draw(logits, temperature, u);
    } else if (c == -1 && temperature == 1.0) {
      // c is past the head: the kept mass is in [top_p E, top_p E + w_tail), so the draw's t is in
      // [u top_p E, u (top_p E + w_tail)); decided here when that interval is inside a head candidate's.
      const auto i = in_head(u * target, u * (target + w_tail));
      if (i >= 0) return cand_[std::size_t(i)];
    }
    // The f64 sums: the cut c, then the draw.
    set_thresholds(1.0);
    double sums[kBins + 1];
    masses(prepare_tail(logits), logit_loader(logits, x1, mx, 1.0), thr1_, sums);
    const double total64 = sums[kBins], margin64 = margin_of(n_valid, total64);
    const auto c = locate(logits, x1, mx, 1.0, sums, *p.top_p * total64, margin64);
    if (!c) return std::nullopt;
    if (temperature == 1.0) {
      const auto r = locate(logits, x1, mx, 1.0, sums, u * c->second, margin64);
      if (!r) return std::nullopt;
      return r->first;
    }
    const float lc = logits[std::size_t(c->first)];
    const uint64_t kc = key(lc, std::size_t(c->first));
    collect_window(logits, mf, mf - lc);  // a superset of the prefix through c
    std::erase_if(keys_, [&](uint64_t k) { return k > kc; });
    sort_keys_into_cand();
    return draw(logits, temperature, u);
  }

  std::vector<int32_t> cand_;
  std::vector<double> prob_;
  std::vector<uint64_t> keys_;
  std::vector<float> xs_;      // members of the bin being narrowed: x, padded with +inf to whole vectors
  std::vector<double> wd_;     // their f64 weights (once narrowed below level 1)
  std::vector<int32_t> ids_;   // and their ids
  float tail_[W];         // the last partial vector of logits, NaN padded
  float thr1_[kBins] = {}; // level-1 thresholds of x
};

}  // namespace pp
