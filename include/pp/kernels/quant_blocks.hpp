// ggml's block-quantized formats: block layouts byte for byte, Format<t> and visit, scalar dequantization
// (the reference values: embedding lookup, the exact path's oracle) and its SIMD form (the exact path).
// Quantizing weights: io/quantize.hpp; activation quantization and the dot kernels: kernels/quant.hpp.
#pragma once

#include <pp/core/dtype.hpp>
#include <pp/kernels/simd.hpp>

#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <cstring>


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

// The largest magnitude of x[0, n) (and, if asked, the value that has it): weight and activation quantization.
inline float abs_max(const float* x, int n, float* signed_max = nullptr) {
  float amax = 0.f, smax = 0.f;
  for (int j = 0; j < n; ++j)
    if (std::abs(x[j]) > amax) amax = std::abs(x[j]), smax = x[j];
  if (signed_max) *signed_max = smax;
  return amax;
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
// Q4_K and Q5_K: eight sub-blocks of 32 codes, each with a 6-bit scale and min; Q5_K's codes have a
// 5th bit, bit j of qh[l] for element l of sub-block j.
template <class Block>
inline void dequantize_k(const Block& b, float* y) {
  constexpr bool kFifthBit = std::is_same_v<Block, BlockQ5_K>;
  const float d = h2f(b.d), dmin = h2f(b.dmin);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, b.scales, sc, m);
    const float d1 = d * float(sc), m1 = dmin * float(m);
    const uint8_t* q = b.qs + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) {
      int code = j % 2 ? q[l] >> 4 : q[l] & 15;
      if constexpr (kFifthBit) code += (b.qh[l] >> j) & 1 ? 16 : 0;
      y[32 * j + l] = d1 * float(code) - m1;
    }
  }
}
inline void dequantize(const BlockQ4_K& b, float* y) { dequantize_k(b, y); }
inline void dequantize(const BlockQ5_K& b, float* y) { dequantize_k(b, y); }
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

// ---- SIMD block dequantization (the exact path): the scalar values above. ----

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
// Q4_K and Q5_K: eight sub-blocks of 32 codes with 6-bit scales and mins; Q5_K adds each code's 5th
// bit from qh (bit j of qh[o] for sub-block j).
template <class A, class Block>
inline void dequantize_k_simd(const Block& b, float* y) {
  constexpr bool kFifthBit = std::is_same_v<Block, BlockQ5_K>;
  constexpr int W = int(fb<A>::size);
  const float d = h2f(b.d), dmin = h2f(b.dmin);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, b.scales, sc, m);
    const fb<A> d1(d * float(sc)), m1(dmin * float(m));
    const uint8_t* q = b.qs + 32 * (j / 2);
    for (int o = 0; o < 32; o += W) {
      const ib<A> v = simd::load_u8<A>(q + o);
      ib<A> code = j % 2 ? v >> 4 : v & ib<A>(15);
      if constexpr (kFifthBit) code = code + sixteen_if<A>(simd::load_u8<A>(b.qh + o), ib<A>(1 << j));
      (d1 * xsimd::to_float(code) - m1).store_aligned(y + 32 * j + o);
    }
  }
}
template <class A>
inline void dequantize_simd(const BlockQ4_K& b, float* y) {
  dequantize_k_simd<A>(b, y);
}
template <class A>
inline void dequantize_simd(const BlockQ5_K& b, float* y) {
  dequantize_k_simd<A>(b, y);
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

}  // namespace pp::quant
