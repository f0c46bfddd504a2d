// Version-2 I/O on a Channel, and ModelLink: one end's connection to the next worker of a chain.
//
// The coordinator's connection to the first worker and each worker's connection to its next hop are
// the same thing: authenticate, send HELLO and read WELCOME; then the connection carries multiplexed
// sessions (mux_frame.hpp). Every error names the hop ("worker 10.0.0.2:52100 (stage 2, layers
// [8, 16))") and what happened.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pp/core/error.hpp"
#include "pp/net/auth.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/frame.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/sha256.hpp"
#include "pp/net/socket.hpp"

namespace pp::net {

// ---- frames on a channel ----

// The 24 extension bytes that follow a version-2 common header.
inline ModelHeader read_extension(Channel& ch, const FrameHeader& h) {
  std::array<uint8_t, kModelExtBytes> ext;
  ch.read_into(ext, "version-2 header extension");
  return decode_model_header(h, ext);
}

inline void send_model(Channel& ch, ModelHeader h, std::span<const uint8_t> payload) {
  h.payload_bytes = static_cast<uint32_t>(payload.size());
  const auto head = encode_model_header(h);
  ch.send_encoded(head, payload);
}

// `permanent`: the refusal is final (kErrPermanent), e.g. another model file or a wrong chain.
inline void send_model_err(Channel& ch, const ModelHeader& about, std::string_view message, bool permanent = false) {
  ModelHeader h = about;
  h.type = kTypeErr;
  h.flags = permanent ? kErrPermanent : 0;
  const std::string_view text = message.substr(0, kMaxErrMessageBytes);
  send_model(ch, h, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

inline void send_model_text(Channel& ch, ModelHeader h, std::string_view text) {
  send_model(ch, h, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

// A text payload (HELLO, WELCOME, STATUS, ERR), refused before reading when it is over the limit.
inline std::string read_text(Channel& ch, uint32_t payload_bytes, const std::string& what) {
  if (payload_bytes > kMaxTextPayload)
    throw FrameError(what + " from " + ch.who() + ": payload_bytes " + std::to_string(payload_bytes) +
                     " > limit " + std::to_string(kMaxTextPayload));
  std::string s(payload_bytes, '\0');
  ch.read_into(std::span(reinterpret_cast<uint8_t*>(s.data()), s.size()), "frame payload");
  return s;
}

// ---- the link to the next hop ----

// How long an upstream end waits for a reply that `hops_below` workers must compute: the hop nearest
// a stalled peer times out first and its ERR, which names that peer, arrives before anyone else's
// timeout fires.
inline constexpr Millis kHopSlack{1000};
inline Millis reply_wait(Millis timeout, std::size_t hops_below) {
  if (timeout == kNoTimeout) return timeout;
  return timeout + kHopSlack * static_cast<int64_t>(hops_below > 0 ? hops_below - 1 : 0);
}

inline std::string hop_name(const Hop& hop, uint32_t stage) {
  return "worker " + hop.peer.str() + " (stage " + std::to_string(stage) + ", layers [" +
         std::to_string(hop.range.lo) + ", " + std::to_string(hop.range.hi) + "))";
}

class ModelLink {
 public:
  // Connects within timeouts.io. `reply_wait` bounds the wait for each reply's first byte: it covers
  // the compute of every stage below, so upstream ends wait longer than the hop nearest a fault.
  ModelLink(const Hop& hop, uint32_t stage, Timeouts timeouts, Millis reply_wait)
      : hop_(hop), stage_(stage), io_(timeouts.io), reply_wait_(reply_wait),
        who_(hop_name(hop, stage)),
        ch_(connect_tcp(hop.peer, timeouts.io, who_), hop.peer, "worker", Timeouts{io_, reply_wait}) {
    ch_.set_who(who_);  // socket errors then name the stage too
  }

  const std::string& who() const { return who_; }
  const Hop& hop() const { return hop_; }
  uint32_t stage() const { return stage_; }
  uint64_t bytes_sent() const { return sent_; }
  uint64_t bytes_received() const { return received_; }

  // The connection itself, for a multiplexed session (mux_frame.hpp), where one thread sends and
  // another reads; it counts what it moves with count_sent / count_received (the counters are atomic).
  Channel& channel() { return ch_; }
  void count_sent(uint64_t n) { sent_ += n; }
  void count_received(uint64_t n) { received_ += n; }

  // Before HELLO when this end holds a key: proves it to the worker and checks the worker's proof
  // (auth.hpp). Throws AuthError naming this hop when they disagree or the worker refuses.
  void authenticate(const PresharedKey& key) {
    authenticate_with_worker(ch_, key);
    sent_ += 2 * kModelHeaderBytes + kNonceBytes + kProofBytes;
    received_ += kModelHeaderBytes + kNonceBytes + kProofBytes;
  }

  // Sends HELLO; a worker connects to its own next hop and loads its stage before answering, so the
  // answer may take `wait` (stage loading), not just a round trip.
  void send_hello(const Hello& hello, uint64_t session) {
    ModelHeader h;
    h.type = kTypeHello;
    h.session = session;
    h.layer_lo = static_cast<uint32_t>(hello.chain.front().range.lo);
    h.layer_hi = static_cast<uint32_t>(hello.chain.front().range.hi);
    const std::string text = encode_hello(hello);
    send_model_text(ch_, h, text);
    sent_ += kModelHeaderBytes + text.size();
  }

  Welcome read_welcome(Millis wait) {
    ch_.set_timeouts(Timeouts{io_, wait});
    const ModelHeader h = read_reply_header("HELLO");
    ch_.set_timeouts(Timeouts{io_, reply_wait_});
    if (h.type != kTypeWelcome)
      throw FrameError(who_ + " answered HELLO with " + model_type_name(h.type) + " (expected WELCOME)");
    const std::string text = read_text(ch_, h.payload_bytes, "WELCOME");
    received_ += text.size();
    try {
      return decode_welcome(text);
    } catch (const HandshakeError& e) {
      throw Error(who_ + ": malformed WELCOME: " + e.what());
    }
  }

 private:
  // A header of a reply: version 2 (its extension read), or an ERR turned into an exception with the
  // peer's text. A version-1 ERR is what a placeholder worker answers a version-2 frame with.
  ModelHeader read_reply_header(const std::string& answering) {
    std::optional<FrameHeader> h;
    try {
      h = ch_.read_header();
    } catch (const FrameError& e) {  // bad magic: garbage from the peer
      throw Error(who_ + ": " + e.what() + " (garbage instead of a reply to " + answering + ")");
    }
    if (!h)
      throw NetError(NetError::Kind::closed, who_ + ": closed the connection before answering " + answering);
    received_ += kFrameHeaderBytes;
    if (h->version == kVersionPlaceholder && h->type == kTypeErr) {
      const std::string text = read_text(ch_, h->payload_bytes, "ERR");
      throw RefusedError(who_ + " speaks version 1 (a placeholder worker, started without --model): " + text);
    }
    if (h->version != kVersionModel)
      throw FrameError(who_ + ": answered with version " + std::to_string(h->version) + " (expected " +
                       std::to_string(kVersionModel) + ")");
    const ModelHeader m = read_extension(ch_, *h);
    received_ += kModelExtBytes;
    if (m.type == kTypeErr) {
      const std::string text = read_text(ch_, m.payload_bytes, "ERR");
      if (m.flags & kErrPermanent) throw RefusedError(who_ + " reports: " + text);
      throw Error(who_ + " reports: " + text);
    }
    return m;
  }

  Hop hop_;
  uint32_t stage_;
  Millis io_, reply_wait_;
  std::string who_;
  Channel ch_;
  std::atomic<uint64_t> sent_{0}, received_{0};
};

}  // namespace pp::net
