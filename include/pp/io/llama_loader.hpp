// The only file that knows Llama's GGUF names: hyperparameters, tensor names and their shapes.
#pragma once

#include <pp/core/dtype.hpp>
#include <pp/core/error.hpp>
#include <pp/core/printable.hpp>
#include <pp/io/gguf.hpp>
#include <pp/model/config.hpp>
#include <pp/model/weights.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pp::llama {

// Bounds on hyperparameters: far above any released Llama, low enough that sizes cannot overflow.
inline constexpr uint64_t kMaxLayers = 1024;
inline constexpr uint64_t kMaxHeads = 1024;
inline constexpr uint64_t kMaxHeadDim = 1024;
inline constexpr uint64_t kMaxEmbd = 1u << 17;
inline constexpr uint64_t kMaxFf = 1u << 20;
inline constexpr uint64_t kMaxVocab = 1u << 24;
inline constexpr uint64_t kMaxCtx = 1u << 24;

inline std::string tensor_name(int layer, const char* what) {
  return "blk." + std::to_string(layer) + "." + what + ".weight";
}

namespace detail {
inline uint64_t bounded(const gguf::File& f, const std::string& key, uint64_t lo, uint64_t hi) {
  const uint64_t v = f.get_uint(key);
  if (v < lo || v > hi)
    throw ModelError("metadata '" + key + "' = " + std::to_string(v) + " is outside [" + std::to_string(lo) +
                     ", " + std::to_string(hi) + "]");
  return v;
}
}  // namespace detail

// Reads the hyperparameters as llama.cpp does and checks them for consistency (not the tensors).
inline Config read_config(const gguf::File& f) {
  if (!f.has("general.architecture")) throw ModelError("metadata 'general.architecture' is missing");
  const std::string arch(f.get_string("general.architecture"));
  if (arch != "llama")
    throw ModelError("general.architecture is '" + arch + "': only 'llama' models are supported");
  using detail::bounded;
  Config c;
  c.n_embd = bounded(f, "llama.embedding_length", 1, kMaxEmbd);
  c.n_layer = bounded(f, "llama.block_count", 1, kMaxLayers);
  c.n_ff = bounded(f, "llama.feed_forward_length", 1, kMaxFf);
  c.n_head = bounded(f, "llama.attention.head_count", 1, kMaxHeads);
  c.n_head_kv = f.has("llama.attention.head_count_kv") ? bounded(f, "llama.attention.head_count_kv", 1, kMaxHeads)
                                                        : c.n_head;
  if (c.n_head % c.n_head_kv != 0)
    throw ModelError("head_count " + std::to_string(c.n_head) + " is not a multiple of head_count_kv " +
                     std::to_string(c.n_head_kv));
  c.ctx_len = bounded(f, "llama.context_length", 1, kMaxCtx);
  if (!f.has("llama.attention.layer_norm_rms_epsilon"))
    throw ModelError("metadata 'llama.attention.layer_norm_rms_epsilon' is missing");
  c.rms_eps = float(f.get_float("llama.attention.layer_norm_rms_epsilon"));
  if (!(c.rms_eps > 0.f) || c.rms_eps > 1.f)
    throw ModelError("layer_norm_rms_epsilon " + std::to_string(c.rms_eps) + " is outside (0, 1]");
  c.rope_base = f.has("llama.rope.freq_base") ? float(f.get_float("llama.rope.freq_base")) : 10000.f;
  if (!(c.rope_base > 1.f) || c.rope_base > 1e12f)
    throw ModelError("rope.freq_base " + std::to_string(c.rope_base) + " is outside (1, 1e12]");
  if (f.has("llama.attention.key_length")) {
    c.head_dim = bounded(f, "llama.attention.key_length", 2, kMaxHeadDim);
  } else {
    if (c.n_embd % c.n_head != 0)
      throw ModelError("embedding_length " + std::to_string(c.n_embd) + " is not a multiple of head_count " +
                       std::to_string(c.n_head));
    c.head_dim = c.n_embd / c.n_head;
  }
  if (f.has("llama.attention.value_length") && f.get_uint("llama.attention.value_length") != c.head_dim)
    throw ModelError("attention.value_length " + std::to_string(f.get_uint("llama.attention.value_length")) +
                     " differs from key_length " + std::to_string(c.head_dim));
  if (c.head_dim % 2 != 0 || c.head_dim > kMaxHeadDim)
    throw ModelError("head dim " + std::to_string(c.head_dim) + " must be even and at most " +
                     std::to_string(kMaxHeadDim));
  if (f.has("llama.rope.dimension_count") && f.get_uint("llama.rope.dimension_count") != c.head_dim)
    throw ModelError("rope.dimension_count " + std::to_string(f.get_uint("llama.rope.dimension_count")) +
                     " differs from the head dim " + std::to_string(c.head_dim) +
                     " (partial rotary embeddings are not supported)");
  const gguf::TensorInfo* emb = f.tensor("token_embd.weight");
  if (!emb) throw ModelError("tensor 'token_embd.weight' is missing");
  if (emb->n_dims != 2 || emb->ne[1] < 1 || emb->ne[1] > kMaxVocab)
    throw ModelError("tensor 'token_embd.weight' must be 2-D [n_embd, n_vocab <= " + std::to_string(kMaxVocab) + "]");
  c.n_vocab = emb->ne[1];
  if (f.has("llama.vocab_size") && f.get_uint("llama.vocab_size") != c.n_vocab)
    throw ModelError("llama.vocab_size " + std::to_string(f.get_uint("llama.vocab_size")) +
                     " differs from token_embd's " + std::to_string(c.n_vocab) + " rows");
  return c;
}

// The weight types the kernels read; anything else is refused naming the tensor and its type.
inline DType kernel_dtype(const gguf::TensorInfo& t) {
  switch (t.type) {
    case gguf::TensorType::F32: return DType::F32;
    case gguf::TensorType::F16: return DType::F16;
    case gguf::TensorType::BF16: return DType::BF16;
    case gguf::TensorType::Q8_0: return DType::Q8_0;
    case gguf::TensorType::Q4_0: return DType::Q4_0;
    case gguf::TensorType::Q4_1: return DType::Q4_1;
    case gguf::TensorType::Q5_0: return DType::Q5_0;
    case gguf::TensorType::Q5_1: return DType::Q5_1;
    case gguf::TensorType::Q4_K: return DType::Q4_K;
    case gguf::TensorType::Q5_K: return DType::Q5_K;
    case gguf::TensorType::Q6_K: return DType::Q6_K;
    default:
      throw ModelError("tensor '" + printable(t.name) + "' has type " + gguf::type_name(t.type) +
                       ", which this build cannot run (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                       "Q4_K, Q5_K, Q6_K)");
  }
}

inline std::string shape_str(const gguf::TensorInfo& t) {
  std::string s = "[";
  for (uint32_t d = 0; d < t.n_dims; ++d) s += (d ? ", " : "") + std::to_string(t.ne[d]);
  return s + "]";
}

// A tensor that must exist with exactly the dims `ne` (ne[0] = row length).
inline const gguf::TensorInfo& require_tensor(const gguf::File& f, const std::string& name,
                                              std::initializer_list<uint64_t> ne) {
  const gguf::TensorInfo* t = f.tensor(name);
  if (!t) throw ModelError("tensor '" + printable(name) + "' is missing");
  bool ok = t->n_dims == ne.size();
  uint32_t d = 0;
  for (uint64_t v : ne) ok = ok && t->ne[d++] == v;
  if (!ok) {
    std::string want = "[";
    d = 0;
    for (uint64_t v : ne) want += (d++ ? ", " : "") + std::to_string(v);
    throw ModelError("tensor '" + printable(name) + "' has shape " + shape_str(*t) + ", expected " + want + "]");
  }
  return *t;
}

// A matrix [rows, cols] stored as ne = [cols, rows].
inline MatView matrix(const gguf::File& f, const std::string& name, std::size_t cols, std::size_t rows) {
  const gguf::TensorInfo& t = require_tensor(f, name, {cols, rows});
  const DType dt = kernel_dtype(t);
  return MatView{dt, t.data.data(), rows, cols, row_bytes(dt, cols)};
}

// A norm weight vector [n] as F32 (the only type llama.cpp writes for norms).
inline const float* norm_vector(const gguf::File& f, const std::string& name, std::size_t n) {
  const gguf::TensorInfo& t = require_tensor(f, name, {n});
  if (t.type != gguf::TensorType::F32)
    throw ModelError("tensor '" + printable(name) + "' has type " + gguf::type_name(t.type) + ", expected F32");
  return reinterpret_cast<const float*>(t.data.data());
}

inline BlockWeights block_tensors(const gguf::File& f, const Config& c, int l) {
  BlockWeights b;
  b.attn_norm = norm_vector(f, tensor_name(l, "attn_norm"), c.n_embd);
  b.wq = matrix(f, tensor_name(l, "attn_q"), c.n_embd, c.q_dim());
  b.wk = matrix(f, tensor_name(l, "attn_k"), c.n_embd, c.kv_dim());
  b.wv = matrix(f, tensor_name(l, "attn_v"), c.n_embd, c.kv_dim());
  b.wo = matrix(f, tensor_name(l, "attn_output"), c.q_dim(), c.n_embd);
  b.ffn_norm = norm_vector(f, tensor_name(l, "ffn_norm"), c.n_embd);
  b.w_gate = matrix(f, tensor_name(l, "ffn_gate"), c.n_embd, c.n_ff);
  b.w_up = matrix(f, tensor_name(l, "ffn_up"), c.n_embd, c.n_ff);
  b.w_down = matrix(f, tensor_name(l, "ffn_down"), c.n_ff, c.n_embd);
  return b;
}

// Names of every tensor block l reads (for residency accounting and prefetch).
inline std::vector<std::string> block_tensor_names(int l) {
  std::vector<std::string> v;
  for (const char* w : {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
                        "ffn_up", "ffn_down"})
    v.push_back(tensor_name(l, w));
  return v;
}

// The output projection: output.weight, or token_embd.weight when tied.
inline MatView output_matrix(const gguf::File& f, const Config& c) {
  if (f.tensor("output.weight")) return matrix(f, "output.weight", c.n_embd, c.n_vocab);
  return matrix(f, "token_embd.weight", c.n_embd, c.n_vocab);
}
inline const char* output_tensor_name(const gguf::File& f) {
  return f.tensor("output.weight") ? "output.weight" : "token_embd.weight";
}

// rope_freqs.weight ([head_dim / 2] F32 divisors of each pair's frequency), or all ones when absent.
inline std::vector<float> rope_freq_factors(const gguf::File& f, const Config& c) {
  std::vector<float> ff(c.head_dim / 2, 1.f);
  if (!f.tensor("rope_freqs.weight")) return ff;
  const float* p = norm_vector(f, "rope_freqs.weight", c.head_dim / 2);
  for (std::size_t i = 0; i < ff.size(); ++i) {
    if (!(p[i] > 0.f)) throw ModelError("rope_freqs.weight[" + std::to_string(i) + "] = " + std::to_string(p[i]) +
                                        " is not positive");
    ff[i] = p[i];
  }
  return ff;
}

}  // namespace pp::llama
