// pp_bench shared pieces: the bandwidth probe and synthetic 1B-shaped models made on demand.
#pragma once

#include <pp/core/anonymous_region.hpp>
#include <pp/core/thread_pool.hpp>

#include "../tools/common/synth.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace pp::bench {

// STREAM-style triad a = b + s * c over 3 x 128 MiB with a pool of `threads` threads; one pass at a
// time, so a benchmark can interleave passes with its own work and compare the two under the same load.
class Triad {
 public:
  explicit Triad(unsigned threads) : pool_(threads), a_(kN * 4), b_(kN * 4), c_(kN * 4) {
    pool_.parallel_for(kN, [&](std::size_t s, std::size_t e, unsigned) {
      for (std::size_t i = s; i < e; ++i) a()[i] = 0.f, b()[i] = 1.f, c()[i] = 2.f;
    });
  }
  // One pass; its bandwidth in GB/s (3 x 4 bytes an element, as STREAM counts).
  double pass() {
    const auto t0 = std::chrono::steady_clock::now();
    pool_.parallel_for(kN, [&](std::size_t s, std::size_t e, unsigned) {
      float *x = a(), *y = b(), *z = c();
      for (std::size_t i = s; i < e; ++i) x[i] = y[i] + 3.f * z[i];
    });
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 3.0 * double(kN) * 4 / dt / 1e9;
  }

 private:
  static constexpr std::size_t kN = (128u << 20) / sizeof(float);
  float* a() { return reinterpret_cast<float*>(a_.data()); }
  float* b() { return reinterpret_cast<float*>(b_.data()); }
  float* c() { return reinterpret_cast<float*>(c_.data()); }
  ThreadPool pool_;
  AnonymousRegion a_, b_, c_;
};

// The triad's best of 5 passes (STREAM's convention): the ceiling quoted at the top of a report.
inline double bandwidth_gbs(unsigned threads) {
  Triad t(threads);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) best = std::max(best, t.pass());
  return best;
}

// This process's resident set (VmRSS), MiB.
inline double rss_mb() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  double kb = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "VmRSS: %lf kB", &kb) == 1) break;
  std::fclose(f);
  return kb / 1024.0;
}

inline std::filesystem::path models_dir() {
  const char* d = std::getenv("PP_BENCH_MODELS");
  return d ? std::filesystem::path(d) : std::filesystem::path("models");
}

// A Llama-3.2-1B-shaped synthetic model of `dtype` ("bf16", "f16", "q8_0", "q4_k_m", ...), generated when missing.
inline std::string model_1b(const std::string& dtype) {
  const auto path = models_dir() / ("synth-llama3.2-1b-" + dtype + ".gguf");
  if (!std::filesystem::exists(path)) {
    std::filesystem::create_directories(models_dir());
    synth::Spec s = synth::llama32_1b();
    synth::set_file_type(s, dtype);
    std::fprintf(stderr, "pp_bench: generating %s ...\n", path.c_str());
    synth::write(s, path.string());
  }
  return path.string();
}

}  // namespace pp::bench
