// Bulk matrix products (prompts) against F32 / F16 / BF16 weights on the vector units: the GEMM of
// CPUs without AMX.
//
// The activations are packed once per call, transposed into blocks of kBlockTokens tokens (PackedX):
// for each k, the block's tokens side by side, so one vector load gives one k of V vectors of tokens.
// A register tile is R weight rows x V token vectors of accumulators: each step over k loads the V
// token vectors and broadcasts one weight per row straight from memory, R*V FMAs for V + R loads, and
// no horizontal sums. The weights need no packing: F32 rows are read where they lie, F16 / BF16 rows
// are widened to f32 once per row block and token chunk (a few % of the FMAs) into a buffer in L1/L2.
// A row block stays in cache while every token block of a chunk passes over it; a chunk's packed
// tokens stay in L2 (kChunkBytes).
//
// The fast path of BF16 weights (simd::Bf16Dot: AVX512-BF16 or AArch64 BF16; StageOptions::fast_float):
// the activations rounded to bf16 as they are packed, in pairs of k (PackedX::pairs), and the tile's step
// is a bf16 dot (vdpbf16ps, bfdot) with one weight pair broadcast per row, two products a lane:
// llama.cpp's numerics for a BF16 matmul.
//
// Numerics: each (row, token) output is one chain over k in order (exact path: acc = fma(w_k, x_k, acc);
// fast path: acc += w_k x_k + w_k+1 x_k+1 per pair) in its own lane: the same operations whatever the
// tile, the row block, the token block, the chunk, the batch or the thread, so bulk results never
// depend on those. They differ in the last bits from the decode kernels (several accumulator chains
// per row), exactly as the AMX tiles do: a row's path depends only on the size of its own request
// (kBulkRows).
#pragma once

#include <pp/core/buffer.hpp>
#include <pp/core/dtype.hpp>
#include <pp/core/float16.hpp>
#include <pp/core/thread_pool.hpp>
#include <pp/kernels/simd.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

namespace pp::kernels::gemm {

// Token vectors per register tile, and weight rows: R*V accumulators + V token vectors + 1 broadcast
// must fit the register file (32 zmm: 12 x 2; 16 ymm / xmm: 6 x 2).
inline constexpr int kVecs = 2;
template <class A>
inline constexpr int kRows = simd::fbatch<A>::size >= 16 ? 12 : 6;
// Tokens per packed block: the V vectors of a tile. The same on every architecture of a build (the
// widest one's), so that one packing serves them all; narrower tiles take a block in several passes.
inline constexpr std::size_t kBlockTokens = kVecs * simd::fbatch<simd::Best>::size;

// Packed token bytes per chunk: well inside a core's L2 (1-2 MiB on current x86 server cores), leaving
// room for the row block and the weights passing through.
inline constexpr std::size_t kChunkBytes = 512 * 1024;

// x [m, k] transposed into blocks of kBlockTokens tokens: f32 [block][k][token], or, for the fast BF16
// path (pairs), u32 [block][ceil(k / 2)][token] holding (x_2j, x_2j+1) rounded to bf16, low half first;
// tokens past m and the odd k's missing partner are zero.
struct PackedX {
  Buffer<uint32_t> data;
  std::size_t m = 0, k = 0;
  bool pairs = false;
  std::size_t steps() const { return pairs ? (k + 1) / 2 : k; }  // 32-bit words of a token over k
  std::size_t blocks() const { return (m + kBlockTokens - 1) / kBlockTokens; }
  std::size_t block_bytes() const { return steps() * kBlockTokens * sizeof(uint32_t); }
  const uint32_t* block(std::size_t b) const { return data.data() + b * steps() * kBlockTokens; }
};

// Packs the tokens of blocks [b0, b1) (see PackedX).
inline void pack_blocks(const float* x, PackedX& p, std::size_t b0, std::size_t b1) {
  constexpr std::size_t TB = kBlockTokens;
  const std::size_t k = p.k, steps = p.steps();
  for (std::size_t b = b0; b < b1; ++b) {
    uint32_t* out = p.data.data() + b * steps * TB;
    for (std::size_t l = 0; l < TB; ++l) {
      const std::size_t t = b * TB + l;
      if (t >= p.m) {
        for (std::size_t s = 0; s < steps; ++s) out[s * TB + l] = 0;
        continue;
      }
      const float* xr = x + t * k;
      if (p.pairs) {
        for (std::size_t s = 0; s < k / 2; ++s)
          out[s * TB + l] = uint32_t(f32_to_bf16(xr[2 * s])) | uint32_t(f32_to_bf16(xr[2 * s + 1])) << 16;
        if (k % 2) out[(k / 2) * TB + l] = f32_to_bf16(xr[k - 1]);
      } else {
        for (std::size_t s = 0; s < k; ++s) std::memcpy(out + s * TB + l, xr + s, 4);
      }
    }
  }
}

// Sizes p for x [m, k] (growing its buffer to the largest call so far); pack_blocks then fills it.
inline void prepare(PackedX& p, std::size_t m, std::size_t k, bool pairs) {
  p.m = m, p.k = k, p.pairs = pairs;
  const std::size_t words = p.blocks() * p.steps() * kBlockTokens;
  if (p.data.size() < words) p.data = Buffer<uint32_t>(words);
}

inline void pack(const float* x, std::size_t m, std::size_t k, bool pairs, PackedX& p) {
  prepare(p, m, k, pairs);
  pack_blocks(x, p, 0, p.blocks());
}

// The weights of a row block as the exact tile reads them: f32, in panels of kPanelK values of k, a
// panel holding the block's R rows one after another ([k / kPanelK][R][kPanelK], the last panel zero-
// padded): every step of the tile reads within one panel, a single stream through L1.
inline constexpr std::size_t kPanelK = 16;

// No work beside a tile's FMAs.
struct NoSideWork {
  void step() {}
};

// out[r * TB + t] = dot(weight row r, token t of xt) for r < R and the V * W tokens of a tile (xt and out
// point at the tile's first token in a block of TB); w: the row block's panels, k of them. With
// `resume`, the chains go on from the values in out (the dot over the k before these). `side.step()`
// runs after every whole panel: a slice of other work (the next row block's widening) placed between
// the FMAs, where the load and store ports have room and a cache miss waits beside them.
template <class A, int R, class Side = NoSideWork>
inline void tile(const float* w, const float* xt, std::size_t k, float* out, bool resume, Side&& side = {}) {
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size, TB = kBlockTokens;
  B acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v)
      acc[r][v] = resume ? B::load_aligned(out + std::size_t(r) * TB + v * W) : B(0.f);
  auto step = [&](const float* panel, std::size_t s, std::size_t j) {
    B xv[kVecs];
    for (int v = 0; v < kVecs; ++v) xv[v] = B::load_aligned(xt + s * TB + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const B wb(panel[std::size_t(r) * kPanelK + j]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = simd::fma(wb, xv[v], acc[r][v]);
    }
  };
  std::size_t s0 = 0;
  for (; s0 + kPanelK <= k; s0 += kPanelK) {
    for (std::size_t j = 0; j < kPanelK; ++j) step(w + s0 * R, s0 + j, j);
    side.step();
  }
  for (std::size_t j = 0; s0 + j < k; ++j) step(w + s0 * R, s0 + j, j);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v].store_aligned(out + std::size_t(r) * TB + v * W);
}

#if PP_HAVE_BF16_DOT
// The fast tile's rows: 24 accumulators, 2 token vectors, 1 broadcast (32 zmm on AVX-512, 32 q on NEON).
inline constexpr int kBf16Rows = 12;

// The fast path's tile: xt packed in pairs, w R rows of bf16 `ws` elements apart, k elements each; with
// `resume`, the chains go on from the values in out. V token vectors: 2 (the whole block), or 1 for a
// block whose tokens fit one vector (a short prompt, a prompt's paced piece beside decode steps, the last
// block of a prompt), which then costs half; each (row, token) is the same chain either way.
template <int R, int V = 2>
inline void tile_bf16(const uint16_t* w, std::size_t ws, const uint32_t* xt, std::size_t k, float* out, bool resume) {
  using D = simd::Bf16Dot;
  constexpr std::size_t TB = kBlockTokens, L = D::kLanes;
  static_assert(TB == 2 * L, "a block is the tile's two token vectors");
  static_assert(V == 1 || V == 2);
  D::Acc acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = resume ? D::load_acc(out + std::size_t(r) * TB + v * L) : D::zero();
  auto step = [&](std::size_t s, auto&& weight_pair) {
    D::Vec xv[V];
    for (int v = 0; v < V; ++v) xv[v] = D::load(xt + s * TB + v * L);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const D::Vec wb = D::broadcast_pair(weight_pair(r));
      for (int v = 0; v < V; ++v) acc[r][v] = D::dot(acc[r][v], wb, xv[v]);
    }
  };
  std::size_t s = 0;
  for (; s < k / 2; ++s)
    step(s, [&](int r) {
      uint32_t p;
      std::memcpy(&p, w + std::size_t(r) * ws + 2 * s, 4);
      return p;
    });
  if (k % 2) step(s, [&](int r) { return uint32_t(w[std::size_t(r) * ws + k - 1]); });  // partner 0
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) D::store(out + std::size_t(r) * TB + v * L, acc[r][v]);
}
#endif

namespace detail {

// A tile kernel's table by row count: {tile_for.operator()<1>(), ..., tile_for.operator()<N>()}, so that
// table[R - 1] runs a block of R rows (full blocks and the last one).
template <int N, class TileFor>
constexpr auto row_table(TileFor tile_for) {
  return [tile_for]<int... R>(std::integer_sequence<int, R...>) {
    return std::array{tile_for.template operator()<R + 1>()...};
  }(std::make_integer_sequence<int, N>{});
}

template <class A>
inline constexpr auto kTable = row_table<kRows<A>>([]<int R>() { return &tile<A, R, NoSideWork>; });

#if PP_HAVE_BF16_DOT
// kBf16Table[V - 1][R - 1]: the tile for R rows and V token vectors.
inline constexpr std::array kBf16Table = {row_table<kBf16Rows>([]<int R>() { return &tile_bf16<R, 1>; }),
                                          row_table<kBf16Rows>([]<int R>() { return &tile_bf16<R, 2>; })};
#endif

// Tile results out[r * TB + t] (rn rows, tn tokens) into y[t * ys + r]: transposed in L1 first, then
// one contiguous run of rows per token (scattering single floats across token rows a power of two
// apart thrashes one cache set).
template <int RMax>
inline void store_tile(const float* out, std::size_t rn, std::size_t tn, float* y, std::size_t ys) {
  constexpr std::size_t TB = kBlockTokens;
  alignas(64) float tr[TB * RMax];
  for (std::size_t r = 0; r < rn; ++r)
    for (std::size_t t = 0; t < TB; ++t) tr[t * RMax + r] = out[r * TB + t];
  for (std::size_t t = 0; t < tn; ++t) std::memcpy(y + t * ys, tr + t * RMax, rn * sizeof(float));
}

// Scratch of the calling thread: two row blocks' weights widened to f32, the tiles' accumulators.
struct Scratch {
  Buffer<float> rows;
  Buffer<float> acc;  // for_each_tile's accumulators between segments of k
  static constexpr int kMaxRows = 16;  // of any tile here or in gemm_q8.hpp (store_tile's bound)
};
static_assert(kRows<simd::Best> <= Scratch::kMaxRows);
inline Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

}  // namespace detail

// Values of k per segment: a row block's segment of weights (R x kSegK: 24 KiB widened to f32 at 12
// rows) stays in L1 and a chunk's tokens of one segment in L2, whatever k is. Without segments a token
// block at k = 8192 is 0.5-1 MiB, so each chunk held one and every row block was fetched (and widened)
// again for each block of tokens.
inline constexpr std::size_t kSegK = 512;
static_assert(kSegK % kPanelK == 0 && kSegK % 32 == 0);  // whole panels, bf16 pairs, Q8_0 blocks
// Row blocks whose accumulators wait between segments (in Scratch::acc, the tiles' own layout).
inline constexpr std::size_t kGroupBlocks = 8;
// Segments of k values, and the length of segment `seg`.
inline constexpr std::size_t seg_count(std::size_t k) { return (k + kSegK - 1) / kSegK; }
inline constexpr std::size_t seg_len(std::size_t k, std::size_t seg) { return std::min(kSegK, k - seg * kSegK); }

// The loops of every tile kernel (float, bf16 dot, Q8_0): y[m, ys] (rows [r0, r1) only) from `blocks`
// packed token blocks, k cut into `segs` segments, a token block's segment `seg_bytes` packed. Loops:
// token chunks (about kChunkBytes of one segment), groups of kGroupBlocks row blocks of R, segments, the
// group's row blocks, the chunk's token blocks. `prepare(rb, rn, seg)` readies a row block's segment,
// `prefetch(rb, rn, seg)` asks for one ahead (the next row block's, or the group's first of the next
// segment: R short runs from R rows, too short for the hardware prefetcher) while this one computes,
// `tile(rb, rn, b, seg, acc, resume)` runs the segment into acc (R x kBlockTokens, the tiles' layout),
// going on from its values when `resume`. So each (row, token) is one chain over k in order, whatever
// the segments, chunks, groups or tasks.
template <int R, class Prepare, class Prefetch, class Tile>
inline void for_each_tile(std::size_t blocks, std::size_t segs, std::size_t seg_bytes, std::size_t m, float* y,
                          std::size_t ys, std::size_t r0, std::size_t r1, Prepare&& prepare, Prefetch&& prefetch,
                          Tile&& tile) {
  constexpr std::size_t TB = kBlockTokens;
  const std::size_t chunk = std::max<std::size_t>(1, kChunkBytes / seg_bytes);  // token blocks
  detail::Scratch& s = detail::scratch();
  const std::size_t acc_words = kGroupBlocks * chunk * R * TB;
  if (s.acc.size() < acc_words) s.acc = Buffer<float>(acc_words);
  for (std::size_t c0 = 0; c0 < blocks; c0 += chunk) {
    const std::size_t c1 = std::min(blocks, c0 + chunk);
    for (std::size_t g0 = r0; g0 < r1; g0 += kGroupBlocks * R) {
      const std::size_t g1 = std::min(r1, g0 + kGroupBlocks * R);
      auto acc = [&](std::size_t rb, std::size_t b) {
        return s.acc.data() + (((rb - g0) / R) * chunk + (b - c0)) * R * TB;
      };
      for (std::size_t seg = 0; seg < segs; ++seg)
        for (std::size_t rb = g0; rb < g1; rb += R) {
          const std::size_t rn = std::min<std::size_t>(R, g1 - rb);
          prepare(rb, rn, seg);
          if (rb + R < g1) prefetch(rb + R, std::min<std::size_t>(R, g1 - rb - R), seg);
          else if (seg + 1 < segs) prefetch(g0, std::min<std::size_t>(R, g1 - g0), seg + 1);
          for (std::size_t b = c0; b < c1; ++b) tile(rb, rn, b, seg, acc(rb, b), seg > 0);
        }
      for (std::size_t rb = g0; rb < g1; rb += R)
        for (std::size_t b = c0; b < c1; ++b)
          detail::store_tile<R>(acc(rb, b), std::min<std::size_t>(R, g1 - rb), std::min(TB, m - b * TB),
                                y + b * TB * ys + rb, ys);
    }
  }
}

// Prefetches values [k0, k0 + kn) of rows [rb, rb + rn) of w (elem bytes a value), into L1 (Locality 3)
// or L2 (2: gemm_f16.hpp, whose token stream would evict them from L1 before the rows are read).
//
// The empty volatile asm is a side effect: without one, GCC 12 at -O3 finds a lambda that only calls
// this free of them (IPA pure-const) and deletes the calls; the Q8_0 tiles' loop had no prefetch at all.
template <int Locality = 3>
inline void prefetch_rows(const MatView& w, std::size_t rb, std::size_t rn, std::size_t k0, std::size_t kn,
                          std::size_t elem) {
  for (std::size_t r = 0; r < rn; ++r) {
    const char* p = reinterpret_cast<const char*>(w.row(rb + r)) + k0 * elem;
    for (std::size_t o = 0; o < kn * elem; o += 64) __builtin_prefetch(p + o, 0, Locality);
  }
  __asm__ volatile("");
}

// A row block's segment of float weights widened to f32 panels (the exact tile's layout, `dst`), one
// row's panel (a unit) at a time: whole at once (run), or slice by slice inside the tiles of the row block
// before it (step, after each of their panels), so the widening and the weights' trip from memory overlap
// the FMAs instead of waiting between row blocks (which cost 7-10% of an F16 prompt).
template <class A, class WT>
struct PanelWidening {
  const MatView* w = nullptr;
  float* dst = nullptr;
  std::size_t rb = 0, rn = 0, k0 = 0, kn = 0;
  std::size_t units = 0, done = 0, per_step = 0;

  PanelWidening(const MatView& w_, float* dst_, std::size_t rb_, std::size_t rn_, std::size_t k0_, std::size_t kn_,
                std::size_t steps)
      : w(&w_), dst(dst_), rb(rb_), rn(rn_), k0(k0_), kn(kn_), units(rn_ * panels()),
        per_step(steps ? (units + steps - 1) / steps : units) {}
  std::size_t panels() const { return (kn + kPanelK - 1) / kPanelK; }
  void unit(std::size_t u) {
    using S = typename WT::storage;
    constexpr std::size_t W = simd::fbatch<A>::size;
    const std::size_t r = u / panels(), s0 = (u % panels()) * kPanelK;  // row by row: each read in order
    const S* src = reinterpret_cast<const S*>(w->row(rb + r)) + k0 + s0;
    float* out = dst + s0 * rn + r * kPanelK;
    if (s0 + kPanelK <= kn)
      for (std::size_t j = 0; j < kPanelK; j += W) simd::load<A>(WT{}, src + j).store_aligned(out + j);
    else
      for (std::size_t j = 0; j < kPanelK; ++j) out[j] = s0 + j < kn ? simd::load1(WT{}, src + j) : 0.f;
  }
  void step() {
    for (const std::size_t end = std::min(units, done + per_step); done < end; ++done) unit(done);
  }
  void run() {
    for (; done < units; ++done) unit(done);
  }
};

// y[m, w.rows] (rows [r0, r1) only) = x * w^T for float weights, x packed by pack(..., pairs = false).
// Each row block's segment is widened to f32 panels once per chunk, then every token block of the chunk
// passes over it; the next row block's segment is widened inside the first tile of this one (into the
// other half of a double buffer), so only a group's first block is widened between tiles.
template <class A, class WT>
inline void matmul_packed_typed(const MatView& w, const PackedX& x, float* y, std::size_t r0, std::size_t r1) {
  constexpr std::size_t TB = kBlockTokens, W = simd::fbatch<A>::size;
  constexpr int R = kRows<A>;
  const std::size_t k = w.cols;
  detail::Scratch& s = detail::scratch();
  if (s.rows.size() < 2 * R * kSegK) s.rows = Buffer<float>(2 * R * kSegK);
  float* cur = s.rows.data();  // the row block the tiles read
  float* nxt = cur + R * kSegK;  // the next one, widened inside the tiles of this one
  struct Block {
    std::size_t rb = SIZE_MAX, rn = 0, seg = 0;
    bool operator==(const Block&) const = default;
  };
  Block ahead, ready;  // the block to widen inside the next tiles; the block nxt holds
  auto widening = [&](float* dst, const Block& b, std::size_t steps) {
    return PanelWidening<A, WT>(w, dst, b.rb, b.rn, b.seg * kSegK, seg_len(k, b.seg), steps);
  };
  auto prepare = [&](std::size_t rb, std::size_t rn, std::size_t seg) {
    if (ready == Block{rb, rn, seg}) std::swap(cur, nxt);
    else widening(cur, {rb, rn, seg}, 0).run();
    ready = {}, ahead = {};
  };
  auto prefetch = [&](std::size_t rb, std::size_t rn, std::size_t seg) {
    prefetch_rows(w, rb, rn, seg * kSegK, seg_len(k, seg), sizeof(typename WT::storage));
    ahead = {rb, rn, seg};
  };
  auto tiles = [&](std::size_t, std::size_t rn, std::size_t b, std::size_t seg, float* acc, bool resume) {
    const float* xt = reinterpret_cast<const float*>(x.block(b)) + seg * kSegK * TB;
    const std::size_t tn = std::min(TB, x.m - b * TB), kn = seg_len(k, seg);
    std::size_t t = 0;
    if (rn == R && ahead != Block{}) {  // the first tile of a whole block: the next block widens beside it
      auto side = widening(nxt, ahead, kn / kPanelK);
      tile<A, R>(cur, xt, kn, acc, resume, side);
      side.run();
      ready = ahead, ahead = {};
      t = kVecs * W;
    }
    for (; t < tn; t += kVecs * W) detail::kTable<A>[rn - 1](cur, xt + t, kn, acc + t, resume, {});
  };
  for_each_tile<R>(x.blocks(), seg_count(k), std::min(k, kSegK) * TB * sizeof(float), x.m, y, w.rows, r0, r1, prepare, prefetch,
                   tiles);
}

template <class A>
inline void matmul_packed(const MatView& w, const PackedX& x, float* y, std::size_t r0, std::size_t r1) {
  switch (w.type) {
    case DType::BF16: return matmul_packed_typed<A, simd::Bf16w>(w, x, y, r0, r1);
    case DType::F16: return matmul_packed_typed<A, simd::F16w>(w, x, y, r0, r1);
    default: return matmul_packed_typed<A, simd::F32w>(w, x, y, r0, r1);
  }
}

// The fast path of BF16 weights exists on this build (a bf16 dot compiled in: simd::Bf16Dot).
inline constexpr bool kHaveFastBf16 = simd::kHaveBf16Dot;

#if PP_HAVE_BF16_DOT
// y[m, w.rows] (rows [r0, r1) only) = x * w^T for BF16 weights, x packed by pack(..., pairs = true).
inline void matmul_packed_bf16(const MatView& w, const PackedX& x, float* y, std::size_t r0, std::size_t r1) {
  constexpr std::size_t TB = kBlockTokens;
  constexpr int R = kBf16Rows;
  const std::size_t k = w.cols;
  const auto no_prepare = [](std::size_t, std::size_t, std::size_t) {};
  // No prefetch: with one (into L1 or L2), these tiles ran at 0.92-1.01x their speed without, 0.96 on
  // average (bench/ab_tiles.sh, Zen 5): the weight pairs are broadcast straight from the rows, whose
  // lines the hardware prefetcher follows. (Up to d22d4f4 GCC deleted the calls anyway: see prefetch_rows.)
  const auto no_prefetch = [](std::size_t, std::size_t, std::size_t) {};
  auto tile = [&](std::size_t rb, std::size_t rn, std::size_t b, std::size_t seg, float* acc, bool resume) {
    const bool one_vector = x.m - b * TB <= simd::Bf16Dot::kLanes;  // the block's tokens fit one vector
    detail::kBf16Table[one_vector ? 0 : 1][rn - 1](reinterpret_cast<const uint16_t*>(w.row(rb)) + seg * kSegK,
                                                   w.row_stride / 2, x.block(b) + seg * kSegK / 2 * TB,
                                                   seg_len(k, seg), acc, resume);
  };
  for_each_tile<R>(x.blocks(), seg_count(k), (std::min(k, kSegK) + 1) / 2 * TB * 4, x.m, y, w.rows, r0, r1, no_prepare,
                   no_prefetch, tile);
}
#endif

// Convenience for tests: packs x [m, w.cols] and runs the exact (pairs = false) or fast kernel.
template <class A>
inline void matmul_rows(const MatView& w, const float* x, std::size_t m, float* y, std::size_t r0, std::size_t r1,
                        bool fast_bf16 = false) {
  PackedX p;
  pack(x, m, w.cols, fast_bf16, p);
#if PP_HAVE_BF16_DOT
  if (fast_bf16) return matmul_packed_bf16(w, p, y, r0, r1);
#endif
  matmul_packed<A>(w, p, y, r0, r1);
}

inline bool applies(const MatView& w) {
  return w.type == DType::F32 || w.type == DType::F16 || w.type == DType::BF16;
}

}  // namespace pp::kernels::gemm
