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

namespace pp {

// att[m, n_head, head_dim] for the chunk's rows at positions pos..pos+m-1. Positions below pos come from
// the ring, the chunk's own from s.k / s.v (so a chunk never reads a slot it has itself overwritten).
// Keys are visited in position order, so the result does not depend on where the ring wrapped.
inline void attention(const Config& c, const KvCache& kv, std::size_t layer, int64_t pos, std::size_t m,
                      Scratch& s, ThreadPool& pool) {
  const std::size_t hd = c.head_dim, group = c.n_head / c.n_head_kv, kvd = c.kv_dim();
  const float scale = 1.0f / std::sqrt(float(hd));
  pool.parallel_for(m * c.n_head, [&](std::size_t b, std::size_t e, unsigned t) {
    float* w = s.scores.data() + std::size_t(t) * s.scores_stride;
    for (std::size_t task = b; task < e; ++task) {
      const std::size_t i = task / c.n_head, h = task % c.n_head, g = h / group;
      const int64_t p = pos + int64_t(i), lo = kv.window_lo(p);
      const float* q = s.q.data() + i * c.q_dim() + h * hd;
      auto key = [&](int64_t j) {
        return j < pos ? kv.k(layer, kv.slot(j)) + g * hd : s.k.data() + std::size_t(j - pos) * kvd + g * hd;
      };
      auto value = [&](int64_t j) {
        return j < pos ? kv.v(layer, kv.slot(j)) + g * hd : s.v.data() + std::size_t(j - pos) * kvd + g * hd;
      };
      const std::size_t n = std::size_t(p - lo + 1);
      for (std::size_t j = 0; j < n; ++j) w[j] = kernels::dot_f32(q, key(lo + int64_t(j)), hd) * scale;
      kernels::softmax(w, n);
      float* out = s.att.data() + i * c.q_dim() + h * hd;
      std::memset(out, 0, hd * sizeof(float));
      for (std::size_t j = 0; j < n; ++j) kernels::axpy(w[j], value(lo + int64_t(j)), out, hd);
    }
  });
}

// x[m, n_embd] (rows at positions pos..pos+m-1) through block `layer` (index within the stage's cache).
// s.cos / s.sin hold the chunk's RoPE tables. Appends the chunk's keys and values to the ring.
inline void block_forward(const Config& c, const llama::BlockTensors& w, KvCache& kv, std::size_t layer,
                          int64_t pos, std::size_t m, float* x, Scratch& s, ThreadPool& pool) {
  const std::size_t E = c.n_embd, hp = c.head_dim / 2;

  // Attention: norm, project, rotate, attend, project back, residual.
  for (std::size_t i = 0; i < m; ++i) kernels::rmsnorm(x + i * E, w.attn_norm, c.rms_eps, E, s.xn.data() + i * E);
  kernels::matmul(pool, w.wq, s.xn.data(), m, s.q.data());
  kernels::matmul(pool, w.wk, s.xn.data(), m, s.k.data());
  kernels::matmul(pool, w.wv, s.xn.data(), m, s.v.data());
  for (std::size_t i = 0; i < m; ++i) {
    kernels::rope(s.q.data() + i * c.q_dim(), c.n_head, c.head_dim, s.cos.data() + i * hp, s.sin.data() + i * hp);
    kernels::rope(s.k.data() + i * c.kv_dim(), c.n_head_kv, c.head_dim, s.cos.data() + i * hp, s.sin.data() + i * hp);
  }
  attention(c, kv, layer, pos, m, s, pool);
  for (std::size_t i = 0; i < m; ++i) {
    const std::size_t slot = kv.slot(pos + int64_t(i));
    std::memcpy(kv.k(layer, slot), s.k.data() + i * c.kv_dim(), c.kv_dim() * sizeof(float));
    std::memcpy(kv.v(layer, slot), s.v.data() + i * c.kv_dim(), c.kv_dim() * sizeof(float));
  }
  kernels::matmul(pool, w.wo, s.att.data(), m, s.proj.data());
  for (std::size_t i = 0; i < m; ++i) kernels::add_inplace(x + i * E, s.proj.data() + i * E, E);

  // MLP: norm, SwiGLU, project back, residual.
  for (std::size_t i = 0; i < m; ++i) kernels::rmsnorm(x + i * E, w.ffn_norm, c.rms_eps, E, s.xn.data() + i * E);
  kernels::matmul(pool, w.w_gate, s.xn.data(), m, s.gate.data());
  kernels::matmul(pool, w.w_up, s.xn.data(), m, s.up.data());
  kernels::swiglu(s.gate.data(), s.up.data(), m * c.n_ff);
  kernels::matmul(pool, w.w_down, s.gate.data(), m, s.proj.data());
  for (std::size_t i = 0; i < m; ++i) kernels::add_inplace(x + i * E, s.proj.data() + i * E, E);
}

}  // namespace pp
