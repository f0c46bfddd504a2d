// Llama loader: hyperparameters read as llama.cpp does, and each inconsistency refused with its own message.
#include <pp/io/gguf_writer.hpp>
#include <pp/io/llama_loader.hpp>
#include <pp/stage.hpp>

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace {

using pp::gguf::TensorType;
using pp::gguf::ValueType;

// A small valid Llama model, described so each test can change one thing before writing it.
struct ModelSpec {
  std::map<std::string, uint32_t> u32 = {{"llama.context_length", 64},      {"llama.embedding_length", 32},
                                         {"llama.block_count", 2},          {"llama.feed_forward_length", 48},
                                         {"llama.attention.head_count", 4}, {"llama.attention.head_count_kv", 2}};
  std::map<std::string, float> f32 = {{"llama.attention.layer_norm_rms_epsilon", 1e-5f}, {"llama.rope.freq_base", 10000.f}};
  std::string arch = "llama";
  // name -> (ne, type)
  std::map<std::string, std::pair<std::vector<uint64_t>, TensorType>> tensors;
  ModelSpec() {
    const uint64_t E = 32, F = 48, V = 40, kv = 16;
    tensors["token_embd.weight"] = {{E, V}, TensorType::F32};
    tensors["output_norm.weight"] = {{E}, TensorType::F32};
    for (int l = 0; l < 2; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      tensors[b + "attn_norm.weight"] = {{E}, TensorType::F32};
      tensors[b + "attn_q.weight"] = {{E, E}, TensorType::F16};
      tensors[b + "attn_k.weight"] = {{E, kv}, TensorType::F16};
      tensors[b + "attn_v.weight"] = {{E, kv}, TensorType::BF16};
      tensors[b + "attn_output.weight"] = {{E, E}, TensorType::F32};
      tensors[b + "ffn_norm.weight"] = {{E}, TensorType::F32};
      tensors[b + "ffn_gate.weight"] = {{E, F}, TensorType::F32};
      tensors[b + "ffn_up.weight"] = {{E, F}, TensorType::F32};
      tensors[b + "ffn_down.weight"] = {{F, E}, TensorType::F32};
    }
  }
  std::string write(const std::string& name) const {
    pp::gguf::Writer w;
    if (!arch.empty()) w.add_string("general.architecture", arch);
    for (const auto& [k, v] : u32) w.add_u32(k, v);
    for (const auto& [k, v] : f32) w.add_f32(k, v);
    for (const auto& [n, t] : tensors) {
      uint64_t count = 1;
      for (auto d : t.first) count *= d;
      const auto tt = pp::gguf::type_traits(t.second);
      std::vector<uint8_t> data(count / tt.block_elems * tt.block_bytes, 0);
      // Norms of 1.0 so a forward pass is finite.
      if (t.second == TensorType::F32)
        for (std::size_t i = 0; i < count; ++i) {
          const float one = n.find("norm") != std::string::npos ? 1.f : 0.01f * float(i % 7);
          std::memcpy(&data[i * 4], &one, 4);
        }
      w.add_tensor(n, t.second, t.first, data.data(), data.size());
    }
    const auto bytes = w.bytes();
    const auto path = std::filesystem::temp_directory_path() / ("pp_loader_" + name + "_" + std::to_string(getpid()) + ".gguf");
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    return path.string();
  }
};

std::string load_error(const ModelSpec& s, const std::string& name) {
  const std::string path = s.write(name);
  std::string msg;
  try {
    pp::Stage st(path, pp::LayerRange{0, 2});
  } catch (const pp::Error& e) {
    msg = e.what();
  }
  std::filesystem::remove(path);
  return msg;
}

TEST(Loader, ValidModelLoadsWithDefaults) {
  ModelSpec s;
  s.f32.erase("llama.rope.freq_base");        // defaults to 10000
  s.u32.erase("llama.attention.head_count_kv");  // defaults to head_count
  s.tensors["blk.0.attn_k.weight"].first = {32, 32};
  s.tensors["blk.0.attn_v.weight"].first = {32, 32};
  s.tensors["blk.1.attn_k.weight"].first = {32, 32};
  s.tensors["blk.1.attn_v.weight"].first = {32, 32};
  const std::string path = s.write("ok");
  {
    pp::Stage st(path, pp::LayerRange{0, 2});
    EXPECT_EQ(st.config().rope_base, 10000.f);
    EXPECT_EQ(st.config().n_head_kv, 4u);
    EXPECT_EQ(st.config().head_dim, 8u);
    EXPECT_EQ(st.config().n_vocab, 40u);
    pp::Sequence seq = st.new_sequence();
    std::vector<float> rows(32), logits(40);
    const int32_t t = 3;
    st.embed({&t, 1}, rows.data());
    st.forward(seq, 0, rows.data(), 1);
    st.head(seq, rows.data(), 1, logits.data());  // tied output
    for (float v : logits) EXPECT_TRUE(std::isfinite(v));
  }
  std::filesystem::remove(path);
}

struct Case {
  const char* name;
  std::function<void(ModelSpec&)> mutate;
  const char* message;  // a distinctive part of the error
};

class LoaderRejects : public ::testing::TestWithParam<Case> {};

TEST_P(LoaderRejects, WithItsOwnMessage) {
  ModelSpec s;
  GetParam().mutate(s);
  const std::string msg = load_error(s, GetParam().name);
  EXPECT_NE(msg.find(GetParam().message), std::string::npos) << "got: '" << msg << "'";
}

INSTANTIATE_TEST_SUITE_P(
    Checks, LoaderRejects,
    ::testing::Values(
        Case{"arch", [](ModelSpec& s) { s.arch = "gpt2"; }, "only 'llama' models"},
        Case{"no_arch", [](ModelSpec& s) { s.arch = ""; }, "'general.architecture' is missing"},
        Case{"no_eps", [](ModelSpec& s) { s.f32.erase("llama.attention.layer_norm_rms_epsilon"); }, "layer_norm_rms_epsilon' is missing"},
        Case{"bad_eps", [](ModelSpec& s) { s.f32["llama.attention.layer_norm_rms_epsilon"] = -1.f; }, "outside (0, 1]"},
        Case{"blocks0", [](ModelSpec& s) { s.u32["llama.block_count"] = 0; }, "'llama.block_count' = 0 is outside"},
        Case{"blocks_huge", [](ModelSpec& s) { s.u32["llama.block_count"] = 100000; }, "'llama.block_count' = 100000"},
        Case{"heads0", [](ModelSpec& s) { s.u32["llama.attention.head_count"] = 0; }, "'llama.attention.head_count' = 0"},
        Case{"kv_not_divisor", [](ModelSpec& s) { s.u32["llama.attention.head_count_kv"] = 3; }, "not a multiple of head_count_kv"},
        Case{"embd_not_multiple", [](ModelSpec& s) { s.u32["llama.attention.head_count"] = 5; s.u32["llama.attention.head_count_kv"] = 5; }, "not a multiple of head_count 5"},
        Case{"rope_dims", [](ModelSpec& s) { s.u32["llama.rope.dimension_count"] = 4; }, "rope.dimension_count 4 differs"},
        Case{"value_length", [](ModelSpec& s) { s.u32["llama.attention.value_length"] = 4; }, "value_length 4 differs"},
        Case{"vocab_size", [](ModelSpec& s) { s.u32["llama.vocab_size"] = 41; }, "llama.vocab_size 41 differs"},
        Case{"missing_tensor", [](ModelSpec& s) { s.tensors.erase("blk.1.ffn_up.weight"); }, "tensor 'blk.1.ffn_up.weight' is missing"},
        Case{"missing_embd", [](ModelSpec& s) { s.tensors.erase("token_embd.weight"); }, "'token_embd.weight' is missing"},
        Case{"wrong_shape", [](ModelSpec& s) { s.tensors["blk.0.attn_q.weight"].first = {32, 16}; }, "'blk.0.attn_q.weight' has shape [32, 16], expected [32, 32]"},
        Case{"norm_type", [](ModelSpec& s) { s.tensors["blk.0.attn_norm.weight"].second = TensorType::F16; }, "'blk.0.attn_norm.weight' has type F16, expected F32"},
        Case{"unsupported_type", [](ModelSpec& s) { s.tensors["blk.0.ffn_gate.weight"] = {{32, 48}, TensorType::I32}; }, "'blk.0.ffn_gate.weight' has type I32"},
        Case{"missing_out_norm", [](ModelSpec& s) { s.tensors.erase("output_norm.weight"); }, "'output_norm.weight' is missing"},
        Case{"output_shape", [](ModelSpec& s) { s.tensors["output.weight"] = {{32, 39}, TensorType::F32}; }, "'output.weight' has shape [32, 39]"},
        Case{"rope_freqs_len", [](ModelSpec& s) { s.tensors["rope_freqs.weight"] = {{3}, TensorType::F32}; }, "'rope_freqs.weight' has shape [3], expected [4]"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Loader, StageOutsideTheModelIsRefused) {
  ModelSpec s;
  const std::string path = s.write("range");
  EXPECT_THROW(pp::Stage(path, pp::LayerRange{1, 3}), pp::Error);
  EXPECT_THROW(pp::Stage(path, pp::LayerRange{2, 1}), pp::Error);
  EXPECT_THROW(pp::Stage::open_stage(path, 0, 3), pp::Error);  // 2 blocks cannot make 3 stages
  EXPECT_NO_THROW(pp::Stage::open_stage(path, 1, 2));
  std::filesystem::remove(path);
}

}  // namespace
