// Bulk matrix products (prompts) against Q8_0 weights: the quantized fast path's GEMM, on AVX512-VNNI
// (int8 products) or AVX2 (int16 products).
//
// The fast path quantizes each activation row to 32-element int8 blocks (quant::ActQ8, llama.cpp's
// scheme). Here those rows are packed once per call with the tokens side by side, as gemm.hpp packs
// floats, then the tokens' scales:
// * VNNI: for each weight block b and each 4 elements of it, 32 tokens x 4 codes (two zmm), offset by
//   128 to unsigned bytes. A register tile is R weight rows x 32 tokens: per 4 elements, vpdpbusd of the
//   token codes with one 4-byte group of a row's codes broadcast straight from the file (64 products an
//   instruction); the int32 sums start at -128 * the row block's code sum, which removes the offset.
// * AVX2: the same layout with the codes as they are (signed). The step is llama.cpp's sign trick on a
//   register tile: |w| of a row's 4-byte group broadcast, the token codes given w's signs (vpsignb),
//   vpmaddubsw (|w| <= 128 times |x| <= 127, pairs summed: at most 32512, never saturating) and
//   vpmaddwd by ones into int32: 32 products for 4 instructions, two of them on the multiplier ports.
// Per block, the int32 sums become f32 and are scaled by d_w * d_x into the f32 accumulators.
//
// Numerics: the integer block dot products are exact, as in quant.hpp's dot kernels; each (row, token)
// output is one chain over blocks, acc = fma(float(dot_b), d_w,b * d_x,b, acc), the same whatever the
// tile, the batch, the thread or the instruction set (VNNI and AVX2 builds give the same bits). It sums
// the blocks in another order than the dot kernels of a decode step (several lanes), so bulk requests
// of Q8_0 weights are "on tiles" (kernels::bulk_on_tiles), as the float tiles are. Intrinsics live here
// rather than in simd.hpp, as AMX's do: a separate unit.
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
#define PP_Q8_TILES_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PP_HAVE_Q8_TILES 1
#define PP_Q8_TILES_VNNI 0
#endif

namespace pp::kernels::gemm_q8 {

#if !PP_HAVE_Q8_TILES
inline constexpr bool kAvailable = false;
#else
inline constexpr bool kAvailable = true;
// What the tiles run on, for labels (pp_bench).
inline constexpr const char* kName = PP_Q8_TILES_VNNI ? "int8 VNNI tiles" : "int8 AVX2 tiles";

inline constexpr std::size_t kBlockTokens = gemm::kBlockTokens;  // results leave through gemm's store_tile
inline constexpr std::size_t kQ = 32;                             // elements of a Q8_0 block
#if PP_Q8_TILES_VNNI
static_assert(kBlockTokens == 32);  // two zmm of int32 lanes
inline constexpr int kRows = 6;     // 12 int32 + 12 f32 accumulators, 2 token vectors, temps
#else
inline constexpr std::size_t kVecs = kBlockTokens / 8;  // ymm of int32 lanes per token block
inline constexpr int kRows = kVecs == 2 ? 2 : 1;      // 2 * kRows * kVecs accumulators + kVecs tokens + 4 of 16 ymm
#endif
static_assert(kRows <= gemm::detail::Scratch::kMaxRows);
inline constexpr std::size_t kGroup = 4;             // codes a 32-bit lane holds
inline constexpr std::size_t kGroups = kQ / kGroup;  // 32-bit lanes of a token's block
// Packed bytes of one weight block's worth of a token block: the groups x tokens x 4 bytes, the scales.
inline constexpr std::size_t kBlockBytes = kGroups * kBlockTokens * 4 + kBlockTokens * 4;

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
      float* scales = reinterpret_cast<float*>(out + kGroups * TB * 4);
      for (std::size_t l = 0; l < TB; ++l) {
        const std::size_t t = tb * TB + l;
        const quant::ActQ8* a = t < p.m ? &reinterpret_cast<const quant::ActQ8*>(xq)[t * p.nb + b] : nullptr;
        for (std::size_t g = 0; g < kGroups; ++g) {
          uint8_t* lane = out + (g * TB + l) * 4;
          constexpr int kOffset = PP_Q8_TILES_VNNI ? 128 : 0;  // VNNI: unsigned codes
          for (std::size_t i = 0; i < 4; ++i) lane[i] = uint8_t(int(a ? a->qs[4 * g + i] : 0) + kOffset);
        }
        scales[l] = a ? a->d : 0.f;
      }
    }
}

// Per row block: each row's block scales as f32 and (VNNI) -128 * its block code sums ([r][b]).
struct RowBlock {
  Buffer<float> d;
  Buffer<int32_t> offset;
};

#if PP_Q8_TILES_VNNI
// out[r * 32 + t] for R rows of Q8_0 blocks (rows `stride` bytes apart), their blocks [b0, b1), and token
// block tb of x; rows: their RowBlock values (nb a row). With `resume`, the chains go on from out.
template <int R>
inline void tile(const uint8_t* w, std::size_t stride, const PackedX& x, std::size_t tb, std::size_t b0,
                 std::size_t b1, const RowBlock& rows, float* out, bool resume) {
  constexpr std::size_t TB = kBlockTokens;
  const std::size_t nb = x.nb;
  const float* d = rows.d.data();
  const int32_t* offset = rows.offset.data();
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v)
      acc[r][v] = resume ? _mm512_load_ps(out + std::size_t(r) * TB + 16 * v) : _mm512_setzero_ps();
  for (std::size_t b = b0; b < b1; ++b) {
    const uint8_t* xb = x.block(tb, b);
    __m512i sum[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm512_set1_epi32(offset[std::size_t(r) * nb + b]);
#pragma GCC unroll 8
    for (std::size_t g = 0; g < kGroups; ++g) {
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
    const float* sx = reinterpret_cast<const float*>(xb + kGroups * TB * 4);
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
#else
// out[r * TB + t] for R rows of Q8_0 blocks (rows `stride` bytes apart), their blocks [b0, b1), and token
// block tb of x. With `resume`, the chains go on from out.
template <int R>
inline void tile(const uint8_t* w, std::size_t stride, const PackedX& x, std::size_t tb, std::size_t b0,
                 std::size_t b1, const RowBlock& rows, float* out, bool resume) {
  constexpr std::size_t TB = kBlockTokens, V = kVecs;
  const std::size_t nb = x.nb;
  const float* d = rows.d.data();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (std::size_t v = 0; v < V; ++v)
      acc[r][v] = resume ? _mm256_load_ps(out + std::size_t(r) * TB + v * 8) : _mm256_setzero_ps();
  for (std::size_t b = b0; b < b1; ++b) {
    const uint8_t* xb = x.block(tb, b);
    __m256i sum[R][V];
    for (int r = 0; r < R; ++r)
      for (std::size_t v = 0; v < V; ++v) sum[r][v] = _mm256_setzero_si256();
    // Not unrolled further: GCC then reassociates the int32 adds of a whole block into a tree of
    // products spilled to the stack.
#pragma GCC unroll 2
    for (std::size_t g = 0; g < kGroups; ++g) {
      __m256i xv[V];
      for (std::size_t v = 0; v < V; ++v)
        xv[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(xb + (g * TB + v * 8) * 4));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t q;
        std::memcpy(&q, w + std::size_t(r) * stride + b * sizeof(quant::BlockQ8_0) + 2 + 4 * g, 4);
        const __m256i wq = _mm256_set1_epi32(q), wa = _mm256_abs_epi8(wq);
        for (std::size_t v = 0; v < V; ++v) {
          const __m256i p16 = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv[v], wq));
          sum[r][v] = _mm256_add_epi32(sum[r][v], _mm256_madd_epi16(p16, ones));
        }
      }
    }
    const float* sx = reinterpret_cast<const float*>(xb + kGroups * TB * 4);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 dw = _mm256_set1_ps(d[std::size_t(r) * nb + b]);
      for (std::size_t v = 0; v < V; ++v)
        acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][v]), _mm256_mul_ps(dw, _mm256_load_ps(sx + v * 8)),
                                    acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (std::size_t v = 0; v < V; ++v) _mm256_store_ps(out + std::size_t(r) * TB + v * 8, acc[r][v]);
}
#endif

namespace detail {
inline constexpr auto kTable = gemm::detail::row_table<kRows>([]<int R>() { return &tile<R>; });

inline RowBlock& row_block() {
  static thread_local RowBlock s;
  return s;
}
}  // namespace detail

// y[m, w.rows] (rows [r0, r1) only) = x * w^T for Q8_0 weights, x packed from the fast path's ActQ8 rows;
// k in segments of gemm::kSegK (gemm::for_each_tile).
inline void matmul_packed(const MatView& w, const PackedX& x, float* y, std::size_t r0, std::size_t r1) {
  constexpr int R = kRows;
  constexpr std::size_t kSegBlocks = gemm::kSegK / kQ;
  const std::size_t nb = x.nb;
  RowBlock& rows = detail::row_block();
  if (rows.d.size() < R * nb) rows.d = Buffer<float>(R * nb), rows.offset = Buffer<int32_t>(R * nb);
  auto seg_blocks = [&](std::size_t seg) {
    return std::pair{seg * kSegBlocks, std::min(nb, (seg + 1) * kSegBlocks)};
  };
  auto prepare = [&](std::size_t rb, std::size_t rn, std::size_t seg) {
    const auto [b0, b1] = seg_blocks(seg);
    for (std::size_t r = 0; r < rn; ++r) {
      const auto* blocks = reinterpret_cast<const quant::BlockQ8_0*>(w.row(rb + r));
      for (std::size_t b = b0; b < b1; ++b) {
        rows.d[r * nb + b] = quant::h2f(blocks[b].d);
        if (!PP_Q8_TILES_VNNI) continue;
        int32_t sum = 0;
        for (int8_t q : blocks[b].qs) sum += q;
        rows.offset[r * nb + b] = -128 * sum;
      }
    }
  };
  auto prefetch = [&](std::size_t rb, std::size_t rn, std::size_t seg) {
    const auto [b0, b1] = seg_blocks(seg);
    gemm::prefetch_rows(w, rb, rn, b0, b1 - b0, sizeof(quant::BlockQ8_0));
  };
  auto tile = [&](std::size_t rb, std::size_t rn, std::size_t tb, std::size_t seg, float* acc, bool resume) {
    const auto [b0, b1] = seg_blocks(seg);
    detail::kTable[rn - 1](w.row(rb), w.row_stride, x, tb, b0, b1, rows, acc, resume);
  };
  const std::size_t segs = (nb + kSegBlocks - 1) / kSegBlocks;
  gemm::for_each_tile<R>(x.blocks(), segs, std::min(nb, kSegBlocks) * kBlockBytes, x.m, y, w.rows, r0, r1, prepare,
                         prefetch, tile);
}
#endif

}  // namespace pp::kernels::gemm_q8
