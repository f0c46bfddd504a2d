// pp_node real mode (tcp-node.md, issue 5): chains of real processes on loopback against the in-process reference, handshake refusals, faults.
//
// Suites: the tests named Fault* run under meson's 'fault' suite, the rest under 'contract'.
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "../../tools/common/synth.hpp"
#include "../common/fixtures.hpp"
#include "../common/node_model_client.hpp"
#include "../common/fake_peer.hpp"
#include "../common/node_process.hpp"
#include "pp/io/gguf.hpp"
#include "pp/io/llama_loader.hpp"
#include "pp/io/mmap.hpp"
#include "pp/generation.hpp"
#include "pp/kernels/simd.hpp"
#include "pp/local_pipeline.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/model_link.hpp"
#include "pp/net/mux_frame.hpp"
#include "pp/net/sha256.hpp"
#include "pp/text/sampler.hpp"
#include "pp/text/tokenizer.hpp"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using pp::test::FakePeer;
using pp::test::slack;
using pp::test::Clock;
using pp::test::Millis;
using pp::test::Process;
using pp::test::RawSocket;
using pp::test::RunResult;

// ---------------------------------------------------------------- models

using pp::test::node_bin;
std::string generate_bin() {
  const char* p = std::getenv("PP_GENERATE_BIN");
  return p ? p : "";
}

std::string golden(const std::string& dtype) {
  return (pp::test::data_dir() / "golden-tiny" / ("golden-tiny-" + dtype + ".gguf")).string();
}

// Synthetic models written once per test process into its own temporary directory.
struct SynthModels {
  fs::path dir;
  std::string mid;  // hidden 128, 8 layers: the "larger" model of the equality tests
  std::string big;  // hidden 256, 8 layers: slow enough per token to kill a worker mid-generation
  SynthModels() {
    char tmpl[] = "/tmp/pp_node_model_test.XXXXXX";
    dir = mkdtemp(tmpl);
    pp::synth::Spec s;
    s.n_vocab = 512, s.n_embd = 128, s.n_layer = 8, s.n_head = 4, s.n_head_kv = 2, s.n_ff = 384, s.ctx = 4096;
    s.seed = 11, s.name = "pp-synth-node-mid";
    mid = (dir / "synth-mid.gguf").string();
    pp::synth::write(s, mid);
    s.n_embd = 256, s.n_head = 8, s.n_head_kv = 4, s.n_ff = 768, s.seed = 12, s.name = "pp-synth-node-big";
    big = (dir / "synth-big.gguf").string();
    pp::synth::write(s, big);
  }
  ~SynthModels() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

const SynthModels& synth() {
  static SynthModels m;
  return m;
}

// ---------------------------------------------------------------- processes

using pp::test::node_argv;
RunResult run(const std::vector<std::string>& argv, Millis timeout = 25s) { return pp::test::run_checked(argv, timeout); }

// Model workers (pp::test::NodeWorker) on ephemeral loopback ports, learnt from their listening lines.
using Worker = pp::test::NodeWorker;
using pp::test::start_node_worker;
using pp::test::chain_of;
using pp::test::expect_passed;

std::vector<Worker> start_workers(const std::string& model, std::size_t n) {
  std::vector<Worker> ws;
  for (std::size_t i = 0; i < n; ++i) {
    auto w = start_node_worker(model);
    if (!w) return {};
    ws.push_back(std::move(*w));
  }
  return ws;
}

std::string join(const std::vector<int>& v) {
  std::string s;
  for (int x : v) {
    if (!s.empty()) s += ',';
    s += std::to_string(x);
  }
  return s;
}

std::vector<int32_t> tokens_line(const std::string& out) {
  std::smatch m;
  std::vector<int32_t> t;
  if (!std::regex_search(out, m, std::regex("\n  tokens:([ 0-9]*)\n"))) return t;
  std::stringstream ss(m[1].str());
  int32_t x;
  while (ss >> x) t.push_back(x);
  return t;
}

std::vector<float> read_f32(const std::string& path) {
  const std::string b = pp::test::read_text_file(path);
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}

// ---------------------------------------------------------------- the single-process reference

struct Reference {
  std::vector<int32_t> tokens;
  std::vector<float> logits;  // [tokens, n_vocab] of every sampled position
};

// pp_generate's loop over pp::LocalPipeline: prompt, then one token at a time, never stopping early.
Reference reference(const std::string& model, const std::vector<int>& cuts, const std::vector<int32_t>& prompt,
                    std::size_t n, const pp::SamplingParams& sp = {}, unsigned threads = 1) {
  pp::LocalPipeline pipe(model, cuts, pp::WireDType::F32, {.threads = threads});
  pp::Generation gen(pipe, {.sampling = sp, .max_tokens = n});
  gen.prefill(prompt);
  Reference r;
  while (gen.step()) r.logits.insert(r.logits.end(), gen.logits().begin(), gen.logits().end());
  r.tokens = gen.tokens();
  return r;
}

// ---------------------------------------------------------------- a raw version-2 client

using pp::test::active_sessions;
using pp::test::handshake;
using pp::test::hello_for;
using pp::test::identity_of;
using pp::test::mux_close;
using pp::test::mux_handshake;
using pp::test::mux_open;
using pp::test::status_count;
using pp::test::V2Client;
using pp::test::V2Frame;
using pp::test::wait_sessions;

// ================================================================ frame and handshake units

TEST(ModelFrame, HeaderLayoutIsTheDocumentedOne) {
  pp::net::ModelHeader h;
  h.type = pp::net::kTypeBatch;
  h.seq = 0x01020304;
  h.layer_lo = 8;
  h.layer_hi = 16;
  h.payload_bytes = 8192;
  h.session = 0x1122334455667788ull;
  h.pos = 0x0000000100000002ull;
  h.rows = 3;
  h.flags = 1;  // the codec carries any flags byte; what a frame type allows is its own check
  const auto b = pp::net::encode_model_header(h);
  const std::vector<uint8_t> want = {'P', 'C', 'P', 'L', 2, 8, 0, 0, 1, 2, 3, 4, 0, 0, 0, 8, 0, 0, 0, 16, 0, 0, 0x20, 0,
                                     0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0, 0, 0, 1, 0, 0, 0, 2,
                                     0, 0, 0, 3, 0, 1, 0, 0};
  EXPECT_EQ(std::vector<uint8_t>(b.begin(), b.end()), want);
  const auto back = pp::net::decode_model_header(pp::net::decode_header(b), std::span(b).subspan(24));
  EXPECT_EQ(back.session, h.session);
  EXPECT_EQ(back.pos, h.pos);
  EXPECT_EQ(back.rows, h.rows);
  EXPECT_EQ(back.flags, h.flags);
  EXPECT_EQ(back.seq, h.seq);
}

// The BATCH refusals test_serve_parts (BatchFrame.TableRoundTripsAndEveryCheckRefuses) leaves out or checks
// only for a throw: each names the field, its value and the limit.
TEST(ModelFrame, BatchBoundsNameFieldValueAndLimit) {
  using pp::net::BatchEntry;
  pp::net::ModelHeader ok;
  ok.type = pp::net::kTypeBatch, ok.seq = 3, ok.session = 9, ok.layer_lo = 2, ok.layer_hi = 4, ok.rows = 2;
  ok.payload_bytes = uint32_t(pp::net::batch_payload_bytes(2, 2, 64));
  const std::vector<BatchEntry> entries = {{11, 0, 1, 0}, {12, uint64_t{1} << 40, 1, 0}};  // pos 2^40: the limit
  EXPECT_NO_THROW(pp::net::check_batch_count(ok, 2, 64));
  EXPECT_NO_THROW(pp::net::check_batch_entries(ok, entries));
  auto refused = [](auto check, const std::string& needle) {
    try {
      check();
      ADD_FAILURE() << "accepted; expected: " << needle;
    } catch (const pp::FrameError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto count = [&](pp::net::ModelHeader m, uint32_t n) { return [=] { pp::net::check_batch_count(m, n, 64); }; };
  auto table = [&](std::vector<BatchEntry> es) { return [=] { pp::net::check_batch_entries(ok, es); }; };
  refused(count(ok, 0), "BATCH seq 3: n_entries 0 outside [1, min(rows 2, 256)]");
  refused(count(ok, 3), "BATCH seq 3: n_entries 3 outside [1, min(rows 2, 256)]");
  pp::net::ModelHeader tall = ok;  // more rows than the entry limit: the limit is 256 entries
  tall.rows = 300, tall.payload_bytes = uint32_t(pp::net::batch_payload_bytes(257, 300, 64));
  refused(count(tall, 257), "BATCH seq 3: n_entries 257 outside [1, min(rows 300, 256)]");
  refused(count([&] { auto m = ok; m.payload_bytes = 0xFFFFFFFFu; return m; }(), 2),
          "BATCH seq 3: payload_bytes 4294967295 != 4 + 2 entries x 24 + rows 2 x hidden 64 x 4 = 564");
  refused(table({{11, 0, 0, 0}, {12, 0, 2, 0}}), "BATCH seq 3: entry 0 (session 11): rows 0");
  refused(table({{11, 0, 1, 0}, {12, (uint64_t{1} << 40) + 1, 1, 0}}),
          "BATCH seq 3: entry 1 (session 12): pos 1099511627777 > limit 2^40");
  refused(table({{11, 0, 1, 0}, {12, ~uint64_t{0}, 1, 0}}), "entry 1 (session 12): pos 18446744073709551615 > limit 2^40");
  refused(table({{11, 0, 1, 0}, {11, 1, 1, 0}}), "BATCH seq 3: entry 1 (session 11): the session appears twice");
  refused(table({{11, 0, 1, 0}, {12, 0, 2, 0}}), "BATCH seq 3: the entries' rows add up to 3, the header says 2");
}

TEST(Handshake, FingerprintIsTheHeaderAndDirectoryOnly) {
  const auto f32 = identity_of(golden("f32"));
  const auto bf16 = identity_of(golden("bf16"));
  EXPECT_EQ(f32.fingerprint.size(), 64u);
  EXPECT_NE(f32.fingerprint, bf16.fingerprint);  // tensor types differ in the directory
  EXPECT_EQ(f32.n_layer, 4u);
  pp::MappedFile f(golden("f32"));
  const auto g = pp::gguf::parse(f.bytes());
  EXPECT_EQ(f32.fingerprint, pp::to_hex(pp::sha256(f.bytes().first(g.data_offset))));
  EXPECT_LT(g.data_offset, f.size() / 4);  // not a hash of the weights
}

TEST(Handshake, HelloAndWelcomeRoundTrip) {
  pp::net::Hello h = hello_for(golden("f32"), 5000, 2, 4, 2);
  h.chain.push_back(pp::net::Hop{pp::LayerRange{4, 8}, pp::net::Peer{"10.0.0.7", 5001}});
  h.sampling.temperature = 0.7;
  h.sampling.top_p = 0.9;
  h.sampling.seed = 123456789012345ull;
  h.coordinator = {"avx2", 6};
  const pp::net::Hello back = pp::net::decode_hello(pp::net::encode_hello(h));
  EXPECT_EQ(back.model.fingerprint, h.model.fingerprint);
  EXPECT_EQ(back.ctx, h.ctx);
  ASSERT_EQ(back.chain.size(), 2u);
  EXPECT_EQ(back.chain[1].peer.str(), "10.0.0.7:5001");
  EXPECT_EQ(back.chain[1].range, (pp::LayerRange{4, 8}));
  EXPECT_EQ(*back.sampling.temperature, 0.7);  // %.17g round-trips doubles exactly
  EXPECT_EQ(*back.sampling.top_p, 0.9);
  EXPECT_FALSE(back.sampling.top_k);
  EXPECT_EQ(back.sampling.seed, h.sampling.seed);
  EXPECT_EQ(back.coordinator.arch, "avx2");
  EXPECT_EQ(back.coordinator.threads, 6u);

  pp::net::Welcome w;
  w.stages.push_back({1, {2, 4}, {"avx2", 3}, 256, 1234, "127.0.0.1:5000"});
  const auto wb = pp::net::decode_welcome(pp::net::encode_welcome(w));
  ASSERT_EQ(wb.stages.size(), 1u);
  EXPECT_EQ(wb.stages[0].profile.arch, "avx2");
  EXPECT_EQ(wb.stages[0].bytes_used, 1234u);
}

TEST(Handshake, ChainChecksNameTheLayers) {
  auto msg = [](uint32_t from, std::vector<std::pair<int, int>> ranges) -> std::string {
    std::vector<pp::net::Hop> chain;
    for (auto [lo, hi] : ranges) chain.push_back({{lo, hi}, {"h", 1}});
    try {
      pp::net::check_chain(from, chain, 8, 1);
    } catch (const pp::net::HandshakeError& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(msg(2, {{2, 5}, {5, 8}}), "accepted");
  EXPECT_NE(msg(2, {{3, 8}}).find("gap: the previous stage ends at layer 2 but stage 1 (h:1) was assigned [3, 8); "
                                  "layers [2, 3) would run nowhere"), std::string::npos);
  EXPECT_NE(msg(3, {{2, 8}}).find("overlap: the previous stage ends at layer 3 but stage 1 (h:1) was assigned [2, 8); "
                                  "layers [2, 3) would run twice"), std::string::npos);
  EXPECT_NE(msg(2, {{2, 5}, {4, 8}}).find("overlap"), std::string::npos);
  EXPECT_NE(msg(2, {{2, 5}, {6, 8}}).find("gap"), std::string::npos);
  EXPECT_NE(msg(2, {{2, 6}}).find("the last stage ends at layer 6; layers [6, 8) of the model's 8 would run nowhere"),
            std::string::npos);
  EXPECT_NE(msg(2, {{2, 2}, {2, 8}}).find("empty"), std::string::npos);
  EXPECT_NE(msg(2, {{2, 9}}).find("beyond the model's 8 layers"), std::string::npos);
}

// ================================================================ real mode on loopback

TEST(ModelNode, SelftestPassesTwoAndFourStages) {
  auto r = run(node_argv({"--selftest", "--model", golden("f32"), "--tokens", "24", "--threads", "1"}));
  expect_passed(r, 24, 24);
  r = run(node_argv({"--selftest", "--model", synth().mid, "--cuts", "2,5,7", "--prompt-ids", "1,2,3", "--tokens", "16",
                     "--ignore-eos", "--threads", "1"}));
  expect_passed(r, 16, 16);
  EXPECT_NE(r.out.find("pipe self-test: 4 stages in one process over loopback"), std::string::npos) << r.out;
}

struct ChainCase {
  std::string name;
  std::function<std::string()> model;
  std::vector<int> cuts;
};

class LoopbackChain : public testing::TestWithParam<ChainCase> {};

// N separate processes (coordinator + N-1 workers) give the single-process tokens and logits bit for bit.
TEST_P(LoopbackChain, TokensAndLogitsIdenticalToOneProcess) {
  const ChainCase& c = GetParam();
  const std::string model = c.model();
  auto ws = start_workers(model, c.cuts.size());
  ASSERT_EQ(ws.size(), c.cuts.size());
  const std::vector<int32_t> prompt = {5, 77, 300, 12, 9};
  const std::size_t n = 20;
  const fs::path logits = fs::path(synth().dir) / (c.name + ".logits");
  const auto r = run(node_argv({"--coordinator", chain_of(ws), "--model", model, "--cuts", join(c.cuts), "--prompt-ids",
                                "5,77,300,12,9", "--tokens", std::to_string(n), "--ignore-eos", "--threads", "1",
                                "--verify", "all", "--logits-out", logits.string()}));
  expect_passed(r, n, n);
  const Reference split = reference(model, c.cuts, prompt, n);
  EXPECT_EQ(tokens_line(r.out), split.tokens);
  const std::vector<float> got = read_f32(logits.string());
  ASSERT_EQ(got.size(), split.logits.size());
  EXPECT_EQ(std::memcmp(got.data(), split.logits.data(), got.size() * 4), 0) << "logits differ from LocalPipeline";
  // Split or not, the same bytes (the engine's own invariant, relied on by verification).
  const Reference whole = reference(model, {}, prompt, n, {}, 2);
  EXPECT_EQ(std::memcmp(whole.logits.data(), split.logits.data(), got.size() * 4), 0);
  // And the single-process generator binary agrees on the tokens.
  const auto g = run({generate_bin(), "-m", model, "--prompt-ids", "5,77,300,12,9", "-n", std::to_string(n), "-t", "1",
                      "--ignore-eos", "--ids"});
  ASSERT_EQ(g.code, 0) << g.err;
  EXPECT_EQ(tokens_line("\n  tokens: " + g.out), split.tokens) << g.out;
  for (auto& w : ws) EXPECT_TRUE(w.proc->running()) << w.proc->err();
}

INSTANTIATE_TEST_SUITE_P(
    Stages, LoopbackChain,
    testing::Values(ChainCase{"tiny2", [] { return golden("f32"); }, {2}},
                    ChainCase{"tiny3", [] { return golden("bf16"); }, {1, 3}},
                    ChainCase{"tiny4", [] { return golden("f16"); }, {1, 2, 3}},
                    ChainCase{"mid2", [] { return synth().mid; }, {4}},
                    ChainCase{"mid3_uneven", [] { return synth().mid; }, {1, 7}},
                    ChainCase{"mid4_uneven", [] { return synth().mid; }, {5, 6, 7}}),
    [](const testing::TestParamInfo<ChainCase>& i) { return i.param.name; });

TEST(ModelNode, SampledTokensMatchTheGenerator) {
  auto ws = start_workers(synth().mid, 2);
  ASSERT_EQ(ws.size(), 2u);
  const auto r = run(node_argv({"--coordinator", chain_of(ws), "--model", synth().mid, "--cuts", "3,6", "--prompt-ids",
                                "7,8,9", "--tokens", "24", "--ignore-eos", "--temperature", "0.9", "--top-k", "40",
                                "--top-p", "0.95", "--seed", "1234", "--threads", "1"}));
  expect_passed(r, 24, 4);  // the default bring-up probe
  EXPECT_NE(r.out.find("verify: bring-up probe of the first 4 tokens"), std::string::npos) << r.out;
  pp::SamplingParams sp;
  sp.temperature = 0.9, sp.top_k = 40, sp.top_p = 0.95, sp.seed = 1234;
  const Reference ref = reference(synth().mid, {}, {7, 8, 9}, 24, sp);
  EXPECT_EQ(tokens_line(r.out), ref.tokens);
  EXPECT_NE(ref.tokens, reference(synth().mid, {}, {7, 8, 9}, 24).tokens) << "sampling should differ from argmax";
}

TEST(ModelNode, TextPromptStreamsAndReportsRates) {
  auto ws = start_workers(golden("f32"), 1);
  ASSERT_EQ(ws.size(), 1u);
  const auto r = run(node_argv({"--coordinator", ws[0].addr(), "--model", golden("f32"), "--prompt", "Hello world",
                                "--tokens", "12", "--threads", "1", "--dump-digests",
                                (fs::path(synth().dir) / "digests.txt").string()}));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("  prompt: "), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("  prefill: \\d+ tokens in [0-9.]+ ms = [0-9.]+ tokens/s\n"))) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("  decode: \\d+ tokens in [0-9.]+ ms = [0-9.]+ tokens/s"))) << r.out;
  // Decoding: BATCH 48 + 4 + 24 + 64 x 4 down, BRES 48 + 4 + 32 (a digest per token: --dump-digests) up.
  EXPECT_NE(r.out.find("  wire: 416 bytes/token per hop while decoding"), std::string::npos) << r.out;
  const auto tokens = tokens_line(r.out);
  ASSERT_FALSE(tokens.empty());
  // One 'position token digest' line per generated token.
  const std::string digests = pp::test::read_text_file(fs::path(synth().dir) / "digests.txt");
  EXPECT_EQ(std::count(digests.begin(), digests.end(), '\n'), long(tokens.size()));
}

TEST(ModelNode, ConcurrentSessionsKeepTheirOwnCache) {
  auto ws = start_workers(synth().mid, 2);
  ASSERT_EQ(ws.size(), 2u);
  // Two coordinators at once through the same workers, different prompts, every token verified.
  auto coord = [&](const std::string& ids) {
    return std::make_unique<Process>(node_argv({"--coordinator", chain_of(ws), "--model", synth().mid, "--cuts", "2,5",
                                                "--prompt-ids", ids, "--tokens", "200", "--ignore-eos", "--threads", "1",
                                                "--verify", "all"}));
  };
  auto a = coord("1,2,3,4");
  auto b = coord("400,300,200");
  const auto ca = a->wait(25s), cb = b->wait(25s);
  ASSERT_TRUE(ca && cb);
  EXPECT_EQ(*ca, 0) << a->out() << a->err();
  EXPECT_EQ(*cb, 0) << b->out() << b->err();
  EXPECT_NE(a->out().find("byte-identity: 200/200 IDENTICAL"), std::string::npos) << a->out();
  EXPECT_NE(b->out().find("byte-identity: 200/200 IDENTICAL"), std::string::npos) << b->out();
  EXPECT_TRUE(wait_sessions(ws[0].port, 0, 5s));
  EXPECT_TRUE(wait_sessions(ws[1].port, 0, 5s));
}

TEST(ModelNode, SessionCountDropsWhenASessionEnds) {
  auto w = start_node_worker(golden("f32"));
  ASSERT_TRUE(w);
  EXPECT_EQ(active_sessions(w->port), 0u);
  // Two multiplexed connections: a with sessions 11 and 12, b with session 21.
  auto a = std::make_unique<V2Client>(w->port);
  auto b = std::make_unique<V2Client>(w->port);
  auto wa = mux_handshake(*a, hello_for(golden("f32"), w->port, 2, 4, 2), 1);
  auto wb = mux_handshake(*b, hello_for(golden("f32"), w->port, 1, 4, 1), 2);
  ASSERT_TRUE(wa && wb);
  ASSERT_EQ(wa->m.type, pp::net::kTypeWelcome) << wa->text();
  ASSERT_EQ(wb->m.type, pp::net::kTypeWelcome) << wb->text();
  EXPECT_TRUE(pp::net::decode_welcome(wa->text()).mux) << wa->text();
  for (auto [c, s] : {std::pair{a.get(), 11}, std::pair{a.get(), 12}, std::pair{b.get(), 21}}) {
    const auto ack = mux_open(*c, uint64_t(s));
    ASSERT_TRUE(ack);
    EXPECT_EQ(ack->m.type, pp::net::kTypeOpen) << ack->text();
    EXPECT_EQ(ack->m.session, uint64_t(s));
  }
  EXPECT_EQ(status_count(w->port, "connections_active"), 2u);
  EXPECT_EQ(active_sessions(w->port), 3u);
  ASSERT_TRUE(mux_close(*a, 12));  // CLOSE frees that session only
  EXPECT_TRUE(wait_sessions(w->port, 2, 3s));
  EXPECT_EQ(status_count(w->port, "connections_active"), 2u);
  a.reset();  // an orderly end frees the connection's sessions
  EXPECT_TRUE(pp::test::wait_connections(w->port, 1, 3s));
  EXPECT_TRUE(wait_sessions(w->port, 1, 3s));
  b->reset();  // an abrupt end frees them too
  EXPECT_TRUE(pp::test::wait_connections(w->port, 0, 3s));
  EXPECT_TRUE(wait_sessions(w->port, 0, 3s));
  EXPECT_EQ(status_count(w->port, "sessions_total"), 3u);
  EXPECT_TRUE(w->proc->wait_stderr("1 session(s) freed as the connection ended", 3s)) << w->proc->err();
  EXPECT_TRUE(w->proc->wait_stderr("ended (0 active)", 3s)) << w->proc->err();
}

TEST(ModelNode, StopsAtEndOfGeneration) {
  // Near-uniform sampling (temperature 50) draws one of the end-of-generation ids within a few hundred
  // tokens; the reference says where, and the chain must stop exactly there (and not with --ignore-eos).
  const std::string model = golden("f32");
  pp::MappedFile f(model);
  const pp::Tokenizer tok = pp::Tokenizer::from_gguf(pp::gguf::parse(f.bytes()));
  ASSERT_FALSE(tok.eog_ids().empty());
  pp::SamplingParams sp;
  sp.temperature = 50.0;
  std::optional<std::size_t> stop;
  Reference ref;
  for (sp.seed = 1; sp.seed < 20 && !stop; ++sp.seed) {
    ref = reference(model, {}, {1, 2, 3}, 600, sp);
    for (std::size_t i = 0; i < ref.tokens.size() && !stop; ++i)
      if (tok.is_eog(ref.tokens[i])) stop = i;
  }
  if (!stop) GTEST_SKIP() << "no end-of-generation token drawn in 19 seeded runs of 600 tokens";
  --sp.seed;
  auto w = start_node_worker(model);
  ASSERT_TRUE(w);
  auto args = [&](bool ignore) {
    std::vector<std::string> a = node_argv({"--coordinator", w->addr(), "--model", model, "--prompt-ids", "1,2,3",
                                            "--tokens", "600", "--temperature", "50", "--seed", std::to_string(sp.seed),
                                            "--threads", "1"});
    if (ignore) a.push_back("--ignore-eos");
    return a;
  };
  const auto r = run(args(false));
  expect_passed(r, *stop + 1, std::min<std::size_t>(4, *stop + 1));
  EXPECT_EQ(tokens_line(r.out), std::vector<int32_t>(ref.tokens.begin(), ref.tokens.begin() + long(*stop) + 1));
  const auto all = run(args(true));
  EXPECT_EQ(tokens_line(all.out), ref.tokens);
}

TEST(ModelNode, OllamaTagResolvesOnEveryEnd) {
  // A local Ollama store holding golden-tiny under the tag "tiny:latest".
  const fs::path store = fs::path(synth().dir) / "ollama";
  const std::string bytes = pp::test::read_text_file(golden("f32"));
  const std::string hex = pp::to_hex(pp::sha256(std::span(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size())));
  fs::create_directories(store / "blobs");
  fs::create_directories(store / "manifests/registry.ollama.ai/library/tiny");
  fs::copy_file(golden("f32"), store / "blobs" / ("sha256-" + hex), fs::copy_options::overwrite_existing);
  std::ofstream(store / "manifests/registry.ollama.ai/library/tiny/latest")
      << R"({"schemaVersion":2,"layers":[{"mediaType":"application/vnd.ollama.image.model","digest":"sha256:)" << hex
      << R"(","size":)" << bytes.size() << "}]}";
  ::setenv("OLLAMA_MODELS", store.c_str(), 1);
  auto w = start_node_worker("tiny:latest");
  ASSERT_TRUE(w);
  const auto r = run(node_argv({"--coordinator", w->addr(), "--model", "tiny", "--prompt-ids", "1,2,3", "--tokens", "8",
                                "--threads", "1", "--verify", "all"}));
  // pp_generate resolves the tag too.
  const auto g = run({generate_bin(), "-m", "tiny", "--prompt-ids", "1,2,3", "-n", "8", "-t", "1", "--ignore-eos", "--ids"});
  ::unsetenv("OLLAMA_MODELS");
  expect_passed(r, 8, 8);
  EXPECT_NE(r.out.find("model: tiny -> " + (store / "blobs" / ("sha256-" + hex)).string()), std::string::npos) << r.out;
  EXPECT_EQ(tokens_line(r.out), reference(golden("f32"), {}, {1, 2, 3}, 8).tokens);
  // Banners name the model as the user did, not by its blob's file name.
  EXPECT_NE(r.out.find("model 'tiny'"), std::string::npos) << r.out;
  EXPECT_NE(w->proc->out().find("model 'tiny:latest'"), std::string::npos) << w->proc->out();
  ASSERT_EQ(g.code, 0) << g.err;
  EXPECT_NE(g.err.find("model: tiny -> "), std::string::npos) << g.err;
  EXPECT_EQ(tokens_line("\n  tokens: " + g.out), reference(golden("f32"), {}, {1, 2, 3}, 8).tokens) << g.out;
}

// ================================================================ handshake refusals

TEST(Handshake, DifferentModelFileIsRefused) {
  auto w = start_node_worker(golden("f32"));
  ASSERT_TRUE(w);
  const auto r = run(node_argv({"--coordinator", w->addr(), "--model", golden("bf16"), "--prompt-ids", "1,2", "--tokens",
                                "4", "--threads", "1"}));
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_NE(r.err.find("worker " + w->addr() + " (stage 1, layers [2, 4)) reports: handshake: different model file: "
                       "the upstream runs 'golden-tiny-bf16.gguf'"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("this worker 'golden-tiny-f32.gguf'"), std::string::npos) << r.err;
  // A model of another geometry says what differs too.
  const auto r2 = run(node_argv({"--coordinator", w->addr(), "--model", synth().mid, "--prompt-ids", "1,2", "--tokens",
                                 "4", "--threads", "1"}));
  EXPECT_EQ(r2.code, 3);
  EXPECT_NE(r2.err.find("n_layer 8 upstream != 4 here; n_embd 128 upstream != 64 here"), std::string::npos) << r2.err;
  EXPECT_TRUE(w->proc->running());
}

TEST(Handshake, DifferentFileDeeperInTheChainIsNamed) {
  auto w1 = start_node_worker(golden("f32"));
  auto w2 = start_node_worker(golden("f16"));
  ASSERT_TRUE(w1 && w2);
  const auto r = run(node_argv({"--coordinator", w1->addr() + "," + w2->addr(), "--model", golden("f32"), "--cuts", "1,2",
                                "--prompt-ids", "1,2", "--tokens", "4", "--threads", "1"}));
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_NE(r.err.find("worker " + w2->addr() + " (stage 2, layers [2, 4)) reports: handshake: different model file"),
            std::string::npos)
      << r.err;
}

TEST(Handshake, OverlappingAndGappedRangesAreRefused) {
  auto w = start_node_worker(golden("f32"));
  ASSERT_TRUE(w);
  struct Case {
    int lo, hi;
    uint32_t from;
    std::string needle;
  };
  for (const Case& c : {Case{2, 4, 1, "layer ranges leave a gap: the previous stage ends at layer 1 but stage 1 "
                                      "(127.0.0.1:" + std::to_string(w->port) + ") was assigned [2, 4)"},
                        Case{2, 4, 3, "layer ranges overlap: the previous stage ends at layer 3"},
                        Case{2, 3, 2, "layers [3, 4) of the model's 4 would run nowhere"}}) {
    V2Client cl(w->port);
    const auto f = handshake(cl, hello_for(golden("f32"), w->port, c.lo, c.hi, c.from));
    ASSERT_TRUE(f);
    EXPECT_EQ(f->m.type, pp::net::kTypeErr);
    EXPECT_NE(f->text().find(c.needle), std::string::npos) << f->text();
    EXPECT_TRUE(cl.closed_by_peer(3s));
  }
  // The coordinator refuses bad cuts itself, before connecting (usage error).
  for (const char* cuts : {"3,2", "2,2", "0,2", "2,4"}) {
    const auto r = run(node_argv({"--coordinator", w->addr() + "," + w->addr(), "--model", golden("f32"), "--cuts", cuts,
                                  "--prompt-ids", "1"}));
    EXPECT_EQ(r.code, 2) << cuts << ": " << r.err;
    EXPECT_NE(r.err.find("strictly increasing"), std::string::npos) << r.err;
  }
  const auto r = run(node_argv({"--coordinator", w->addr(), "--model", golden("f32"), "--cuts", "1,2", "--prompt-ids", "1"}));
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("2 cut(s) for 1 worker(s)"), std::string::npos) << r.err;
  EXPECT_EQ(active_sessions(w->port), 0u);
}

// Entry flags on the multiplexed protocol: through a real 2-worker chain, the entry that asks gets the
// digest and the logits of its sampled position, bit-identical to LocalPipeline; the one that asks
// nothing gets its 4-byte token only.
TEST(MuxEntryFlags, DigestAndLogitsPerEntryMatchLocalPipeline) {
  namespace net = pp::net;
  const std::string model = golden("f32");
  const std::vector<int> cuts = {1, 2};  // this test runs [0, 1) as a coordinator does; workers [1, 2), [2, 4)
  auto ws = start_workers(model, 2);
  ASSERT_EQ(ws.size(), 2u);
  const net::ModelIdentity id = identity_of(model);
  const uint32_t V = id.n_vocab, E = id.n_embd;
  const int n_layer = int(id.n_layer);
  ASSERT_EQ(n_layer, 4);

  constexpr uint64_t kConn = 42, kA = 101, kB = 202;
  V2Client c(ws[0].port);
  net::Hello hello = hello_for(model, ws[0].port, 1, 2, 1);
  hello.chain.push_back(net::Hop{pp::LayerRange{2, n_layer}, net::Peer{"127.0.0.1", ws[1].port}});
  hello.mux = true;
  const auto welcome = handshake(c, hello, kConn);
  ASSERT_TRUE(welcome);
  ASSERT_EQ(welcome->m.type, net::kTypeWelcome) << welcome->text();
  ASSERT_NE(welcome->text().find("mux=1"), std::string::npos) << welcome->text();
  for (const uint64_t s : {kA, kB}) {
    net::ModelHeader h;
    h.type = net::kTypeOpen;
    h.session = s;
    h.layer_lo = 1, h.layer_hi = 2;
    const std::string text = net::encode_sampling(pp::SamplingParams{});  // argmax
    ASSERT_TRUE(c.send_frame(h, std::vector<uint8_t>(text.begin(), text.end())));
    const auto ack = c.read_frame(10s);
    ASSERT_TRUE(ack);
    ASSERT_EQ(ack->m.type, net::kTypeOpen) << ack->text();
    EXPECT_EQ(ack->m.session, s);
  }

  // Stage 0 here, as pp_node --serve runs it; the reference runs each session alone.
  const pp::Stage first(pp::Model::open(model), pp::LayerRange{0, cuts[0]});
  pp::Sequence seq_a = first.new_sequence(), seq_b = first.new_sequence();
  pp::LocalPipeline ref_a(model, cuts, pp::WireDType::F32, {.threads = 1});
  pp::LocalPipeline ref_b(model, cuts, pp::WireDType::F32, {.threads = 1});
  pp::Sampler sampler;

  // One step of both sessions: A feeds `ta` at pos_a, B feeds `tb` at pos_b. Returns the decoded BRES.
  uint32_t seq = 0;
  auto step = [&](const std::vector<int32_t>& ta, uint64_t pos_a, uint8_t flags_a, const std::vector<int32_t>& tb,
                  uint64_t pos_b, uint8_t flags_b, std::vector<uint8_t>& raw) {
    const std::vector<net::BatchEntry> entries = {{kA, pos_a, uint32_t(ta.size()), flags_a},
                                                  {kB, pos_b, uint32_t(tb.size()), flags_b}};
    const std::size_t rows = ta.size() + tb.size();
    std::vector<float> x(rows * E);
    first.embed(ta, x.data());
    first.embed(tb, x.data() + ta.size() * E);
    const std::vector<pp::Stage::BatchEntry> run = {{&seq_a, int64_t(pos_a), ta.size()},
                                                    {&seq_b, int64_t(pos_b), tb.size()}};
    first.forward_batch(run, x.data());
    std::vector<uint8_t> payload = net::encode_batch_table(entries);
    const auto* xb = reinterpret_cast<const uint8_t*>(x.data());
    payload.insert(payload.end(), xb, xb + x.size() * 4);
    net::ModelHeader h;
    h.type = net::kTypeBatch;
    h.seq = ++seq;
    h.session = kConn;
    h.layer_lo = 1, h.layer_hi = 2;
    h.rows = uint32_t(rows);
    EXPECT_TRUE(c.send_frame(h, payload));
    const auto r = c.read_frame(10s);
    if (!r) {
      ADD_FAILURE() << "no reply to BATCH seq " << seq;
      return std::vector<net::EntryResult>{};
    }
    EXPECT_EQ(r->m.type, net::kTypeBatchRes) << r->text();
    EXPECT_EQ(r->m.seq, seq);
    EXPECT_EQ(r->m.session, kConn);
    EXPECT_EQ(r->m.rows, 2u);
    raw = r->payload;
    try {
      return net::decode_batch_res(r->payload, entries, V);
    } catch (const pp::FrameError& e) {
      ADD_FAILURE() << e.what();
      return std::vector<net::EntryResult>{};
    }
  };
  auto same_bytes = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
  };
  auto digest_of = [](const std::vector<float>& v) {
    return pp::sha256(std::span(reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4));
  };

  // Prompts: A asks digest and logits, B nothing.
  const std::vector<int32_t> pa = {5, 77, 300}, pb = {12, 9};
  std::vector<float> la(V), lb(V);
  ref_a.run(pa, 0, la.data());
  ref_b.run(pb, 0, lb.data());
  std::vector<uint8_t> raw;
  auto r = step(pa, 0, net::kEntryDigest | net::kEntryLogits, pb, 0, 0, raw);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(raw.size(), (4 + 32 + 4 * std::size_t{V}) + 4) << "B's entry is its 4-byte token only";
  EXPECT_TRUE(same_bytes(r[0].logits, la)) << "logits differ from LocalPipeline";
  ASSERT_TRUE(r[0].digest);
  EXPECT_EQ(*r[0].digest, digest_of(la));
  EXPECT_EQ(r[0].token, sampler.sample(la, {}, 3));
  EXPECT_FALSE(r[1].digest);
  EXPECT_TRUE(r[1].logits.empty());
  EXPECT_EQ(r[1].token, sampler.sample(lb, {}, 2));
  int32_t tail;
  std::memcpy(&tail, raw.data() + raw.size() - 4, 4);
  EXPECT_EQ(tail, r[1].token);

  // Next step, the flags swapped round: A a digest only, B logits only.
  const std::vector<int32_t> na = {r[0].token}, nb = {r[1].token};
  ref_a.run(na, 3, la.data());
  ref_b.run(nb, 2, lb.data());
  r = step(na, 3, net::kEntryDigest, nb, 2, net::kEntryLogits, raw);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(raw.size(), (4 + 32) + (4 + 4 * std::size_t{V}));
  ASSERT_TRUE(r[0].digest);
  EXPECT_EQ(*r[0].digest, digest_of(la));
  EXPECT_TRUE(r[0].logits.empty());
  EXPECT_FALSE(r[1].digest);
  EXPECT_TRUE(same_bytes(r[1].logits, lb)) << "logits differ from LocalPipeline";
  EXPECT_EQ(r[0].token, sampler.sample(la, {}, 4));
  EXPECT_EQ(r[1].token, sampler.sample(lb, {}, 3));
  for (auto& w : ws) EXPECT_TRUE(w.proc->running()) << w.proc->err();
}

// A middle stage bounds each BRES by the BATCH it sent down, before reading its payload.
TEST(MuxEntryFlags, MiddleStageRefusesABresOfAnotherSize) {
  namespace net = pp::net;
  const std::string model = golden("f32");
  // The next hop: WELCOME with mux=1, the OPEN acked, then 8 bytes for a BATCH whose one entry asks
  // nothing (4 bytes).
  FakePeer below([](int fd) {
    auto read = [fd]() -> std::optional<net::ModelHeader> {
      const auto head = pp::test::read_exact(fd, net::kModelHeaderBytes, 10s);
      if (!head) return std::nullopt;
      const net::ModelHeader m =
          net::decode_model_header(net::decode_header(*head), std::span(*head).subspan(net::kFrameHeaderBytes));
      if (m.payload_bytes && !pp::test::read_exact(fd, m.payload_bytes, 10s)) return std::nullopt;
      return m;
    };
    auto reply = [fd](net::ModelHeader h, uint8_t type, const std::vector<uint8_t>& payload) {
      h.type = type;
      h.payload_bytes = uint32_t(payload.size());
      const auto head = net::encode_model_header(h);
      std::vector<uint8_t> b(head.begin(), head.end());
      b.insert(b.end(), payload.begin(), payload.end());
      (void)::send(fd, b.data(), b.size(), MSG_NOSIGNAL);
    };
    auto hello = read();
    if (!hello) return;
    const std::string w = net::encode_welcome(net::Welcome{{}, true});
    reply(*hello, net::kTypeWelcome, std::vector<uint8_t>(w.begin(), w.end()));
    auto open = read();
    if (!open) return;
    reply(*open, net::kTypeOpen, {});
    auto batch = read();
    if (!batch) return;
    batch->rows = 1;
    reply(*batch, net::kTypeBatchRes, std::vector<uint8_t>(8, 0));
  });
  auto w = start_node_worker(model);
  ASSERT_TRUE(w);
  const net::ModelIdentity id = identity_of(model);
  V2Client c(w->port);
  net::Hello hello = hello_for(model, w->port, 1, 2, 1);
  hello.chain.push_back(net::Hop{pp::LayerRange{2, int(id.n_layer)}, net::Peer{"127.0.0.1", below.port()}});
  hello.mux = true;
  const auto welcome = handshake(c, hello, 42);
  ASSERT_TRUE(welcome);
  ASSERT_EQ(welcome->m.type, net::kTypeWelcome) << welcome->text();
  net::ModelHeader h;
  h.type = net::kTypeOpen;
  h.session = 7;
  h.layer_lo = 1, h.layer_hi = 2;
  const std::string text = net::encode_sampling(pp::SamplingParams{});
  ASSERT_TRUE(c.send_frame(h, std::vector<uint8_t>(text.begin(), text.end())));
  const auto ack = c.read_frame(10s);
  ASSERT_TRUE(ack);
  ASSERT_EQ(ack->m.type, net::kTypeOpen) << ack->text();
  std::vector<uint8_t> payload = net::encode_batch_table(std::vector<net::BatchEntry>{{7, 0, 1, 0}});
  const std::vector<float> row(id.n_embd, 0.25f);
  const auto* rb = reinterpret_cast<const uint8_t*>(row.data());
  payload.insert(payload.end(), rb, rb + row.size() * 4);
  h.type = net::kTypeBatch;
  h.session = 42;
  h.seq = 1;
  h.rows = 1;
  ASSERT_TRUE(c.send_frame(h, payload));
  const auto err = c.read_frame(10s);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->m.type, net::kTypeErr);
  EXPECT_EQ(err->m.session, 42u);
  EXPECT_NE(err->text().find("layers [2, 4)): BRES seq 1 payload_bytes 8 != 4 (token, digest and logits as the BATCH "
                             "entries' flags ask)"),
            std::string::npos)
      << err->text();
  EXPECT_TRUE(w->proc->running());
}

TEST(Handshake, WrongVersionIsRefused) {
  auto w = start_node_worker(golden("f32"));
  ASSERT_TRUE(w);
  {  // a HELLO of another protocol version
    V2Client c(w->port);
    std::string text = pp::net::encode_hello(hello_for(golden("f32"), w->port, 2, 4, 2));
    text.replace(text.find("protocol=2"), 10, "protocol=3");
    ASSERT_TRUE(c.send_text(pp::net::kTypeHello, 1, text));
    const auto f = c.read_frame();
    ASSERT_TRUE(f);
    EXPECT_EQ(f->m.type, pp::net::kTypeErr);
    EXPECT_NE(f->text().find("protocol version: the peer speaks 3, this end speaks 2"), std::string::npos) << f->text();
  }
  {  // a frame header of an unknown version: ERR in the version-1 layout every reader parses
    V2Client c(w->port);
    std::vector<uint8_t> h = {'P', 'C', 'P', 'L', 3, 1, 0, 0, 0, 0, 0, 7, 0, 0, 0, 2, 0, 0, 0, 4, 0, 0, 0, 0};
    ASSERT_TRUE(c.send(h));
    const auto f = c.read_frame();
    ASSERT_TRUE(f);
    EXPECT_EQ(f->version, 1);
    EXPECT_EQ(f->m.type, pp::net::kTypeErr);
    EXPECT_NE(f->text().find("version 3 is not spoken here"), std::string::npos) << f->text();
    EXPECT_TRUE(c.closed_by_peer(3s));
  }
  // The placeholder coordinator (version 1) against a model worker.
  const auto r = run(node_argv({"--coordinator", "127.0.0.1", "--port", std::to_string(w->port), "--hidden", "64",
                                "--layers", "4", "--cut", "2", "--tokens", "2"}));
  EXPECT_EQ(r.code, 3);
  EXPECT_NE(r.err.find("answered FWD seq 0 with ERR: this worker runs a model ('golden-tiny-f32.gguf', 4 layers)"),
            std::string::npos)
      << r.err;
  // A model coordinator (version 2) against a placeholder worker.
  Process pw(node_argv({"--worker", "--host", "127.0.0.1", "--port", "0"}));
  ASSERT_TRUE(pw.wait_output("(Ctrl-C to stop)", 5s));
  std::smatch m;
  const std::string out = pw.out();
  ASSERT_TRUE(std::regex_search(out, m, std::regex("listening on 127\\.0\\.0\\.1:(\\d+)")));
  const auto r2 = run(node_argv({"--coordinator", "127.0.0.1:" + m[1].str(), "--model", golden("f32"), "--prompt-ids", "1",
                                 "--tokens", "2"}));
  EXPECT_EQ(r2.code, 3);
  EXPECT_NE(r2.err.find("speaks version 1 (a placeholder worker, started without --model)"), std::string::npos)
      << r2.err;
  EXPECT_NE(r2.err.find("this worker runs the placeholder (no --model)"), std::string::npos) << r2.err;
  EXPECT_TRUE(w->proc->running());
}

// ================================================================ multi-host: network namespaces and veth

// Runs `ip` (or tc) and returns its exit status and stderr.
RunResult ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"ip"};
  argv.insert(argv.end(), args.begin(), args.end());
  return pp::test::run_process(argv, 10s);
}

// Three namespaces A - B - C joined by two veth pairs; the coordinator in A cannot reach C: the chain does.
TEST(MultiHost, ChainAcrossNamespacesWithVethAndNetem) {
  const std::string tag = std::to_string(::getpid() % 100000);
  const std::string nsA = "ppA" + tag, nsB = "ppB" + tag, nsC = "ppC" + tag;
  const auto probe = ip({"netns", "add", nsA});
  if (probe.code != 0)
    GTEST_SKIP() << "cannot create network namespaces (`ip netns add` exited " << probe.code << ": " << probe.err
                 << "); the multi-host test needs CAP_SYS_ADMIN and CAP_NET_ADMIN";
  struct Cleanup {
    std::vector<std::string> ns;
    ~Cleanup() {
      for (const auto& n : ns) ip({"netns", "del", n});
    }
  } cleanup{{nsA}};
  ASSERT_EQ(ip({"netns", "add", nsB}).code, 0);
  cleanup.ns.push_back(nsB);
  ASSERT_EQ(ip({"netns", "add", nsC}).code, 0);
  cleanup.ns.push_back(nsC);
  const std::string ab = "pa" + tag, ba = "pb" + tag, bc = "pc" + tag, cb = "pd" + tag;
  const std::vector<std::vector<std::string>> setup = {
      {"link", "add", ab, "type", "veth", "peer", "name", ba},
      {"link", "set", ab, "netns", nsA},
      {"link", "set", ba, "netns", nsB},
      {"link", "add", bc, "type", "veth", "peer", "name", cb},
      {"link", "set", bc, "netns", nsB},
      {"link", "set", cb, "netns", nsC},
      {"-n", nsA, "addr", "add", "10.201.1.1/24", "dev", ab},
      {"-n", nsB, "addr", "add", "10.201.1.2/24", "dev", ba},
      {"-n", nsB, "addr", "add", "10.201.2.2/24", "dev", bc},
      {"-n", nsC, "addr", "add", "10.201.2.3/24", "dev", cb},
      {"-n", nsA, "link", "set", ab, "up"},
      {"-n", nsB, "link", "set", ba, "up"},
      {"-n", nsB, "link", "set", bc, "up"},
      {"-n", nsC, "link", "set", cb, "up"},
      {"-n", nsA, "link", "set", "lo", "up"},
      {"-n", nsB, "link", "set", "lo", "up"},
      {"-n", nsC, "link", "set", "lo", "up"}};
  for (const auto& s : setup) {
    const auto r = ip(s);
    ASSERT_EQ(r.code, 0) << "ip " << s[0] << " " << s[1] << " ...: " << r.err;
  }
  // netem needs the sch_netem module; say so and go on without the delay when the kernel lacks it.
  bool delayed = true;
  for (const auto& [ns, dev] : std::vector<std::pair<std::string, std::string>>{{nsA, ab}, {nsB, ba}, {nsB, bc}, {nsC, cb}}) {
    const auto r = pp::test::run_process({"tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"}, 10s);
    if (r.code != 0) {
      delayed = false;
      std::cout << "[ NOTE     ] netem unavailable (tc: " << r.err.substr(0, r.err.find('\n'))
                << "): the chain crosses veth pairs without the 1 ms delay" << std::endl;
      break;
    }
  }
  const std::string model = synth().mid;
  auto in_ns = [&](const std::string& ns, std::vector<std::string> args) {
    std::vector<std::string> argv = {"ip", "netns", "exec", ns, node_bin()};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  };
  const uint16_t p1 = 52101, p2 = 52102;  // fresh namespaces: nothing else binds there
  Process w1(in_ns(nsB, {"--worker", "--model", model, "--host", "0.0.0.0", "--port", std::to_string(p1), "--threads", "1"}));
  Process w2(in_ns(nsC, {"--worker", "--model", model, "--host", "10.201.2.3", "--port", std::to_string(p2), "--threads", "1"}));
  ASSERT_TRUE(w1.wait_output("(Ctrl-C to stop)", 10s)) << w1.err();
  ASSERT_TRUE(w2.wait_output("(Ctrl-C to stop)", 10s)) << w2.err();
  EXPECT_NE(w1.err().find("warning: worker bound to 0.0.0.0:52101 (not loopback)"), std::string::npos) << w1.err();
  const auto r = run(in_ns(nsA, {"--coordinator", "10.201.1.2:" + std::to_string(p1) + ",10.201.2.3:" + std::to_string(p2),
                                 "--model", model, "--cuts", "3,6", "--prompt-ids", "3,1,4,1,5", "--tokens", "24",
                                 "--ignore-eos", "--threads", "1", "--verify", "all"}));
  expect_passed(r, 24, 24);
  EXPECT_EQ(tokens_line(r.out), reference(model, {}, {3, 1, 4, 1, 5}, 24).tokens);
  if (delayed) {
    // Each token crosses two veth links down and two up, each end delayed 1 ms: >= 4 ms per round trip.
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, std::regex("round-trip ms: min (\\d+\\.\\d)")));
    EXPECT_GE(std::stod(m[1]), 3.9) << r.out;
  }
  // The coordinator's namespace cannot reach C: the second hop really went through B.
  const auto direct = run(in_ns(nsA, {"--coordinator", "10.201.2.3:" + std::to_string(p2), "--model", model,
                                      "--prompt-ids", "1", "--tokens", "1", "--timeout", "1"}));
  EXPECT_EQ(direct.code, 3) << direct.err;
}

// ================================================================ faults

TEST(FaultModel, KillMiddleWorkerMidGeneration) {
  const std::string model = synth().big;
  auto ws = start_workers(model, 3);
  ASSERT_EQ(ws.size(), 3u);
  Process coord(node_argv({"--coordinator", chain_of(ws), "--model", model, "--cuts", "2,4,6", "--prompt-ids", "1,2,3,4",
                           "--tokens", "1000000", "--ignore-eos", "--threads", "1", "--verify", "none", "--timeout", "3"}));
  ASSERT_TRUE(coord.wait_output("  prompt: ", 15s)) << coord.err();
  ASSERT_TRUE(wait_sessions(ws[1].port, 1, 5s));  // mid-generation: the run only ends by the kill
  ASSERT_TRUE(coord.running()) << "generation ended before the kill: " << coord.out();
  ws[1].proc->kill_hard();
  const auto t0 = Clock::now();
  const auto code = coord.wait(8s);
  ASSERT_TRUE(code) << "coordinator hung after a middle worker died";
  EXPECT_LT(Clock::now() - t0, 3s + slack(2s));  // --timeout 3 at most, plus the host's reaction time
  EXPECT_EQ(*code, 3);
  // The first worker reports the dead one by address and stage.
  EXPECT_NE(coord.err().find("worker " + ws[1].addr() + " (stage 2, layers [4, 6))"), std::string::npos) << coord.err();
  EXPECT_EQ(coord.out().find("byte-identity:"), std::string::npos);
  // The others stay up, drop the dead session, and serve a new one.
  EXPECT_TRUE(ws[0].proc->running());
  EXPECT_TRUE(ws[2].proc->running());
  EXPECT_TRUE(wait_sessions(ws[0].port, 0, 5s));
  EXPECT_TRUE(wait_sessions(ws[2].port, 0, 5s));
  const auto r = run(node_argv({"--coordinator", ws[0].addr() + "," + ws[2].addr(), "--model", model, "--cuts", "3,5",
                                "--prompt-ids", "1,2,3,4", "--tokens", "8", "--ignore-eos", "--threads", "1", "--verify",
                                "all"}));
  expect_passed(r, 8, 8);
}

TEST(FaultModel, StalledLastWorkerIsNamedWithinSeconds) {
  auto ws = start_workers(golden("f32"), 2);
  ASSERT_EQ(ws.size(), 2u);
  Process coord(node_argv({"--coordinator", chain_of(ws), "--model", golden("f32"), "--cuts", "1,2", "--prompt-ids", "1,2",
                           "--tokens", "1000000", "--ignore-eos", "--threads", "1", "--verify", "none", "--timeout", "1"}));
  ASSERT_TRUE(coord.wait_output("  prompt: ", 10s)) << coord.err();
  ws[1].proc->signal(SIGSTOP);
  const auto t0 = Clock::now();
  const auto code = coord.wait(10s);
  ws[1].proc->signal(SIGCONT);
  ASSERT_TRUE(code) << "coordinator hung on a stalled worker";
  EXPECT_LT(Clock::now() - t0, 1s + slack(3s));  // --timeout 1
  EXPECT_EQ(*code, 3);
  // Named by address and stage, whichever hop's clock ran out first: the coordinator's, or the first worker's
  // (which reports it up) — and whether the stop caught it between frames or inside one.
  EXPECT_NE(coord.err().find("worker " + ws[1].addr() + " (stage 2, layers [2, 4)): timed out"), std::string::npos)
      << coord.err();
  EXPECT_NE(coord.err().find("1.0 s"), std::string::npos) << coord.err();
  EXPECT_TRUE(ws[0].proc->running());
}

void drain_some(int fd) {
  std::vector<uint8_t> b(65536);
  if (pp::test::wait_readable(fd, 5s)) (void)::recv(fd, b.data(), b.size(), 0);
}

RunResult coordinator_against(const std::string& addr) {
  return run(node_argv({"--coordinator", addr, "--model", golden("f32"), "--prompt-ids", "1,2", "--tokens", "4",
                        "--threads", "1", "--timeout", "1", "--load-timeout", "1"}),
             15s);
}

TEST(FaultModel, PeerAcceptsAndNeverAnswersTheHandshake) {
  FakePeer peer([](int) {});
  const auto r = coordinator_against(peer.addr());
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_LT(r.seconds, 1.0 + slack(4s).count() / 1e3);  // --timeout 1, after loading the coordinator's stage
  EXPECT_NE(r.err.find("worker " + peer.addr() + " (stage 1, layers [2, 4)): timed out after 1.0 s without data"),
            std::string::npos)
      << r.err;
}

TEST(FaultModel, PeerSendsGarbageInsteadOfWelcome) {
  FakePeer peer([](int fd) {
    drain_some(fd);
    std::vector<uint8_t> junk(64);
    std::mt19937 rng(3);
    for (auto& b : junk) b = uint8_t(rng());
    ::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
  });
  const auto r = coordinator_against(peer.addr());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("worker " + peer.addr() + " (stage 1, layers [2, 4)): frame: magic:"), std::string::npos) << r.err;
}

TEST(FaultModel, PeerAnnouncesAHugeWelcome) {
  FakePeer peer([](int fd) {
    drain_some(fd);
    pp::net::ModelHeader h;
    h.type = pp::net::kTypeWelcome;
    h.payload_bytes = 0xFFFFFFFFu;
    const auto b = pp::net::encode_model_header(h);
    ::send(fd, b.data(), b.size(), MSG_NOSIGNAL);
  });
  const auto r = coordinator_against(peer.addr());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("WELCOME from worker " + peer.addr() + " (stage 1, layers [2, 4)): payload_bytes 4294967295 > limit 65536"),
            std::string::npos)
      << r.err;
}

// Reads one version-2 frame from a raw fd (for fake workers); false on close or timeout.
bool fake_read_v2(int fd, pp::net::ModelHeader& m, std::vector<uint8_t>& payload) {
  const auto h = pp::test::read_exact(fd, 48, 5s);
  if (!h) return false;
  m = pp::net::decode_model_header(pp::net::decode_header(*h), std::span(*h).subspan(24));
  auto p = pp::test::read_exact(fd, m.payload_bytes, 5s);
  if (!p) return false;
  payload = std::move(*p);
  return true;
}

void fake_send_v2(int fd, pp::net::ModelHeader m, const std::string& payload) {
  m.payload_bytes = static_cast<uint32_t>(payload.size());
  const auto h = pp::net::encode_model_header(m);
  std::string b(h.begin(), h.end());
  b += payload;
  ::send(fd, b.data(), b.size(), MSG_NOSIGNAL);
}

// A worker with other kernels whose digests do not match: the report says both things, exit status 1.
TEST(FaultModel, DifferentProfileAndWrongDigestsAreReported) {
  FakePeer peer([](int fd) {
    pp::net::ModelHeader m;
    std::vector<uint8_t> p;
    if (!fake_read_v2(fd, m, p)) return;
    m.type = pp::net::kTypeWelcome;
    pp::net::Welcome w;
    w.mux = true;
    w.stages.push_back({1, {2, 4}, {"sse4_2", 1}, 2048, 0, "fake"});
    fake_send_v2(fd, m, pp::net::encode_welcome(w));
    while (fake_read_v2(fd, m, p)) {
      if (m.type == pp::net::kTypeOpen) {
        fake_send_v2(fd, m, "");  // the session is open
      } else if (m.type == pp::net::kTypeBatch) {
        const uint32_t n = pp::net::detail::get_be32(p.data());
        std::string res;
        for (uint32_t i = 0; i < n; ++i) {
          const auto e = pp::net::decode_batch_entry(
              std::span<const uint8_t, pp::net::kBatchEntryBytes>(p.data() + 4 + i * pp::net::kBatchEntryBytes, pp::net::kBatchEntryBytes));
          res += std::string(4, '\0');                                              // token 0
          if (e.flags & pp::net::kEntryDigest) res += std::string(32, '\0');        // an all-zero digest
        }
        m.type = pp::net::kTypeBatchRes;
        m.rows = n;
        fake_send_v2(fd, m, res);
      }
    }
  });
  const auto r = run(node_argv({"--coordinator", peer.addr(), "--model", golden("f32"), "--prompt-ids", "1,2", "--tokens",
                                "3", "--ignore-eos", "--threads", "1", "--verify", "all"}));
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("numeric profiles differ (coordinator " + std::string(pp::simd::Best::name()) +
                       "; stage 1 sse4_2): byte-identity with this process is not expected"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("byte-identity: 0/3 identical  FAIL (3)  (numeric profiles differ: identity was not expected)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("  MISMATCH pos=2: distributed 000000000000 local "), std::string::npos) << r.out;
}

// A chain that answers differently once it is re-established: with --resume the replay is checked token by
// token, and a divergence ends the run naming the position and both tokens.
TEST(FaultModel, ReplayThatDivergesEndsTheRun) {
  FakePeer peer(
      [](int fd, int conn) {
        pp::net::ModelHeader m;
        std::vector<uint8_t> p;
        if (!fake_read_v2(fd, m, p)) return;  // HELLO
        m.type = pp::net::kTypeWelcome;
        pp::net::Welcome w;
        w.mux = true;
        w.stages.push_back({1, {2, 4}, {pp::simd::Best::name(), 1}, 2048, 0, "fake"});
        fake_send_v2(fd, m, pp::net::encode_welcome(w));
        for (int batches = 0; fake_read_v2(fd, m, p);) {
          if (m.type == pp::net::kTypeOpen) {
            fake_send_v2(fd, m, "");
          } else if (m.type == pp::net::kTypeBatch) {
            if (conn == 0 && ++batches == 4) {  // the first chain fails after three tokens
              ::shutdown(fd, SHUT_RDWR);
              return;
            }
            const int32_t token = conn == 0 ? 5 : 6;  // the second chain samples another token
            std::string res(4, '\0');
            std::memcpy(res.data(), &token, 4);
            m.type = pp::net::kTypeBatchRes;
            m.rows = 1;
            fake_send_v2(fd, m, res);
          }
        }
      },
      2);
  const auto r = run(node_argv({"--coordinator", peer.addr(), "--model", golden("f32"), "--prompt-ids", "1,2", "--tokens",
                                "10", "--ignore-eos", "--threads", "1", "--verify", "none", "--timeout", "2", "--resume",
                                "30"}));
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_NE(r.err.find("resuming: re-establishing the chain and replaying 4 positions"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("replay diverged at position 2: the new chain sampled token 6 where the session had 5"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("byte-identity:"), std::string::npos) << r.out;
}

TEST(FaultModel, RandomBytesCloseThatConnectionOnly) {
  auto w = start_node_worker(golden("f32"), {"--timeout", "1"});
  ASSERT_TRUE(w);
  std::mt19937 rng(11);
  for (int trial = 0; trial < 8; ++trial) {
    V2Client c(w->port);
    std::vector<uint8_t> junk(1 + rng() % 200);
    for (auto& b : junk) b = uint8_t(rng());
    if (trial % 2) std::memcpy(junk.data(), "PCPL\x02", std::min<std::size_t>(junk.size(), 5));
    c.send(junk);
    c.closed_by_peer(3s);  // closes, or waits for the rest of an announced frame until we go
  }
  const auto r = run(node_argv({"--coordinator", w->addr(), "--model", golden("f32"), "--prompt-ids", "1,2", "--tokens",
                                "4", "--threads", "1", "--verify", "all"}));
  expect_passed(r, 4, 4);
}

// A BATCH whose header (or, once the header passed, entry count) is outside a bound is refused before the rest
// of its payload is read or any buffer sized by it is made: the header alone (or the header and the count)
// draws the ERR, which names the field, its value and the limit, and the connection closes.
TEST(FaultModel, OversizedFramesRefusedBeforeAllocation) {
  auto w = start_node_worker(golden("f32"), {"--max-ctx", "64"});
  ASSERT_TRUE(w);
  const uint32_t one_row = uint32_t(pp::net::batch_payload_bytes(1, 1, 64));  // 4 + 24 + 256
  struct Case {
    uint32_t rows, payload_bytes;
    std::optional<uint32_t> n_entries;  // sent after the header when set; nothing else follows
    std::string needle;
  };
  for (const Case& c : {Case{1, 0xFFFFFFFFu, 1, "payload_bytes 4294967295 != 4 + 1 entries x 24 + rows 1 x hidden 64 x 4 = 284"},
                        Case{1, one_row, 0xFFFFFFFFu, "n_entries 4294967295 outside [1, min(rows 1, 256)]"},
                        Case{1, 10, std::nullopt, "payload_bytes 10 < 284 (one entry and 1 rows)"},
                        Case{65, uint32_t(pp::net::batch_payload_bytes(1, 65, 64)), std::nullopt,
                             "rows 65 outside [1, 64] (the KV capacity)"},
                        Case{0x40000000u, 0, std::nullopt, "rows 1073741824 outside [1, 64]"}}) {
    SCOPED_TRACE(c.needle);
    V2Client cl(w->port);
    pp::net::Hello h = hello_for(golden("f32"), w->port, 2, 4, 2);
    h.ctx = 64;
    const auto wel = mux_handshake(cl, h, 77);
    ASSERT_TRUE(wel);
    ASSERT_EQ(wel->m.type, pp::net::kTypeWelcome) << wel->text();
    const auto ack = mux_open(cl, 5);
    ASSERT_TRUE(ack);
    ASSERT_EQ(ack->m.type, pp::net::kTypeOpen) << ack->text();
    pp::net::ModelHeader f = pp::test::batch_header(77, 2, 4, 9, {{5, 0, 1, 0}}, 64);
    f.rows = c.rows, f.payload_bytes = c.payload_bytes;
    const auto head = pp::net::encode_model_header(f);
    std::vector<uint8_t> b(head.begin(), head.end());
    if (c.n_entries) b.insert(b.end(), {uint8_t(*c.n_entries >> 24), uint8_t(*c.n_entries >> 16),
                                        uint8_t(*c.n_entries >> 8), uint8_t(*c.n_entries)});
    ASSERT_TRUE(cl.send(b));  // no more of the payload follows
    const auto e = cl.read_frame(3s);
    ASSERT_TRUE(e) << "no ERR before the payload";
    EXPECT_EQ(e->m.type, pp::net::kTypeErr);
    EXPECT_EQ(e->m.session, 77u) << "a refused BATCH ends the connection: the ERR carries the connection's session";
    EXPECT_NE(e->text().find("BATCH seq 9: " + c.needle), std::string::npos) << e->text();
    EXPECT_TRUE(cl.closed_by_peer(3s));
  }
  EXPECT_TRUE(wait_sessions(w->port, 0, 3s));
  EXPECT_TRUE(wait_sessions(w->port, 0, 3s));
  // A ctx larger than the worker allows is refused in the handshake.
  V2Client cl(w->port);
  pp::net::Hello h = hello_for(golden("f32"), w->port, 2, 4, 2);
  h.ctx = 65;
  const auto e = mux_handshake(cl, h);
  ASSERT_TRUE(e);
  EXPECT_NE(e->text().find("ctx 65 outside [1, 64] (this worker's --max-ctx)"), std::string::npos) << e->text();
  EXPECT_TRUE(w->proc->running());
}

TEST(FaultModel, TwoHundredStalledPartialHeaders) {
  auto w = start_node_worker(golden("f32"));
  ASSERT_TRUE(w);
  std::vector<std::unique_ptr<RawSocket>> stalled;
  for (int i = 0; i < 200; ++i) {
    stalled.push_back(std::make_unique<RawSocket>(w->port));
    stalled.back()->send({'P', 'C', 'P', 'L', 2, 1, 0});
  }
  const auto r = run(node_argv({"--coordinator", w->addr(), "--model", golden("f32"), "--prompt-ids", "1,2", "--tokens",
                                "8", "--threads", "1", "--verify", "all"}));
  expect_passed(r, 8, 8);
}

TEST(FaultModel, ResetMidFrameEndsThatSessionOnly) {
  auto w = start_node_worker(golden("f32"));
  ASSERT_TRUE(w);
  {
    V2Client cl(w->port);
    const auto wel = mux_handshake(cl, hello_for(golden("f32"), w->port, 2, 4, 2), 5);
    ASSERT_TRUE(wel);
    ASSERT_EQ(wel->m.type, pp::net::kTypeWelcome) << wel->text();
    const auto ack = mux_open(cl, 6);
    ASSERT_TRUE(ack);
    ASSERT_EQ(ack->m.type, pp::net::kTypeOpen) << ack->text();
    EXPECT_EQ(active_sessions(w->port), 1u);
    EXPECT_EQ(status_count(w->port, "sessions_active"), 1u);
    // Header, entry table, then 100 of the row's 256 bytes.
    const std::vector<pp::net::BatchEntry> entries = {{6, 0, 1, 0}};
    std::vector<uint8_t> part = pp::test::batch_bytes(pp::test::batch_header(5, 2, 4, 0, entries, 64), entries,
                                                      std::vector<float>(64, 0.0f));
    part.resize(part.size() - 256 + 100);
    ASSERT_TRUE(cl.send(part));
    std::this_thread::sleep_for(slack(100ms));  // the worker reads the partial payload before the reset
    cl.reset();
  }
  EXPECT_TRUE(wait_sessions(w->port, 0, 3s));
  EXPECT_TRUE(wait_sessions(w->port, 0, 3s));
  EXPECT_TRUE(w->proc->wait_stderr("connection reset by peer while reading BATCH rows (100 of 256 bytes)", 3s))
      << w->proc->err();
  const auto r = run(node_argv({"--coordinator", w->addr(), "--model", golden("f32"), "--prompt-ids", "1,2", "--tokens",
                                "4", "--threads", "1", "--verify", "all"}));
  expect_passed(r, 4, 4);
}

}  // namespace
