// Elementwise and normalisation kernels: RMSNorm, SwiGLU, softmax, RoPE, dot and axpy on f32 rows.
#pragma once

#include <pp/kernels/simd.hpp>

#include <cmath>
#include <cstddef>

namespace pp::kernels {

// dot(a[0, n), b[0, n)) in f32.
template <class A = simd::Best>
inline float dot_f32(const float* a, const float* b, std::size_t n) {
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size;
  B acc0(0.f), acc1(0.f);
  std::size_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    acc0 = simd::fma(B::load_unaligned(a + i), B::load_unaligned(b + i), acc0);
    acc1 = simd::fma(B::load_unaligned(a + i + W), B::load_unaligned(b + i + W), acc1);
  }
  for (; i + W <= n; i += W) acc0 = simd::fma(B::load_unaligned(a + i), B::load_unaligned(b + i), acc0);
  float r = xsimd::hadd(acc0 + acc1);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// y[0, n) += a * x[0, n)
template <class A = simd::Best>
inline void axpy(float a, const float* x, float* y, std::size_t n) {
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size;
  const B va(a);
  std::size_t i = 0;
  for (; i + W <= n; i += W) simd::fma(va, B::load_unaligned(x + i), B::load_unaligned(y + i)).store_unaligned(y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

// y[0, n) += x[0, n)
template <class A = simd::Best>
inline void add_inplace(float* y, const float* x, std::size_t n) {
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size;
  std::size_t i = 0;
  for (; i + W <= n; i += W) (B::load_unaligned(y + i) + B::load_unaligned(x + i)).store_unaligned(y + i);
  for (; i < n; ++i) y[i] += x[i];
}

// out = x / sqrt(mean(x^2) + eps) * w, over one row of n.
template <class A = simd::Best>
inline void rmsnorm(const float* x, const float* w, float eps, std::size_t n, float* out) {
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size;
  const float ss = dot_f32<A>(x, x, n);
  // 1/sqrt rather than xsimd::rsqrt, which is an approximation.
  const float scale = 1.0f / std::sqrt(ss / float(n) + eps);
  const B vs(scale);
  std::size_t i = 0;
  for (; i + W <= n; i += W)
    (B::load_unaligned(x + i) * vs * B::load_unaligned(w + i)).store_unaligned(out + i);
  for (; i < n; ++i) out[i] = x[i] * scale * w[i];
}

// gate[0, n) = silu(gate) * up
template <class A = simd::Best>
inline void swiglu(float* gate, const float* up, std::size_t n) {
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size;
  const B one(1.f);
  std::size_t i = 0;
  for (; i + W <= n; i += W) {
    const B g = B::load_unaligned(gate + i);
    (g / (one + xsimd::exp(-g)) * B::load_unaligned(up + i)).store_unaligned(gate + i);
  }
  for (; i < n; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// In place: x[0, n) = softmax(x). Returns nothing; n >= 1.
template <class A = simd::Best>
inline void softmax(float* x, std::size_t n) {
  float mx = x[0];
  for (std::size_t i = 1; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size;
  const B vmx(mx);
  B vsum(0.f);
  std::size_t i = 0;
  for (; i + W <= n; i += W) {
    const B e = xsimd::exp(B::load_unaligned(x + i) - vmx);
    e.store_unaligned(x + i);
    vsum += e;
  }
  float sum = xsimd::hadd(vsum);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = 1.f / sum;
  for (std::size_t j = 0; j < n; ++j) x[j] *= inv;
}

// RoPE on adjacent pairs (x[2i], x[2i+1]) of each of n_heads heads of head_dim, given this position's
// cos/sin per pair ([head_dim / 2] each). This is the layout GGUF Llama files are permuted for.
inline void rope(float* x, std::size_t n_heads, std::size_t head_dim, const float* cos, const float* sin) {
  for (std::size_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    for (std::size_t i = 0; i < head_dim / 2; ++i) {
      const float x0 = v[2 * i], x1 = v[2 * i + 1];
      v[2 * i] = x0 * cos[i] - x1 * sin[i];
      v[2 * i + 1] = x0 * sin[i] + x1 * cos[i];
    }
  }
}

}  // namespace pp::kernels
