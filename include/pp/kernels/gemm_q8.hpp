// Bulk matrix products (prompts) against Q8_0 weights on AVX512-VNNI: the quantized fast path's GEMM.
//
// The fast path quantizes each activation row to 32-element int8 blocks (quant::ActQ8, llama.cpp's
// scheme). Here those rows are packed once per call with the tokens side by side, as gemm.hpp packs
// floats: for each weight block b and each 4 elements of it, 32 tokens x 4 codes (two zmm), the codes
// offset by 128 to unsigned bytes, then the 32 tokens' scales. A register tile is R weight rows x 32
// tokens: per 4 elements, vpdpbusd of the token codes with one 4-byte group of a row's codes broadcast
// straight from the file (64 products an instruction, the weights need no unpacking); per block, the
// int32 sums (started at -128 * the row block's code sum, which removes the offset exactly) become f32
// and are scaled by d_w * d_x into the f32 accumulators.
//
// Numerics: the integer block dot products are exact, as in quant.hpp's dot kernels; each (row, token)
// output is one chain over blocks, acc = fma(float(dot_b), d_w,b * d_x,b, acc), the same whatever the
// tile, the batch or the thread. It sums the blocks in another order than the dot kernels of a decode
// step (several lanes), so bulk requests of Q8_0 weights are "on tiles" (kernels::bulk_on_tiles), as the
// float tiles are. Intrinsics live here rather than in simd.hpp, as AMX's do: a separate unit.
#pragma once

#include <pp/core/buffer.hpp>
#include <pp/core/dtype.hpp>
#include <pp/kernels/gemm.hpp>
#include <pp/kernels/quant_blocks.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PP_HAVE_Q8_TILES 1
#endif

namespace pp::kernels::gemm_q8 {

#if !PP_HAVE_Q8_TILES
inline constexpr bool kAvailable = false;
#else
inline constexpr bool kAvailable = true;

inline constexpr std::size_t kBlockTokens = 32;  // two zmm of int32 lanes
static_assert(gemm::kBlockTokens == kBlockTokens);  // results leave through gemm's store_tile
inline constexpr int kRows = 6;                  // 12 int32 + 12 f32 accumulators, 2 token vectors, temps
static_assert(kRows <= gemm::detail::Scratch::kMaxRows);
inline constexpr std::size_t kQ = 32;            // elements of a Q8_0 block
// Packed bytes of one weight block's worth of a token block: 8 groups x 32 tokens x 4 codes, 32 scales.
inline constexpr std::size_t kBlockBytes = 8 * kBlockTokens * 4 + kBlockTokens * 4;

// The activation rows (ActQ8 blocks) of a call, packed (see the top of the file); tokens past m are zero.
struct PackedX {
  Buffer<uint8_t> data;
  std::size_t m = 0, nb = 0;  // tokens, 32-element blocks of k
  std::size_t blocks() const { return (m + kBlockTokens - 1) / kBlockTokens; }
  const uint8_t* block(std::size_t tb, std::size_t b) const { return data.data() + (tb * nb + b) * kBlockBytes; }
};

inline void prepare(PackedX& p, std::size_t m, std::size_t k) {
  p.m = m, p.nb = k / kQ;
  const std::size_t bytes = p.blocks() * p.nb * kBlockBytes;
  if (p.data.size() < bytes) p.data = Buffer<uint8_t>(bytes);
}

// Packs token blocks [tb0, tb1) from xq: m rows of nb ActQ8 blocks.
inline void pack_blocks(const uint8_t* xq, PackedX& p, std::size_t tb0, std::size_t tb1) {
  constexpr std::size_t TB = kBlockTokens;
  for (std::size_t tb = tb0; tb < tb1; ++tb)
    for (std::size_t b = 0; b < p.nb; ++b) {
      uint8_t* out = p.data.data() + (tb * p.nb + b) * kBlockBytes;
      float* scales = reinterpret_cast<float*>(out + 8 * TB * 4);
      for (std::size_t l = 0; l < TB; ++l) {
        const std::size_t t = tb * TB + l;
        if (t >= p.m) {
          for (std::size_t g = 0; g < 8; ++g) std::memset(out + (g * TB + l) * 4, 128, 4);  // code 0
          scales[l] = 0.f;
          continue;
        }
        const quant::ActQ8& a = reinterpret_cast<const quant::ActQ8*>(xq)[t * p.nb + b];
        for (std::size_t g = 0; g < 8; ++g)
          for (std::size_t i = 0; i < 4; ++i) out[(g * TB + l) * 4 + i] = uint8_t(int(a.qs[4 * g + i]) + 128);
        scales[l] = a.d;
      }
    }
}

// Per row block: each row's block scales as f32 and -128 * its block code sums.
struct RowBlock {
  Buffer<float> d;
  Buffer<int32_t> offset;
};

// out[r * 32 + t] for R rows of Q8_0 blocks (rows `stride` bytes apart) and token block tb of x; d and
// offset: the rows' RowBlock values, nb a row.
template <int R>
inline void tile(const uint8_t* w, std::size_t stride, const PackedX& x, std::size_t tb, const float* d,
                 const int32_t* offset, float* out) {
  constexpr std::size_t TB = kBlockTokens;
  const std::size_t nb = x.nb;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (std::size_t b = 0; b < nb; ++b) {
    const uint8_t* xb = x.block(tb, b);
    __m512i sum[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_set1_epi32(offset[std::size_t(r) * nb + b]);
#pragma GCC unroll 8
    for (std::size_t g = 0; g < 8; ++g) {
      const __m512i x0 = _mm512_load_si512(xb + g * TB * 4), x1 = _mm512_load_si512(xb + g * TB * 4 + 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t q;
        std::memcpy(&q, w + std::size_t(r) * stride + b * sizeof(quant::BlockQ8_0) + 2 + 4 * g, 4);
        const __m512i wq = _mm512_set1_epi32(q);
        sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], x0, wq);
        sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], x1, wq);
      }
    }
    const float* sx = reinterpret_cast<const float*>(xb + 8 * TB * 4);
    const __m512 s0 = _mm512_load_ps(sx), s1 = _mm512_load_ps(sx + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 dw = _mm512_set1_ps(d[std::size_t(r) * nb + b]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][0]), _mm512_mul_ps(dw, s0), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][1]), _mm512_mul_ps(dw, s1), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(out + std::size_t(r) * TB, acc[r][0]);
    _mm512_store_ps(out + std::size_t(r) * TB + 16, acc[r][1]);
  }
}

namespace detail {
using TileFn = void (*)(const uint8_t*, std::size_t, const PackedX&, std::size_t, const float*, const int32_t*, float*);
template <int... R>
constexpr auto table(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{&tile<R + 1>...};
}
inline constexpr auto kTable = table(std::make_integer_sequence<int, kRows>{});

inline RowBlock& row_block() {
  static thread_local RowBlock s;
  return s;
}
}  // namespace detail

// y[m, w.rows] (rows [r0, r1) only) = x * w^T for Q8_0 weights, x packed from the fast path's ActQ8 rows.
inline void matmul_packed(const MatView& w, const PackedX& x, float* y, std::size_t r0, std::size_t r1) {
  constexpr std::size_t TB = kBlockTokens;
  constexpr int R = kRows;
  const std::size_t nb = x.nb, ys = w.rows;
  RowBlock& rows = detail::row_block();
  float* out = gemm::detail::scratch().out;
  if (rows.d.size() < R * nb) rows.d = Buffer<float>(R * nb), rows.offset = Buffer<int32_t>(R * nb);
  auto prepare = [&](std::size_t rb, std::size_t rn) {
    for (std::size_t r = 0; r < rn; ++r) {
      const auto* blocks = reinterpret_cast<const quant::BlockQ8_0*>(w.row(rb + r));
      for (std::size_t b = 0; b < nb; ++b) {
        int32_t sum = 0;
        for (int8_t q : blocks[b].qs) sum += q;
        rows.d[r * nb + b] = quant::h2f(blocks[b].d);
        rows.offset[r * nb + b] = -128 * sum;
      }
    }
  };
  gemm::for_each_tile<R>(x.blocks(), nb * kBlockBytes, r0, r1, prepare, [&](std::size_t rb, std::size_t rn, std::size_t tb) {
    detail::kTable[rn - 1](w.row(rb), w.row_stride, x, tb, rows.d.data(), rows.offset.data(), out);
    gemm::detail::store_tile<R>(out, rn, std::min(TB, x.m - tb * TB), y + tb * TB * ys + rb, ys);
  });
}
#endif

}  // namespace pp::kernels::gemm_q8
