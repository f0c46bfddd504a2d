// Kernels on every compiled-in architecture against float64 (Eigen) oracles; bf16/f16 conversions bit-exact.
#include <pp/core/cpu_features.hpp>
#include <pp/core/float16.hpp>
#include <pp/kernels/attention.hpp>
#include <pp/kernels/matmul.hpp>
#include <pp/kernels/ops.hpp>

#include "../common/archs.hpp"
#include "../common/oracle.hpp"
#include "../common/timing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <random>
#include <vector>

namespace {

using pp::test::for_each_arch;
using pp::test::f64;

using pp::test::randv;
using pp::test::Stored;
using pp::test::store;

// cpu::missing_for_build, which the tools ask before anything else (a build for a better CPU exits 2
// naming what is missing, instead of SIGILL): this CPU runs this test's build (it is running it), and a
// CPU with no extension at all lacks each instruction set the build's -march enables.
TEST(CpuFeatures, MissingForBuildNamesWhatTheBuildUses) {
  EXPECT_EQ(pp::cpu::missing_for_build(pp::cpu::features()), "");
  const std::string none = pp::cpu::missing_for_build(pp::cpu::Features{});
  std::vector<std::string> want;
#if defined(__SSE4_2__)
  want.push_back("SSE4.2");
#endif
#if defined(__AVX2__)
  want.push_back("AVX2");
#endif
#if defined(__AVX512BW__)
  want.push_back("AVX-512BW");
#endif
#if defined(__AVX512BF16__)
  want.push_back("AVX-512 BF16");
#endif
#if defined(__ARM_FEATURE_DOTPROD)
  want.push_back("sdot");
#endif
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
  want.push_back("bfdot");
#endif
  for (const std::string& w : want) EXPECT_NE(none.find(w), std::string::npos) << w << " not in: " << none;
  if (want.empty()) {
    EXPECT_EQ(none, "");  // plain AArch64: NEON is in every AArch64 CPU
  }
}

// cpu::prefetch_bytes: none on Zen 4 (AMD family 0x19 with AVX-512), a page ahead elsewhere (Zen 3, Zen 5,
// Intel, AArch64); PP_PREFETCH_BYTES overrides with a multiple of 64 up to 64 KiB and is ignored otherwise.
TEST(CpuFeatures, PrefetchDistanceByCpuAndOverride) {
  pp::cpu::Features zen4, zen3, zen5, intel;
  zen4.amd = zen3.amd = zen5.amd = true;
  zen4.family = zen3.family = 0x19;
  zen5.family = 0x1a;
  intel.family = 6;
  zen4.avx512f = zen5.avx512f = intel.avx512f = true;
  EXPECT_EQ(pp::cpu::prefetch_bytes(zen4, nullptr), 0u);
  EXPECT_EQ(pp::cpu::prefetch_bytes(zen3, nullptr), 4096u);
  EXPECT_EQ(pp::cpu::prefetch_bytes(zen5, nullptr), 4096u);
  EXPECT_EQ(pp::cpu::prefetch_bytes(intel, ""), 4096u);
  EXPECT_EQ(pp::cpu::prefetch_bytes(zen4, "2048"), 2048u);
  EXPECT_EQ(pp::cpu::prefetch_bytes(intel, "0"), 0u);
  EXPECT_EQ(pp::cpu::prefetch_bytes(intel, "65536"), 65536u);
  for (const char* bad : {"100", "-64", "65600", "4k", " 64", "99999999999999999999999"})
    EXPECT_EQ(pp::cpu::prefetch_bytes(zen4, bad), 0u) << bad;
  const pp::cpu::Features& here = pp::cpu::features();
  EXPECT_EQ(pp::simd::kPrefetchBytes, pp::cpu::prefetch_bytes(here, std::getenv("PP_PREFETCH_BYTES")));
}

TEST(Float16, Bf16RoundTripAndRounding) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = pp::bf16_to_f32(uint16_t(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(pp::bf16_to_f32(pp::f32_to_bf16(f))));
      continue;
    }
    ASSERT_EQ(pp::f32_to_bf16(f), h);
  }
  EXPECT_EQ(pp::f32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie to even (down)
  EXPECT_EQ(pp::f32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie to even (up)
  EXPECT_EQ(pp::f32_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
}

TEST(Float16, F16RoundTripRoundingAndRange) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = pp::f16_to_f32(uint16_t(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(pp::f32_to_f16(f), h) << h;
  }
  EXPECT_EQ(pp::f32_to_f16(65504.f), 0x7bff);
  EXPECT_EQ(pp::f32_to_f16(65520.f), 0x7c00);  // rounds past the largest half: infinity
  EXPECT_EQ(pp::f32_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(pp::f32_to_f16(-1e6f), 0xfc00);
  EXPECT_EQ(pp::f32_to_f16(5.9604645e-8f), 0x0001);  // smallest subnormal
  EXPECT_EQ(pp::f32_to_f16(2.9802322e-8f), 0x0000);  // half of it: ties to even (zero)
  EXPECT_EQ(pp::f16_to_f32(0x3c00), 1.f);
}

TEST(Simd, WideningIsExactOnEveryArch) {
  std::vector<uint16_t> all(65536 + 64);
  for (uint32_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i);
  for_each_arch([&](auto a) {
    using A = decltype(a);
    constexpr std::size_t W = pp::simd::fbatch<A>::size;
    alignas(64) float out[64];
    for (std::size_t i = 0; i + W <= 65536; i += W) {
      pp::simd::load<A>(pp::simd::Bf16w{}, all.data() + i).store_aligned(out);
      for (std::size_t j = 0; j < W; ++j)
        ASSERT_EQ(std::bit_cast<uint32_t>(out[j]), std::bit_cast<uint32_t>(pp::bf16_to_f32(all[i + j]))) << A::name();
      pp::simd::load<A>(pp::simd::F16w{}, all.data() + i).store_aligned(out);
      for (std::size_t j = 0; j < W; ++j) {
        const float want = pp::f16_to_f32(all[i + j]);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(out[j])) << A::name();
        } else {
          ASSERT_EQ(std::bit_cast<uint32_t>(out[j]), std::bit_cast<uint32_t>(want)) << A::name() << " h=" << i + j;
        }
      }
    }
  });
}

TEST(Matmul, EveryTypeAndArchAgainstScalarOracle) {
  std::mt19937 rng(42);
  for (pp::DType t : {pp::DType::F32, pp::DType::F16, pp::DType::BF16})
    for (std::size_t cols : {1, 7, 16, 63, 64, 65, 130, 257})
      for (std::size_t m : {1, 2, 3, 4, 5, 9}) {
        const std::size_t rows = 1 + rng() % 40;
        const Stored w = store(t, randv(rows * cols, rng));
        const std::vector<float> x = randv(m * cols, rng);
        pp::MatView mv{t, w.bytes.data(), rows, cols, pp::row_bytes(t, cols)};
        const pp::test::Dots o = pp::test::dots(w.values, x, m, rows, cols);
        for_each_arch([&](auto a) {
          using A = decltype(a);
          std::vector<float> y(m * rows, NAN);
          pp::kernels::matmul_rows<A>(mv, x.data(), m, y.data(), 0, rows);
          for (std::size_t i = 0; i < m; ++i)
            for (std::size_t r = 0; r < rows; ++r) {
              ASSERT_NEAR(y[i * rows + r], o.want(i, r), 1e-6 * o.mag(i, r) + 1e-30)
                  << A::name() << " " << pp::dtype_name(t) << " cols " << cols << " m " << m;
            }
        });
      }
}

TEST(Matmul, RowResultDoesNotDependOnBatchOrThreads) {
  std::mt19937 rng(7);
  const std::size_t rows = 50, cols = 200, m = 7;
  const Stored w = store(pp::DType::BF16, randv(rows * cols, rng));
  const std::vector<float> x = randv(m * cols, rng);
  pp::MatView mv{pp::DType::BF16, w.bytes.data(), rows, cols, cols * 2};
  std::vector<float> batch(m * rows), single(rows), threaded(m * rows);
  pp::ThreadPool p1(1), p3(3);
  pp::kernels::matmul(p1, mv, x.data(), m, batch.data());
  pp::kernels::matmul(p3, mv, x.data(), m, threaded.data());
  EXPECT_EQ(batch, threaded);
  for (std::size_t i = 0; i < m; ++i) {
    pp::kernels::matmul(p1, mv, x.data() + i * cols, 1, single.data());
    for (std::size_t r = 0; r < rows; ++r) ASSERT_EQ(single[r], batch[i * rows + r]);
  }
}

TEST(Ops, RmsnormSwigluSoftmaxDotAxpyOnEveryArch) {
  std::mt19937 rng(3);
  for (std::size_t n : {1, 5, 16, 33, 100, 2048}) {
    const auto x = randv(n, rng), w = randv(n, rng), u = randv(n, rng, 3.f);
    const Eigen::VectorXd X = f64(x, n, 1), Wv = f64(w, n, 1), U = f64(u, n, 1);
    const double dot = X.dot(Wv), mag = X.cwiseAbs().dot(Wv.cwiseAbs());
    const double scale = 1 / std::sqrt(X.squaredNorm() / double(n) + 1e-5);
    const Eigen::ArrayXd e = (U.array() - U.maxCoeff()).exp(), soft = e / e.sum();
    for_each_arch([&](auto a) {
      using A = decltype(a);
      std::vector<float> out(n);
      pp::kernels::rmsnorm<A>(x.data(), w.data(), 1e-5f, n, out.data());
      for (std::size_t i = 0; i < n; ++i) ASSERT_NEAR(out[i], x[i] * scale * w[i], 1e-5 * (1 + std::abs(x[i] * scale * w[i])));
      EXPECT_NEAR(pp::kernels::dot_f32<A>(x.data(), w.data(), n), dot, 1e-6 * mag + 1e-30);
      std::vector<float> y = u;
      pp::kernels::axpy<A>(0.5f, x.data(), y.data(), n);
      for (std::size_t i = 0; i < n; ++i) ASSERT_NEAR(y[i], u[i] + 0.5 * x[i], 1e-6 * (1 + std::abs(u[i])));
      std::vector<float> g = u;
      pp::kernels::swiglu<A>(g.data(), x.data(), n);
      for (std::size_t i = 0; i < n; ++i) {
        const double want = double(u[i]) / (1 + std::exp(-double(u[i]))) * x[i];
        ASSERT_NEAR(g[i], want, 1e-5 * (1 + std::abs(want)));
      }
      std::vector<float> s = u;
      pp::kernels::softmax<A>(s.data(), n);
      for (std::size_t i = 0; i < n; ++i) ASSERT_NEAR(s[i], soft(Eigen::Index(i)), 1e-6);
    });
  }
}

TEST(Ops, RopeRotatesAdjacentPairs) {
  const std::size_t hd = 8;
  std::vector<float> x = {1, 0, 0, 1, 2, 3, -1, 4, 1, 0, 0, 1, 2, 3, -1, 4};
  const std::vector<float> c = {0.f, 1.f, 0.5f, -1.f}, s = {1.f, 0.f, 0.8660254f, 0.f};
  const std::vector<float> in = x;
  pp::kernels::rope(x.data(), 2, hd, c.data(), s.data());
  for (std::size_t h = 0; h < 2; ++h)
    for (std::size_t i = 0; i < hd / 2; ++i) {
      const float x0 = in[h * hd + 2 * i], x1 = in[h * hd + 2 * i + 1];
      EXPECT_FLOAT_EQ(x[h * hd + 2 * i], x0 * c[i] - x1 * s[i]);
      EXPECT_FLOAT_EQ(x[h * hd + 2 * i + 1], x0 * s[i] + x1 * c[i]);
    }
}

TEST(ThreadPool, CoversEveryIndexOnce) {
  pp::ThreadPool pool(3);
  for (std::size_t n : {0, 1, 2, 3, 10, 1000}) {
    std::vector<int> hits(n, 0);
    pool.parallel_for(n, [&](std::size_t b, std::size_t e, unsigned t) {
      EXPECT_LT(t, 3u);
      for (std::size_t i = b; i < e; ++i) ++hits[i];
    });
    for (int h : hits) ASSERT_EQ(h, 1);
  }
}

TEST(ThreadPool, ClaimedCoversEveryIndexOnce) {
  for (unsigned threads : {1u, 3u}) {
    pp::ThreadPool pool(threads);
    for (std::size_t n : {0, 1, 2, 3, 10, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      pool.parallel_for_claimed(n, [&](std::size_t i, unsigned t) {
        EXPECT_LT(t, threads);
        hits[i].fetch_add(1);
      });
      for (const auto& h : hits) ASSERT_EQ(h.load(), 1) << threads << " threads, n " << n;
    }
  }
}

// A thread held up on one item (a core running slower) does not hold up the rest: the other thread
// takes every remaining item while it waits. Under a static split the held thread's other items would
// wait for it, and the guard (scaled to this host) would run out.
TEST(ThreadPool, ClaimedItemsGoToTheThreadThatIsFree) {
  pp::ThreadPool pool(2);
  constexpr std::size_t n = 64;
  std::mutex mu;
  std::condition_variable cv;
  std::size_t done = 0;
  bool others_done = false;
  std::size_t done_at_release = 0;
  std::vector<unsigned> by(n, 99);
  pool.parallel_for_claimed(n, [&](std::size_t i, unsigned t) {
    by[i] = t;
    std::unique_lock lk(mu);
    if (i == 0) {  // the first item claimed: its thread waits until the other has done the rest
      others_done = cv.wait_for(lk, pp::test::slack(std::chrono::seconds(20)), [&] { return done == n - 1; });
      done_at_release = done;
      return;
    }
    ++done;
    cv.notify_all();
  });
  EXPECT_TRUE(others_done) << done_at_release << " of the other " << n - 1 << " items done while one thread was held";
  std::size_t held = 0;
  for (unsigned t : by) held += t == by[0] ? 1 : 0;
  EXPECT_EQ(held, 1u) << "the held thread took " << held << " items";
}

}  // namespace

namespace {
// Decode steps over rows longer than kDecodeTileMinCols take several rows a tile (matmul.hpp): each row's
// result is bit-identical to the one-row tiles of three tokens and of a split row range, and within f32
// rounding of the oracle, on every type and architecture, with odd row counts and ragged column tails.
TEST(Matmul, LongRowDecodeTilesEqualOneRowTiles) {
  std::mt19937 rng(23);
  constexpr std::size_t kLong = pp::kernels::kDecodeTileMinCols;
  for (pp::DType t : {pp::DType::F32, pp::DType::F16, pp::DType::BF16})
    for (std::size_t cols : {kLong + 1, kLong + 70, 2 * kLong}) {
      const std::size_t rows = 23;
      const Stored w = store(t, randv(rows * cols, rng));
      const std::vector<float> x = randv(3 * cols, rng);
      pp::MatView mv{t, w.bytes.data(), rows, cols, pp::row_bytes(t, cols)};
      const pp::test::Dots o = pp::test::dots(w.values, x, 1, rows, cols);
      for_each_arch([&](auto a) {
        using A = decltype(a);
        std::vector<float> y1(rows, NAN), y3(3 * rows, NAN), ysplit(rows, NAN);
        pp::kernels::matmul_rows<A>(mv, x.data(), 1, y1.data(), 0, rows);
        pp::kernels::matmul_rows<A>(mv, x.data(), 3, y3.data(), 0, rows);
        pp::kernels::matmul_rows<A>(mv, x.data(), 1, ysplit.data(), 0, 5);
        pp::kernels::matmul_rows<A>(mv, x.data(), 1, ysplit.data(), 5, rows);
        for (std::size_t r = 0; r < rows; ++r) {
          ASSERT_EQ(std::bit_cast<uint32_t>(y1[r]), std::bit_cast<uint32_t>(y3[r]))
              << A::name() << " " << pp::dtype_name(t) << " cols " << cols << " row " << r;
          ASSERT_EQ(std::bit_cast<uint32_t>(y1[r]), std::bit_cast<uint32_t>(ysplit[r])) << A::name() << " row " << r;
          ASSERT_NEAR(y1[r], o.want(0, r), 1e-6 * o.mag(0, r) + 1e-30) << A::name() << " " << pp::dtype_name(t);
        }
      });
    }
}

// Through pp::kernels::matmul for bulk rows: on AMX machines BF16/F16 weights run on tiles (32-row
// blocks) with the remaining rows on the AVX path; both must match the oracle and be independent of
// batch and threads.
TEST(Matmul, DispatchedHalfPathsMatchOracleAndAreBatchInvariant) {
  std::printf("AMX %s\n", pp::kernels::amx::available() ? "available: tiles in use for BF16/F16" : "not available");
  std::mt19937 rng(11);
  for (pp::DType type : {pp::DType::BF16, pp::DType::F16})
  for (std::size_t rows : {32, 100, 200, 600})
    for (std::size_t cols : {64, 256, 1536, 2048}) {
      if (rows == 600 && cols < 1536) continue;  // several row groups of the tile kernel; k in uneven chunks
      const Stored w = store(type, randv(rows * cols, rng));
      const std::size_t m = 37;
      const std::vector<float> x = randv(m * cols, rng, 3.f);
      const pp::test::Dots o = pp::test::dots(w.values, x, m, rows, cols);
      pp::MatView mv{type, w.bytes.data(), rows, cols, cols * 2};
      std::vector<float> y(m * rows), y1(rows), y3(m * rows);
      pp::ThreadPool p1(1), p3(3);
      pp::kernels::matmul(p1, mv, x.data(), m, y.data(), {}, /*bulk=*/true);
      pp::kernels::matmul(p3, mv, x.data(), m, y3.data(), {}, true);
      EXPECT_EQ(y, y3);
      for (std::size_t i = 0; i < m; ++i) {
        pp::kernels::matmul(p1, mv, x.data() + i * cols, 1, y1.data(), {}, true);
        for (std::size_t r = 0; r < rows; ++r) {
          ASSERT_EQ(y1[r], y[i * rows + r]) << "row " << r << " token " << i;
          ASSERT_NEAR(y[i * rows + r], o.want(i, r), 1e-6 * o.mag(i, r) + 1e-30) << "rows " << rows << " cols " << cols;
        }
      }
    }
}
}  // namespace

namespace {
// The vector tile kernel of bulk requests (gemm.hpp) on every compiled-in architecture: full and last
// row blocks (12 or 6 rows a tile), full and partial token blocks, odd and even k, several token chunks; each
// (row, token) result within f32 rounding of a float64 oracle and bit-identical whatever the number of
// tokens computed with it and whatever the row range a task was given.
TEST(Gemm, EveryTypeAndArchAgainstOracleAndShapeInvariant) {
  std::mt19937 rng(5);
  for (pp::DType type : {pp::DType::F32, pp::DType::F16, pp::DType::BF16})
    for (std::size_t cols : {16, 37, 64, 200, 1000, 2048})
      for (std::size_t rows : {1, 3, 4, 9, 23, 110}) {
        if (rows == 110 && cols != 1000) continue;  // 110: several groups of row blocks (gemm::kGroupBlocks)
        const Stored w = store(type, randv(rows * cols, rng));
        // 2048: several token chunks (gemm::kChunkBytes); 1000 and 2048: several segments of k
        // (gemm::kSegK), 1000 with a short last one.
        const std::size_t m = cols == 2048 ? 70 : 13;
        const std::vector<float> x = randv(m * cols, rng, 2.f);
        pp::MatView mv{type, w.bytes.data(), rows, cols, pp::row_bytes(type, cols)};
        const pp::test::Dots o = pp::test::dots(w.values, x, m, rows, cols);
        for_each_arch([&](auto a) {
          using A = decltype(a);
          std::vector<float> y(m * rows, NAN), y1(rows, NAN), ysplit(m * rows, NAN);
          pp::kernels::gemm::matmul_rows<A>(mv, x.data(), m, y.data(), 0, rows);
          // The same rows in two task ranges that cut a register tile.
          const std::size_t cut = rows / 2 + (rows > 4 ? 1 : 0);
          pp::kernels::gemm::matmul_rows<A>(mv, x.data(), m, ysplit.data(), 0, cut);
          pp::kernels::gemm::matmul_rows<A>(mv, x.data(), m, ysplit.data(), cut, rows);
          EXPECT_EQ(y, ysplit) << A::name();
          for (std::size_t i = 0; i < m; ++i) {
            pp::kernels::gemm::matmul_rows<A>(mv, x.data() + i * cols, 1, y1.data(), 0, rows);
            for (std::size_t r = 0; r < rows; ++r) {
              ASSERT_EQ(std::bit_cast<uint32_t>(y1[r]), std::bit_cast<uint32_t>(y[i * rows + r]))
                  << A::name() << " row " << r << " token " << i;
              ASSERT_NEAR(y[i * rows + r], o.want(i, r), 1e-6 * o.mag(i, r) + 1e-30)
                  << A::name() << " type " << int(type) << " cols " << cols << " rows " << rows;
              // One chain over k in order, however k is cut into segments (simd::fma: fused where the
              // architecture has an FMA, a multiply and an add on SSE4.2).
              using B = pp::simd::fbatch<A>;
              B chain(0.f);
              for (std::size_t j = 0; j < cols; ++j) chain = pp::simd::fma(B(w.values[r * cols + j]), B(x[i * cols + j]), chain);
              ASSERT_EQ(std::bit_cast<uint32_t>(chain.get(0)), std::bit_cast<uint32_t>(y[i * rows + r]))
                  << A::name() << " row " << r << " token " << i << " cols " << cols;
            }
          }
        });
      }
}
}  // namespace

namespace {
// The fast path of BF16 weights (gemm.hpp, AVX512-BF16 or AArch64 BF16): against a float64 oracle on the bf16-rounded
// activations (products of two bf16 are exact in f32, so only the f32 sums round), full and last row
// blocks, partial token blocks, odd k (a last pair with a zero partner), several token chunks; bit-identical whatever the token count and the row range of a task; and
// through kernels::matmul for bulk rows with fast_float, independent of the thread count.
TEST(GemmFastBf16, AgainstOracleOnRoundedActivationsAndShapeInvariant) {
  if (!pp::kernels::gemm::kHaveFastBf16) GTEST_SKIP() << "no bf16 dot in this build (AVX512-BF16, AArch64 BF16)";
#if PP_HAVE_BF16_DOT
  std::mt19937 rng(9);
  for (std::size_t cols : {32, 37, 64, 201, 2048})
    for (std::size_t rows : {1, 3, 4, 9, 23}) {
      const Stored w = store(pp::DType::BF16, randv(rows * cols, rng));
      const std::size_t m = cols == 2048 ? 140 : 13;  // 2048: several token chunks
      const std::vector<float> x = randv(m * cols, rng, 2.f);
      std::vector<float> xr(m * cols);  // the activations rounded to bf16, as the kernel sees them
      for (std::size_t i = 0; i < x.size(); ++i) xr[i] = pp::bf16_to_f32(pp::f32_to_bf16(x[i]));
      const pp::test::Dots o = pp::test::dots(w.values, xr, m, rows, cols);
      pp::MatView mv{pp::DType::BF16, w.bytes.data(), rows, cols, cols * 2};
      std::vector<float> y(m * rows, NAN), y1(rows, NAN), ysplit(m * rows, NAN);
      pp::kernels::gemm::matmul_rows<pp::simd::Best>(mv, x.data(), m, y.data(), 0, rows, true);
      const std::size_t cut = rows / 2 + (rows > 4 ? 1 : 0);
      pp::kernels::gemm::matmul_rows<pp::simd::Best>(mv, x.data(), m, ysplit.data(), 0, cut, true);
      pp::kernels::gemm::matmul_rows<pp::simd::Best>(mv, x.data(), m, ysplit.data(), cut, rows, true);
      EXPECT_EQ(y, ysplit);
      for (std::size_t i = 0; i < m; ++i) {
        pp::kernels::gemm::matmul_rows<pp::simd::Best>(mv, x.data() + i * cols, 1, y1.data(), 0, rows, true);
        for (std::size_t r = 0; r < rows; ++r) {
          ASSERT_EQ(std::bit_cast<uint32_t>(y1[r]), std::bit_cast<uint32_t>(y[i * rows + r])) << r << " " << i;
          ASSERT_NEAR(y[i * rows + r], o.want(i, r), 1e-6 * o.mag(i, r) + 1e-30) << "cols " << cols << " rows " << rows;
        }
      }
      // Dispatched: bulk rows with fast_float take this kernel, on any thread count.
      std::vector<uint8_t> xq(m * pp::kernels::xq_row_bytes(cols));
      std::vector<float> yd(m * rows), yd3(m * rows);
      pp::ThreadPool p1(1), p3(3);
      pp::kernels::matmul(p1, mv, x.data(), m, yd.data(), {false, xq, true}, /*bulk=*/true);
      pp::kernels::matmul(p3, mv, x.data(), m, yd3.data(), {false, xq, true}, true);
      EXPECT_EQ(yd, y);
      EXPECT_EQ(yd3, y);
    }
#endif
}

// The fast path's decode kernel (matmul.hpp's dot_tile_bf16: requests under kBulkRows rows with
// fast_float): against the float64 oracle on the bf16-rounded activations, widths with and without a
// 64- and 32-element tail; every row of an m-row request bit-identical to the same row alone (m up to
// 15: full and partial 4-token and 4-row tiles; one row a tile for up to 8 tokens where their x tile
// fits in 16 KiB, as at 2048 columns, and at 4096 for 1-2 tokens but four rows a tile from 3) and to any
// thread count; and not the exact path's result.
TEST(MatmulFastBf16, DecodeRowsAgainstOracleAndEqualAlone) {
  if (!pp::kernels::gemm::kHaveFastBf16) GTEST_SKIP() << "no bf16 dot in this build (AVX512-BF16, AArch64 BF16)";
  std::mt19937 rng(11);
  for (std::size_t cols : {32, 37, 64, 96, 201, 2048, 4096})
    for (std::size_t rows : {1, 5, 17, 40}) {
      const Stored w = store(pp::DType::BF16, randv(rows * cols, rng));
      constexpr std::size_t m = pp::kernels::kBulkRows - 1;
      const std::vector<float> x = randv(m * cols, rng, 2.f);
      std::vector<float> xr(m * cols);
      for (std::size_t i = 0; i < x.size(); ++i) xr[i] = pp::bf16_to_f32(pp::f32_to_bf16(x[i]));
      const pp::test::Dots o = pp::test::dots(w.values, xr, m, rows, cols);
      pp::MatView mv{pp::DType::BF16, w.bytes.data(), rows, cols, cols * 2};
      std::vector<uint8_t> xq(m * pp::kernels::xq_row_bytes(cols));
      pp::ThreadPool p1(1), p3(3);
      std::vector<float> y(m * rows, NAN), y3(m * rows, NAN), exact(m * rows, NAN), y1(rows, NAN);
      pp::kernels::matmul(p1, mv, x.data(), m, y.data(), {false, xq, true});
      pp::kernels::matmul(p3, mv, x.data(), m, y3.data(), {false, xq, true});
      pp::kernels::matmul(p1, mv, x.data(), m, exact.data(), {false, xq, false});
      EXPECT_EQ(y, y3) << "cols " << cols << " rows " << rows;
      bool differs = false;
      for (std::size_t n = 1; n <= m; ++n) {  // the first n rows as one request
        std::vector<float> yn(n * rows, NAN);
        pp::kernels::matmul(p1, mv, x.data(), n, yn.data(), {false, xq, true});
        for (std::size_t i = 0; i < n * rows; ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(yn[i]), std::bit_cast<uint32_t>(y[i])) << "n " << n << " at " << i;
      }
      for (std::size_t i = 0; i < m; ++i)
        for (std::size_t r = 0; r < rows; ++r) {
          ASSERT_NEAR(y[i * rows + r], o.want(i, r), 1e-6 * o.mag(i, r) + 1e-30) << "cols " << cols << " rows " << rows;
          differs = differs || y[i * rows + r] != exact[i * rows + r];
        }
      EXPECT_TRUE(differs) << "the fast decode path gave the exact path's bits: was it taken?";
    }
}
}  // namespace

namespace {
// Attention (attention.hpp) on every compiled-in architecture: attn_scores and attn_values for 1..8 query
// heads per KV head, head dims with and without a vector tail, key counts on and off the SIMD width.
namespace attn = pp::kernels;
using attn::kAttnPad;

constexpr std::size_t kGroups[] = {1, 2, 3, 4, 5, 6, 7, 8};
constexpr std::size_t kHeadDims[] = {5, 20, 64, 128};  // 5, 20: a scalar head-dimension tail on every width
constexpr std::size_t kCounts[] = {1, 7, 16, 33, 257};

// A marker the kernels never compute from finite inputs: left in place where nothing may be written.
const float kUntouched = std::bit_cast<float>(0x7fc0dead);
bool untouched(float x) { return std::bit_cast<uint32_t>(x) == 0x7fc0deadu; }

// Keys transposed ([hd][ld]) as the KV ring stores them: `count` random keys, NaN in the lanes past them
// (loaded whole but ignored), and nothing past what attn_scores may read (kt[d * ld + j], j < count + kAttnPad - 1).
struct Keys {
  std::size_t hd, count, ld;
  std::vector<float> kt;
  Keys(std::size_t hd_, std::size_t count_, std::mt19937& rng)
      : hd(hd_), count(count_), ld(count_ + kAttnPad + 3), kt((hd_ - 1) * ld + count_ + kAttnPad - 1, NAN) {
    std::normal_distribution<float> nd;
    for (std::size_t d = 0; d < hd; ++d)
      for (std::size_t j = 0; j < count; ++j) kt[d * ld + j] = nd(rng);
  }
};

// a * b + c as architecture A's FMA computes it (one rounding where A has fused FMA).
template <class A>
float arch_fma(float a, float b, float c) {
  using B = pp::simd::fbatch<A>;
  return pp::simd::fma<A>(B(a), B(b), B(c)).get(0);
}

// Scores against Eigen float64: each within gamma(2 hd + 1) (hd FMAs, two roundings each where the FMA is a
// multiply and an add, then the scale) of the sum of |scale * q * k|; the padding contract holds: nothing
// written past j = count + kAttnPad - 1 of a score row, nor past the last row.
TEST(Attention, ScoresMatchFloat64OracleAndKeepToTheirPadding) {
  std::mt19937 rng(17);
  for (std::size_t group : kGroups)
    for (std::size_t hd : kHeadDims)
      for (std::size_t count : kCounts) {
        const Keys k(hd, count, rng);
        const std::vector<float> q = randv(group * hd, rng);
        const float scale = 1 / std::sqrt(float(hd));
        const std::size_t ws = count + kAttnPad + 2, guard = 64;
        const Eigen::MatrixXd Q = f64(q, group, hd), K = f64(k.kt.data(), hd, count, k.ld);
        const Eigen::MatrixXd want = double(scale) * Q * K, mag = std::abs(double(scale)) * Q.cwiseAbs() * K.cwiseAbs();
        const double tol = pp::test::gamma_f32(2 * hd + 1);
        for_each_arch([&](auto a) {
          using A = decltype(a);
          std::vector<float> w(group * ws + guard, kUntouched);
          attn::attn_scores<A>(q.data(), group, hd, k.kt.data(), k.ld, count, scale, w.data(), ws);
          for (std::size_t h = 0; h < group; ++h) {
            for (std::size_t j = 0; j < count; ++j)
              ASSERT_NEAR(w[h * ws + j], want(h, j), tol * mag(h, j) + 1e-30)
                  << A::name() << " group " << group << " hd " << hd << " count " << count << " head " << h << " key " << j;
            for (std::size_t j = count + kAttnPad - 1; j < ws; ++j)
              ASSERT_TRUE(untouched(w[h * ws + j])) << A::name() << " wrote score " << j << " of " << count << " keys";
          }
          for (std::size_t i = group * ws; i < w.size(); ++i) ASSERT_TRUE(untouched(w[i])) << A::name() << " past the rows";
        });
      }
}

// Each score is one FMA chain over the head dimension in order, then the scale (attention.hpp): bit for bit
// that chain on every architecture, so a key scores the same whichever lane or block it falls in; keys
// rotated by r positions give the same scores rotated by r (key 0 moved to lane 17, etc.).
TEST(Attention, ScoreIsOneChainWhateverTheKeysLane) {
  std::mt19937 rng(19);
  for (std::size_t group : {1, 3, 8})
    for (std::size_t hd : kHeadDims)
      for (std::size_t count : kCounts) {
        const Keys k(hd, count, rng);
        Keys rot = k;  // key j of rot is key (j + r) % count of k
        const std::size_t r = 17 % count;
        for (std::size_t d = 0; d < hd; ++d)
          for (std::size_t j = 0; j < count; ++j) rot.kt[d * k.ld + j] = k.kt[d * k.ld + (j + r) % count];
        const std::vector<float> q = randv(group * hd, rng);
        const float scale = 1 / std::sqrt(float(hd));
        const std::size_t ws = count + kAttnPad;
        for_each_arch([&](auto a) {
          using A = decltype(a);
          std::vector<float> w(group * ws), wr(group * ws);
          attn::attn_scores<A>(q.data(), group, hd, k.kt.data(), k.ld, count, scale, w.data(), ws);
          attn::attn_scores<A>(q.data(), group, hd, rot.kt.data(), k.ld, count, scale, wr.data(), ws);
          for (std::size_t h = 0; h < group; ++h)
            for (std::size_t j = 0; j < count; ++j) {
              float acc = 0.f;
              for (std::size_t d = 0; d < hd; ++d) acc = arch_fma<A>(q[h * hd + d], k.kt[d * k.ld + j], acc);
              ASSERT_EQ(std::bit_cast<uint32_t>(w[h * ws + j]), std::bit_cast<uint32_t>(acc * scale))
                  << A::name() << " hd " << hd << " count " << count << " head " << h << " key " << j;
              ASSERT_EQ(std::bit_cast<uint32_t>(wr[h * ws + j]), std::bit_cast<uint32_t>(w[h * ws + (j + r) % count]))
                  << A::name() << " key " << (j + r) % count << " in lane " << j;
            }
        });
      }
}

// Values by rows ([count][vs], vs > hd as in the KV ring), scores rows `ws` apart, onto random outputs.
struct ValuesCase {
  std::size_t group, hd, count, ws, vs;
  std::vector<float> w, v, out0;
  ValuesCase(std::size_t group_, std::size_t hd_, std::size_t count_, std::mt19937& rng)
      : group(group_), hd(hd_), count(count_), ws(count_ + kAttnPad), vs(hd_ + 3),
        w(randv(group_ * ws, rng)), v(randv((count_ - 1) * vs + hd_, rng)), out0(randv(group_ * hd_, rng)) {}
};

// Weighted sums against Eigen float64: out0 + W V, each element within gamma(2 count) (count FMAs, two
// roundings each at most) of |out0| + the sum of |w v|; nothing written past group * hd outputs.
TEST(Attention, ValuesMatchFloat64OracleAndStayInTheirOutputs) {
  std::mt19937 rng(23);
  for (std::size_t group : kGroups)
    for (std::size_t hd : kHeadDims)
      for (std::size_t count : kCounts) {
        const ValuesCase c(group, hd, count, rng);
        const Eigen::MatrixXd W = f64(c.w.data(), group, count, c.ws), V = f64(c.v.data(), count, hd, c.vs),
                              O = f64(c.out0, group, hd);
        const Eigen::MatrixXd want = O + W * V, mag = O.cwiseAbs() + W.cwiseAbs() * V.cwiseAbs();
        const double tol = pp::test::gamma_f32(2 * count);
        for_each_arch([&](auto a) {
          using A = decltype(a);
          std::vector<float> out(c.out0);
          out.resize(group * hd + 64, kUntouched);
          attn::attn_values<A>(c.w.data(), c.ws, group, hd, c.v.data(), c.vs, count, out.data());
          for (std::size_t h = 0; h < group; ++h)
            for (std::size_t d = 0; d < hd; ++d)
              ASSERT_NEAR(out[h * hd + d], want(h, d), tol * mag(h, d) + 1e-30)
                  << A::name() << " group " << group << " hd " << hd << " count " << count << " head " << h << " dim " << d;
          for (std::size_t i = group * hd; i < out.size(); ++i) ASSERT_TRUE(untouched(out[i])) << A::name();
        });
      }
}

// Each output element is one FMA chain over the keys in order, continued across calls (attention.hpp): bit
// for bit that chain on every architecture (the head-dimension tail past the last whole vector is std::fma),
// and the same whether the keys come in one call or split in two at any key.
TEST(Attention, ValueIsOneChainAcrossKeyRanges) {
  std::mt19937 rng(29);
  for (std::size_t group : {1, 3, 8})
    for (std::size_t hd : kHeadDims)
      for (std::size_t count : kCounts) {
        const ValuesCase c(group, hd, count, rng);
        for_each_arch([&](auto a) {
          using A = decltype(a);
          const std::size_t hdv = hd / pp::simd::fbatch<A>::size * pp::simd::fbatch<A>::size;
          std::vector<float> out(c.out0), split(c.out0);
          attn::attn_values<A>(c.w.data(), c.ws, group, hd, c.v.data(), c.vs, count, out.data());
          const std::size_t cut = count / 3;
          attn::attn_values<A>(c.w.data(), c.ws, group, hd, c.v.data(), c.vs, cut, split.data());
          attn::attn_values<A>(c.w.data() + cut, c.ws, group, hd, c.v.data() + cut * c.vs, c.vs, count - cut, split.data());
          for (std::size_t h = 0; h < group; ++h)
            for (std::size_t d = 0; d < hd; ++d) {
              float acc = c.out0[h * hd + d];
              for (std::size_t j = 0; j < count; ++j) {
                const float p = c.w[h * c.ws + j], x = c.v[j * c.vs + d];
                acc = d < hdv ? arch_fma<A>(p, x, acc) : std::fma(p, x, acc);
              }
              ASSERT_EQ(std::bit_cast<uint32_t>(out[h * hd + d]), std::bit_cast<uint32_t>(acc))
                  << A::name() << " hd " << hd << " count " << count << " head " << h << " dim " << d;
              ASSERT_EQ(std::bit_cast<uint32_t>(split[h * hd + d]), std::bit_cast<uint32_t>(acc)) << A::name() << " cut " << cut;
            }
        });
      }
}
}  // namespace
