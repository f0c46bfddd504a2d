// The prompt tile kernels of two versions of the code in one process, alternated: the working tree's
// (pp::kernels::gemm, gemm_q8) against a base commit's (gemm_base, gemm_q8_base: headers that
// bench/ab_tiles.sh extracts from git with their namespaces renamed). On a shared host the speed of a
// whole process moves by 10-20% from one run to the next (memory placement, the neighbours' load), more
// than most kernel changes; within one process, with the two versions taking turns on the same weights,
// the same copy of x and the same scratch, an A/A run agrees to within 2% a case. Prints GFLOP/s of each
// version, new / base per case and their geometric mean, and whether the outputs differ (the tiles'
// results should not change unless a change means them to).
//
// Cases: F16 / BF16 exact tiles, BF16 fast (bf16 dot) tiles, Q8_0 int8 tiles where built, 2048 rows x
// 2048 / 8192 columns, 128 and 512 tokens, one thread, weights streamed from memory (8 copies in turn).
#include <pp/core/anonymous_region.hpp>
#include <pp/kernels/gemm.hpp>
#include <pp/kernels/gemm_base.hpp>
#include <pp/kernels/gemm_q8.hpp>
#include <pp/kernels/gemm_q8_base.hpp>
#include <pp/kernels/quant.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using A = pp::simd::Best;
namespace k_new = pp::kernels::gemm;
namespace k_base = pp::kernels::gemm_base;
namespace q_new = pp::kernels::gemm_q8;
namespace q_base = pp::kernels::gemm_q8_base;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

enum class Path { exact, fast_bf16, q8 };

struct Case {
  pp::DType type;
  Path path;
  std::size_t cols, m;
  std::string name() const {
    return std::string(pp::dtype_name(type)) + (path == Path::exact ? " exact" : path == Path::fast_bf16 ? " fast" : " tiles") +
           " 2048x" + std::to_string(cols) + " m=" + std::to_string(m);
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 8;
  std::vector<Case> cases;
  for (std::size_t cols : {2048, 8192})
    for (std::size_t m : {128, 512}) {
      cases.push_back({pp::DType::F16, Path::exact, cols, m});
      cases.push_back({pp::DType::BF16, Path::exact, cols, m});
      if (k_new::kHaveFastBf16 && k_base::kHaveFastBf16) cases.push_back({pp::DType::BF16, Path::fast_bf16, cols, m});
      if (q_new::kAvailable && q_base::kAvailable) cases.push_back({pp::DType::Q8_0, Path::q8, cols, m});
    }
  std::printf("kernels %s, %d rounds a case, one thread\n", A::name(), rounds);
  double log_sum = 0;
  for (const Case& c : cases) {
    constexpr std::size_t kRows = 2048, kCopies = 8;
    const std::size_t row_bytes = pp::row_bytes(c.type, c.cols), bytes = row_bytes * kRows;
    pp::AnonymousRegion w(bytes * kCopies);
    std::mt19937 rng(1);
    for (std::size_t i = 0; i < bytes * kCopies / 2; ++i)  // f16 / bf16 values near 1; Q8_0: scales near 1
      reinterpret_cast<uint16_t*>(w.data())[i] = uint16_t(0x3c00 ^ (rng() & 0x03ff));
    std::vector<float> x(c.m * c.cols), y_new(c.m * kRows), y_base(c.m * kRows);
    for (float& v : x) v = float(int(rng() % 2001) - 1000) / 1000.f;
    std::vector<uint8_t> xq;
    k_new::PackedX pf_new;
    k_base::PackedX pf_base;
#if PP_HAVE_Q8_TILES
    q_new::PackedX pq_new;
    q_base::PackedX pq_base;
#endif
    if (c.path == Path::q8) {
      const std::size_t rb = pp::quant::act_row_bytes(c.type, c.cols);
      xq.resize(c.m * rb);
      for (std::size_t i = 0; i < c.m; ++i)
        pp::quant::quantize_act_row(c.type, x.data() + i * c.cols, c.cols, xq.data() + i * rb);
#if PP_HAVE_Q8_TILES
      q_new::prepare(pq_new, c.m, c.cols);
      q_new::pack_blocks(xq.data(), pq_new, 0, pq_new.blocks());
      q_base::prepare(pq_base, c.m, c.cols);
      q_base::pack_blocks(xq.data(), pq_base, 0, pq_base.blocks());
#endif
    } else {
      k_new::pack(x.data(), c.m, c.cols, c.path == Path::fast_bf16, pf_new);
      k_base::pack(x.data(), c.m, c.cols, c.path == Path::fast_bf16, pf_base);
    }
    auto run = [&](bool base, std::size_t copy) {
      const pp::MatView mv{c.type, w.data() + bytes * copy, kRows, c.cols, row_bytes};
      float* y = base ? y_base.data() : y_new.data();
      switch (c.path) {
        case Path::exact:
          return base ? k_base::matmul_packed<A>(mv, pf_base, y, 0, kRows) : k_new::matmul_packed<A>(mv, pf_new, y, 0, kRows);
        case Path::fast_bf16:
#if PP_HAVE_BF16_DOT
          return base ? k_base::matmul_packed_bf16(mv, pf_base, y, 0, kRows)
                      : k_new::matmul_packed_bf16(mv, pf_new, y, 0, kRows);
#else
          return;
#endif
        case Path::q8:
#if PP_HAVE_Q8_TILES
          return base ? q_base::matmul_packed(mv, pq_base, y, 0, kRows) : q_new::matmul_packed(mv, pq_new, y, 0, kRows);
#else
          return;
#endif
      }
    };
    double t_new = 0, t_base = 0;
    std::size_t copy = 0;
    constexpr int kCalls = 4;  // per turn
    for (int r = 0; r < rounds; ++r)
      for (int turn = 0; turn < 2; ++turn) {
        const bool base = (turn ^ r) & 1;  // each version goes first in every other round
        const double t0 = now();
        for (int i = 0; i < kCalls; ++i, copy = (copy + 1) % kCopies) run(base, copy);
        (base ? t_base : t_new) += now() - t0;
      }
    run(false, 0);
    run(true, 0);
    const bool same = std::memcmp(y_new.data(), y_base.data(), y_new.size() * sizeof(float)) == 0;
    const double flop = 2.0 * kRows * double(c.cols) * double(c.m) * kCalls * rounds;
    log_sum += std::log(t_base / t_new);
    std::printf("%-28s base %6.1f  new %6.1f GFLOP/s  new/base %.3f%s\n", c.name().c_str(), flop / t_base / 1e9,
                flop / t_new / 1e9, t_base / t_new, same ? "" : "  (outputs differ)");
  }
  std::printf("geometric mean new/base %.3f over %zu cases\n", std::exp(log_sum / double(cases.size())), cases.size());
}
