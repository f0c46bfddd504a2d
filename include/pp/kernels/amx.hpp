// BF16 weight matmul on Intel AMX tiles with f32-exact activations: the prefill engine on AMX CPUs.
//
// AMX multiplies bf16 pairs exactly into f32 and accumulates in f32. Activations are f32, so each is
// split into three bf16 parts, x = hi + mid + lo (exact to within 2^-24 relative), and the weights
// are multiplied by each part: the result is an f32-accumulated dot product of the exact weights and
// the f32 activations, like the AVX path, at several times its speed. Tiles compute Y^T = W * X^T:
// A = 16 weight rows x 32 k straight from the weight matrix (row stride), B = 32 k x 16 tokens of a
// part in VNNI pair layout, C = 16 rows x 16 tokens of f32.
//
// Every (row, token) output is computed by the same tile sequence whatever the number of tokens in the
// call and whatever thread runs it, so results are independent of batch size and thread count here
// too (but differ in the last bits from the AVX path, which is what machines without AMX run).
// Tile intrinsics live here rather than in simd.hpp: they are a separate unit, not xsimd batches.
#pragma once

#include <pp/core/buffer.hpp>
#include <pp/core/dtype.hpp>
#include <pp/core/float16.hpp>
#include <pp/core/thread_pool.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PP_HAVE_AMX 1
#endif

namespace pp::kernels::amx {

inline constexpr std::size_t kTileK = 32;     // bf16 elements of k per tile row
inline constexpr std::size_t kTileRows = 16;  // weight rows (A) and tokens (B) per tile
inline constexpr std::size_t kRowBlock = 32;  // weight rows per task: two A tiles

#if PP_HAVE_AMX
// Whether this process may use AMX: compiled in, granted by the kernel, not disabled by PP_NO_AMX=1.
inline bool available() {
  static const bool ok = [] {
    const char* off = std::getenv("PP_NO_AMX");
    if (off && off[0] == '1') return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#else
inline bool available() { return false; }
#endif

// Whether a matmul against w runs on AMX (rows beyond the last full 32-row block use the AVX path).
// F16 weights are split on the fly into two bf16 parts, w = hi + lo, exactly (11 significant bits).
inline bool applies(const MatView& w) {
  return available() && (w.type == DType::BF16 || w.type == DType::F16) && w.cols % kTileK == 0 &&
         w.rows >= kRowBlock;
}

// x [m, k] f32 split into hi/mid/lo bf16 parts, each laid out per 16-token block as [k / 2][16][2]
// (the B-tile pair layout); tokens past m are zero.
struct PackedX {
  Buffer<uint16_t> parts[3];
  std::size_t m_blocks = 0, k = 0;
  const uint16_t* tile(int part, std::size_t mb, std::size_t ks) const {
    return parts[part].data() + (mb * (k / 2) + ks * (kTileK / 2)) * kTileRows * 2;
  }
};

#if PP_HAVE_AMX
// 16 floats -> 16 bf16 (round to nearest even) and back.
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512 from_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif

// Packs tokens [16 * b0, 16 * b1) of x (see PackedX).
inline void pack_blocks(const float* x, std::size_t m, std::size_t k, PackedX& p, std::size_t b0, std::size_t b1) {
  for (std::size_t b = b0; b < b1; ++b)
    for (std::size_t ks = 0; ks < k / kTileK; ++ks) {
      // parts[part][token][pair] for this 16-token x 32-k tile, then transposed into [pair][token].
      alignas(64) uint32_t t16[3][kTileRows][kTileRows];
      for (std::size_t t = 0; t < kTileRows; ++t) {
        const std::size_t tok = b * kTileRows + t;
        const float* src = tok < m ? x + tok * k + ks * kTileK : nullptr;
#if PP_HAVE_AMX
        for (int h = 0; h < 2; ++h) {
          const __m512 v = src ? _mm512_loadu_ps(src + 16 * h) : _mm512_setzero_ps();
          const __m256i hi = to_bf16(v);
          const __m512 r1 = _mm512_sub_ps(v, from_bf16(hi));
          const __m256i mid = to_bf16(r1);
          const __m256i lo = to_bf16(_mm512_sub_ps(r1, from_bf16(mid)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(&t16[0][t][8 * h]), hi);
          _mm256_store_si256(reinterpret_cast<__m256i*>(&t16[1][t][8 * h]), mid);
          _mm256_store_si256(reinterpret_cast<__m256i*>(&t16[2][t][8 * h]), lo);
        }
#else
        for (std::size_t j = 0; j < kTileK; ++j) {
          const float v = src ? src[j] : 0.f;
          const uint16_t hi = f32_to_bf16(v);
          const float r1 = v - bf16_to_f32(hi);
          const uint16_t mid = f32_to_bf16(r1);
          const uint16_t lo = f32_to_bf16(r1 - bf16_to_f32(mid));
          reinterpret_cast<uint16_t*>(t16[0][t])[j] = hi;
          reinterpret_cast<uint16_t*>(t16[1][t])[j] = mid;
          reinterpret_cast<uint16_t*>(t16[2][t])[j] = lo;
        }
#endif
      }
      for (int part = 0; part < 3; ++part) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(const_cast<uint16_t*>(p.tile(part, b, ks)));
        for (std::size_t q = 0; q < kTileRows; ++q)
          for (std::size_t t = 0; t < kTileRows; ++t) dst[q * kTileRows + t] = t16[part][t][q];
      }
    }
}

// Sizes p for m tokens of k and packs x, the token blocks split across the pool.
inline void pack(const float* x, std::size_t m, std::size_t k, PackedX& p, ThreadPool& pool) {
  const std::size_t mb = (m + kTileRows - 1) / kTileRows, need = mb * kTileRows * k;
  if (p.parts[0].size() < need)
    for (auto& b : p.parts) b = Buffer<uint16_t>(need);
  p.m_blocks = mb;
  p.k = k;
  pool.parallel_for(mb, [&](std::size_t b, std::size_t e, unsigned) { pack_blocks(x, m, k, p, b, e); });
}

#if PP_HAVE_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Cache blocking: a group of kGroup row blocks (their weights, 32 x k bf16 each) and one token pair's
// activation parts (3 x 32 x k bf16) stay in L2 while the group runs over every token pair in turn.
inline constexpr std::size_t kGroup = 4;

// y[m, w.rows], rows [r0, r1) (multiples of 32 apart, r0 aligned) from the packed activations.
inline void matmul_rows(const MatView& w, const PackedX& px, std::size_t m, float* y, std::size_t r0, std::size_t r1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = kTileRows, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) float c[4][kTileRows][kTileRows];
  alignas(64) uint16_t split[2][2][kTileRows][kTileK];  // F16 only: [row tile][hi, lo][row][k]
  const bool f16 = w.type == DType::F16;
  const std::size_t ksteps = w.cols / kTileK, N = w.rows;
  const long stride = long(w.row_stride);
  for (std::size_t rg = r0; rg < r1; rg += kGroup * kRowBlock) {
    const std::size_t rg_end = std::min(r1, rg + kGroup * kRowBlock);
    for (std::size_t mb = 0; mb < px.m_blocks; mb += 2) {
      const bool two = mb + 1 < px.m_blocks;  // a second 16-token block in this pass
      for (std::size_t rb = rg; rb < rg_end; rb += kRowBlock) {
        const uint8_t* a0 = w.row(rb);
        const uint8_t* a1 = w.row(rb + kTileRows);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        // C += A * B over the parts: three activation parts against the weights' (one or two) parts.
        auto accumulate = [&](std::size_t ks, int n_parts) {
          for (int part = 0; part < n_parts; ++part) {
            _tile_loadd(6, px.tile(part, mb, ks), 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
              _tile_loadd(7, px.tile(part, mb + 1, ks), 64);
              _tile_dpbf16ps(1, 4, 7);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
        };
        for (std::size_t ks = 0; ks < ksteps; ++ks) {
          if (!f16) {
            _tile_loadd(4, a0 + ks * 64, stride);
            _tile_loadd(5, a1 + ks * 64, stride);
            accumulate(ks, 3);
            continue;
          }
          // w = hi + lo exactly; lo * x_lo is below f32 resolution (2^-8 * 2^-16 relative) and skipped.
          for (int rt = 0; rt < 2; ++rt)
            for (std::size_t r = 0; r < kTileRows; ++r) {
              const uint8_t* src = (rt ? a1 : a0) + r * w.row_stride + ks * 64;
              for (int h = 0; h < 2; ++h) {
                const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * h)));
                const __m256i hi = to_bf16(v);
                _mm256_store_si256(reinterpret_cast<__m256i*>(&split[rt][0][r][16 * h]), hi);
                _mm256_store_si256(reinterpret_cast<__m256i*>(&split[rt][1][r][16 * h]),
                                   to_bf16(_mm512_sub_ps(v, from_bf16(hi))));
              }
            }
          _tile_loadd(4, split[0][0], 64);
          _tile_loadd(5, split[1][0], 64);
          accumulate(ks, 3);
          _tile_loadd(4, split[0][1], 64);
          _tile_loadd(5, split[1][1], 64);
          accumulate(ks, 2);
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        // Tile q holds rows rb + 16 * (q / 2) for tokens of block mb + q % 2: c[q][row][token] -> y[token][row].
        for (int q = 0; q < 4; ++q) {
          if (q % 2 == 1 && !two) continue;
          const std::size_t row0 = rb + std::size_t(q / 2) * kTileRows, tok0 = (mb + std::size_t(q % 2)) * kTileRows;
          for (std::size_t t = 0; t < kTileRows && tok0 + t < m; ++t)
            for (std::size_t r = 0; r < kTileRows; ++r) y[(tok0 + t) * N + row0 + r] = c[q][r][t];
        }
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace pp::kernels::amx
