// One Llama decoder block: RMSNorm, grouped-query attention with RoPE, residual, RMSNorm, SwiGLU, residual.
#pragma once

#include <pp/core/thread_pool.hpp>
#include <pp/io/llama_loader.hpp>
#include <pp/kernels/matmul.hpp>
#include <pp/kernels/ops.hpp>
#include <pp/model/config.hpp>
#include <pp/model/kv_cache.hpp>
#include <pp/model/scratch.hpp>

#include <cmath>
#include <cstring>
#include <span>

namespace pp {

// A run of consecutive rows of one sequence within a chunk: rows [row0, row0 + n) sit at positions
// pos..pos+n-1 of the sequence whose cache is `kv`. A chunk holds one segment (a prefill or a decode
// step) or several (sequences decoding together, so each weight is read once for all of them).
struct Segment {
  KvCache* kv;
  int64_t pos;
  std::size_t row0, n;
};

// att[m, n_head, head_dim] for the chunk's rows. A row attends to its own sequence: positions below its
// segment's start come from that sequence's ring, the segment's own rows from s.k / s.v (so a chunk
// never reads a slot it has itself overwritten). Keys are visited in position order, so the result
// does not depend on where the ring wrapped or on the other rows of the chunk.
inline void attention(const Config& c, std::span<const Segment> segs, std::size_t layer, std::size_t m, Scratch& s,
                      ThreadPool& pool) {
  const std::size_t hd = c.head_dim, group = c.n_head / c.n_head_kv, kvd = c.kv_dim();
  const float scale = 1.0f / std::sqrt(float(hd));
  // One task per (row, KV head): the query heads sharing a KV head read each key and value once.
  pool.parallel_for(m * c.n_head_kv, [&](std::size_t b, std::size_t e, unsigned t) {
    float* w = s.scores.data() + std::size_t(t) * s.scores_stride * group;  // [group][window]
    for (std::size_t task = b; task < e; ++task) {
      const std::size_t i = task / c.n_head_kv, g = task % c.n_head_kv;
      const Segment& seg = segs[s.row_seg[i]];
      const KvCache& kv = *seg.kv;
      const int64_t p = seg.pos + int64_t(i - seg.row0), lo = kv.window_lo(p);
      const float* q = s.q.data() + i * c.q_dim() + g * group * hd;  // [group, head_dim]
      auto fresh = [&](int64_t j) { return (seg.row0 + std::size_t(j - seg.pos)) * kvd + g * hd; };
      auto key = [&](int64_t j) { return j < seg.pos ? kv.k(layer, kv.slot(j)) + g * hd : s.k.data() + fresh(j); };
      auto value = [&](int64_t j) { return j < seg.pos ? kv.v(layer, kv.slot(j)) + g * hd : s.v.data() + fresh(j); };
      const std::size_t n = std::size_t(p - lo + 1);
      for (std::size_t j = 0; j < n; ++j) {
        const float* kj = key(lo + int64_t(j));
        for (std::size_t h = 0; h < group; ++h) w[h * s.scores_stride + j] = kernels::dot_f32(q + h * hd, kj, hd) * scale;
      }
      for (std::size_t h = 0; h < group; ++h) kernels::softmax(w + h * s.scores_stride, n);
      float* out = s.att.data() + i * c.q_dim() + g * group * hd;  // [group, head_dim]
      std::memset(out, 0, group * hd * sizeof(float));
      for (std::size_t j = 0; j < n; ++j) {
        const float* vj = value(lo + int64_t(j));
        for (std::size_t h = 0; h < group; ++h) kernels::axpy(w[h * s.scores_stride + j], vj, out + h * hd, hd);
      }
    }
  });
}

// x[m, n_embd] (the chunk's rows, described by `segs`) through block `layer` (index within the stage's
// caches). s.cos / s.sin hold each row's RoPE table, s.row_seg each row's segment. Appends every
// segment's keys and values to its sequence's ring.
// fast_quant: quantized weights take the fast path (int8 activations, see kernels/quant.hpp).
inline void block_forward(const Config& c, const llama::BlockTensors& w, std::span<const Segment> segs,
                          std::size_t layer, std::size_t m, float* x, Scratch& s, ThreadPool& pool,
                          bool fast_quant = false) {
  const std::size_t E = c.n_embd, hp = c.head_dim / 2;
  const kernels::QuantPath qp{fast_quant, s.xq.span()};

  // Attention: norm, project, rotate, attend, project back, residual.
  for (std::size_t i = 0; i < m; ++i) kernels::rmsnorm(x + i * E, w.attn_norm, c.rms_eps, E, s.xn.data() + i * E);
  kernels::matmul(pool, w.wq, s.xn.data(), m, s.q.data(), qp);
  kernels::matmul(pool, w.wk, s.xn.data(), m, s.k.data(), qp);
  kernels::matmul(pool, w.wv, s.xn.data(), m, s.v.data(), qp);
  for (std::size_t i = 0; i < m; ++i) {
    kernels::rope(s.q.data() + i * c.q_dim(), c.n_head, c.head_dim, s.cos.data() + i * hp, s.sin.data() + i * hp);
    kernels::rope(s.k.data() + i * c.kv_dim(), c.n_head_kv, c.head_dim, s.cos.data() + i * hp, s.sin.data() + i * hp);
  }
  attention(c, segs, layer, m, s, pool);
  for (const Segment& seg : segs)
    for (std::size_t i = 0; i < seg.n; ++i) {
      const std::size_t slot = seg.kv->slot(seg.pos + int64_t(i)), row = seg.row0 + i;
      std::memcpy(seg.kv->k(layer, slot), s.k.data() + row * c.kv_dim(), c.kv_dim() * sizeof(float));
      std::memcpy(seg.kv->v(layer, slot), s.v.data() + row * c.kv_dim(), c.kv_dim() * sizeof(float));
    }
  kernels::matmul(pool, w.wo, s.att.data(), m, s.proj.data(), qp);
  for (std::size_t i = 0; i < m; ++i) kernels::add_inplace(x + i * E, s.proj.data() + i * E, E);

  // MLP: norm, SwiGLU, project back, residual.
  for (std::size_t i = 0; i < m; ++i) kernels::rmsnorm(x + i * E, w.ffn_norm, c.rms_eps, E, s.xn.data() + i * E);
  kernels::matmul(pool, w.w_gate, s.xn.data(), m, s.gate.data(), qp);
  kernels::matmul(pool, w.w_up, s.xn.data(), m, s.up.data(), qp);
  kernels::swiglu(s.gate.data(), s.up.data(), m * c.n_ff);
  kernels::matmul(pool, w.w_down, s.gate.data(), m, s.proj.data(), qp);
  for (std::size_t i = 0; i < m; ++i) kernels::add_inplace(x + i * E, s.proj.data() + i * E, E);
}

}  // namespace pp
