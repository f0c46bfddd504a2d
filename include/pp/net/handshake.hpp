// The version-2 handshake: model fingerprint, HELLO / WELCOME texts, and the checks that refuse a mismatch.
//
// Before any activation flows, every hop of a chain agrees on the model file (a fingerprint of its
// header, metadata and tensor directory), its geometry, the protocol version and contiguous layer
// ranges; each end also learns the others' numeric profile (kernel target and threads).
//
// Both messages are UTF-8 `key=value` lines (docs/PROTOCOL-TCP.md "Handshake"): easy to read in a
// capture, and a later version may add keys that this one ignores.
#pragma once

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pp/core/error.hpp"
#include "pp/core/hex.hpp"
#include "pp/core/printable.hpp"
#include "pp/io/gguf.hpp"
#include "pp/model/config.hpp"
#include "pp/model/layer_range.hpp"
#include "pp/model.hpp"
#include "pp/net/sha256.hpp"
#include "pp/net/socket.hpp"
#include "pp/text/sampler.hpp"

namespace pp::net {

inline constexpr uint32_t kProtocolVersion = 2;

// A handshake that cannot go on; the message says what differs.
class HandshakeError : public Error {
 public:
  explicit HandshakeError(const std::string& what) : Error("handshake: " + what) {}
};

// What both ends must agree on about the model file.
struct ModelIdentity {
  std::string fingerprint;  // hex SHA-256 of the file's bytes [0, data_offset)
  std::string file;         // the file's name (no directory), for messages only
  uint32_t n_layer = 0;
  uint32_t n_embd = 0;
  uint32_t n_vocab = 0;
};

// SHA-256 over the GGUF header, metadata and tensor directory (everything before the aligned data
// section): it changes with any tensor's name, type, shape or offset and with any metadata, and costs
// kilobytes to compute, not gigabytes. Two files with identical directories but different weight
// bytes are not told apart; the byte-identity probe is what catches those.
inline ModelIdentity identify_model(std::span<const uint8_t> file_bytes, const gguf::File& g, const Config& c,
                                    const std::string& path) {
  ModelIdentity id;
  id.fingerprint = to_hex(sha256(file_bytes.first(static_cast<std::size_t>(g.data_offset))));
  const std::size_t slash = path.find_last_of('/');
  id.file = slash == std::string::npos ? path : path.substr(slash + 1);
  id.n_layer = static_cast<uint32_t>(c.n_layer);
  id.n_embd = static_cast<uint32_t>(c.n_embd);
  id.n_vocab = static_cast<uint32_t>(c.n_vocab);
  return id;
}
// The same for an open model; `name` (default: the model's path) gives the file name messages show.
inline ModelIdentity identify_model(const Model& m, const std::string& name = {}) {
  return identify_model(m.file().bytes(), m.gguf(), m.config(), name.empty() ? m.path() : name);
}

// The numeric profile of one end: results are bit-identical across ends only with the same kernels.
struct NumericProfile {
  std::string arch;  // pp::simd::Best::name()
  unsigned threads = 0;
};

// One worker of a chain: the layers it runs and where it listens.
struct Hop {
  LayerRange range;
  Peer peer;
};

// Coordinator (or upstream worker) -> worker.
struct Hello {
  uint32_t protocol = kProtocolVersion;
  ModelIdentity model;
  uint32_t ctx = 0;       // KV capacity every stage allocates; the largest BATCH is ctx rows
  uint32_t from = 0;      // where the sender's layers end: the receiver must begin here
  uint32_t stage = 0;     // the receiver's stage index (the coordinator is stage 0)
  std::vector<Hop> chain; // chain[0] is the receiver, then every later worker in order
  SamplingParams sampling;
  NumericProfile coordinator;  // passed down unchanged: every worker can tell when its kernels differ
  // The coordinator's timeouts, used by every hop of the session for its own next hop, so that waits
  // nest (each end waits longer than the ends below it) whatever each worker was started with.
  uint32_t timeout_ms = 0;       // connect and stall timeout; 0 = the worker's own --timeout
  uint32_t load_timeout_ms = 0;  // waiting for WELCOME; 0 = the worker's own --load-timeout
  bool mux = false;  // the connection carries many sessions (OPEN / BATCH / CLOSE, mux_frame.hpp)
};

// What a stage reports about itself in WELCOME.
struct StageReport {
  uint32_t stage = 0;
  LayerRange range;
  NumericProfile profile;
  uint32_t ctx = 0;
  uint64_t bytes_used = 0;  // bytes of weights the stage reads
  std::string where;        // host:port as its upstream named it
};

// Worker -> upstream: its own stage first, then every stage below it.
struct Welcome {
  std::vector<StageReport> stages;
  bool mux = false;  // every stage below accepted a multiplexed connection
};

namespace detail {

inline std::string double_text(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);  // round-trips every double
  return buf;
}

// key=value lines into pairs; refuses a line without '='.
inline std::vector<std::pair<std::string_view, std::string_view>> parse_lines(std::string_view text,
                                                                             const char* what) {
  std::vector<std::pair<std::string_view, std::string_view>> kv;
  while (!text.empty()) {
    const std::size_t nl = text.find('\n');
    const std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
    if (line.empty()) continue;
    const std::size_t eq = line.find('=');
    if (eq == std::string_view::npos || eq == 0)
      throw HandshakeError(std::string(what) + ": line '" + printable(line, 80) + "' is not key=value");
    kv.emplace_back(line.substr(0, eq), line.substr(eq + 1));
  }
  return kv;
}

template <class T>
T parse_uint(std::string_view key, std::string_view v, T max) {
  uint64_t x = 0;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  if (r.ec != std::errc{} || r.ptr != v.data() + v.size() || x > static_cast<uint64_t>(max))
    throw HandshakeError("'" + printable(key, 80) + "' = '" + printable(v, 40) +
                         "' is not an integer in [0, " + std::to_string(max) + "]");
  return static_cast<T>(x);
}

inline double parse_double(std::string_view key, std::string_view v) {
  const std::string s(v.substr(0, 64));
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size())
    throw HandshakeError("'" + printable(key, 80) + "' = '" + printable(s) + "' is not a number");
  return x;
}

// "a,b,c" -> fields; exactly n of them.
inline std::vector<std::string_view> split(std::string_view key, std::string_view v, std::size_t n) {
  std::vector<std::string_view> out;
  while (true) {
    const std::size_t c = v.find(',');
    out.push_back(v.substr(0, c));
    if (c == std::string_view::npos) break;
    v = v.substr(c + 1);
  }
  if (out.size() != n)
    throw HandshakeError("'" + printable(key, 80) + "' has " + std::to_string(out.size()) + " fields, expected " +
                         std::to_string(n));
  return out;
}

inline Peer parse_peer(std::string_view key, std::string_view v) {
  const std::size_t colon = v.rfind(':');
  if (colon == std::string_view::npos || colon == 0)
    throw HandshakeError("'" + printable(key, 80) + "': '" + printable(v, 80) + "' is not host:port");
  return Peer{std::string(v.substr(0, colon)), parse_uint<uint16_t>(key, v.substr(colon + 1), 65535)};
}

// A text field must not break the line format.
inline std::string clean(std::string_view s) {
  std::string out;
  for (char c : s) out += (c == '\n' || c == '\r' || c == ',' || c == '=') ? '_' : c;
  return out;
}

}  // namespace detail

inline std::string encode_hello(const Hello& h) {
  std::string s;
  auto line = [&](std::string_view k, const std::string& v) { s.append(k).append("=").append(v).append("\n"); };
  line("protocol", std::to_string(h.protocol));
  line("fingerprint", h.model.fingerprint);
  line("model", detail::clean(h.model.file));
  line("n_layer", std::to_string(h.model.n_layer));
  line("n_embd", std::to_string(h.model.n_embd));
  line("n_vocab", std::to_string(h.model.n_vocab));
  line("ctx", std::to_string(h.ctx));
  line("from", std::to_string(h.from));
  line("stage", std::to_string(h.stage));
  for (const Hop& hop : h.chain)
    line("hop", std::to_string(hop.range.lo) + "," + std::to_string(hop.range.hi) + "," + hop.peer.str());
  if (h.sampling.temperature) line("temperature", detail::double_text(*h.sampling.temperature));
  if (h.sampling.top_k) line("top_k", std::to_string(*h.sampling.top_k));
  if (h.sampling.top_p) line("top_p", detail::double_text(*h.sampling.top_p));
  if (h.sampling.min_p) line("min_p", detail::double_text(*h.sampling.min_p));
  line("seed", std::to_string(h.sampling.seed));
  if (!h.coordinator.arch.empty())
    line("profile", detail::clean(h.coordinator.arch) + "," + std::to_string(h.coordinator.threads));
  if (h.timeout_ms) line("timeout_ms", std::to_string(h.timeout_ms));
  if (h.load_timeout_ms) line("load_timeout_ms", std::to_string(h.load_timeout_ms));
  if (h.mux) line("mux", "1");
  return s;
}

// Parses a HELLO; a missing required key or a malformed value is a HandshakeError. Unknown keys are
// ignored (a later version may add some). The protocol number is parsed first, so a peer of another
// version is told about the version rather than about a key it does not send.
inline Hello decode_hello(std::string_view text) {
  Hello h;
  bool have_protocol = false, have_fp = false, have_layer = false, have_embd = false, have_vocab = false,
       have_ctx = false, have_from = false, have_stage = false;
  const auto kv = detail::parse_lines(text, "HELLO");
  for (const auto& [k, v] : kv)
    if (k == "protocol") h.protocol = detail::parse_uint<uint32_t>(k, v, UINT32_MAX), have_protocol = true;
  if (!have_protocol) throw HandshakeError("HELLO has no 'protocol' line");
  if (h.protocol != kProtocolVersion)
    throw HandshakeError("protocol version: the peer speaks " + std::to_string(h.protocol) +
                         ", this end speaks " + std::to_string(kProtocolVersion));
  for (const auto& [k, v] : kv) {
    if (k == "fingerprint") h.model.fingerprint = std::string(v.substr(0, 64)), have_fp = true;
    else if (k == "model") h.model.file = std::string(v.substr(0, 256));
    else if (k == "n_layer") h.model.n_layer = detail::parse_uint<uint32_t>(k, v, UINT32_MAX), have_layer = true;
    else if (k == "n_embd") h.model.n_embd = detail::parse_uint<uint32_t>(k, v, UINT32_MAX), have_embd = true;
    else if (k == "n_vocab") h.model.n_vocab = detail::parse_uint<uint32_t>(k, v, UINT32_MAX), have_vocab = true;
    else if (k == "ctx") h.ctx = detail::parse_uint<uint32_t>(k, v, UINT32_MAX), have_ctx = true;
    else if (k == "from") h.from = detail::parse_uint<uint32_t>(k, v, INT32_MAX), have_from = true;
    else if (k == "stage") h.stage = detail::parse_uint<uint32_t>(k, v, 65535), have_stage = true;
    else if (k == "hop") {
      const auto f = detail::split(k, v, 3);
      h.chain.push_back(Hop{LayerRange{detail::parse_uint<int>(k, f[0], INT32_MAX), detail::parse_uint<int>(k, f[1], INT32_MAX)},
                            detail::parse_peer(k, f[2])});
      if (h.chain.size() > 1024) throw HandshakeError("HELLO names more than 1024 hops");
    } else if (k == "temperature") h.sampling.temperature = detail::parse_double(k, v);
    else if (k == "top_k") h.sampling.top_k = detail::parse_uint<int64_t>(k, v, INT64_MAX);
    else if (k == "top_p") h.sampling.top_p = detail::parse_double(k, v);
    else if (k == "min_p") h.sampling.min_p = detail::parse_double(k, v);
    else if (k == "seed") h.sampling.seed = detail::parse_uint<uint64_t>(k, v, UINT64_MAX);
    else if (k == "profile") {
      const auto f = detail::split(k, v, 2);
      h.coordinator = NumericProfile{std::string(f[0].substr(0, 64)), detail::parse_uint<unsigned>(k, f[1], 65535)};
    } else if (k == "timeout_ms") h.timeout_ms = detail::parse_uint<uint32_t>(k, v, 86400000);
    else if (k == "load_timeout_ms") h.load_timeout_ms = detail::parse_uint<uint32_t>(k, v, 86400000);
    else if (k == "mux") h.mux = detail::parse_uint<uint32_t>(k, v, 1) == 1;
  }
  const std::pair<bool, const char*> required[] = {{have_fp, "fingerprint"}, {have_layer, "n_layer"},
                                                    {have_embd, "n_embd"},    {have_vocab, "n_vocab"},
                                                    {have_ctx, "ctx"},        {have_from, "from"},
                                                    {have_stage, "stage"}};
  for (const auto& [have, key] : required)
    if (!have) throw HandshakeError(std::string("HELLO has no '") + key + "' line");
  if (h.chain.empty()) throw HandshakeError("HELLO assigns no layer range (no 'hop' line)");
  try {
    h.sampling.validate();
  } catch (const RequestError& e) {
    throw HandshakeError(std::string("sampling: ") + e.what());
  }
  return h;
}

inline std::string encode_welcome(const Welcome& w) {
  std::string s = "protocol=" + std::to_string(kProtocolVersion) + "\n";
  if (w.mux) s += "mux=1\n";
  for (const StageReport& r : w.stages)
    s += "stage=" + std::to_string(r.stage) + "," + std::to_string(r.range.lo) + "," + std::to_string(r.range.hi) +
         "," + detail::clean(r.profile.arch) + "," + std::to_string(r.profile.threads) + "," + std::to_string(r.ctx) +
         "," + std::to_string(r.bytes_used) + "," + r.where + "\n";
  return s;
}

inline Welcome decode_welcome(std::string_view text) {
  Welcome w;
  for (const auto& [k, v] : detail::parse_lines(text, "WELCOME")) {
    if (k == "mux") w.mux = detail::parse_uint<uint32_t>(k, v, 1) == 1;
    if (k != "stage") continue;
    const auto f = detail::split(k, v, 8);
    StageReport r;
    r.stage = detail::parse_uint<uint32_t>(k, f[0], 65535);
    r.range = LayerRange{detail::parse_uint<int>(k, f[1], INT32_MAX), detail::parse_uint<int>(k, f[2], INT32_MAX)};
    r.profile.arch = std::string(f[3].substr(0, 64));
    r.profile.threads = detail::parse_uint<unsigned>(k, f[4], 65535);
    r.ctx = detail::parse_uint<uint32_t>(k, f[5], UINT32_MAX);
    r.bytes_used = detail::parse_uint<uint64_t>(k, f[6], UINT64_MAX);
    r.where = std::string(f[7].substr(0, 300));
    w.stages.push_back(std::move(r));
    if (w.stages.size() > 1024) throw HandshakeError("WELCOME reports more than 1024 stages");
  }
  return w;
}

namespace detail {
inline std::string range_text(int lo, int hi) { return "[" + std::to_string(lo) + ", " + std::to_string(hi) + ")"; }
}  // namespace detail

// Checks that the chain's ranges, starting where the sender's layers end (`from`), tile the model's
// blocks exactly: no overlap, no gap, nothing empty, nothing past the end. `first_stage` numbers
// chain[0]. The message names the stages and the layers concerned.
inline void check_chain(uint32_t from, const std::vector<Hop>& chain, uint32_t n_layer, uint32_t first_stage) {
  int prev_hi = static_cast<int>(from);
  for (std::size_t i = 0; i < chain.size(); ++i) {
    const LayerRange r = chain[i].range;
    const std::string who = "stage " + std::to_string(first_stage + i) + " (" + chain[i].peer.str() + ") was assigned " +
                            detail::range_text(r.lo, r.hi);
    if (r.lo >= r.hi) throw HandshakeError("layer ranges: " + who + ", which is empty");
    if (r.hi > static_cast<int>(n_layer))
      throw HandshakeError("layer ranges: " + who + ", beyond the model's " + std::to_string(n_layer) + " layers");
    if (r.lo > prev_hi)
      throw HandshakeError("layer ranges leave a gap: the previous stage ends at layer " + std::to_string(prev_hi) +
                           " but " + who + "; layers " + detail::range_text(prev_hi, r.lo) + " would run nowhere");
    if (r.lo < prev_hi)
      throw HandshakeError("layer ranges overlap: the previous stage ends at layer " + std::to_string(prev_hi) +
                           " but " + who + "; layers " + detail::range_text(r.lo, prev_hi) + " would run twice");
    prev_hi = r.hi;
  }
  if (prev_hi != static_cast<int>(n_layer))
    throw HandshakeError("layer ranges leave a gap: the last stage ends at layer " + std::to_string(prev_hi) +
                         "; layers " + detail::range_text(prev_hi, static_cast<int>(n_layer)) +
                         " of the model's " + std::to_string(n_layer) + " would run nowhere");
}

// A worker's checks of a HELLO against its own model; every difference is named.
inline void check_hello(const Hello& h, const ModelIdentity& mine, uint32_t max_ctx) {
  std::string diff;
  auto add = [&](const std::string& d) { diff += (diff.empty() ? "" : "; ") + d; };
  if (h.model.fingerprint != mine.fingerprint)
    add("different model file: the upstream runs '" + printable(h.model.file, 200) + "' (fingerprint " +
        printable(h.model.fingerprint.substr(0, 16)) + "), this worker '" + mine.file + "' (fingerprint " +
        mine.fingerprint.substr(0, 16) + ")");
  auto geo = [&](const char* name, uint32_t theirs, uint32_t ours) {
    if (theirs != ours)
      add(std::string(name) + " " + std::to_string(theirs) + " upstream != " + std::to_string(ours) + " here");
  };
  geo("n_layer", h.model.n_layer, mine.n_layer);
  geo("n_embd", h.model.n_embd, mine.n_embd);
  geo("n_vocab", h.model.n_vocab, mine.n_vocab);
  if (!diff.empty()) throw HandshakeError(diff);
  if (h.ctx == 0 || h.ctx > max_ctx)
    throw HandshakeError("ctx " + std::to_string(h.ctx) + " outside [1, " + std::to_string(max_ctx) +
                         "] (this worker's --max-ctx)");
  check_chain(h.from, h.chain, mine.n_layer, h.stage);
}

}  // namespace pp::net
