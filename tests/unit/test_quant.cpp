// Quantized formats: hand-computed blocks per type, SIMD dequantization, both dot paths on every arch, synth.
#include <pp/core/float16.hpp>
#include <pp/core/thread_pool.hpp>
#include <pp/io/quantize.hpp>
#include <pp/kernels/matmul.hpp>
#include <pp/kernels/quant.hpp>
#include <pp/kernels/quant_blocks.hpp>
#include <pp/stage.hpp>

#include "../../tools/common/synth.hpp"

#include "../common/archs.hpp"
#include "../common/oracle.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <vector>

namespace {

using pp::DType;
namespace q = pp::quant;

using pp::test::for_each_arch;

constexpr DType kTypes[] = {DType::Q8_0, DType::Q4_0, DType::Q4_1, DType::Q5_0,
                            DType::Q5_1, DType::Q4_K, DType::Q5_K, DType::Q6_K};

template <class Block>
std::vector<float> deq(const Block& b) {
  std::vector<float> y(Block::kElems);
  q::dequantize(b, y.data());
  return y;
}

// ---- Hand-computed blocks ----

TEST(QuantDequant, Q8_0SignedCodesTimesScale) {
  q::BlockQ8_0 b{};
  b.d = 0x3800;  // 0.5
  b.qs[0] = -128, b.qs[1] = 127, b.qs[2] = -1, b.qs[31] = 3;
  const auto y = deq(b);
  EXPECT_EQ(y[0], -64.f);
  EXPECT_EQ(y[1], 63.5f);
  EXPECT_EQ(y[2], -0.5f);
  EXPECT_EQ(y[3], 0.f);
  EXPECT_EQ(y[31], 1.5f);
}

TEST(QuantDequant, Q4_0LowNibblesFirstOffset8) {
  q::BlockQ4_0 b{};
  b.d = 0x4000;  // 2
  std::memset(b.qs, 0x88, 16);  // code 8 everywhere: zero
  b.qs[0] = 0x1F, b.qs[1] = 0x80, b.qs[15] = 0x8F;
  const auto y = deq(b);
  EXPECT_EQ(y[0], 14.f);    // (15 - 8) * 2
  EXPECT_EQ(y[16], -14.f);  // (1 - 8) * 2: element 16 is qs[0]'s high nibble
  EXPECT_EQ(y[1], -16.f);
  EXPECT_EQ(y[17], 0.f);
  EXPECT_EQ(y[15], 14.f);
  EXPECT_EQ(y[31], 0.f);
  EXPECT_EQ(y[5], 0.f);
}

TEST(QuantDequant, Q4_1ScaleAndMin) {
  q::BlockQ4_1 b{};
  b.d = 0x3800, b.m = 0xBC00;  // 0.5, -1
  b.qs[0] = 0xF3;
  const auto y = deq(b);
  EXPECT_EQ(y[0], 0.5f);   // 3 * 0.5 - 1
  EXPECT_EQ(y[16], 6.5f);  // 15 * 0.5 - 1
  EXPECT_EQ(y[1], -1.f);   // code 0: the min
}

// qh = bits 0, 16 and 31: elements 0, 16 and 31 have their 5th bit set.
constexpr uint8_t kQh5[4] = {0x01, 0x00, 0x01, 0x80};

TEST(QuantDequant, Q5_0FifthBitIsBitEOfQh) {
  q::BlockQ5_0 b{};
  b.d = 0x3C00;  // 1
  std::memcpy(b.qh, kQh5, 4);
  b.qs[0] = 0x21, b.qs[1] = 0x21, b.qs[15] = 0xF0;
  const auto y = deq(b);
  EXPECT_EQ(y[0], 1.f);     // (1 | 16) - 16
  EXPECT_EQ(y[16], 2.f);    // (2 | 16) - 16
  EXPECT_EQ(y[1], -15.f);   // 1 - 16
  EXPECT_EQ(y[17], -14.f);  // 2 - 16
  EXPECT_EQ(y[15], -16.f);  // 0 - 16
  EXPECT_EQ(y[31], 15.f);   // (15 | 16) - 16
}

TEST(QuantDequant, Q5_1FifthBitScaleAndMin) {
  q::BlockQ5_1 b{};
  b.d = 0x3800, b.m = 0x4000;  // 0.5, 2
  std::memcpy(b.qh, kQh5, 4);
  b.qs[0] = 0x21, b.qs[1] = 0x21, b.qs[15] = 0xF0;
  const auto y = deq(b);
  EXPECT_EQ(y[0], 10.5f);  // 17 * 0.5 + 2
  EXPECT_EQ(y[16], 11.f);  // 18 * 0.5 + 2
  EXPECT_EQ(y[1], 2.5f);   // 1 * 0.5 + 2
  EXPECT_EQ(y[15], 2.f);
  EXPECT_EQ(y[31], 17.5f);  // 31 * 0.5 + 2
}

// 6-bit scales {1, 2, 3, 63, 17, 33, 48, 63} and mins {0, 5, 63, 1, 31, 16, 47, 62}, packed by hand:
// bytes 0-3: scale 0-3 | top 2 bits of scale 4-7 << 6; bytes 4-7: min 0-3 | top bits of min 4-7 << 6;
// bytes 8-11: low nibble of scale 4-7 | low nibble of min 4-7 << 4.
constexpr uint8_t kSc[8] = {1, 2, 3, 63, 17, 33, 48, 63};
constexpr uint8_t kMn[8] = {0, 5, 63, 1, 31, 16, 47, 62};
constexpr uint8_t kScales12[12] = {0x41, 0x82, 0xC3, 0xFF, 0x40, 0x45, 0xBF, 0xC1, 0xF1, 0x01, 0xF0, 0xEF};

TEST(QuantDequant, KScalePackingSixBits) {
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    q::scale_min_k4(j, kScales12, sc, m);
    EXPECT_EQ(sc, kSc[j]) << j;
    EXPECT_EQ(m, kMn[j]) << j;
  }
  uint8_t sc8[8], mn8[8];
  q::scales_mins_k4(kScales12, sc8, mn8);
  for (int j = 0; j < 8; ++j) EXPECT_TRUE(sc8[j] == kSc[j] && mn8[j] == kMn[j]) << "all at once, " << j;
  uint8_t packed[12];
  q::pack_scale_min_k4(kSc, kMn, packed);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(packed[i], kScales12[i]) << i;
}

TEST(QuantDequant, Q4_KSubBlocksScalesMins) {
  q::BlockQ4_K b{};
  b.d = 0x3C00, b.dmin = 0x3800;  // 1, 0.5
  std::memcpy(b.scales, kScales12, 12);
  std::memset(b.qs, 0x5A, 128);  // low nibble 10, high 5
  b.qs[0] = 0x0F;
  const auto y = deq(b);
  EXPECT_EQ(y[0], 15.f);    // sub-block 0: 1 * 15 - 0.5 * 0
  EXPECT_EQ(y[1], 10.f);    // 1 * 10
  EXPECT_EQ(y[32], -2.5f);  // sub-block 1 = high nibbles of qs[0..32): 2 * 0 - 0.5 * 5
  EXPECT_EQ(y[33], 7.5f);   // 2 * 5 - 2.5
  const float want[8] = {10.f, 7.5f, -1.5f, 314.5f, 154.5f, 157.f, 456.5f, 284.f};  // element 32j + 5
  for (int j = 0; j < 8; ++j) EXPECT_EQ(y[32 * j + 5], want[j]) << "sub-block " << j;
}

TEST(QuantDequant, Q5_KFifthBitIsBitJOfQh) {
  q::BlockQ5_K b{};
  b.d = 0x3C00, b.dmin = 0x3800;
  std::memcpy(b.scales, kScales12, 12);
  std::memset(b.qs, 0x5A, 128);
  b.qh[3] = 0xA5;  // bits 0, 2, 5, 7: element 3 of sub-blocks 0, 2, 5, 7 gets +16
  const auto y = deq(b);
  const float want3[8] = {26.f, 7.5f, 46.5f, 314.5f, 154.5f, 685.f, 456.5f, 1292.f};
  const float want4[8] = {10.f, 7.5f, -1.5f, 314.5f, 154.5f, 157.f, 456.5f, 284.f};
  for (int j = 0; j < 8; ++j) {
    EXPECT_EQ(y[32 * j + 3], want3[j]) << "sub-block " << j;
    EXPECT_EQ(y[32 * j + 4], want4[j]) << "sub-block " << j;
  }
}

TEST(QuantDequant, Q6_KBitLayoutSignedScales) {
  q::BlockQ6_K b{};
  b.d = 0x3800;  // 0.5
  for (int g = 0; g < 16; ++g) b.scales[g] = int8_t(3 * g - 20);
  b.ql[0] = 0x21, b.ql[32] = 0x43, b.qh[0] = 0xE4;   // high bit pairs 0, 1, 2, 3
  b.ql[64] = 0xF0, b.ql[96] = 0x0F, b.qh[32] = 0x1B;  // high bit pairs 3, 2, 1, 0
  const auto y = deq(b);
  EXPECT_EQ(y[0], 310.f);     // 0.5 * -20 * ((1 | 0 << 4) - 32)
  EXPECT_EQ(y[32], 91.f);     // 0.5 * -14 * ((3 | 1 << 4) - 32)
  EXPECT_EQ(y[64], -8.f);     // 0.5 * -8 * ((2 | 2 << 4) - 32)
  EXPECT_EQ(y[96], -20.f);    // 0.5 * -2 * ((4 | 3 << 4) - 32)
  EXPECT_EQ(y[128], 32.f);    // 0.5 * 4 * ((0 | 3 << 4) - 32)
  EXPECT_EQ(y[160], 75.f);    // 0.5 * 10 * ((15 | 2 << 4) - 32)
  EXPECT_EQ(y[192], -8.f);    // 0.5 * 16 * ((15 | 1 << 4) - 32)
  EXPECT_EQ(y[224], -352.f);  // 0.5 * 22 * (0 - 32)
  EXPECT_EQ(y[17], 272.f);    // group 1: 0.5 * -17 * -32
}

// ---- Random blocks with sane scales ----

float urand(std::mt19937& rng, float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
uint16_t h(float f) { return pp::f32_to_f16(f); }

void sanitize(q::BlockQ8_0& b, std::mt19937& r) { b.d = h(urand(r, 1e-3f, 2e-2f)); }
void sanitize(q::BlockQ4_0& b, std::mt19937& r) { b.d = h(urand(r, -0.1f, 0.1f)); }
void sanitize(q::BlockQ4_1& b, std::mt19937& r) { b.d = h(urand(r, 0.f, 0.05f)), b.m = h(urand(r, -0.4f, 0.f)); }
void sanitize(q::BlockQ5_0& b, std::mt19937& r) { b.d = h(urand(r, -0.05f, 0.05f)); }
void sanitize(q::BlockQ5_1& b, std::mt19937& r) { b.d = h(urand(r, 0.f, 0.03f)), b.m = h(urand(r, -0.4f, 0.f)); }
void sanitize(q::BlockQ4_K& b, std::mt19937& r) { b.d = h(urand(r, 0.f, 1e-3f)), b.dmin = h(urand(r, 0.f, 2e-3f)); }
void sanitize(q::BlockQ5_K& b, std::mt19937& r) { b.d = h(urand(r, 0.f, 5e-4f)), b.dmin = h(urand(r, 0.f, 2e-3f)); }
void sanitize(q::BlockQ6_K& b, std::mt19937& r) { b.d = h(urand(r, -1e-4f, 1e-4f)); }

// `rows` rows of `cols` random codes (every bit pattern) with sane f16 scales.
std::vector<uint8_t> random_matrix(DType t, std::size_t rows, std::size_t cols, std::mt19937& rng) {
  std::vector<uint8_t> w(rows * pp::row_bytes(t, cols));
  for (auto& b : w) b = uint8_t(rng());
  q::visit(t, [&](auto f) {
    using B = typename decltype(f)::Block;
    B* b = reinterpret_cast<B*>(w.data());
    for (std::size_t i = 0; i < w.size() / sizeof(B); ++i) sanitize(b[i], rng);
  });
  return w;
}

std::vector<float> dequant_matrix(DType t, const std::vector<uint8_t>& w, std::size_t rows, std::size_t cols) {
  std::vector<float> y(rows * cols);
  for (std::size_t r = 0; r < rows; ++r) q::dequantize_row(t, w.data() + r * pp::row_bytes(t, cols), cols, &y[r * cols]);
  return y;
}

using pp::test::randv;

TEST(QuantDequant, SimdBlockDequantEqualsScalarOnEveryArch) {
  std::mt19937 rng(7);
  for (DType t : kTypes) {
    const std::size_t cols = 1024;
    const auto w = random_matrix(t, 4, cols, rng);
    const auto want = dequant_matrix(t, w, 4, cols);
    for_each_arch([&](auto a) {
      using A = decltype(a);
      q::visit(t, [&](auto f) {
        using B = typename decltype(f)::Block;
        const B* b = reinterpret_cast<const B*>(w.data());
        alignas(64) float y[B::kElems];
        for (std::size_t i = 0; i < w.size() / sizeof(B); ++i) {
          q::dequantize_simd<A>(b[i], y);
          for (std::size_t e = 0; e < B::kElems; ++e) {
            const float ref = want[i * B::kElems + e];
            // Equal up to an FMA contraction of d * q - m in either form.
            ASSERT_NEAR(y[e], ref, 1e-6f * (std::abs(ref) + 1.f))
                << A::name() << " " << pp::dtype_name(t) << " block " << i << " elem " << e;
          }
        }
      });
    });
  }
}

TEST(QuantDequant, RowToF32DequantizesOneRow) {
  std::mt19937 rng(3);
  for (DType t : kTypes) {
    const std::size_t rows = 3, cols = 512;
    const auto w = random_matrix(t, rows, cols, rng);
    const auto want = dequant_matrix(t, w, rows, cols);
    pp::MatView mv{t, w.data(), rows, cols, pp::row_bytes(t, cols)};
    std::vector<float> out(cols);
    pp::kernels::row_to_f32(mv, 2, out.data());
    for (std::size_t j = 0; j < cols; ++j) ASSERT_EQ(out[j], want[2 * cols + j]) << pp::dtype_name(t);
  }
}

// ---- Quantizers (synthetic models) ----

TEST(QuantQuantize, RoundTripWithinHalfAStep) {
  std::mt19937 rng(11);
  for (DType t : kTypes) {
    const std::size_t n = 2048;
    std::vector<float> x = randv(n, rng);
    x[5] = 0.f, x[300] = 4.f;  // an exact zero and an outlier
    std::vector<uint8_t> b(pp::row_bytes(t, n));
    q::quantize_row(t, x.data(), n, b.data());
    std::vector<float> y(n);
    q::dequantize_row(t, b.data(), n, y.data());
    double err2 = 0, x2 = 0;
    for (std::size_t i = 0; i < n; ++i) err2 += (y[i] - x[i]) * (y[i] - x[i]), x2 += x[i] * x[i];
    const double rel = std::sqrt(err2 / x2);
    // Relative RMS error of round-to-nearest: about step / sqrt(12) over the spread of the values.
    const double bound = t == DType::Q8_0 ? 0.01 : t == DType::Q6_K ? 0.04 : (t == DType::Q5_0 || t == DType::Q5_1 || t == DType::Q5_K) ? 0.07 : 0.14;
    EXPECT_LT(rel, bound) << pp::dtype_name(t);
    std::printf("[quant] %s round trip: relative RMS error %.4f\n", pp::dtype_name(t), rel);
  }
}

TEST(QuantQuantize, ActivationBlocksScalesSumsAndBsums) {
  std::mt19937 rng(5);
  std::vector<float> x = randv(512, rng);
  for (DType t : {DType::Q8_0, DType::Q4_K}) {
    std::vector<uint8_t> b(q::act_row_bytes(t, x.size()));
    ASSERT_LE(b.size(), q::act_row_bytes_bound(x.size()));
    q::quantize_act_row(t, x.data(), x.size(), b.data());
    if (t == DType::Q8_0) {
      const auto* a = reinterpret_cast<const q::ActQ8*>(b.data());
      for (int i = 0; i < 16; ++i) {
        int s = 0;
        float amax = 0;
        for (int j = 0; j < 32; ++j) s += a[i].qs[j], amax = std::max(amax, std::abs(x[32 * i + j]));
        // llama.cpp's rounding: codes from 127 / amax, then d and s = d * sum rounded to f16.
        for (int j = 0; j < 32; ++j) EXPECT_EQ(a[i].qs[j], int(std::nearbyint(x[32 * i + j] * (127.f / amax))));
        EXPECT_EQ(a[i].d, pp::f16_to_f32(pp::f32_to_f16(amax / 127.f)));
        EXPECT_EQ(a[i].s, pp::f16_to_f32(pp::f32_to_f16(amax / 127.f * float(s))));
      }
    } else {
      const auto* a = reinterpret_cast<const q::BlockQ8_K*>(b.data());
      for (int i = 0; i < 2; ++i)
        for (int g = 0; g < 16; ++g) {
          int s = 0;
          for (int l = 0; l < 16; ++l) {
            s += a[i].qs[16 * g + l];
            EXPECT_LE(std::abs(a[i].d * a[i].qs[16 * g + l] - x[256 * i + 16 * g + l]), 0.5f * std::abs(a[i].d) * 1.0001f);
          }
          EXPECT_EQ(a[i].bsums[g], s);
        }
    }
  }
}

// ---- Dot kernels against the scalar dequantize-then-dot oracle ----

std::vector<float> dequant_acts(DType t, const std::vector<uint8_t>& xq, std::size_t m, std::size_t n) {
  std::vector<float> y(m * n);
  const std::size_t rb = q::act_row_bytes(t, n);
  q::visit(t, [&](auto f) {
    using Act = typename decltype(f)::Act;
    for (std::size_t i = 0; i < m; ++i) {
      const Act* a = reinterpret_cast<const Act*>(xq.data() + i * rb);
      for (std::size_t b = 0; b < n / Act::kElems; ++b) q::dequantize(a[b], &y[i * n + b * Act::kElems]);
    }
  });
  return y;
}

// Checks y[m, rows] against float64 (Eigen) dots of wf[rows, cols] and xf[m, cols]. The tolerance scales with the
// magnitudes that meet in the sum (|w| and the row's largest |w|, which bounds the scale and min terms).
// `extra[t * rows + r]` is added to the oracle's dot.
void expect_dots(const std::vector<float>& y, const std::vector<float>& wf, const std::vector<float>& xf,
                 std::size_t m, std::size_t rows, std::size_t cols, const std::string& what,
                 const std::vector<double>& extra = {}) {
  const Eigen::MatrixXd W = pp::test::f64(wf, rows, cols), X = pp::test::f64(xf, m, cols);
  const Eigen::VectorXd wmax = W.cwiseAbs().rowwise().maxCoeff();
  const Eigen::MatrixXd want = X * W.transpose();  // [m, rows]
  // mag[t, r] = sum_j (|w[r, j]| + wmax[r]) |x[t, j]|
  const Eigen::MatrixXd mag = X.cwiseAbs() * W.cwiseAbs().transpose() + X.cwiseAbs().rowwise().sum() * wmax.transpose();
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t t = 0; t < m; ++t) {
      const double e = extra.empty() ? 0 : extra[t * rows + r];
      ASSERT_NEAR(y[t * rows + r], want(t, r) + e, 2e-6 * mag(t, r) + 1e-30) << what << " row " << r << " token " << t;
    }
}

// Q4_1 / Q5_1's min term uses Q8_1's s (d * sum rounded to f16, as llama.cpp) instead of d * sum:
// extra[t, r] = sum over blocks of m * (s - d * sum q).
std::vector<double> q8_1_rounding(DType t, const std::vector<uint8_t>& w, const std::vector<uint8_t>& xq,
                                  std::size_t m, std::size_t rows, std::size_t cols) {
  std::vector<double> extra(m * rows, 0.0);
  q::visit(t, [&](auto f) {
    using B = typename decltype(f)::Block;
    if constexpr (q::kHasMin<B>) {
      for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t i = 0; i < m; ++i) {
          const B* wb = reinterpret_cast<const B*>(w.data() + r * pp::row_bytes(t, cols));
          const auto* a = reinterpret_cast<const q::ActQ8*>(xq.data() + i * q::act_row_bytes(t, cols));
          for (std::size_t b = 0; b < cols / 32; ++b) {
            int sum = 0;
            for (int j = 0; j < 32; ++j) sum += a[b].qs[j];
            extra[i * rows + r] += double(pp::f16_to_f32(wb[b].m)) * (double(a[b].s) - double(a[b].d) * sum);
          }
        }
    }
  });
  return extra;
}

TEST(QuantDot, ExactAndFastMatchOracleOnEveryArch) {
  std::mt19937 rng(42);
  for (DType t : kTypes)
    for (std::size_t cols : {256, 768}) {
      const std::size_t rows = 6;
      const auto w = random_matrix(t, rows, cols, rng);
      const auto wf = dequant_matrix(t, w, rows, cols);
      pp::MatView mv{t, w.data(), rows, cols, pp::row_bytes(t, cols)};
      for (std::size_t m : {1, 2, 3, 4, 5, 7}) {
        const auto x = randv(m * cols, rng);
        std::vector<uint8_t> xq(m * q::act_row_bytes(t, cols));
        for (std::size_t i = 0; i < m; ++i)
          q::quantize_act_row(t, &x[i * cols], cols, xq.data() + i * q::act_row_bytes(t, cols));
        const auto xqf = dequant_acts(t, xq, m, cols);
        const auto extra = q8_1_rounding(t, w, xq, m, rows, cols);
        for_each_arch([&](auto a) {
          using A = decltype(a);
          const std::string what = std::string(A::name()) + " " + pp::dtype_name(t) + " cols " +
                                   std::to_string(cols) + " m " + std::to_string(m);
          std::vector<float> y(m * rows);
          pp::kernels::matmul_rows<A>(mv, x.data(), m, y.data(), 0, rows);
          expect_dots(y, wf, x, m, rows, cols, "exact " + what);
          pp::kernels::matmul_rows<A>(mv, x.data(), m, y.data(), 0, rows, xq.data());
          expect_dots(y, wf, xqf, m, rows, cols, "fast " + what, extra);
        });
      }
    }
}

// Prefill == decode: a row's dot with a token is bit-identical in a 1-token and a 7-token call, and
// through the threaded matmul with its own activation quantization.
TEST(QuantDot, TokenCountAndThreadsDoNotChangeBits) {
  std::mt19937 rng(9);
  pp::ThreadPool pool(2);
  for (DType t : kTypes) {
    const std::size_t rows = 40, cols = 512, m = 7;
    const auto w = random_matrix(t, rows, cols, rng);
    pp::MatView mv{t, w.data(), rows, cols, pp::row_bytes(t, cols)};
    const auto x = randv(m * cols, rng);
    std::vector<uint8_t> xq(m * q::act_row_bytes_bound(cols));
    for (bool fast : {false, true}) {
      std::vector<float> all(m * rows), one(rows);
      pp::kernels::matmul(pool, mv, x.data(), m, all.data(), {fast, xq});
      for (std::size_t i = 0; i < m; ++i) {
        pp::kernels::matmul(pool, mv, &x[i * cols], 1, one.data(), {fast, xq});
        for (std::size_t r = 0; r < rows; ++r)
          ASSERT_EQ(std::bit_cast<uint32_t>(one[r]), std::bit_cast<uint32_t>(all[i * rows + r]))
              << pp::dtype_name(t) << (fast ? " fast" : " exact") << " token " << i << " row " << r;
      }
    }
  }
}

// The Q8_0 decode dot (two blocks a 512-bit register on AVX-512, one a 256-bit half elsewhere): odd and even
// block counts, one block, a row longer than the others; against the oracle on every architecture, and a
// row's bits the same in a 1-token call as in calls of 2-7 tokens.
TEST(QuantDot, Q8_0FastRowsOddBlockCountsAndTokenCounts) {
  std::mt19937 rng(31);
  for (std::size_t cols : {32, 64, 96, 800, 2080}) {
    const std::size_t rows = 9, m = 7;
    const auto w = random_matrix(DType::Q8_0, rows, cols, rng);
    const auto wf = dequant_matrix(DType::Q8_0, w, rows, cols);
    pp::MatView mv{DType::Q8_0, w.data(), rows, cols, pp::row_bytes(DType::Q8_0, cols)};
    const auto x = randv(m * cols, rng);
    const std::size_t rb = q::act_row_bytes(DType::Q8_0, cols);
    std::vector<uint8_t> xq(m * rb);
    for (std::size_t i = 0; i < m; ++i) q::quantize_act_row(DType::Q8_0, &x[i * cols], cols, xq.data() + i * rb);
    const auto xqf = dequant_acts(DType::Q8_0, xq, m, cols);
    for_each_arch([&](auto a) {
      using A = decltype(a);
      const std::string what = std::string(A::name()) + " cols " + std::to_string(cols);
      std::vector<float> one(m * rows);
      for (std::size_t i = 0; i < m; ++i)
        pp::kernels::matmul_rows<A>(mv, &x[i * cols], 1, one.data() + i * rows, 0, rows, xq.data() + i * rb);
      expect_dots(one, wf, xqf, m, rows, cols, "q8_0 fast " + what);
      for (std::size_t k = 2; k <= m; ++k) {
        std::vector<float> some(k * rows);
        pp::kernels::matmul_rows<A>(mv, x.data(), k, some.data(), 0, rows, xq.data());
        for (std::size_t i = 0; i < k * rows; ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(some[i]), std::bit_cast<uint32_t>(one[i])) << what << " tokens " << k << " at " << i;
      }
    });
  }
}

// Bulk requests of Q8_0 weights on the fast path (gemm_q8.hpp where AVX512-VNNI or AVX2 is compiled in,
// the dot kernels elsewhere): against the oracle on the quantized activations; a row's result independent of
// how many tokens share the call (partial token blocks, several chunks), the thread count and so the
// row ranges of tasks (full and last row blocks).
TEST(QuantDot, Q8_0BulkRowsMatchOracleWhateverTheBatchAndThreads) {
  std::mt19937 rng(11);
  pp::ThreadPool p1(1), p3(3);
  for (std::size_t cols : {32, 96, 2048})
    for (std::size_t rows : {1, 5, 23, 70}) {
      const auto w = random_matrix(DType::Q8_0, rows, cols, rng);
      const auto wf = dequant_matrix(DType::Q8_0, w, rows, cols);
      pp::MatView mv{DType::Q8_0, w.data(), rows, cols, pp::row_bytes(DType::Q8_0, cols)};
      const std::size_t m = cols == 2048 ? 300 : 45;  // 2048: several token chunks
      const auto x = randv(m * cols, rng);
      const std::size_t rb = q::act_row_bytes(DType::Q8_0, cols);
      std::vector<uint8_t> xq(m * rb), xq_own(m * rb);
      for (std::size_t i = 0; i < m; ++i) q::quantize_act_row(DType::Q8_0, &x[i * cols], cols, xq.data() + i * rb);
      std::vector<float> y1(m * rows), y3(m * rows), part(17 * rows);
      pp::kernels::matmul(p1, mv, x.data(), m, y1.data(), {true, xq_own}, /*bulk=*/true);
      pp::kernels::matmul(p3, mv, x.data(), m, y3.data(), {true, xq_own}, true);
      ASSERT_EQ(y1, y3) << "cols " << cols << " rows " << rows;
      pp::kernels::matmul(p3, mv, x.data() + 20 * cols, 17, part.data(), {true, xq_own}, true);
      for (std::size_t i = 0; i < 17 * rows; ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(part[i]), std::bit_cast<uint32_t>(y1[20 * rows + i])) << i;
      expect_dots(y1, wf, dequant_acts(DType::Q8_0, xq, m, cols), m, rows, cols,
                  "q8_0 bulk cols " + std::to_string(cols) + " rows " + std::to_string(rows));
      if (!pp::kernels::gemm_q8::kAvailable) continue;
      // On tiles, bit for bit the chain gemm_q8.hpp promises, whatever the instruction set (VNNI or
      // AVX2 builds): acc = fma(float(exact block dot), d_w * d_x, acc) over the blocks in order.
      const std::size_t nb = cols / 32;
      for (std::size_t t = 0; t < m; ++t)
        for (std::size_t r = 0; r < rows; ++r) {
          const auto* wb = reinterpret_cast<const q::BlockQ8_0*>(w.data() + r * mv.row_stride);
          const auto* xb = reinterpret_cast<const q::ActQ8*>(xq.data() + t * rb);
          float acc = 0.f;
          for (std::size_t b = 0; b < nb; ++b) {
            int32_t dot = 0;
            for (int j = 0; j < 32; ++j) dot += int32_t(wb[b].qs[j]) * int32_t(xb[b].qs[j]);
            acc = std::fma(float(dot), q::h2f(wb[b].d) * xb[b].d, acc);
          }
          ASSERT_EQ(std::bit_cast<uint32_t>(acc), std::bit_cast<uint32_t>(y1[t * rows + r]))
              << "cols " << cols << " rows " << rows << " token " << t << " row " << r;
        }
    }
}

}  // namespace

// ---- Synthetic quantized models (tools/common/synth.hpp) ----

namespace synth_test {

std::string tmp_model(const std::string& file_type, std::size_t n_layer) {
  pp::synth::Spec s;
  s.n_vocab = 512, s.n_embd = 256, s.n_layer = n_layer, s.n_head = 4, s.n_head_kv = 1, s.n_ff = 512, s.ctx = 256;
  pp::synth::set_file_type(s, file_type);
  const std::string path =
      (std::filesystem::temp_directory_path() / ("pp-test-quant-" + file_type + "-" + std::to_string(::getpid()) + ".gguf"))
          .string();
  pp::synth::write(s, path);
  return path;
}

// Logits of a 9-token prompt in one prefill and token by token (they must agree bit for bit).
void prefill_and_decode(const std::string& path, bool fast, std::vector<float>& pre, std::vector<float>& dec) {
  auto st = pp::Stage::open_full(path, {.threads = 2, .fast_quant = fast});
  const std::size_t V = st->config().n_vocab, E = st->config().n_embd;
  const std::vector<int32_t> toks = {496, 72, 101, 108, 108, 111, 44, 32, 119};
  std::vector<float> rows(toks.size() * E);
  pre.assign(toks.size() * V, 0.f), dec.assign(toks.size() * V, 0.f);
  pp::Sequence a = st->new_sequence(), b = st->new_sequence();
  st->embed(toks, rows.data());
  st->forward(a, 0, rows.data(), toks.size());
  st->head(a, rows.data(), toks.size(), pre.data());
  for (std::size_t i = 0; i < toks.size(); ++i) {
    st->embed({&toks[i], 1}, rows.data());
    st->forward(b, int64_t(i), rows.data(), 1);
    st->head(b, rows.data(), 1, &dec[i * V]);
  }
}

}  // namespace synth_test

TEST(QuantSynth, Q4_K_MFollowsLlamaQuantizeMix) {
  const std::string path = synth_test::tmp_model("q4_k_m", 16);
  pp::MappedFile f(path);
  const pp::gguf::File g = pp::gguf::parse(f.bytes());
  EXPECT_EQ(g.tensor("token_embd.weight")->type, pp::gguf::TensorType::Q6_K);
  const std::set<int> more = {0, 1, 4, 7, 10, 13, 14, 15};  // llama.cpp's use_more_bits for 16 layers
  for (int l = 0; l < 16; ++l) {
    const auto want = more.count(l) ? pp::gguf::TensorType::Q6_K : pp::gguf::TensorType::Q4_K;
    EXPECT_EQ(g.tensor(pp::llama::tensor_name(l, "attn_v"))->type, want) << l;
    EXPECT_EQ(g.tensor(pp::llama::tensor_name(l, "ffn_down"))->type, want) << l;
    EXPECT_EQ(g.tensor(pp::llama::tensor_name(l, "attn_q"))->type, pp::gguf::TensorType::Q4_K) << l;
  }
  std::filesystem::remove(path);
}

TEST(QuantSynth, QuantizedModelsRunPrefillEqualsDecodeOnBothPaths) {
  for (const char* ft : {"q8_0", "q4_k_m", "q5_1"}) {
    const std::string path = synth_test::tmp_model(ft, 2);
    std::vector<float> exact_pre, exact_dec, fast_pre, fast_dec;
    synth_test::prefill_and_decode(path, false, exact_pre, exact_dec);
    synth_test::prefill_and_decode(path, true, fast_pre, fast_dec);
    for (std::size_t i = 0; i < exact_pre.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(exact_pre[i]), std::bit_cast<uint32_t>(exact_dec[i])) << ft << " exact " << i;
      ASSERT_EQ(std::bit_cast<uint32_t>(fast_pre[i]), std::bit_cast<uint32_t>(fast_dec[i])) << ft << " fast " << i;
    }
    double diff = 0, mag = 0;
    for (std::size_t i = 0; i < exact_pre.size(); ++i)
      diff = std::max(diff, double(std::abs(fast_pre[i] - exact_pre[i]))), mag = std::max(mag, double(std::abs(exact_pre[i])));
    EXPECT_LT(diff, 0.05 * mag) << ft << ": the fast path strays far from the exact one";
    std::printf("[quant] synth %s: fast vs exact max |logit diff| %.4f (max |logit| %.2f)\n", ft, diff, mag);
    std::filesystem::remove(path);
  }
}

// The handshake's kernel profile says when Q8_0 prompts run on the VNNI tiles (their sums differ from a
// build without them), and only then: not on the exact path, not for a file without Q8_0 blocks.
TEST(QuantSynth, Q8_0TilesShowInTheKernelProfile) {
  const std::string q8 = synth_test::tmp_model("q8_0", 1), q4 = synth_test::tmp_model("q4_k_m", 1);
  const bool tiles = pp::kernels::gemm_q8::kAvailable;
  EXPECT_EQ(pp::Stage::open_full(q8, {.fast_quant = true})->kernel_profile().ends_with("+q8tiles"), tiles);
  EXPECT_FALSE(pp::Stage::open_full(q8, {.fast_quant = false})->kernel_profile().ends_with("+q8tiles"));
  EXPECT_FALSE(pp::Stage::open_full(q4, {.fast_quant = true})->kernel_profile().ends_with("+q8tiles"));
  std::filesystem::remove(q8);
  std::filesystem::remove(q4);
}

// A chunk whose rows take different paths (decode rows beside a prompt's bulk piece) runs in one pass over
// the weights (kernels::matmul_groups): every group's rows are bit for bit what a call of its own gives,
// for every weight type, on the exact and the fast paths, on any thread count, with weight-row counts that
// end inside a fused block and inside a tile.
TEST(MatmulGroups, EachGroupGetsWhatItsOwnCallGives) {
  std::mt19937 rng(23);
  std::vector<DType> types = {DType::F32, DType::F16, DType::BF16};
  types.insert(types.end(), std::begin(kTypes), std::end(kTypes));
  const std::vector<pp::kernels::RowGroup> groups = {{0, 3, false}, {3, 17, true}, {20, 2, false}, {22, 5, true}};
  const std::size_t m = 27;
  pp::ThreadPool p1(1), p3(3);
  for (DType t : types)
    for (const std::size_t cols : {std::size_t(256), std::size_t(2048)})
      for (const std::size_t rows : {std::size_t(13), std::size_t(100)}) {
        std::vector<uint8_t> w(rows * pp::row_bytes(t, cols));
        if (pp::is_quantized(t)) {
          w = random_matrix(t, rows, cols, rng);
        } else {
          const auto v = randv(rows * cols, rng);
          for (std::size_t i = 0; i < v.size(); ++i) {
            if (t == DType::F32) std::memcpy(&w[i * 4], &v[i], 4);
            const uint16_t h = t == DType::BF16 ? pp::f32_to_bf16(v[i]) : pp::f32_to_f16(v[i]);
            if (t != DType::F32) std::memcpy(&w[i * 2], &h, 2);
          }
        }
        const pp::MatView mv{t, w.data(), rows, cols, pp::row_bytes(t, cols)};
        const auto x = randv(m * cols, rng);
        for (const bool fast : {false, true}) {
          SCOPED_TRACE(std::string(pp::dtype_name(t)) + " cols " + std::to_string(cols) + " rows " +
                       std::to_string(rows) + (fast ? " fast" : " exact"));
          std::vector<uint8_t> xq(m * pp::kernels::xq_row_bytes(cols));
          const pp::kernels::QuantPath path{fast, xq, fast};
          std::vector<float> want(m * rows, NAN), got(m * rows, NAN), got3(m * rows, NAN);
          for (const auto& g : groups)
            pp::kernels::matmul(p1, mv, x.data() + g.row0 * cols, g.n, want.data() + g.row0 * rows, path, g.bulk);
          pp::kernels::matmul_groups(p1, mv, x.data(), got.data(), path, groups);
          pp::kernels::matmul_groups(p3, mv, x.data(), got3.data(), path, groups);
          for (std::size_t i = 0; i < want.size(); ++i) {
            ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i])) << "row " << i / rows;
            ASSERT_EQ(std::bit_cast<uint32_t>(got3[i]), std::bit_cast<uint32_t>(want[i])) << "3 threads, row " << i / rows;
          }
        }
      }
}
