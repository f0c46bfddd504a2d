// Deadlines that follow the host. A test never waits a fixed wall-clock time sized for a fast machine: it
// acts on events (a line printed, a frame read, a process exit), and the deadline that guards each wait
// against a hang, or the slack allowed past a timeout the code under test enforces, is scaled by how
// slow this host is right now: a baseline workload timed in the same test process, never less than 1. A
// sanitized build, a slower CPU or a second busy process all show in it (the baseline runs ~4x slower
// under ASan + UBSan at -O1, the sanitized tools the contract tests spawn ~2-3x).
//
//   host_factor()       >= 1, measured once per process
//   slack(d)            d * host_factor(): for "within d of the event", e.g. timeout + slack(1s)
//   PP_TEST_TIME_SCALE  multiplies the factor (valgrind, emulation)
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace pp::test {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

namespace detail {

// Seconds for one pass of a fixed workload shaped like the tools' own work: heap allocations, strings,
// a float loop over a few hundred KiB (cache traffic, bounds-checked by ASan).
inline double baseline_pass() {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  std::vector<float> a(1 << 16), b(1 << 16);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = float(i % 251) * 0.5f, b[i] = float(i % 127) * 0.25f;
  volatile float sink = 0;
  for (int r = 0; r < 40; ++r) {
    float acc = 0;
    for (std::size_t i = 0; i < a.size(); ++i) acc += a[i] * b[(i * 7 + std::size_t(r)) & (b.size() - 1)];
    sink = sink + acc;
  }
  std::size_t total = 0;
  for (int i = 0; i < 4000; ++i) {
    std::string s = "token " + std::to_string(i) + " of the baseline";
    std::vector<uint8_t> v(s.begin(), s.end());
    total += v.size();
  }
  sink = sink + float(total);
  return std::chrono::duration<double>(clock::now() - t0).count();
}

// The baseline's median on an idle AMD EPYC Zen 5 / Xeon Sapphire Rapids core, built -O2 or -O3 without
// sanitizers (about 4 ms there): hosts at least that fast get factor 1.
inline constexpr double kReferenceSeconds = 0.004;

inline double measure_factor() {
  std::array<double, 5> t{};
  for (double& s : t) s = baseline_pass();
  std::sort(t.begin(), t.end());
  double f = std::max(1.0, t[2] / kReferenceSeconds);
  if (const char* e = std::getenv("PP_TEST_TIME_SCALE")) {
    const double m = std::atof(e);
    if (m > 0) f *= m;
  }
  return std::min(f, 50.0);
}

}  // namespace detail

// >= 1: how much longer than on a fast idle machine this process should allow for anything to happen.
inline double host_factor() {
  static const double f = [] {
    const double v = detail::measure_factor();
    std::fprintf(stderr, "[pp::test] host factor %.2f (baseline median, sanitized %s)\n", v, kSanitized ? "yes" : "no");
    return v;
  }();
  return f;
}

// `d` scaled to this host: a hang guard or the slack allowed past an enforced timeout.
template <class Rep, class Period>
std::chrono::milliseconds slack(std::chrono::duration<Rep, Period> d) {
  const double ms = std::chrono::duration<double, std::milli>(d).count() * host_factor();
  return std::chrono::milliseconds(static_cast<int64_t>(ms));
}

}  // namespace pp::test
