// pp_worker contract: spawns the real binary (PP_WORKER_BIN) and checks each rule of the stage
// worker protocol (../shared/spec/worker-protocol.md, docs/PROTOCOL-WORKER.md) in its own test.
#include "../common/fake_store.hpp"
#include "../common/worker_process.hpp"
#include "worker/base64.hpp"

#include <pp/core/float16.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

using json = nlohmann::json;
using Env = std::map<std::string, std::string>;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;
namespace b64 = pp::worker::base64;

// The child-process harness (Worker, kTimeout, worker_bin) lives in tests/common/worker_process.hpp.
using pp::test::kTimeout;
using pp::test::seconds_since;
using pp::test::Worker;

Env stub_env(int stage, int n, const Env& extra = {}) {
  Env e = {{"STAGE", std::to_string(stage)}, {"NUM_STAGES", std::to_string(n)}, {"PP_WORKER_STUB", "1"}};
  for (const auto& [k, v] : extra) e[k] = v;
  return e;
}

std::string bytes_of(const json& reply, const char* field = "hidden_b64") {
  return b64::decode(reply.at(field).get<std::string>());
}

// [n * 16] bf16 hidden rows, deterministic and varied.
std::string sample_hidden(int n, int salt = 0) {
  std::string raw;
  for (int i = 0; i < n * 16; ++i) {
    const uint16_t v = pp::f32_to_bf16(float((i * 37 + salt * 11) % 200 - 100) / 128.0f);
    raw.push_back(char(v & 0xff));
    raw.push_back(char(v >> 8));
  }
  return b64::encode(raw);
}

json forward_req(const char* op, int id, int pos, int n, const std::string& hidden) {
  return {{"op", op}, {"request_id", id}, {"position", pos}, {"seq_len", n}, {"hidden_b64", hidden}};
}

void expect_error(const json& r, const json& id, const std::string& fragment) {
  ASSERT_TRUE(r.contains("error")) << r.dump();
  ASSERT_TRUE(r["error"].is_string()) << r.dump();
  EXPECT_EQ(r.at("request_id"), id) << r.dump();
  EXPECT_NE(r["error"].get<std::string>().find(fragment), std::string::npos)
      << "error '" << r["error"].get<std::string>() << "' lacks '" << fragment << "'";
}

// Sends `line` to a fresh stage-`stage`-of-3 stub, expects an error, then proves it still serves.
void expect_bad_request(int stage, const std::string& line, const json& id, const std::string& fragment) {
  Worker w(stub_env(stage, 3));
  w.ready();
  w.send_line(line);
  expect_error(w.reply(), id, fragment);
  const json ok = stage == 0   ? w.call({{"op", "tokenize"}, {"request_id", 4242}, {"prompt", "still here"}})
                  : stage == 1 ? w.call(forward_req("forward_range", 4242, 0, 1, sample_hidden(1)))
                               : w.call({{"op", "detokenize"}, {"request_id", 4242}, {"tokens", {1}}});
  EXPECT_EQ(ok.at("request_id"), 4242) << ok.dump();
  EXPECT_FALSE(ok.contains("error")) << ok.dump();
}

// ---------------------------------------------------------------- start-up

TEST(Startup, ReadyLineIsTheFirstLineAndCarriesTheGeometry) {
  Worker w(stub_env(1, 3));
  const std::optional<std::string> first = w.line();
  ASSERT_TRUE(first.has_value()) << w.stderr_text();
  const json r = json::parse(*first);
  EXPECT_EQ(r.at("status"), "ready");
  EXPECT_EQ(r.at("pid"), w.pid());
  EXPECT_EQ(r.at("stage"), 1);
  EXPECT_EQ(r.at("wire_dtype"), "bf16");
  EXPECT_EQ(r.at("hidden_dim"), 16);
  EXPECT_EQ(r.at("vocab_size"), 32);
  EXPECT_EQ(r.at("total_blocks"), 16);
  EXPECT_EQ(r.at("layer_range"), json({5, 10}));
  EXPECT_EQ(r.at("ctx"), 4096);
  EXPECT_TRUE(r.at("eos_token_ids").is_array());
}

TEST(Startup, StubModeByFlagAsWellAsEnvironment) {
  Worker w(Env{{"STAGE", "0"}, {"NUM_STAGES", "2"}}, {"--stub"});
  EXPECT_EQ(w.ready().at("hidden_dim"), 16);
}

TEST(Startup, WireDTypeF16IsAnnounced) {
  Worker w(stub_env(0, 2, {{"PP_WIRE_DTYPE", "f16"}}));
  EXPECT_EQ(w.ready().at("wire_dtype"), "f16");
}

TEST(Startup, CtxSetsTheAnnouncedCapacity) {
  Worker w(stub_env(0, 2, {{"PP_CTX", "128"}}));
  EXPECT_EQ(w.ready().at("ctx"), 128);
}

TEST(Startup, SurroundingAsciiWhitespaceIsAccepted) {
  Worker w(Env{{"STAGE", " 1\t"}, {"NUM_STAGES", "\n2 "}, {"PP_WORKER_STUB", "1"}});
  EXPECT_EQ(w.ready().at("stage"), 1);
}

// Exit 2 within a second, no ready line, stdin untouched, one stderr line naming var and value.
void expect_startup_refused(const Env& env, const std::string& var, const std::string& value_fragment) {
  const auto t0 = Clock::now();
  Worker w(env, {}, "{\"op\":\"tokenize\",\"request_id\":1,\"prompt\":\"x\"}\n");
  const std::optional<int> code = w.wait_exit(1.0);
  ASSERT_TRUE(code.has_value()) << "still running after 1 s (scaled to this host)";
  EXPECT_LT(seconds_since(t0), 1.0 * pp::test::host_factor());  // the spec's second, on this host
  EXPECT_EQ(*code, 2);
  EXPECT_EQ(w.stdout_so_far(), "") << "printed something on stdout (a ready line?)";
  const std::string err = w.stderr_text();
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_NE(err.find(var), std::string::npos) << err;
  EXPECT_NE(err.find(value_fragment), std::string::npos) << err;
  EXPECT_EQ(w.unread_stdin(), "{\"op\":\"tokenize\",\"request_id\":1,\"prompt\":\"x\"}\n") << "stdin was read";
}

TEST(StartupEnv, StageOutOfRange) { expect_startup_refused(stub_env(2, 2), "STAGE", "'2'"); }
TEST(StartupEnv, StageNegative) {
  expect_startup_refused({{"STAGE", "-1"}, {"NUM_STAGES", "2"}, {"PP_WORKER_STUB", "1"}}, "STAGE", "'-1'");
}
TEST(StartupEnv, StageArabicIndicDigit) {
  expect_startup_refused({{"STAGE", "\xd9\xa0"}, {"NUM_STAGES", "2"}, {"PP_WORKER_STUB", "1"}}, "STAGE",
                         "'\xd9\xa0'");
}
TEST(StartupEnv, NumStagesArabicIndicDigit) {
  expect_startup_refused({{"STAGE", "0"}, {"NUM_STAGES", "\xd9\xa2"}, {"PP_WORKER_STUB", "1"}}, "NUM_STAGES",
                         "'\xd9\xa2'");
}
TEST(StartupEnv, StageEmpty) {
  expect_startup_refused({{"STAGE", ""}, {"NUM_STAGES", "2"}, {"PP_WORKER_STUB", "1"}}, "STAGE", "''");
}
TEST(StartupEnv, StagePlusOne) {
  expect_startup_refused({{"STAGE", "+1"}, {"NUM_STAGES", "2"}, {"PP_WORKER_STUB", "1"}}, "STAGE", "'+1'");
}
TEST(StartupEnv, StageNotAnInteger) {
  expect_startup_refused({{"STAGE", "1.0"}, {"NUM_STAGES", "2"}, {"PP_WORKER_STUB", "1"}}, "STAGE", "'1.0'");
}
TEST(StartupEnv, NumStagesZero) { expect_startup_refused(stub_env(0, 0), "NUM_STAGES", "'0'"); }
TEST(StartupEnv, NumStagesOne) { expect_startup_refused(stub_env(0, 1), "NUM_STAGES", "'1'"); }
TEST(StartupEnv, StageMissing) {
  expect_startup_refused({{"NUM_STAGES", "2"}, {"PP_WORKER_STUB", "1"}}, "STAGE", "not set");
}
TEST(StartupEnv, NumStagesMissing) {
  expect_startup_refused({{"STAGE", "0"}, {"PP_WORKER_STUB", "1"}}, "NUM_STAGES", "not set");
}
TEST(StartupEnv, UnknownWireDType) {
  expect_startup_refused(stub_env(0, 2, {{"PP_WIRE_DTYPE", "f32"}}), "PP_WIRE_DTYPE", "'f32'");
}
TEST(StartupEnv, RefusedEvenInRealMode) {
  expect_startup_refused({{"STAGE", "5"}, {"NUM_STAGES", "2"}, {"MODEL", "whatever:1b"}}, "STAGE", "'5'");
}

// ---------------------------------------------------------------- real mode start-up (model resolution)

// A fake Ollama store (tests/common/fake_store.hpp) holding fake:1b, a GGUF header only; `stage0_env` runs stage 0 of
// 2 on `model` with the store as both $OLLAMA_MODELS and $HOME.
using pp::test::FakeStore;
fs::path add_fake_1b(pp::test::OllamaStore& s) {
  return s.add_model("fake", "1b", std::string("GGUF\x03\0\0\0", 8) + std::string(24, '\0'), std::string(64, 'c'));
}
Env stage0_env(const pp::test::OllamaStore& s, const std::string& model) {
  Env e = s.env();
  e.insert({{"STAGE", "0"}, {"NUM_STAGES", "2"}, {"MODEL", model}});
  return e;
}

TEST_F(FakeStore, RealModeResolvesTheTagBeforeLoading) {
  const fs::path blob = add_fake_1b(*this);
  Worker w(stage0_env(*this, "fake:1b"));
  const std::optional<int> code = w.wait_exit();
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 2);  // the blob is a GGUF header only: no loadable model either way
  EXPECT_EQ(w.stdout_so_far(), "");
  EXPECT_NE(w.stderr_text().find(blob.string()), std::string::npos) << w.stderr_text();
}

TEST_F(FakeStore, RealModeMissingTagListsPathsTried) {
  add_fake_1b(*this);
  Worker w(stage0_env(*this, "fake:70b"));
  ASSERT_EQ(w.wait_exit(), std::optional<int>(2));
  const std::string err = w.stderr_text();
  EXPECT_NE(err.find((root_ / "manifests/registry.ollama.ai/library/fake/70b").string()), std::string::npos) << err;
  EXPECT_EQ(w.stdout_so_far(), "");
}

TEST_F(FakeStore, RealModeWithoutModelExits2) {
  add_fake_1b(*this);
  Env e = stage0_env(*this, "");
  e.erase("MODEL");
  Worker w(e);
  ASSERT_EQ(w.wait_exit(), std::optional<int>(2));
  EXPECT_NE(w.stderr_text().find("no model"), std::string::npos) << w.stderr_text();
}

TEST_F(FakeStore, ModelFlagOverridesEnvironment) {
  add_fake_1b(*this);
  const fs::path notgguf = root_ / "x.gguf";
  std::ofstream(notgguf) << "nope";
  Worker w(stage0_env(*this, "fake:1b"), {"--model", notgguf.string()});
  ASSERT_EQ(w.wait_exit(), std::optional<int>(2));
  EXPECT_NE(w.stderr_text().find("not a GGUF file"), std::string::npos) << w.stderr_text();
}

// ---------------------------------------------------------------- each op on its role (stub)

void expect_stub_hidden(const json& r, int id, int seq_len, bool f16 = false) {
  ASSERT_FALSE(r.contains("error")) << r.dump();
  EXPECT_EQ(r.at("request_id"), id);
  EXPECT_EQ(r.at("seq_len"), seq_len);
  const std::string raw = bytes_of(r);
  ASSERT_EQ(raw.size(), size_t(seq_len) * 16 * 2);
  bool nonzero = false;
  for (size_t i = 0; i < raw.size(); i += 2) {
    const uint16_t h = uint16_t(uint8_t(raw[i]) | uint8_t(raw[i + 1]) << 8);
    const float v = f16 ? pp::f16_to_f32(h) : pp::bf16_to_f32(h);
    EXPECT_TRUE(std::isfinite(v));
    EXPECT_GE(v, -1.0f);
    EXPECT_LT(v, 1.0f);
    nonzero = nonzero || v != 0.0f;
  }
  EXPECT_TRUE(nonzero);
}

TEST(Ops, TokenizeOnFirst) {
  Worker w(stub_env(0, 3));
  w.ready();
  const json r = w.call({{"op", "tokenize"}, {"request_id", 1}, {"prompt", "  hello big\tworld\n"}});
  ASSERT_EQ(r.at("tokens").size(), 3u) << r.dump();
  for (const auto& t : r["tokens"]) EXPECT_GE(t.get<int>(), 0);
  const json empty = w.call({{"op", "tokenize"}, {"request_id", 2}, {"prompt", ""}, {"add_bos", true},
                             {"parse_special", false}});
  EXPECT_EQ(empty.at("tokens"), json::array());
}

TEST(Ops, EmbedAndForwardOnFirst) {
  Worker w(stub_env(0, 3));
  w.ready();
  expect_stub_hidden(w.call({{"op", "embed_and_forward"}, {"request_id", 3}, {"tokens", {1, 2, 3}}}), 3, 3);
  expect_stub_hidden(w.call({{"op", "embed_and_forward"}, {"request_id", 4}, {"tokens", {100000}}, {"position", 9}}),
                     4, 1);
}

TEST(Ops, DecodeStepOnFirst) {
  Worker w(stub_env(0, 3));
  w.ready();
  expect_stub_hidden(w.call({{"op", "decode_step"}, {"request_id", 5}, {"token_id", 7}, {"position", 3}}), 5, 1);
}

TEST(Ops, ForwardRangeOnMiddle) {
  Worker w(stub_env(1, 3));
  w.ready();
  expect_stub_hidden(w.call(forward_req("forward_range", 6, 0, 4, sample_hidden(4))), 6, 4);
}

// Issue 16, finding 8: a non-finite hidden state is refused naming its position; the stage keeps serving.
TEST(Ops, NonFiniteHiddenStateIsRefusedNamingThePosition) {
  for (const int stage : {1, 2}) {
    Worker w(stub_env(stage, 3));
    w.ready();
    std::string raw = b64::decode(sample_hidden(3));
    raw[2 * (16 + 5)] = char(0xc0), raw[2 * (16 + 5) + 1] = char(0x7f);  // row 1, column 5: bf16 NaN
    const char* op = stage == 1 ? "forward_range" : "forward_and_sample";
    expect_error(w.call(forward_req(op, 8, 40, 3, b64::encode(raw))), 8,
                 "row 1 (position 41), column 5 is NaN (bf16 0x7fc0): hidden states must be finite");
    const json ok = w.call(forward_req(op, 9, 40, 3, sample_hidden(3)));
    EXPECT_FALSE(ok.contains("error")) << ok.dump();
  }
}

TEST(Ops, ForwardAndSampleOnLast) {
  Worker w(stub_env(2, 3));
  w.ready();
  const json r = w.call(forward_req("forward_and_sample", 7, 0, 2, sample_hidden(2)));
  ASSERT_TRUE(r.contains("token_id")) << r.dump();
  EXPECT_EQ(r.at("request_id"), 7);
  EXPECT_GE(r["token_id"].get<int>(), 0);
  EXPECT_LT(r["token_id"].get<int>(), 32);
  EXPECT_FALSE(r.contains("logits_b64"));
}

TEST(Ops, ForwardAndSampleReturnsLogits) {
  Worker w(stub_env(1, 2));
  w.ready();
  json req = forward_req("forward_and_sample", 8, 4, 1, sample_hidden(1));
  req["return_logits"] = true;
  const json r = w.call(req);
  const std::string raw = bytes_of(r, "logits_b64");
  ASSERT_EQ(raw.size(), 32u * 4);
  std::vector<float> logits(32);
  std::memcpy(logits.data(), raw.data(), raw.size());
  const int argmax = int(std::max_element(logits.begin(), logits.end()) - logits.begin());
  EXPECT_EQ(r.at("token_id"), argmax);
}

TEST(Ops, ForwardAndSampleAcceptsSamplingFields) {
  Worker w(stub_env(1, 2));
  w.ready();
  json req = forward_req("forward_and_sample", 9, 4, 1, sample_hidden(1));
  req.update({{"temperature", 0.7}, {"top_k", 40}, {"top_p", 1}, {"min_p", 0.05}, {"seed", 18446744073709551615ull}});
  const json r = w.call(req);
  EXPECT_TRUE(r.contains("token_id")) << r.dump();
}

TEST(Ops, DetokenizeOnLast) {
  Worker w(stub_env(2, 3));
  w.ready();
  EXPECT_EQ(w.call({{"op", "detokenize"}, {"request_id", 10}, {"tokens", {3, 17, 0}}}).at("text"), "3 17 0");
  EXPECT_EQ(w.call({{"op", "detokenize"}, {"request_id", 11}, {"tokens", json::array()}, {"keep_special", true}})
                .at("text"),
            "");
}

TEST(Ops, GenerateFullNeedsRealMode) {
  for (int stage = 0; stage < 3; ++stage) {
    Worker w(stub_env(stage, 3));
    w.ready();
    expect_error(w.call({{"op", "generate_full"}, {"request_id", 12}, {"prompt", "hi"}, {"max_tokens", 4}}), 12,
                 "real mode");
  }
}

TEST(Ops, GenerateFullFieldsAreValidated) {
  Worker w(stub_env(0, 2));
  w.ready();
  expect_error(w.call({{"op", "generate_full"}, {"request_id", 1}, {"max_tokens", 4}}), 1, "'prompt'");
  expect_error(w.call({{"op", "generate_full"}, {"request_id", 2}, {"prompt", "x"}, {"max_tokens", 0}}), 2,
               "'max_tokens'");
}

// tokenize -> embed -> forward_range -> sample -> decode_step -> forward_range -> sample -> detokenize.
void run_pipeline(const Env& extra, bool f16) {
  Worker first(stub_env(0, 3, extra)), middle(stub_env(1, 3, extra)), last(stub_env(2, 3, extra));
  first.ready();
  middle.ready();
  last.ready();
  const json toks = first.call({{"op", "tokenize"}, {"request_id", 1}, {"prompt", "the quick brown fox"}});
  const json h0 = first.call({{"op", "embed_and_forward"}, {"request_id", 2}, {"tokens", toks.at("tokens")}});
  expect_stub_hidden(h0, 2, 4, f16);
  const json h1 = middle.call(forward_req("forward_range", 3, 0, 4, h0.at("hidden_b64")));
  expect_stub_hidden(h1, 3, 4, f16);
  const json s1 = last.call(forward_req("forward_and_sample", 4, 0, 4, h1.at("hidden_b64")));
  const json d0 = first.call({{"op", "decode_step"}, {"request_id", 5}, {"token_id", s1.at("token_id")}, {"position", 4}});
  expect_stub_hidden(d0, 5, 1, f16);
  const json d1 = middle.call(forward_req("forward_range", 6, 4, 1, d0.at("hidden_b64")));
  const json s2 = last.call(forward_req("forward_and_sample", 7, 4, 1, d1.at("hidden_b64")));
  const json text = last.call({{"op", "detokenize"}, {"request_id", 8}, {"tokens", {s1.at("token_id"), s2.at("token_id")}}});
  EXPECT_EQ(text.at("text"), std::to_string(s1["token_id"].get<int>()) + " " + std::to_string(s2["token_id"].get<int>()));
}

TEST(Ops, ThreeStagePipelineRoundTrip) { run_pipeline({}, false); }
TEST(Ops, ThreeStagePipelineRoundTripOnF16Wire) { run_pipeline({{"PP_WIRE_DTYPE", "f16"}}, true); }

TEST(Ops, TwoStagePipelineFirstToLast) {
  Worker first(stub_env(0, 2)), last(stub_env(1, 2));
  first.ready();
  last.ready();
  const json h = first.call({{"op", "embed_and_forward"}, {"request_id", 1}, {"tokens", {5, 6}}});
  const json s = last.call(forward_req("forward_and_sample", 2, 0, 2, h.at("hidden_b64")));
  EXPECT_TRUE(s.contains("token_id")) << s.dump();
}

// ---------------------------------------------------------------- each op on a wrong role

struct WrongRoleCase {
  std::string op;
  int stage;  // of 3
};

json valid_request(const std::string& op, int id) {
  if (op == "tokenize") return {{"op", op}, {"request_id", id}, {"prompt", "a b"}};
  if (op == "embed_and_forward") return {{"op", op}, {"request_id", id}, {"tokens", {1}}};
  if (op == "decode_step") return {{"op", op}, {"request_id", id}, {"token_id", 1}, {"position", 1}};
  if (op == "detokenize") return {{"op", op}, {"request_id", id}, {"tokens", {1}}};
  return forward_req(op.c_str(), id, 0, 1, sample_hidden(1));
}

class WrongRole : public ::testing::TestWithParam<WrongRoleCase> {};

TEST_P(WrongRole, IsRefusedNamingOpAndStage) {
  const WrongRoleCase c = GetParam();
  Worker w(stub_env(c.stage, 3));
  w.ready();
  const json r = w.call(valid_request(c.op, 77));
  expect_error(r, 77, "'" + c.op + "'");
  expect_error(r, 77, "stage " + std::to_string(c.stage));
  // Still serving afterwards.
  const std::string own = c.stage == 0 ? "tokenize" : c.stage == 1 ? "forward_range" : "detokenize";
  EXPECT_FALSE(w.call(valid_request(own, 78)).contains("error"));
}

std::vector<WrongRoleCase> wrong_role_cases() {
  const std::map<std::string, int> home = {{"tokenize", 0},      {"embed_and_forward", 0},  {"decode_step", 0},
                                           {"forward_range", 1}, {"forward_and_sample", 2}, {"detokenize", 2}};
  std::vector<WrongRoleCase> cases;
  for (const auto& [op, stage] : home)
    for (int s = 0; s < 3; ++s)
      if (s != stage) cases.push_back({op, s});
  return cases;
}

std::string wrong_role_name(const ::testing::TestParamInfo<WrongRoleCase>& info) {
  static const char* const kRole[] = {"first", "middle", "last"};
  return info.param.op + "_on_" + kRole[info.param.stage];
}

INSTANTIATE_TEST_SUITE_P(Ops, WrongRole, ::testing::ValuesIn(wrong_role_cases()), wrong_role_name);

TEST(Ops, ForwardRangeIsRefusedByBothStagesOfATwoStagePipeline) {
  for (int stage = 0; stage < 2; ++stage) {
    Worker w(stub_env(stage, 2));
    w.ready();
    expect_error(w.call(forward_req("forward_range", 1, 0, 1, sample_hidden(1))), 1, "'forward_range'");
  }
}

// ---------------------------------------------------------------- malformed input, one class per test

TEST(Malformed, NotJson) { expect_bad_request(0, "this is not json", nullptr, "not JSON"); }
TEST(Malformed, TruncatedJson) { expect_bad_request(0, R"({"op":"tokenize","request_id":1)", nullptr, "not JSON"); }
TEST(Malformed, JsonNumber) { expect_bad_request(0, "42", nullptr, "not a JSON object"); }
TEST(Malformed, JsonArray) { expect_bad_request(0, "[]", nullptr, "not a JSON object"); }
TEST(Malformed, JsonString) { expect_bad_request(0, "\"x\"", nullptr, "not a JSON object"); }
TEST(Malformed, MissingOp) { expect_bad_request(0, R"({"request_id":3})", 3, "'op'"); }
TEST(Malformed, OpNotAString) { expect_bad_request(0, R"({"op":5,"request_id":3})", 3, "'op' must be a string"); }
TEST(Malformed, MissingRequestId) { expect_bad_request(0, R"({"op":"tokenize","prompt":"x"})", nullptr, "request_id"); }
TEST(Malformed, RequestIdString) {
  expect_bad_request(0, R"({"op":"tokenize","request_id":"1","prompt":"x"})", nullptr, "request_id");
}
TEST(Malformed, RequestIdFloat) {
  expect_bad_request(0, R"({"op":"tokenize","request_id":1.5,"prompt":"x"})", nullptr, "request_id");
}
TEST(Malformed, RequestIdBoolean) {
  expect_bad_request(0, R"({"op":"tokenize","request_id":true,"prompt":"x"})", nullptr, "request_id");
}
TEST(Malformed, UnknownOp) { expect_bad_request(0, R"({"op":"explode","request_id":3})", 3, "unknown op"); }
TEST(Malformed, BoolAsIntPosition) {
  expect_bad_request(0, R"({"op":"decode_step","request_id":3,"token_id":1,"position":true})", 3,
                     "'position' must be an integer, got boolean");
}
TEST(Malformed, BoolAsIntTokenId) {
  expect_bad_request(0, R"({"op":"decode_step","request_id":3,"token_id":false,"position":0})", 3, "'token_id'");
}
TEST(Malformed, BoolAsIntSeqLen) {
  json r = forward_req("forward_range", 3, 0, 1, sample_hidden(1));
  r["seq_len"] = true;
  expect_bad_request(1, r.dump(), 3, "'seq_len' must be an integer, got boolean");
}
TEST(Malformed, BoolAsIntInTokenList) {
  expect_bad_request(0, R"({"op":"embed_and_forward","request_id":3,"tokens":[1,true]})", 3, "'tokens[1]'");
}
TEST(Malformed, FloatAsInt) {
  expect_bad_request(0, R"({"op":"decode_step","request_id":3,"token_id":1,"position":1.5})", 3, "'position'");
}
TEST(Malformed, NegativePosition) {
  expect_bad_request(0, R"({"op":"decode_step","request_id":3,"token_id":1,"position":-1})", 3, "must be >= 0");
}
TEST(Malformed, NegativeTokenId) {
  expect_bad_request(0, R"({"op":"decode_step","request_id":3,"token_id":-5,"position":0})", 3, "'token_id' is -5");
}
TEST(Malformed, NegativeTokenInList) {
  expect_bad_request(2, R"({"op":"detokenize","request_id":3,"tokens":[1,-2]})", 3, "'tokens[1]' is -2");
}
TEST(Malformed, EmptyTokens) {
  expect_bad_request(0, R"({"op":"embed_and_forward","request_id":3,"tokens":[]})", 3, "'tokens' is empty");
}
TEST(Malformed, TokensNotAList) {
  expect_bad_request(0, R"({"op":"embed_and_forward","request_id":3,"tokens":"1 2"})", 3, "list of integers");
}
TEST(Malformed, MissingRequiredField) {
  expect_bad_request(0, R"({"op":"decode_step","request_id":3,"token_id":1})", 3, "missing field 'position'");
}
TEST(Malformed, PromptNotAString) {
  expect_bad_request(0, R"({"op":"tokenize","request_id":3,"prompt":["a"]})", 3, "'prompt' must be a string");
}
TEST(Malformed, AddBosNotABoolean) {
  expect_bad_request(0, R"({"op":"tokenize","request_id":3,"prompt":"a","add_bos":1})", 3, "'add_bos' must be a boolean");
}
TEST(Malformed, InvalidBase64Character) {
  std::string h = sample_hidden(1);
  h[5] = '*';
  expect_bad_request(1, forward_req("forward_range", 3, 0, 1, h).dump(), 3, "not valid base64");
}
TEST(Malformed, InvalidBase64Length) {
  expect_bad_request(1, forward_req("forward_range", 3, 0, 1, sample_hidden(1).substr(1)).dump(), 3,
                     "not valid base64");
}
TEST(Malformed, InvalidBase64Padding) {
  const std::string h = sample_hidden(1);  // 32 bytes: "...=" at the end
  expect_bad_request(1, forward_req("forward_range", 3, 0, 1, h.substr(0, 4) + "=" + h.substr(5)).dump(), 3,
                     "not valid base64");
}
TEST(Malformed, HiddenTooShort) {
  expect_bad_request(1, forward_req("forward_range", 3, 0, 2, sample_hidden(1)).dump(), 3,
                     "decodes to 32 bytes, expected 64");
}
TEST(Malformed, HiddenTooLong) {
  expect_bad_request(1, forward_req("forward_range", 3, 0, 1, sample_hidden(2)).dump(), 3,
                     "decodes to 64 bytes, expected 32");
}
TEST(Malformed, HiddenLengthMismatchOnLast) {
  expect_bad_request(2, forward_req("forward_and_sample", 3, 0, 3, sample_hidden(2)).dump(), 3, "expected 96");
}
TEST(Malformed, HiddenNotAString) {
  json r = forward_req("forward_range", 3, 0, 1, "");
  r["hidden_b64"] = json::array();
  expect_bad_request(1, r.dump(), 3, "'hidden_b64' must be a string");
}
TEST(Malformed, SeqLenZero) {
  expect_bad_request(1, forward_req("forward_range", 3, 0, 0, "").dump(), 3, "'seq_len' is 0, must be >= 1");
}
TEST(Malformed, SeqLenAboveCtx) {
  expect_bad_request(1, forward_req("forward_range", 3, 0, 5000, "").dump(), 3, "must be <= 4096");
}
json sample_with(const char* field, const json& value) {
  json r = forward_req("forward_and_sample", 3, 0, 1, sample_hidden(1));
  r[field] = value;
  return r;
}
TEST(Malformed, TemperatureZero) { expect_bad_request(2, sample_with("temperature", 0).dump(), 3, "must be > 0"); }
TEST(Malformed, TemperatureNotANumber) {
  expect_bad_request(2, sample_with("temperature", "hot").dump(), 3, "'temperature' must be a number");
}
TEST(Malformed, TopKZero) { expect_bad_request(2, sample_with("top_k", 0).dump(), 3, "'top_k' is 0"); }
TEST(Malformed, TopKBoolean) { expect_bad_request(2, sample_with("top_k", true).dump(), 3, "'top_k' must be an integer"); }
TEST(Malformed, TopPZero) { expect_bad_request(2, sample_with("top_p", 0).dump(), 3, "(0, 1]"); }
TEST(Malformed, TopPAboveOne) { expect_bad_request(2, sample_with("top_p", 1.5).dump(), 3, "(0, 1]"); }
TEST(Malformed, MinPOne) { expect_bad_request(2, sample_with("min_p", 1).dump(), 3, "[0, 1)"); }
TEST(Malformed, SeedNegative) { expect_bad_request(2, sample_with("seed", -1).dump(), 3, "'seed' is -1"); }
TEST(Malformed, SeedNotAnInteger) { expect_bad_request(2, sample_with("seed", 1.5).dump(), 3, "'seed'"); }
TEST(Malformed, ReturnLogitsNotABoolean) {
  expect_bad_request(2, sample_with("return_logits", 1).dump(), 3, "'return_logits' must be a boolean");
}

TEST(Malformed, InvalidUtf8IsNotJson) { expect_bad_request(0, "{\"op\":\"tok\xff\"}", nullptr, "not JSON"); }

// ---------------------------------------------------------------- line limit

TEST(LineLimit, HugeLineIsDrainedAnsweredAndServingContinues) {
  Worker w(stub_env(0, 2));
  const json ready = w.ready();
  const size_t limit = ready.at("max_line_bytes").get<size_t>();
  std::string huge = R"({"op":"tokenize","request_id":1,"prompt":")" + std::string(limit + 4096, 'a') + "\"}\n";
  w.send(huge);
  w.send_json({{"op", "tokenize"}, {"request_id", 2}, {"prompt", "x y"}});
  expect_error(w.reply(), nullptr, "exceeds the limit");
  const json ok = w.reply();
  EXPECT_EQ(ok.at("request_id"), 2);
  EXPECT_EQ(ok.at("tokens").size(), 2u);
}

TEST(LineLimit, HugeLineIsNotBuffered) {
  Worker w(stub_env(0, 2));
  w.ready();
  const long base_kb = w.peak_rss_kb();  // the worker's own footprint (larger under ASan)
  const std::string chunk(size_t(4) << 20, 'x');
  for (int i = 0; i < 16; ++i) w.send(chunk);  // 64 MB, ~50x the stub's limit
  w.send("\n");
  expect_error(w.reply(), nullptr, "67108864 bytes exceeds the limit");
  const long peak_kb = w.peak_rss_kb();
  EXPECT_GT(peak_kb, 0);
  EXPECT_LT(peak_kb - base_kb, 32 * 1024) << "the worker buffered the over-long line (peak " << peak_kb << " KiB, "
                                           << base_kb << " KiB at ready)";
}

TEST(LineLimit, HugeLineAtEndOfInputIsAnswered) {
  Worker w(stub_env(0, 2));
  w.ready();
  w.send(std::string(size_t(3) << 20, 'x'));
  w.close_stdin();
  expect_error(w.reply(), nullptr, "exceeds the limit");
  EXPECT_EQ(w.wait_exit(), std::optional<int>(0));
}

TEST(LineLimit, LargestLegalRequestIsAccepted) {
  Worker w(stub_env(1, 3));
  const json ready = w.ready();
  const int ctx = ready.at("ctx");
  const json r = w.call(forward_req("forward_range", 1, 0, ctx, sample_hidden(ctx)));
  expect_stub_hidden(r, 1, ctx);
}

TEST(LineLimit, LargeRequestWithBrokenBase64IsStillRefused) {
  Worker w(stub_env(1, 3));
  w.ready();
  std::string h = sample_hidden(4096);
  h[h.size() / 2] = '#';
  expect_error(w.call(forward_req("forward_range", 5, 0, 4096, h)), 5, "not valid base64");
  std::string line = forward_req("forward_range", 6, 0, 4096, sample_hidden(4096)).dump();
  line[line.find("hidden_b64") + 20] = '\x01';  // a raw control character: not JSON at all
  w.send_line(line);
  expect_error(w.reply(), nullptr, "not JSON");
}

// ---------------------------------------------------------------- lifecycle

TEST(Lifecycle, EndOfInputAnswersEveryQueuedRequest) {
  Worker w(stub_env(0, 2));
  w.ready();
  std::string batch;
  constexpr int kRequests = 300;
  for (int i = 0; i < kRequests; ++i)
    batch += json({{"op", "decode_step"}, {"request_id", i}, {"token_id", i}, {"position", i}}).dump() + "\n";
  w.send(batch);
  w.close_stdin();
  for (int i = 0; i < kRequests; ++i) {
    const json r = w.reply();
    ASSERT_EQ(r.at("request_id"), i);
    ASSERT_EQ(r.at("seq_len"), 1);
  }
  EXPECT_EQ(w.wait_exit(), std::optional<int>(0));
}

TEST(Lifecycle, LastLineWithoutNewlineIsAnswered) {
  Worker w(stub_env(0, 2));
  w.ready();
  w.send(R"({"op":"tokenize","request_id":1,"prompt":"a"})");
  w.close_stdin();
  EXPECT_EQ(w.reply().at("request_id"), 1);
  EXPECT_EQ(w.wait_exit(), std::optional<int>(0));
}

TEST(Lifecycle, BlankLinesAreSkipped) {
  Worker w(stub_env(0, 2));
  w.ready();
  w.send("\n  \r\n\n");
  EXPECT_EQ(w.call({{"op", "tokenize"}, {"request_id", 1}, {"prompt", "a"}}).at("request_id"), 1);
}

// Two requests that each take the stub's delay; the signal lands during the first: its reply comes, the
// second is never started (no reply for it before the worker closes stdout), and the worker exits 0
// sooner after that reply than the second request alone would take.
void expect_signal_finishes_in_flight(int sig) {
  const double delay = 1.0 * pp::test::host_factor();
  Worker w(stub_env(0, 2, {{"PP_WORKER_STUB_DELAY_MS", std::to_string(int(delay * 1000))}}));
  w.ready();
  w.send_json({{"op", "decode_step"}, {"request_id", 1}, {"token_id", 1}, {"position", 0}});
  w.send_json({{"op", "decode_step"}, {"request_id", 2}, {"token_id", 1}, {"position", 1}});
  std::this_thread::sleep_for(pp::test::slack(std::chrono::milliseconds(200)));  // the first is in flight
  ::kill(w.pid(), sig);
  const json r = w.reply(3.0);
  const auto replied = Clock::now();
  EXPECT_EQ(r.at("request_id"), 1);
  EXPECT_EQ(r.at("seq_len"), 1);
  EXPECT_EQ(w.wait_exit(3.0), std::optional<int>(0));
  EXPECT_LT(seconds_since(replied), delay) << "the queued second request ran too";
  for (const std::string& l : w.rest_lines(0.5)) EXPECT_EQ(l.find("\"request_id\":2"), std::string::npos) << l;
}

TEST(Lifecycle, SigtermFinishesTheInFlightRequestThenExits0) { expect_signal_finishes_in_flight(SIGTERM); }
TEST(Lifecycle, SigintFinishesTheInFlightRequestThenExits0) { expect_signal_finishes_in_flight(SIGINT); }

TEST(Lifecycle, SigtermWhileIdleExitsPromptly) {
  Worker w(stub_env(1, 2));
  w.ready();
  const auto t0 = Clock::now();
  ::kill(w.pid(), SIGTERM);
  EXPECT_EQ(w.wait_exit(2.0), std::optional<int>(0));
  EXPECT_LT(seconds_since(t0), 1.0 * pp::test::host_factor());
}

TEST(Lifecycle, SigtermWhileReadingAPartialLineExits0) {
  Worker w(stub_env(0, 2));
  w.ready();
  w.send(R"({"op":"tokenize","requ)");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ::kill(w.pid(), SIGTERM);
  EXPECT_EQ(w.wait_exit(2.0), std::optional<int>(0));
}

// ---------------------------------------------------------------- stub determinism

TEST(Stub, SameInputSameBytesAcrossProcesses) {
  std::vector<std::string> runs;
  for (int k = 0; k < 2; ++k) {
    Worker first(stub_env(0, 3)), middle(stub_env(1, 3)), last(stub_env(2, 3));
    first.ready();
    middle.ready();
    last.ready();
    const json t = first.call({{"op", "tokenize"}, {"request_id", 1}, {"prompt", "one two three"}});
    const json e = first.call({{"op", "embed_and_forward"}, {"request_id", 2}, {"tokens", t.at("tokens")}, {"position", 5}});
    const json f = middle.call(forward_req("forward_range", 3, 5, 3, e.at("hidden_b64")));
    json s = forward_req("forward_and_sample", 4, 5, 3, f.at("hidden_b64"));
    s["return_logits"] = true;
    const json l = last.call(s);
    runs.push_back(t.dump() + e.dump() + f.dump() + l.dump());
  }
  EXPECT_EQ(runs[0], runs[1]);
}

TEST(Stub, PositionChangesTheHiddenBytes) {
  Worker first(stub_env(0, 3)), middle(stub_env(1, 3));
  first.ready();
  middle.ready();
  auto embed = [&](int pos) {
    return first.call({{"op", "embed_and_forward"}, {"request_id", pos}, {"tokens", {4, 5}}, {"position", pos}})
        .at("hidden_b64");
  };
  auto decode = [&](int pos) {
    return first.call({{"op", "decode_step"}, {"request_id", pos}, {"token_id", 4}, {"position", pos}}).at("hidden_b64");
  };
  auto forward = [&](int pos) {
    return middle.call(forward_req("forward_range", pos, pos, 2, sample_hidden(2))).at("hidden_b64");
  };
  EXPECT_EQ(embed(0), embed(0));
  EXPECT_NE(embed(0), embed(1));
  EXPECT_EQ(decode(7), decode(7));
  EXPECT_NE(decode(7), decode(8));
  EXPECT_EQ(forward(3), forward(3));
  EXPECT_NE(forward(3), forward(4));
}

TEST(Stub, TokensDifferWithInput) {
  Worker first(stub_env(0, 2));
  first.ready();
  const json a = first.call({{"op", "embed_and_forward"}, {"request_id", 1}, {"tokens", {1}}});
  const json b = first.call({{"op", "embed_and_forward"}, {"request_id", 1}, {"tokens", {2}}});
  EXPECT_NE(a.at("hidden_b64"), b.at("hidden_b64"));
}

TEST(Stub, SampleIsDeterministicAndAProbeOverPositionsVaries) {
  Worker last(stub_env(1, 2));
  last.ready();
  const std::string h = sample_hidden(1);
  std::set<int> tokens;
  for (int pos = 0; pos < 16; ++pos) {
    const int t = last.call(forward_req("forward_and_sample", pos, pos, 1, h)).at("token_id");
    EXPECT_EQ(last.call(forward_req("forward_and_sample", pos, pos, 1, h)).at("token_id"), t);
    tokens.insert(t);
  }
  EXPECT_GT(tokens.size(), 1u);
}

TEST(Stub, TokenIdsAreNotRangeChecked) {
  Worker first(stub_env(0, 2));
  first.ready();
  EXPECT_FALSE(first.call({{"op", "decode_step"}, {"request_id", 1}, {"token_id", 128255}, {"position", 0}})
                   .contains("error"));
}

// ---------------------------------------------------------------- events

TEST(Events, OnStdoutTheyNeverCarryRequestId) {
  Worker w(stub_env(0, 2, {{"PP_WORKER_EVENTS", "1"}, {"PP_HEARTBEAT_SECS", "1"}}));
  w.send_json({{"op", "tokenize"}, {"request_id", 1}, {"prompt", "a b"}});
  w.send_json({{"op", "embed_and_forward"}, {"request_id", 2}, {"tokens", {1}}});
  w.send_line("{broken");
  std::vector<std::string> lines;  // everything up to the first heartbeat, then the rest after stdin closes
  while (auto l = w.line()) {
    lines.push_back(*l);
    if (l->find("\"event\":\"heartbeat\"") != std::string::npos) break;
  }
  w.close_stdin();
  for (std::string& l : w.rest_lines()) lines.push_back(std::move(l));
  ASSERT_EQ(w.wait_exit(), std::optional<int>(0));
  std::vector<json> replies;
  std::set<std::string> kinds;
  for (const std::string& l : lines) {
    const json j = json::parse(l);
    if (j.contains("event")) {
      EXPECT_FALSE(j.contains("request_id")) << l;
      kinds.insert(j["event"].get<std::string>());
      if (j["event"] == "op") {
        for (const char* k : {"op", "compute_ms", "decode_ms", "encode_ms", "total_ms"})
          EXPECT_TRUE(j.contains(k)) << k << " missing in " << l;
      }
    } else {
      replies.push_back(j);
    }
  }
  ASSERT_EQ(replies.size(), 4u);
  EXPECT_EQ(replies[0].at("status"), "ready");
  EXPECT_EQ(replies[1].at("request_id"), 1);
  EXPECT_EQ(replies[2].at("request_id"), 2);
  EXPECT_TRUE(replies[3].at("request_id").is_null());
  for (const char* k : {"starting", "model_loaded", "op", "heartbeat", "exiting"}) EXPECT_TRUE(kinds.count(k)) << k;
}

TEST(Events, GoToStderrByDefault) {
  Worker w(stub_env(0, 2));
  w.send_json({{"op", "tokenize"}, {"request_id", 1}, {"prompt", "a"}});
  w.close_stdin();
  const std::vector<std::string> lines = w.rest_lines();
  ASSERT_EQ(w.wait_exit(), std::optional<int>(0));
  ASSERT_EQ(lines.size(), 2u);
  for (const std::string& l : lines) EXPECT_FALSE(json::parse(l).contains("event")) << l;
  const std::string err = w.stderr_text();
  EXPECT_NE(err.find("\"event\":\"starting\""), std::string::npos) << err;
  EXPECT_NE(err.find("\"event\":\"op\""), std::string::npos) << err;
  EXPECT_EQ(err.find("request_id"), std::string::npos) << err;
}

}  // namespace
