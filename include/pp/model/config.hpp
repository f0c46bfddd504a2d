// Hyperparameters of a Llama-architecture model, as read from the GGUF metadata.
#pragma once

#include <cstddef>

namespace pp {

struct Config {
  std::size_t n_vocab = 0;
  std::size_t n_embd = 0;     // residual width (hidden_dim)
  std::size_t n_layer = 0;    // decoder blocks
  std::size_t n_head = 0;     // query heads
  std::size_t n_head_kv = 0;  // key/value heads (grouped-query attention)
  std::size_t head_dim = 0;
  std::size_t n_ff = 0;       // SwiGLU inner width
  std::size_t ctx_len = 0;    // trained context length
  float rms_eps = 1e-5f;
  float rope_base = 10000.f;

  std::size_t q_dim() const { return n_head * head_dim; }
  std::size_t kv_dim() const { return n_head_kv * head_dim; }
};

}  // namespace pp
