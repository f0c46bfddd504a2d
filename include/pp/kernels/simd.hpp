// The only file with ISA intrinsics: the compiled-in xsimd architectures and weight widening to f32.
//
// Kernels are templates over an xsimd architecture A. `Archs` lists every architecture this build can
// run (the best first); tests run each kernel on all of them against a scalar oracle.
#pragma once

#include <pp/core/float16.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <xsimd/xsimd.hpp>

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

using Archs = ArchList<
#if XSIMD_WITH_AVX512BW
    Avx512,
#endif
#if XSIMD_WITH_FMA3_AVX2
    Avx2,
#endif
    Sse42>;

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

template <class A>
using fbatch = xsimd::batch<float, A>;

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

// Scalar widening for loop tails.
inline float load1(F32w, const float* p) { return *p; }
inline float load1(Bf16w, const uint16_t* p) { return bf16_to_f32(*p); }
inline float load1(F16w, const uint16_t* p) { return f16_to_f32(*p); }

// Accumulators per token in the dot kernels: enough independent FMA chains to hide latency,
// few enough that a 4-token tile stays in registers.
template <class A>
inline constexpr int kAccumulators = fbatch<A>::size >= 16 ? 4 : 2;

}  // namespace pp::simd
