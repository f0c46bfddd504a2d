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

// STREAM-style triad a = b + s * c over 3 x 128 MiB with `threads` threads: the decode ceiling (GB/s).
inline double bandwidth_gbs(unsigned threads) {
  const std::size_t n = (128u << 20) / sizeof(float);
  AnonymousRegion ra(n * 4), rb(n * 4), rc(n * 4);
  float* a = reinterpret_cast<float*>(ra.data());
  float* b = reinterpret_cast<float*>(rb.data());
  float* c = reinterpret_cast<float*>(rc.data());
  ThreadPool pool(threads);
  pool.parallel_for(n, [&](std::size_t s, std::size_t e, unsigned) {
    for (std::size_t i = s; i < e; ++i) a[i] = 0.f, b[i] = 1.f, c[i] = 2.f;
  });
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(n, [&](std::size_t s, std::size_t e, unsigned) {
      for (std::size_t i = s; i < e; ++i) a[i] = b[i] + 3.f * c[i];
    });
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 3.0 * double(n) * 4 / dt / 1e9);
  }
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
