// A stage's activation buffers for a chunk of up to `max_rows` rows, reserved once and backed as used
// (a stage that only ever sees short requests holds only their rows).
#pragma once

#include <pp/core/anonymous_region.hpp>
#include <pp/kernels/attention.hpp>
#include <pp/kernels/matmul.hpp>
#include <pp/model/config.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace pp {

struct Scratch {
  Scratch() = default;
  Scratch(const Config& c, std::size_t max_rows, std::size_t kv_capacity, unsigned n_threads)
      : max_rows(max_rows), xn(max_rows * c.n_embd), q(max_rows * c.q_dim()), k(max_rows * c.kv_dim()),
        v(max_rows * c.kv_dim()), kt_ld((max_rows + 15) / 16 * 16), kt(c.kv_dim() * kt_ld + kernels::kAttnPad), att(max_rows * c.q_dim()), proj(max_rows * c.n_embd),
        gate(max_rows * c.n_ff), up(max_rows * c.n_ff), cos(max_rows * c.head_dim / 2),
        sin(max_rows * c.head_dim / 2), row_seg(max_rows), scores_stride((kv_capacity + 15) / 16 * 16 + kernels::kAttnPad),
        scores(std::size_t(n_threads) * scores_stride * (c.n_head / c.n_head_kv)),
        xq(max_rows * kernels::xq_row_bytes(std::max({c.n_embd, c.q_dim(), c.n_ff}))) {}

  std::size_t max_rows = 0;
  LazyArray<float> xn;        // [rows, n_embd] normed input
  LazyArray<float> q;         // [rows, n_head, head_dim]
  LazyArray<float> k, v;      // [rows, n_head_kv, head_dim] this chunk's new keys / values
  std::size_t kt_ld = 0;
  LazyArray<float> kt;        // [n_head_kv, head_dim, kt_ld] + pad: the new keys transposed
  LazyArray<float> att;       // [rows, n_head, head_dim] attention output
  LazyArray<float> proj;      // [rows, n_embd] projection back to the residual
  LazyArray<float> gate, up;  // [rows, n_ff]
  LazyArray<float> cos, sin;  // [rows, head_dim / 2] RoPE tables of the chunk's positions
  LazyArray<uint32_t> row_seg;  // [rows] index of each row's segment in the chunk
  std::size_t scores_stride = 0;
  LazyArray<float> scores;    // [n_threads, group, scores_stride] attention weights of each thread's query heads
  LazyArray<uint8_t> xq;      // [rows, xq_row_bytes] a matmul's input as int8 blocks or bf16 (fast paths)
};

}  // namespace pp
