// Test helpers for pp_node's version-2 (real-model) mode: model workers as processes, a raw frame client that can
// authenticate, and the frames of a multiplexed connection (HELLO with mux=1, OPEN, BATCH, CLOSE) built by hand.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "node_process.hpp"
#include "pp/io/gguf.hpp"
#include "pp/io/llama_loader.hpp"
#include "pp/io/mmap.hpp"
#include "pp/net/auth.hpp"
#include "pp/net/frame.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/mux_frame.hpp"
#include "pp/text/sampler.hpp"

namespace pp::test {

// A model worker (NodeWorker, node_process.hpp) on `port`; nullopt and a test failure if it does not come up
// within 10 s (scaled).
inline std::optional<NodeWorker> start_node_worker(const std::string& model, const std::vector<std::string>& extra = {},
                                                   uint16_t port = 0) {
  std::vector<std::string> argv = {node_bin(), "--worker", "--model", model, "--host", "127.0.0.1",
                                   "--port", std::to_string(port), "--threads", "1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return start_listening(argv, Millis{10000}, "listening on 127\\.0\\.0\\.1:(\\d+)  \\(Ctrl-C to stop\\)");
}

struct V2Frame {
  uint8_t version = 0;
  pp::net::ModelHeader m;
  std::vector<uint8_t> payload;
  std::string text() const { return std::string(payload.begin(), payload.end()); }
};

// A blocking client speaking raw version-2 frames.
class V2Client : public RawSocket {
 public:
  using RawSocket::RawSocket;

  bool send_frame(pp::net::ModelHeader h, const std::vector<uint8_t>& payload) {
    h.payload_bytes = static_cast<uint32_t>(payload.size());
    return send_head(h, payload);
  }
  // The header as given (payload_bytes may lie), then `payload`.
  bool send_head(const pp::net::ModelHeader& h, const std::vector<uint8_t>& payload = {}) {
    const auto head = pp::net::encode_model_header(h);
    std::vector<uint8_t> b(head.begin(), head.end());
    b.insert(b.end(), payload.begin(), payload.end());
    return send(b);
  }
  bool send_text(uint8_t type, uint64_t session, const std::string& text) {
    pp::net::ModelHeader h;
    h.type = type;
    h.session = session;
    return send_frame(h, std::vector<uint8_t>(text.begin(), text.end()));
  }

  // A version-1 or version-2 frame (the header's version says which layout follows).
  std::optional<V2Frame> read_frame(Millis timeout = Millis{5000}) {
    const auto head = read_n(24, timeout);
    if (!head) return std::nullopt;
    const pp::net::FrameHeader h = pp::net::decode_header(*head);
    V2Frame f;
    f.version = h.version;
    if (h.version == 2) {
      const auto ext = read_n(24, timeout);
      if (!ext) return std::nullopt;
      f.m = pp::net::decode_model_header(h, *ext);
    } else {
      f.m.type = h.type;
      f.m.seq = h.seq;
      f.m.payload_bytes = h.payload_bytes;
    }
    if (f.m.payload_bytes > (64u << 20)) return std::nullopt;
    if (f.m.payload_bytes) {
      auto p = read_n(f.m.payload_bytes, timeout);
      if (!p) return std::nullopt;
      f.payload = std::move(*p);
    }
    return f;
  }

  // Plays the upstream end of the AUTH exchange with `key`; true when the worker's proof checked out
  // and this end's proof was sent (the worker's verdict on it comes with the next reply).
  bool authenticate(const pp::net::PresharedKey& key) {
    const pp::net::Nonce mine = pp::net::random_nonce();
    pp::net::ModelHeader h;
    h.type = pp::net::kTypeAuth;
    h.seq = pp::net::kAuthChallenge;
    if (!send_frame(h, std::vector<uint8_t>(mine.begin(), mine.end()))) return false;
    const auto r = read_frame();
    if (!r || r->m.type != pp::net::kTypeAuth || r->payload.size() != 64) return false;
    pp::net::Nonce theirs;
    std::copy_n(r->payload.begin(), 32, theirs.begin());
    if (!pp::net::auth_proof_matches(key, pp::net::AuthRole::worker, mine, theirs,
                                     std::span(r->payload).subspan(32)))
      return false;
    const pp::net::Proof p = pp::net::auth_proof(key, pp::net::AuthRole::upstream, mine, theirs);
    h.seq = pp::net::kAuthFinish;
    return send_frame(h, std::vector<uint8_t>(p.begin(), p.end()));
  }

  // STATUS as key -> value (empty when refused).
  std::map<std::string, std::string> status() {
    std::map<std::string, std::string> kv;
    if (!send_text(pp::net::kTypeStatus, 0, "")) return kv;
    const auto f = read_frame();
    if (!f || f->m.type != pp::net::kTypeStatus) return kv;
    std::stringstream ss(f->text());
    std::string line;
    while (std::getline(ss, line)) {
      const auto eq = line.find('=');
      if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
    }
    return kv;
  }
};

inline pp::net::ModelIdentity identity_of(const std::string& model) {
  pp::MappedFile f(model);
  const pp::gguf::File g = pp::gguf::parse(f.bytes());
  return pp::net::identify_model(f.bytes(), g, pp::llama::read_config(g), model);
}

// A HELLO for a single worker at `port` running [lo, hi), from a sender whose layers end at `from`.
inline pp::net::Hello hello_for(const std::string& model, uint16_t port, int lo, int hi, uint32_t from,
                                uint32_t ctx = 256) {
  pp::net::Hello h;
  h.model = identity_of(model);
  h.ctx = ctx;
  h.from = from;
  h.stage = 1;
  h.chain.push_back(pp::net::Hop{pp::LayerRange{lo, hi}, pp::net::Peer{"127.0.0.1", port}});
  h.mux = true;  // a worker serves only multiplexed connections
  return h;
}

// HELLO on `c` and its answer.
inline std::optional<V2Frame> handshake(V2Client& c, const pp::net::Hello& h, uint64_t session = 42) {
  if (!c.send_text(pp::net::kTypeHello, session, pp::net::encode_hello(h))) return std::nullopt;
  return c.read_frame(Millis{10000});
}

// ---------------------------------------------------------------- multiplexed connections, raw

// HELLO with mux=1 on `c` and its answer: WELCOME (with mux=1 when every stage accepted) or ERR. `connection`
// is the HELLO's session id: every BATCH on the connection carries it.
inline std::optional<V2Frame> mux_handshake(V2Client& c, pp::net::Hello h, uint64_t connection = 42) {
  h.mux = true;
  return handshake(c, h, connection);
}

// OPEN of `session` with `sampling` (default: argmax), and its answer: OPEN (the last stage's ack) or ERR.
inline std::optional<V2Frame> mux_open(V2Client& c, uint64_t session, const pp::SamplingParams& sampling = {},
                                       uint32_t seq = 0) {
  pp::net::ModelHeader h;
  h.type = pp::net::kTypeOpen;
  h.session = session;
  h.seq = seq;
  const std::string text = pp::net::encode_sampling(sampling);
  if (!c.send_frame(h, std::vector<uint8_t>(text.begin(), text.end()))) return std::nullopt;
  return c.read_frame(Millis{10000});
}

// CLOSE of `session` (no reply).
inline bool mux_close(V2Client& c, uint64_t session) {
  pp::net::ModelHeader h;
  h.type = pp::net::kTypeClose;
  h.session = session;
  return c.send_frame(h, {});
}

// A BATCH header on `connection` for the receiver's layers [lo, hi): rows = the entries' rows, payload_bytes
// the size of a well-formed payload (a test may overwrite either to lie).
inline pp::net::ModelHeader batch_header(uint64_t connection, uint32_t lo, uint32_t hi, uint32_t seq,
                                         const std::vector<pp::net::BatchEntry>& entries, uint32_t n_embd) {
  pp::net::ModelHeader h;
  h.type = pp::net::kTypeBatch;
  h.session = connection;
  h.layer_lo = lo, h.layer_hi = hi;
  h.seq = seq;
  uint64_t rows = 0;
  for (const pp::net::BatchEntry& e : entries) rows += e.rows;
  h.rows = static_cast<uint32_t>(rows);
  h.payload_bytes = static_cast<uint32_t>(pp::net::batch_payload_bytes(entries.size(), rows, n_embd));
  return h;
}

// The bytes of a BATCH: `h` as given, the entry table, then `rows` (little-endian f32, each entry's rows in
// entry order).
inline std::vector<uint8_t> batch_bytes(const pp::net::ModelHeader& h, const std::vector<pp::net::BatchEntry>& entries,
                                        const std::vector<float>& rows) {
  const auto head = pp::net::encode_model_header(h);
  std::vector<uint8_t> b(head.begin(), head.end());
  const std::vector<uint8_t> table = pp::net::encode_batch_table(entries);
  b.insert(b.end(), table.begin(), table.end());
  const auto* p = reinterpret_cast<const uint8_t*>(rows.data());
  b.insert(b.end(), p, p + rows.size() * 4);
  return b;
}

// A well-formed BATCH of `entries` with `rows` ([sum of the entries' rows, n_embd] values), sent whole.
inline bool send_batch(V2Client& c, uint64_t connection, uint32_t lo, uint32_t hi, uint32_t seq,
                       const std::vector<pp::net::BatchEntry>& entries, const std::vector<float>& rows, uint32_t n_embd) {
  return c.send(batch_bytes(batch_header(connection, lo, hi, seq, entries, n_embd), entries, rows));
}

// STATUS of the worker at `port` (authenticating first when a key is given).
inline std::map<std::string, std::string> worker_status(uint16_t port, const pp::net::PresharedKey* key = nullptr) {
  V2Client c(port);
  if (key && !c.authenticate(*key)) return {};
  return c.status();
}

// A count from the worker's STATUS (SIZE_MAX when absent): `connections_active` counts connections that
// completed a HELLO, `sessions_active` the sessions opened on them (each a KV cache).
inline std::size_t status_count(uint16_t port, const std::string& name, const pp::net::PresharedKey* key = nullptr) {
  const auto kv = worker_status(port, key);
  const auto it = kv.find(name);
  return it == kv.end() ? SIZE_MAX : std::stoul(it->second);
}

inline std::size_t active_sessions(uint16_t port, const pp::net::PresharedKey* key = nullptr) {
  return status_count(port, "sessions_active", key);
}

// True once the worker's STATUS reports `want` for `name`, within `timeout` (scaled to the host).
inline bool wait_count(uint16_t port, const std::string& name, std::size_t want, Millis timeout,
                       const pp::net::PresharedKey* key = nullptr) {
  const auto deadline = Clock::now() + slack(timeout);
  while (status_count(port, name, key) != want) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(Millis{20});
  }
  return true;
}

// True once the worker reports `want` active sessions, within `timeout` (scaled to the host).
inline bool wait_sessions(uint16_t port, std::size_t want, Millis timeout, const pp::net::PresharedKey* key = nullptr) {
  return wait_count(port, "sessions_active", want, timeout, key);
}

// True once the worker reports `want` connections past their HELLO, within `timeout`.
inline bool wait_connections(uint16_t port, std::size_t want, Millis timeout, const pp::net::PresharedKey* key = nullptr) {
  return wait_count(port, "connections_active", want, timeout, key);
}

}  // namespace pp::test
