// libFuzzer target: bytes from a peer -> PCPL frame decoding, bounds checks, handshake texts, placeholder serving.
//
// 1. frame.hpp / model_frame.hpp: decode_header, decode_frame, check_fwd_v1, decode_model_header;
//    whatever decodes must re-encode to the same bytes, whatever a check accepts must be within its limits.
// 2. mux_frame.hpp: a version-2 BATCH (the only version-2 frame that carries residual rows) through
//    check_batch_header / check_batch_count / its entry table / check_batch_entries, whose acceptance
//    must imply the documented bounds, against the frame's own range and session and against another
//    assignment (which must refuse); the BRES those entries ask for is bounded and decodes to what was
//    encoded.
// 3. handshake.hpp: a version-2 HELLO / WELCOME / STATUS / OPEN payload (or, failing that, the whole
//    input) as handshake text; whatever decodes must survive encode -> decode unchanged and check_hello.
// 4. placeholder_worker.hpp: the whole input as the byte stream of one connection, served by
//    serve_placeholder over a socketpair; every reply it sends must decode as a version-1 frame.
// 5. auth.hpp: the whole input as what the upstream sends to admit_upstream (worker side), and as
//    what the worker answers to authenticate_with_worker (upstream side). Neither may return: the
//    input does not hold the key, and every exchange uses fresh nonces.
// Only pp::Error may escape; anything else is a finding.
#include "fuzz_common.hpp"

#include <pp/core/error.hpp>
#include <pp/net/auth.hpp>
#include <pp/net/channel.hpp>
#include <pp/net/frame.hpp>
#include <pp/net/handshake.hpp>
#include <pp/net/model_frame.hpp>
#include <pp/net/mux_frame.hpp>
#include <pp/net/placeholder_worker.hpp>
#include <pp/net/socket.hpp>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <sys/socket.h>
#include <unistd.h>

namespace {

namespace net = pp::net;
using pp::fuzz::fail;

// Limits small enough that an accepted FWD is cheap to run (placeholder layers x payload words).
constexpr net::FrameLimits kLimits{.max_payload = 1u << 16, .max_layer_range = 64};

void frames(std::span<const uint8_t> bytes) {
  net::FrameHeader h;
  try {
    h = net::decode_header(bytes);
  } catch (const pp::FrameError&) {
    return;
  }
  const auto again = net::encode_header(h);
  if (std::memcmp(again.data(), bytes.data(), again.size()) != 0) fail("encode_header(decode_header(b)) != b");
  try {
    const net::FrameView v = net::decode_frame(bytes);
    if (v.payload.size() != h.payload_bytes || v.payload.data() != bytes.data() + net::kFrameHeaderBytes ||
        v.payload.size() > bytes.size() - net::kFrameHeaderBytes)
      fail("decode_frame's payload is not the announced bytes after the header");
  } catch (const pp::FrameError&) {
    if (h.payload_bytes <= bytes.size() - net::kFrameHeaderBytes) fail("decode_frame refused a complete frame");
  }
  try {
    net::check_fwd_v1(h, kLimits);
    if (h.payload_bytes > kLimits.max_payload || h.payload_bytes % 4 != 0 || h.layer_lo > h.layer_hi ||
        h.layer_hi - h.layer_lo > kLimits.max_layer_range)
      fail("check_fwd_v1 accepted a header outside its limits");
  } catch (const pp::FrameError&) {
  }
  if (h.version != net::kVersionModel) return;
  net::ModelHeader m;
  try {
    m = net::decode_model_header(h, bytes.subspan(net::kFrameHeaderBytes));
  } catch (const pp::FrameError&) {
    return;
  }
  const auto encoded = net::encode_model_header(m);
  // Bytes 6..7 (common reserved) and 46..47 (extension reserved) are sent as zero and ignored.
  for (std::size_t i = 0; i < encoded.size(); ++i)
    if (i != 6 && i != 7 && i != 46 && i != 47 && encoded[i] != bytes[i])
      fail("encode_model_header(decode_model_header(b)) != b");
}

// A BATCH: header checks, then the entry count, the table and the entries, as a mux worker reads them.
void batch(std::span<const uint8_t> bytes) {
  if (bytes.size() < net::kModelHeaderBytes) return;
  net::ModelHeader m;
  try {
    const net::FrameHeader h = net::decode_header(bytes);
    if (h.version != net::kVersionModel || h.type != net::kTypeBatch) return;
    m = net::decode_model_header(h, bytes.subspan(net::kFrameHeaderBytes));
  } catch (const pp::FrameError&) {
    return;
  }
  const net::ModelGeometry g{.n_embd = 4, .n_vocab = 32, .ctx = 64};
  const std::span<const uint8_t> payload = bytes.subspan(net::kModelHeaderBytes);
  try {
    // Another connection's session or another range is refused whatever else the header says.
    net::check_batch_header(m, g, m.layer_lo, m.layer_hi, m.session ^ 1);
    fail("check_batch_header accepted a BATCH of another connection");
  } catch (const pp::FrameError&) {
  }
  try {
    net::check_batch_header(m, g, m.layer_lo + 1, m.layer_hi, m.session);
    fail("check_batch_header accepted a BATCH for another layer range");
  } catch (const pp::FrameError&) {
  }
  try {
    net::check_batch_header(m, g, m.layer_lo, m.layer_hi, m.session);
    if (m.rows == 0 || m.rows > g.ctx || m.flags != 0 || m.dtype != net::kDTypeF32)
      fail("check_batch_header accepted a header outside its limits");
    if (payload.size() < 4) return;
    const uint32_t n = net::detail::get_be32(payload.data());
    net::check_batch_count(m, n, g.n_embd);
    if (n == 0 || n > net::kMaxBatchEntries || n > m.rows || m.payload_bytes != net::batch_payload_bytes(n, m.rows, g.n_embd))
      fail("check_batch_count accepted a count outside its limits");
    if (payload.size() < 4 + std::size_t(n) * net::kBatchEntryBytes) return;
    std::vector<net::BatchEntry> entries;
    for (uint32_t i = 0; i < n; ++i)
      entries.push_back(net::decode_batch_entry(
          payload.subspan(4 + std::size_t(i) * net::kBatchEntryBytes).first<net::kBatchEntryBytes>()));
    const std::vector<uint8_t> table = net::encode_batch_table(entries);
    for (std::size_t i = 0; i < table.size(); ++i)  // bytes 21..23 of each entry are reserved
      if ((i < 4 || (i - 4) % net::kBatchEntryBytes < 21) && table[i] != payload[i])
        fail("encode_batch_table(decoded entries) != the table");
    net::check_batch_entries(m, entries);
    uint64_t rows = 0;
    for (const net::BatchEntry& e : entries) rows += e.rows;
    if (rows != m.rows) fail("check_batch_entries accepted entries whose rows do not add up");
    uint32_t logits_entries = 0;
    for (const net::BatchEntry& e : entries) {
      if (e.flags & ~net::kKnownEntryFlags) fail("check_batch_entries accepted unknown entry flags");
      logits_entries += (e.flags & net::kEntryLogits) ? 1 : 0;
    }
    if (logits_entries > net::kMaxLogitsEntries) fail("check_batch_entries accepted more logits entries than the limit");
    // The BRES these entries ask for: bounded, and it decodes to what was encoded.
    std::vector<int32_t> tokens(n);
    std::vector<float> logits(std::size_t(n) * g.n_vocab);
    for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = float(i % 97) - 48.5f;
    for (uint32_t i = 0; i < n; ++i) tokens[i] = int32_t(i * 7 % g.n_vocab);
    const std::vector<uint8_t> res = net::encode_batch_res(entries, tokens, logits, g.n_vocab);
    if (res.size() != net::batch_res_bytes(entries, g.n_vocab) || res.size() > net::max_batch_res_bytes(g.n_vocab))
      fail("a BRES of accepted entries is not the size the flags fix, or past the bound");
    const std::vector<net::EntryResult> back = net::decode_batch_res(res, entries, g.n_vocab);
    for (uint32_t i = 0; i < n; ++i) {
      const std::span<const float> row(logits.data() + std::size_t(i) * g.n_vocab, g.n_vocab);
      if (back[i].token != tokens[i] || back[i].digest.has_value() != bool(entries[i].flags & net::kEntryDigest) ||
          (back[i].digest && *back[i].digest != net::logits_digest(row)) ||
          ((entries[i].flags & net::kEntryLogits) &&
           std::memcmp(back[i].logits.data(), row.data(), row.size_bytes()) != 0))
        fail("decode_batch_res(encode_batch_res(...)) differs");
    }
  } catch (const pp::FrameError&) {
  }
}

bool same(const net::Hello& a, const net::Hello& b) {
  if (a.protocol != b.protocol || a.model.fingerprint != b.model.fingerprint ||
      net::detail::clean(a.model.file) != b.model.file || a.model.n_layer != b.model.n_layer ||
      a.model.n_embd != b.model.n_embd || a.model.n_vocab != b.model.n_vocab || a.ctx != b.ctx || a.from != b.from ||
      a.stage != b.stage || a.chain.size() != b.chain.size() || a.sampling.temperature != b.sampling.temperature ||
      a.sampling.top_k != b.sampling.top_k || a.sampling.top_p != b.sampling.top_p ||
      a.sampling.min_p != b.sampling.min_p || a.sampling.seed != b.sampling.seed || a.timeout_ms != b.timeout_ms ||
      a.load_timeout_ms != b.load_timeout_ms)
    return false;
  for (std::size_t i = 0; i < a.chain.size(); ++i)
    if (a.chain[i].range.lo != b.chain[i].range.lo || a.chain[i].range.hi != b.chain[i].range.hi ||
        a.chain[i].peer.host != b.chain[i].peer.host || a.chain[i].peer.port != b.chain[i].peer.port)
      return false;
  return true;
}

void handshake(std::string_view text) {
  try {
    const net::Hello h = net::decode_hello(text);
    const std::string wire = net::encode_hello(h);
    net::Hello back;
    try {
      back = net::decode_hello(wire);
    } catch (const pp::Error& e) {
      fail("decode_hello refused what encode_hello wrote", e.what());
    }
    if (!same(h, back)) fail("decode_hello(encode_hello(h)) != h", wire);
    // The worker's checks against a model that matches the HELLO's geometry (so the chain is checked too).
    net::ModelIdentity mine = h.model;
    try {
      net::check_hello(h, mine, 4096);
    } catch (const net::HandshakeError&) {
    }
    mine.fingerprint += "x";
    try {
      net::check_hello(h, mine, 4096);
      fail("check_hello accepted a different fingerprint");
    } catch (const net::HandshakeError&) {
    }
  } catch (const net::HandshakeError&) {
  }
  try {
    const net::Welcome w = net::decode_welcome(text);
    const std::string wire = net::encode_welcome(w);
    net::Welcome back;
    try {
      back = net::decode_welcome(wire);
    } catch (const pp::Error& e) {
      fail("decode_welcome refused what encode_welcome wrote", e.what());
    }
    if (back.stages.size() != w.stages.size()) fail("decode_welcome(encode_welcome(w)) lost stages", wire);
    for (std::size_t i = 0; i < w.stages.size(); ++i) {
      const net::StageReport &a = w.stages[i], &b = back.stages[i];
      if (a.stage != b.stage || a.range.lo != b.range.lo || a.range.hi != b.range.hi ||
          net::detail::clean(a.profile.arch) != b.profile.arch || a.profile.threads != b.profile.threads ||
          a.ctx != b.ctx || a.bytes_used != b.bytes_used || a.where != b.where)
        fail("decode_welcome(encode_welcome(w)) != w", wire);
    }
  } catch (const net::HandshakeError&) {
  }
  try {
    const pp::SamplingParams sp = net::decode_sampling(text);
    const std::string wire = net::encode_sampling(sp);
    pp::SamplingParams back;
    try {
      back = net::decode_sampling(wire);
    } catch (const pp::Error& e) {
      fail("decode_sampling refused what encode_sampling wrote", e.what());
    }
    if (back.temperature != sp.temperature || back.top_k != sp.top_k || back.top_p != sp.top_p ||
        back.min_p != sp.min_p || back.seed != sp.seed)
      fail("decode_sampling(encode_sampling(s)) != s", wire);
  } catch (const net::HandshakeError&) {
  }
}

// The handshake text of a version-2 HELLO / WELCOME / STATUS frame, else the whole input.
std::string_view handshake_text(std::span<const uint8_t> bytes) {
  const std::string_view all(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  try {
    const net::FrameHeader h = net::decode_header(bytes);
    if (h.version != net::kVersionModel || bytes.size() < net::kModelHeaderBytes) return all;
    if (h.type != net::kTypeHello && h.type != net::kTypeWelcome && h.type != net::kTypeStatus &&
        h.type != net::kTypeOpen)
      return all;
    const std::size_t n = std::min<std::size_t>(h.payload_bytes, bytes.size() - net::kModelHeaderBytes);
    return all.substr(net::kModelHeaderBytes, n);
  } catch (const pp::FrameError&) {
    return all;
  }
}

// Runs `serve` on the server end of a socketpair whose client end has sent `bytes` and shut its
// write side (so every read completes or sees end of stream at once); returns what the server sent.
template <class Serve>
std::vector<uint8_t> over_connection(std::span<const uint8_t> bytes, Serve&& serve) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) fail("socketpair failed");
  net::Fd client(sv[0]);
  std::size_t sent = 0;  // inputs stay far below the socket buffer
  while (sent < bytes.size()) {
    const ssize_t w = ::send(client.get(), bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (w <= 0) fail("socketpair send failed (input larger than the socket buffer?)");
    sent += std::size_t(w);
  }
  ::shutdown(client.get(), SHUT_WR);
  std::vector<uint8_t> replies;
  net::Channel ch(net::Fd(sv[1]), net::Peer{"fuzz", 1}, "upstream",
                  net::Timeouts{.io = net::Millis(2000), .idle = net::Millis(2000)});
  serve(ch);
  // Every reply is queued by now. Read them before the server's end closes: closing a unix socket
  // with unread input resets the peer, which could drop them.
  uint8_t buf[65536];
  while (true) {
    const ssize_t r = ::recv(client.get(), buf, sizeof buf, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (r < 0) fail("socketpair recv failed", std::strerror(errno));
    if (r == 0) break;
    replies.insert(replies.end(), buf, buf + r);
  }
  return replies;
}

// The input as one connection's bytes into serve_placeholder; its replies must be well-formed frames.
void serve(std::span<const uint8_t> bytes) {
  const std::vector<uint8_t> replies = over_connection(bytes, [](net::Channel& ch) {
    try {
      net::serve_placeholder(ch, kLimits);
    } catch (const pp::Error&) {
    }
  });
  std::span<const uint8_t> rest(replies);
  while (!rest.empty()) {
    net::FrameView v;
    try {
      v = net::decode_frame(rest);
    } catch (const pp::FrameError& e) {
      fail("serve_placeholder sent a malformed frame", e.what());
    }
    if (v.header.version != net::kVersionPlaceholder || (v.header.type != net::kTypeRes && v.header.type != net::kTypeErr))
      fail("serve_placeholder sent a frame that is neither a version-1 RES nor an ERR");
    if (v.header.type == net::kTypeErr && v.header.payload_bytes > net::kMaxErrMessageBytes)
      fail("serve_placeholder sent an ERR longer than kMaxErrMessageBytes");
    rest = rest.subspan(net::kFrameHeaderBytes + v.payload.size());
  }
}

// Both ends of the AUTH exchange against bytes that do not hold the key: each must refuse.
void auth(std::span<const uint8_t> bytes) {
  static const net::PresharedKey key("fuzz-key-0123456789abcdef", "fuzz");
  over_connection(bytes, [](net::Channel& ch) {
    try {
      const std::optional<net::ModelHeader> first = net::detail::read_auth_header(ch);
      if (!first) return;
      net::admit_upstream(ch, *first, key);
      fail("admit_upstream admitted an upstream that does not hold the key");
    } catch (const pp::Error&) {
    }
  });
  over_connection(bytes, [](net::Channel& ch) {
    try {
      net::authenticate_with_worker(ch, key);
      fail("authenticate_with_worker accepted a worker that does not hold the key");
    } catch (const pp::Error&) {
    }
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  frames(bytes);
  batch(bytes);
  handshake(handshake_text(bytes));
  if (size <= 65536) {
    serve(bytes);
    auth(bytes);
  }
  return 0;
}
