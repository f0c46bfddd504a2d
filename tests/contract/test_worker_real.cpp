// pp_worker real mode: spawns workers on real GGUF models and drives them as the orchestrator does.
//
// * A synthetic model with the real Llama-3 vocabulary (pp_gguf synth --vocab-from the shared fixture):
//   geometry in the ready line, the tokenize -> ... -> detokenize round trip, the KV rules, id ranges.
// * Equivalence: N workers chained First -> Middle... -> Last -> First equal `pp_generate --cuts
//   <compute_layer_range cuts> --wire bf16|f16` bit for bit (tokens and last-stage logits), greedy and
//   seeded; their tokens equal generate_full (no wire rounding) on golden-tiny.
// * An Ollama tag resolved through a fake store starts a real worker; a middle stage maps its share.
// * Bench.* (only with PP_WORKER_BENCH_MODEL): per-op overhead and tokens/s of a 2-stage pipeline.
#include "../common/fake_store.hpp"
#include "../common/fixtures.hpp"
#include "../common/node_process.hpp"
#include "../common/worker_process.hpp"
#include "worker/base64.hpp"
#include "worker/startup.hpp"

#include <pp/core/float16.hpp>
#include <pp/model/layer_range.hpp>
#include <pp/net/sha256.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

using json = nlohmann::json;
using pp::test::Worker;
using pp::test::WorkerEnv;
namespace fs = std::filesystem;
namespace b64 = pp::worker::base64;

// ---------------------------------------------------------------- helpers

std::string bin_from_env(const char* var, const char* name) {
  if (const char* b = std::getenv(var)) return b;
  return pp::test::tool_path(name);
}

// A tool run to completion (pp::test::run_process) with stdout and stderr captured; one that has not finished
// after 120 s (scaled) is killed and a test failure.
using pp::test::RunResult;
RunResult run_tool(const std::vector<std::string>& argv) { return pp::test::run_checked(argv, std::chrono::seconds(120)); }

std::string join_ids(const std::vector<int32_t>& v, char sep = ',') {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? std::string(1, sep) : "") + std::to_string(v[i]);
  return s;
}

std::vector<float> f32_of_b64(const std::string& b) {
  const std::string raw = b64::decode(b);
  std::vector<float> v(raw.size() / 4);
  std::memcpy(v.data(), raw.data(), v.size() * 4);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// The `{"event":kind,...}` lines of a worker's stderr.
std::vector<json> events_of(const Worker& w, const std::string& kind) {
  std::vector<json> out;
  std::istringstream in(w.stderr_text());
  std::string line;
  while (std::getline(in, line)) {
    const json j = json::parse(line, nullptr, false);
    if (j.is_object() && j.value("event", "") == kind) out.push_back(j);
  }
  return out;
}

double vm_rss_mb(pid_t pid) { return double(pp::test::proc_status_kib(pid, "VmRSS")) / 1024.0; }

WorkerEnv real_env(const std::string& model, int stage, int n, const WorkerEnv& extra = {}) {
  WorkerEnv e = {{"STAGE", std::to_string(stage)}, {"NUM_STAGES", std::to_string(n)}, {"MODEL", model},
                 {"PP_HEARTBEAT_SECS", "0"}};
  for (const auto& [k, v] : extra) e[k] = v;
  return e;
}

void expect_ok(const json& r, int64_t id) {
  ASSERT_FALSE(r.contains("error")) << r.dump().substr(0, 400);
  EXPECT_EQ(r.at("request_id"), id);
}

void expect_error(const json& r, int64_t id, const std::string& fragment) {
  ASSERT_TRUE(r.contains("error")) << r.dump().substr(0, 400);
  EXPECT_EQ(r.at("request_id"), id);
  EXPECT_NE(r["error"].get<std::string>().find(fragment), std::string::npos)
      << "error '" << r["error"].get<std::string>() << "' lacks '" << fragment << "'";
}

// ---------------------------------------------------------------- models

// Models built once per run in a temporary directory (removed at exit).
struct Models {
  fs::path dir;
  std::string vocab;  // real Llama-3 vocabulary, 4 blocks, hidden 64 (empty when the fixture is absent)
  std::string deep;   // 10 blocks, hidden 64, byte-level vocabulary of 512
  std::string wide;   // 8 blocks, hidden 512: weights dominate the resident set
  std::string skip_reason;

  Models() {
    char tmpl[] = "/tmp/pp_worker_real_XXXXXX";
    dir = ::mkdtemp(tmpl);
    const std::string gguf_bin = bin_from_env("PP_GGUF_BIN", "pp_gguf");
    auto synth = [&](const std::string& name, std::vector<std::string> args) {
      const std::string out = (dir / name).string();
      args.insert(args.begin(), {gguf_bin, "synth", out});
      const RunResult r = run_tool(args);
      if (r.code != 0) throw std::runtime_error("pp_gguf synth " + name + " failed: " + r.err);
      return out;
    };
    deep = synth("deep.gguf", {"--layers", "10", "--embd", "64", "--ff", "128", "--vocab", "512", "--seed", "5"});
    wide = synth("wide.gguf", {"--layers", "8", "--embd", "512", "--ff", "2048", "--vocab", "512", "--seed", "6"});
    const fs::path fixtures = pp::test::shared_fixtures();
    const fs::path vocab_src = fixtures.empty() ? fs::path() : fixtures / "llama3-vocab-only.gguf";
    if (!vocab_src.empty() && fs::exists(vocab_src))
      vocab = synth("vocab.gguf", {"--layers", "4", "--embd", "64", "--ff", "128", "--vocab-from", vocab_src.string()});
    else
      skip_reason = "the real Llama-3 vocabulary (PP_SHARED_FIXTURES/llama3-vocab-only.gguf) is absent: " +
                    (vocab_src.empty() ? std::string("PP_SHARED_FIXTURES is not set or missing") : vocab_src.string());
  }
  ~Models() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

const Models& models() {
  static const Models m;
  return m;
}

std::string golden_tiny(const char* dtype = "f32") {
  return (pp::test::data_dir() / "golden-tiny" / (std::string("golden-tiny-") + dtype + ".gguf")).string();
}

std::vector<int32_t> golden_prompt(const char* p) {
  return pp::test::load_json(pp::test::data_dir() / "golden-tiny" / (std::string("golden-tiny-f32.") + p + ".exact.json"))
      .at("prompt_tokens")
      .get<std::vector<int32_t>>();
}

std::vector<int32_t> golden_greedy(const char* p) {
  return pp::test::load_json(pp::test::data_dir() / "golden-tiny" / (std::string("golden-tiny-f32.") + p + ".exact.json"))
      .at("greedy")
      .get<std::vector<int32_t>>();
}

// ---------------------------------------------------------------- the orchestrator's loop

struct PipelineOutput {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;  // [tokens][vocab] the last stage's logits behind each token
};

// N workers, stage i of N each, driven exactly as the orchestrator drives them.
class Pipeline {
 public:
  Pipeline(const std::string& model, int n, const WorkerEnv& extra = {}, double timeout = pp::test::kTimeout)
      : timeout_(timeout) {
    for (int i = 0; i < n; ++i) workers_.push_back(std::make_unique<Worker>(real_env(model, i, n, extra)));
    for (auto& w : workers_) ready_.push_back(w->reply(timeout_ > 30 ? timeout_ : 30));
  }

  Worker& worker(int i) { return *workers_[std::size_t(i)]; }
  const json& ready(int i) const { return ready_[std::size_t(i)]; }
  int size() const { return int(workers_.size()); }

  // Where stages 1..N-1 begin, from the ready lines: pp_generate's --cuts.
  std::vector<int32_t> cuts() const {
    std::vector<int32_t> c;
    for (std::size_t i = 1; i < ready_.size(); ++i) c.push_back(ready_[i].at("layer_range")[0].get<int32_t>());
    return c;
  }

  json call(int stage, json req) {
    req["request_id"] = next_id_++;
    Worker& w = worker(stage);
    w.send_json(req);
    json r = w.reply(timeout_);
    if (r.contains("error") || r.at("request_id") != req["request_id"])
      throw std::runtime_error("stage " + std::to_string(stage) + ": " + r.dump().substr(0, 400));
    return r;
  }

  // Prefill of `prompt` at position 0, then n_tokens - 1 decode steps, each feeding the sampled
  // token back to the first stage at the next position. `sampling` fields go to forward_and_sample.
  PipelineOutput generate(const std::vector<int32_t>& prompt, int n_tokens, const json& sampling = json::object()) {
    PipelineOutput out;
    int64_t pos = 0;
    for (int i = 0; i < n_tokens; ++i) {
      json r = i == 0 ? call(0, {{"op", "embed_and_forward"}, {"tokens", prompt}, {"position", 0}})
                      : call(0, {{"op", "decode_step"}, {"token_id", out.tokens.back()}, {"position", pos}});
      const int64_t seq_len = r.at("seq_len");
      std::string hidden = r.at("hidden_b64");
      for (int s = 1; s + 1 < size(); ++s)
        hidden = call(s, {{"op", "forward_range"}, {"hidden_b64", hidden}, {"position", pos}, {"seq_len", seq_len}})
                     .at("hidden_b64");
      json req = {{"op", "forward_and_sample"}, {"hidden_b64", hidden}, {"position", pos}, {"seq_len", seq_len},
                  {"return_logits", true}};
      for (const auto& [k, v] : sampling.items()) req[k] = v;
      r = call(size() - 1, req);
      out.tokens.push_back(r.at("token_id"));
      out.logits.push_back(f32_of_b64(r.at("logits_b64")));
      pos += seq_len;
    }
    return out;
  }

 private:
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<json> ready_;
  double timeout_;
  int64_t next_id_ = 1;
};

struct GeneratorOutput {
  PipelineOutput run;
  std::string stderr_text;
};

// pp_generate's tokens (never stopping early), and with `logits` (--logits-out) the logits behind each; its
// stderr has the timings.
GeneratorOutput pp_generate(const std::string& model, const std::vector<int32_t>& prompt, int n_tokens,
                            const std::vector<int32_t>& cuts, const std::string& wire,
                            const std::vector<std::string>& extra = {}, bool logits = true) {
  char tmpl[] = "/tmp/pp_worker_real_gen_XXXXXX";
  const fs::path dir = ::mkdtemp(tmpl);
  const std::string logits_path = (dir / "logits.json").string();
  std::vector<std::string> argv = {bin_from_env("PP_GENERATE_BIN", "pp_generate"), "-m", model, "--prompt-ids",
                                   join_ids(prompt), "-n", std::to_string(n_tokens), "--ignore-eos", "--ids"};
  if (logits) argv.insert(argv.end(), {"--logits-out", logits_path});
  if (!cuts.empty()) argv.insert(argv.end(), {"--cuts", join_ids(cuts), "--wire", wire});
  argv.insert(argv.end(), extra.begin(), extra.end());
  const RunResult r = run_tool(argv);
  GeneratorOutput g;
  g.stderr_text = r.err;
  if (r.code != 0) {
    fs::remove_all(dir);
    throw std::runtime_error("pp_generate failed: " + r.err);
  }
  if (logits) {
    const json j = pp::test::load_json(logits_path);
    g.run.tokens = j.at("greedy").get<std::vector<int32_t>>();
    for (const auto& row : j.at("greedy_logits")) g.run.logits.push_back(row.get<std::vector<float>>());
  } else {  // --ids: stdout is the generated ids alone
    std::istringstream in(r.out);
    for (int32_t t; in >> t;) g.run.tokens.push_back(t);
  }
  fs::remove_all(dir);
  return g;
}

// The pipeline equals pp_generate with the same cuts and wire, bit for bit; returns the pipeline's output.
PipelineOutput expect_equal_to_generator(const std::string& model, int n, const std::vector<int32_t>& prompt,
                                         const std::string& wire = "bf16", const json& sampling = json::object(),
                                         const std::vector<std::string>& gen_sampling = {}) {
  constexpr int kTokens = 17;  // prefill + 16 decode steps
  WorkerEnv extra;
  if (wire == "f16") extra["PP_WIRE_DTYPE"] = "f16";
  Pipeline p(model, n, extra);
  EXPECT_EQ(p.ready(0).at("wire_dtype"), wire);
  const PipelineOutput got = p.generate(prompt, kTokens, sampling);
  const std::vector<int32_t> cuts = p.cuts();
  const int total = p.ready(0).at("total_blocks");
  for (int i = 0; i < n; ++i) {
    const pp::LayerRange r = pp::compute_layer_range(i, n, total);
    EXPECT_EQ(p.ready(i).at("layer_range"), json({r.lo, r.hi})) << "stage " << i << " of " << n;
  }
  const GeneratorOutput want = pp_generate(model, prompt, kTokens, cuts, wire, gen_sampling);
  EXPECT_EQ(got.tokens, want.run.tokens) << n << " stages, cuts " << join_ids(cuts) << ", wire " << wire;
  EXPECT_EQ(got.logits.size(), want.run.logits.size());
  for (std::size_t i = 0; i < std::min(got.logits.size(), want.run.logits.size()); ++i)
    EXPECT_TRUE(same_bits(got.logits[i], want.run.logits[i]))
        << "step " << i << ": logits differ by up to " << max_abs_diff(got.logits[i], want.run.logits[i]) << " ("
        << n << " stages, cuts " << join_ids(cuts) << ", wire " << wire << ")";
  return got;
}

// ---------------------------------------------------------------- real vocabulary: geometry and round trip

TEST(RealVocab, ReadyLineCarriesTheModelGeometry) {
  if (models().vocab.empty()) GTEST_SKIP() << models().skip_reason;
  for (int stage : {0, 1}) {
    Worker w(real_env(models().vocab, stage, 2));
    const json r = w.reply(30);
    EXPECT_EQ(r.at("status"), "ready");
    EXPECT_EQ(r.at("mode"), "real");
    EXPECT_EQ(r.at("wire_dtype"), "bf16");
    EXPECT_EQ(r.at("hidden_dim"), 64);
    EXPECT_EQ(r.at("vocab_size"), 128256);
    EXPECT_EQ(r.at("total_blocks"), 4);
    const int total = r.at("total_blocks");
    EXPECT_EQ(r.at("layer_range"), stage == 0 ? json({0, total / 2}) : json({total / 2, total}));
    EXPECT_EQ(r.at("ctx"), 2048);  // min(4096, the synthetic model's context length 2048)
    EXPECT_EQ(r.at("max_line_bytes"), pp::worker::max_line_bytes(2048, 64));
    // The tokenizer's end-of-generation ids, as llama.cpp picks them for this vocabulary (eos_token_id
    // 128009 <|eot_id|>, and <|eom_id|> by name).
    EXPECT_EQ(r.at("eos_token_ids"), json({128001, 128008, 128009}));
    const std::vector<json> loaded = events_of(w, "model_loaded");
    ASSERT_EQ(loaded.size(), 1u) << w.stderr_text();
    EXPECT_EQ(loaded[0].at("mode"), "real");
    EXPECT_EQ(loaded[0].at("bytes_mapped"), loaded[0].at("bytes_prefetched"));
    EXPECT_GT(loaded[0].at("resident_mb").get<double>(), 0.0);
    for (const char* k : {"load_ms", "map_parse_ms", "prefetch_ms", "tokenizer_ms", "kv_alloc_ms", "file_bytes"})
      EXPECT_TRUE(loaded[0].contains(k)) << k;
  }
}

TEST(RealVocab, PipelineRoundTrip) {
  if (models().vocab.empty()) GTEST_SKIP() << models().skip_reason;
  Worker first(real_env(models().vocab, 0, 2));
  Worker last(real_env(models().vocab, 1, 2));
  first.reply(30);
  last.reply(30);
  const std::string prompt = "Hello, world! The quick brown fox";

  json r = first.call({{"op", "tokenize"}, {"request_id", 1}, {"prompt", prompt}});
  expect_ok(r, 1);
  const auto tokens = r.at("tokens").get<std::vector<int32_t>>();
  ASSERT_GE(tokens.size(), 3u);
  EXPECT_EQ(tokens[0], 128000);  // <|begin_of_text|>: Llama-3 adds BOS
  r = first.call({{"op", "tokenize"}, {"request_id", 2}, {"prompt", prompt}, {"add_bos", false}});
  EXPECT_EQ(r.at("tokens").get<std::vector<int32_t>>(), std::vector<int32_t>(tokens.begin() + 1, tokens.end()));

  const int64_t n = int64_t(tokens.size());
  r = first.call({{"op", "embed_and_forward"}, {"request_id", 3}, {"tokens", tokens}, {"position", 0}});
  expect_ok(r, 3);
  EXPECT_EQ(r.at("seq_len"), n);
  EXPECT_EQ(b64::decode(r.at("hidden_b64").get<std::string>()).size(), std::size_t(n) * 64 * 2);

  r = last.call({{"op", "forward_and_sample"}, {"request_id", 4}, {"hidden_b64", r.at("hidden_b64")},
                 {"position", 0}, {"seq_len", n}, {"return_logits", true}});
  expect_ok(r, 4);
  const int32_t t1 = r.at("token_id");
  EXPECT_GE(t1, 0);
  EXPECT_LT(t1, 128256);
  const std::vector<float> logits = f32_of_b64(r.at("logits_b64"));
  ASSERT_EQ(logits.size(), 128256u);
  EXPECT_EQ(std::max_element(logits.begin(), logits.end()) - logits.begin(), t1);  // argmax without sampling fields

  r = first.call({{"op", "decode_step"}, {"request_id", 5}, {"token_id", t1}, {"position", n}});
  expect_ok(r, 5);
  EXPECT_EQ(r.at("seq_len"), 1);
  EXPECT_EQ(b64::decode(r.at("hidden_b64").get<std::string>()).size(), 64u * 2);

  r = last.call({{"op", "forward_and_sample"}, {"request_id", 6}, {"hidden_b64", r.at("hidden_b64")},
                 {"position", n}, {"seq_len", 1}});
  expect_ok(r, 6);
  const int32_t t2 = r.at("token_id");
  EXPECT_FALSE(r.contains("logits_b64"));

  r = last.call({{"op", "detokenize"}, {"request_id", 7}, {"tokens", tokens}});
  expect_ok(r, 7);
  EXPECT_EQ(r.at("text"), prompt);  // BOS is a control token: left out by default
  r = last.call({{"op", "detokenize"}, {"request_id", 8}, {"tokens", tokens}, {"keep_special", true}});
  EXPECT_EQ(r.at("text"), "<|begin_of_text|>" + prompt);
  r = last.call({{"op", "detokenize"}, {"request_id", 9}, {"tokens", {t1, t2}}, {"keep_special", true}});
  expect_ok(r, 9);
  EXPECT_TRUE(r.at("text").is_string());

  // Each role's ops stay refused on the other stage.
  expect_error(first.call({{"op", "detokenize"}, {"request_id", 10}, {"tokens", {1}}}), 10, "stage 0");
  expect_error(last.call({{"op", "tokenize"}, {"request_id", 11}, {"prompt", "x"}}), 11, "stage 1");
}

TEST(RealVocab, GenerateFullRunsOnEveryStageAndAgrees) {
  if (models().vocab.empty()) GTEST_SKIP() << models().skip_reason;
  std::vector<std::vector<int32_t>> outs;
  for (int stage : {0, 1, 2}) {
    Worker w(real_env(models().vocab, stage, 3));
    ASSERT_EQ(w.reply(30).at("layer_range").size(), 2u);
    const json r = w.call({{"op", "generate_full"}, {"request_id", 1}, {"prompt", "Once upon a time"},
                           {"max_tokens", 8}});
    expect_ok(r, 1);
    outs.push_back(r.at("tokens").get<std::vector<int32_t>>());
    EXPECT_EQ(outs.back().size(), 8u);
  }
  EXPECT_EQ(outs[0], outs[1]);
  EXPECT_EQ(outs[0], outs[2]);
}

// ---------------------------------------------------------------- real vocabulary: KV rules and id ranges

// A gap, a rewind into overwritten ring slots and requests over the capacity are refused, the worker
// keeps serving, and the cache is as it was: the next valid step gives the bytes of a worker that never
// saw the refused requests.
TEST(RealVocab, KvRulesAreErrorsThatLeaveTheCacheAsItWas) {
  if (models().vocab.empty()) GTEST_SKIP() << models().skip_reason;
  const WorkerEnv small = {{"PP_CTX", "8"}};
  Worker w(real_env(models().vocab, 0, 2, small));
  Worker ref(real_env(models().vocab, 0, 2, small));
  Worker last(real_env(models().vocab, 1, 2, small));
  EXPECT_EQ(w.reply(30).at("ctx"), 8);
  ref.reply(30);
  last.reply(30);
  const std::vector<int32_t> prompt = {128000, 9906, 11, 1917, 0};  // <|begin_of_text|>Hello, world!
  expect_ok(w.call({{"op", "embed_and_forward"}, {"request_id", 1}, {"tokens", prompt}}), 1);
  expect_ok(ref.call({{"op", "embed_and_forward"}, {"request_id", 1}, {"tokens", prompt}}), 1);

  // Gap: position 7 with 5 positions cached.
  expect_error(w.call({{"op", "decode_step"}, {"request_id", 2}, {"token_id", 13}, {"position", 7}}), 2,
               "beyond the cached length 5");
  // Over capacity: 9 rows with ctx 8, on the first and on the last stage.
  expect_error(w.call({{"op", "embed_and_forward"}, {"request_id", 3}, {"tokens", std::vector<int32_t>(9, 13)}}), 3,
               "ctx");
  const std::string nine_rows = b64::encode(std::string(9 * 64 * 2, '\0'));
  expect_error(last.call({{"op", "forward_and_sample"}, {"request_id", 4}, {"hidden_b64", nine_rows},
                          {"position", 0}, {"seq_len", 9}}),
               4, "ctx");
  // Still serving, and the refused requests left no trace.
  json a = w.call({{"op", "decode_step"}, {"request_id", 5}, {"token_id", 13}, {"position", 5}});
  json b = ref.call({{"op", "decode_step"}, {"request_id", 5}, {"token_id", 13}, {"position", 5}});
  expect_ok(a, 5);
  EXPECT_EQ(a.at("hidden_b64"), b.at("hidden_b64"));

  // Run past the capacity: positions 6..11, so the ring holds 4..11 and 0..3 are overwritten.
  for (int64_t pos = 6; pos < 12; ++pos) {
    expect_ok(w.call({{"op", "decode_step"}, {"request_id", 10 + pos}, {"token_id", 13}, {"position", pos}}), 10 + pos);
    expect_ok(ref.call({{"op", "decode_step"}, {"request_id", 10 + pos}, {"token_id", 13}, {"position", pos}}),
              10 + pos);
  }
  // Rewind to 6: its window [0, 6] needs overwritten positions.
  expect_error(w.call({{"op", "decode_step"}, {"request_id", 30}, {"token_id", 13}, {"position", 6}}), 30,
               "overwritten");
  // Rewind to 11 (window [4, 11], all still held) is allowed and equals the reference's step 12.
  a = w.call({{"op", "decode_step"}, {"request_id", 31}, {"token_id", 42}, {"position", 11}});
  expect_ok(a, 31);
  b = ref.call({{"op", "decode_step"}, {"request_id", 31}, {"token_id", 42}, {"position", 11}});
  EXPECT_EQ(a.at("hidden_b64"), b.at("hidden_b64"));
  // Position 0 starts a new sequence.
  expect_ok(w.call({{"op", "embed_and_forward"}, {"request_id", 32}, {"tokens", prompt}, {"position", 0}}), 32);
  const std::vector<json> ops = events_of(w, "op");
  EXPECT_GE(ops.size(), 10u);
}

TEST(RealVocab, TokenIdsOutsideTheVocabularyAreRefused) {
  if (models().vocab.empty()) GTEST_SKIP() << models().skip_reason;
  Worker first(real_env(models().vocab, 0, 2));
  Worker last(real_env(models().vocab, 1, 2));
  first.reply(30);
  last.reply(30);
  expect_error(first.call({{"op", "embed_and_forward"}, {"request_id", 1}, {"tokens", {1, 128256}}}), 1,
               "tokens[1]");
  expect_error(first.call({{"op", "decode_step"}, {"request_id", 2}, {"token_id", 200000}, {"position", 0}}), 2,
               "token_id");
  expect_error(last.call({{"op", "detokenize"}, {"request_id", 3}, {"tokens", {128256}}}), 3, "tokens[0]");
  expect_error(first.call({{"op", "generate_full"}, {"request_id", 4}, {"tokens", {128256}}, {"max_tokens", 1}}), 4,
               "tokens[0]");
  expect_ok(first.call({{"op", "embed_and_forward"}, {"request_id", 5}, {"tokens", {128255}}}), 5);
  expect_ok(last.call({{"op", "detokenize"}, {"request_id", 6}, {"tokens", {128255}}}), 6);
}

// The line limit follows the real geometry: ctx 8 x hidden 64 allows a 1 MiB + 1368-byte line.
TEST(RealLimits, LineLimitFollowsTheModelGeometry) {
  Worker w(real_env(golden_tiny(), 1, 2, {{"PP_CTX", "8"}}));
  const json ready = w.reply(30);
  const std::size_t limit = pp::worker::max_line_bytes(8, 64);
  EXPECT_EQ(ready.at("max_line_bytes"), limit);
  w.send_line(R"({"op":"detokenize","request_id":1,"tokens":[1],"pad":")" + std::string(limit, 'x') + "\"}");
  const json r = w.reply();
  EXPECT_TRUE(r.at("request_id").is_null());
  EXPECT_NE(r.at("error").get<std::string>().find("exceeds the limit of " + std::to_string(limit)), std::string::npos)
      << r.dump();
  // Eight rows (the capacity) still fit in one line and are served.
  const std::string eight_rows = b64::encode(std::string(8 * 64 * 2, '\0'));
  w.send_json({{"op", "forward_and_sample"}, {"request_id", 2}, {"hidden_b64", eight_rows}, {"position", 0},
               {"seq_len", 8}});
  expect_ok(w.reply(), 2);
}

// ---------------------------------------------------------------- equivalence with the single-process generator

TEST(Equivalence, GoldenTinyBf16WireEqualsGeneratorAndGenerateFull) {
  const std::string model = golden_tiny();
  float worst = 0;
  for (const char* p : {"p7", "p40"}) {
    const std::vector<int32_t> prompt = golden_prompt(p);
    // generate_full: the whole model, no wire rounding, greedy; equals the float64 reference's greedy.
    Worker full(real_env(model, 0, 2));
    full.reply(30);
    const json r = full.call({{"op", "generate_full"}, {"request_id", 1}, {"tokens", prompt}, {"max_tokens", 17}});
    expect_ok(r, 1);
    const auto reference = r.at("tokens").get<std::vector<int32_t>>();
    const std::vector<int32_t> exact = golden_greedy(p);
    EXPECT_EQ(std::vector<int32_t>(reference.begin(), reference.begin() + long(exact.size())), exact) << p;
    const GeneratorOutput unsplit = pp_generate(model, prompt, 17, {}, "f32");
    EXPECT_EQ(unsplit.run.tokens, reference) << p;

    for (int n : {2, 3, 4}) {
      const PipelineOutput got = expect_equal_to_generator(model, n, prompt);
      EXPECT_EQ(got.tokens, reference) << p << ", " << n << " stages";
      for (std::size_t i = 0; i < std::min(got.logits.size(), unsplit.run.logits.size()); ++i)
        worst = std::max(worst, max_abs_diff(got.logits[i], unsplit.run.logits[i]));
    }
  }
  std::printf("largest |logit| difference the bf16 wire causes on golden-tiny p7/p40 (2-4 stages vs unsplit): %g\n",
              double(worst));
  RecordProperty("bf16_wire_max_logit_diff", std::to_string(worst));
}

// Any model given in PP_WORKER_EQUIV_MODEL (e.g. a 1B-shaped Q8_0 synth, too large for CI): 2 stages.
TEST(Equivalence, ModelFromEnvironment) {
  const char* model = std::getenv("PP_WORKER_EQUIV_MODEL");
  if (!model) GTEST_SKIP() << "set PP_WORKER_EQUIV_MODEL to a GGUF to check a 2-stage worker pipeline against pp_generate";
  expect_equal_to_generator(model, 2, {1, 17, 300, 42, 42, 7});
}

TEST(Equivalence, GoldenTinyModelDtypes) {
  for (const char* dtype : {"f16", "bf16"}) expect_equal_to_generator(golden_tiny(dtype), 2, golden_prompt("p7"));
}

TEST(Equivalence, DeepSyntheticModelTwoToFiveStages) {
  const std::vector<int32_t> prompt = {1, 17, 300, 42, 42, 7, 511, 0, 256, 99, 3};
  for (int n = 2; n <= 5; ++n) expect_equal_to_generator(models().deep, n, prompt);
}

TEST(Equivalence, F16WireEqualsGeneratorF16) {
  expect_equal_to_generator(golden_tiny(), 3, golden_prompt("p40"), "f16");
  expect_equal_to_generator(models().deep, 4, {5, 6, 7, 8, 9}, "f16");
}

TEST(Equivalence, SeededSamplingEqualsGenerator) {
  const json sampling = {{"temperature", 1.3}, {"top_k", 40}, {"top_p", 0.95}, {"min_p", 0.02}, {"seed", 1234}};
  const std::vector<std::string> flags = {"--temperature", "1.3", "--top-k", "40", "--top-p", "0.95",
                                          "--min-p",       "0.02", "--seed", "1234"};
  const PipelineOutput a = expect_equal_to_generator(golden_tiny(), 2, golden_prompt("p7"), "bf16", sampling, flags);
  expect_equal_to_generator(models().deep, 3, {1, 2, 3, 4}, "bf16", sampling, flags);
  // A different seed draws a different sequence (the draw depends on the seed).
  json other = sampling;
  other["seed"] = 99;
  const PipelineOutput b =
      expect_equal_to_generator(golden_tiny(), 2, golden_prompt("p7"), "bf16", other,
                                {"--temperature", "1.3", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.02", "--seed", "99"});
  EXPECT_NE(a.tokens, b.tokens);
}

// ---------------------------------------------------------------- model resolution and residency

TEST(RealOllama, TagInAFakeStoreStartsARealWorker) {
  pp::test::OllamaStore store;  // tests/common/fake_store.hpp; removed after the worker has stopped
  const std::string blob = pp::test::read_text_file(golden_tiny());
  const std::string hex = pp::to_hex(pp::sha256({reinterpret_cast<const uint8_t*>(blob.data()), blob.size()}));
  const fs::path blob_path = store.add_model("golden-tiny", "latest", blob, hex);
  {
    Worker w(real_env("golden-tiny", 0, 2, store.env()));
    const json r = w.reply(30);
    EXPECT_EQ(r.at("status"), "ready");
    EXPECT_EQ(r.at("mode"), "real");
    EXPECT_EQ(r.at("hidden_dim"), 64);
    EXPECT_EQ(r.at("vocab_size"), 512);
    EXPECT_EQ(r.at("layer_range"), json({0, 2}));
    const std::vector<json> resolved = events_of(w, "model_resolved");
    ASSERT_EQ(resolved.size(), 1u);
    EXPECT_EQ(resolved[0].at("how"), "ollama");
    EXPECT_EQ(resolved[0].at("path"), blob_path.string());
    expect_ok(w.call({{"op", "embed_and_forward"}, {"request_id", 1}, {"tokens", {496, 198}}}), 1);
  }
}

// A middle stage maps and pages in only its blocks; generate_full then pages in the rest of the model.
TEST(RealResidency, MiddleStageHoldsItsShare) {
  const std::string model = models().wide;
  Worker w(real_env(model, 1, 4, {{"PP_CTX", "64"}}));
  const json r = w.reply(30);
  EXPECT_EQ(r.at("layer_range"), json({2, 4}));
  const json loaded = events_of(w, "model_loaded").at(0);
  const double file_mb = loaded.at("file_bytes").get<double>() / (1 << 20);
  const double mapped_mb = loaded.at("bytes_mapped").get<double>() / (1 << 20);
  EXPECT_NEAR(mapped_mb, file_mb / 4, file_mb * 0.03) << "2 of 8 blocks, no embeddings, no head";
  const double before = vm_rss_mb(w.pid());
  expect_ok(w.call({{"op", "generate_full"}, {"request_id", 1}, {"tokens", {1, 2, 3}}, {"max_tokens", 1}}), 1);
  const double after = vm_rss_mb(w.pid());
  std::printf("wide model %.1f MB; middle stage 1 of 4 maps %.1f MB, resident %.1f MB; after generate_full %.1f MB\n",
              file_mb, mapped_mb, before, after);
  EXPECT_LT(before, after - 0.6 * (file_mb - mapped_mb)) << "the stage alone must hold far less than the model";
  if (!pp::test::kSanitized) {  // ASan's shadow memory and quarantine are most of a sanitized RSS
    EXPECT_LT(before, 0.5 * file_mb);
  }
}

// ---------------------------------------------------------------- measurements (PP_WORKER_BENCH_MODEL only)

struct OpStats {
  int n = 0;
  double parse = 0, decode = 0, compute = 0, encode = 0, write = 0, total = 0;
  void add(const json& e) {
    ++n;
    parse += e.value("parse_ms", 0.0), decode += e.value("decode_ms", 0.0), compute += e.value("compute_ms", 0.0);
    encode += e.value("encode_ms", 0.0), write += e.value("write_ms", 0.0), total += e.value("total_ms", 0.0);
  }
  void print(const std::string& what) const {
    if (!n) return;
    const double io = parse + decode + encode;
    std::printf("  %-42s n=%-3d compute %8.2f ms | json %6.3f  b64+wire decode %6.3f  encode %6.3f  write %6.3f ms"
                " | overhead %.2f%% of compute\n",
                what.c_str(), n, compute / n, parse / n, decode / n, encode / n, write / n, 100.0 * io / compute);
  }
};

// Prefill of PP_WORKER_BENCH_PREFILL (512) tokens, then PP_WORKER_BENCH_TOKENS (32) decode steps through
// a 2-stage pipeline; per-op JSON/base64 cost vs compute from the op events, tokens/s against pp_generate.
TEST(Bench, TwoStagePipelineOnAModel) {
  const char* model = std::getenv("PP_WORKER_BENCH_MODEL");
  if (!model) GTEST_SKIP() << "set PP_WORKER_BENCH_MODEL to a GGUF (e.g. a Llama-3.2-1B-shaped synth) to measure";
  const int n_prefill = std::getenv("PP_WORKER_BENCH_PREFILL") ? std::atoi(std::getenv("PP_WORKER_BENCH_PREFILL")) : 512;
  const int n_tokens = std::getenv("PP_WORKER_BENCH_TOKENS") ? std::atoi(std::getenv("PP_WORKER_BENCH_TOKENS")) : 32;
  std::vector<int32_t> prompt(static_cast<std::size_t>(n_prefill));
  for (int i = 0; i < n_prefill; ++i) prompt[std::size_t(i)] = int32_t((i * 7919 + 13) % 100000);

  const auto t_load = std::chrono::steady_clock::now();
  Pipeline p(model, 2, {}, 600);
  const double load_s = pp::test::seconds_since(t_load);
  for (int i = 0; i < 2; ++i) {
    const json l = events_of(p.worker(i), "model_loaded").at(0);
    std::printf("stage %d/2: layers [%d, %d) maps %.0f MB, VmRSS after load %.0f MB (load %.0f ms: map+parse %.1f, "
                "prefetch %.0f, tokenizer %.0f, kv %.0f)\n",
                i, p.ready(i)["layer_range"][0].get<int>(), p.ready(i)["layer_range"][1].get<int>(),
                l["bytes_mapped"].get<double>() / 1e6, vm_rss_mb(p.worker(i).pid()), l["load_ms"].get<double>(),
                l["map_parse_ms"].get<double>(), l["prefetch_ms"].get<double>(), l["tokenizer_ms"].get<double>(),
                l["kv_alloc_ms"].get<double>());
  }
  std::printf("pipeline start-up (both stages, in parallel) %.1f s\n", load_s);

  // Prefill (timed alone), then the decode steps.
  const auto t0 = std::chrono::steady_clock::now();
  PipelineOutput first = p.generate(prompt, 1);
  const double prefill_s = pp::test::seconds_since(t0);
  int64_t pos = n_prefill;
  std::vector<int32_t> tokens = first.tokens;
  const auto t1 = std::chrono::steady_clock::now();
  for (int i = 1; i < n_tokens; ++i) {
    const json h = p.call(0, {{"op", "decode_step"}, {"token_id", tokens.back()}, {"position", pos}});
    const json r = p.call(1, {{"op", "forward_and_sample"}, {"hidden_b64", h.at("hidden_b64")}, {"position", pos},
                              {"seq_len", 1}});
    tokens.push_back(r.at("token_id"));
    ++pos;
  }
  const double decode_s = pp::test::seconds_since(t1);
  std::printf("2-stage worker pipeline: prefill %d tokens %.2f s (%.1f tok/s) | decode %d tokens %.2f tok/s\n",
              n_prefill, prefill_s, n_prefill / prefill_s, n_tokens - 1, (n_tokens - 1) / decode_s);

  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // each op event follows its reply
  for (int i = 0; i < 2; ++i) {
    OpStats prefill, decode;
    for (const json& e : events_of(p.worker(i), "op")) {
      if (!e.value("ok", false)) continue;
      (e.value("seq_len", 0) > 1 ? prefill : decode).add(e);
    }
    prefill.print("stage " + std::to_string(i) + " prefill (" + std::to_string(n_prefill) + " rows)");
    decode.print("stage " + std::to_string(i) + " decode (1 row)");
  }

  const GeneratorOutput whole = pp_generate(model, prompt, n_tokens, {}, "f32", {}, false);
  std::printf("pp_generate (one process, same prompt): %s", whole.stderr_text.c_str());
  const GeneratorOutput cut = pp_generate(model, prompt, n_tokens, p.cuts(), "bf16", {}, false);
  std::printf("pp_generate --cuts %s --wire bf16: %s", join_ids(p.cuts()).c_str(), cut.stderr_text.c_str());
  EXPECT_EQ(cut.run.tokens, tokens);
}

}  // namespace
