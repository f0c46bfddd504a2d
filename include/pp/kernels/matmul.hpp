// Matrix products against stored weights (F32 / F16 / BF16 here, ggml's quantized formats in quant.hpp).
//
// Invariant: the dot product of one weight row with one activation row is computed by the same
// sequence of operations whether it is part of a 1-token matvec or an n-token matmul, and whatever
// thread computes it, within each of two paths: requests of kBulkRows rows or more (prompts) take the
// tile kernels (AMX, or gemm.hpp's vector register tiles), shorter ones (decode steps) the dot kernels
// below. A row's path depends only on its own request's size, so split pipelines, batches and thread
// counts never change a result.
#pragma once

#include <pp/core/dtype.hpp>
#include <pp/core/thread_pool.hpp>
#include <pp/kernels/quant.hpp>
#include <pp/kernels/amx.hpp>
#include <pp/kernels/gemm.hpp>
#include <pp/kernels/gemm_f16.hpp>
#include <pp/kernels/gemm_q8.hpp>
#include <pp/kernels/simd.hpp>

#include <algorithm>
#include <array>
#include <cassert>
#include <cstddef>
#include <cstdlib>
#include <span>
#include <utility>
#include <vector>

namespace pp::kernels {

// y[t * ys + r] = dot(w[r * ws + (0, n)], x[t * xs + (0, n)]) for r < NR rows, t < NT tokens. Each (row,
// token) pair sums K chains of W-lane steps in the same order whatever NR and NT are, so a row's result
// does not depend on the tile it was computed in. Several rows a tile (decode steps, NT = 1) load each
// slice of x once for all of them: a row of 8192 has 32 KiB of f32 activations, a whole L1, which one row
// at a time would fetch again from L2 for every row (2048 x 8192 streamed at 18 GB/s one row a time
// against 42 for 8192 x 2048 on Zen 4, see docs/PERFORMANCE.md).
template <class A, class WT, int NR, int NT>
inline void dot_tile(const typename WT::storage* w, std::size_t ws, const float* x, std::size_t xs, std::size_t n,
                     float* y, std::size_t ys) {
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size;
  constexpr int K = simd::kWeightAccumulators<A, WT>;
  B acc[NR][NT][K];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      for (int k = 0; k < K; ++k) acc[r][t][k] = B(0.f);
  std::size_t i = 0;
  for (; i + K * W <= n; i += K * W) {
    for (int r = 0; r < NR; ++r) simd::prefetch_ahead(w + r * ws + i, K * W * sizeof(*w));
    for (int k = 0; k < K; ++k) {
      B xk[NT];
      for (int t = 0; t < NT; ++t) xk[t] = B::load_unaligned(x + t * xs + i + k * W);
      for (int r = 0; r < NR; ++r) {
        const B wk = simd::load<A>(WT{}, w + r * ws + i + k * W);
        for (int t = 0; t < NT; ++t) acc[r][t][k] = simd::fma(wk, xk[t], acc[r][t][k]);
      }
    }
  }
  for (; i + W <= n; i += W)
    for (int r = 0; r < NR; ++r) {
      const B wk = simd::load<A>(WT{}, w + r * ws + i);
      for (int t = 0; t < NT; ++t) acc[r][t][0] = simd::fma(wk, B::load_unaligned(x + t * xs + i), acc[r][t][0]);
    }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      B s = acc[r][t][0];
      for (int k = 1; k < K; ++k) s += acc[r][t][k];
      float v = xsimd::hadd(s);
      for (std::size_t j = i; j < n; ++j) v += simd::load1(WT{}, w + r * ws + j) * x[t * xs + j];
      y[t * ys + r] = v;
    }
}

// A decode step (one token) over long rows takes four rows a tile, whose 4 x K accumulators fit the
// registers of every target; rows of at most kDecodeTileMinCols (16 KiB of activations, half an L1) go one
// at a time, which streams them faster. Measured on Zen 4, F16 decode at 1 thread (docs/PERFORMANCE.md,
// "Long rows in decode"): four-row tiles on every matrix 9.5 -> 7.7 tok/s, on the down projection (8192
// columns) only 9.5 -> 11.2; two-row tiles there 10.3.
inline constexpr int kDecodeTileRows = 4;
inline constexpr std::size_t kDecodeTileMinCols = 4096;

// y[m, w.rows] (rows [r0, r1) only) = x[m, w.cols] * w^T.
template <class A, class WT>
inline void matmul_rows_typed(const MatView& w, const float* x, std::size_t m, float* y, std::size_t r0,
                              std::size_t r1) {
  using S = typename WT::storage;
  const std::size_t n = w.cols, ys = w.rows;
  assert(w.row_stride % sizeof(S) == 0);
  const std::size_t ws = w.row_stride / sizeof(S);
  const auto row = [&](std::size_t r) { return reinterpret_cast<const S*>(w.row(r)); };
  // A block of weight rows stays in cache while every token tile passes over it.
  constexpr std::size_t kRowBlock = 16;
  for (std::size_t rb = r0; rb < r1; rb += kRowBlock) {
    const std::size_t re = std::min(rb + kRowBlock, r1);
    std::size_t t = 0;
    for (; t + 4 <= m; t += 4)
      for (std::size_t r = rb; r < re; ++r) dot_tile<A, WT, 1, 4>(row(r), ws, x + t * n, n, n, y + t * ys + r, ys);
    std::size_t r = rb;
    if (m - t == 1 && n > kDecodeTileMinCols)
      for (; r + kDecodeTileRows <= re; r += kDecodeTileRows)
        dot_tile<A, WT, kDecodeTileRows, 1>(row(r), ws, x + t * n, n, n, y + t * ys + r, ys);
    for (; r < re; ++r) {
      switch (m - t) {
        case 3: dot_tile<A, WT, 1, 3>(row(r), ws, x + t * n, n, n, y + t * ys + r, ys); break;
        case 2: dot_tile<A, WT, 1, 2>(row(r), ws, x + t * n, n, n, y + t * ys + r, ys); break;
        case 1: dot_tile<A, WT, 1, 1>(row(r), ws, x + t * n, n, n, y + t * ys + r, ys); break;
        default: break;
      }
    }
  }
}

#if PP_HAVE_BF16_DOT
// The fast path's dot kernel (BF16 weights, activations rounded to bf16: xb): y[t * ys + r] =
// dot(w[r * ws + (0, n)], xb[t * xs + (0, n)]) for r < R rows, t < T tokens, the bf16 dot (Bf16Dot). R x T
// accumulators, one a (row, token) pair, each summing its Bf16Dot::kElems-element steps in order: a row's result
// does not depend on the rows and tokens beside it. Each weight vector loaded serves T tokens and each
// activation vector R rows, so the tile computes rather than loads.
template <int R, int T>
inline void dot_tile_bf16(const uint16_t* w, std::size_t ws, const uint16_t* xb, std::size_t xs, std::size_t n,
                          float* y, std::size_t ys) {
  using D = simd::Bf16Dot;
  constexpr std::size_t E = D::kElems;
  typename D::Acc acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = D::zero();
  std::size_t i = 0;
  for (; i + E <= n; i += E) {
    typename D::Vec wv[R];
    for (int r = 0; r < R; ++r) {
      simd::prefetch_ahead(w + r * ws + i, E * sizeof(*w));
      wv[r] = D::loadu(w + r * ws + i);
    }
    for (int t = 0; t < T; ++t) {
      const typename D::Vec xv = D::loadu(xb + t * xs + i);
      for (int r = 0; r < R; ++r) acc[r][t] = D::dot(acc[r][t], wv[r], xv);
    }
  }
  if (i < n) {
    typename D::Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = D::load_first(w + r * ws + i, n - i);
    for (int t = 0; t < T; ++t) {
      const typename D::Vec xv = D::load_first(xb + t * xs + i, n - i);
      for (int r = 0; r < R; ++r) acc[r][t] = D::dot(acc[r][t], wv[r], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[t * ys + r] = D::sum(acc[r][t]);
}

namespace detail {
inline constexpr int kBf16TileRows = 4, kBf16TileTokens = 4;
inline constexpr std::size_t kOneStreamXBytes = 16 * 1024;  // half or less of every L1d we target
using Bf16DotTileFn = void (*)(const uint16_t*, std::size_t, const uint16_t*, std::size_t, std::size_t, float*,
                               std::size_t);
template <int... I>
constexpr auto bf16_dot_tiles(std::integer_sequence<int, I...>) {  // [R - 1][T - 1]
  return std::array<Bf16DotTileFn, sizeof...(I)>{&dot_tile_bf16<I / kBf16TileTokens + 1, I % kBf16TileTokens + 1>...};
}
inline constexpr auto kBf16DotTiles =
    bf16_dot_tiles(std::make_integer_sequence<int, kBf16TileRows * kBf16TileTokens>{});
}  // namespace detail

// y[m, w.rows] (rows [r0, r1) only) = xb[m, w.cols] * w^T, BF16 weights, xb rounded to bf16 (its rows
// xs elements apart).
inline void matmul_rows_bf16(const MatView& w, const uint16_t* xb, std::size_t xs, std::size_t m, float* y,
                             std::size_t r0, std::size_t r1) {
  constexpr std::size_t R = detail::kBf16TileRows, T = detail::kBf16TileTokens;
  const std::size_t n = w.cols, ys = w.rows, ws = w.row_stride / 2;
  // Few rows (decode steps of up to 8 sequences) whose token tile of x fits in L1 beside the streamed
  // weights take one row a tile: one stream through the rows, every token tile over the row while it is
  // in L1. With four rows a tile, four streams: 0.63-0.76 of the triad for one token, against 0.93-0.98
  // with one; 2, 4 and 8 tokens 1.35x, 1.48x and 1.11x the GB/s (means, pp_bench MatmulFew,
  // docs/PERFORMANCE.md). Larger x tiles (3+ tokens against 4096 columns, 2+ against the 8192-wide down
  // projection) and more tokens keep four rows a tile: each x vector read serves four rows. One token
  // always takes one stream.
  const bool one_stream =
      m == 1 || (m <= 2 * T && std::min(m, T) * n * sizeof(uint16_t) <= detail::kOneStreamXBytes);
  const std::size_t rows_per_tile = one_stream ? 1 : R;  // R rows: 16 KiB at n = 2048, in L1 for every token tile
  for (std::size_t r = r0; r < r1; r += rows_per_tile) {
    const std::size_t rn = std::min(rows_per_tile, r1 - r);
    const auto* wr = reinterpret_cast<const uint16_t*>(w.row(r));
    for (std::size_t t = 0; t < m; t += T) {
      const std::size_t tn = std::min(T, m - t);
      detail::kBf16DotTiles[(rn - 1) * T + (tn - 1)](wr, ws, xb + t * xs, xs, n, y + t * ys + r, ys);
    }
  }
}
#endif

// xq: for quantized w, the rows of x quantized by quant::quantize_act_row (fast path); null = exact path.
template <class A>
inline void matmul_rows(const MatView& w, const float* x, std::size_t m, float* y, std::size_t r0, std::size_t r1,
                        const uint8_t* xq = nullptr) {
  switch (w.type) {
    case DType::F32: return matmul_rows_typed<A, simd::F32w>(w, x, m, y, r0, r1);
    case DType::F16: return matmul_rows_typed<A, simd::F16w>(w, x, m, y, r0, r1);
    case DType::BF16: return matmul_rows_typed<A, simd::Bf16w>(w, x, m, y, r0, r1);
    default: return quant::matmul_rows<A>(w, x, xq, m, y, r0, r1);
  }
}

// The numeric path of a matmul. Quantized weights: exact = weights dequantized to f32 inside the dot;
// fast = x's rows quantized once per call into the caller's `xq`, integer dot products. BF16 weights with
// fast_float (where the CPU has a bf16 dot, gemm::kHaveFastBf16): x rounded to bf16 as gemm.hpp packs
// it, the bf16 dot: vdpbf16ps or bfdot (the tiles for bulk requests, dot_tile_bf16 for decode steps), llama.cpp's numerics.
// F16 weights with fast_float (where gemm_f16's int16 tiles exist): bulk requests on those tiles (x and
// w as int16 codes with power-of-two scales, closer to exact than llama.cpp's f16 activations), decode
// steps exact. Otherwise float weights are exact.
struct QuantPath {
  bool fast = false;
  std::span<uint8_t> xq;  // [m, xq_row_bytes(w.cols)] bytes
  bool fast_float = false;
};

// Bytes of one row of `xq` for matmuls of input width up to n.
inline constexpr std::size_t xq_row_bytes(std::size_t n) { return quant::act_row_bytes_bound(n); }

// Whether this build has a fast path for some float weights (BF16's bf16 dot, F16's int16 tiles).
inline constexpr bool kHaveFastFloat = gemm::kHaveFastBf16 || gemm_f16::kAvailable;

// The default of fast_float on this CPU, from the measurements in docs/PERFORMANCE.md: fast where this
// build has a fast path (the bf16 dot, the int16 tiles), except on AMX CPUs, whose exact tiles are faster
// still; PP_EXACT_FLOAT=1 (what the tools' --exact-float sets) makes the exact path the default of every
// stage of the process.
inline bool fast_float_default() {
  const char* exact = std::getenv("PP_EXACT_FLOAT");
  if (exact && exact[0] == '1') return false;
  return kHaveFastFloat && !amx::available();
}

#if PP_HAVE_AMX
// BF16 / F16 weights on AMX: whole 32-row blocks on tiles, the remaining rows (if any) on the AVX path.
template <class A>
inline void matmul_amx(ThreadPool& pool, const MatView& w, const float* x, std::size_t m, float* y) {
  // Grows to the largest call, then reused: no per-token allocation. Workers must see the caller's
  // instance, so it is passed by reference (a thread_local named inside the lambda would be theirs).
  static thread_local amx::PackedX tls;
  amx::PackedX& px = tls;
  amx::pack(x, m, w.cols, px, pool);
  const std::size_t blocks = w.rows / amx::kRowBlock, tail = blocks * amx::kRowBlock;
  pool.parallel_for(blocks, [&](std::size_t b, std::size_t e, unsigned) {
    amx::matmul_rows(w, px, m, y, b * amx::kRowBlock, e * amx::kRowBlock);
  });
  if (tail < w.rows) matmul_rows<A>(w, x, m, y, tail, w.rows);
}
#endif

// Requests of at least this many rows (prompts) are "bulk": float weights run on tile kernels (AMX
// tiles, else vector register tiles), many times faster for many rows but summing in a different order
// from the dot kernels, which every shorter request (a decode step) takes because they stream the
// weights faster for one row.
inline constexpr std::size_t kBulkRows = 16;

// Whether bulk rows against weights of type t take a tile kernel (and so sum in another order than the
// dot kernels of a decode step): float weights do, Q8_0 on the fast path where VNNI tiles are compiled
// in; other quantized formats keep one path.
inline bool bulk_on_tiles(DType t, bool fast_quant = true) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16 ||
         (t == DType::Q8_0 && fast_quant && gemm_q8::kAvailable);
}

// x [m, n] rounded to bf16 (as gemm.hpp packs it) into buf, grown to the largest call. Rows 64-byte
// aligned (a vector load across two cache lines costs a second access in every tile step) and one cache
// line more apart than whole lines, so that rows of 4 KiB multiples do not all fall in the same L1 sets
// as each other and the weight rows.
struct Bf16Rows {
  const uint16_t* data;
  std::size_t stride;  // elements from one row to the next
};
inline Bf16Rows round_rows_bf16(const float* x, std::size_t m, std::size_t n, std::vector<uint16_t>& buf) {
  constexpr std::size_t kLine = 64 / sizeof(uint16_t);
  const std::size_t xs = (n + kLine - 1) / kLine * kLine + kLine;
  if (buf.size() < m * xs + kLine) buf.resize(m * xs + kLine);
  uint16_t* xb = buf.data() + (kLine - reinterpret_cast<std::uintptr_t>(buf.data()) / sizeof(uint16_t) % kLine) % kLine;
  for (std::size_t t = 0; t < m; ++t)
    for (std::size_t i = 0; i < n; ++i) xb[t * xs + i] = f32_to_bf16(x[t * n + i]);
  return {xb, xs};
}

// The kernel a call's rows take: this choice is the numerics' contract (a row's result depends on its
// kernel), so matmul and matmul_groups both make it here.
enum class Kernel { q8_tiles, f16_tiles, amx, tiles, tiles_bf16, dot_bf16, rows };
inline Kernel kernel_for(const MatView& w, QuantPath path, [[maybe_unused]] bool bulk) {
  const bool fast_bf16 = path.fast_float && w.type == DType::BF16 && gemm::kHaveFastBf16;
#if PP_HAVE_Q8_TILES
  if (bulk && path.fast && w.type == DType::Q8_0) return Kernel::q8_tiles;
#endif
#if PP_HAVE_F16_TILES
  if (bulk && path.fast_float && w.type == DType::F16) return Kernel::f16_tiles;
#endif
#if PP_HAVE_AMX
  if (bulk && amx::applies(w) && !fast_bf16) return Kernel::amx;
#endif
  if (bulk && gemm::applies(w)) return fast_bf16 ? Kernel::tiles_bf16 : Kernel::tiles;
  return fast_bf16 ? Kernel::dot_bf16 : Kernel::rows;
}

// fn(r0, r1) over [0, rows) in items of `per` rows that the pool's threads claim one by one
// (ThreadPool::parallel_for_claimed), so that a core running slower for a while hands its share to the others.
template <class Fn>
inline void for_claimed_rows(ThreadPool& pool, std::size_t rows, std::size_t per, Fn&& fn) {
  pool.parallel_for_claimed((rows + per - 1) / per,
                            [&](std::size_t i, unsigned) { fn(i * per, std::min((i + 1) * per, rows)); });
}

// Rows per item of a prompt's tile loop: whole tiles of every tile kernel (12, 6 and 2 rows), about eight
// items a thread, at most a group of row blocks (gemm::kGroupBlocks x 12) so that an item is not cut into
// part groups. One thread: one item.
inline std::size_t tile_rows_per_item(std::size_t rows, unsigned threads) {
  if (threads <= 1) return std::max<std::size_t>(rows, 1);
  return std::clamp<std::size_t>(rows / (8 * std::size_t(threads)) / 12 * 12, 12, gemm::kGroupBlocks * 12);
}

// A bulk call on a kernel whose activations are packed once per call (Packed: its PackedX): prepare(px)
// sizes the caller's buffer (grown to the largest call, then reused; the pool's threads get it by
// reference, a thread_local named in their tasks would be theirs), the pool packs its token blocks
// (pack(px, b, e)), then run(px, r0, r1) over the rows, items claimed by the threads.
template <class Packed, class Prepare, class Pack, class Run>
inline void run_packed(ThreadPool& pool, std::size_t rows, Prepare&& prepare, Pack&& pack, Run&& run) {
  static thread_local Packed tls;
  Packed& px = tls;
  prepare(px);
  pool.parallel_for(px.blocks(), [&](std::size_t b, std::size_t e, unsigned) { pack(px, b, e); });
  for_claimed_rows(pool, rows, tile_rows_per_item(rows, pool.size()),
                   [&](std::size_t r0, std::size_t r1) { run(std::as_const(px), r0, r1); });
}

// y[m, w.rows] = x[m, w.cols] * w^T, output rows split across the pool. bulk: the rows belong to bulk
// requests (see kBulkRows); the caller decides, so that a row's path depends on its own request only.
template <class A = simd::Best>
inline void matmul(ThreadPool& pool, const MatView& w, const float* x, std::size_t m, float* y, QuantPath path = {},
                   [[maybe_unused]] bool bulk = false) {
  const uint8_t* xq = nullptr;
  if (path.fast && is_quantized(w.type)) {
    const std::size_t rb = quant::act_row_bytes(w.type, w.cols);
    assert(path.xq.size() >= m * rb);
    pool.parallel_for(m, [&](std::size_t b, std::size_t e, unsigned) {
      for (std::size_t i = b; i < e; ++i) quant::quantize_act_row(w.type, x + i * w.cols, w.cols, path.xq.data() + i * rb);
    });
    xq = path.xq.data();
  }
  constexpr std::size_t kGrain = 16;  // rows per task: whole row blocks (and whole register tiles)
  const std::size_t n_tasks = (w.rows + kGrain - 1) / kGrain;
  const Kernel kernel = kernel_for(w, path, bulk);
#if PP_HAVE_Q8_TILES
  if (kernel == Kernel::q8_tiles)
    return run_packed<gemm_q8::PackedX>(
        pool, w.rows, [&](auto& px) { gemm_q8::prepare(px, m, w.cols); },
        [&](auto& px, std::size_t b, std::size_t e) { gemm_q8::pack_blocks(xq, px, b, e); },
        [&](const auto& px, std::size_t r0, std::size_t r1) { gemm_q8::matmul_packed(w, px, y, r0, r1); });
#endif
#if PP_HAVE_F16_TILES
  if (kernel == Kernel::f16_tiles)
    return run_packed<gemm_f16::PackedX>(
        pool, w.rows, [&](auto& px) { gemm_f16::prepare(px, m, w.cols); },
        [&](auto& px, std::size_t b, std::size_t e) { gemm_f16::pack_blocks(x, px, b, e); },
        [&](const auto& px, std::size_t r0, std::size_t r1) { gemm_f16::matmul_packed(w, px, y, r0, r1); });
#endif
#if PP_HAVE_AMX
  if (kernel == Kernel::amx) return matmul_amx<A>(pool, w, x, m, y);
#endif
  if (kernel == Kernel::tiles || kernel == Kernel::tiles_bf16) {
    const bool fast_bf16 = kernel == Kernel::tiles_bf16;
    return run_packed<gemm::PackedX>(
        pool, w.rows, [&](auto& px) { gemm::prepare(px, m, w.cols, fast_bf16); },
        [&](auto& px, std::size_t b, std::size_t e) { gemm::pack_blocks(x, px, b, e); },
        [&](const auto& px, std::size_t r0, std::size_t r1) {
#if PP_HAVE_BF16_DOT
          if (fast_bf16) return gemm::matmul_packed_bf16(w, px, y, r0, r1);
#endif
          gemm::matmul_packed<A>(w, px, y, r0, r1);
        });
  }
#if PP_HAVE_BF16_DOT
  if (kernel == Kernel::dot_bf16) {
    static thread_local std::vector<uint16_t> tls;  // the caller's (see above)
    const Bf16Rows xb = round_rows_bf16(x, m, w.cols, tls);
    pool.parallel_for(n_tasks, [&](std::size_t b, std::size_t e, unsigned) {
      matmul_rows_bf16(w, xb.data, xb.stride, m, y, b * kGrain, std::min(e * kGrain, w.rows));
    });
    return;
  }
#endif
  pool.parallel_for(n_tasks, [&](std::size_t b, std::size_t e, unsigned) {
    matmul_rows<A>(w, x, m, y, b * kGrain, std::min(e * kGrain, w.rows), xq);
  });
}

// Consecutive rows of one call that take one path: bulk or not (see matmul).
struct RowGroup {
  std::size_t row0 = 0, n = 0;
  bool bulk = false;
};

// y[m, w.rows] = x * w^T where the rows come in groups on different paths (a prompt's piece beside the
// rows of decode steps): each group's rows get exactly what matmul gives them, but in one pass over the
// weights. A call per group would stream every weight once per group; here each block of weight rows
// (about kFuseBytes) runs for every group while it is in cache. The kernels' results do not depend on the
// weight-row range they are given (gemm::for_each_tile: each (row, token) is one chain over k; the dot
// kernels are row by row), so nothing changes but the traffic. Bulk groups on AMX tiles run as calls.
inline constexpr std::size_t kFuseBytes = 384 * 1024;

template <class A = simd::Best>
inline void matmul_groups(ThreadPool& pool, const MatView& w, const float* x, float* y, QuantPath path,
                          std::span<const RowGroup> groups) {
  if (groups.empty()) return;
  for (const RowGroup& g : groups)
    if (kernel_for(w, path, g.bulk) == Kernel::amx) {
      for (const RowGroup& h : groups) matmul<A>(pool, w, x + h.row0 * w.cols, h.n, y + h.row0 * w.rows, path, h.bulk);
      return;
    }
  const std::size_t m = groups.back().row0 + groups.back().n;
  // Quantized activations for every row at once (row by row: what each group's call would make).
  const uint8_t* xq = nullptr;
  std::size_t rb = 0;
  if (path.fast && is_quantized(w.type)) {
    rb = quant::act_row_bytes(w.type, w.cols);
    assert(path.xq.size() >= m * rb);
    pool.parallel_for(m, [&](std::size_t b, std::size_t e, unsigned) {
      for (std::size_t i = b; i < e; ++i) quant::quantize_act_row(w.type, x + i * w.cols, w.cols, path.xq.data() + i * rb);
    });
    xq = path.xq.data();
  }
  // Each group's activations in its path's form, as matmul prepares them, in the caller's buffers (grown
  // to the largest call, then reused).
  struct Prepared {
    Kernel kernel = Kernel::rows;
    std::size_t slot = 0;
    Bf16Rows xb{};
  };
  // (Bound here: in the pool's tasks the names would be each pool thread's own.)
  static thread_local std::vector<gemm::PackedX> packed_tls;
  static thread_local std::vector<std::vector<uint16_t>> rounded_tls;
  std::vector<gemm::PackedX>& packed = packed_tls;
  std::vector<std::vector<uint16_t>>& rounded = rounded_tls;
#if PP_HAVE_Q8_TILES
  static thread_local std::vector<gemm_q8::PackedX> packed_q8_tls;
  std::vector<gemm_q8::PackedX>& packed_q8 = packed_q8_tls;
#endif
#if PP_HAVE_F16_TILES
  static thread_local std::vector<gemm_f16::PackedX> packed_f16_tls;
  std::vector<gemm_f16::PackedX>& packed_f16 = packed_f16_tls;
#endif
  static thread_local std::vector<Prepared> prep_tls;
  std::vector<Prepared>& prep = prep_tls;
  prep.assign(groups.size(), Prepared{});
  std::size_t n_packed = 0, n_rounded = 0;
  [[maybe_unused]] std::size_t n_q8 = 0, n_f16 = 0;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const RowGroup& g = groups[i];
    Prepared& p = prep[i];
    p.kernel = kernel_for(w, path, g.bulk);
#if PP_HAVE_Q8_TILES
    if (p.kernel == Kernel::q8_tiles) {
      p.slot = n_q8++;
      if (packed_q8.size() < n_q8) packed_q8.resize(n_q8);
      gemm_q8::PackedX& px = packed_q8[p.slot];
      gemm_q8::prepare(px, g.n, w.cols);
      const uint8_t* gx = xq + g.row0 * rb;
      pool.parallel_for(px.blocks(), [&](std::size_t b, std::size_t e, unsigned) { gemm_q8::pack_blocks(gx, px, b, e); });
      continue;
    }
#endif
#if PP_HAVE_F16_TILES
    if (p.kernel == Kernel::f16_tiles) {
      p.slot = n_f16++;
      if (packed_f16.size() < n_f16) packed_f16.resize(n_f16);
      gemm_f16::PackedX& px = packed_f16[p.slot];
      gemm_f16::prepare(px, g.n, w.cols);
      const float* gx = x + g.row0 * w.cols;
      pool.parallel_for(px.blocks(), [&](std::size_t b, std::size_t e, unsigned) { gemm_f16::pack_blocks(gx, px, b, e); });
      continue;
    }
#endif
    if (p.kernel == Kernel::tiles || p.kernel == Kernel::tiles_bf16) {
      p.slot = n_packed++;
      if (packed.size() < n_packed) packed.resize(n_packed);
      gemm::PackedX& px = packed[p.slot];
      gemm::prepare(px, g.n, w.cols, p.kernel == Kernel::tiles_bf16);
      const float* gx = x + g.row0 * w.cols;
      pool.parallel_for(px.blocks(), [&](std::size_t b, std::size_t e, unsigned) { gemm::pack_blocks(gx, px, b, e); });
      continue;
    }
    if (p.kernel == Kernel::dot_bf16) {
      p.slot = n_rounded++;
      if (rounded.size() < n_rounded) rounded.resize(n_rounded);
      p.xb = round_rows_bf16(x + g.row0 * w.cols, g.n, w.cols, rounded[p.slot]);
    }
  }
  // Weight rows per block: a multiple of the tiles' row counts (12 and 6; 4 for the dot tiles).
  const std::size_t fuse = std::clamp<std::size_t>(kFuseBytes / std::max<std::size_t>(1, w.row_stride) / 12 * 12, 12, 48);
  for_claimed_rows(pool, w.rows, fuse, [&](std::size_t r0, std::size_t r1) {
    for (std::size_t i = 0; i < groups.size(); ++i) {
      const RowGroup& g = groups[i];
      float* gy = y + g.row0 * w.rows;
      switch (prep[i].kernel) {
#if PP_HAVE_Q8_TILES
        case Kernel::q8_tiles: gemm_q8::matmul_packed(w, packed_q8[prep[i].slot], gy, r0, r1); break;
#endif
#if PP_HAVE_F16_TILES
        case Kernel::f16_tiles: gemm_f16::matmul_packed(w, packed_f16[prep[i].slot], gy, r0, r1); break;
#endif
#if PP_HAVE_BF16_DOT
        case Kernel::tiles_bf16: gemm::matmul_packed_bf16(w, packed[prep[i].slot], gy, r0, r1); break;
        case Kernel::dot_bf16: matmul_rows_bf16(w, prep[i].xb.data, prep[i].xb.stride, g.n, gy, r0, r1); break;
#endif
        case Kernel::tiles: gemm::matmul_packed<A>(w, packed[prep[i].slot], gy, r0, r1); break;
        default: matmul_rows<A>(w, x + g.row0 * w.cols, g.n, gy, r0, r1, xq ? xq + g.row0 * rb : nullptr); break;
      }
    }
  });
}

// One weight row as f32 (embedding lookup; quantized rows are dequantized).
inline void row_to_f32(const MatView& w, std::size_t r, float* out) {
  const uint8_t* p = w.row(r);
  if (is_quantized(w.type)) return quant::dequantize_row(w.type, p, w.cols, out);
  for (std::size_t j = 0; j < w.cols; ++j) {
    switch (w.type) {
      case DType::F32: out[j] = reinterpret_cast<const float*>(p)[j]; break;
      case DType::F16: out[j] = f16_to_f32(reinterpret_cast<const uint16_t*>(p)[j]); break;
      case DType::BF16: out[j] = bf16_to_f32(reinterpret_cast<const uint16_t*>(p)[j]); break;
      default: break;
    }
  }
}

}  // namespace pp::kernels
