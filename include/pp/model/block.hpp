// One Llama decoder block: RMSNorm, grouped-query attention with RoPE, residual, RMSNorm, SwiGLU, residual.
#pragma once

#include <pp/core/thread_pool.hpp>
#include <pp/io/llama_loader.hpp>
#include <pp/kernels/attention.hpp>
#include <pp/kernels/matmul.hpp>
#include <pp/kernels/ops.hpp>
#include <pp/model/config.hpp>
#include <pp/model/kv_cache.hpp>
#include <pp/model/scratch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>

namespace pp {

// A run of consecutive rows of one sequence within a chunk: rows [row0, row0 + n) sit at positions
// pos..pos+n-1 of the sequence whose cache is `kv`. A chunk holds one segment (a prefill or a decode
// step) or several (sequences decoding together, so each weight is read once for all of them).
// bulk: the segment is (part of) a request of kernels::kBulkRows rows or more (see kernels::matmul).
struct Segment {
  KvCache* kv;
  int64_t pos;
  std::size_t row0, n;
  bool bulk = false;
};

// y = x * w^T for the chunk's rows, each run of consecutive bulk or non-bulk segments in one call.
inline void matmul_segments(ThreadPool& pool, const MatView& w, std::span<const Segment> segs, const float* x,
                            float* y, kernels::QuantPath qp) {
  for (std::size_t a = 0, b; a < segs.size(); a = b) {
    for (b = a + 1; b < segs.size() && segs[b].bulk == segs[a].bulk;) ++b;
    const std::size_t r0 = segs[a].row0, r1 = segs[b - 1].row0 + segs[b - 1].n;
    kernels::matmul(pool, w, x + r0 * w.cols, r1 - r0, y + r0 * w.rows, qp, segs[a].bulk);
  }
}

// att[m, n_head, head_dim] for the chunk's rows. A row attends to its own sequence: positions below its
// segment's start come from that sequence's ring, the segment's own rows from s.kt / s.v (so a chunk
// never reads a slot it has itself overwritten). Values are summed in position order, so the result
// does not depend on where the ring wrapped or on the other rows of the chunk (kernels/attention.hpp).
// Expects s.kt to hold the chunk's keys transposed.
inline void attention(const Config& c, std::span<const Segment> segs, std::size_t layer, std::size_t m, Scratch& s,
                      ThreadPool& pool) {
  const std::size_t hd = c.head_dim, group = c.n_head / c.n_head_kv, kvd = c.kv_dim(), nkv = c.n_head_kv;
  const float scale = 1.0f / std::sqrt(float(hd));
  // One task per (row, KV head): the query heads sharing a KV head read each key and value once.
  // Rows are dealt out cheap and dear alternately (a causal row's cost grows with its position), so
  // the pool's contiguous split gives each thread a similar share.
  pool.parallel_for(m * nkv, [&](std::size_t b, std::size_t e, unsigned t) {
    float* w = s.scores.data() + std::size_t(t) * s.scores_stride * group;  // [group][scores_stride]
    for (std::size_t task = b; task < e; ++task) {
      const std::size_t r = task / nkv, g = task % nkv;
      const std::size_t i = r % 2 == 0 ? r / 2 : m - 1 - r / 2;
      const Segment& seg = segs[s.row_seg[i]];
      const KvCache& kv = *seg.kv;
      const int64_t p = seg.pos + int64_t(i - seg.row0), lo = kv.window_lo(p);
      const float* q = s.q.data() + i * c.q_dim() + g * group * hd;  // [group, head_dim]
      // Keys lo..p as up to three runs: the ring's (which may wrap once), then the chunk's own.
      struct Run { const float* kt; std::size_t ld; const float* v; std::size_t n; };
      Run runs[3];
      std::size_t n_runs = 0, n = 0;
      if (lo < seg.pos) {
        const std::size_t first = kv.slot(lo), count = std::size_t(seg.pos - lo);
        const std::size_t n1 = std::min(count, kv.capacity() - first);
        runs[n_runs++] = {kv.kt(layer, g) + first, kv.k_ld(), kv.v(layer, first) + g * hd, n1};
        if (n1 < count) runs[n_runs++] = {kv.kt(layer, g), kv.k_ld(), kv.v(layer, 0) + g * hd, count - n1};
      }
      const std::size_t own = seg.row0 + std::size_t(std::max<int64_t>(lo, seg.pos) - seg.pos);
      runs[n_runs++] = {s.kt.data() + g * hd * s.kt_ld + own, s.kt_ld, s.v.data() + own * kvd + g * hd,
                        std::size_t(p - std::max<int64_t>(lo, seg.pos) + 1)};
      for (std::size_t k = 0; k < n_runs; ++k) {
        kernels::attn_scores(q, group, hd, runs[k].kt, runs[k].ld, runs[k].n, scale, w + n, s.scores_stride);
        n += runs[k].n;
      }
      for (std::size_t h = 0; h < group; ++h) kernels::softmax(w + h * s.scores_stride, n);
      float* out = s.att.data() + i * c.q_dim() + g * group * hd;  // [group, head_dim]
      std::memset(out, 0, group * hd * sizeof(float));
      for (std::size_t k = 0, j = 0; k < n_runs; j += runs[k].n, ++k)
        kernels::attn_values(w + j, s.scores_stride, group, hd, runs[k].v, kvd, runs[k].n, out);
    }
  });
}

// x[m, n_embd] (the chunk's rows, described by `segs`) through block `layer` (index within the stage's
// caches). s.cos / s.sin hold each row's RoPE table, s.row_seg each row's segment. Appends every
// segment's keys and values to its sequence's ring.
// fast_quant: quantized weights take the fast path (int8 activations, see kernels/quant.hpp);
// fast_float: BF16 weights in prompts take the bf16-dot fast path (kernels/gemm.hpp).
inline void block_forward(const Config& c, const llama::BlockTensors& w, std::span<const Segment> segs,
                          std::size_t layer, std::size_t m, float* x, Scratch& s, ThreadPool& pool,
                          bool fast_quant = false, bool fast_float = false) {
  const std::size_t E = c.n_embd, hp = c.head_dim / 2;
  const kernels::QuantPath qp{fast_quant, s.xq.span(), fast_float};

  // Attention: norm, project, rotate, attend, project back, residual.
  // Row-wise steps run across the pool too (a prefill chunk's rows; one row runs inline).
  auto rows = [&](auto&& f) {
    pool.parallel_for(m, [&](std::size_t b, std::size_t e, unsigned) {
      for (std::size_t i = b; i < e; ++i) f(i);
    });
  };
  rows([&](std::size_t i) { kernels::rmsnorm(x + i * E, w.attn_norm, c.rms_eps, E, s.xn.data() + i * E); });
  matmul_segments(pool, w.wq, segs, s.xn.data(), s.q.data(), qp);
  matmul_segments(pool, w.wk, segs, s.xn.data(), s.k.data(), qp);
  matmul_segments(pool, w.wv, segs, s.xn.data(), s.v.data(), qp);
  rows([&](std::size_t i) {
    kernels::rope(s.q.data() + i * c.q_dim(), c.n_head, c.head_dim, s.cos.data() + i * hp, s.sin.data() + i * hp);
    kernels::rope(s.k.data() + i * c.kv_dim(), c.n_head_kv, c.head_dim, s.cos.data() + i * hp, s.sin.data() + i * hp);
  });
  // The chunk's keys transposed for attention; after it, every segment's keys and values into its
  // ring. Keys are split across the pool by element (transposed writes then run along positions); a
  // few rows (a decode step) are cheaper to store inline than to hand to the pool.
  const std::size_t kvd = c.kv_dim();
  constexpr std::size_t kInlineRows = 16;
  auto by_element = [&](auto&& f) {
    if (m < kInlineRows) return f(std::size_t(0), kvd, 0u);
    pool.parallel_for(kvd, f);
  };
  by_element([&](std::size_t e0, std::size_t e1, unsigned) {
    for (std::size_t e = e0; e < e1; ++e)
      for (std::size_t i = 0; i < m; ++i) s.kt[e * s.kt_ld + i] = s.k[i * kvd + e];
  });
  attention(c, segs, layer, m, s, pool);
  by_element([&](std::size_t e0, std::size_t e1, unsigned) {
    for (const Segment& seg : segs)
      for (std::size_t e = e0; e < e1; ++e)
        for (std::size_t i = 0; i < seg.n; ++i)
          seg.kv->k_at(layer, seg.kv->slot(seg.pos + int64_t(i)), e) = s.k[(seg.row0 + i) * kvd + e];
  });
  rows([&](std::size_t i) {
    const Segment& seg = segs[s.row_seg[i]];
    std::memcpy(seg.kv->v(layer, seg.kv->slot(seg.pos + int64_t(i - seg.row0))), s.v.data() + i * kvd, kvd * sizeof(float));
  });
  matmul_segments(pool, w.wo, segs, s.att.data(), s.proj.data(), qp);
  rows([&](std::size_t i) {
    kernels::add_inplace(x + i * E, s.proj.data() + i * E, E);
    kernels::rmsnorm(x + i * E, w.ffn_norm, c.rms_eps, E, s.xn.data() + i * E);
  });

  // MLP: norm, SwiGLU, project back, residual.
  matmul_segments(pool, w.w_gate, segs, s.xn.data(), s.gate.data(), qp);
  matmul_segments(pool, w.w_up, segs, s.xn.data(), s.up.data(), qp);
  rows([&](std::size_t i) { kernels::swiglu(s.gate.data() + i * c.n_ff, s.up.data() + i * c.n_ff, c.n_ff); });
  matmul_segments(pool, w.w_down, segs, s.gate.data(), s.proj.data(), qp);
  rows([&](std::size_t i) { kernels::add_inplace(x + i * E, s.proj.data() + i * E, E); });
}

}  // namespace pp
