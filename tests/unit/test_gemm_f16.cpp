// The fast path of F16 prompts (kernels/gemm_f16.hpp): the int16 tiles of this build's target. A dispatched
// suite (tests/meson.build): compiled once per x86-64 kernel target and run on each this CPU has, so the
// AVX2 tiles are checked on AVX-512 hosts too, against the same scheme as the VNNI ones.
#include <pp/core/dtype.hpp>
#include <pp/core/thread_pool.hpp>
#include <pp/kernels/gemm_f16.hpp>
#include <pp/kernels/matmul.hpp>

#include "../common/oracle.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace {

using pp::test::randv;
using pp::test::Stored;
using pp::test::store;

// The fast path of F16 prompts (gemm_f16.hpp: VNNI or AVX2 tiles): bit for bit the chain the header promises,
// computed here on its own from the scheme (int16 codes with power-of-two scales: activations per token
// and block of 16 values of k at 14 bits, weights per row and segment at 13 bits; exact integer block
// sums; seg = fma(sum, d_x, seg) over a segment's blocks, out = fma(seg, d_w, out) over segments), on full
// and last row blocks, partial token blocks, k off the block size and over several segments; within the
// codes' rounding of a float64 oracle; the same whatever the token count, the row range or the thread
// count (through kernels::matmul for bulk rows with fast_float); and not the exact path's result.
#if PP_HAVE_F16_TILES
struct F16Codes {
  std::vector<int64_t> codes;  // per value
  std::vector<double> scale;   // per group
};
// Codes of `n` values in groups of `group` (the last one shorter): |code| < 2^bits before rounding, clamped
// to 2^bits - 1; a group whose largest |v| is below 2^-100 has scale 0.
F16Codes f16_codes(const float* v, std::size_t n, std::size_t group, int bits) {
  F16Codes c{std::vector<int64_t>(n, 0), {}};
  for (std::size_t g0 = 0; g0 < n; g0 += group) {
    const std::size_t g1 = std::min(n, g0 + group);
    double max = 0;
    for (std::size_t i = g0; i < g1; ++i) max = std::max(max, std::abs(double(v[i])));
    if (max < 0x1p-100) {
      c.scale.push_back(0);
      continue;
    }
    int E = 0;
    std::frexp(max, &E);
    const double lim = std::ldexp(1.0, bits) - 1;
    for (std::size_t i = g0; i < g1; ++i)
      c.codes[i] = int64_t(std::clamp(std::nearbyint(std::ldexp(double(v[i]), bits - E)), -lim, lim));
    c.scale.push_back(std::ldexp(1.0, E - bits));
  }
  return c;
}
#endif

TEST(GemmFastF16, SchemeBitForBitWithinCodeRoundingAndShapeInvariant) {
  if (!pp::kernels::gemm_f16::kAvailable) GTEST_SKIP() << "no int16 tiles in this build (AVX512-VNNI, or AVX2 without AVX-512)";
#if PP_HAVE_F16_TILES
  namespace g16 = pp::kernels::gemm_f16;
  std::printf("[gemm_f16] %s, %d rows x %zu tokens a tile\n", g16::kName, g16::kRows, g16::kBlockTokens);
  constexpr std::size_t Q = g16::kQ, S = pp::kernels::gemm::kSegK;
  std::mt19937 rng(16);
  for (std::size_t cols : {16, 37, 64, 520, 1100})
    for (std::size_t rows : {1, 5, 6, 7, 13}) {
      std::vector<float> wv = randv(rows * cols, rng, 0.05f);
      wv[0] = 3.f;  // a row with an outlier: its small values round
      const Stored w = store(pp::DType::F16, wv);
      const std::size_t m = rows == 7 ? 70 : 13;  // 70: a full and a partial token block
      std::vector<float> x = randv(m * cols, rng, 2.f);
      x[1] = 1e-3f, x[cols / 2] = 40.f;  // blocks with a wide range
      pp::MatView mv{pp::DType::F16, w.bytes.data(), rows, cols, cols * 2};
      std::vector<float> y(m * rows, NAN), ysplit(m * rows, NAN), y1(rows, NAN);
      g16::PackedX px;
      g16::prepare(px, m, cols);
      g16::pack_blocks(x.data(), px, 0, px.blocks());
      g16::matmul_packed(mv, px, y.data(), 0, rows);
      const std::size_t cut = std::min<std::size_t>(rows, 6);
      g16::matmul_packed(mv, px, ysplit.data(), 0, cut);
      g16::matmul_packed(mv, px, ysplit.data(), cut, rows);
      EXPECT_EQ(y, ysplit);
      for (std::size_t t = 0; t < m; ++t) {
        const F16Codes xc = f16_codes(&x[t * cols], cols, Q, g16::kActBits);
        g16::PackedX p1;
        g16::prepare(p1, 1, cols);
        g16::pack_blocks(&x[t * cols], p1, 0, 1);
        g16::matmul_packed(mv, p1, y1.data(), 0, rows);
        for (std::size_t r = 0; r < rows; ++r) {
          const F16Codes wc = f16_codes(&w.values[r * cols], cols, S, g16::kWeightBits);
          float out = 0.f;
          double exact = 0, bound = 0;
          for (std::size_t seg = 0; seg * S < cols; ++seg) {
            float acc = 0.f;
            for (std::size_t b = seg * S / Q; b * Q < std::min(cols, (seg + 1) * S); ++b) {
              int64_t dot = 0;
              for (std::size_t i = b * Q; i < std::min(cols, (b + 1) * Q); ++i)
                dot += xc.codes[i] * wc.codes[i];
              ASSERT_LE(std::abs(dot), int64_t(INT32_MAX));
              acc = std::fma(float(dot), float(xc.scale[b]), acc);
            }
            out = seg == 0 ? acc * float(wc.scale[seg]) : std::fma(acc, float(wc.scale[seg]), out);
          }
          for (std::size_t i = 0; i < cols; ++i) {
            const double xi = x[t * cols + i], wi = w.values[r * cols + i];
            const double dx = xc.scale[i / Q] / 2, dw = wc.scale[i / S] / 2;  // half a code
            exact += xi * wi;
            bound += std::abs(wi) * dx + std::abs(xi) * dw + dx * dw + 1e-6 * std::abs(xi * wi);
          }
          ASSERT_EQ(std::bit_cast<uint32_t>(y[t * rows + r]), std::bit_cast<uint32_t>(out))
              << "cols " << cols << " rows " << rows << " token " << t << " row " << r;
          ASSERT_EQ(std::bit_cast<uint32_t>(y1[r]), std::bit_cast<uint32_t>(out)) << "alone: token " << t;
          ASSERT_NEAR(out, exact, bound);
        }
      }
      // Dispatched: bulk rows with fast_float take this kernel, on any thread count; without, the exact tiles.
      std::vector<uint8_t> xq(m * pp::kernels::xq_row_bytes(cols));
      std::vector<float> yd(m * rows), yd3(m * rows), ye(m * rows);
      pp::ThreadPool p1(1), p3(3);
      pp::kernels::matmul(p1, mv, x.data(), m, yd.data(), {false, xq, true}, /*bulk=*/true);
      pp::kernels::matmul(p3, mv, x.data(), m, yd3.data(), {false, xq, true}, true);
      pp::kernels::matmul(p1, mv, x.data(), m, ye.data(), {false, xq, false}, true);
      EXPECT_EQ(yd, y);
      EXPECT_EQ(yd3, y);
      EXPECT_NE(ye, y);
    }
#endif
}

// The int16 tiles at the edges of their codes: every product at the largest codes (activations just
// below a power of two, weights at f16's largest magnitude) sums without overflow; an infinity or NaN
// in a weight row or an activation block gives NaN where it reaches (never a finite wrong value), and
// a block of zeros or of values below 2^-100 gives zero.
TEST(GemmFastF16, LargestCodesZerosAndNonFinite) {
  if (!pp::kernels::gemm_f16::kAvailable) GTEST_SKIP() << "no int16 tiles in this build (AVX512-VNNI, or AVX2 without AVX-512)";
#if PP_HAVE_F16_TILES
  namespace g16 = pp::kernels::gemm_f16;
  constexpr std::size_t cols = 64, rows = 3, m = 4;
  std::vector<float> wv(rows * cols, 65504.f);  // f16's largest
  for (std::size_t i = 0; i < cols; ++i) wv[cols + i] = i % 2 ? -2.f : 2.f;
  wv[2 * cols + 5] = INFINITY;
  const Stored w = store(pp::DType::F16, wv);
  std::vector<float> x(m * cols, std::nextafter(1.f, 0.f));  // codes 16383 after rounding
  for (std::size_t i = 0; i < cols; ++i) x[cols + i] = i < 16 ? 0.f : 1e-35f;
  x[2 * cols + 20] = NAN;
  x[3 * cols + 40] = -INFINITY;
  pp::MatView mv{pp::DType::F16, w.bytes.data(), rows, cols, cols * 2};
  g16::PackedX px;
  g16::prepare(px, m, cols);
  g16::pack_blocks(x.data(), px, 0, px.blocks());
  std::vector<float> y(m * rows, 0.f);
  g16::matmul_packed(mv, px, y.data(), 0, rows);
  EXPECT_NEAR(y[0], 64 * 65504.0, 64 * 65504.0 * 1e-4);  // no int32 wrap-around
  EXPECT_NEAR(y[1], 0.0, 1e-3);                              // +2, -2, ...
  EXPECT_TRUE(std::isnan(y[2]));                             // the infinite weight
  EXPECT_EQ(y[rows + 0], 0.f);                               // zeros and 1e-35 (below 2^-100)
  EXPECT_EQ(y[rows + 1], 0.f);
  for (std::size_t r = 0; r < rows; ++r) {
    EXPECT_TRUE(std::isnan(y[2 * rows + r])) << r;  // NaN activation
    EXPECT_TRUE(std::isnan(y[3 * rows + r])) << r;  // infinite activation
  }
#endif
}

}  // namespace
