// Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/) and the GGUF dictionary.
//
//   make_seeds <out-dir> <tests/data>     (scripts/fuzz.sh --seeds runs it into tests/fuzz)
//
// GGUF seeds are tiny Llama models carrying golden-tiny's real tokenizer metadata (a few KB to
// ~70 KB instead of golden-tiny's 0.5-1 MB, so mutations land in headers rather than weights), one
// per weight type and layout variant, plus one handcrafted file per parser and loader rejection.
#include "common/synth.hpp"

#include <pp/core/float16.hpp>
#include <pp/io/gguf.hpp>
#include <pp/io/gguf_writer.hpp>
#include <pp/io/mmap.hpp>
#include <pp/io/quantize.hpp>
#include <pp/net/auth.hpp>
#include <pp/net/frame.hpp>
#include <pp/net/handshake.hpp>
#include <pp/net/model_frame.hpp>
#include <pp/net/mux_frame.hpp>
#include <pp/net/placeholder.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using pp::gguf::TensorType;
using pp::gguf::ValueType;
using pp::gguf::Writer;
using Bytes = std::vector<uint8_t>;

void write_file(const fs::path& p, const void* data, std::size_t n) {
  fs::create_directories(p.parent_path());
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), std::streamsize(n));
  if (!out) throw std::runtime_error("cannot write " + p.string());
}
void write_file(const fs::path& p, const Bytes& b) { write_file(p, b.data(), b.size()); }
void write_file(const fs::path& p, const std::string& s) { write_file(p, s.data(), s.size()); }

// ---------------------------------------------------------------------------------------------
// GGUF

struct ModelSpec {
  TensorType dtype = TensorType::F32;
  TensorType embd_dtype = TensorType::F32;
  std::size_t n_embd = 8, n_head = 2, n_head_kv = 1, n_ff = 8, n_layer = 2;  // blocks of 32 need n_embd 32
  bool tied = true, rope_freqs = true, tokenizer = true;
  uint32_t version = 3, alignment = 32;
  std::string arch = "llama";
  // Hooks for the loader rejections: edit the numeric llama.* keys (f32 for freq_base and the
  // epsilon, u32 otherwise; NaN removes a key), or change or drop (return false) one tensor.
  std::function<void(std::map<std::string, double>&)> edit_meta;
  std::function<bool(const std::string&, TensorType&, std::vector<uint64_t>&)> tensor_hook;
  float rope_freq_0 = 0;  // when non-zero, replaces rope_freqs[0]
};

// Bytes of a tensor of `type` with dims ne; values small and deterministic (quantized types get
// well-formed blocks from the scalar quantizer).
Bytes tensor_bytes(TensorType type, const std::vector<uint64_t>& ne, float fill) {
  uint64_t n = 1;
  for (uint64_t d : ne) n *= d;
  const auto tt = pp::gguf::type_traits(type);
  const std::size_t cols = std::size_t(ne[0]), rows = std::size_t(n / ne[0]);
  Bytes out(std::size_t(n / tt.block_elems * tt.block_bytes));
  const std::size_t rb = out.size() / rows;
  std::vector<float> row(cols);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t j = 0; j < cols; ++j) row[j] = fill * float(int((r * 31 + j * 7) % 17) - 8) / 8.f;
    uint8_t* o = out.data() + r * rb;
    switch (type) {
      case TensorType::F32: std::memcpy(o, row.data(), cols * 4); break;
      case TensorType::F16:
      case TensorType::BF16:
        for (std::size_t j = 0; j < cols; ++j) {
          const uint16_t h = type == TensorType::BF16 ? pp::f32_to_bf16(row[j]) : pp::f32_to_f16(row[j]);
          std::memcpy(o + 2 * j, &h, 2);
        }
        break;
      case TensorType::F64: break;  // a type the kernels refuse: zero bytes are enough
      default: pp::quant::quantize_row(pp::synth::quant_dtype(type), row.data(), cols, o); break;
    }
  }
  return out;
}

Bytes make_model(const ModelSpec& s, const pp::gguf::File& vocab) {
  Writer w(s.alignment);
  w.add_string("general.architecture", s.arch);
  w.add_string("general.name", "fuzz-seed");
  if (s.alignment != pp::gguf::kDefaultAlignment) w.add_u32("general.alignment", s.alignment);
  std::size_t n_kv = 0, n_vocab = 16;
  if (s.tokenizer) n_vocab = pp::synth::detail::copy_tokenizer(w, vocab, n_kv);
  const std::size_t hd = s.n_embd / s.n_head;
  std::map<std::string, double> meta = {
      {"llama.context_length", 2048},
      {"llama.embedding_length", double(s.n_embd)},
      {"llama.block_count", double(s.n_layer)},
      {"llama.feed_forward_length", double(s.n_ff)},
      {"llama.attention.head_count", double(s.n_head)},
      {"llama.attention.head_count_kv", double(s.n_head_kv)},
      {"llama.rope.dimension_count", double(hd)},
      {"llama.vocab_size", double(n_vocab)},
      {"llama.rope.freq_base", 500000.0},
      {"llama.attention.layer_norm_rms_epsilon", 1e-5},
  };
  if (s.edit_meta) s.edit_meta(meta);
  for (const auto& [key, v] : meta) {
    if (std::isnan(v)) continue;
    if (key == "llama.rope.freq_base" || key == "llama.attention.layer_norm_rms_epsilon") w.add_f32(key, float(v));
    else w.add_u32(key, uint32_t(v));
  }
  auto add = [&](const std::string& name, TensorType type, std::vector<uint64_t> ne, float fill) {
    if (s.tensor_hook && !s.tensor_hook(name, type, ne)) return;
    Bytes b = tensor_bytes(type, ne, fill);
    if (name == "rope_freqs.weight" && type == TensorType::F32) {
      std::vector<float> f = pp::synth::llama3_rope_freqs(hd, 500000.f);
      if (s.rope_freq_0 != 0) f[0] = s.rope_freq_0;
      std::memcpy(b.data(), f.data(), std::min(b.size(), f.size() * 4));
    }
    w.add_tensor(name, type, ne, b.data(), b.size());
  };
  add("token_embd.weight", s.embd_dtype, {s.n_embd, n_vocab}, 0.05f);
  if (s.rope_freqs) add("rope_freqs.weight", TensorType::F32, {hd / 2}, 1.f);
  for (std::size_t l = 0; l < s.n_layer; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    add(b + "attn_norm.weight", TensorType::F32, {s.n_embd}, 1.f);
    add(b + "attn_q.weight", s.dtype, {s.n_embd, s.n_embd}, 0.1f);
    add(b + "attn_k.weight", s.dtype, {s.n_embd, s.n_head_kv * hd}, 0.1f);
    add(b + "attn_v.weight", s.dtype, {s.n_embd, s.n_head_kv * hd}, 0.1f);
    add(b + "attn_output.weight", s.dtype, {s.n_embd, s.n_embd}, 0.1f);
    add(b + "ffn_norm.weight", TensorType::F32, {s.n_embd}, 1.f);
    add(b + "ffn_gate.weight", s.dtype, {s.n_embd, s.n_ff}, 0.1f);
    add(b + "ffn_up.weight", s.dtype, {s.n_embd, s.n_ff}, 0.1f);
    add(b + "ffn_down.weight", s.dtype, {s.n_ff, s.n_embd}, 0.1f);
  }
  add("output_norm.weight", TensorType::F32, {s.n_embd}, 1.f);
  if (!s.tied) add("output.weight", s.embd_dtype, {s.n_embd, n_vocab}, 0.05f);
  return w.bytes(s.version);
}

template <class T>
void put(Bytes& b, T v) {
  Writer::put(b, v);
}

// A file whose metadata is one raw entry: key, type id, then `body`.
Bytes raw_kv(std::string_view key, uint32_t type, const std::function<void(Bytes&)>& body) {
  Writer w;
  Writer::put_string(w.raw_meta(), key);
  put(w.raw_meta(), type);
  body(w.raw_meta());
  w.count_raw_kv();
  return w.bytes();
}

// A file with raw tensor directory entries {name, ne, type, offset} and `data` bytes of data.
struct RawTensor {
  std::string name;
  std::vector<uint64_t> ne;
  uint32_t type;
  uint64_t offset;
};
Bytes raw_tensors(const std::vector<RawTensor>& ts, std::size_t data = 64, uint32_t version = 3) {
  Writer w;
  for (const RawTensor& t : ts) {
    Writer::put_string(w.raw_dir(), t.name);
    put(w.raw_dir(), uint32_t(t.ne.size()));
    for (uint64_t d : t.ne) put(w.raw_dir(), d);
    put(w.raw_dir(), t.type);
    put(w.raw_dir(), t.offset);
    w.count_raw_tensor();
  }
  w.raw_data().resize(data);
  return w.bytes(version);
}

Bytes with_counts(Bytes b, int64_t n_tensors, int64_t n_kv) {
  std::memcpy(b.data() + 8, &n_tensors, 8);
  std::memcpy(b.data() + 16, &n_kv, 8);
  return b;
}

void gguf_seeds(const fs::path& dir, const fs::path& data) {
  const pp::MappedFile vocab_file((data / "golden-tiny" / "golden-tiny-f32.gguf").string());
  const pp::gguf::File vocab = pp::gguf::parse(vocab_file.bytes());
  std::size_t n = 0;
  auto seed = [&](const std::string& name, const Bytes& b) {
    write_file(dir / (name + ".gguf"), b);
    ++n;
  };

  // Valid models, one per weight type and layout variant.
  using T = TensorType;
  const auto model = [&](const std::string& name, const std::function<void(ModelSpec&)>& edit) {
    ModelSpec s;
    edit(s);
    seed(name, make_model(s, vocab));
  };
  model("model-f32-tied-rope", [](ModelSpec&) {});
  model("model-bf16-output-norope", [](ModelSpec& s) {
    s.dtype = s.embd_dtype = T::BF16, s.tied = false, s.rope_freqs = false;
  });
  model("model-f16-v2-align64", [](ModelSpec& s) {
    s.dtype = s.embd_dtype = T::F16, s.version = 2, s.alignment = 64, s.n_layer = 1, s.tokenizer = false;
  });
  model("model-q8_0", [](ModelSpec& s) { s.dtype = s.embd_dtype = T::Q8_0, s.n_embd = s.n_ff = 32, s.n_layer = 1; });
  const auto quant = [&](const char* name, T t) {
    model(name, [t](ModelSpec& s) {
      s.dtype = t, s.embd_dtype = T::Q8_0, s.n_embd = s.n_ff = 32, s.n_layer = 1, s.tokenizer = false, s.tied = false;
    });
  };
  quant("model-q4_0", T::Q4_0);
  quant("model-q4_1", T::Q4_1);
  quant("model-q5_0", T::Q5_0);
  quant("model-q5_1", T::Q5_1);
  model("model-no-tokenizer-mha-3-layers", [](ModelSpec& s) {
    s.tokenizer = false, s.n_head_kv = 2, s.n_embd = 16, s.n_ff = 24, s.n_layer = 3;
  });

  // Loader (model) rejections, one per check of read_config / block_tensors / rope_freq_factors.
  const auto meta = [&](const std::string& name, double value, const char* key) {
    model("reject-model-" + name, [&](ModelSpec& s) {
      s.tokenizer = false, s.n_layer = 1;
      s.edit_meta = [=](std::map<std::string, double>& m) { m[key] = value; };
    });
  };
  const double absent = std::nan("");
  meta("block-count-0", 0, "llama.block_count");
  meta("head-count-kv-3", 3, "llama.attention.head_count_kv");
  meta("context-length-missing", absent, "llama.context_length");
  meta("rms-eps-0", 0, "llama.attention.layer_norm_rms_epsilon");
  meta("freq-base-1", 1, "llama.rope.freq_base");
  meta("key-length-odd", 7, "llama.attention.key_length");
  meta("value-length-8", 8, "llama.attention.value_length");
  meta("rope-dims-8", 8, "llama.rope.dimension_count");
  meta("vocab-size-17", 17, "llama.vocab_size");
  meta("embedding-length-33", 33, "llama.embedding_length");
  meta("ff-over-limit", double(1u << 21), "llama.feed_forward_length");
  model("reject-model-arch-gpt2", [](ModelSpec& s) { s.arch = "gpt2", s.tokenizer = false, s.n_layer = 1; });
  model("reject-model-rope-freq-negative", [](ModelSpec& s) { s.rope_freq_0 = -1, s.tokenizer = false, s.n_layer = 1; });
  const auto tensor = [&](const std::string& name,
                          std::function<bool(const std::string&, TensorType&, std::vector<uint64_t>&)> hook) {
    model("reject-model-" + name, [&](ModelSpec& s) { s.tensor_hook = hook, s.tokenizer = false, s.n_layer = 1; });
  };
  tensor("missing-ffn-up", [](const std::string& n, TensorType&, std::vector<uint64_t>&) {
    return n != "blk.0.ffn_up.weight";
  });
  tensor("missing-output-norm", [](const std::string& n, TensorType&, std::vector<uint64_t>&) {
    return n != "output_norm.weight";
  });
  tensor("wrong-shape-attn-k", [](const std::string& n, TensorType&, std::vector<uint64_t>& ne) {
    if (n == "blk.0.attn_k.weight") ne[1] = 8;
    return true;
  });
  tensor("unsupported-type-f64", [](const std::string& n, TensorType& t, std::vector<uint64_t>&) {
    if (n == "blk.0.attn_q.weight") t = TensorType::F64;
    return true;
  });
  tensor("norm-not-f32", [](const std::string& n, TensorType& t, std::vector<uint64_t>&) {
    if (n == "blk.0.attn_norm.weight") t = TensorType::F16;
    return true;
  });
  tensor("embd-1d", [](const std::string& n, TensorType&, std::vector<uint64_t>& ne) {
    if (n == "token_embd.weight") ne = {8 * 16};
    return true;
  });

  // Parser rejections, one per check (as tests/unit/test_gguf.cpp's Rejects).
  {
    Bytes b = Writer().bytes();
    b[3] = 'X';
    seed("reject-bad-magic", b);
  }
  for (uint32_t v : {0u, 1u, 4u, 0x02000000u, 0x03000000u}) seed("reject-version-" + std::to_string(v), Writer().bytes(v));
  seed("reject-n-tensors-negative", with_counts(Writer().bytes(), -1, 0));
  seed("reject-n-kv-past-end", with_counts(Writer().bytes(), 0, 1000));
  seed("reject-n-kv-over-limit", with_counts(Writer().bytes(), 0, int64_t(1) << 40));
  const auto u64 = [](uint64_t v) { return [v](Bytes& b) { put(b, v); }; };
  seed("reject-string-past-end", raw_kv("s", uint32_t(ValueType::STRING), u64(1000)));
  seed("reject-string-over-limit", raw_kv("s", uint32_t(ValueType::STRING), u64(uint64_t(1) << 40)));
  seed("reject-unknown-value-type", raw_kv("k", 13, u64(0)));
  seed("reject-bool-2", raw_kv("b", uint32_t(ValueType::BOOL), [](Bytes& b) { b.push_back(2); }));
  seed("reject-nested-array", raw_kv("a", uint32_t(ValueType::ARRAY), [](Bytes& b) {
         put(b, uint32_t(ValueType::ARRAY));
         put(b, uint64_t(1));
       }));
  seed("reject-array-count-past-end", raw_kv("a", uint32_t(ValueType::ARRAY), [](Bytes& b) {
         put(b, uint32_t(ValueType::U32));
         put(b, uint64_t(1) << 30);
       }));
  seed("reject-array-bool-element-3", raw_kv("a", uint32_t(ValueType::ARRAY), [](Bytes& b) {
         put(b, uint32_t(ValueType::BOOL));
         put(b, uint64_t(3));
         b.insert(b.end(), {0, 1, 3});
       }));
  seed("reject-array-of-strings-truncated", raw_kv("a", uint32_t(ValueType::ARRAY), [](Bytes& b) {
         put(b, uint32_t(ValueType::STRING));
         put(b, uint64_t(2));
         put(b, uint64_t(3));
         b.insert(b.end(), {'a', 'b', 'c'});
         put(b, uint64_t(500));
       }));
  {
    Writer w;
    w.add_u32("k", 1);
    w.add_u32("k", 2);
    seed("reject-duplicate-key", w.bytes());
  }
  {
    Writer w;
    w.add_u32("general.alignment", 48);
    seed("reject-alignment-not-power-of-two", w.bytes());
    Writer w0;
    w0.add_u32("general.alignment", 0);
    seed("reject-alignment-zero", w0.bytes());
    Writer w64;
    w64.add_u64("general.alignment", 64);
    seed("reject-alignment-u64", w64.bytes());
  }
  const uint32_t f32 = uint32_t(T::F32), q4_0 = uint32_t(T::Q4_0);
  seed("reject-n-dims-5", raw_tensors({{"t", {1, 1, 1, 1, 1}, f32, 0}}));
  seed("reject-dim-0", raw_tensors({{"t", {4, 0}, f32, 0}}));
  seed("reject-elements-overflow", raw_tensors({{"t", {uint64_t(1) << 32, uint64_t(1) << 32}, f32, 0}}));
  seed("reject-bytes-overflow", raw_tensors({{"t", {uint64_t(1) << 62}, f32, 0}}));
  seed("reject-unknown-tensor-type", raw_tensors({{"t", {4}, 31, 0}}));
  seed("reject-row-not-block-multiple", raw_tensors({{"t", {16}, q4_0, 0}}));
  seed("reject-offset-misaligned", raw_tensors({{"t", {4}, f32, 4}}));
  seed("reject-out-of-order", raw_tensors({{"a", {4}, f32, 32}, {"b", {4}, f32, 0}}));
  seed("reject-overlap", raw_tensors({{"a", {16}, f32, 0}, {"b", {4}, f32, 32}}));
  seed("reject-data-past-end", raw_tensors({{"t", {64}, f32, 0}}));
  seed("reject-duplicate-tensor", raw_tensors({{"t", {4}, f32, 0}, {"t", {4}, f32, 32}}));
  seed("reject-empty-tensor-name", raw_tensors({{"", {4}, f32, 0}}));
  seed("reject-tensor-name-64", raw_tensors({{std::string(64, 'n'), {4}, f32, 0}}));
  seed("ok-two-tensors-v2", raw_tensors({{"a", {4}, f32, 0}, {"b", {2, 2}, f32, 32}}, 64, 2));
  std::printf("fuzz_gguf: %zu seeds\n", n);
}

// Dictionary: the magic, Llama and tokenizer key names, tensor names; each also with its GGUF
// length prefix (u64 little-endian), as keys and names appear on disk.
void gguf_dict(const fs::path& path, const fs::path& data) {
  const pp::MappedFile f((data / "golden-tiny" / "golden-tiny-f32.gguf").string());
  const pp::gguf::File g = pp::gguf::parse(f.bytes());
  std::set<std::string> words;
  for (const auto& [k, v] : g.kv) words.insert(k);
  for (const char* k : {"general.alignment", "llama.attention.key_length", "llama.attention.value_length",
                        "llama.vocab_size", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.eot_token_id",
                        "tokenizer.ggml.eom_token_id", "tokenizer.ggml.pre", "llama", "gpt2", "llama-bpe", "default"})
    words.insert(k);
  for (const auto& t : g.tensors) words.insert(t.name);
  for (const char* t : {"output.weight", "output_norm.weight", "rope_freqs.weight", "token_embd.weight"}) words.insert(t);
  auto esc = [](const std::string& s) {
    std::string o;
    char buf[8];
    for (unsigned char c : s) {
      if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') o += char(c);
      else {
        std::snprintf(buf, sizeof buf, "\\x%02X", c);
        o += buf;
      }
    }
    return o;
  };
  std::string out = "# GGUF dictionary for fuzz_gguf (written by tests/fuzz/make_seeds.cpp).\n\"GGUF\"\n";
  out += "\"\\x03\\x00\\x00\\x00\"\n\"\\x02\\x00\\x00\\x00\"\n\"\\x20\\x00\\x00\\x00\"\n";
  for (const std::string& w : words) {
    Bytes prefixed;
    Writer::put_string(prefixed, w);
    out += "\"" + esc(w) + "\"\n";
    out += "\"" + esc(std::string(prefixed.begin(), prefixed.end())) + "\"\n";
  }
  write_file(path, out);
}

// ---------------------------------------------------------------------------------------------
// Tokenizer: control byte (bit 0 vocabulary, bit 1 keep_special) + text.

void tokenizer_seeds(const fs::path& dir, const fs::path& data) {
  std::ifstream in(data / "golden-tiny" / "tokenizer-cases.jsonl");
  std::string line;
  std::size_t i = 0;
  while (std::getline(in, line)) {
    const std::string text = nlohmann::json::parse(line).at("text").get<std::string>();
    const char control = char(i % 4);
    char name[32];
    std::snprintf(name, sizeof name, "case-%03zu", i++);
    write_file(dir / name, std::string(1, control) + text);
  }
  std::printf("fuzz_tokenizer: %zu seeds\n", i);
}

// ---------------------------------------------------------------------------------------------
// Frames: version-1 and version-2 frames, handshake texts, streams of several frames.

Bytes v1(uint8_t type, uint32_t seq, uint32_t lo, uint32_t hi, const Bytes& payload, uint8_t version = 1) {
  pp::net::FrameHeader h;
  h.version = version, h.type = type, h.seq = seq, h.layer_lo = lo, h.layer_hi = hi;
  return pp::net::encode_frame(h, payload);
}

Bytes v2(const pp::net::ModelHeader& m, const std::string& text) {
  pp::net::ModelHeader h = m;
  h.payload_bytes = uint32_t(text.size());
  const auto head = pp::net::encode_model_header(h);
  Bytes b(head.begin(), head.end());
  b.insert(b.end(), text.begin(), text.end());
  return b;
}

void frame_seeds(const fs::path& dir) {
  namespace net = pp::net;
  std::size_t n = 0;
  auto seed = [&](const std::string& name, const Bytes& b) {
    write_file(dir / name, b);
    ++n;
  };
  const Bytes words = net::make_input(7, 64);
  seed("v1-fwd", v1(net::kTypeFwd, 1, 0, 4, words));
  seed("v1-fwd-empty", v1(net::kTypeFwd, 2, 3, 3, {}));
  seed("v1-res", v1(net::kTypeRes, 3, 0, 4, words));
  seed("v1-err", v1(net::kTypeErr, 4, 0, 0, Bytes{'b', 'a', 'd'}));
  seed("v1-unknown-type", v1(9, 5, 0, 1, Bytes(8, 1)));
  seed("v1-fwd-odd-payload", v1(net::kTypeFwd, 6, 0, 1, Bytes(6, 2)));
  seed("v1-fwd-range-reversed", v1(net::kTypeFwd, 7, 5, 1, Bytes(8, 3)));
  seed("v3-fwd", v1(net::kTypeFwd, 8, 0, 1, Bytes(8, 4), 3));
  {
    Bytes stream = v1(net::kTypeFwd, 1, 0, 2, words);
    for (const Bytes& more : {v1(net::kTypeRes, 2, 0, 1, Bytes(4, 0)), v1(net::kTypeFwd, 3, 2, 6, net::make_input(3, 32))})
      stream.insert(stream.end(), more.begin(), more.end());
    seed("v1-stream", stream);
  }
  {
    Bytes truncated = v1(net::kTypeFwd, 1, 0, 2, words);
    truncated.resize(truncated.size() - 5);
    seed("v1-fwd-truncated", truncated);
    pp::net::FrameHeader big;
    big.payload_bytes = 0xFFFFFFF0u;
    const auto h = net::encode_header(big);
    seed("v1-fwd-huge-payload", Bytes(h.begin(), h.end()));
  }

  net::Hello hello;
  hello.model = {"3f2a9c0d5e6b7a8190a1b2c3d4e5f60718293a4b5c6d7e8f9012345678abcdef", "golden-tiny-f32.gguf", 4, 64, 512};
  hello.ctx = 256;
  hello.from = 1;
  hello.stage = 1;
  hello.chain = {{pp::LayerRange{1, 3}, net::Peer{"127.0.0.1", 7001}}, {pp::LayerRange{3, 4}, net::Peer{"::1", 7002}}};
  hello.sampling.temperature = 0.7;
  hello.sampling.top_k = 40;
  hello.sampling.top_p = 0.95;
  hello.sampling.min_p = 0.05;
  hello.sampling.seed = 12345;
  hello.timeout_ms = 5000;
  hello.load_timeout_ms = 60000;
  net::Welcome welcome;
  welcome.stages = {{1, pp::LayerRange{1, 3}, {"avx512", 2}, 256, 123456, "127.0.0.1:7001"},
                    {2, pp::LayerRange{3, 4}, {"avx2", 1}, 256, 65432, "[::1]:7002"}};
  net::ModelHeader m;
  m.seq = 1, m.session = 0x1122334455667788ull;
  m.type = net::kTypeHello;
  seed("v2-hello", v2(m, net::encode_hello(hello)));
  m.type = net::kTypeWelcome;
  seed("v2-welcome", v2(m, net::encode_welcome(welcome)));
  m.type = net::kTypeStatus;
  seed("v2-status", v2(m, ""));
  {
    // A BATCH of two sessions (1 + 2 rows of 4 values), the same with a bad header flags byte and dtype,
    // one whose entry count is far past the limit, its BRES, and an OPEN with sampling parameters.
    net::ModelHeader b;
    b.type = net::kTypeBatch, b.seq = 9, b.layer_lo = 0, b.layer_hi = 2, b.session = 5, b.rows = 3;
    const std::vector<net::BatchEntry> entries = {{11, 0, 1, 0}, {12, 7, 2, 0}};
    const Bytes table = net::encode_batch_table(entries);
    std::string payload(table.begin(), table.end());
    payload.append(3 * 4 * 4, '\0');
    seed("v2-batch", v2(b, payload));
    b.flags = 0x80, b.dtype = 1;
    seed("v2-batch-bad-flags-dtype", v2(b, payload));
    b.flags = 0, b.dtype = 0;
    std::string huge = payload;
    huge[0] = huge[1] = huge[2] = huge[3] = '\xff';
    seed("v2-batch-huge-count", v2(b, huge));
    b.type = net::kTypeBatchRes, b.rows = 2;
    seed("v2-bres", v2(b, std::string(2 * 4, '\x01')));
    const std::vector<net::BatchEntry> flagged = {{11, 0, 1, net::kEntryDigest | net::kEntryLogits}, {12, 7, 2, 0}};
    const Bytes ftable = net::encode_batch_table(flagged);
    std::string fpayload(ftable.begin(), ftable.end());
    fpayload.append(3 * 4 * 4, '\0');
    seed("v2-batch-flags", v2(b, fpayload));
    net::ModelHeader o;
    o.type = net::kTypeOpen, o.session = 11;
    seed("v2-open", v2(o, net::encode_sampling(hello.sampling)));
  }
  {
    // The AUTH exchange: step 1 then step 3 (what an upstream sends), step 2 (what a worker answers).
    net::ModelHeader a;
    a.type = net::kTypeAuth, a.seq = net::kAuthChallenge;
    Bytes up = v2(a, std::string(net::kNonceBytes, '\x5a'));
    a.seq = net::kAuthFinish;
    const Bytes finish = v2(a, std::string(net::kProofBytes, '\x3c'));
    up.insert(up.end(), finish.begin(), finish.end());
    seed("v2-auth-upstream", up);
    a.seq = net::kAuthResponse;
    seed("v2-auth-worker", v2(a, std::string(net::kNonceBytes + net::kProofBytes, '\x7e')));
    a.type = net::kTypeErr, a.seq = 0;
    seed("v2-auth-err", v2(a, "authentication failed: different keys"));
  }
  seed("hello-text", [&] {
    const std::string t = net::encode_hello(hello);
    return Bytes(t.begin(), t.end());
  }());
  seed("welcome-text", [&] {
    const std::string t = net::encode_welcome(welcome);
    return Bytes(t.begin(), t.end());
  }());
  std::printf("fuzz_frame: %zu seeds\n", n);
}

// ---------------------------------------------------------------------------------------------
// Worker requests: one valid line per op (for the stage that serves it), the classic bad ones,
// and a few multi-line inputs.

void worker_seeds(const fs::path& dir) {
  // Two bf16 rows of 16 values (0x3f80 = 1.0), base64.
  std::string rows;
  for (int i = 0; i < 32; ++i) rows += i % 2 ? "\x3f" : "\x80";
  const std::string b64 = [&] {
    static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string o;
    for (std::size_t i = 0; i < rows.size(); i += 3) {
      const uint32_t v = (uint8_t(rows[i]) << 16) | (i + 1 < rows.size() ? uint8_t(rows[i + 1]) << 8 : 0) |
                         (i + 2 < rows.size() ? uint8_t(rows[i + 2]) : 0);
      o += a[v >> 18], o += a[(v >> 12) & 63];
      o += i + 1 < rows.size() ? a[(v >> 6) & 63] : '=';
      o += i + 2 < rows.size() ? a[v & 63] : '=';
    }
    return o;
  }();
  const std::vector<std::pair<std::string, std::string>> lines = {
      {"tokenize", R"({"request_id":1,"op":"tokenize","prompt":"Hello world","add_bos":true,"parse_special":false})"},
      {"embed", R"({"request_id":2,"op":"embed_and_forward","tokens":[1,2,3],"position":0})"},
      {"decode-step", R"({"request_id":3,"op":"decode_step","token_id":5,"position":3})"},
      {"forward-range", R"({"request_id":4,"op":"forward_range","position":0,"seq_len":2,"hidden_b64":")" + b64 + "\"}"},
      {"sample", R"({"request_id":5,"op":"forward_and_sample","position":7,"seq_len":2,"temperature":0.8,"top_k":40,"top_p":0.9,"min_p":0.05,"seed":42,"return_logits":true,"hidden_b64":")" +
                     b64 + "\"}"},
      {"detokenize", R"({"request_id":6,"op":"detokenize","tokens":[1,2,3],"keep_special":true})"},
      {"generate-full", R"({"request_id":7,"op":"generate_full","prompt":"hi","max_tokens":4})"},
      {"generate-full-tokens", R"({"request_id":8,"op":"generate_full","tokens":[1,2],"max_tokens":2})"},
      {"not-json", "{\"request_id\":9,"},
      {"not-object", "[1,2,3]"},
      {"no-id", R"({"op":"tokenize","prompt":"x"})"},
      {"unknown-op", R"({"request_id":10,"op":"explode"})"},
      {"bad-b64", R"({"request_id":11,"op":"forward_range","position":0,"seq_len":1,"hidden_b64":"AAA="})"},
      {"huge-position", R"({"request_id":12,"op":"decode_step","token_id":1,"position":2147483647})"},
      {"huge-ids", R"({"request_id":18446744073709551615,"op":"detokenize","tokens":[2147483647,-1]})"},
      {"float-fields", R"({"request_id":13,"op":"forward_and_sample","position":0,"seq_len":1,"temperature":1e400,"hidden_b64":"AAAA"})"},
      {"unicode", "{\"request_id\":14,\"op\":\"tokenize\",\"prompt\":\"\\u00e9\\ud83d\\ude00 caf\xc3\xa9\"}"},
      {"multi", R"({"request_id":15,"op":"tokenize","prompt":"a b"})" "\n\n" R"({"request_id":16,"op":"detokenize","tokens":[]})" "\n" R"({"request_id":17,"op":"embed_and_forward","tokens":[0]})"},
  };
  for (const auto& [name, line] : lines) write_file(dir / name, line + "\n");
  std::printf("fuzz_worker_request: %zu seeds\n", lines.size());
}

// fuzz_mux: what follows the target's fixed HELLO (mux=1, connection 0x0123456789abcdef, the last stage
// [1, 4) of golden-tiny: n_embd 64, ctx 64): OPEN / BATCH / CLOSE / STATUS streams.
void mux_seeds(const fs::path& dir) {
  namespace net = pp::net;
  constexpr uint64_t kConn = 0x0123456789abcdefull;
  constexpr uint32_t kEmbd = 64;
  std::size_t n = 0;
  auto frame = [](uint8_t type, uint64_t session, uint32_t seq, const Bytes& payload, uint32_t rows = 0, uint64_t pos = 0) {
    net::ModelHeader m;
    m.type = type, m.session = session, m.seq = seq, m.layer_lo = 1, m.layer_hi = 4, m.rows = rows, m.pos = pos;
    m.payload_bytes = uint32_t(payload.size());
    const auto h = net::encode_model_header(m);
    Bytes b(h.begin(), h.end());
    b.insert(b.end(), payload.begin(), payload.end());
    return b;
  };
  auto open = [&](uint64_t s, const std::string& sampling) {
    return frame(net::kTypeOpen, s, 0, Bytes(sampling.begin(), sampling.end()));
  };
  auto batch = [&](uint32_t seq, const std::vector<net::BatchEntry>& es) {
    Bytes p = net::encode_batch_table(es);
    uint32_t rows = 0;
    for (const auto& e : es) rows += e.rows;
    for (uint32_t i = 0; i < rows * kEmbd; ++i) {
      const float x = float(int(i % 61) - 30) / 64.0f;
      const auto* b = reinterpret_cast<const uint8_t*>(&x);
      p.insert(p.end(), b, b + 4);
    }
    return frame(net::kTypeBatch, kConn, seq, p, rows);
  };
  auto cat = [](std::initializer_list<Bytes> parts) {
    Bytes out;
    for (const Bytes& b : parts) out.insert(out.end(), b.begin(), b.end());
    return out;
  };
  auto seed = [&](const std::string& name, const Bytes& b) {
    write_file(dir / name, b);
    ++n;
  };
  pp::SamplingParams greedy, sampled;
  sampled.temperature = 0.8, sampled.top_k = 40, sampled.top_p = 0.9, sampled.seed = 7;
  const std::string g = net::encode_sampling(greedy), t = net::encode_sampling(sampled);
  seed("open-batch-close", cat({open(5, g), batch(1, {{5, 0, 3, 0}}), batch(2, {{5, 3, 1, 0}}), frame(net::kTypeClose, 5, 0, {})}));
  seed("two-sessions", cat({open(5, g), open(6, t), batch(1, {{5, 0, 2, 0}, {6, 0, 4, 0}}), batch(2, {{6, 4, 1, 0}, {5, 2, 1, 0}}),
                            frame(net::kTypeClose, 6, 0, {}), batch(3, {{5, 3, 1, 0}})}));
  seed("status", frame(net::kTypeStatus, kConn, 0, {}));
  seed("batch-unknown-session", batch(1, {{9, 0, 1, 0}}));
  seed("open-twice", cat({open(5, g), open(5, g)}));
  seed("open-reserved", cat({open(0, g), open(kConn, g)}));
  seed("open-bad-sampling", open(5, "temperature=-1\ntop_k=abc\n"));
  seed("batch-past-ctx", cat({open(5, g), batch(1, {{5, 62, 4, 0}})}));
  seed("batch-duplicate-entry", cat({open(5, g), batch(1, {{5, 0, 1, 0}, {5, 1, 1, 0}})}));
  const uint8_t both = net::kEntryDigest | net::kEntryLogits;
  seed("batch-entry-flags", cat({open(5, g), open(6, t), batch(1, {{5, 0, 2, both}, {6, 0, 1, 0}}),
                                 batch(2, {{6, 1, 1, net::kEntryLogits}, {5, 2, 1, net::kEntryDigest}})}));
  seed("batch-unknown-flags", cat({open(5, g), batch(1, {{5, 0, 1, 0x84}})}));
  seed("batch-five-logits", cat({open(1, g), open(2, g), open(3, g), open(4, g), open(5, g),
                                 batch(1, {{1, 0, 1, both}, {2, 0, 1, both}, {3, 0, 1, both}, {4, 0, 1, both}, {5, 0, 1, both}})}));
  seed("close-unknown-and-keepalive", cat({frame(net::kTypeClose, 77, 0, {}), frame(net::kTypeClose, 0, 0, {})}));
  {
    Bytes nan_rows = cat({open(5, g), batch(1, {{5, 0, 2, 0}})});
    const float bad = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(nan_rows.data() + nan_rows.size() - 4 * 10, &bad, 4);
    seed("batch-nan", nan_rows);
  }
  {
    Bytes truncated = cat({open(5, g), batch(1, {{5, 0, 2, 0}})});
    truncated.resize(truncated.size() - 7);
    seed("batch-truncated", truncated);
  }
  seed("fwd-on-mux", frame(net::kTypeFwd, kConn, 0, Bytes(kEmbd * 4, 0), 1));
  std::printf("fuzz_mux: %zu seeds\n", n);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: make_seeds <out-dir (tests/fuzz)> <tests/data>\n");
    return 2;
  }
  try {
    const fs::path out = argv[1], data = argv[2];
    for (const char* t : {"fuzz_gguf", "fuzz_tokenizer", "fuzz_frame", "fuzz_worker_request", "fuzz_mux"})
      fs::remove_all(out / "corpus" / t);
    gguf_seeds(out / "corpus" / "fuzz_gguf", data);
    gguf_dict(out / "gguf.dict", data);
    tokenizer_seeds(out / "corpus" / "fuzz_tokenizer", data);
    frame_seeds(out / "corpus" / "fuzz_frame");
    worker_seeds(out / "corpus" / "fuzz_worker_request");
    mux_seeds(out / "corpus" / "fuzz_mux");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
