// pp_node placeholder mode against the spec (tcp-node.md), the Python prototype, and hostile peers on loopback.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "../common/fake_peer.hpp"
#include "../common/node_process.hpp"
#include "pp/core/error.hpp"
#include "pp/net/frame.hpp"
#include "pp/net/latency.hpp"
#include "pp/net/placeholder.hpp"
#include "pp/net/sha256.hpp"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using pp::test::Clock;
using pp::test::FakePeer;
using pp::test::free_port;
using pp::test::Millis;
using pp::test::Process;
using pp::test::RunResult;
using pp::test::slack;

// ---------------------------------------------------------------- independent reference

// The spec's transform on host-order words, written from tcp-node.md without pp's code.
std::vector<uint32_t> ref_make_input(uint32_t seq, std::size_t n_words) {
  std::vector<uint32_t> w(n_words);
  uint32_t x = seq * 2246822519u + 3266489917u;
  for (auto& v : w) {
    x = x * 1664525u + 1013904223u;
    v = x;
  }
  return w;
}

void ref_run_layers(std::vector<uint32_t>& w, uint32_t lo, uint32_t hi) {
  for (uint32_t layer = lo; layer < hi; ++layer) {
    const uint32_t c = layer * 2654435761u + 0x9E3779B1u;
    uint32_t prev = 0;
    for (auto& v : w) {
      uint32_t x = v + c;
      x ^= x >> 15;
      x = x * 0x2545F491u + prev;
      v = x;
      prev = x;
    }
  }
}

std::vector<uint8_t> le_bytes(const std::vector<uint32_t>& w) {
  std::vector<uint8_t> b;
  for (uint32_t v : w) {
    for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  return b;
}

std::vector<uint32_t> le_words(const std::vector<uint8_t>& b) {
  std::vector<uint32_t> w(b.size() / 4);
  for (std::size_t i = 0; i < w.size(); ++i) {
    w[i] = uint32_t{b[4 * i]} | (uint32_t{b[4 * i + 1]} << 8) | (uint32_t{b[4 * i + 2]} << 16) |
           (uint32_t{b[4 * i + 3]} << 24);
  }
  return w;
}

// A PCPL frame built by hand (big-endian), independent of pp::net::encode_header.
std::vector<uint8_t> raw_frame(uint8_t version, uint8_t type, uint32_t seq, uint32_t lo, uint32_t hi,
                               uint32_t payload_bytes, const std::vector<uint8_t>& payload = {}) {
  std::vector<uint8_t> f = {'P', 'C', 'P', 'L', version, type, 0, 0};
  for (uint32_t v : {seq, lo, hi, payload_bytes}) {
    for (int i = 3; i >= 0; --i) f.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  f.insert(f.end(), payload.begin(), payload.end());
  return f;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// ---------------------------------------------------------------- processes

using pp::test::expect_passed;
using pp::test::node_argv;
using pp::test::node_bin;
RunResult run(const std::vector<std::string>& argv, Millis timeout = 20s) { return pp::test::run_checked(argv, timeout); }

// The prototype lives beside the fixtures: $PP_SHARED_FIXTURES/../prototype/pipe_node.py.
std::string prototype_path() {
  const char* f = std::getenv("PP_SHARED_FIXTURES");
  if (!f) return "";
  const fs::path p = fs::path(f) / ".." / "prototype" / "pipe_node.py";
  return fs::exists(p) ? p.string() : "";
}

// A pp_node worker (pp::test::NodeWorker) on an ephemeral loopback port, learnt from its listening line.
using Worker = pp::test::NodeWorker;
std::optional<Worker> start_worker(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> argv = {node_bin(), "--worker", "--host", "127.0.0.1", "--port", "0"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return pp::test::start_listening(argv, 5s, "pipe worker \\(stage B\\) listening on 127\\.0\\.0\\.1:(\\d+)  "
                                             "\\(Ctrl-C to stop\\)\n");
}

// ---------------------------------------------------------------- raw loopback client

struct RawFrame {
  uint8_t version = 0;
  uint8_t type = 0;
  uint32_t seq = 0, lo = 0, hi = 0;
  std::vector<uint8_t> payload;
  std::string text() const { return std::string(payload.begin(), payload.end()); }
};

// A raw loopback client that reads v1 frames.
class Client : public pp::test::RawSocket {
 public:
  using RawSocket::RawSocket;

  std::optional<RawFrame> read_frame(Millis timeout = 5s) {
    const auto head = read_n(24, timeout);
    if (!head) return std::nullopt;
    const auto& h = *head;
    if (std::memcmp(h.data(), "PCPL", 4) != 0) return std::nullopt;
    RawFrame f;
    f.version = h[4];
    f.type = h[5];
    f.seq = be32(&h[8]);
    f.lo = be32(&h[12]);
    f.hi = be32(&h[16]);
    const uint32_t n = be32(&h[20]);
    if (n > (64u << 20)) return std::nullopt;
    if (n > 0) {
      auto p = read_n(n, timeout);
      if (!p) return std::nullopt;
      f.payload = std::move(*p);
    }
    return f;
  }

};

// One FWD round trip on `c`, checked against the reference transform.
void expect_fwd_roundtrip(Client& c, uint32_t seq, uint32_t n_words, uint32_t lo, uint32_t hi) {
  auto words = ref_make_input(seq, n_words);
  const auto payload = le_bytes(words);
  ASSERT_TRUE(c.send(raw_frame(1, 1, seq, lo, hi, static_cast<uint32_t>(payload.size()), payload)));
  const auto reply = c.read_frame(5s);
  ASSERT_TRUE(reply) << "no RES for seq " << seq;
  EXPECT_EQ(reply->version, 1);
  EXPECT_EQ(reply->type, 2) << reply->text();
  EXPECT_EQ(reply->seq, seq);
  EXPECT_EQ(reply->lo, lo);
  EXPECT_EQ(reply->hi, hi);
  ref_run_layers(words, lo, hi);
  EXPECT_EQ(reply->payload, le_bytes(words));
}

// Reads one frame from a raw fd (for fake peers); false on close/timeout.
bool fake_read_frame(int fd, RawFrame& f) {
  const auto h = pp::test::read_exact(fd, 24, 5s);
  if (!h) return false;
  f.version = (*h)[4];
  f.type = (*h)[5];
  f.seq = be32(&(*h)[8]);
  f.lo = be32(&(*h)[12]);
  f.hi = be32(&(*h)[16]);
  auto p = pp::test::read_exact(fd, be32(&(*h)[20]), 5s);
  if (!p) return false;
  f.payload = std::move(*p);
  return true;
}

void fake_send(int fd, const std::vector<uint8_t>& b) { ::send(fd, b.data(), b.size(), MSG_NOSIGNAL); }

// ================================================================ transform (spec vectors)

TEST(Transform, MatchesIndependentReimplementation) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const uint32_t n_words = rng() % 300;
    const uint32_t seq = rng();
    const uint32_t lo = rng() % 40;
    const uint32_t hi = lo + rng() % 10;
    auto ref = ref_make_input(seq, n_words);
    auto bytes = pp::net::make_input(seq, n_words * 4);
    ASSERT_EQ(bytes, le_bytes(ref)) << "make_input seq " << seq;
    ref_run_layers(ref, lo, hi);
    pp::net::run_layers(bytes, lo, hi);
    ASSERT_EQ(le_words(bytes), ref) << "run_layers [" << lo << "," << hi << ") n_words " << n_words;
  }
}

TEST(Transform, LayerIndicesWrapModulo2To32) {
  auto ref = ref_make_input(1, 8);
  auto bytes = pp::net::make_input(1, 32);
  ref_run_layers(ref, 0xFFFFFFF0u, 0xFFFFFFFFu);
  pp::net::run_layers(bytes, 0xFFFFFFF0u, 0xFFFFFFFFu);
  EXPECT_EQ(le_words(bytes), ref);
}

// Literal words from the prototype's own functions (pipe_node.make_input / run_layers, run once).
TEST(Transform, PrototypeVectors) {
  EXPECT_EQ(le_words(pp::net::make_input(0, 16)),
            (std::vector<uint32_t>{0x54e31a78, 0x9e3b1b77, 0x80ffc26a, 0xad3c0ec1}));
  EXPECT_EQ(le_words(pp::net::make_input(7, 12)), (std::vector<uint32_t>{0xf9bcf8c5, 0x81631360, 0x2c8f2f3f}));
  EXPECT_EQ(le_words(pp::net::make_input(0xFFFFFFFF, 8)), (std::vector<uint32_t>{0xcf9f686d, 0x7dc7aee8}));

  auto a = pp::net::make_input(3, 20);
  pp::net::run_layers(a, 0, 4);
  EXPECT_EQ(le_words(a), (std::vector<uint32_t>{0x28e33945, 0x537c91b4, 0x0ea8f8dd, 0x71d6af98, 0x4b6d7105}));

  auto b = pp::net::make_input(5, 16);
  pp::net::run_layers(b, 12, 24);
  EXPECT_EQ(le_words(b), (std::vector<uint32_t>{0xc85e3fc4, 0x1264a90f, 0x154e6a77, 0x86d75ceb}));

  auto c = le_bytes({0, 1, 0xFFFFFFFF, 0x80000000});
  pp::net::run_layers(c, 2, 3);
  EXPECT_EQ(le_words(c), (std::vector<uint32_t>{0xdfe719cf, 0xbae483a7, 0x7585a8e5, 0xe0dbc2b4}));

  // sha256(run_layers(make_input(1, 11520), 0, 24))[:12], the prototype's short_digest.
  auto d = pp::net::make_input(1, 11520);
  pp::net::run_layers(d, 0, 24);
  EXPECT_EQ(pp::to_hex(pp::sha256(d)).substr(0, 12), "f3a295f4af8a");
}

TEST(Transform, SplitComposesExactly) {
  auto whole = pp::net::make_input(11, 2880 * 4);
  auto split = whole;
  pp::net::run_layers(whole, 0, 24);
  pp::net::run_layers(split, 0, 9);
  pp::net::run_layers(split, 9, 24);
  EXPECT_EQ(whole, split);
  pp::net::run_layers(split, 5, 5);  // an empty range is the identity
  EXPECT_EQ(whole, split);
}

TEST(Transform, Sha256KnownAnswers) {
  const std::string abc = "abc";
  EXPECT_EQ(pp::to_hex(pp::sha256({reinterpret_cast<const uint8_t*>(abc.data()), abc.size()})),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(pp::to_hex(pp::sha256({})), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const std::string two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 56 bytes: padding spills
  EXPECT_EQ(pp::to_hex(pp::sha256({reinterpret_cast<const uint8_t*>(two.data()), two.size()})),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

// Values from the prototype's pctl() (Python round: half to even).
TEST(Transform, PercentileAsPrototype) {
  std::vector<double> s64;
  for (int i = 64; i >= 1; --i) s64.push_back(i);
  EXPECT_EQ(pp::net::percentile(s64, 50), 33.0);  // 31.5 -> 32
  EXPECT_EQ(pp::net::percentile(s64, 99), 63.0);
  EXPECT_EQ(pp::net::percentile({1, 2}, 50), 1.0);               // 0.5 -> 0
  EXPECT_EQ(pp::net::percentile({1, 2, 3, 4, 5, 6}, 50), 3.0);   // 2.5 -> 2
  EXPECT_EQ(pp::net::percentile({4, 3, 2, 1}, 50), 3.0);         // 1.5 -> 2
  EXPECT_EQ(pp::net::percentile({5}, 99), 5.0);
  EXPECT_EQ(pp::net::round_half_even(-0.5), 0.0);
  EXPECT_EQ(pp::net::round_half_even(3.5), 4.0);
}

// ================================================================ frame codec

TEST(Frame, HeaderMatchesPrototypeBytes) {
  pp::net::FrameHeader h;
  h.seq = 0x01020304;
  h.layer_lo = 12;
  h.layer_hi = 24;
  h.payload_bytes = 11520;
  const auto bytes = pp::net::encode_header(h);
  // struct.pack("!4sBBHIIII", b"PCPL", 1, 1, 0, 0x01020304, 12, 24, 11520) in the prototype.
  EXPECT_EQ(pp::to_hex(bytes), "5043504c01010000010203040000000c0000001800002d00");
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), raw_frame(1, 1, 0x01020304, 12, 24, 11520));
}

TEST(Frame, RoundTrip) {
  std::mt19937 rng(3);
  for (int i = 0; i < 200; ++i) {
    pp::net::FrameHeader h;
    h.version = static_cast<uint8_t>(rng());
    h.type = static_cast<uint8_t>(rng());
    h.reserved = static_cast<uint16_t>(rng());
    h.seq = rng();
    h.layer_lo = rng();
    h.layer_hi = rng();
    std::vector<uint8_t> payload(rng() % 64);
    for (auto& b : payload) b = static_cast<uint8_t>(rng());
    const auto frame = pp::net::encode_frame(h, payload);
    ASSERT_EQ(frame.size(), 24 + payload.size());
    const auto v = pp::net::decode_frame(frame);
    EXPECT_EQ(v.header.version, h.version);  // any version decodes: the caller decides
    EXPECT_EQ(v.header.type, h.type);
    EXPECT_EQ(v.header.reserved, h.reserved);
    EXPECT_EQ(v.header.seq, h.seq);
    EXPECT_EQ(v.header.layer_lo, h.layer_lo);
    EXPECT_EQ(v.header.layer_hi, h.layer_hi);
    EXPECT_EQ(v.header.payload_bytes, payload.size());
    EXPECT_EQ(std::vector<uint8_t>(v.payload.begin(), v.payload.end()), payload);
  }
}

template <class F>
std::string frame_error_of(F&& f) {
  try {
    f();
  } catch (const pp::FrameError& e) {
    return e.what();
  }
  return "<no FrameError>";
}

TEST(Frame, RejectsShortHeader) {
  const auto full = raw_frame(1, 1, 0, 0, 1, 0);
  for (std::size_t n = 0; n < 24; ++n) {
    const std::string msg = frame_error_of(
        [&] { pp::net::decode_header(std::span<const uint8_t>(full.data(), n)); });
    EXPECT_EQ(msg, "frame: header: " + std::to_string(n) + " bytes < 24");
  }
}

TEST(Frame, RejectsBadMagicAtEveryByte) {
  for (std::size_t i = 0; i < 4; ++i) {
    auto f = raw_frame(1, 1, 0, 0, 1, 0);
    f[i] ^= 0x20;
    const std::string msg = frame_error_of([&] { pp::net::decode_header(f); });
    EXPECT_NE(msg.find("frame: magic: '"), std::string::npos) << msg;
    EXPECT_NE(msg.find("!= 'PCPL'"), std::string::npos) << msg;
  }
  std::vector<uint8_t> binary(24, 0xff);
  EXPECT_EQ(frame_error_of([&] { pp::net::decode_header(binary); }),
            "frame: magic: '\\xff\\xff\\xff\\xff' != 'PCPL'");
}

TEST(Frame, RejectsTruncatedPayload) {
  auto f = raw_frame(1, 1, 0, 0, 1, 8, {1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(frame_error_of([&] { pp::net::decode_frame(f); }),
            "frame: payload_bytes 8 > 7 bytes available after the header");
}

TEST(Frame, VersionIsTheCallersDecision) {
  for (uint8_t v : {0, 2, 3, 255}) {
    const auto h = pp::net::decode_header(raw_frame(v, 1, 0, 0, 1, 0));
    EXPECT_EQ(h.version, v);
    EXPECT_EQ(frame_error_of([&] { pp::net::require_version(h, pp::net::kVersionPlaceholder); }),
              "frame: version: " + std::to_string(v) + " != 1 (this end speaks version 1)");
  }
  EXPECT_NO_THROW(pp::net::require_version(pp::net::decode_header(raw_frame(1, 1, 0, 0, 1, 0)), 1));
}

TEST(Frame, FwdBoundsEachRejection) {
  const pp::net::FrameLimits limits;  // 64 MiB, 65536 layers
  auto check = [&](uint32_t lo, uint32_t hi, uint32_t nbytes) {
    return frame_error_of(
        [&] { pp::net::check_fwd_v1(pp::net::decode_header(raw_frame(1, 1, 9, lo, hi, nbytes)), limits); });
  };
  EXPECT_EQ(check(0, 1, 0xFFFFFFFCu), "frame: FWD seq 9: payload_bytes 4294967292 > limit 67108864 (--max-payload)");
  EXPECT_EQ(check(0, 1, (64u << 20) + 4), "frame: FWD seq 9: payload_bytes 67108868 > limit 67108864 (--max-payload)");
  for (uint32_t odd : {1u, 2u, 3u, 11522u}) {
    EXPECT_EQ(check(0, 1, odd), "frame: FWD seq 9: payload_bytes " + std::to_string(odd) +
                                    " is not a multiple of 4 (payload is uint32 words)");
  }
  EXPECT_EQ(check(5, 3, 16), "frame: FWD seq 9: layer_lo 5 > layer_hi 3");
  EXPECT_EQ(check(0, 65537, 16),
            "frame: FWD seq 9: layer range [0, 65537) spans 65537 layers > limit 65536 (--max-layer-range)");
  EXPECT_EQ(check(0, 0xFFFFFFFFu, 16),
            "frame: FWD seq 9: layer range [0, 4294967295) spans 4294967295 layers > limit 65536 "
            "(--max-layer-range)");
  // At the limits, and an empty payload or range: accepted.
  EXPECT_EQ(check(100, 100 + 65536, 64u << 20), "<no FrameError>");
  EXPECT_EQ(check(7, 7, 0), "<no FrameError>");
}

TEST(Frame, DecodeNeverCrashesOnRandomBytes) {
  std::mt19937 rng(11);
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> b(rng() % 64);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    if (b.size() >= 4 && (i % 2 == 0)) std::memcpy(b.data(), "PCPL", 4);  // half reach the fields
    try {
      const auto v = pp::net::decode_frame(b);
      ASSERT_GE(b.size(), 24u);
      ASSERT_EQ(v.header.payload_bytes, be32(&b[20]));
      ASSERT_LE(v.header.payload_bytes + 24u, b.size());
      pp::net::check_fwd_v1(v.header, {});
    } catch (const pp::FrameError&) {
    }
  }
}

// ================================================================ command line and selftest

TEST(Cli, SelftestPasses) {
  const auto r = run(node_argv({"--selftest", "--hidden", "256", "--layers", "8", "--cut", "3", "--tokens", "16"}));
  expect_passed(r, 16, 16);
  EXPECT_NE(r.out.find("pipe self-test: stage B on a local thread, splitting the forward\n\n"), std::string::npos);
  EXPECT_NE(r.out.find("  hidden=256 (1024 B)  layers=8  cut@3  stageA=[0,3)  stageB=[3,8)\n"), std::string::npos);
  EXPECT_NE(r.out.find("  wire: 2096 bytes/token"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" tokens/s"), std::string::npos);
}

TEST(Cli, SelftestDefaults) {
  const auto r = run(node_argv({"--selftest"}));
  expect_passed(r, 64, 64);
  EXPECT_NE(r.out.find("  hidden=2880 (11520 B)  layers=24  cut@12  stageA=[0,12)  stageB=[12,24)\n"),
            std::string::npos);
}

TEST(Cli, CutOutsideRangeIsUsageError) {
  for (const auto& [cut, layers] : std::vector<std::pair<std::string, std::string>>{
           {"0", "24"}, {"24", "24"}, {"25", "24"}, {"-1", "24"}, {"1", "1"}}) {
    const auto r = run(node_argv({"--selftest", "--cut", cut, "--layers", layers}));
    EXPECT_EQ(r.code, 2) << "--cut " << cut << " --layers " << layers << ": " << r.err;
    EXPECT_NE(r.err.find("--"), std::string::npos) << r.err;
  }
  const auto c = run(node_argv({"--coordinator", "127.0.0.1", "--cut", "0"}));
  EXPECT_EQ(c.code, 2);
  EXPECT_NE(c.err.find("--cut must be between 1 and layers-1"), std::string::npos) << c.err;
}

TEST(Cli, OtherUsageErrors) {
  EXPECT_EQ(run(node_argv({})).code, 2);                                       // no mode
  EXPECT_EQ(run(node_argv({"--selftest", "--worker"})).code, 2);               // two modes
  EXPECT_EQ(run(node_argv({"--selftest", "--bogus"})).code, 2);                // unknown option
  EXPECT_EQ(run(node_argv({"--selftest", "--hidden", "0"})).code, 2);
  EXPECT_EQ(run(node_argv({"--selftest", "--tokens", "0"})).code, 2);
  EXPECT_EQ(run(node_argv({"--selftest", "--hidden", "20000000"})).code, 2);  // 80 MB > --max-payload
  EXPECT_EQ(run(node_argv({"--worker", "--port", "70000"})).code, 2);
  EXPECT_EQ(run(node_argv({"--help"})).code, 0);
  // --serve / --chat run a coordinator: never silently ignored beside another mode; alone they need --model.
  for (const char* mode : {"--selftest", "--worker"}) {
    const auto r = run(node_argv({mode, "--serve", "--model", "x.gguf"}));
    EXPECT_EQ(r.code, 2) << mode;
    EXPECT_NE(r.err.find("--serve runs a coordinator"), std::string::npos) << r.err;
  }
  const auto alone = run(node_argv({"--chat"}));
  EXPECT_EQ(alone.code, 2);
  EXPECT_NE(alone.err.find("--serve and --chat need --model"), std::string::npos) << alone.err;
}

// A worker that corrupts one word: the coordinator reports the prototype's FAIL line, exit 1.
TEST(Cli, MismatchExitsOne) {
  FakePeer peer([](int fd) {
    RawFrame f;
    while (fake_read_frame(fd, f)) {
      auto words = le_words(f.payload);
      ref_run_layers(words, f.lo, f.hi);
      if (f.seq % 2 == 1) words[0] ^= 1;
      fake_send(fd, raw_frame(1, 2, f.seq, f.lo, f.hi, static_cast<uint32_t>(words.size() * 4), le_bytes(words)));
    }
  });
  const auto r = run(node_argv({"--coordinator", "127.0.0.1", "--port", std::to_string(peer.port()), "--hidden", "16",
                                "--layers", "4", "--cut", "2", "--tokens", "6", "--timeout", "5"}));
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("byte-identity: 3/6 identical  FAIL (3)\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  MISMATCH seq=1: dist="), std::string::npos) << r.out;
}

// ================================================================ interop with the Python prototype

struct Shape {
  int hidden, layers, cut, tokens;
};
const std::vector<Shape> kInteropShapes = {{64, 4, 1, 8}, {300, 7, 5, 6}, {2880, 24, 12, 4}};

TEST(Interop, NodeCoordinatorAgainstPrototypeWorker) {
  const std::string proto = prototype_path();
  if (proto.empty()) GTEST_SKIP() << "prototype not found at $PP_SHARED_FIXTURES/../prototype/pipe_node.py; "
                                     "interop skipped (transform vectors still cover the spec)";
  const uint16_t port = free_port();
  Process py({"python3", "-u", proto, "--worker", "--host", "127.0.0.1", "--port", std::to_string(port)});
  ASSERT_TRUE(py.wait_output("listening on 127.0.0.1:" + std::to_string(port), 10s)) << py.out() << py.err();
  for (const auto& s : kInteropShapes) {
    const auto r = run(node_argv({"--coordinator", "127.0.0.1", "--port", std::to_string(port), "--hidden",
                                  std::to_string(s.hidden), "--layers", std::to_string(s.layers), "--cut",
                                  std::to_string(s.cut), "--tokens", std::to_string(s.tokens)}));
    SCOPED_TRACE("hidden " + std::to_string(s.hidden) + " layers " + std::to_string(s.layers) + " cut " +
                 std::to_string(s.cut));
    expect_passed(r, s.tokens, s.tokens);
  }
  const auto nv = run(node_argv({"--coordinator", "127.0.0.1", "--port", std::to_string(port), "--hidden", "32",
                                 "--layers", "3", "--cut", "1", "--tokens", "3", "--no-verify"}));
  EXPECT_EQ(nv.code, 0) << nv.err;
  EXPECT_NE(nv.out.find("\nbyte-identity: skipped (--no-verify); worker holds the far layers\n"), std::string::npos)
      << nv.out;
}

TEST(Interop, PrototypeCoordinatorAgainstNodeWorker) {
  const std::string proto = prototype_path();
  if (proto.empty()) GTEST_SKIP() << "prototype not found at $PP_SHARED_FIXTURES/../prototype/pipe_node.py; "
                                     "interop skipped (transform vectors still cover the spec)";
  auto w = start_worker();
  ASSERT_TRUE(w);
  for (const auto& s : kInteropShapes) {
    const std::vector<std::string> geometry = {"--port", std::to_string(w->port), "--hidden", std::to_string(s.hidden),
                                               "--layers", std::to_string(s.layers), "--cut", std::to_string(s.cut),
                                               "--tokens", std::to_string(s.tokens)};
    std::vector<std::string> py = {"python3", proto, "--coordinator", "127.0.0.1"};
    py.insert(py.end(), geometry.begin(), geometry.end());
    std::vector<std::string> cpp = {node_bin(), "--coordinator", "127.0.0.1"};
    cpp.insert(cpp.end(), geometry.begin(), geometry.end());
    SCOPED_TRACE("hidden " + std::to_string(s.hidden) + " layers " + std::to_string(s.layers) + " cut " +
                 std::to_string(s.cut));
    const auto rp = run(py);
    expect_passed(rp, s.tokens, s.tokens);
    // Both coordinators print the same header lines.
    const auto rc = run(cpp);
    expect_passed(rc, s.tokens, s.tokens);
    auto first_lines = [](const std::string& out) {
      const auto a = out.find('\n');
      return out.substr(0, out.find('\n', a + 1) + 1);
    };
    EXPECT_EQ(first_lines(rp.out), first_lines(rc.out));
  }
  EXPECT_TRUE(w->proc->running());
}

// ================================================================ faults: a pp_node worker under abuse

TEST(FaultWorker, RandomBytesCloseThatConnectionOnly) {
  auto w = start_worker({"--timeout", "2"});
  ASSERT_TRUE(w);
  Client good(w->port);
  ASSERT_TRUE(good.connected());
  expect_fwd_roundtrip(good, 0, 64, 3, 9);

  std::mt19937 rng(5);
  std::vector<uint8_t> junk(4096);
  for (auto& b : junk) b = static_cast<uint8_t>(rng());
  junk[0] = 'X';  // not 'P', so the magic fails
  Client bad(w->port);
  ASSERT_TRUE(bad.connected());
  bad.send(junk);
  EXPECT_TRUE(bad.closed_by_peer(3s));

  expect_fwd_roundtrip(good, 1, 64, 3, 9);  // the open connection still works
  Client fresh(w->port);
  expect_fwd_roundtrip(fresh, 2, 128, 0, 24);
  EXPECT_TRUE(w->proc->wait_stderr("magic", 2s)) << w->proc->err();
  EXPECT_TRUE(w->proc->running());
}

TEST(FaultWorker, FourGiBHeaderRefusedBeforeAllocation) {
  auto w = start_worker({"--timeout", "2"});
  ASSERT_TRUE(w);
  const long base = pp::test::proc_status_kib(w->proc->pid(), "VmHWM");  // the worker's own footprint (larger under ASan)
  Client c(w->port);
  ASSERT_TRUE(c.send(raw_frame(1, 1, 42, 0, 1, 0xFFFFFFFCu)));
  const auto err = c.read_frame(3s);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->type, 255);
  EXPECT_EQ(err->seq, 42u);
  EXPECT_EQ(err->text(), "frame: FWD seq 42: payload_bytes 4294967292 > limit 67108864 (--max-payload)");
  EXPECT_TRUE(c.closed_by_peer(3s));
  // Nothing near the announced size was ever reserved.
  const long hwm = pp::test::proc_status_kib(w->proc->pid(), "VmHWM");
  EXPECT_GT(hwm, 0);
  EXPECT_LT(hwm - base, 32 * 1024) << "worker peak RSS " << hwm << " KiB, " << base << " KiB before the frame";

  Client fresh(w->port);
  expect_fwd_roundtrip(fresh, 1, 32, 1, 2);
}

TEST(FaultWorker, EveryBoundAnsweredWithErrBeforeThePayload) {
  auto w = start_worker({"--timeout", "2", "--max-payload", "4096", "--max-layer-range", "100"});
  ASSERT_TRUE(w);
  struct Case {
    std::vector<uint8_t> frame;
    std::string message;
  };
  const std::vector<Case> cases = {
      {raw_frame(1, 1, 1, 0, 1, 4100), "frame: FWD seq 1: payload_bytes 4100 > limit 4096 (--max-payload)"},
      {raw_frame(1, 1, 2, 0, 1, 11), "frame: FWD seq 2: payload_bytes 11 is not a multiple of 4 (payload is uint32 words)"},
      {raw_frame(1, 1, 3, 9, 2, 8), "frame: FWD seq 3: layer_lo 9 > layer_hi 2"},
      {raw_frame(1, 1, 4, 0, 101, 8),
       "frame: FWD seq 4: layer range [0, 101) spans 101 layers > limit 100 (--max-layer-range)"},
      {raw_frame(1, 2, 5, 0, 1, 0xFFFFFFFFu), "frame: RES seq 5: payload_bytes 4294967295 > limit 4096 (--max-payload)"},
      {raw_frame(2, 1, 6, 0, 1, 8),
       "frame: version: 2 != 1 (this end speaks version 1); this worker runs the placeholder (no --model)"},
  };
  for (const auto& k : cases) {
    Client c(w->port);
    ASSERT_TRUE(c.send(k.frame));  // header only: the worker must answer without waiting for a payload
    const auto err = c.read_frame(3s);
    ASSERT_TRUE(err) << k.message;
    EXPECT_EQ(err->type, 255);
    EXPECT_EQ(err->text(), k.message);
    EXPECT_TRUE(c.closed_by_peer(3s)) << k.message;
  }
  Client fresh(w->port);
  expect_fwd_roundtrip(fresh, 1, 1024, 0, 100);  // exactly at both limits
}

TEST(FaultWorker, WrongTypeGetsErrAndConnectionStays) {
  auto w = start_worker({"--timeout", "2"});
  ASSERT_TRUE(w);
  Client c(w->port);
  expect_fwd_roundtrip(c, 0, 16, 2, 5);
  for (uint8_t type : {uint8_t{2}, uint8_t{255}, uint8_t{0}, uint8_t{7}}) {
    ASSERT_TRUE(c.send(raw_frame(1, type, 77, 2, 5, 10, std::vector<uint8_t>(10, 0xab))));
    const auto err = c.read_frame(3s);
    ASSERT_TRUE(err) << "type " << int{type};
    EXPECT_EQ(err->type, 255);
    EXPECT_EQ(err->seq, 77u);
    EXPECT_EQ(err->text(), "expected T_FWD");
  }
  expect_fwd_roundtrip(c, 1, 16, 2, 5);  // same connection, still in sync
}

TEST(FaultWorker, TwoHundredStalledPartialHeaders) {
  auto w = start_worker({"--timeout", "2"});
  ASSERT_TRUE(w);
  std::vector<std::unique_ptr<Client>> stalled;
  const auto partial = raw_frame(1, 1, 0, 0, 1, 16);
  for (int i = 0; i < 200; ++i) {
    stalled.push_back(std::make_unique<Client>(w->port));
    ASSERT_TRUE(stalled.back()->connected()) << "connection " << i;
    stalled.back()->send(std::vector<uint8_t>(partial.begin(), partial.begin() + 10));
  }
  const auto t0 = Clock::now();
  Client good(w->port);
  expect_fwd_roundtrip(good, 3, 256, 0, 12);
  EXPECT_LT(Clock::now() - t0, slack(2s));  // served beside 200 stalled connections, not after their timeout
  // The worker drops each stalled connection once --timeout passes without progress.
  int closed = 0;
  for (auto& c : stalled) closed += c->closed_by_peer(5s) ? 1 : 0;
  EXPECT_EQ(closed, 200);
  EXPECT_TRUE(w->proc->running());
  expect_fwd_roundtrip(good, 4, 256, 0, 12);
}

TEST(FaultWorker, ConnectionsBeyondTheLimitAreRefused) {
  auto w = start_worker({"--max-connections", "4"});
  ASSERT_TRUE(w);
  std::vector<std::unique_ptr<Client>> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(std::make_unique<Client>(w->port));
    expect_fwd_roundtrip(*idle.back(), i, 8, 0, 1);  // each is being served
  }
  Client extra(w->port);
  const auto err = extra.read_frame(3s);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->type, 255);
  EXPECT_EQ(err->text(), "worker busy: 4 connections open (limit 4)");
  EXPECT_TRUE(extra.closed_by_peer(3s));

  idle.pop_back();  // free a slot; the worker notices the close asynchronously
  bool served = false;
  for (int attempt = 0; attempt < 50 && !served; ++attempt) {
    Client retry(w->port);
    const auto words = le_bytes(ref_make_input(9, 8));
    retry.send(raw_frame(1, 1, 9, 0, 1, 32, words));
    const auto f = retry.read_frame(3s);
    served = f && f->type == 2;
    if (!served) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(served);
}

TEST(FaultWorker, ResetMidFrame) {
  auto w = start_worker({"--timeout", "2"});
  ASSERT_TRUE(w);
  Client good(w->port);
  expect_fwd_roundtrip(good, 0, 64, 0, 2);
  {
    Client r(w->port);
    auto f = raw_frame(1, 1, 1, 0, 1, 4096, std::vector<uint8_t>(100, 1));
    ASSERT_TRUE(r.send(f));
    std::this_thread::sleep_for(slack(50ms));  // the worker reads the partial payload before the reset
    r.reset();
  }
  EXPECT_TRUE(w->proc->wait_stderr("reset", 3s)) << w->proc->err();
  expect_fwd_roundtrip(good, 1, 64, 0, 2);
  Client fresh(w->port);
  expect_fwd_roundtrip(fresh, 2, 64, 0, 2);
}

TEST(FaultWorker, IdleConnectionsTimeOut) {
  auto w = start_worker({"--idle-timeout", "0.5"});
  ASSERT_TRUE(w);
  Client c(w->port);
  expect_fwd_roundtrip(c, 0, 8, 0, 1);
  const auto t0 = Clock::now();
  EXPECT_TRUE(c.closed_by_peer(5s));
  EXPECT_LT(Clock::now() - t0, 500ms + slack(2500ms));  // --idle-timeout 0.5
}

TEST(FaultWorker, KilledWorkerEndsCoordinatorWithinSeconds) {
  auto w = start_worker();
  ASSERT_TRUE(w);
  Process coord(node_argv({"--coordinator", "127.0.0.1", "--port", std::to_string(w->port), "--hidden", "64", "--layers",
                           "4", "--cut", "2", "--tokens", "4000000000", "--no-verify", "--timeout", "3"}));
  ASSERT_TRUE(coord.wait_output("stageB=[2,4)", 5s)) << coord.err();
  std::this_thread::sleep_for(200ms);
  w->proc->kill_hard();
  const auto t0 = Clock::now();
  const auto code = coord.wait(8s);
  ASSERT_TRUE(code) << "coordinator hung after its worker died";
  EXPECT_LT(Clock::now() - t0, 3s + slack(2s));  // --timeout 3
  EXPECT_EQ(*code, 3);
  EXPECT_NE(coord.err().find("worker 127.0.0.1:" + std::to_string(w->port)), std::string::npos) << coord.err();
}

// ================================================================ faults: a coordinator facing a bad worker

RunResult coordinator_against(uint16_t port, const std::string& timeout = "1") {
  return run(node_argv({"--coordinator", "127.0.0.1", "--port", std::to_string(port), "--hidden", "64", "--layers", "4",
                        "--cut", "2", "--tokens", "4", "--timeout", timeout}),
             15s);
}

TEST(FaultCoordinator, PeerAcceptsAndNeverAnswers) {
  FakePeer peer([](int) {});
  const auto r = coordinator_against(peer.port());
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_LT(r.seconds, 1.0 + slack(4s).count() / 1e3);  // --timeout 1
  const std::string who = "worker 127.0.0.1:" + std::to_string(peer.port());
  EXPECT_NE(r.err.find(who + ": timed out after 1.0 s without data while reading frame header (0 of 24 bytes)"),
            std::string::npos)
      << r.err;
}

TEST(FaultCoordinator, PeerClosesBeforeAnswering) {
  FakePeer peer([](int fd) { ::shutdown(fd, SHUT_RDWR); });
  const auto r = coordinator_against(peer.port());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("worker 127.0.0.1:" + std::to_string(peer.port())), std::string::npos) << r.err;
  EXPECT_TRUE(r.err.find("closed") != std::string::npos || r.err.find("reset") != std::string::npos) << r.err;
}

TEST(FaultCoordinator, PeerSendsGarbage) {
  FakePeer peer([](int fd) {
    RawFrame f;
    fake_read_frame(fd, f);
    fake_send(fd, std::vector<uint8_t>(24, 'Z'));
  });
  const auto r = coordinator_against(peer.port());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("magic: 'ZZZZ' != 'PCPL'"), std::string::npos) << r.err;
}

TEST(FaultCoordinator, PeerAnnouncesAHugeReply) {
  FakePeer peer([](int fd) {
    RawFrame f;
    fake_read_frame(fd, f);
    fake_send(fd, raw_frame(1, 2, f.seq, f.lo, f.hi, 0xFFFFFFFCu));
  });
  const auto r = coordinator_against(peer.port());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("RES seq 0 from worker 127.0.0.1:" + std::to_string(peer.port()) +
                       ": payload_bytes 4294967292 != 256 (hidden 64 x 4)"),
            std::string::npos)
      << r.err;
}

TEST(FaultCoordinator, PeerAnswersErr) {
  FakePeer peer([](int fd) {
    RawFrame f;
    fake_read_frame(fd, f);
    const std::string msg = "runs a model";
    fake_send(fd, raw_frame(1, 255, f.seq, f.lo, f.hi, static_cast<uint32_t>(msg.size()),
                            std::vector<uint8_t>(msg.begin(), msg.end())));
  });
  const auto r = coordinator_against(peer.port());
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("answered FWD seq 0 with ERR: runs a model"), std::string::npos) << r.err;
}

TEST(FaultCoordinator, NobodyListening) {
  const uint16_t port = free_port();
  const auto r = coordinator_against(port);
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("worker 127.0.0.1:" + std::to_string(port) + ": connect: connection refused"),
            std::string::npos)
      << r.err;
}

}  // namespace
