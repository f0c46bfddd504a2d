// Synthetic Llama-3.2-layout GGUF models with deterministic random weights, written as a stream.
//
// Weights follow the recipe of ../shared/fixtures/REFCHECK-FIXTURES.txt so logits are not degenerate:
// normal draws (one generator per tensor, seeded from the model seed and the tensor name) scaled per
// matrix kind and rounded to the bfloat16 grid, so F32/F16/BF16 files hold the same values; quantized
// files hold those values quantized (io/quantize.hpp), in llama-quantize's per-tensor type mixes.
#pragma once

#include <pp/core/error.hpp>
#include <pp/core/float16.hpp>
#include <pp/io/gguf.hpp>
#include <pp/io/gguf_writer.hpp>
#include <pp/io/mmap.hpp>
#include <pp/io/quantize.hpp>
#include <pp/text/sampler.hpp>

#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pp::synth {

struct Spec {
  std::size_t n_vocab = 512, n_embd = 64, n_layer = 4, n_head = 4, n_head_kv = 2, n_ff = 192, ctx = 2048;
  float rope_base = 500000.f, rms_eps = 1e-5f;
  gguf::TensorType dtype = gguf::TensorType::BF16;  // every matrix, except as below
  // llama-quantize's exceptions (set by file_type): token_embd, which is also the tied output, and the
  // attn_v / ffn_down of the layers its use_more_bits rule picks (the "_M" K-quant mixes).
  std::optional<gguf::TensorType> embd_dtype, more_bits_dtype;
  uint64_t seed = 1;
  std::string vocab_from;  // copy tokenizer.* metadata (and the vocabulary size) from this GGUF
  std::string name = "pp-synth";
};

// Sets the weight types the way llama-quantize writes file type `name`: f32, f16, bf16; q8_0 (every matrix,
// token_embd included, as Ollama's llama3.2:1b); q6_k; q4_0, q4_1, q5_0, q5_1 (token_embd, the tied output,
// in Q6_K); q4_k_m, q5_k_m (also Q6_K for attn_v / ffn_down of the use_more_bits layers).
inline void set_file_type(Spec& s, std::string_view name) {
  using T = gguf::TensorType;
  struct Row {
    std::string_view name;
    T dtype;
    std::optional<T> embd, more_bits;
  };
  static const Row rows[] = {{"f32", T::F32, {}, {}},          {"f16", T::F16, {}, {}},
                             {"bf16", T::BF16, {}, {}},        {"q8_0", T::Q8_0, {}, {}},
                             {"q6_k", T::Q6_K, {}, {}},        {"q4_0", T::Q4_0, T::Q6_K, {}},
                             {"q4_1", T::Q4_1, T::Q6_K, {}},   {"q5_0", T::Q5_0, T::Q6_K, {}},
                             {"q5_1", T::Q5_1, T::Q6_K, {}},   {"q4_k_m", T::Q4_K, T::Q6_K, T::Q6_K},
                             {"q5_k_m", T::Q5_K, T::Q6_K, T::Q6_K}};
  for (const Row& r : rows)
    if (r.name == name) {
      s.dtype = r.dtype, s.embd_dtype = r.embd, s.more_bits_dtype = r.more_bits;
      return;
    }
  throw Error("synth: file type '" + std::string(name) +
              "' is not one of f32, f16, bf16, q8_0, q6_k, q4_0, q4_1, q5_0, q5_1, q4_k_m, q5_k_m");
}

// llama-quantize's choice of layers that get more bits in the "_M" mixes (layer i of n).
inline bool use_more_bits(std::size_t i, std::size_t n) {
  return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;  // i >= n / 8 in the last test
}

// A matrix's type for rows of `cols` elements. Like llama-quantize, a K-quant falls back when the row is not
// a multiple of 256: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0.
inline gguf::TensorType fit_row(gguf::TensorType t, std::size_t cols) {
  using T = gguf::TensorType;
  if (cols % 256 != 0) {
    if (t == T::Q4_K) t = T::Q5_0;
    if (t == T::Q5_K) t = T::Q5_1;
    if (t == T::Q6_K) t = T::Q8_0;
  }
  if (cols % gguf::type_traits(t).block_elems != 0)
    throw Error("synth: rows of " + std::to_string(cols) + " elements do not fit " + gguf::type_name(t) + " blocks");
  return t;
}

// The kernel type of a quantized tensor type synth writes.
inline DType quant_dtype(gguf::TensorType t) {
  using T = gguf::TensorType;
  switch (t) {
    case T::Q8_0: return DType::Q8_0;
    case T::Q4_0: return DType::Q4_0;
    case T::Q4_1: return DType::Q4_1;
    case T::Q5_0: return DType::Q5_0;
    case T::Q5_1: return DType::Q5_1;
    case T::Q4_K: return DType::Q4_K;
    case T::Q5_K: return DType::Q5_K;
    case T::Q6_K: return DType::Q6_K;
    default: throw Error(std::string("synth: cannot write tensor type ") + gguf::type_name(t));
  }
}

// Exactly Llama-3.2-1B's shapes.
inline Spec llama32_1b() {
  Spec s;
  s.n_vocab = 128256, s.n_embd = 2048, s.n_layer = 16, s.n_head = 32, s.n_head_kv = 8, s.n_ff = 8192;
  s.ctx = 131072;
  s.name = "pp-synth-llama3.2-1b";
  return s;
}

// Llama-3.1/3.2 rope scaling (factor 32, low 1, high 4, original context 8192) as rope_freqs divisors.
inline std::vector<float> llama3_rope_freqs(std::size_t head_dim, float base) {
  std::vector<float> f(head_dim / 2);
  for (std::size_t i = 0; i < f.size(); ++i) {
    const float freq = 1.f / std::pow(base, float(2 * i) / float(head_dim));
    const float wavelen = 2.f * float(M_PI) / freq;
    if (wavelen < 8192.f / 4.f) f[i] = 1.f;
    else if (wavelen > 8192.f / 1.f) f[i] = 32.f;
    else {
      const float s = (8192.f / wavelen - 1.f) / (4.f - 1.f);
      f[i] = 1.f / ((1.f - s) / 32.f + s);
    }
  }
  return f;
}

// Approximately normal N(0, 1) draws (Irwin-Hall of four 16-bit uniforms): cheap enough for 1B weights.
class Normal {
 public:
  explicit Normal(uint64_t seed) : s_(seed) {}
  float operator()() {
    const uint64_t r = splitmix64(s_++);
    const double sum = double(r & 0xffff) + double((r >> 16) & 0xffff) + double((r >> 32) & 0xffff) + double(r >> 48);
    return float((sum / 65535.0 - 2.0) * 1.7320508075688772);  // var of the sum of 4 U(0,1) is 1/3
  }

 private:
  uint64_t s_;
};

inline uint64_t name_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return splitmix64(seed ^ h);
}

struct TensorPlan {
  std::string name;
  std::vector<uint64_t> ne;  // ne[0] = row length
  gguf::TensorType type;
  enum Kind { Matrix, Norm, OutNorm, RopeFreqs } kind;
  float scale = 1.f;
  uint64_t n_bytes = 0;
};

namespace detail {
inline void add_byte_level_tokenizer(gguf::Writer& w, std::size_t n_vocab, std::size_t& n_kv) {
  // GPT-2 byte-to-unicode: printable bytes map to themselves, the rest to U+0100 upwards.
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    const uint32_t cp = printable ? uint32_t(b) : uint32_t(256 + extra++);
    std::string s;
    if (cp < 0x80) s += char(cp);
    else {
      s += char(0xC0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3f));
    }
    tokens.push_back(s);
    types.push_back(1);
  }
  // Control tokens in the last 16 ids (or right after the bytes), in Llama-3 naming.
  const std::size_t base = n_vocab >= 128256 ? 128000 : n_vocab - 16;
  const char* named[] = {"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eom_id|>", "<|eot_id|>"};
  for (std::size_t id = 256; id < n_vocab; ++id) {
    const std::size_t k = id - base;
    if (id >= base && k < 6) tokens.push_back(named[k]);
    else tokens.push_back("<|reserved_special_token_" + std::to_string(id) + "|>");
    types.push_back(3);
  }
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "llama-bpe");
  w.add_strings("tokenizer.ggml.tokens", tokens);
  w.add_array("tokenizer.ggml.token_type", gguf::ValueType::I32, types);
  w.add_strings("tokenizer.ggml.merges", {});
  w.add_u32("tokenizer.ggml.bos_token_id", uint32_t(base));
  w.add_u32("tokenizer.ggml.eos_token_id", uint32_t(base + 5));
  w.add_u32("tokenizer.ggml.eot_token_id", uint32_t(base + 5));
  w.add_u32("tokenizer.ggml.eom_token_id", uint32_t(base + 4));
  w.add_bool("tokenizer.ggml.add_bos_token", true);
  n_kv += 10;
}

// Copies every tokenizer.* entry of `src` as raw bytes; returns the vocabulary size.
inline std::size_t copy_tokenizer(gguf::Writer& w, const gguf::File& src, std::size_t& n_kv) {
  auto& m = w.raw_meta();
  for (const auto& [key, v] : src.kv) {
    if (key.rfind("tokenizer.", 0) != 0) continue;
    gguf::Writer::put_string(m, key);
    gguf::Writer::put(m, uint32_t(v.type));
    if (v.type == gguf::ValueType::STRING) gguf::Writer::put_string(m, v.str);
    else if (v.type == gguf::ValueType::ARRAY) {
      gguf::Writer::put(m, uint32_t(v.elem));
      gguf::Writer::put(m, uint64_t(v.count));
      if (v.elem == gguf::ValueType::STRING)
        for (auto s : v.strings) gguf::Writer::put_string(m, s);
      else m.insert(m.end(), v.raw.begin(), v.raw.end());
    } else {
      const std::size_t sz = gguf::scalar_size(v.type);
      if (v.type == gguf::ValueType::F32) gguf::Writer::put(m, float(v.f));
      else if (v.type == gguf::ValueType::F64) gguf::Writer::put(m, v.f);
      else if (v.type == gguf::ValueType::I8 || v.type == gguf::ValueType::I16 || v.type == gguf::ValueType::I32 ||
               v.type == gguf::ValueType::I64) {
        const int64_t x = v.i;
        m.insert(m.end(), reinterpret_cast<const uint8_t*>(&x), reinterpret_cast<const uint8_t*>(&x) + sz);
      } else {
        const uint64_t x = v.u;
        m.insert(m.end(), reinterpret_cast<const uint8_t*>(&x), reinterpret_cast<const uint8_t*>(&x) + sz);
      }
    }
    w.count_raw_kv();
    ++n_kv;
  }
  const gguf::Value* toks = src.find("tokenizer.ggml.tokens");
  if (!toks) throw Error("vocabulary source has no tokenizer.ggml.tokens");
  return toks->count;
}
}  // namespace detail

// Writes the model to `path` (via a temporary file renamed into place). Returns the file size.
inline uint64_t write(Spec spec, const std::string& path) {
  if (spec.n_head % spec.n_head_kv != 0 || spec.n_embd % spec.n_head != 0 || (spec.n_embd / spec.n_head) % 2)
    throw Error("synth: inconsistent head geometry");
  const std::size_t hd = spec.n_embd / spec.n_head;
  gguf::Writer w;
  std::size_t n_kv = 0;
  std::unique_ptr<MappedFile> vocab_file;
  std::unique_ptr<gguf::File> vocab;
  if (!spec.vocab_from.empty()) {
    vocab_file = std::make_unique<MappedFile>(spec.vocab_from);
    vocab = std::make_unique<gguf::File>(gguf::parse(vocab_file->bytes()));
  }
  w.add_string("general.architecture", "llama");
  w.add_string("general.name", spec.name);
  w.add_u32("general.alignment", 32);
  n_kv += 3;
  auto u32 = [&](const char* k, std::size_t v) { w.add_u32(k, uint32_t(v)); ++n_kv; };
  if (vocab) spec.n_vocab = detail::copy_tokenizer(w, *vocab, n_kv);
  else detail::add_byte_level_tokenizer(w, spec.n_vocab, n_kv);
  u32("llama.context_length", spec.ctx);
  u32("llama.embedding_length", spec.n_embd);
  u32("llama.block_count", spec.n_layer);
  u32("llama.feed_forward_length", spec.n_ff);
  u32("llama.attention.head_count", spec.n_head);
  u32("llama.attention.head_count_kv", spec.n_head_kv);
  u32("llama.rope.dimension_count", hd);
  u32("llama.vocab_size", spec.n_vocab);
  w.add_f32("llama.rope.freq_base", spec.rope_base);
  w.add_f32("llama.attention.layer_norm_rms_epsilon", spec.rms_eps);
  n_kv += 2;

  const float se = 1.f / std::sqrt(float(spec.n_embd));
  std::vector<TensorPlan> plan;
  auto mat = [&](std::string n, std::size_t cols, std::size_t rows, float scale, gguf::TensorType type) {
    plan.push_back({std::move(n), {cols, rows}, fit_row(type, cols), TensorPlan::Matrix, scale});
  };
  auto vec = [&](std::string n, std::size_t len, TensorPlan::Kind k) {
    plan.push_back({std::move(n), {len}, gguf::TensorType::F32, k, 1.f});
  };
  mat("token_embd.weight", spec.n_embd, spec.n_vocab, se, spec.embd_dtype.value_or(spec.dtype));
  vec("rope_freqs.weight", hd / 2, TensorPlan::RopeFreqs);
  for (std::size_t l = 0; l < spec.n_layer; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    const gguf::TensorType more =
        spec.more_bits_dtype && use_more_bits(l, spec.n_layer) ? *spec.more_bits_dtype : spec.dtype;
    vec(b + "attn_norm.weight", spec.n_embd, TensorPlan::Norm);
    mat(b + "attn_q.weight", spec.n_embd, spec.n_embd, 2 * se, spec.dtype);
    mat(b + "attn_k.weight", spec.n_embd, spec.n_head_kv * hd, 2 * se, spec.dtype);
    mat(b + "attn_v.weight", spec.n_embd, spec.n_head_kv * hd, se, more);
    mat(b + "attn_output.weight", spec.n_embd, spec.n_embd, se, spec.dtype);
    vec(b + "ffn_norm.weight", spec.n_embd, TensorPlan::Norm);
    mat(b + "ffn_gate.weight", spec.n_embd, spec.n_ff, se, spec.dtype);
    mat(b + "ffn_up.weight", spec.n_embd, spec.n_ff, se, spec.dtype);
    mat(b + "ffn_down.weight", spec.n_ff, spec.n_embd, 1.f / std::sqrt(float(spec.n_ff)), more);
  }
  vec("output_norm.weight", spec.n_embd, TensorPlan::OutNorm);

  // Header: magic, version, counts, metadata, directory, padding to the alignment.
  std::vector<uint8_t> head, dir;
  uint64_t off = 0;
  for (TensorPlan& t : plan) {
    const auto tt = gguf::type_traits(t.type);
    uint64_t n = 1;
    for (auto d : t.ne) n *= d;
    t.n_bytes = n / tt.block_elems * tt.block_bytes;
    gguf::Writer::put_string(dir, t.name);
    gguf::Writer::put(dir, uint32_t(t.ne.size()));
    for (auto d : t.ne) gguf::Writer::put(dir, d);
    gguf::Writer::put(dir, uint32_t(t.type));
    gguf::Writer::put(dir, off);
    off = (off + t.n_bytes + 31) / 32 * 32;
  }
  gguf::Writer::put(head, gguf::kMagic);
  gguf::Writer::put(head, uint32_t(3));
  gguf::Writer::put(head, int64_t(plan.size()));
  gguf::Writer::put(head, int64_t(n_kv));
  head.insert(head.end(), w.raw_meta().begin(), w.raw_meta().end());
  head.insert(head.end(), dir.begin(), dir.end());
  head.resize((head.size() + 31) / 32 * 32);

  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw Error("synth: cannot write '" + tmp + "'");
  auto put = [&](const void* p, std::size_t n) {
    if (std::fwrite(p, 1, n, f) != n) {
      std::fclose(f);
      throw Error("synth: write to '" + tmp + "' failed (disk full?)");
    }
  };
  put(head.data(), head.size());
  const std::vector<float> rope = llama3_rope_freqs(hd, spec.rope_base);
  std::vector<uint8_t> buf;
  std::vector<float> row;
  uint64_t written = 0;
  for (const TensorPlan& t : plan) {
    Normal rng(name_seed(spec.seed, t.name));
    const std::size_t cols = std::size_t(t.ne[0]), rows = t.ne.size() > 1 ? std::size_t(t.ne[1]) : 1;
    const std::size_t rb = std::size_t(t.n_bytes) / rows;
    buf.resize(std::size_t(t.n_bytes));
    row.resize(cols);
    for (std::size_t r = 0; r < rows; ++r) {  // values drawn in element order, whatever the type
      for (std::size_t j = 0; j < cols; ++j) {
        float v = 0.f;
        switch (t.kind) {
          case TensorPlan::Matrix: v = t.scale * rng(); break;
          case TensorPlan::Norm: v = 1.f + 0.1f * rng(); break;
          case TensorPlan::OutNorm: v = 4.f * (1.f + 0.1f * rng()); break;
          case TensorPlan::RopeFreqs: v = rope[j]; break;
        }
        row[j] = t.kind == TensorPlan::RopeFreqs ? v : bf16_to_f32(f32_to_bf16(v));  // the bf16 grid
      }
      uint8_t* out = buf.data() + r * rb;
      switch (t.type) {
        case gguf::TensorType::F32: std::memcpy(out, row.data(), cols * 4); break;
        case gguf::TensorType::F16:
        case gguf::TensorType::BF16:
          for (std::size_t j = 0; j < cols; ++j) {
            const uint16_t h = t.type == gguf::TensorType::BF16 ? f32_to_bf16(row[j]) : f32_to_f16(row[j]);
            std::memcpy(out + j * 2, &h, 2);
          }
          break;
        default: quant::quantize_row(quant_dtype(t.type), row.data(), cols, out);
      }
    }
    put(buf.data(), buf.size());
    written += t.n_bytes;
    const uint64_t pad = (32 - written % 32) % 32;
    static const uint8_t zeros[32] = {};
    put(zeros, pad);
    written += pad;
  }
  if (std::fclose(f) != 0) throw Error("synth: closing '" + tmp + "' failed");
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw Error("synth: cannot rename to '" + path + "'");
  return head.size() + written;
}

}  // namespace pp::synth
