// Bulk matrix products (prompts) against F16 weights on the fast path (StageOptions::fast_float): int16
// products, twice the products an instruction of the f32 FMAs the exact tiles issue: vpdpwssd on
// AVX512-VNNI, vpmaddwd + vpaddd on AVX2 (AVX2-only CPUs; the same bits, see Numerics).
//
// llama.cpp rounds a prompt's activations to f16 for an F16 matmul (11 significant bits, an error of up
// to 2^-11 of each value) and multiplies in f32. Here both sides become int16 codes with power-of-two
// scales, so every product and every sum of a block is exact in int32:
// * activations: per token and block of kQ = 16 values of k, codes of at most kActBits = 14 bits
//   (|code| <= 2^14 - 1) scaled by 2^e, e from the block's largest |x|: an error of at most 2^-15 of
//   that largest value, below f16's rounding for all but the block's smallest values;
// * weights: per row and segment of k (gemm::kSegK values), codes of at most kWeightBits = 13 bits,
//   scaled from the segment's largest |w|: the f16 values within 2^2 of it are exact (11 significant
//   bits), the others rounded to 2^-14 of it.
// A block's 16 products are each below 2^27, so their int32 sum cannot overflow (static_assert below).
//
// Layout, as gemm_q8.hpp's: the activation rows are packed once per call with the tokens side by side:
// for each block b, 8 pairs of k x TB tokens (gemm::kBlockTokens: 32 on AVX-512, 16 on AVX2) of
// (code_2j, code_2j+1) in 32-bit lanes, then the TB tokens' scales. A row block's segment of weights
// becomes codes once per token chunk (prepare). A register tile is R weight rows x TB tokens: per pair of
// k, the products of the token codes with a row's code pair broadcast, summed in pairs into int32 lanes
// (vpdpwssd; vpmaddwd then vpaddd); per block, the int32 sums become f32 and are scaled by the tokens'
// block scales into the segment's f32 accumulators; per segment, those are scaled by the rows' weight
// scales into the output.
//
// Numerics: each (row, token) output is one chain, seg_s = fma(float(dot_b), d_x,b, seg_s) over the
// segment's blocks in order, then out = fma(seg_s, d_w,s, out) over segments in order: the same whatever
// the tile, the batch, the chunk, the thread or the instruction set (the block sums are exact integers).
// Decode steps (not bulk) keep the exact dot kernels.
//
// AVX-512 builds without VNNI (x86-64-v4: Skylake-SP) have no int16 tiles: their exact zmm tiles issue
// 16-lane FMAs, and vpmaddwd + vpaddd there was never measured.
#pragma once

#include <pp/core/buffer.hpp>
#include <pp/core/dtype.hpp>
#include <pp/core/float16.hpp>
#include <pp/kernels/gemm.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PP_HAVE_F16_TILES 1
#define PP_F16_TILES_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include <immintrin.h>
#define PP_HAVE_F16_TILES 1
#define PP_F16_TILES_VNNI 0
#endif

namespace pp::kernels::gemm_f16 {

inline constexpr std::size_t kQ = 16;  // values of k per activation block (one scale per token)
inline constexpr int kActBits = 14, kWeightBits = 13;
static_assert(int64_t(kQ) * ((int64_t(1) << kActBits) - 1) * ((int64_t(1) << kWeightBits) - 1) <= INT32_MAX,
              "a block's int32 sum of products must not overflow");
static_assert(gemm::kSegK % kQ == 0);

// 2^e as a float, e within the normal range.
inline float pow2(int e) { return std::bit_cast<float>(uint32_t(e + 127) << 23); }

// The exponent e of the codes v * 2^-e of values whose largest magnitude is `max` (a normal float), so
// that |v * 2^-e| < 2^bits: max < 2^E with E = frexp's exponent (the biased exponent - 126), e = E - bits.
// From the bits: this runs per token and block of every prompt, where frexp was a libm call.
inline int code_exponent(float max, int bits) {
  return int((std::bit_cast<uint32_t>(max) >> 23) & 0xff) - 126 - bits;
}

// Values of magnitude below this in a whole block are taken as zero: 2^-e stays a normal float.
inline constexpr float kTinyBlock = 0x1p-100f;

#if !PP_HAVE_F16_TILES
inline constexpr bool kAvailable = false;
#else
inline constexpr bool kAvailable = true;
// What the tiles run on, for labels (pp_bench).
inline constexpr const char* kName = PP_F16_TILES_VNNI ? "int16 VNNI tiles" : "int16 AVX2 tiles";

inline constexpr std::size_t kBlockTokens = gemm::kBlockTokens;  // results leave through gemm's store_tile
inline constexpr std::size_t kPairs = kQ / 2;
#if PP_F16_TILES_VNNI
static_assert(kBlockTokens == 32);  // two zmm of int32 lanes
inline constexpr int kRows = 6;     // 12 int32 + 12 f32 accumulators, 2 token vectors, 1 broadcast
#else
inline constexpr std::size_t kVecs = kBlockTokens / 8;  // ymm of int32 lanes per token block
static_assert(kVecs == 2);                              // AVX2 builds: gemm's two vectors of 8 floats
// 8 int32 sums, 2 token vectors, 1 broadcast and 1 product in registers, the f32 accumulators in L1 (a
// load and a store a block): 133-138 GFLOP/s on Zen 5 at one thread, against 127-131 for 6 rows and
// 128-131 for 2 (BM_MatmulBulk, haswell build).
inline constexpr int kRows = 4;
#endif
static_assert(kRows <= gemm::detail::Scratch::kMaxRows);
// Packed bytes of one block of a token block: the pairs x tokens x 4 bytes, the tokens' scales.
inline constexpr std::size_t kBlockBytes = kPairs * kBlockTokens * 4 + kBlockTokens * 4;

// The activation rows of a call, packed (see the top of the file); tokens past m and k past its end are 0.
struct PackedX {
  Buffer<uint8_t> data;
  std::size_t m = 0, k = 0, nb = 0;  // tokens, values of k, blocks of kQ
  std::size_t blocks() const { return (m + kBlockTokens - 1) / kBlockTokens; }
  const uint8_t* block(std::size_t tb, std::size_t b) const { return data.data() + (tb * nb + b) * kBlockBytes; }
};

inline void prepare(PackedX& p, std::size_t m, std::size_t k) {
  p.m = m, p.k = k, p.nb = (k + kQ - 1) / kQ;
  const std::size_t bytes = p.blocks() * p.nb * kBlockBytes;
  if (p.data.size() < bytes) p.data = Buffer<uint8_t>(bytes);
}

// A row block's segment of weights as codes: rows of kSegK int16 and each row's scale (as
// quantize_act_block's, with kWeightBits codes).
struct RowBlock {
  Buffer<int16_t> codes;
  std::array<float, kRows> scale{};
};

#if PP_F16_TILES_VNNI
// One token's block of n <= kQ values as int16 codes (kQ of them, zero past n) and their scale: 2^e, 0
// for a block of zeros (or of values below kTinyBlock), NaN for a block holding a NaN or an infinity
// (so that the outputs it reaches are NaN, as the exact path's would be NaN or infinite). The largest
// magnitude comes from the f32 bits (|x|'s bits order as |x| does; an infinity or NaN is above every
// finite value).
inline float quantize_act_block(const float* x, std::size_t n, __m256i& codes) {
  const __mmask16 live = n >= kQ ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
  const __m512 v = _mm512_maskz_loadu_ps(live, x);
  const uint32_t max_bits =
      _mm512_reduce_max_epu32(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
  codes = _mm256_setzero_si256();
  if (max_bits >= 0x7f800000u) return std::numeric_limits<float>::quiet_NaN();
  const float max = std::bit_cast<float>(max_bits);
  if (max < kTinyBlock) return 0.f;
  const int e = code_exponent(max, kActBits);
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(pow2(-e))));  // nearest, ties even
  const __m512i lim = _mm512_set1_epi32((1 << kActBits) - 1);
  codes = _mm512_cvtepi32_epi16(_mm512_max_epi32(_mm512_min_epi32(q, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim)));
  return pow2(e);
}

// A row's n values of F16 weights from `src` into codes (zero up to the next whole block) and its scale.
// The largest magnitude comes from the f16 bits themselves (|w|'s bits order as |w| does; an infinity or
// NaN is above every finite value). The codes need no clamp: a value within 2^2 of the largest is an
// 11-bit significand times 2^2 at most (|code| <= 8188), the others round to smaller codes.
inline void prepare_row(const uint16_t* src, std::size_t n, int16_t* codes, float& scale) {
  const std::size_t padded = (n + kQ - 1) / kQ * kQ;
  __m512i vmax = _mm512_setzero_si512();
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  for (std::size_t i = 0; i < n; i += 32) {
    const __mmask32 live = n - i >= 32 ? ~__mmask32(0) : __mmask32((1u << (n - i)) - 1);
    vmax = _mm512_max_epu16(vmax, _mm512_and_si512(_mm512_maskz_loadu_epi16(live, src + i), magnitude));
  }
  const __m256i m16 = _mm256_max_epu16(_mm512_castsi512_si256(vmax), _mm512_extracti64x4_epi64(vmax, 1));
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m16);
  const uint16_t max_bits = *std::max_element(lanes, lanes + 16);
  if (max_bits == 0 || max_bits >= 0x7c00) {  // all zero; an infinity or NaN (outputs NaN, see above)
    std::fill(codes, codes + padded, int16_t(0));
    scale = max_bits == 0 ? 0.f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const int e = code_exponent(f16_to_f32(max_bits), kWeightBits);
  const __m512 inv = _mm512_set1_ps(pow2(-e));
  for (std::size_t i = 0; i < n; i += kQ) {
    const __mmask16 live = n - i >= kQ ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, src + i)), inv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
  }
  scale = pow2(e);
}

// out[r * 32 + t] for R rows of codes (rows.codes, kSegK apart, starting at the segment's block b0), the
// segment's blocks [b0, b1) and token block tb of x. With `resume`, the chains go on from out.
template <int R>
inline void tile(const RowBlock& rows, const PackedX& x, std::size_t tb, std::size_t b0, std::size_t b1, float* out,
                 bool resume) {
  constexpr std::size_t TB = kBlockTokens;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (std::size_t b = b0; b < b1; ++b) {
    const uint8_t* xb = x.block(tb, b);
    const int16_t* wb = rows.codes.data() + (b - b0) * kQ;
    auto weight_pair = [&](int r, std::size_t j) {
      int32_t q;
      std::memcpy(&q, wb + std::size_t(r) * gemm::kSegK + 2 * j, 4);
      return _mm512_set1_epi32(q);
    };
    __m512i sum[R][2];
    {
      const __m512i x0 = _mm512_load_si512(xb), x1 = _mm512_load_si512(xb + 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i wq = weight_pair(r, 0);
        sum[r][0] = _mm512_madd_epi16(x0, wq);
        sum[r][1] = _mm512_madd_epi16(x1, wq);
      }
    }
#pragma GCC unroll 8
    for (std::size_t j = 1; j < kPairs; ++j) {
      const __m512i x0 = _mm512_load_si512(xb + j * TB * 4), x1 = _mm512_load_si512(xb + j * TB * 4 + 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i wq = weight_pair(r, j);
        sum[r][0] = _mm512_dpwssd_epi32(sum[r][0], x0, wq);
        sum[r][1] = _mm512_dpwssd_epi32(sum[r][1], x1, wq);
      }
    }
    const float* sx = reinterpret_cast<const float*>(xb + kPairs * TB * 4);
    const __m512 s0 = _mm512_load_ps(sx), s1 = _mm512_load_ps(sx + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][0]), s0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][1]), s1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 dw = _mm512_set1_ps(rows.scale[std::size_t(r)]);
    for (int v = 0; v < 2; ++v) {
      float* o = out + std::size_t(r) * TB + 16 * v;
      _mm512_store_ps(o, resume ? _mm512_fmadd_ps(acc[r][v], dw, _mm512_load_ps(o)) : _mm512_mul_ps(acc[r][v], dw));
    }
  }
}

#else
// AVX2 forms of the three above; the same codes, scales and sums (see Numerics).

// The largest of the 8 unsigned 32-bit lanes of v.
inline uint32_t max_epu32(__m256i v) {
  v = _mm256_max_epu32(v, _mm256_permute2x128_si256(v, v, 1));
  v = _mm256_max_epu32(v, _mm256_shuffle_epi32(v, 0x4e));
  v = _mm256_max_epu32(v, _mm256_shuffle_epi32(v, 0xb1));
  return uint32_t(_mm256_cvtsi256_si32(v));
}

// 16 int32 lanes (lo: values 0-7, hi: 8-15) as 16 int16 in order, each within int16 already.
inline __m256i narrow_epi32(__m256i lo, __m256i hi) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8);  // packs interleaves 128-bit lanes
}

inline float quantize_act_block(const float* x, std::size_t n, __m256i& codes) {
  alignas(32) float tail[kQ];
  if (n < kQ) {  // the last block of a row whose k is not a multiple of kQ
    std::fill(std::copy(x, x + n, tail), tail + kQ, 0.f);
    x = tail;
  }
  const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const uint32_t max_bits = max_epu32(_mm256_max_epu32(_mm256_and_si256(_mm256_castps_si256(v0), magnitude),
                                                       _mm256_and_si256(_mm256_castps_si256(v1), magnitude)));
  codes = _mm256_setzero_si256();
  if (max_bits >= 0x7f800000u) return std::numeric_limits<float>::quiet_NaN();
  const float max = std::bit_cast<float>(max_bits);
  if (max < kTinyBlock) return 0.f;
  const int e = code_exponent(max, kActBits);
  const __m256 inv = _mm256_set1_ps(pow2(-e));
  const __m256i lim = _mm256_set1_epi32((1 << kActBits) - 1), neg = _mm256_sub_epi32(_mm256_setzero_si256(), lim);
  auto code = [&](__m256 v) {
    return _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, inv)), lim), neg);
  };
  codes = narrow_epi32(code(v0), code(v1));
  return pow2(e);
}

inline void prepare_row(const uint16_t* src, std::size_t n, int16_t* codes, float& scale) {
  const std::size_t padded = (n + kQ - 1) / kQ * kQ, whole = n / kQ * kQ;
  __m256i vmax = _mm256_setzero_si256();
  const __m256i magnitude = _mm256_set1_epi16(0x7fff);
  for (std::size_t i = 0; i < whole; i += kQ)
    vmax = _mm256_max_epu16(vmax, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), magnitude));
  alignas(32) uint16_t lanes[kQ];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), vmax);
  uint16_t max_bits = *std::max_element(lanes, lanes + kQ);
  for (std::size_t i = whole; i < n; ++i) max_bits = std::max<uint16_t>(max_bits, src[i] & 0x7fff);
  if (max_bits == 0 || max_bits >= 0x7c00) {  // all zero; an infinity or NaN (outputs NaN, see above)
    std::fill(codes, codes + padded, int16_t(0));
    scale = max_bits == 0 ? 0.f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const int e = code_exponent(f16_to_f32(max_bits), kWeightBits);
  const __m256 inv = _mm256_set1_ps(pow2(-e));
  auto code = [&](const uint16_t* p) {
    return _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), inv));
  };
  auto store = [&](const uint16_t* p, std::size_t i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), narrow_epi32(code(p), code(p + 8)));
  };
  for (std::size_t i = 0; i < whole; i += kQ) store(src + i, i);
  if (whole < n) {
    alignas(32) uint16_t tail[kQ] = {};
    std::copy(src + whole, src + n, tail);
    store(tail, whole);
  }
  scale = pow2(e);
}

// out[r * TB + t] for R rows of codes (rows.codes, kSegK apart, starting at the segment's block b0), the
// segment's blocks [b0, b1) and token block tb of x. With `resume`, the chains go on from out.
template <int R>
inline void tile(const RowBlock& rows, const PackedX& x, std::size_t tb, std::size_t b0, std::size_t b1, float* out,
                 bool resume) {
  constexpr std::size_t TB = kBlockTokens, V = kVecs;
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (std::size_t v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (std::size_t b = b0; b < b1; ++b) {
    const uint8_t* xb = x.block(tb, b);
    const int16_t* wb = rows.codes.data() + (b - b0) * kQ;
    __m256i sum[R][V];
#pragma GCC unroll 8
    for (std::size_t j = 0; j < kPairs; ++j) {
      __m256i xv[V];
      for (std::size_t v = 0; v < V; ++v) {
        xv[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(xb + (j * TB + v * 8) * 4));
        // In a register: GCC would fold the load into every vpmaddwd, R loads instead of one
        // (BM_MatmulBulk F16 with 3 rows a tile, Zen 5: 105-108 GFLOP/s folded, 114-116 in registers).
        __asm__("" : "+x"(xv[v]));
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t q;
        std::memcpy(&q, wb + std::size_t(r) * gemm::kSegK + 2 * j, 4);
        const __m256i wq = _mm256_set1_epi32(q);
        for (std::size_t v = 0; v < V; ++v) {
          const __m256i p = _mm256_madd_epi16(xv[v], wq);
          sum[r][v] = j == 0 ? p : _mm256_add_epi32(sum[r][v], p);
          // Opaque to the optimizer: GCC 12 otherwise reassociates a block's int32 adds into a tree
          // whose products spill to the stack (BM_MatmulBulk F16, Zen 5: 69-73 GFLOP/s, the exact tiles
          // 96-97).
          __asm__("" : "+x"(sum[r][v]));
        }
      }
    }
    const float* sx = reinterpret_cast<const float*>(xb + kPairs * TB * 4);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (std::size_t v = 0; v < V; ++v)
        acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][v]), _mm256_load_ps(sx + v * 8), acc[r][v]);
  }
  for (int r = 0; r < R; ++r) {
    const __m256 dw = _mm256_set1_ps(rows.scale[std::size_t(r)]);
    for (std::size_t v = 0; v < V; ++v) {
      float* o = out + std::size_t(r) * TB + 8 * v;
      _mm256_store_ps(o, resume ? _mm256_fmadd_ps(acc[r][v], dw, _mm256_load_ps(o)) : _mm256_mul_ps(acc[r][v], dw));
    }
  }
}
#endif

// Packs token blocks [tb0, tb1) of x [m, k].
inline void pack_blocks(const float* x, PackedX& p, std::size_t tb0, std::size_t tb1) {
  constexpr std::size_t TB = kBlockTokens;
  for (std::size_t tb = tb0; tb < tb1; ++tb)
    for (std::size_t b = 0; b < p.nb; ++b) {
      uint8_t* out = p.data.data() + (tb * p.nb + b) * kBlockBytes;
      float* scales = reinterpret_cast<float*>(out + kPairs * TB * 4);
      for (std::size_t l = 0; l < TB; ++l) {
        const std::size_t t = tb * TB + l;
        __m256i codes = _mm256_setzero_si256();
        scales[l] = t < p.m ? quantize_act_block(x + t * p.k + b * kQ, std::min(kQ, p.k - b * kQ), codes) : 0.f;
        alignas(32) uint32_t pairs[kPairs];
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), codes);
        for (std::size_t j = 0; j < kPairs; ++j) std::memcpy(out + (j * TB + l) * 4, &pairs[j], 4);
      }
    }
}

// kTable[R - 1]: the tile for a block of R rows.
inline constexpr auto kTable = gemm::detail::row_table<kRows>([]<int R>() { return &tile<R>; });

// y[m, w.rows] (rows [r0, r1) only) = x * w^T for F16 weights, x packed by pack_blocks; k in segments of
// gemm::kSegK (gemm::for_each_tile). The row block's codes are the calling thread's.
inline void matmul_packed(const MatView& w, const PackedX& x, float* y, std::size_t r0, std::size_t r1) {
  constexpr std::size_t kSegBlocks = gemm::kSegK / kQ;
  const std::size_t k = w.cols, nb = x.nb;
  static thread_local RowBlock rows;
  if (rows.codes.size() < kRows * gemm::kSegK) rows.codes = Buffer<int16_t>(kRows * gemm::kSegK);
  auto prepare = [&](std::size_t rb, std::size_t rn, std::size_t seg) {
    for (std::size_t r = 0; r < rn; ++r)
      prepare_row(reinterpret_cast<const uint16_t*>(w.row(rb + r)) + seg * gemm::kSegK, gemm::seg_len(k, seg),
                  rows.codes.data() + r * gemm::kSegK, rows.scale[r]);
  };
  auto prefetch = [&](std::size_t rb, std::size_t rn, std::size_t seg) {
    gemm::prefetch_rows<2>(w, rb, rn, seg * gemm::kSegK, gemm::seg_len(k, seg), 2);  // into L2
  };
  auto tile = [&](std::size_t, std::size_t rn, std::size_t tb, std::size_t seg, float* acc, bool resume) {
    kTable[rn - 1](rows, x, tb, seg * kSegBlocks, std::min(nb, (seg + 1) * kSegBlocks), acc, resume);
  };
  gemm::for_each_tile<kRows>(x.blocks(), gemm::seg_count(k), std::min(nb, kSegBlocks) * kBlockBytes, x.m, y, w.rows, r0,
                         r1, prepare, prefetch, tile);
}
#endif

}  // namespace pp::kernels::gemm_f16
