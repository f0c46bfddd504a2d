// The weights of one decoder block as the model layer sees them: views, filled by the loader
// (io/llama_loader.hpp, the only place that knows the GGUF names), repointed when a stage copies them.
#pragma once

#include <pp/core/dtype.hpp>

namespace pp {

struct BlockWeights {
  const float* attn_norm;  // [n_embd]
  MatView wq;              // [q_dim, n_embd]
  MatView wk;              // [kv_dim, n_embd]
  MatView wv;              // [kv_dim, n_embd]
  MatView wo;              // [n_embd, q_dim]
  const float* ffn_norm;   // [n_embd]
  MatView w_gate;          // [n_ff, n_embd]
  MatView w_up;            // [n_ff, n_embd]
  MatView w_down;          // [n_embd, n_ff]
};

}  // namespace pp
