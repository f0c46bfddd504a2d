// BF16 / F16 weight matmul on Intel AMX tiles with f32-exact activations: the prefill engine on AMX CPUs.
//
// AMX multiplies bf16 pairs exactly into f32 and accumulates in f32. Activations are f32, so each is
// split into three bf16 parts, x = hi + mid + lo (exact to within 2^-24 relative), and the weights
// are multiplied by each part: the result is an f32-accumulated dot product of the exact weights and
// the f32 activations, like the AVX path, at several times its speed. F16 weights are split too, w =
// hi + lo exactly. Tiles compute Y = X * W^T in y's own layout: A = 16 tokens x 32 k of an activation
// part, B = 32 k x 16 weight rows in the pair layout (weights repacked per group of rows, in L2),
// C = 16 tokens x 16 rows of f32.
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
inline constexpr std::size_t kRowBlock = 32;  // weight rows per task: two B tiles
inline constexpr std::size_t kTileElems = kTileRows * kTileK;  // bf16 elements of one 1 KiB tile

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

// x [m, k] f32 split into hi/mid/lo bf16 parts, each laid out as A tiles: [16-token block][k / 32][16
// tokens][32 k] (one 1 KiB tile after another); tokens past m are zero.
struct PackedX {
  Buffer<uint16_t> parts[3];
  std::size_t m_blocks = 0, k = 0;
  const uint16_t* tile(int part, std::size_t mb, std::size_t ks) const {
    return parts[part].data() + (mb * (k / kTileK) + ks) * kTileElems;
  }
};

#if PP_HAVE_AMX
// 16 floats -> 16 bf16 (round to nearest even) and back.
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline __m512 from_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Packs tokens [16 * b0, 16 * b1) of x (see PackedX).
inline void pack_blocks(const float* x, std::size_t m, std::size_t k, PackedX& p, std::size_t b0, std::size_t b1) {
  const std::size_t ksteps = k / kTileK;
  for (std::size_t b = b0; b < b1; ++b)
    for (std::size_t t = 0; t < kTileRows; ++t) {
      const std::size_t tok = b * kTileRows + t;
      for (std::size_t ks = 0; ks < ksteps; ++ks) {
        const std::size_t off = ((b * ksteps + ks) * kTileRows + t) * kTileK;
        for (std::size_t h = 0; h < 2; ++h) {
          const __m512 v = tok < m ? _mm512_loadu_ps(x + tok * k + ks * kTileK + 16 * h) : _mm512_setzero_ps();
          const __m256i hi = to_bf16(v);
          const __m512 r1 = _mm512_sub_ps(v, from_bf16(hi));
          const __m256i mid = to_bf16(r1);
          const __m256i lo = to_bf16(_mm512_sub_ps(r1, from_bf16(mid)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(p.parts[0].data() + off + 16 * h), hi);
          _mm256_store_si256(reinterpret_cast<__m256i*>(p.parts[1].data() + off + 16 * h), mid);
          _mm256_store_si256(reinterpret_cast<__m256i*>(p.parts[2].data() + off + 16 * h), lo);
        }
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

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// In place: lane j of r[i] <-> lane i of r[j] (16 x 16 32-bit elements).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Cache blocking. k is taken in chunks of kChunkK; a group of rows is repacked, chunk by chunk, into
// about kGroupBytes of B tiles (weights in the pair layout, F16 as hi and lo) that stay in L2 while
// every token pair passes over them. Partial sums wait in y between chunks (exactly: f32 stored and
// reloaded), so the order of the sum is fixed by k alone, never by the group or the thread.
// (Software prefetch of the next group's weights or activations measured slower: it competes with
// the tile loads.)
inline constexpr std::size_t kChunkK = 1024;
inline constexpr std::size_t kGroupBytes = std::size_t(1) << 20;

// Rows [rb, rb + 16) x k [k0, k0 + 32 * steps) of w into B tiles, one per k step from dst (bf16 pairs
// of k per row: [16 pairs][16 rows][2]); F16 weights also write their low parts from dst_lo.
inline void repack_b(const MatView& w, std::size_t rb, std::size_t k0, std::size_t steps, uint16_t* dst,
                     uint16_t* dst_lo) {
  const bool f16 = w.type == DType::F16;
  for (std::size_t ks = 0; ks < steps; ++ks) {
    __m512i hi[kTileRows], lo[kTileRows];
    for (std::size_t r = 0; r < kTileRows; ++r) {
      const uint8_t* src = w.row(rb + r) + (k0 + ks * kTileK) * 2;
      if (!f16) {
        hi[r] = _mm512_loadu_si512(src);
        continue;
      }
      // w = hi + lo exactly (11 significant bits in two bf16 parts).
      const __m512 v0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
      const __m512 v1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32)));
      const __m256i h0 = to_bf16(v0), h1 = to_bf16(v1);
      hi[r] = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
      lo[r] = _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(_mm512_sub_ps(v0, from_bf16(h0)))),
                                 to_bf16(_mm512_sub_ps(v1, from_bf16(h1))), 1);
    }
    transpose16x16(hi);
    for (std::size_t j = 0; j < kTileRows; ++j) _mm512_store_si512(dst + ks * kTileElems + j * kTileK, hi[j]);
    if (!f16) continue;
    transpose16x16(lo);
    for (std::size_t j = 0; j < kTileRows; ++j) _mm512_store_si512(dst_lo + ks * kTileElems + j * kTileK, lo[j]);
  }
}

// y[m, w.rows], rows [r0, r1) (multiples of 32 apart, r0 aligned) from the packed activations.
// Tiles compute Y = X * W^T directly in y's layout: A = 16 tokens x 32 k of an activation part, B =
// 32 k x 16 weight rows, C = 16 tokens x 16 rows (four of them: two token blocks x two row tiles).
inline void matmul_rows(const MatView& w, const PackedX& px, std::size_t m, float* y, std::size_t r0, std::size_t r1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = kTileRows, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const bool f16 = w.type == DType::F16;
  const int w_parts = f16 ? 2 : 1;
  const std::size_t K = w.cols, N = w.rows, chunk = std::min(K, kChunkK);
  const std::size_t group =
      std::min(r1 - r0, std::max(kRowBlock, kGroupBytes / (chunk * 2 * w_parts) / kRowBlock * kRowBlock));
  // B tiles [w part][row tile][k step] of the current group and chunk; the last partial token block's
  // C tiles [row tile][16 tokens][16 rows] (y has no room for a whole tile there).
  static thread_local Buffer<uint16_t> packed_w;
  static thread_local Buffer<float> tail;
  if (packed_w.size() < std::size_t(w_parts) * group * chunk) packed_w = Buffer<uint16_t>(std::size_t(w_parts) * group * chunk);
  if (tail.size() < group * kTileRows) tail = Buffer<float>(group * kTileRows);
  const std::size_t full_blocks = m / kTileRows;
  for (std::size_t rg = r0; rg < r1; rg += group) {
    const std::size_t row_tiles = (std::min(r1, rg + group) - rg) / kTileRows;
    for (std::size_t k0 = 0; k0 < K; k0 += chunk) {
      const std::size_t steps = (std::min(K, k0 + chunk) - k0) / kTileK, ks0 = k0 / kTileK;
      const std::size_t lo_offset = row_tiles * steps * kTileElems;  // F16: the low parts follow the high ones
      for (std::size_t rt = 0; rt < row_tiles; ++rt) {
        uint16_t* dst = packed_w.data() + rt * steps * kTileElems;
        repack_b(w, rg + rt * kTileRows, k0, steps, dst, dst + lo_offset);
      }
      for (std::size_t mb = 0; mb < px.m_blocks; mb += 2) {
        const bool two = mb + 1 < px.m_blocks;  // a second 16-token block in this pass
        for (std::size_t rt = 0; rt < row_tiles; rt += 2) {
          // C tile q: token block mb + q % 2, row tile rt + q / 2; in y, or in `tail` for a partial block.
          auto c_tile = [&](int q, long& stride) {
            const std::size_t b = mb + std::size_t(q % 2), t = rt + std::size_t(q / 2);
            if (b < full_blocks) {
              stride = long(N * sizeof(float));
              return y + b * kTileRows * N + rg + t * kTileRows;
            }
            stride = long(kTileRows * sizeof(float));
            return tail.data() + t * kTileRows * kTileRows;
          };
          long stride;
          if (k0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {
            _tile_loadd(0, c_tile(0, stride), stride);
            _tile_loadd(2, c_tile(2, stride), stride);
            if (two) {
              _tile_loadd(1, c_tile(1, stride), stride);
              _tile_loadd(3, c_tile(3, stride), stride);
            }
          }
          // The weights' parts (one, or F16's two) against the activation parts: three against the
          // high part; against the low one, x_lo (below f32 resolution: 2^-8 * 2^-16 relative) is skipped.
          for (int wp = 0; wp < w_parts; ++wp) {
            const uint16_t* b0 = packed_w.data() + std::size_t(wp) * lo_offset + rt * steps * kTileElems;
            const uint16_t* b1 = b0 + steps * kTileElems;
            const int x_parts = wp == 0 ? 3 : 2;
            for (std::size_t ks = 0; ks < steps; ++ks) {
              _tile_loadd(4, b0 + ks * kTileElems, 64);
              _tile_loadd(5, b1 + ks * kTileElems, 64);
              for (int part = 0; part < x_parts; ++part) {
                _tile_loadd(6, px.tile(part, mb, ks0 + ks), 64);
                _tile_dpbf16ps(0, 6, 4);
                _tile_dpbf16ps(2, 6, 5);
                if (two) {
                  _tile_loadd(7, px.tile(part, mb + 1, ks0 + ks), 64);
                  _tile_dpbf16ps(1, 7, 4);
                  _tile_dpbf16ps(3, 7, 5);
                }
              }
            }
          }
          _tile_stored(0, c_tile(0, stride), stride);
          _tile_stored(2, c_tile(2, stride), stride);
          if (two) {
            _tile_stored(1, c_tile(1, stride), stride);
            _tile_stored(3, c_tile(3, stride), stride);
          }
        }
      }
    }
    if (full_blocks < px.m_blocks)
      for (std::size_t rt = 0; rt < row_tiles; ++rt)
        for (std::size_t t = 0; full_blocks * kTileRows + t < m; ++t)
          std::memcpy(y + (full_blocks * kTileRows + t) * N + rg + rt * kTileRows,
                      tail.data() + (rt * kTileRows + t) * kTileRows, kTileRows * sizeof(float));
  }
  _tile_release();
}
#endif

}  // namespace pp::kernels::amx
