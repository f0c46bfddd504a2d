// ggml's block-quantized weights: block layouts, scalar (de)quantization, and dot kernels for both numeric paths.
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
#include <pp/kernels/simd.hpp>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pp::quant {

// ---- Block layouts, byte for byte as ggml stores them (f16 scales as raw uint16_t). ----

struct BlockQ8_0 {  // x = d * q
  static constexpr std::size_t kElems = 32;
  uint16_t d;
  int8_t qs[32];
};
struct BlockQ4_0 {  // x = d * (q - 8); element j < 16 in qs[j]'s low nibble, j + 16 in its high nibble
  static constexpr std::size_t kElems = 32;
  uint16_t d;
  uint8_t qs[16];
};
struct BlockQ4_1 {  // x = d * q + m
  static constexpr std::size_t kElems = 32;
  uint16_t d, m;
  uint8_t qs[16];
};
struct BlockQ5_0 {  // x = d * (q - 16); bit e of qh (little-endian u32) is element e's 5th bit
  static constexpr std::size_t kElems = 32;
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
struct BlockQ5_1 {  // x = d * q + m
  static constexpr std::size_t kElems = 32;
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[16];
};
// K-quants: a 256-element super-block of 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes
// (see scale_min_k4): x = d * sc_j * q - dmin * m_j. Sub-blocks 2p and 2p+1 are the low and high nibbles
// of qs[32p, 32p + 32).
struct BlockQ4_K {
  static constexpr std::size_t kElems = 256;
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
struct BlockQ5_K {  // as Q4_K, plus bit j of qh[l] = 5th bit of element l of sub-block j
  static constexpr std::size_t kElems = 256;
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
// x = d * sc[e / 16] * (q - 32), q 6 bits. Per 128-element half h: elements 32k + l (k < 4, l < 32) have
// low bits in ql[64h + 32(k & 1) + l] (low nibble for k < 2, high for k >= 2) and high bits
// (qh[32h + l] >> 2k) & 3.
struct BlockQ6_K {
  static constexpr std::size_t kElems = 256;
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
// Activations of the K-quant fast path: x = d * q, bsums[g] = sum of q over elements [16g, 16g + 16).
struct BlockQ8_K {
  static constexpr std::size_t kElems = 256;
  float d;
  int8_t qs[256];
  int16_t bsums[16];
};
// Activations of the 32-block fast path: ggml's Q8_1 (Q8_0 plus s = d * sum of q, which serves Q4_1 /
// Q5_1's min term) with its two f16 values held as f32, so the dot loop converts nothing. Memory only.
struct ActQ8 {
  static constexpr std::size_t kElems = 32;
  float d;  // an f16 value
  float s;  // an f16 value
  int8_t qs[32];
};

static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ8_K) == 292 && sizeof(ActQ8) == 40);

// The block type of a weight format and the activation block its fast path uses.
template <DType T>
struct Format;
template <> struct Format<DType::Q8_0> { using Block = BlockQ8_0; using Act = ActQ8; };
template <> struct Format<DType::Q4_0> { using Block = BlockQ4_0; using Act = ActQ8; };
template <> struct Format<DType::Q4_1> { using Block = BlockQ4_1; using Act = ActQ8; };
template <> struct Format<DType::Q5_0> { using Block = BlockQ5_0; using Act = ActQ8; };
template <> struct Format<DType::Q5_1> { using Block = BlockQ5_1; using Act = ActQ8; };
template <> struct Format<DType::Q4_K> { using Block = BlockQ4_K; using Act = BlockQ8_K; };
template <> struct Format<DType::Q5_K> { using Block = BlockQ5_K; using Act = BlockQ8_K; };
template <> struct Format<DType::Q6_K> { using Block = BlockQ6_K; using Act = BlockQ8_K; };

// f(Format<t>{}) for a quantized runtime type t.
template <class F>
inline decltype(auto) visit(DType t, F&& f) {
  switch (t) {
    case DType::Q8_0: return f(Format<DType::Q8_0>{});
    case DType::Q4_0: return f(Format<DType::Q4_0>{});
    case DType::Q4_1: return f(Format<DType::Q4_1>{});
    case DType::Q5_0: return f(Format<DType::Q5_0>{});
    case DType::Q5_1: return f(Format<DType::Q5_1>{});
    case DType::Q4_K: return f(Format<DType::Q4_K>{});
    case DType::Q5_K: return f(Format<DType::Q5_K>{});
    default: assert(t == DType::Q6_K); return f(Format<DType::Q6_K>{});
  }
}

inline float h2f(uint16_t h) { return simd::half_to_float(h); }

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block: sub-blocks 0..3 in the low 6 bits of
// bytes j and j + 4; sub-blocks 4..7 in the nibbles of byte j + 4 with their top 2 bits in the spare top
// bits of bytes j - 4 (scale) and j (min).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}
// All eight at once, four bytes per 32-bit word: sc[8] and m[8].
inline void scales_mins_k4(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  const uint32_t a = load_u32(q), b = load_u32(q + 4), c = load_u32(q + 8);
  const uint32_t w[4] = {a & 0x3f3f3f3fu, (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u),           // scales
                         b & 0x3f3f3f3fu, ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)};  // mins
  std::memcpy(sc, w, 8);
  std::memcpy(m, w + 2, 8);
}
// The inverse: 8 scales and 8 mins (each < 64) into 12 bytes.
inline void pack_scale_min_k4(const uint8_t* sc, const uint8_t* m, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = uint8_t((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = uint8_t((m[j] & 63) | ((m[j + 4] >> 4) << 6));
    q[j + 8] = uint8_t((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
  }
}

// ---- Scalar dequantization: the reference values (ggml's dequantize_row_* operation for operation). ----

inline void dequantize(const BlockQ8_0& b, float* y) {
  const float d = h2f(b.d);
  for (int j = 0; j < 32; ++j) y[j] = float(b.qs[j]) * d;
}
inline void dequantize(const BlockQ4_0& b, float* y) {
  const float d = h2f(b.d);
  for (int j = 0; j < 16; ++j) {
    y[j] = float((b.qs[j] & 15) - 8) * d;
    y[j + 16] = float((b.qs[j] >> 4) - 8) * d;
  }
}
inline void dequantize(const BlockQ4_1& b, float* y) {
  const float d = h2f(b.d), m = h2f(b.m);
  for (int j = 0; j < 16; ++j) {
    y[j] = float(b.qs[j] & 15) * d + m;
    y[j + 16] = float(b.qs[j] >> 4) * d + m;
  }
}
inline void dequantize(const BlockQ5_0& b, float* y) {
  const float d = h2f(b.d);
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < 16; ++j) {
    const int x0 = int((b.qs[j] & 15) | (((qh >> j) & 1) << 4)) - 16;
    const int x1 = int((b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
    y[j] = float(x0) * d;
    y[j + 16] = float(x1) * d;
  }
}
inline void dequantize(const BlockQ5_1& b, float* y) {
  const float d = h2f(b.d), m = h2f(b.m);
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < 16; ++j) {
    const uint32_t x0 = (b.qs[j] & 15) | (((qh >> j) & 1) << 4);
    const uint32_t x1 = (b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = float(x0) * d + m;
    y[j + 16] = float(x1) * d + m;
  }
}
inline void dequantize(const BlockQ4_K& b, float* y) {
  const float d = h2f(b.d), dmin = h2f(b.dmin);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, b.scales, sc, m);
    const float d1 = d * float(sc), m1 = dmin * float(m);
    const uint8_t* q = b.qs + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) y[32 * j + l] = d1 * float(j % 2 ? q[l] >> 4 : q[l] & 15) - m1;
  }
}
inline void dequantize(const BlockQ5_K& b, float* y) {
  const float d = h2f(b.d), dmin = h2f(b.dmin);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, b.scales, sc, m);
    const float d1 = d * float(sc), m1 = dmin * float(m);
    const uint8_t* q = b.qs + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) {
      const int lo = j % 2 ? q[l] >> 4 : q[l] & 15;
      y[32 * j + l] = d1 * float(lo + ((b.qh[l] >> j) & 1 ? 16 : 0)) - m1;
    }
  }
}
inline void dequantize(const BlockQ6_K& b, float* y) {
  const float d = h2f(b.d);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b.ql + 64 * h;
    const uint8_t* qh = b.qh + 32 * h;
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo = ql[32 * (k & 1) + l];
        const int q = ((k < 2 ? lo & 15 : lo >> 4) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
        const int e = 128 * h + 32 * k + l;
        y[e] = d * float(b.scales[e / 16]) * float(q);
      }
  }
}
inline void dequantize(const BlockQ8_K& b, float* y) {
  for (int j = 0; j < 256; ++j) y[j] = b.d * float(b.qs[j]);
}
inline void dequantize(const ActQ8& b, float* y) {
  for (int j = 0; j < 32; ++j) y[j] = b.d * float(b.qs[j]);
}

template <class Block>
inline void dequantize_blocks(const uint8_t* row, std::size_t n, float* y) {
  const Block* b = reinterpret_cast<const Block*>(row);
  for (std::size_t i = 0; i < n / Block::kElems; ++i) dequantize(b[i], y + i * Block::kElems);
}

// y[0, n) = one row of n elements of quantized type t (embedding lookup, tests).
inline void dequantize_row(DType t, const uint8_t* row, std::size_t n, float* y) {
  visit(t, [&](auto f) { dequantize_blocks<typename decltype(f)::Block>(row, n, y); });
}

// ---- Scalar quantization (synthetic models, tests): round-to-nearest in the spirit of ggml's
// quantize_row_*_ref; the K-quants use a plain min/max scale search. Formats are exact. ----

inline float abs_max(const float* x, int n, float* signed_max = nullptr) {
  float amax = 0.f, smax = 0.f;
  for (int j = 0; j < n; ++j)
    if (std::abs(x[j]) > amax) amax = std::abs(x[j]), smax = x[j];
  if (signed_max) *signed_max = smax;
  return amax;
}
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

// ---- Exact path: SIMD block dequantization (the scalar values above) and the f32 dot. ----

template <class A>
using fb = simd::fbatch<A>;
template <class A>
using ib = simd::ibatch<A>;

template <class A>
inline void dequantize_simd(const BlockQ8_0& b, float* y) {
  constexpr int W = int(fb<A>::size);
  const fb<A> d(h2f(b.d));
  for (int o = 0; o < 32; o += W) (xsimd::to_float(simd::load_i8<A>(b.qs + o)) * d).store_aligned(y + o);
}
template <class A>
inline void dequantize_simd(const BlockQ4_0& b, float* y) {
  constexpr int W = int(fb<A>::size);
  const fb<A> d(h2f(b.d));
  for (int o = 0; o < 16; o += W) {
    const ib<A> q = simd::load_u8<A>(b.qs + o);
    (xsimd::to_float((q & ib<A>(15)) - ib<A>(8)) * d).store_aligned(y + o);
    (xsimd::to_float((q >> 4) - ib<A>(8)) * d).store_aligned(y + 16 + o);
  }
}
template <class A>
inline void dequantize_simd(const BlockQ4_1& b, float* y) {
  constexpr int W = int(fb<A>::size);
  const fb<A> d(h2f(b.d)), m(h2f(b.m));
  for (int o = 0; o < 16; o += W) {
    const ib<A> q = simd::load_u8<A>(b.qs + o);
    (xsimd::to_float(q & ib<A>(15)) * d + m).store_aligned(y + o);
    (xsimd::to_float(q >> 4) * d + m).store_aligned(y + 16 + o);
  }
}
// 16 in the lanes whose bit of `bits` is set: min(bits & bit, 1) << 4 with bit <= 1 << 15, so no sign
// trouble. (xsimd 8.1's select on AVX-512 integer batches does not compile without optimization.)
template <class A>
inline ib<A> sixteen_if(const ib<A>& bits, const ib<A>& bit) {
  return xsimd::min(bits & bit, ib<A>(1)) << 4;
}
// 16 where bit e of qh is set, for the lanes e = o .. o + W - 1 (o and o + W on the same side of 16).
template <class A>
inline ib<A> fifth_bits(uint32_t qh, int o) {
  alignas(64) static constexpr int32_t kBit[32] = {1 << 0, 1 << 1, 1 << 2,  1 << 3,  1 << 4,  1 << 5,  1 << 6,  1 << 7,
                                                   1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15};
  return sixteen_if<A>(ib<A>(int32_t(o < 16 ? qh & 0xffff : qh >> 16)), ib<A>::load_aligned(kBit + o % 16));
}
template <class A>
inline void dequantize_simd(const BlockQ5_0& b, float* y) {
  constexpr int W = int(fb<A>::size);
  const fb<A> d(h2f(b.d));
  const uint32_t qh = load_u32(b.qh);
  for (int o = 0; o < 16; o += W) {
    const ib<A> q = simd::load_u8<A>(b.qs + o);
    (xsimd::to_float(((q & ib<A>(15)) | fifth_bits<A>(qh, o)) - ib<A>(16)) * d).store_aligned(y + o);
    (xsimd::to_float(((q >> 4) | fifth_bits<A>(qh, 16 + o)) - ib<A>(16)) * d).store_aligned(y + 16 + o);
  }
}
template <class A>
inline void dequantize_simd(const BlockQ5_1& b, float* y) {
  constexpr int W = int(fb<A>::size);
  const fb<A> d(h2f(b.d)), m(h2f(b.m));
  const uint32_t qh = load_u32(b.qh);
  for (int o = 0; o < 16; o += W) {
    const ib<A> q = simd::load_u8<A>(b.qs + o);
    (xsimd::to_float((q & ib<A>(15)) | fifth_bits<A>(qh, o)) * d + m).store_aligned(y + o);
    (xsimd::to_float((q >> 4) | fifth_bits<A>(qh, 16 + o)) * d + m).store_aligned(y + 16 + o);
  }
}
template <class A>
inline void dequantize_simd(const BlockQ4_K& b, float* y) {
  constexpr int W = int(fb<A>::size);
  const float d = h2f(b.d), dmin = h2f(b.dmin);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, b.scales, sc, m);
    const fb<A> d1(d * float(sc)), m1(dmin * float(m));
    const uint8_t* q = b.qs + 32 * (j / 2);
    for (int o = 0; o < 32; o += W) {
      const ib<A> v = simd::load_u8<A>(q + o);
      (d1 * xsimd::to_float(j % 2 ? v >> 4 : v & ib<A>(15)) - m1).store_aligned(y + 32 * j + o);
    }
  }
}
template <class A>
inline void dequantize_simd(const BlockQ5_K& b, float* y) {
  constexpr int W = int(fb<A>::size);
  const float d = h2f(b.d), dmin = h2f(b.dmin);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, b.scales, sc, m);
    const fb<A> d1(d * float(sc)), m1(dmin * float(m));
    const uint8_t* q = b.qs + 32 * (j / 2);
    const ib<A> bit(1 << j);
    for (int o = 0; o < 32; o += W) {
      const ib<A> v = simd::load_u8<A>(q + o);
      const ib<A> hi = sixteen_if<A>(simd::load_u8<A>(b.qh + o), bit);
      (d1 * xsimd::to_float((j % 2 ? v >> 4 : v & ib<A>(15)) + hi) - m1).store_aligned(y + 32 * j + o);
    }
  }
}
template <class A>
inline void dequantize_simd(const BlockQ6_K& b, float* y) {
  constexpr int W = int(fb<A>::size);  // divides 16: one scale per batch
  const float d = h2f(b.d);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int o = 0; o < 32; o += W) {
        const int e = 128 * h + 32 * k + o;
        const ib<A> lo = simd::load_u8<A>(b.ql + 64 * h + 32 * (k & 1) + o);
        const ib<A> hi = (simd::load_u8<A>(b.qh + 32 * h + o) >> (2 * k)) & ib<A>(3);
        const ib<A> q = ((k < 2 ? lo & ib<A>(15) : lo >> 4) | (hi << 4)) - ib<A>(32);
        (fb<A>(d * float(b.scales[e / 16])) * xsimd::to_float(q)).store_aligned(y + e);
      }
}

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

// y[t * ys] = dot(w, activation row t) for t < NT; activation rows (ActQ8 blocks) are xqs bytes apart.
template <class A, int NT, class Block>
inline void dot_fast(const Block* w, std::size_t n, const uint8_t* xq, std::size_t xqs, float* y, std::size_t ys)
  requires(Block::kElems == 32)
{
  using IA = simd::IntArch<A>;
  using F = fb<IA>;
  using I = ib<IA>;
  using Q = simd::Bytes32<A>;
  F acc[NT];
  float mins[NT];
  const ActQ8* a[NT];
  for (int t = 0; t < NT; ++t) acc[t] = F(0.f), mins[t] = 0.f, a[t] = reinterpret_cast<const ActQ8*>(xq + t * xqs);
  for (std::size_t i = 0; i < n / 32; ++i) {
    const Block& b = w[i];
    simd::prefetch_ahead(&b, sizeof(Block));
    const Q q = codes<A>(b);
    const float d = h2f(b.d);
    for (int t = 0; t < NT; ++t) {
      const ActQ8& x = a[t][i];
      const Q s = Q::load(x.qs);
      const I p = kHasMin<Block> ? simd::dot_us<A>(I(0), q, s) : simd::dot_ss<A>(I(0), q, s);
      acc[t] = simd::fma(xsimd::to_float(p), F(d * x.d), acc[t]);
      if constexpr (kHasMin<Block>) mins[t] += h2f(b.m) * x.s;
    }
  }
  for (int t = 0; t < NT; ++t) y[t * ys] = xsimd::hadd(acc[t]) + mins[t];
}

// Q4_K / Q5_K: sum_j d sc_j (q . s)_j - dmin m_j (sum of s over sub-block j), times the activation scale.
template <class A, int NT, class Block>
inline void dot_fast(const Block* w, std::size_t n, const uint8_t* xq, std::size_t xqs, float* y, std::size_t ys)
  requires(std::is_same_v<Block, BlockQ4_K> || std::is_same_v<Block, BlockQ5_K>)
{
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
    uint8_t sc[8], mn[8];
    scales_mins_k4(b.scales, sc, mn);
    const S scales = S::pairs_u8(sc), mins = S::pairs_u8(mn);  // lanes 2j, 2j + 1: sub-block j
    S group[8];
    Q u[8];
    for (int p = 0; p < 4; ++p) {
      u[2 * p] = Q::low_nibbles(b.qs + 32 * p);
      u[2 * p + 1] = Q::high_nibbles(b.qs + 32 * p);
      if constexpr (std::is_same_v<Block, BlockQ5_K>) {
        u[2 * p] = u[2 * p] | Q::bit4_of_bytes(b.qh, 2 * p);
        u[2 * p + 1] = u[2 * p + 1] | Q::bit4_of_bytes(b.qh, 2 * p + 1);
      }
    }
    for (int j = 0; j < 8; ++j) group[j] = scales.group(j);
    const float d = h2f(b.d), dmin = h2f(b.dmin);
    for (int t = 0; t < NT; ++t) {
      const BlockQ8_K& x = a[t][i];
      I p(0);
      for (int j = 0; j < 8; ++j) p = simd::dot_us_scaled<A>(p, u[j], Q::load(x.qs + 32 * j), group[j]);
      const I m = simd::madd<A>(mins, S::load(x.bsums));  // bsums 2j and 2j + 1 cover sub-block j
      acc[t] = simd::fma(xsimd::to_float(p), F(d * x.d), acc[t]);
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
    S group[8];
    Q u[8];  // u[4h + k]: elements 128h + 32k + (0..31), codes 0..63
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k) {
        const uint8_t* ql = b.ql + 64 * h + 32 * (k & 1);
        u[4 * h + k] = (k < 2 ? Q::low_nibbles(ql) : Q::high_nibbles(ql)) | Q::bits45_of_bytes(b.qh + 32 * h, 2 * k);
      }
    for (int g = 0; g < 8; ++g) group[g] = scales.group(g);
    const float d = h2f(b.d);
    for (int t = 0; t < NT; ++t) {
      const BlockQ8_K& x = a[t][i];
      I p(0);
      for (int g = 0; g < 8; ++g) p = simd::dot_us_scaled<A>(p, u[g], Q::load(x.qs + 32 * g), group[g]);
      const I off = simd::madd<A>(scales, S::load(x.bsums));
      acc[t] = simd::fma(xsimd::to_float(p), F(d * x.d), acc[t]);
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
