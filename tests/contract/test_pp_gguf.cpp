// pp_gguf contract: `info` on generated and fixture files (exit 0, expected lines), errors exit 2 with one line.
#include <pp/io/gguf_writer.hpp>
#include <pp/model.hpp>
#include <pp/model/kv_cache.hpp>

#include "../common/node_process.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using pp::gguf::TensorType;
using pp::gguf::Writer;
using testing::HasSubstr;

using ToolRun = pp::test::RunResult;

// A scratch directory unique to this process, removed at exit.
const fs::path& scratch() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("pp_gguf_test." + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  static const struct Cleanup {
    ~Cleanup() { fs::remove_all(dir); }
  } cleanup;
  return dir;
}

// Runs pp_gguf with `args`, capturing stdout, stderr and the exit status; a run killed after 30 s (scaled) is
// also a failure.
ToolRun pp_gguf(const std::vector<std::string>& args) {
  const char* bin = std::getenv("PP_GGUF_BIN");
  std::vector<std::string> argv{bin ? bin : "tools/pp_gguf"};
  argv.insert(argv.end(), args.begin(), args.end());
  return pp::test::run_checked(argv, std::chrono::seconds(30));
}

fs::path write_file(const std::string& name, const std::vector<uint8_t>& bytes) {
  const fs::path p = scratch() / name;
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  return p;
}

// A Llama-layout file with `n_blocks` blocks of two F32 tensors (1 KiB each), 4 KiB token_embd,
// rope_freqs, output_norm, and an output matrix unless tied.
std::vector<uint8_t> llama_like(uint32_t n_blocks, bool tied) {
  Writer w;
  w.add_string("general.architecture", "llama");
  w.add_u32("llama.block_count", n_blocks);
  w.add_strings("tokenizer.ggml.tokens", {"a", "b", "c", "d", "e", "f", "g"});
  w.add_array("tokenizer.ggml.token_type", pp::gguf::ValueType::I32, std::vector<int32_t>{1, 1, 1, 1, 1, 1, 3});
  const std::vector<float> zeros(1024, 0.0f);
  w.add_tensor("token_embd.weight", TensorType::F32, {16, 64}, zeros.data(), 4096);
  w.add_tensor("rope_freqs.weight", TensorType::F32, {8}, zeros.data(), 32);
  for (uint32_t l = 0; l < n_blocks; ++l) {
    const std::string blk = "blk." + std::to_string(l) + ".";
    w.add_tensor(blk + "attn_norm.weight", TensorType::F32, {256}, zeros.data(), 1024);
    w.add_tensor(blk + "attn_q.weight", TensorType::F32, {16, 16}, zeros.data(), 1024);
  }
  w.add_tensor("output_norm.weight", TensorType::F32, {16}, zeros.data(), 64);
  if (!tied) w.add_tensor("output.weight", TensorType::F32, {16, 64}, zeros.data(), 4096);
  return w.bytes();
}

TEST(PpGgufInfo, PrintsHeaderMetadataTensorsAndTotals) {
  const fs::path p = write_file("model.gguf", llama_like(2, false));
  const ToolRun r = pp_gguf({"info", p.string()});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, HasSubstr("version: 3\n"));
  EXPECT_THAT(r.out, HasSubstr("alignment: 32\n"));
  EXPECT_THAT(r.out, HasSubstr("llama.block_count"));
  EXPECT_THAT(r.out, HasSubstr("[string x 7] \"a\", \"b\", \"c\", \"d\", \"e\", ..."));
  EXPECT_THAT(r.out, HasSubstr("[i32 x 7] 1, 1, 1, 1, 1, ..."));
  EXPECT_THAT(r.out, testing::ContainsRegex("blk\\.1\\.attn_q\\.weight +F32 +\\[16, 16\\] +1024"));
  EXPECT_THAT(r.out, testing::ContainsRegex("F32 +8 tensors"));
  EXPECT_THAT(r.out, testing::Not(HasSubstr("split into")));
}

// Stage layout: k = total / n, the last stage takes the rest; token_embd on the first, the output
// (or the tied token_embd) and output_norm on the last, rope_freqs everywhere.
TEST(PpGgufInfo, StagesFollowTheLayerRule) {
  const fs::path p = write_file("tied.gguf", llama_like(5, true));
  const ToolRun r = pp_gguf({"info", p.string(), "--stages", "3"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("split into 3 stages over 5 blocks:"));
  // 2 block tensors (2048 bytes) per block; rope_freqs 32; token_embd 4096; output_norm 64.
  EXPECT_THAT(r.out, HasSubstr("stage 0 (first): blocks [0, 1), 4 tensors, 6176 bytes"));
  EXPECT_THAT(r.out, HasSubstr("outside blocks: token_embd.weight rope_freqs.weight\n"));
  EXPECT_THAT(r.out, HasSubstr("stage 1 (middle): blocks [1, 2), 3 tensors, 2080 bytes"));
  EXPECT_THAT(r.out, HasSubstr("stage 2 (last): blocks [2, 5), 9 tensors, 10336 bytes"));
  EXPECT_THAT(r.out, HasSubstr("outside blocks: token_embd.weight rope_freqs.weight output_norm.weight\n"));

  const fs::path u = write_file("untied.gguf", llama_like(4, false));
  const ToolRun s = pp_gguf({"info", u.string(), "--stages", "2"});
  ASSERT_EQ(s.code, 0) << s.err;
  EXPECT_THAT(s.out, HasSubstr("stage 0 (first): blocks [0, 2), 6 tensors, 8224 bytes"));
  EXPECT_THAT(s.out, HasSubstr("stage 1 (last): blocks [2, 4), 7 tensors, 8288 bytes"));
  EXPECT_THAT(s.out, HasSubstr("outside blocks: rope_freqs.weight output_norm.weight output.weight\n"));
}

TEST(PpGgufInfo, GoldenTinyFixture) {
  fs::path p;
  for (const char* var : {"PP_TEST_DATA", "PP_SHARED_FIXTURES"})
    if (const char* d = std::getenv(var); d && fs::exists(fs::path(d) / "golden-tiny/golden-tiny-bf16.gguf"))
      p = fs::path(d) / "golden-tiny/golden-tiny-bf16.gguf";
  if (p.empty()) GTEST_SKIP() << "golden-tiny-bf16.gguf absent (PP_TEST_DATA, PP_SHARED_FIXTURES)";
  const ToolRun r = pp_gguf({"info", p.string(), "--stages", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("tensors (39):"));
  EXPECT_THAT(r.out, testing::ContainsRegex("token_embd\\.weight +BF16 +\\[64, 512\\] +65536"));
  EXPECT_THAT(r.out, HasSubstr("stage 0 (first): blocks [0, 2)"));
  EXPECT_THAT(r.out, HasSubstr("stage 1 (last): blocks [2, 4)"));
  // Per-stage memory: its weights and the KV caches of --sessions sessions at --ctx (default min(4096, trained)).
  const pp::Config c = pp::Model::open(p.string())->config();
  const auto kv = [&](uint64_t sessions, uint64_t ctx) {
    return pp::format_bytes(2 * sessions * pp::KvCache::bytes_per_layer(ctx, c.kv_dim()));  // 2 blocks a stage
  };
  EXPECT_THAT(r.out, HasSubstr("+ KV " + kv(1, std::min<uint64_t>(4096, c.ctx_len)) + " (1 session(s) x ctx " +
                               std::to_string(std::min<uint64_t>(4096, c.ctx_len)) + ") = "));
  const ToolRun m = pp_gguf({"info", p.string(), "--stages", "2", "--sessions", "8", "--ctx", "1000"});
  ASSERT_EQ(m.code, 0) << m.err;
  EXPECT_THAT(m.out, HasSubstr("+ KV " + kv(8, 1000) + " (8 session(s) x ctx 1000) = "));
  EXPECT_NE(kv(8, 1000), kv(1, 1000));
  // A file without attention metadata still gets its weights, and says why there is no KV figure.
  const fs::path u = write_file("nokv.gguf", llama_like(4, false));
  const ToolRun n = pp_gguf({"info", u.string(), "--stages", "2"});
  ASSERT_EQ(n.code, 0) << n.err;
  EXPECT_THAT(n.out, HasSubstr("    memory: weights 8.0 KiB; KV unknown ("));
}

// Every error: nothing on stdout, exactly one line on stderr naming the problem, exit 2.
void expect_error(const ToolRun& r, const std::string& message) {
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, testing::StartsWith("pp_gguf: "));
  EXPECT_THAT(r.err, HasSubstr(message));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(PpGgufInfo, CorruptFileExits2WithOneLine) {
  std::vector<uint8_t> bytes = llama_like(2, false);
  bytes.resize(bytes.size() - 1);
  expect_error(pp_gguf({"info", write_file("truncated.gguf", bytes).string()}),
               "gguf: tensor 'output.weight': data [");
  bytes[0] = 'X';
  expect_error(pp_gguf({"info", write_file("magic.gguf", bytes).string()}), "gguf: bad magic");
}

// Issue 16, finding 7: key and tensor names from an untrusted file reached the terminal raw (ESC sequences,
// control bytes), and a NUL cut the line short. They are printed escaped, in `info` and in parser errors.
TEST(PpGgufInfo, NamesFromTheFileAreEscapedEverywhereTheyArePrinted) {
  using namespace std::string_literals;
  const std::string esc_key = "evil.\x1b]0;pwned\x07.key\0tail"s;
  const std::string esc_tensor = "blk.0.\x1b[2J\x9b" "31m\r\nx\0y.weight"s;
  const std::string esc_other = "\x1b[31mrogue\x7f"s;  // not a block tensor: listed by name in the stage layout
  Writer w;
  w.add_string("general.architecture", "llama");
  w.add_u32("llama.block_count", 2);
  w.add_u32(esc_key, 7);
  const std::vector<float> zeros(16, 0.0f);
  w.add_tensor(esc_tensor, TensorType::F32, {16}, zeros.data(), 64);
  w.add_tensor(esc_other, TensorType::F32, {16}, zeros.data(), 64);
  const fs::path p = write_file("escapes.gguf", w.bytes());
  const ToolRun r = pp_gguf({"info", p.string(), "--stages", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const std::string* s : {&r.out, &r.err}) {
    for (char c : *s) {
      const auto u = static_cast<unsigned char>(c);
      EXPECT_TRUE(c == '\n' || (u >= 0x20 && u < 0x7f)) << "raw byte 0x" << std::hex << int(u) << " printed";
    }
  }
  EXPECT_THAT(r.out, HasSubstr("evil.\\x1b]0;pwned\\x07.key\\x00tail"));
  EXPECT_THAT(r.out, HasSubstr("blk.0.\\x1b[2J\\x9b31m\\x0d\\nx\\x00y.weight"));
  EXPECT_THAT(r.out, HasSubstr(" \\x1b[31mrogue\\x7f"));
  // A parser error about the same name: a duplicate tensor.
  Writer d;
  d.add_string("general.architecture", "llama");
  d.add_tensor(esc_tensor, TensorType::F32, {16}, zeros.data(), 64);
  d.add_tensor(esc_tensor, TensorType::F32, {16}, zeros.data(), 64);
  const ToolRun e = pp_gguf({"info", write_file("dup.gguf", d.bytes()).string()});
  EXPECT_EQ(e.code, 2);
  EXPECT_THAT(e.err, HasSubstr("tensor 'blk.0.\\x1b[2J\\x9b31m\\x0d\\nx\\x00y.weight': duplicate tensor name"));
  for (char c : e.err) {
    const auto u = static_cast<unsigned char>(c);
    EXPECT_TRUE(c == '\n' || (u >= 0x20 && u < 0x7f)) << "raw byte 0x" << std::hex << int(u) << " printed";
  }
}

TEST(PpGgufInfo, UsageErrorsExit2) {
  expect_error(pp_gguf({"info", (scratch() / "missing.gguf").string()}), "cannot open");
  expect_error(pp_gguf({}), "subcommand");
  expect_error(pp_gguf({"frobnicate"}), "frobnicate");
  const fs::path p = write_file("small.gguf", llama_like(2, true));
  expect_error(pp_gguf({"info", p.string(), "--stages", "1"}), "--stages");
  expect_error(pp_gguf({"info", p.string(), "--stages", "3"}), "cannot split 2 blocks into 3 stages");
  Writer w;  // no block count
  expect_error(pp_gguf({"info", write_file("noblocks.gguf", w.bytes()).string(), "--stages", "2"}),
               "metadata 'llama.block_count': missing");
}

}  // namespace
