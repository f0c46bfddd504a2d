// The only file with ISA intrinsics: the compiled-in xsimd architectures and weight widening to f32.
//
// Kernels are templates over an xsimd architecture A. `Archs` lists every architecture this build can
// run (the best first); tests run each kernel on all of them against a scalar oracle.
//
// x86-64: AVX-512BW, FMA3+AVX2, SSE4.2 (x86-64-v2). AArch64: neon64 (Advanced SIMD is part of the base
// ISA), whose integer dots use sdot where the build targets it (__ARM_FEATURE_DOTPROD, e.g.
// -march=armv8.2-a+dotprod) and widening multiplies otherwise, with the same int32 lanes either way.
#pragma once

#include <pp/core/cpu_features.hpp>
#include <pp/core/float16.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <xsimd/xsimd.hpp>

#if XSIMD_WITH_NEON64
#include <arm_neon.h>
#elif !XSIMD_WITH_SSE4_2
#error "pp needs x86-64-v2 (SSE4.2) or AArch64 (NEON): build with -march=x86-64-v2 or higher, or for aarch64"
#endif

namespace pp::simd {

template <class... A>
struct ArchList {};

#if XSIMD_WITH_AVX512BW
using Avx512 = xsimd::avx512bw;
#endif
#if XSIMD_WITH_FMA3_AVX2
using Avx2 = xsimd::fma3<xsimd::avx2>;
#endif
#if XSIMD_WITH_SSE4_2
using Sse42 = xsimd::sse4_2;
#endif
#if XSIMD_WITH_NEON64
using Neon64 = xsimd::neon64;
#endif

#if XSIMD_WITH_SSE4_2
using Archs = ArchList<
#if XSIMD_WITH_AVX512BW
    Avx512,
#endif
#if XSIMD_WITH_FMA3_AVX2
    Avx2,
#endif
    Sse42>;
#else
using Archs = ArchList<Neon64>;
#endif

template <class L>
struct First;
template <class A, class... R>
struct First<ArchList<A, R...>> {
  using type = A;
};
using Best = First<Archs>::type;

template <class A>
inline const char* arch_name() {
  return A::name();
}

// The kernel target of this build as the tools print it (--version): the best architecture's name, on
// AArch64 "neon64" and the extensions the integer and bf16 kernels use ("neon64+dotprod").
inline const char* kernel_target() {
#if XSIMD_WITH_NEON64
  return "neon64"
#if defined(__ARM_FEATURE_DOTPROD)
         "+dotprod"
#endif
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
         "+bf16"
#endif
      ;
#else
  return arch_name<Best>();
#endif
}

template <class A>
using fbatch = xsimd::batch<float, A>;

// a * b + c with one rounding on every architecture with an FMA (xsimd 8.1 has no AVX-512 fma: its generic
// one is a multiply and an add, two roundings and two instructions, under -ffp-contract=off); SSE4.2 has
// none, and there it is that multiply and add.
template <class A>
inline fbatch<A> fma(const fbatch<A>& a, const fbatch<A>& b, const fbatch<A>& c) {
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of_v<xsimd::avx512f, A>) return fbatch<A>(_mm512_fmadd_ps(a, b, c));
  else
#endif
    return xsimd::fma(a, b, c);
}

// x86's maxps / minps on every architecture: a > b ? a : b and a < b ? a : b, so b when either is NaN
// (and b of -0 / +0). NEON's fmax / fmin return NaN instead; the sampler's NaN-skipping reductions need
// the x86 rule.
template <class A>
inline fbatch<A> max_x86(const fbatch<A>& a, const fbatch<A>& b) {
#if XSIMD_WITH_NEON64
  return xsimd::select(a > b, a, b);
#else
  return xsimd::max(a, b);
#endif
}
template <class A>
inline fbatch<A> min_x86(const fbatch<A>& a, const fbatch<A>& b) {
#if XSIMD_WITH_NEON64
  return xsimd::select(a < b, a, b);
#else
  return xsimd::min(a, b);
#endif
}

// The lanes of a float comparison as bits (lane i -> bit i).
template <class A>
inline uint32_t bitmask(const xsimd::batch_bool<float, A>& b) {
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of_v<xsimd::avx512f, A>) return uint32_t(__mmask16(b));
  else
#endif
#if XSIMD_WITH_AVX
  if constexpr (std::is_base_of_v<xsimd::avx, A>) return uint32_t(_mm256_movemask_ps(b));
  else
#endif
#if XSIMD_WITH_NEON64
  {
    static constexpr uint32_t kBit[4] = {1, 2, 4, 8};
    return vaddvq_u32(vandq_u32(uint32x4_t(b), vld1q_u32(kBit)));
  }
#else
    return uint32_t(_mm_movemask_ps(b));
#endif
}

// f's first half of lanes (lo) and second half (hi), widened to f64 (exact).
template <class A>
inline void widen(const fbatch<A>& f, xsimd::batch<double, A>& lo, xsimd::batch<double, A>& hi) {
  using D = xsimd::batch<double, A>;
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of_v<xsimd::avx512f, A>) {
    lo = D(_mm512_cvtps_pd(_mm512_castps512_ps256(f)));
    hi = D(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))));
  } else
#endif
#if XSIMD_WITH_AVX
  if constexpr (std::is_base_of_v<xsimd::avx, A>) {
    lo = D(_mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    hi = D(_mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
  } else
#endif
  {
#if XSIMD_WITH_NEON64
    lo = D(vcvt_f64_f32(vget_low_f32(f)));
    hi = D(vcvt_high_f64_f32(f));
#else
    lo = D(_mm_cvtps_pd(f));
    hi = D(_mm_cvtps_pd(_mm_movehl_ps(f, f)));
#endif
  }
}

// The two halves of a float lane mask as the masks of widen()'s lo and hi.
template <class A>
inline void widen(const xsimd::batch_bool<float, A>& m, xsimd::batch_bool<double, A>& lo, xsimd::batch_bool<double, A>& hi) {
  using D = xsimd::batch<double, A>;
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of_v<xsimd::avx512f, A>) {
    const __mmask16 k = m;
    lo = xsimd::batch_bool<double, A>(__mmask8(k)), hi = xsimd::batch_bool<double, A>(__mmask8(k >> 8));
  } else
#endif
  {
    D l, h;
    widen<A>(xsimd::bitwise_cast(m), l, h);  // all-ones lanes widen to NaN, zero lanes to 0
    lo = l != l, hi = h != h;
  }
}

// lo += wl and hi += wh in the lanes where m (a float mask over widen()'s halves: lo, then hi) is set.
template <class A>
inline void add_where(const xsimd::batch_bool<float, A>& m, const xsimd::batch<double, A>& wl,
                      const xsimd::batch<double, A>& wh, xsimd::batch<double, A>& lo, xsimd::batch<double, A>& hi) {
  using D = xsimd::batch<double, A>;
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of_v<xsimd::avx512f, A>) {
    const __mmask16 k = m;
    lo = D(_mm512_mask_add_pd(lo, __mmask8(k), lo, wl));
    hi = D(_mm512_mask_add_pd(hi, __mmask8(k >> 8), hi, wh));
  } else
#endif
  {
    xsimd::batch_bool<double, A> ml, mh;
    widen<A>(m, ml, mh);
    lo += xsimd::select(ml, wl, D(0.0)), hi += xsimd::select(mh, wh, D(0.0));
  }
}

// a * b + c in f64 with one rounding (see fma above).
template <class A>
inline xsimd::batch<double, A> fma(const xsimd::batch<double, A>& a, const xsimd::batch<double, A>& b,
                                   const xsimd::batch<double, A>& c) {
#if XSIMD_WITH_AVX512F
  if constexpr (std::is_base_of_v<xsimd::avx512f, A>) return xsimd::batch<double, A>(_mm512_fmadd_pd(a, b, c));
  else
#endif
    return xsimd::fma(a, b, c);
}

// Weight element tags: how a row of stored weights becomes f32 lanes.
struct F32w {
  using storage = float;
};
struct Bf16w {
  using storage = uint16_t;
};
struct F16w {
  using storage = uint16_t;
};

template <class A>
inline fbatch<A> load(F32w, const float* p) {
  return fbatch<A>::load_unaligned(p);
}

// bf16 -> f32 is a 16-bit left shift of each element.
#if XSIMD_WITH_AVX512F
inline __m512 widen_bf16(const uint16_t* p, const xsimd::avx512f&) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen_f16(const uint16_t* p, const xsimd::avx512f&) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
#if XSIMD_WITH_AVX2
inline __m256 widen_bf16(const uint16_t* p, const xsimd::avx2&) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#if defined(__F16C__)
inline __m256 widen_f16(const uint16_t* p, const xsimd::avx2&) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
#endif
#if XSIMD_WITH_SSE4_2
inline __m128 widen_bf16(const uint16_t* p, const xsimd::sse4_2&) {
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}
// Without F16C: exact integer re-biasing (normals, subnormals via a float subtract, inf/NaN).
inline __m128 widen_f16(const uint16_t* p, const xsimd::sse4_2&) {
  const __m128i h = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
  __m128i o = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7fff)), 13);
  const __m128i exp = _mm_and_si128(o, _mm_set1_epi32(0x0f800000));
  o = _mm_add_epi32(o, _mm_set1_epi32((127 - 15) << 23));
  const __m128i is_infnan = _mm_cmpeq_epi32(exp, _mm_set1_epi32(0x0f800000));
  o = _mm_add_epi32(o, _mm_and_si128(is_infnan, _mm_set1_epi32((128 - 16) << 23)));
  const __m128i is_sub = _mm_cmpeq_epi32(exp, _mm_setzero_si128());
  const __m128 sub = _mm_sub_ps(_mm_castsi128_ps(_mm_add_epi32(o, _mm_set1_epi32(1 << 23))),
                                _mm_castsi128_ps(_mm_set1_epi32(113 << 23)));
  const __m128 r = _mm_blendv_ps(_mm_castsi128_ps(o), sub, _mm_castsi128_ps(is_sub));
  return _mm_or_ps(r, _mm_castsi128_ps(sign));
}
#endif
#if XSIMD_WITH_NEON64
inline float32x4_t widen_bf16(const uint16_t* p, const xsimd::neon64&) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
// fcvtl: exact for every f16 value (subnormals, inf, NaN).
inline float32x4_t widen_f16(const uint16_t* p, const xsimd::neon64&) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
#endif

template <class A>
inline fbatch<A> load(Bf16w, const uint16_t* p) {
  return fbatch<A>(widen_bf16(p, A{}));
}

template <class A>
inline fbatch<A> load(F16w, const uint16_t* p) {
#if XSIMD_WITH_AVX2 && !defined(__F16C__)
  if constexpr (std::is_base_of_v<xsimd::avx2, A> && !std::is_base_of_v<xsimd::avx512f, A>) {
    alignas(64) float tmp[8];
    for (int i = 0; i < 8; ++i) tmp[i] = f16_to_f32(p[i]);
    return fbatch<A>::load_aligned(tmp);
  } else
#endif
  return fbatch<A>(widen_f16(p, A{}));
}

// ---- bf16 dot products: the fast path of BF16 weights, activations rounded to bf16 as llama.cpp rounds
// them. Each f32 lane of an accumulator adds two bf16 products a step, twice the products of an f32
// FMA. x86-64: AVX512-BF16 (Zen 4/5, Cooper Lake, Sapphire Rapids), vdpbf16ps, 16 lanes. AArch64: the
// BF16 extension (__ARM_FEATURE_BF16_VECTOR_ARITHMETIC, e.g. -march=armv8.6-a: Neoverse V1/V2/N2,
// Graviton 3/4, Apple M2+), bfdot, 4 lanes; its pair sum rounds to odd where vdpbf16ps rounds to
// nearest, so the two agree to the f32 rounding of a chain, not bit for bit. Both flush subnormals.
// PP_HAVE_BF16_DOT: this build has one. ----
#if defined(__AVX512BF16__)
#define PP_HAVE_BF16_DOT 1
inline constexpr bool kHaveBf16Dot = true;
struct Bf16Dot {
  using Acc = __m512;
  using Vec = __m512i;
  static constexpr std::size_t kLanes = 16;  // f32 lanes of Acc, bf16 pairs of Vec
  static Acc zero() { return _mm512_setzero_ps(); }
  static Vec load(const uint32_t* p) { return _mm512_load_si512(p); }  // 64-byte aligned: 16 bf16 pairs
  static Vec broadcast_pair(uint32_t pair) { return _mm512_set1_epi32(int(pair)); }
  static void store(float* p, Acc a) { _mm512_store_ps(p, a); }  // 64-byte aligned
  static Acc load_acc(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
  static Acc dot(Acc acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  // The dot kernels' side (matmul.hpp): bf16 rows read where they lie, 32 elements a vector.
  static constexpr std::size_t kElems = 32;
  static Vec loadu(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static Vec load_first(const uint16_t* p, std::size_t count) {  // count < 32; the rest zero
    return _mm512_maskz_loadu_epi16(__mmask32((1u << count) - 1u), p);
  }
  static float sum(Acc a) { return _mm512_reduce_add_ps(a); }
};
#elif XSIMD_WITH_NEON64 && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#define PP_HAVE_BF16_DOT 1
inline constexpr bool kHaveBf16Dot = true;
struct Bf16Dot {
  using Acc = float32x4_t;
  using Vec = bfloat16x8_t;
  static constexpr std::size_t kLanes = 4;
  static Acc zero() { return vdupq_n_f32(0.f); }
  static Vec load(const uint32_t* p) { return vreinterpretq_bf16_u32(vld1q_u32(p)); }
  static Vec broadcast_pair(uint32_t pair) { return vreinterpretq_bf16_u32(vdupq_n_u32(pair)); }
  static void store(float* p, Acc a) { vst1q_f32(p, a); }
  static Acc load_acc(const float* p) { return vld1q_f32(p); }
  static Acc dot(Acc acc, Vec w, Vec x) { return vbfdotq_f32(acc, w, x); }
  static constexpr std::size_t kElems = 8;
  static Vec loadu(const uint16_t* p) { return vreinterpretq_bf16_u16(vld1q_u16(p)); }
  static Vec load_first(const uint16_t* p, std::size_t count) {  // count < 8; the rest zero
    uint16_t tail[kElems] = {};
    std::memcpy(tail, p, count * sizeof(uint16_t));
    return loadu(tail);
  }
  static float sum(Acc a) { return vaddvq_f32(a); }
};
#else
#define PP_HAVE_BF16_DOT 0
inline constexpr bool kHaveBf16Dot = false;
#endif

// Scalar widening for loop tails.
inline float load1(F32w, const float* p) { return *p; }
inline float load1(Bf16w, const uint16_t* p) { return bf16_to_f32(*p); }
inline float load1(F16w, const uint16_t* p) { return f16_to_f32(*p); }

// Accumulators per token in the dot kernels: enough independent FMA chains to hide latency,
// few enough that a 4-token tile stays in registers.
template <class A>
inline constexpr int kAccumulators = fbatch<A>::size >= 16 ? 4 : 2;

// Accumulators per token of the float-weight dot kernels, by weight type. F16 rows stream faster from
// memory with two 16-lane chains than with four (one cache line an iteration; pp_bench decode, see
// docs/PERFORMANCE.md); BF16 measured the same either way and keeps four, as F32 does. On 8-lane
// registers (AVX2) three: with two, each FMA waiting for the last held a core to 32 bytes of BF16 / F16
// per FMA latency, below the memory's rate; four make a 4-token tile 16 accumulators in AVX2's 16
// registers, spilled. Zen 5 as AVX2, one token streamed from memory (BM_MatmulFew): BF16 24 -> 38 GB/s,
// F16 30 -> 38, four tokens unchanged (docs/PERFORMANCE.md, "The same host as an AVX2-only CPU").
template <class A, class WT>
inline constexpr int kWeightAccumulators =
    fbatch<A>::size >= 16 ? (std::is_same_v<WT, F16w> ? 2 : 4) : fbatch<A>::size == 8 ? 3 : kAccumulators<A>;

// Weight rows lie end to end and are read once per token: fetching a fixed distance ahead of the read
// keeps one stream going across rows and pages (the hardware prefetcher stops at each 4 KiB page, and
// a bf16 row of 2048 is exactly one). How far, or whether at all, depends on the CPU
// (cpu::prefetch_bytes: a page ahead, none on Zen 4); read once, before main.
inline const std::size_t kPrefetchBytes = cpu::prefetch_bytes();

// Prefetches the cache lines of [p, p + bytes) kPrefetchBytes ahead (nothing where that is 0).
inline void prefetch_ahead(const void* p, std::size_t bytes) {
  if (kPrefetchBytes == 0) return;
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b + kPrefetchBytes);
}

// One f16 block scale to f32 (F16C's single-instruction form where compiled in; same value).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return f16_to_f32(h);
#endif
}

// ---- Quantized weights, exact path: W bytes (W = lanes of ibatch<A>) widened to int32 lanes. ----

template <class A>
using ibatch = xsimd::batch<int32_t, A>;

#if XSIMD_WITH_AVX512F
inline __m512i widen_u8(const uint8_t* p, const xsimd::avx512f&) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512i widen_i8(const int8_t* p, const xsimd::avx512f&) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
#if XSIMD_WITH_AVX2
inline __m256i widen_u8(const uint8_t* p, const xsimd::avx2&) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i widen_i8(const int8_t* p, const xsimd::avx2&) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#endif
#if XSIMD_WITH_NEON64
inline uint8x8_t load4_bytes_neon(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return vreinterpret_u8_u32(vdup_n_u32(v));
}
inline int32x4_t widen_u8(const uint8_t* p, const xsimd::neon64&) {
  return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(load4_bytes_neon(p)))));
}
inline int32x4_t widen_i8(const int8_t* p, const xsimd::neon64&) {
  return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(load4_bytes_neon(p)))));
}
#endif
#if XSIMD_WITH_SSE4_2
inline __m128i load4_bytes(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm_cvtsi32_si128(v);
}
inline __m128i widen_u8(const uint8_t* p, const xsimd::sse4_2&) { return _mm_cvtepu8_epi32(load4_bytes(p)); }
inline __m128i widen_i8(const int8_t* p, const xsimd::sse4_2&) { return _mm_cvtepi8_epi32(load4_bytes(p)); }
#endif

template <class A>
inline ibatch<A> load_u8(const uint8_t* p) {
  return ibatch<A>(widen_u8(p, A{}));
}
template <class A>
inline ibatch<A> load_i8(const int8_t* p) {
  return ibatch<A>(widen_i8(p, A{}));
}

// ---- Quantized weights, fast path: integer dot products over groups of 32 8-bit codes. ----
//
// A group is one 32-block (Q8_0 / Q4_0 / ...) or one 32-element sub-block of a K-quant, in ggml's
// element order. `Bytes32<A>` holds it; `dot_us` / `dot_ss` / `dot_us_scaled` multiply two groups
// lane-wise and add each run of 4 products into one int32 lane of `ibatch<IntArch<A>>`, whose lane sum
// is the dot product. The AVX-512 build works on 256-bit halves as llama.cpp does (a 32-group fills
// one), with VNNI's vpdpbusd where compiled in; AVX2 and SSE4.2 (x86-64-v2) use pmaddubsw.
//
// pmaddubsw adds two u8 x s8 products into a saturating int16: the codes stay below the bound that
// makes saturation impossible (u <= 128 and |s| <= 127: 2 * 128 * 127 < 32767).

#if XSIMD_WITH_AVX2
struct Bytes256 {
  __m256i v;
  static __m256i m8(int8_t b) { return _mm256_set1_epi8(b); }
  static Bytes256 load(const void* p) { return {_mm256_loadu_si256(static_cast<const __m256i*>(p))}; }
  // 16 packed bytes -> low nibbles (elements 0..15), then high nibbles (16..31): the 32-block order.
  static Bytes256 nibbles(const uint8_t* q16) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q16));
    return {_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), m8(0x0f))};
  }
  static Bytes256 low_nibbles(const uint8_t* q32) { return {_mm256_and_si256(load(q32).v, m8(0x0f))}; }
  static Bytes256 high_nibbles(const uint8_t* q32) {
    return {_mm256_and_si256(_mm256_srli_epi16(load(q32).v, 4), m8(0x0f))};
  }
  // byte e = 16 where bit e of `bits` is set (the 5th bit of Q5_0 / Q5_1).
  static Bytes256 bit4_of_mask(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(bits)),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i sel = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
    return {_mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), m8(0x10))};
  }
  // byte e = 16 where bit b of q32[e] is set (the 5th bit of Q5_K).
  static Bytes256 bit4_of_bytes(const uint8_t* q32, int b) {
    const __m256i sel = m8(int8_t(1u << b));
    return {_mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(load(q32).v, sel), sel), m8(0x10))};
  }
  // byte e = ((q32[e] >> s) & 3) << 4 (the two high bits of Q6_K). 16-bit shifts are safe: the mask
  // keeps only bits of the byte itself.
  static Bytes256 bits45_of_bytes(const uint8_t* q32, int s) {
    const __m256i x = _mm256_and_si256(_mm256_srli_epi16(load(q32).v, s), m8(3));
    return {_mm256_slli_epi16(x, 4)};
  }
  friend Bytes256 operator|(Bytes256 a, Bytes256 b) { return {_mm256_or_si256(a.v, b.v)}; }
  Bytes256 minus(int8_t k) const { return {_mm256_sub_epi8(v, m8(k))}; }
};

// 16 int16 lanes: the K-quants' scales and mins, Q8_K's bsums.
struct Shorts256 {
  __m256i v;
  static Shorts256 load(const int16_t* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
  // lanes 2j and 2j + 1 = m8[j]: one value per 32-group, for both of its 16-halves.
  static Shorts256 pairs_u8(const uint8_t* m8) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m8)));
    return {_mm256_set_m128i(_mm_unpackhi_epi16(x, x), _mm_unpacklo_epi16(x, x))};
  }
  // lane g = s16[g], sign-extended.
  static Shorts256 widen_i8(const int8_t* s16) {
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s16)))};
  }
  // The multiplier of 32-group g in dot_us_scaled: lanes 0..7 = lane 2g, lanes 8..15 = lane 2g + 1.
  Shorts256 group(int g) const {
    const __m256i pair = _mm256_permutevar8x32_epi32(v, _mm256_set1_epi32(g));
    return {_mm256_shuffle_epi8(pair, _mm256_set_epi64x(0x0302030203020302, 0x0302030203020302,
                                                        0x0100010001000100, 0x0100010001000100))};
  }
};

// Shorts256 rearranged for group(): its even lanes in the low 128 bits, its odd lanes in the high ones,
// so each group is one in-lane shuffle (group() itself crosses lanes first: two shuffles). For a block's
// 8 groups: 2 + 8 shuffles instead of 16.
struct Shorts256Groups {
  __m256i v;
  explicit Shorts256Groups(Shorts256 s)
      : v(_mm256_permute4x64_epi64(
            _mm256_shuffle_epi8(s.v, _mm256_set_epi64x(0x0f0e0b0a07060302, 0x0d0c090805040100, 0x0f0e0b0a07060302,
                                                       0x0d0c090805040100)),
            0xd8)) {}
  // groups_of(pairs_u8(8 bytes)) from the bytes in a register's low half: their int16 in both halves.
  static Shorts256Groups of_u8(__m128i m8) {
    return Shorts256Groups(_mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(m8)));
  }
  Shorts256 group(int g) const { return {_mm256_shuffle_epi8(v, _mm256_set1_epi16(int16_t(0x0100 + 0x0202 * g)))}; }

 private:
  explicit Shorts256Groups(__m256i rearranged) : v(rearranged) {}
};
inline Shorts256Groups groups_of(const Shorts256& s) { return Shorts256Groups(s); }

inline __m256i dot_us(__m256i acc, Bytes256 u, Bytes256 s, const xsimd::avx2&) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u.v, s.v), _mm256_set1_epi16(1)));
}
// Products of the group's elements 0..15 times sc's lanes 0..7, 16..31 times lanes 8..15 (see group()).
inline __m256i dot_us_scaled(__m256i acc, Bytes256 u, Bytes256 s, Shorts256 sc, const xsimd::avx2&) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u.v, s.v), sc.v));
}
// Pairwise a * b of 16 int16 lanes, into the int32 lanes.
inline __m256i madd(Shorts256 a, Shorts256 b, const xsimd::avx2&) { return _mm256_madd_epi16(a.v, b.v); }
// Signed x signed through |w| * (s with w's sign).
inline __m256i dot_ss(__m256i acc, Bytes256 w, Bytes256 s, const xsimd::avx2& a) {
  return dot_us(acc, {_mm256_abs_epi8(w.v)}, {_mm256_sign_epi8(s.v, w.v)}, a);
}
Bytes256 bytes32_of(const xsimd::avx2&);
Shorts256 shorts16_of(const xsimd::avx2&);
xsimd::fma3<xsimd::avx2> int_arch_of(const xsimd::avx2&);
#endif

#if XSIMD_WITH_AVX512BW
inline __m256i dot_us(__m256i acc, Bytes256 u, Bytes256 s, const xsimd::avx512f&) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u.v, s.v);
#else
  return dot_us(acc, u, s, xsimd::avx2{});
#endif
}
inline __m256i dot_us_scaled(__m256i acc, Bytes256 u, Bytes256 s, Shorts256 sc, const xsimd::avx512f&) {
  return dot_us_scaled(acc, u, s, sc, xsimd::avx2{});
}
inline __m256i madd(Shorts256 a, Shorts256 b, const xsimd::avx512f&) { return _mm256_madd_epi16(a.v, b.v); }
inline __m256i dot_ss(__m256i acc, Bytes256 w, Bytes256 s, const xsimd::avx512f& a) {
  return dot_us(acc, {_mm256_abs_epi8(w.v)}, {_mm256_sign_epi8(s.v, w.v)}, a);
}
Bytes256 bytes32_of(const xsimd::avx512f&);
Shorts256 shorts16_of(const xsimd::avx512f&);
xsimd::fma3<xsimd::avx2> int_arch_of(const xsimd::avx512f&);
#endif

#if XSIMD_WITH_SSE4_2
// x86-64-v2: the group in two 128-bit halves (elements 0..15 in lo, 16..31 in hi). SSSE3 is part of it.
struct Bytes128x2 {
  __m128i lo, hi;
  static __m128i m8(int8_t b) { return _mm_set1_epi8(b); }
  static __m128i ld(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  static Bytes128x2 load(const void* p) { return {ld(p), ld(static_cast<const uint8_t*>(p) + 16)}; }
  static Bytes128x2 nibbles(const uint8_t* q16) {
    const __m128i x = ld(q16);
    return {_mm_and_si128(x, m8(0x0f)), _mm_and_si128(_mm_srli_epi16(x, 4), m8(0x0f))};
  }
  static Bytes128x2 low_nibbles(const uint8_t* q32) {
    return {_mm_and_si128(ld(q32), m8(0x0f)), _mm_and_si128(ld(q32 + 16), m8(0x0f))};
  }
  static Bytes128x2 high_nibbles(const uint8_t* q32) {
    return {_mm_and_si128(_mm_srli_epi16(ld(q32), 4), m8(0x0f)),
            _mm_and_si128(_mm_srli_epi16(ld(q32 + 16), 4), m8(0x0f))};
  }
  static Bytes128x2 bit4_of_mask(uint32_t bits) {
    const __m128i all = _mm_set1_epi32(int32_t(bits));
    const __m128i sel = _mm_set1_epi64x(int64_t(0x8040201008040201ull));
    auto half = [&](int64_t idx_hi, int64_t idx_lo) {
      const __m128i spread = _mm_shuffle_epi8(all, _mm_set_epi64x(idx_hi, idx_lo));
      return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, sel), sel), m8(0x10));
    };
    return {half(0x0101010101010101, 0x0000000000000000), half(0x0303030303030303, 0x0202020202020202)};
  }
  static Bytes128x2 bit4_of_bytes(const uint8_t* q32, int b) {
    const __m128i sel = m8(int8_t(1u << b));
    auto half = [&](const uint8_t* p) {
      return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(ld(p), sel), sel), m8(0x10));
    };
    return {half(q32), half(q32 + 16)};
  }
  static Bytes128x2 bits45_of_bytes(const uint8_t* q32, int s) {
    auto half = [&](const uint8_t* p) {
      return _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(ld(p), s), m8(3)), 4);
    };
    return {half(q32), half(q32 + 16)};
  }
  friend Bytes128x2 operator|(Bytes128x2 a, Bytes128x2 b) {
    return {_mm_or_si128(a.lo, b.lo), _mm_or_si128(a.hi, b.hi)};
  }
  Bytes128x2 minus(int8_t k) const { return {_mm_sub_epi8(lo, m8(k)), _mm_sub_epi8(hi, m8(k))}; }
};

struct Shorts128x2 {
  __m128i lo, hi;  // lanes 0..7, 8..15
  static Shorts128x2 load(const int16_t* p) { return {Bytes128x2::ld(p), Bytes128x2::ld(p + 8)}; }
  static Shorts128x2 pairs_u8(const uint8_t* m8) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m8)));
    return {_mm_unpacklo_epi16(x, x), _mm_unpackhi_epi16(x, x)};
  }
  static Shorts128x2 widen_i8(const int8_t* s16) {
    const __m128i x = Bytes128x2::ld(s16);
    return {_mm_cvtepi8_epi16(x), _mm_cvtepi8_epi16(_mm_srli_si128(x, 8))};
  }
  Shorts128x2 group(int g) const {
    const __m128i half = g < 4 ? lo : hi;
    const int16_t k = int16_t(0x0404 * (g % 4));
    return {_mm_shuffle_epi8(half, _mm_set1_epi16(int16_t(0x0100 + k))),
            _mm_shuffle_epi8(half, _mm_set1_epi16(int16_t(0x0302 + k)))};
  }
};

inline __m128i dot_us_scaled(__m128i acc, Bytes128x2 u, Bytes128x2 s, Shorts128x2 sc, const xsimd::sse4_2&) {
  const __m128i lo = _mm_madd_epi16(_mm_maddubs_epi16(u.lo, s.lo), sc.lo);
  const __m128i hi = _mm_madd_epi16(_mm_maddubs_epi16(u.hi, s.hi), sc.hi);
  return _mm_add_epi32(acc, _mm_add_epi32(lo, hi));
}
inline __m128i dot_us(__m128i acc, Bytes128x2 u, Bytes128x2 s, const xsimd::sse4_2& a) {
  // Each half widened by its own pmaddwd (scale 1): adding int16 pairs first could saturate.
  const __m128i one = _mm_set1_epi16(1);
  return dot_us_scaled(acc, u, s, {one, one}, a);
}
inline __m128i madd(Shorts128x2 a, Shorts128x2 b, const xsimd::sse4_2&) {
  return _mm_add_epi32(_mm_madd_epi16(a.lo, b.lo), _mm_madd_epi16(a.hi, b.hi));
}
inline __m128i dot_ss(__m128i acc, Bytes128x2 w, Bytes128x2 s, const xsimd::sse4_2& a) {
  return dot_us(acc, {_mm_abs_epi8(w.lo), _mm_abs_epi8(w.hi)}, {_mm_sign_epi8(s.lo, w.lo), _mm_sign_epi8(s.hi, w.hi)},
                a);
}
Bytes128x2 bytes32_of(const xsimd::sse4_2&);
Shorts128x2 shorts16_of(const xsimd::sse4_2&);
xsimd::sse4_2 int_arch_of(const xsimd::sse4_2&);
#endif

#if XSIMD_WITH_NEON64
// AArch64: the group in two 128-bit halves (elements 0..15 in lo, 16..31 in hi), as on SSE4.2. Every code
// fits a signed byte (unsigned codes are at most 63, signed ones -128..127, activations -127..127), so
// one signed x signed dot serves dot_us and dot_ss. Lane i of a 16-byte dot is the sum of the products
// of bytes 4i .. 4i + 3 (sdot's lanes); the plain-NEON form builds the same lanes from exact int16
// products, so both builds give the same int32 lanes and so the same float results.
struct NeonBytes32 {
  uint8x16_t lo, hi;
  static uint8x16_t m8(uint8_t b) { return vdupq_n_u8(b); }
  static uint8x16_t ld(const void* p) { return vld1q_u8(static_cast<const uint8_t*>(p)); }
  static NeonBytes32 load(const void* p) { return {ld(p), ld(static_cast<const uint8_t*>(p) + 16)}; }
  static NeonBytes32 nibbles(const uint8_t* q16) {
    const uint8x16_t x = ld(q16);
    return {vandq_u8(x, m8(0x0f)), vshrq_n_u8(x, 4)};
  }
  static NeonBytes32 low_nibbles(const uint8_t* q32) {
    return {vandq_u8(ld(q32), m8(0x0f)), vandq_u8(ld(q32 + 16), m8(0x0f))};
  }
  static NeonBytes32 high_nibbles(const uint8_t* q32) { return {vshrq_n_u8(ld(q32), 4), vshrq_n_u8(ld(q32 + 16), 4)}; }
  // byte e = 16 where bit e of `bits` is set.
  static NeonBytes32 bit4_of_mask(uint32_t bits) {
    static constexpr uint8_t kSel[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t sel = vld1q_u8(kSel);
    auto half = [&](uint32_t b16) {  // bits of elements 16h .. 16h + 15
      const uint8x16_t spread = vcombine_u8(vdup_n_u8(uint8_t(b16)), vdup_n_u8(uint8_t(b16 >> 8)));
      return vandq_u8(vtstq_u8(spread, sel), m8(0x10));
    };
    return {half(bits & 0xffff), half(bits >> 16)};
  }
  // byte e = 16 where bit b of q32[e] is set.
  static NeonBytes32 bit4_of_bytes(const uint8_t* q32, int b) {
    const uint8x16_t sel = m8(uint8_t(1u << b));
    return {vandq_u8(vtstq_u8(ld(q32), sel), m8(0x10)), vandq_u8(vtstq_u8(ld(q32 + 16), sel), m8(0x10))};
  }
  // byte e = ((q32[e] >> s) & 3) << 4.
  static NeonBytes32 bits45_of_bytes(const uint8_t* q32, int s) {
    const int8x16_t right = vdupq_n_s8(int8_t(-s));
    auto half = [&](const uint8_t* p) { return vshlq_n_u8(vandq_u8(vshlq_u8(ld(p), right), m8(3)), 4); };
    return {half(q32), half(q32 + 16)};
  }
  friend NeonBytes32 operator|(NeonBytes32 a, NeonBytes32 b) { return {vorrq_u8(a.lo, b.lo), vorrq_u8(a.hi, b.hi)}; }
  NeonBytes32 minus(int8_t k) const { return {vsubq_u8(lo, m8(uint8_t(k))), vsubq_u8(hi, m8(uint8_t(k)))}; }
};

struct NeonShorts16 {
  int16x8_t lo, hi;  // lanes 0..7, 8..15
  static NeonShorts16 load(const int16_t* p) { return {vld1q_s16(p), vld1q_s16(p + 8)}; }
  static NeonShorts16 pairs_u8(const uint8_t* m8) {
    const int16x8_t x = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(m8)));
    return {vzip1q_s16(x, x), vzip2q_s16(x, x)};
  }
  static NeonShorts16 widen_i8(const int8_t* s16) {
    const int8x16_t x = vld1q_s8(s16);
    return {vmovl_s8(vget_low_s8(x)), vmovl_high_s8(x)};
  }
  // The multipliers of 32-group g in dot_us_scaled: every lane of lo = lane 2g (elements 0..15), of hi =
  // lane 2g + 1 (elements 16..31).
  NeonShorts16 group(int g) const {
    alignas(16) int16_t t[16];
    vst1q_s16(t, lo);
    vst1q_s16(t + 8, hi);
    return {vdupq_n_s16(t[2 * g]), vdupq_n_s16(t[2 * g + 1])};
  }
};

// The four lanes of sdot over 16 byte products (see NeonBytes32), without adding an accumulator.
inline int32x4_t dot16(uint8x16_t a, uint8x16_t b) {
  const int8x16_t x = vreinterpretq_s8_u8(a), y = vreinterpretq_s8_u8(b);
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(vdupq_n_s32(0), x, y);
#else
  // Products are exact in int16 (|x * y| <= 128 * 128); pairs, then pairs of pairs, in int32.
  const int32x4_t p0 = vpaddlq_s16(vmull_s8(vget_low_s8(x), vget_low_s8(y)));  // bytes 0-1, 2-3, 4-5, 6-7
  const int32x4_t p1 = vpaddlq_s16(vmull_high_s8(x, y));                        // bytes 8-9, ..., 14-15
  return vpaddq_s32(p0, p1);                                                     // bytes 0-3, ..., 12-15
#endif
}

inline int32x4_t dot_ss(int32x4_t acc, NeonBytes32 w, NeonBytes32 s, const xsimd::neon64&) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(vdotq_s32(acc, vreinterpretq_s8_u8(w.lo), vreinterpretq_s8_u8(s.lo)), vreinterpretq_s8_u8(w.hi),
                   vreinterpretq_s8_u8(s.hi));
#else
  return vaddq_s32(acc, vaddq_s32(dot16(w.lo, s.lo), dot16(w.hi, s.hi)));
#endif
}
inline int32x4_t dot_us(int32x4_t acc, NeonBytes32 u, NeonBytes32 s, const xsimd::neon64& a) {
  return dot_ss(acc, u, s, a);
}
inline int32x4_t dot_us_scaled(int32x4_t acc, NeonBytes32 u, NeonBytes32 s, NeonShorts16 sc, const xsimd::neon64&) {
  acc = vmlaq_s32(acc, dot16(u.lo, s.lo), vmovl_s16(vget_low_s16(sc.lo)));
  return vmlaq_s32(acc, dot16(u.hi, s.hi), vmovl_s16(vget_low_s16(sc.hi)));
}
inline int32x4_t madd(NeonShorts16 a, NeonShorts16 b, const xsimd::neon64&) {
  int32x4_t r = vmull_s16(vget_low_s16(a.lo), vget_low_s16(b.lo));
  r = vmlal_high_s16(r, a.lo, b.lo);
  r = vmlal_s16(r, vget_low_s16(a.hi), vget_low_s16(b.hi));
  return vmlal_high_s16(r, a.hi, b.hi);
}
NeonBytes32 bytes32_of(const xsimd::neon64&);
NeonShorts16 shorts16_of(const xsimd::neon64&);
xsimd::neon64 int_arch_of(const xsimd::neon64&);
#endif

// The groups of a Shorts16 (see Shorts256Groups): where group() needs no rearranging, the value itself.
template <class S>
inline const S& groups_of(const S& s) {
  return s;
}

// The 32-code group type of arch A, its 16 x int16 type, and the arch of its int32 / float partial sums.
template <class A>
using Bytes32 = decltype(bytes32_of(A{}));
template <class A>
using Shorts16 = decltype(shorts16_of(A{}));
template <class A>
using IntArch = decltype(int_arch_of(A{}));

template <class A>
inline ibatch<IntArch<A>> dot_us(const ibatch<IntArch<A>>& acc, const Bytes32<A>& u, const Bytes32<A>& s) {
  return dot_us(acc, u, s, A{});
}
template <class A>
inline ibatch<IntArch<A>> dot_ss(const ibatch<IntArch<A>>& acc, const Bytes32<A>& w, const Bytes32<A>& s) {
  return dot_ss(acc, w, s, A{});
}
template <class A>
inline ibatch<IntArch<A>> dot_us_scaled(const ibatch<IntArch<A>>& acc, const Bytes32<A>& u, const Bytes32<A>& s,
                                        const Shorts16<A>& sc) {
  return dot_us_scaled(acc, u, s, sc, A{});
}
template <class A>
inline ibatch<IntArch<A>> madd(const Shorts16<A>& a, const Shorts16<A>& b) {
  return madd(a, b, A{});
}

}  // namespace pp::simd
