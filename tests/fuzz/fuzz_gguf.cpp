// libFuzzer target: bytes -> GGUF parser -> Llama config, every tensor view a stage takes, tokenizer.
//
// What a stage does with an untrusted file (pp::Stage::init, Tokenizer::from_gguf), minus the mmap.
// Only pp::Error may escape a step; anything else (another exception, an ASan/UBSan report, a view
// that reaches past the bytes, an allocation libFuzzer finds too large) is a finding.
#include "fuzz_common.hpp"

#include <pp/core/error.hpp>
#include <pp/io/gguf.hpp>
#include <pp/io/llama_loader.hpp>
#include <pp/text/tokenizer.hpp>

#include <cstdint>
#include <iostream>
#include <span>
#include <string>

namespace {

using pp::fuzz::fail;
using pp::fuzz::touch;

// A matrix view must lie inside its tensor's bytes, which lie inside the file.
void check_matrix(const pp::gguf::File& f, const pp::MatView& m, const char* name) {
  const pp::gguf::TensorInfo* t = f.tensor(name);
  if (!t) fail("matrix view without a tensor", name);
  if (m.rows * m.row_stride != t->n_bytes) fail("matrix view size differs from the tensor's bytes", name);
  touch(m.data, m.rows * m.row_stride);
}

// The lookups of Stage::init for a stage owning every block (first and last at once).
void load_model(const pp::gguf::File& f) {
  namespace llama = pp::llama;
  const pp::Config c = llama::read_config(f);
  if (c.n_layer < 1 || c.n_layer > llama::kMaxLayers || c.head_dim % 2 != 0 || c.n_head % c.n_head_kv != 0)
    fail("read_config accepted an inconsistent config");
  const std::vector<float> freqs = llama::rope_freq_factors(f, c);
  if (freqs.size() != c.head_dim / 2) fail("rope_freq_factors has the wrong length");
  for (std::size_t l = 0; l < c.n_layer; ++l) {
    const pp::BlockWeights b = llama::block_tensors(f, c, int(l));
    touch(b.attn_norm, c.n_embd * sizeof(float));
    touch(b.ffn_norm, c.n_embd * sizeof(float));
    const auto name = [&](const char* w) { return llama::tensor_name(int(l), w); };
    check_matrix(f, b.wq, name("attn_q").c_str());
    check_matrix(f, b.wk, name("attn_k").c_str());
    check_matrix(f, b.wv, name("attn_v").c_str());
    check_matrix(f, b.wo, name("attn_output").c_str());
    check_matrix(f, b.w_gate, name("ffn_gate").c_str());
    check_matrix(f, b.w_up, name("ffn_up").c_str());
    check_matrix(f, b.w_down, name("ffn_down").c_str());
  }
  check_matrix(f, llama::matrix(f, "token_embd.weight", c.n_embd, c.n_vocab), "token_embd.weight");
  touch(llama::norm_vector(f, "output_norm.weight", c.n_embd), c.n_embd * sizeof(float));
  check_matrix(f, llama::output_matrix(f, c), llama::output_tensor_name(f));
}

// The tokenizer a worker builds from the same metadata, and one encode/decode through it.
void load_tokenizer(const pp::gguf::File& f) {
  const pp::Tokenizer tok = pp::Tokenizer::from_gguf(f);
  const std::vector<int32_t> ids = tok.encode("Hello, world! <|eot_id|> 123 \xC3\xA9", false, true);
  for (int32_t id : ids)
    if (id < 0 || id >= tok.vocab_size()) fail("encode returned an id outside the vocabulary");
  (void)tok.decode(ids, true);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Tokenizer::from_gguf warns on std::cerr when tokenizer.ggml.pre is missing: drop those lines
  // (libFuzzer and the sanitizers write to fd 2 directly, so their reports still show).
  std::cerr.rdbuf(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  pp::gguf::File f;
  try {
    f = pp::gguf::parse(bytes);
  } catch (const pp::Error&) {
    return 0;
  }
  for (const pp::gguf::TensorInfo& t : f.tensors) {
    if (t.data.size() != t.n_bytes) fail("tensor view size differs from n_bytes", t.name);
    if (t.data.data() < data || t.data.data() + t.data.size() > data + size) fail("tensor view outside the input", t.name);
  }
  try {
    load_model(f);
  } catch (const pp::Error&) {
  }
  try {
    load_tokenizer(f);
  } catch (const pp::Error&) {
  }
  return 0;
}
