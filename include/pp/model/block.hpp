// One Llama decoder block: RMSNorm, grouped-query attention with RoPE, residual, RMSNorm, SwiGLU, residual.
#pragma once

#include <pp/core/thread_pool.hpp>
#include <pp/kernels/attention.hpp>
#include <pp/kernels/matmul.hpp>
#include <pp/kernels/ops.hpp>
#include <pp/model/config.hpp>
#include <pp/model/kv_cache.hpp>
#include <pp/model/scratch.hpp>
#include <pp/model/weights.hpp>

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

// y = x * w^T for the chunk's rows: one call when every segment takes the same path; else each run of
// consecutive bulk or non-bulk segments on its path, in one pass over the weights (kernels::matmul_groups:
// a decode step with a prompt's piece in it streams the weights once, not twice).
inline void matmul_segments(ThreadPool& pool, const MatView& w, std::span<const Segment> segs, const float* x,
                            float* y, kernels::QuantPath qp) {
  static thread_local std::vector<kernels::RowGroup> groups;  // the caller's, reused
  groups.clear();
  for (std::size_t a = 0, b; a < segs.size(); a = b) {
    for (b = a + 1; b < segs.size() && segs[b].bulk == segs[a].bulk;) ++b;
    const std::size_t r0 = segs[a].row0, r1 = segs[b - 1].row0 + segs[b - 1].n;
    groups.push_back(kernels::RowGroup{r0, r1 - r0, segs[a].bulk});
  }
  if (groups.size() == 1) {
    const kernels::RowGroup& g = groups.front();
    return kernels::matmul(pool, w, x + g.row0 * w.cols, g.n, y + g.row0 * w.rows, qp, g.bulk);
  }
  kernels::matmul_groups(pool, w, x, y, qp, groups);
}

// The steps of one decoder block over a chunk of rows (one or several segments, see Segment), each
// reading and writing the scratch buffers named in its comment. Row-wise steps run across the pool
// (a prefill chunk's rows; a single row runs inline); the matrix products go through matmul_segments.
class BlockStep {
 public:
  // fast_quant: quantized weights take the fast path (int8 activations, see kernels/quant.hpp);
  // fast_float: BF16 weights take the bf16-dot fast path (kernels/gemm.hpp's tiles for prompts,
  // kernels/matmul.hpp's dot tiles for decode steps).
  BlockStep(const Config& cfg, std::span<const Segment> segs, std::size_t n_rows, Scratch& scratch, ThreadPool& pool,
            bool fast_quant, bool fast_float)
      : cfg_(cfg), segs_(segs), n_rows_(n_rows), buf_(scratch), pool_(pool), path_{fast_quant, scratch.xq.span(), fast_float} {}

  // xn = rmsnorm(x) * weight, row by row.
  void rmsnorm(const float* x, const float* weight) const {
    const std::size_t E = cfg_.n_embd;
    for_each_row([&](std::size_t i) { kernels::rmsnorm(x + i * E, weight, cfg_.rms_eps, E, buf_.xn.data() + i * E); });
  }

  // x += proj, row by row: the residual connection after attention and after the MLP.
  void add_residual(float* x) const {
    const std::size_t E = cfg_.n_embd;
    for_each_row([&](std::size_t i) { kernels::add_inplace(x + i * E, buf_.proj.data() + i * E, E); });
  }

  // proj = wo * attention(rope(wq * xn), rope(wk * xn), wv * xn) for block `layer`, each row attending to
  // its own sequence; every segment's keys and values are appended to its ring.
  void self_attention(const BlockWeights& w, std::size_t layer) const {
    matmul(w.wq, buf_.xn.data(), buf_.q.data());
    matmul(w.wk, buf_.xn.data(), buf_.k.data());
    matmul(w.wv, buf_.xn.data(), buf_.v.data());
    rotate_queries_and_keys();
    transpose_chunk_keys();
    attend(layer);
    append_to_caches(layer);
    matmul(w.wo, buf_.att.data(), buf_.proj.data());
  }

  // proj = w_down * (silu(w_gate * xn) * (w_up * xn)), the SwiGLU MLP.
  void mlp(const BlockWeights& w) const {
    matmul(w.w_gate, buf_.xn.data(), buf_.gate.data());
    matmul(w.w_up, buf_.xn.data(), buf_.up.data());
    const std::size_t F = cfg_.n_ff;
    for_each_row([&](std::size_t i) { kernels::swiglu(buf_.gate.data() + i * F, buf_.up.data() + i * F, F); });
    matmul(w.w_down, buf_.gate.data(), buf_.proj.data());
  }

 private:
  template <class F>
  void for_each_row(F&& f) const {
    pool_.parallel_for(n_rows_, [&](std::size_t b, std::size_t e, unsigned) {
      for (std::size_t i = b; i < e; ++i) f(i);
    });
  }

  void matmul(const MatView& w, const float* in, float* out) const { matmul_segments(pool_, w, segs_, in, out, path_); }

  // q and k rotated in place by each row's RoPE table (cos / sin, filled by the stage per position).
  void rotate_queries_and_keys() const {
    const std::size_t half = cfg_.head_dim / 2;
    for_each_row([&](std::size_t i) {
      const float* cos = buf_.cos.data() + i * half;
      const float* sin = buf_.sin.data() + i * half;
      kernels::rope(buf_.q.data() + i * cfg_.q_dim(), cfg_.n_head, cfg_.head_dim, cos, sin);
      kernels::rope(buf_.k.data() + i * cfg_.kv_dim(), cfg_.n_head_kv, cfg_.head_dim, cos, sin);
    });
  }

  // Work split by key element, so that transposed writes run along positions; a few rows (a decode
  // step) are cheaper to do inline than to hand to the pool.
  template <class F>
  void for_each_key_element(F&& f) const {
    constexpr std::size_t kInlineRows = 16;
    if (n_rows_ < kInlineRows) return f(std::size_t(0), cfg_.kv_dim(), 0u);
    pool_.parallel_for(cfg_.kv_dim(), f);
  }

  // kt = the chunk's keys transposed ([kv_dim][kt_ld]), as attention reads a chunk's own keys.
  void transpose_chunk_keys() const {
    const std::size_t kvd = cfg_.kv_dim();
    for_each_key_element([&](std::size_t e0, std::size_t e1, unsigned) {
      for (std::size_t e = e0; e < e1; ++e)
        for (std::size_t i = 0; i < n_rows_; ++i) buf_.kt[e * buf_.kt_ld + i] = buf_.k[i * kvd + e];
    });
  }

  // After attention (a chunk never reads a slot it has itself overwritten): each segment's k and v
  // into its sequence's ring.
  void append_to_caches(std::size_t layer) const {
    const std::size_t kvd = cfg_.kv_dim();
    for_each_key_element([&](std::size_t e0, std::size_t e1, unsigned) {
      for (const Segment& seg : segs_) seg.kv->store_keys(layer, seg.pos, seg.n, buf_.k.data() + seg.row0 * kvd, e0, e1);
    });
    for_each_row([&](std::size_t i) {
      const Segment& seg = segs_[buf_.row_seg[i]];
      seg.kv->store_value(layer, seg.pos + int64_t(i - seg.row0), buf_.v.data() + i * kvd);
    });
  }

  // att = softmax(q k^T / sqrt(head_dim)) v for every row and query head. A row at position p attends to
  // its sequence's positions [window_lo(p), p]: those below its segment's start from the ring, the
  // segment's own from kt / v of this chunk. Values are summed in position order, so the result does
  // not depend on where the ring wrapped or on the other rows of the chunk (kernels/attention.hpp).
  void attend(std::size_t layer) const {
    const std::size_t n_kv_heads = cfg_.n_head_kv;
    // One task per (row, KV head): the query heads sharing a KV head read each key and value once.
    // Rows are dealt out cheap and dear alternately (a causal row's cost grows with its position), so
    // the pool's contiguous split gives each thread a similar share.
    pool_.parallel_for(n_rows_ * n_kv_heads, [&](std::size_t b, std::size_t e, unsigned thread) {
      for (std::size_t task = b; task < e; ++task) {
        const std::size_t r = task / n_kv_heads, kv_head = task % n_kv_heads;
        attend_row(layer, r % 2 == 0 ? r / 2 : n_rows_ - 1 - r / 2, kv_head, thread);
      }
    });
  }

  // Row `row`, the query heads of KV head `kv_head`, with thread `thread`'s score buffer.
  void attend_row(std::size_t layer, std::size_t row, std::size_t kv_head, unsigned thread) const {
    const std::size_t hd = cfg_.head_dim, group = cfg_.n_head / cfg_.n_head_kv, kvd = cfg_.kv_dim();
    const float scale = 1.0f / std::sqrt(float(hd));
    const Segment& seg = segs_[buf_.row_seg[row]];
    const int64_t pos = seg.pos + int64_t(row - seg.row0), lo = seg.kv->window_lo(pos);
    // Keys lo..pos as up to three runs: the ring's (which may wrap once), then the chunk's own.
    KeyRun runs[3];
    std::size_t n_runs = seg.kv->runs(layer, kv_head, lo, seg.pos, runs);
    const int64_t own_lo = std::max(lo, seg.pos);
    const std::size_t own = seg.row0 + std::size_t(own_lo - seg.pos);
    runs[n_runs++] = {buf_.kt.data() + kv_head * hd * buf_.kt_ld + own, buf_.kt_ld, buf_.v.data() + own * kvd + kv_head * hd,
                      std::size_t(pos - own_lo + 1)};

    float* scores = buf_.scores.data() + std::size_t(thread) * buf_.scores_stride * group;  // [group][scores_stride]
    const float* q = buf_.q.data() + row * cfg_.q_dim() + kv_head * group * hd;            // [group, head_dim]
    std::size_t n_keys = 0;
    for (std::size_t k = 0; k < n_runs; n_keys += runs[k].n, ++k)
      kernels::attn_scores(q, group, hd, runs[k].kt, runs[k].ld, runs[k].n, scale, scores + n_keys, buf_.scores_stride);
    for (std::size_t h = 0; h < group; ++h) kernels::softmax(scores + h * buf_.scores_stride, n_keys);
    float* out = buf_.att.data() + row * cfg_.q_dim() + kv_head * group * hd;  // [group, head_dim]
    std::fill(out, out + group * hd, 0.f);
    for (std::size_t k = 0, j = 0; k < n_runs; j += runs[k].n, ++k)
      kernels::attn_values(scores + j, buf_.scores_stride, group, hd, runs[k].v, kvd, runs[k].n, out);
  }

  const Config& cfg_;
  std::span<const Segment> segs_;
  std::size_t n_rows_;
  Scratch& buf_;
  ThreadPool& pool_;
  kernels::QuantPath path_;
};

// x[n_rows, n_embd] (the chunk's rows, described by `segs`) through block `layer` (its index within the
// stage's caches), as the paper writes it:
//   x = x + attention(rmsnorm(x)),   x = x + mlp(rmsnorm(x)).
// scratch.cos / scratch.sin hold each row's RoPE table, scratch.row_seg each row's segment. Appends every
// segment's keys and values to its sequence's ring.
inline void block_forward(const Config& cfg, const BlockWeights& w, std::span<const Segment> segs, std::size_t layer,
                          std::size_t n_rows, float* x, Scratch& scratch, ThreadPool& pool, bool fast_quant = false,
                          bool fast_float = false) {
  const BlockStep step(cfg, segs, n_rows, scratch, pool, fast_quant, fast_float);
  step.rmsnorm(x, w.attn_norm);
  step.self_attention(w, layer);
  step.add_residual(x);
  step.rmsnorm(x, w.ffn_norm);
  step.mlp(w);
  step.add_residual(x);
}

}  // namespace pp
