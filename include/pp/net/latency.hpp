// Latency statistics for pp_node's report, computed exactly as the Python prototype does.
#pragma once

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <vector>

namespace pp::net {

// Python's round() on a double: nearest integer, ties to even.
inline double round_half_even(double x) {
  const double lo = std::floor(x);
  const double frac = x - lo;
  if (frac > 0.5) return lo + 1;
  if (frac < 0.5) return lo;
  return std::fmod(lo, 2.0) == 0.0 ? lo : lo + 1;
}

// Percentile p (0..100) of the samples: s[min(len-1, round_half_even(p/100 * (len-1)))] of the
// sorted samples, the prototype's pctl(). Samples must not be empty.
inline double percentile(std::vector<double> samples, double p) {
  assert(!samples.empty());
  std::sort(samples.begin(), samples.end());
  const std::size_t last = samples.size() - 1;
  const double rank = round_half_even((p / 100.0) * static_cast<double>(last));
  const std::size_t i = rank <= 0 ? 0 : std::min(last, static_cast<std::size_t>(rank));
  return samples[i];
}

}  // namespace pp::net
