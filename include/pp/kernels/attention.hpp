// Attention inner loops for the query heads that share one KV head: scores against keys stored
// transposed ([head_dim][keys]), and the weighted sum of values stored by rows ([keys][kv_dim]).
//
// Each score is one FMA chain over the head dimension in order, each output element one FMA chain
// over the keys in position order, so a value never depends on which SIMD lane or block it was
// computed in: prefill, decode and batched sequences agree bit for bit.
#pragma once

#include <pp/kernels/simd.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace pp::kernels {

// Extra floats a transposed key buffer or score row must have past its last key: blocks of two
// vectors are loaded and stored whole, the lanes past `count` being ignored.
inline constexpr std::size_t kAttnPad = 32;

// w[h * ws + j] = scale * sum_d q[h * hd + d] * kt[d * ld + j] for h < group, j < count.
// Reads kt[d * ld + j] up to j < count + kAttnPad - 1 and writes w up to j < count + kAttnPad - 1.
template <class A = simd::Best>
inline void attn_scores(const float* q, std::size_t group, std::size_t hd, const float* kt, std::size_t ld,
                        std::size_t count, float scale, float* w, std::size_t ws) {
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size;
  static_assert(2 * W <= kAttnPad);
  constexpr std::size_t H = 4;  // query heads per pass: 8 independent chains hide the FMA latency
  const B vs(scale);
  for (std::size_t j = 0; j < count; j += 2 * W)
    for (std::size_t h0 = 0; h0 < group; h0 += H) {
      const std::size_t hn = std::min(H, group - h0);
      B acc[H][2];
      for (std::size_t h = 0; h < H; ++h) acc[h][0] = acc[h][1] = B(0.f);
      const float* qh = q + h0 * hd;
      for (std::size_t d = 0; d < hd; ++d) {
        const B k0 = B::load_unaligned(kt + d * ld + j), k1 = B::load_unaligned(kt + d * ld + j + W);
        for (std::size_t h = 0; h < H; ++h)
          if (h < hn) {
            const B qd(qh[h * hd + d]);
            acc[h][0] = simd::fma(qd, k0, acc[h][0]);
            acc[h][1] = simd::fma(qd, k1, acc[h][1]);
          }
      }
      for (std::size_t h = 0; h < hn; ++h) {
        (acc[h][0] * vs).store_unaligned(w + (h0 + h) * ws + j);
        (acc[h][1] * vs).store_unaligned(w + (h0 + h) * ws + j + W);
      }
    }
}

// out[h * hd + d] += sum_j w[h * ws + j] * v[j * vs + d] for h < group, j < count (in order of j),
// d < hd. Accumulates onto `out`, so consecutive key ranges continue the same chains.
template <class A = simd::Best>
inline void attn_values(const float* w, std::size_t ws, std::size_t group, std::size_t hd, const float* v,
                        std::size_t vs, std::size_t count, float* out) {
  using B = simd::fbatch<A>;
  constexpr std::size_t W = B::size;
  constexpr std::size_t V = 4;                 // vectors of the head dimension per pass
  constexpr std::size_t H = W >= 16 ? 4 : 2;   // heads per pass: H * V accumulators in registers
  const std::size_t hdv = hd / W * W;
  for (std::size_t h0 = 0; h0 < group; h0 += H) {
    const std::size_t hn = std::min(H, group - h0);
    for (std::size_t d0 = 0; d0 < hdv; d0 += V * W) {
      const std::size_t vn = std::min(V, (hdv - d0) / W);
      B acc[H][V];
      for (std::size_t h = 0; h < H; ++h)
        for (std::size_t c = 0; c < V; ++c)
          acc[h][c] = h < hn && c < vn ? B::load_unaligned(out + (h0 + h) * hd + d0 + c * W) : B(0.f);
      for (std::size_t j = 0; j < count; ++j) {
        const float* vj = v + j * vs + d0;
        B x[V];
        for (std::size_t c = 0; c < V; ++c)
          if (c < vn) x[c] = B::load_unaligned(vj + c * W);
        for (std::size_t h = 0; h < H; ++h)
          if (h < hn) {
            const B p(w[(h0 + h) * ws + j]);
            for (std::size_t c = 0; c < V; ++c)
              if (c < vn) acc[h][c] = simd::fma(p, x[c], acc[h][c]);
          }
      }
      for (std::size_t h = 0; h < hn; ++h)
        for (std::size_t c = 0; c < vn; ++c) acc[h][c].store_unaligned(out + (h0 + h) * hd + d0 + c * W);
    }
    for (std::size_t d = hdv; d < hd; ++d)  // head_dim not a multiple of the vector width
      for (std::size_t h = 0; h < hn; ++h)
        for (std::size_t j = 0; j < count; ++j)
          out[(h0 + h) * hd + d] = std::fma(w[(h0 + h) * ws + j], v[j * vs + d], out[(h0 + h) * hd + d]);
  }
}

}  // namespace pp::kernels
