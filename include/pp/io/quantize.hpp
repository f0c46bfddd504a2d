// Scalar quantization of weights into ggml's block formats (kernels/quant_blocks.hpp): the synthetic
// models' GGUF files (tools/common/synth.hpp) and tests.
#pragma once

#include <pp/core/dtype.hpp>
#include <pp/core/float16.hpp>
#include <pp/kernels/quant_blocks.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace pp::quant {


// ---- Scalar quantization (synthetic models, tests): round-to-nearest in the spirit of ggml's
// quantize_row_*_ref; the K-quants use a plain min/max scale search. Formats are exact. ----

inline int clampi(int v, int lo, int hi) { return std::min(hi, std::max(lo, v)); }

inline void quantize(const float* x, BlockQ8_0& b) {
  const float d = abs_max(x, 32) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  b.d = f32_to_f16(d);
  for (int j = 0; j < 32; ++j) b.qs[j] = int8_t(std::round(x[j] * id));
}
inline void quantize(const float* x, BlockQ4_0& b) {
  float mx;
  abs_max(x, 32, &mx);
  const float d = mx / -8.f, id = d != 0.f ? 1.f / d : 0.f;  // the largest magnitude maps to code 0
  b.d = f32_to_f16(d);
  for (int j = 0; j < 16; ++j) {
    const int q0 = clampi(int(x[j] * id + 8.5f), 0, 15), q1 = clampi(int(x[j + 16] * id + 8.5f), 0, 15);
    b.qs[j] = uint8_t(q0 | (q1 << 4));
  }
}
inline void min_max(const float* x, int n, float& lo, float& hi) {
  lo = x[0], hi = x[0];
  for (int j = 1; j < n; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
}
inline void quantize(const float* x, BlockQ4_1& b) {
  float lo, hi;
  min_max(x, 32, lo, hi);
  const float d = (hi - lo) / 15.f, id = d != 0.f ? 1.f / d : 0.f;
  b.d = f32_to_f16(d), b.m = f32_to_f16(lo);
  for (int j = 0; j < 16; ++j) {
    const int q0 = clampi(int((x[j] - lo) * id + 0.5f), 0, 15), q1 = clampi(int((x[j + 16] - lo) * id + 0.5f), 0, 15);
    b.qs[j] = uint8_t(q0 | (q1 << 4));
  }
}
inline void quantize(const float* x, BlockQ5_0& b) {
  float mx;
  abs_max(x, 32, &mx);
  const float d = mx / -16.f, id = d != 0.f ? 1.f / d : 0.f;
  b.d = f32_to_f16(d);
  uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    const int q0 = clampi(int(x[j] * id + 16.5f), 0, 31), q1 = clampi(int(x[j + 16] * id + 16.5f), 0, 31);
    b.qs[j] = uint8_t((q0 & 15) | ((q1 & 15) << 4));
    qh |= uint32_t(q0 >> 4) << j | uint32_t(q1 >> 4) << (j + 16);
  }
  std::memcpy(b.qh, &qh, 4);
}
inline void quantize(const float* x, BlockQ5_1& b) {
  float lo, hi;
  min_max(x, 32, lo, hi);
  const float d = (hi - lo) / 31.f, id = d != 0.f ? 1.f / d : 0.f;
  b.d = f32_to_f16(d), b.m = f32_to_f16(lo);
  uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    const int q0 = clampi(int((x[j] - lo) * id + 0.5f), 0, 31), q1 = clampi(int((x[j + 16] - lo) * id + 0.5f), 0, 31);
    b.qs[j] = uint8_t((q0 & 15) | ((q1 & 15) << 4));
    qh |= uint32_t(q0 >> 4) << j | uint32_t(q1 >> 4) << (j + 16);
  }
  std::memcpy(b.qh, &qh, 4);
}

// Q4_K / Q5_K codes L[256] in [0, qmax], with d, dmin and the packed 6-bit scales and mins.
inline void quantize_k_asym(const float* x, int qmax, uint16_t& d, uint16_t& dmin, uint8_t* scales, uint8_t* L) {
  float scale[8], minv[8], max_scale = 0.f, max_min = 0.f;
  for (int j = 0; j < 8; ++j) {
    float lo, hi;
    min_max(x + 32 * j, 32, lo, hi);
    lo = std::min(lo, 0.f);  // x = scale * q - min with min >= 0, as ggml
    scale[j] = (hi - lo) / float(qmax), minv[j] = -lo;
    max_scale = std::max(max_scale, scale[j]), max_min = std::max(max_min, minv[j]);
  }
  d = f32_to_f16(max_scale / 63.f), dmin = f32_to_f16(max_min / 63.f);
  const float dh = f16_to_f32(d), dmh = f16_to_f32(dmin);
  uint8_t sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = uint8_t(dh > 0.f ? clampi(int(std::nearbyint(scale[j] / dh)), 0, 63) : 0);
    mn[j] = uint8_t(dmh > 0.f ? clampi(int(std::ceil(minv[j] / dmh)), 0, 63) : 0);  // up: codes stay >= 0
    const float ds = dh * float(sc[j]), dm = dmh * float(mn[j]);
    for (int l = 0; l < 32; ++l)
      L[32 * j + l] = uint8_t(ds > 0.f ? clampi(int(std::nearbyint((x[32 * j + l] + dm) / ds)), 0, qmax) : 0);
  }
  pack_scale_min_k4(sc, mn, scales);
}
inline void quantize(const float* x, BlockQ4_K& b) {
  uint8_t L[256];
  quantize_k_asym(x, 15, b.d, b.dmin, b.scales, L);
  for (int p = 0; p < 4; ++p)
    for (int l = 0; l < 32; ++l) b.qs[32 * p + l] = uint8_t(L[64 * p + l] | (L[64 * p + 32 + l] << 4));
}
inline void quantize(const float* x, BlockQ5_K& b) {
  uint8_t L[256];
  quantize_k_asym(x, 31, b.d, b.dmin, b.scales, L);
  std::memset(b.qh, 0, sizeof b.qh);
  for (int p = 0; p < 4; ++p)
    for (int l = 0; l < 32; ++l) {
      const uint8_t lo = L[64 * p + l], hi = L[64 * p + 32 + l];
      b.qs[32 * p + l] = uint8_t((lo & 15) | ((hi & 15) << 4));
      b.qh[l] |= uint8_t(((lo >> 4) << (2 * p)) | ((hi >> 4) << (2 * p + 1)));
    }
}
inline void quantize(const float* x, BlockQ6_K& b) {
  float scale[16], max_scale = 0.f;
  for (int g = 0; g < 16; ++g) {
    scale[g] = abs_max(x + 16 * g, 16) / 31.f;  // codes -31..31 of the -32..31 range
    max_scale = std::max(max_scale, scale[g]);
  }
  b.d = f32_to_f16(max_scale / 127.f);
  const float dh = f16_to_f32(b.d);
  uint8_t L[256];
  for (int g = 0; g < 16; ++g) {
    b.scales[g] = int8_t(dh > 0.f ? clampi(int(std::nearbyint(scale[g] / dh)), -128, 127) : 0);
    const float ds = dh * float(b.scales[g]);
    for (int l = 0; l < 16; ++l)
      L[16 * g + l] = uint8_t(32 + (ds > 0.f ? clampi(int(std::nearbyint(x[16 * g + l] / ds)), -32, 31) : 0));
  }
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t* q = L + 128 * h + l;  // q[0], q[32], q[64], q[96]: the four 32-element groups
      b.ql[64 * h + l] = uint8_t((q[0] & 15) | ((q[64] & 15) << 4));
      b.ql[64 * h + 32 + l] = uint8_t((q[32] & 15) | ((q[96] & 15) << 4));
      b.qh[32 * h + l] = uint8_t((q[0] >> 4) | ((q[32] >> 4) << 2) | ((q[64] >> 4) << 4) | ((q[96] >> 4) << 6));
    }
}

// out = one row of n elements (a multiple of the block size) quantized to t; row_bytes(t, n) bytes.
inline void quantize_row(DType t, const float* x, std::size_t n, uint8_t* out) {
  visit(t, [&](auto f) {
    using Block = typename decltype(f)::Block;
    Block* b = reinterpret_cast<Block*>(out);
    for (std::size_t i = 0; i < n / Block::kElems; ++i) quantize(x + i * Block::kElems, b[i]);
  });
}

}  // namespace pp::quant
