// ggml's block-quantized weights: activation quantization and the dot kernels of both numeric paths
// (block layouts and dequantization: quant_blocks.hpp; quantizing weights: io/quantize.hpp).
//
// Exact path: each weight block is dequantized to f32 (the values ggml's dequantize_row_*
// gives) and multiplied into f32 activations with f32 accumulation. Fast path (llama.cpp's scheme): the
// activation rows are quantized once per matmul to int8 blocks (ActQ8 for the 32-element formats, ggml's
// Q8_K for the K-quants) and every block product is an integer dot product times the two blocks' scales.
// kernels::matmul takes the exact path unless asked; pp::StageOptions::fast_quant chooses (fast by default).
//
// Invariant (as in matmul.hpp): one weight row's dot with one activation row is the same sequence of
// operations whatever the number of tokens in the call, on either path.
#pragma once

#include <pp/core/dtype.hpp>
#include <pp/core/float16.hpp>
#include <pp/kernels/quant_blocks.hpp>
#include <pp/kernels/simd.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace pp::quant {


// ---- Activation quantization (fast path), rounding as llama.cpp's CPU backend does, so the fast path
// reproduces its numerics: symmetric int8, round to nearest even; Q8_0 / Q8_1 keep f16 scales. ----

inline float f16_round(float v) { return f16_to_f32(f32_to_f16(v)); }

inline void quantize_act(const float* x, ActQ8& b) {
  const float amax = abs_max(x, 32), d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < 32; ++j) sum += b.qs[j] = int8_t(std::nearbyint(x[j] * id));
  b.d = f16_round(d), b.s = f16_round(d * float(sum));
}
// ggml's Q8_K reference: the largest-magnitude value maps to -127 (so d may be negative).
inline void quantize_act(const float* x, BlockQ8_K& b) {
  float mx;
  if (abs_max(x, 256, &mx) == 0.f) {
    std::memset(&b, 0, sizeof b);
    return;
  }
  const float iscale = -127.f / mx;
  for (int j = 0; j < 256; ++j) b.qs[j] = int8_t(std::min(127, int(std::nearbyint(iscale * x[j]))));
  for (int g = 0; g < 16; ++g) {
    int s = 0;
    for (int l = 0; l < 16; ++l) s += b.qs[16 * g + l];
    b.bsums[g] = int16_t(s);
  }
  b.d = 1.f / iscale;
}

// Bytes of one quantized activation row of n elements for weights of type t.
inline std::size_t act_row_bytes(DType t, std::size_t n) {
  return visit(t, [&](auto f) {
    using Act = typename decltype(f)::Act;
    return n / Act::kElems * sizeof(Act);
  });
}
// An upper bound of act_row_bytes over every type, for sizing scratch.
inline constexpr std::size_t act_row_bytes_bound(std::size_t n) { return (n + 31) / 32 * sizeof(ActQ8); }

inline void quantize_act_row(DType t, const float* x, std::size_t n, uint8_t* out) {
  visit(t, [&](auto f) {
    using Act = typename decltype(f)::Act;
    Act* b = reinterpret_cast<Act*>(out);
    for (std::size_t i = 0; i < n / Act::kElems; ++i) quantize_act(x + i * Act::kElems, b[i]);
  });
}

// ---- Exact path: the f32 dot over blocks dequantized by quant_blocks.hpp's dequantize_simd. ----

// y[t * ys] = dot(w[0, n), x[t * xs + (0, n)]) for t < NT: each block dequantized once for the NT tokens.
template <class A, int NT, class Block>
inline void dot_exact(const Block* w, std::size_t n, const float* x, std::size_t xs, float* y, std::size_t ys) {
  using B = fb<A>;
  constexpr std::size_t W = B::size, E = Block::kElems;
  constexpr int K = simd::kAccumulators<A>;
  B acc[NT][K];
  for (int t = 0; t < NT; ++t)
    for (int k = 0; k < K; ++k) acc[t][k] = B(0.f);
  alignas(64) float buf[E];
  for (std::size_t i = 0; i < n / E; ++i) {
    dequantize_simd<A>(w[i], buf);
    const float* xi = x + i * E;
    for (std::size_t k = 0; k < E / W; ++k) {
      const B wk = B::load_aligned(buf + k * W);
      for (int t = 0; t < NT; ++t)
        acc[t][k % K] = simd::fma(wk, B::load_unaligned(xi + t * xs + k * W), acc[t][k % K]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    B s = acc[t][0];
    for (int k = 1; k < K; ++k) s += acc[t][k];
    y[t * ys] = xsimd::hadd(s);
  }
}

// ---- Fast path: integer dot products against quantized activations. ----

// The 32 codes of a 32-block as the integer kernels read them: signed (q - offset) for the symmetric
// formats, unsigned q for the ones with a min.
template <class A> inline simd::Bytes32<A> codes(const BlockQ8_0& b) { return simd::Bytes32<A>::load(b.qs); }
template <class A> inline simd::Bytes32<A> codes(const BlockQ4_0& b) { return simd::Bytes32<A>::nibbles(b.qs).minus(8); }
template <class A> inline simd::Bytes32<A> codes(const BlockQ4_1& b) { return simd::Bytes32<A>::nibbles(b.qs); }
template <class A> inline simd::Bytes32<A> codes(const BlockQ5_0& b) {
  using Q = simd::Bytes32<A>;
  return (Q::nibbles(b.qs) | Q::bit4_of_mask(load_u32(b.qh))).minus(16);
}
template <class A> inline simd::Bytes32<A> codes(const BlockQ5_1& b) {
  using Q = simd::Bytes32<A>;
  return Q::nibbles(b.qs) | Q::bit4_of_mask(load_u32(b.qh));
}
template <class Block>
inline constexpr bool kHasMin = std::is_same_v<Block, BlockQ4_1> || std::is_same_v<Block, BlockQ5_1>;

#if XSIMD_WITH_AVX512BW
namespace k512 {
template <int NT>
inline void dot_q8_0(const BlockQ8_0* w, std::size_t n, const uint8_t* xq, std::size_t xqs, float* y, std::size_t ys);
}  // namespace k512
#endif

// y[t * ys] = dot(w, activation row t) for t < NT; activation rows (ActQ8 blocks) are xqs bytes apart.
template <class A, int NT, class Block>
inline void dot_fast(const Block* w, std::size_t n, const uint8_t* xq, std::size_t xqs, float* y, std::size_t ys)
  requires(Block::kElems == 32)
{
#if XSIMD_WITH_AVX512BW
  if constexpr (std::is_same_v<Block, BlockQ8_0> && std::is_base_of_v<xsimd::avx512bw, A>)
    return k512::dot_q8_0<NT>(w, n, xq, xqs, y, ys);
#endif
  using IA = simd::IntArch<A>;
  using F = fb<IA>;
  using I = ib<IA>;
  using Q = simd::Bytes32<A>;
  // Two chains a token, even and odd blocks: one FMA a block on a single chain waits for the last, which
  // held a decode step below the memory's rate (Q8_0 on AVX2: docs/PERFORMANCE.md, "The same host as an
  // AVX2-only CPU").
  F acc[NT][2];
  float mins[NT];
  const ActQ8* a[NT];
  for (int t = 0; t < NT; ++t)
    acc[t][0] = acc[t][1] = F(0.f), mins[t] = 0.f, a[t] = reinterpret_cast<const ActQ8*>(xq + t * xqs);
  const auto block = [&]<int K>(std::size_t i) {
    const Block& b = w[i];
    simd::prefetch_ahead(&b, sizeof(Block));
    const Q q = codes<A>(b);
    const float d = h2f(b.d);
    for (int t = 0; t < NT; ++t) {
      const ActQ8& x = a[t][i];
      const Q s = Q::load(x.qs);
      const I p = kHasMin<Block> ? simd::dot_us<A>(I(0), q, s) : simd::dot_ss<A>(I(0), q, s);
      acc[t][K] = simd::fma(xsimd::to_float(p), F(d * x.d), acc[t][K]);
      if constexpr (kHasMin<Block>) mins[t] += h2f(b.m) * x.s;
    }
  };
  const std::size_t nb = n / 32;
  std::size_t i = 0;
  for (; i + 2 <= nb; i += 2) block.template operator()<0>(i), block.template operator()<1>(i + 1);
  if (i < nb) block.template operator()<0>(i);
  for (int t = 0; t < NT; ++t) y[t * ys] = xsimd::hadd(acc[t][0] + acc[t][1]) + mins[t];
}

#if XSIMD_WITH_AVX2
// A Q4_K / Q5_K block's 8 scales and 8 mins (12 bytes of 6-bit fields, unpacked as scales_mins_k4 does it,
// in four dwords: scales 0-3, 4-7, mins 0-3, 4-7) as bytes 0-7 and 8-15 of a register, without leaving the
// vector registers: about 10 instructions against some 25 through bytes in memory. Reads 16 bytes from
// `q`, still in the block: 4 bytes of codes (Q5_K: high bits) follow its scales.
inline __m128i scales_mins_k4(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));  // dwords a, b, c
  const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x3f));                 // a & 0x3f.., b & 0x3f..
  const __m128i c = _mm_srlv_epi32(_mm_shuffle_epi32(v, 0xaa), _mm_setr_epi32(0, 4, 0, 0));  // c, c >> 4
  const __m128i hi = _mm_or_si128(_mm_and_si128(c, _mm_set1_epi8(0x0f)),
                                  _mm_and_si128(_mm_srli_epi32(v, 2), _mm_set1_epi8(0x30)));
  return _mm_unpacklo_epi32(lo, hi);
}
#endif

// A Q4_K / Q5_K block's scales as groups_of(pairs) gives them and its mins in lanes 2j and 2j + 1
// (sub-block j), for arch A's dot_us_scaled and madd.
template <class G, class S>
struct K4ScalesMins {
  G groups;
  S mins;
};
template <class A>
inline auto k4_scales_mins(const uint8_t* q) {
  using S = simd::Shorts16<A>;
  using G = std::remove_cvref_t<decltype(simd::groups_of(std::declval<S>()))>;
#if XSIMD_WITH_AVX2
  if constexpr (std::is_same_v<S, simd::Shorts256>) {
    const __m128i sm = scales_mins_k4(q);
    const __m256i mins = _mm256_shuffle_epi8(  // word k of each half = byte 8 + k / 2 (low half) or 12 + k / 2
        _mm256_broadcastsi128_si256(sm),
        _mm256_set_epi8(-1, 15, -1, 15, -1, 14, -1, 14, -1, 13, -1, 13, -1, 12, -1, 12,  //
                        -1, 11, -1, 11, -1, 10, -1, 10, -1, 9, -1, 9, -1, 8, -1, 8));
    return K4ScalesMins<G, S>{G::of_u8(sm), S{mins}};
  } else
#endif
  {
    uint8_t sc[8], mn[8];
    scales_mins_k4(q, sc, mn);
    return K4ScalesMins<G, S>{simd::groups_of(S::pairs_u8(sc)), S::pairs_u8(mn)};
  }
}

#if XSIMD_WITH_AVX512BW
// The K-quants on AVX-512BW: 64 codes a register, two sub-blocks (Q4_K / Q5_K) or four 16-groups (Q6_K)
// at once, against the activation bytes as Q8_K stores them (no shuffle on that side). The int16 pair
// sums of vpmaddubsw (|u| <= 63, |s| <= 127: at most 16002) are multiplied by each lane's scale and
// summed into int32 by vpdpwssd where AVX512-VNNI is compiled in, vpmaddwd + vpaddd otherwise: the same
// exact integers either way. Per block, the 16 int32 lanes become f32 and are scaled into f32 lanes.
namespace k512 {
inline __m512i dot_scaled(__m512i acc, __m512i u, __m512i s, __m512i sc) {
  const __m512i p = _mm512_maddubs_epi16(u, s);
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, p, sc);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, sc));
#endif
}
// 32 bytes in both halves, the high half shifted right by `hi_shift` bits (in 64-bit lanes: callers mask
// to bits that stay within their byte).
inline __m512i halves(const uint8_t* p32, int lo_shift, int hi_shift) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p32)));
  return _mm512_srlv_epi64(v, _mm512_set_epi64(hi_shift, hi_shift, hi_shift, hi_shift, lo_shift, lo_shift, lo_shift,
                                                lo_shift));
}
// Lane-index vectors for vpermw: lane i of kPick[c] = 4c + i / 8 (Q6_K's 16-groups of a 64-element
// chunk c) and, read as 2c + i / 16, the two sub-blocks of Q4_K's chunk c.
// kPick.mins: lanes 2j and 2j + 1 = 8 + j (Q4_K's min j, after its 8 scales).
struct alignas(64) PickTable {
  int16_t k6[4][32], k4[4][32], mins[32];
  constexpr PickTable() : k6{}, k4{}, mins{} {
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < 32; ++i) k6[c][i] = int16_t(4 * c + i / 8), k4[c][i] = int16_t(2 * c + i / 16);
    for (int i = 0; i < 32; ++i) mins[i] = int16_t(8 + i / 2 % 8);
  }
};
inline constexpr PickTable kPick{};
inline __m512i pick(const int16_t* idx, __m512i v) {
  return _mm512_permutexvar_epi16(_mm512_load_si512(idx), v);
}
inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }
inline float reduce(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

template <int NT, class Block>
inline void dot_k4(const Block* w, std::size_t n, const uint8_t* xq, std::size_t xqs, float* y, std::size_t ys) {
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  __m512 acc[NT];
  __m256 accm[NT];
  const BlockQ8_K* a[NT];
  for (int t = 0; t < NT; ++t)
    acc[t] = _mm512_setzero_ps(), accm[t] = _mm256_setzero_ps(), a[t] = reinterpret_cast<const BlockQ8_K*>(xq + t * xqs);
  for (std::size_t i = 0; i < n / 256; ++i) {
    const Block& b = w[i];
    simd::prefetch_ahead(&b, sizeof(Block));
    const __m512i scw = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(scales_mins_k4(b.scales)));
    const __m256i mins = _mm512_castsi512_si256(pick(kPick.mins, scw));  // lanes 2j, 2j + 1: min j
    __m512i u[4], scale[4];
    for (int c = 0; c < 4; ++c) {  // elements 64c ..: sub-block 2c in the low half, 2c + 1 in the high
      u[c] = _mm512_and_si512(halves(b.qs + 32 * c, 0, 4), m4);
      if constexpr (std::is_same_v<Block, BlockQ5_K>) {  // + 16 where bit 2c (2c + 1) of qh[l] is set
        const __m512i bit = _mm512_mask_blend_epi64(0xf0, _mm512_set1_epi8(int8_t(1u << (2 * c))),
                                                    _mm512_set1_epi8(int8_t(1u << (2 * c + 1))));
        const __mmask64 set = _mm512_test_epi8_mask(halves(b.qh, 0, 0), bit);
        u[c] = _mm512_mask_add_epi8(u[c], set, u[c], _mm512_set1_epi8(16));
      }
      scale[c] = pick(kPick.k4[c], scw);
    }
    uint32_t d_dmin;  // d and dmin, adjacent f16, to lanes 0 and 1 in one conversion
    std::memcpy(&d_dmin, &b.d, 4);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(int(d_dmin)));
    for (int t = 0; t < NT; ++t) {
      const BlockQ8_K& x = a[t][i];
      __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(u[0], _mm512_loadu_si512(x.qs)), scale[0]);
      for (int c = 1; c < 4; ++c) p = dot_scaled(p, u[c], _mm512_loadu_si512(x.qs + 64 * c), scale[c]);
      const __m256i m = _mm256_madd_epi16(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums)));
      const __m128 s = _mm_mul_ps(dd, _mm_set1_ps(x.d));  // d x.d, dmin x.d
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_broadcastss_ps(s), acc[t]);
      accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_broadcastss_ps(_mm_movehdup_ps(s)), accm[t]);
    }
  }
  for (int t = 0; t < NT; ++t) y[t * ys] = reduce(acc[t]) - reduce(accm[t]);
}

template <int NT>
inline void dot_k6(const BlockQ6_K* w, std::size_t n, const uint8_t* xq, std::size_t xqs, float* y, std::size_t ys) {
  const __m512i m4 = _mm512_set1_epi8(0x0f), m3 = _mm512_set1_epi8(0x03);
  __m512 acc[NT];
  __m256 acco[NT];
  const BlockQ8_K* a[NT];
  for (int t = 0; t < NT; ++t)
    acc[t] = _mm512_setzero_ps(), acco[t] = _mm256_setzero_ps(), a[t] = reinterpret_cast<const BlockQ8_K*>(xq + t * xqs);
  for (std::size_t i = 0; i < n / 256; ++i) {
    const BlockQ6_K& b = w[i];
    simd::prefetch_ahead(&b, sizeof(BlockQ6_K));
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)));
    const __m512i scw = _mm512_castsi256_si512(sc16);
    __m512i u[4], scale[4];
    for (int h = 0; h < 2; ++h) {  // chunk 2h + k2: elements 128h + 64 k2 .., low nibbles for k2 = 0
      const __m512i ql = _mm512_loadu_si512(b.ql + 64 * h);
      const __m512i hi01 = _mm512_slli_epi16(_mm512_and_si512(halves(b.qh + 32 * h, 0, 2), m3), 4);
      const __m512i hi23 = _mm512_slli_epi16(_mm512_and_si512(halves(b.qh + 32 * h, 4, 6), m3), 4);
      u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), hi01);
      u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), hi23);
    }
    for (int c = 0; c < 4; ++c) scale[c] = pick(kPick.k6[c], scw);
    const float d = h2f(b.d);
    for (int t = 0; t < NT; ++t) {
      const BlockQ8_K& x = a[t][i];
      __m512i p = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) p = dot_scaled(p, u[c], _mm512_loadu_si512(x.qs + 64 * c), scale[c]);
      const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums)));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d * x.d), acc[t]);
      acco[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(32.f * d * x.d), acco[t]);
    }
  }
  for (int t = 0; t < NT; ++t) y[t * ys] = reduce(acc[t]) - reduce(acco[t]);
}

// Q8_0 two blocks a register: codes of blocks i and i + 1 in the low and high halves, |w| x (s with w's
// sign) summed in runs of 4 into 16 int32 lanes (vpdpbusd; vpmaddubsw + vpmaddwd by ones without VNNI, the
// same integers), then one f32 FMA by d_w x d_x of each half's block. On 256-bit halves a block at a
// time (the generic kernel) that FMA is one dependent chain a 34-byte block, which at 4 cycles held a
// decode step below the memory's rate on Zen 5; here it is one a 68 bytes. Each lane's chain runs over
// the blocks in order whatever NT is (an odd last block fills the low half, the high half zero), so a
// row's result does not depend on the tokens beside it.
template <int NT>
inline void dot_q8_0(const BlockQ8_0* w, std::size_t n, const uint8_t* xq, std::size_t xqs, float* y, std::size_t ys) {
  const auto ld = [](const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  const auto pair = [&](const int8_t* lo, const int8_t* hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(ld(lo)), ld(hi), 1);
  };
  const auto dot = [](__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
  };
  __m512 acc[NT];
  const ActQ8* a[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps(), a[t] = reinterpret_cast<const ActQ8*>(xq + t * xqs);
  // Blocks i and i + 1, or block i alone (Two = false: the high half zero, its scale 0).
  const auto step = [&]<bool Two>(std::size_t i) {
    const auto codes = [&](const int8_t* lo, const int8_t* hi) {
      return Two ? pair(lo, hi) : _mm512_zextsi256_si512(ld(lo));
    };
    const __m512i q = codes(w[i].qs, w[i + Two].qs);
    const __m512i u = _mm512_abs_epi8(q);
    const __mmask64 neg = _mm512_movepi8_mask(q);
    const float d0 = h2f(w[i].d), d1 = Two ? h2f(w[i + 1].d) : 0.f;
    for (int t = 0; t < NT; ++t) {
      const ActQ8& x0 = a[t][i];
      const ActQ8& x1 = a[t][i + Two];
      const __m512i s = codes(x0.qs, x1.qs);
      const __m512i p = dot(u, _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s));
      const __m512 sc = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d0 * x0.d), _mm512_set1_ps(d1 * x1.d));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[t]);
    }
  };
  const std::size_t nb = n / 32;
  std::size_t i = 0;
  for (; i + 2 <= nb; i += 2) {
    simd::prefetch_ahead(w + i, 2 * sizeof(BlockQ8_0));
    step.template operator()<true>(i);
  }
  if (i < nb) step.template operator()<false>(i);
  for (int t = 0; t < NT; ++t) y[t * ys] = reduce(acc[t]);
}
}  // namespace k512
#endif

// Q4_K / Q5_K: sum_j d sc_j (q . s)_j - dmin m_j (sum of s over sub-block j), times the activation scale.
template <class A, int NT, class Block>
inline void dot_fast(const Block* w, std::size_t n, const uint8_t* xq, std::size_t xqs, float* y, std::size_t ys)
  requires(std::is_same_v<Block, BlockQ4_K> || std::is_same_v<Block, BlockQ5_K>)
{
#if XSIMD_WITH_AVX512BW
  if constexpr (std::is_base_of_v<xsimd::avx512bw, A>) return k512::dot_k4<NT>(w, n, xq, xqs, y, ys);
#endif
  using IA = simd::IntArch<A>;
  using F = fb<IA>;
  using I = ib<IA>;
  using Q = simd::Bytes32<A>;
  using S = simd::Shorts16<A>;
  F acc[NT], accm[NT];
  const BlockQ8_K* a[NT];
  for (int t = 0; t < NT; ++t) acc[t] = accm[t] = F(0.f), a[t] = reinterpret_cast<const BlockQ8_K*>(xq + t * xqs);
  for (std::size_t i = 0; i < n / 256; ++i) {
    const Block& b = w[i];
    simd::prefetch_ahead(&b, sizeof(Block));
    const auto [groups, mins] = k4_scales_mins<A>(b.scales);
    // Sub-block by sub-block, every token: its codes and multipliers live only while they are used (all
    // eight of a block held at once spilled to the stack on AVX2's 16 registers). Integer sums: any order.
    I p[NT];
    for (int t = 0; t < NT; ++t) p[t] = I(0);
    for (int j = 0; j < 8; ++j) {
      Q u = j % 2 == 0 ? Q::low_nibbles(b.qs + 32 * (j / 2)) : Q::high_nibbles(b.qs + 32 * (j / 2));
      if constexpr (std::is_same_v<Block, BlockQ5_K>) u = u | Q::bit4_of_bytes(b.qh, j);
      const S g = groups.group(j);
      for (int t = 0; t < NT; ++t) p[t] = simd::dot_us_scaled<A>(p[t], u, Q::load(a[t][i].qs + 32 * j), g);
    }
    const float d = h2f(b.d), dmin = h2f(b.dmin);
    for (int t = 0; t < NT; ++t) {
      const BlockQ8_K& x = a[t][i];
      const I m = simd::madd<A>(mins, S::load(x.bsums));  // bsums 2j and 2j + 1 cover sub-block j
      acc[t] = simd::fma(xsimd::to_float(p[t]), F(d * x.d), acc[t]);
      accm[t] = simd::fma(xsimd::to_float(m), F(dmin * x.d), accm[t]);
    }
  }
  for (int t = 0; t < NT; ++t) y[t * ys] = xsimd::hadd(acc[t] - accm[t]);
}

// Q6_K: d sum_g sc_g ((q . s)_g - 32 (sum of s over group g)), times the activation scale.
template <class A, int NT, class Block>
inline void dot_fast(const Block* w, std::size_t n, const uint8_t* xq, std::size_t xqs, float* y, std::size_t ys)
  requires(std::is_same_v<Block, BlockQ6_K>)
{
#if XSIMD_WITH_AVX512BW
  if constexpr (std::is_base_of_v<xsimd::avx512bw, A>) return k512::dot_k6<NT>(w, n, xq, xqs, y, ys);
#endif
  using IA = simd::IntArch<A>;
  using F = fb<IA>;
  using I = ib<IA>;
  using Q = simd::Bytes32<A>;
  using S = simd::Shorts16<A>;
  F acc[NT], acco[NT];
  const BlockQ8_K* a[NT];
  for (int t = 0; t < NT; ++t) acc[t] = acco[t] = F(0.f), a[t] = reinterpret_cast<const BlockQ8_K*>(xq + t * xqs);
  for (std::size_t i = 0; i < n / 256; ++i) {
    const BlockQ6_K& b = w[i];
    simd::prefetch_ahead(&b, sizeof(BlockQ6_K));
    const S scales = S::widen_i8(b.scales);  // lane g: elements [16g, 16g + 16)
    const auto& groups = simd::groups_of(scales);
    // 32-group by 32-group, every token (as Q4_K above: nothing spilled). u: elements 128h + 32k + (0..31)
    // of group 4h + k, codes 0..63.
    I p[NT];
    for (int t = 0; t < NT; ++t) p[t] = I(0);
    for (int g = 0; g < 8; ++g) {
      const int h = g / 4, k = g % 4;
      const uint8_t* ql = b.ql + 64 * h + 32 * (k & 1);
      const Q u = (k < 2 ? Q::low_nibbles(ql) : Q::high_nibbles(ql)) | Q::bits45_of_bytes(b.qh + 32 * h, 2 * k);
      const S sc = groups.group(g);
      for (int t = 0; t < NT; ++t) p[t] = simd::dot_us_scaled<A>(p[t], u, Q::load(a[t][i].qs + 32 * g), sc);
    }
    const float d = h2f(b.d);
    for (int t = 0; t < NT; ++t) {
      const BlockQ8_K& x = a[t][i];
      const I off = simd::madd<A>(scales, S::load(x.bsums));
      acc[t] = simd::fma(xsimd::to_float(p[t]), F(d * x.d), acc[t]);
      acco[t] = simd::fma(xsimd::to_float(off), F(32.f * d * x.d), acco[t]);
    }
  }
  for (int t = 0; t < NT; ++t) y[t * ys] = xsimd::hadd(acc[t] - acco[t]);
}

// ---- Row loops ----

// y[m, w.rows] (rows [r0, r1) only) = x[m, w.cols] * w^T for quantized w. With xq (the rows of x quantized
// by quantize_act_row, act_row_bytes apart) the fast path runs, otherwise the exact one.
template <class A, class Block>
inline void matmul_rows_typed(const MatView& w, const float* x, const uint8_t* xq, std::size_t m, float* y,
                              std::size_t r0, std::size_t r1, std::size_t xqs) {
  const std::size_t n = w.cols, ys = w.rows;
  auto tile = [&]<int NT>(std::size_t r, std::size_t t) {
    const Block* wr = reinterpret_cast<const Block*>(w.row(r));
    if (xq) dot_fast<A, NT>(wr, n, xq + t * xqs, xqs, y + t * ys + r, ys);
    else dot_exact<A, NT>(wr, n, x + t * n, n, y + t * ys + r, ys);
  };
  // A block of weight rows stays in cache while every token tile passes over it.
  constexpr std::size_t kRowBlock = 16;
  for (std::size_t rb = r0; rb < r1; rb += kRowBlock) {
    const std::size_t re = std::min(rb + kRowBlock, r1);
    std::size_t t = 0;
    for (; t + 4 <= m; t += 4)
      for (std::size_t r = rb; r < re; ++r) tile.template operator()<4>(r, t);
    for (std::size_t r = rb; r < re; ++r) {
      switch (m - t) {
        case 3: tile.template operator()<3>(r, t); break;
        case 2: tile.template operator()<2>(r, t); break;
        case 1: tile.template operator()<1>(r, t); break;
        default: break;
      }
    }
  }
}

template <class A>
inline void matmul_rows(const MatView& w, const float* x, const uint8_t* xq, std::size_t m, float* y, std::size_t r0,
                        std::size_t r1) {
  const std::size_t xqs = xq ? act_row_bytes(w.type, w.cols) : 0;
  visit(w.type, [&](auto f) {
    matmul_rows_typed<A, typename decltype(f)::Block>(w, x, xq, m, y, r0, r1, xqs);
  });
}

}  // namespace pp::quant
