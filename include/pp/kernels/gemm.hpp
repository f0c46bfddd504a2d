// Bulk matrix products (prompts) against F32 / F16 / BF16 weights on the vector units: the tile kernel
// of CPUs without AMX.
//
// A register tile holds R weight rows x T tokens of accumulators. Each step over k loads T activation
// vectors and R weight vectors and does R*T FMAs, so every load feeds several FMAs (the 1-row dot
// kernels of matmul.hpp do one FMA per activation load, which leaves a prompt load-bound). Tokens are
// taken in chunks whose activations stay in L2 while all of a task's weight rows pass over them, and
// the R rows of a tile stay in L1 while the chunk's tokens pass over them.
//
// Numerics: each (row, token) dot is one chain of W-lane FMAs over k in order, a fixed horizontal sum,
// then the scalar tail: the same operations whatever the tile shape, the chunking, the batch or the
// thread, so bulk results never depend on those. They differ in the last bits from the decode kernels
// (several accumulator chains per row), exactly as the AMX tiles do: a row's path depends only on the
// size of its own request (kBulkRows).
//
// The fast path of BF16 weights (AVX512-BF16 without AMX by default, StageOptions::fast_float): the
// activations rounded to bf16 once per call, then the same tiles with vdpbf16ps, 32 products per
// instruction: llama.cpp's numerics for a BF16 matmul, at about 2.3x the exact tiles.
#pragma once

#include <pp/core/dtype.hpp>
#include <pp/core/float16.hpp>
#include <pp/kernels/simd.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <utility>

namespace pp::kernels::gemm {

// Weight rows per register tile, and tokens: R*T accumulators + T activations + 1 weight vector must
// fit the register file (32 zmm: 4 x 6; 16 ymm / xmm: 4 x 2).
inline constexpr int kRows = 4;
template <class A>
inline constexpr int kTokens = simd::fbatch<A>::size >= 16 ? 6 : 2;

// Activation bytes of one token chunk: well inside a core's L2 (1-2 MiB on current x86 server cores),
// leaving room for the weights passing through.
inline constexpr std::size_t kChunkBytes = 384 * 1024;

// y[t * ys + r] = dot(w row r, x row t) for r < R, t < T; w rows `w_stride` bytes apart, x rows n apart.
template <class A, class WT, int R, int T>
inline void tile(const uint8_t* w, std::size_t w_stride, const float* x, std::size_t n, float* y, std::size_t ys) {
  using S = typename WT::storage;
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size;
  const S* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const S*>(w + std::size_t(r) * w_stride);
  B acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = B(0.f);
  std::size_t i = 0;
  for (; i + W <= n; i += W) {
    B xt[T];
    for (int t = 0; t < T; ++t) xt[t] = B::load_unaligned(x + std::size_t(t) * n + i);
    for (int r = 0; r < R; ++r) {
      const B wv = simd::load<A>(WT{}, wr[r] + i);
      for (int t = 0; t < T; ++t) acc[r][t] = xsimd::fma(wv, xt[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float s = xsimd::hadd(acc[r][t]);
      for (std::size_t j = i; j < n; ++j) s = std::fma(simd::load1(WT{}, wr[r] + j), x[std::size_t(t) * n + j], s);
      y[std::size_t(t) * ys + std::size_t(r)] = s;
    }
}

#if defined(__AVX512BF16__)
// The fast path of BF16 weights: xb holds the activations rounded to bf16 (round_activations); each
// (row, token) dot is one chain of vdpbf16ps over k, a fixed horizontal sum, then the scalar tail.
template <int R, int T>
inline void tile_bf16(const uint8_t* w, std::size_t w_stride, const uint16_t* xb, std::size_t n, float* y,
                      std::size_t ys) {
  using D = simd::Bf16Dot;
  const uint16_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint16_t*>(w + std::size_t(r) * w_stride);
  D::Acc acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = D::zero();
  std::size_t i = 0;
  for (; i + D::kElems <= n; i += D::kElems) {
    D::Vec xt[T];
    for (int t = 0; t < T; ++t) xt[t] = D::load(xb + std::size_t(t) * n + i);
    for (int r = 0; r < R; ++r) {
      const D::Vec wv = D::load(wr[r] + i);
      for (int t = 0; t < T; ++t) acc[r][t] = D::dot(acc[r][t], wv, xt[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      float s = D::sum(acc[r][t]);
      for (std::size_t j = i; j < n; ++j) s = std::fma(bf16_to_f32(wr[r][j]), bf16_to_f32(xb[std::size_t(t) * n + j]), s);
      y[std::size_t(t) * ys + std::size_t(r)] = s;
    }
}
#endif

namespace detail {

using TileFn = void (*)(const uint8_t*, std::size_t, const float*, std::size_t, float*, std::size_t);

// kTable[R - 1][T - 1]: the tile for a block of R rows and T tokens (full tiles and the edges).
template <class A, class WT, int R, int... T>
constexpr std::array<TileFn, sizeof...(T)> tokens_row(std::integer_sequence<int, T...>) {
  return {&tile<A, WT, R, T + 1>...};
}
template <class A, class WT, int... R>
constexpr auto table(std::integer_sequence<int, R...>) {
  return std::array<std::array<TileFn, kTokens<A>>, sizeof...(R)>{
      tokens_row<A, WT, R + 1>(std::make_integer_sequence<int, kTokens<A>>{})...};
}
template <class A, class WT>
inline constexpr auto kTable = table<A, WT>(std::make_integer_sequence<int, kRows>{});

#if defined(__AVX512BF16__)
inline constexpr int kBf16Tokens = 6;
using Bf16TileFn = void (*)(const uint8_t*, std::size_t, const uint16_t*, std::size_t, float*, std::size_t);
template <int R, int... T>
constexpr std::array<Bf16TileFn, sizeof...(T)> bf16_tokens_row(std::integer_sequence<int, T...>) {
  return {&tile_bf16<R, T + 1>...};
}
template <int... R>
constexpr auto bf16_table(std::integer_sequence<int, R...>) {
  return std::array<std::array<Bf16TileFn, kBf16Tokens>, sizeof...(R)>{
      bf16_tokens_row<R + 1>(std::make_integer_sequence<int, kBf16Tokens>{})...};
}
inline constexpr auto kBf16Table = bf16_table(std::make_integer_sequence<int, kRows>{});
#endif

}  // namespace detail

// Runs table[rows - 1][tokens - 1] over every tile of y[m, w.rows] rows [r0, r1): tokens in chunks of
// about kChunkBytes of activations (x rows of `elem` bytes), a chunk's tiles row block by row block.
template <std::size_t T, class Table, class X>
inline void for_each_tile(const Table& table, const MatView& w, const X* x, std::size_t m, float* y, std::size_t r0,
                          std::size_t r1) {
  constexpr std::size_t R = kRows;
  const std::size_t n = w.cols, ys = w.rows;
  const std::size_t chunk = std::max<std::size_t>(T, kChunkBytes / (n * sizeof(X)) / T * T);
  for (std::size_t t0 = 0; t0 < m; t0 += chunk) {
    const std::size_t t1 = std::min(m, t0 + chunk);
    for (std::size_t rb = r0; rb < r1; rb += R) {
      const std::size_t rn = std::min(R, r1 - rb);
      for (std::size_t t = t0; t < t1; t += T) {
        const std::size_t tn = std::min(T, t1 - t);
        table[rn - 1][tn - 1](w.row(rb), w.row_stride, x + t * n, n, y + t * ys + rb, ys);
      }
    }
  }
}

// y[m, w.rows] (rows [r0, r1) only) = x[m, w.cols] * w^T, for float weights of type WT.
template <class A, class WT>
inline void matmul_rows_typed(const MatView& w, const float* x, std::size_t m, float* y, std::size_t r0,
                              std::size_t r1) {
  for_each_tile<kTokens<A>>(detail::kTable<A, WT>, w, x, m, y, r0, r1);
}

template <class A>
inline void matmul_rows(const MatView& w, const float* x, std::size_t m, float* y, std::size_t r0, std::size_t r1) {
  switch (w.type) {
    case DType::F32: return matmul_rows_typed<A, simd::F32w>(w, x, m, y, r0, r1);
    case DType::F16: return matmul_rows_typed<A, simd::F16w>(w, x, m, y, r0, r1);
    case DType::BF16: return matmul_rows_typed<A, simd::Bf16w>(w, x, m, y, r0, r1);
    default: return;
  }
}

// The fast path of BF16 weights exists on this build (AVX512-BF16 compiled in).
inline constexpr bool kHaveFastBf16 = simd::kHaveBf16Dot;

// Activations as the fast path uses them: each f32 rounded to the nearest bf16 (ties to even), as
// llama.cpp rounds a BF16 matmul's input.
inline void round_activations(const float* x, std::size_t n, uint16_t* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

#if defined(__AVX512BF16__)
// y[m, w.rows] (rows [r0, r1) only) = xb[m, w.cols] * w^T for BF16 weights, xb rounded by round_activations.
inline void matmul_rows_bf16(const MatView& w, const uint16_t* xb, std::size_t m, float* y, std::size_t r0,
                             std::size_t r1) {
  for_each_tile<detail::kBf16Tokens>(detail::kBf16Table, w, xb, m, y, r0, r1);
}
#endif

inline bool applies(const MatView& w) {
  return w.type == DType::F32 || w.type == DType::F16 || w.type == DType::BF16;
}

}  // namespace pp::kernels::gemm
