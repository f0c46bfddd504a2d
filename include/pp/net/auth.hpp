// Who may open a session on a worker: mutual challenge-response over a pre-shared key (HMAC-SHA256, OpenSSL).
//
// Before HELLO, an upstream end (the coordinator, or a worker towards its next hop) and a worker that
// requires a key exchange three AUTH frames (docs/PROTOCOL-TCP.md "Authentication"):
//
//   1  upstream -> worker   Nu                              32 random bytes
//   2  worker -> upstream   Nw || HMAC(K, "PCPL-AUTH-1" W Nu Nw)   the worker proves it holds K first
//   3  upstream -> worker   HMAC(K, "PCPL-AUTH-1" U Nu Nw)        sent only after step 2 checked out
//
// The key never crosses the wire; both nonces come from OpenSSL's CSPRNG, so no proof can be replayed
// into another connection; the role byte (W / U) keeps a worker from being used to compute the
// upstream's proof; proofs are compared in constant time. Every AUTH payload has a fixed size that is
// checked before it is read. This authenticates the two ends when a connection opens; it does not
// encrypt or protect later frames (a tunnel does that).
#pragma once

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pp/core/error.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/frame.hpp"
#include "pp/net/model_frame.hpp"

namespace pp::net {

inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kProofBytes = 32;   // HMAC-SHA256
inline constexpr std::size_t kMinKeyBytes = 16;  // shorter keys are guessable
inline constexpr std::size_t kMaxKeyBytes = 4096;
// The steps, carried in the AUTH frame's seq field, and their fixed payload sizes.
inline constexpr uint32_t kAuthChallenge = 1;  // Nu
inline constexpr uint32_t kAuthResponse = 2;   // Nw || worker proof
inline constexpr uint32_t kAuthFinish = 3;     // upstream proof
// With a key, a new connection's whole exchange (three AUTH frames) must be done within this, however
// the peer paces its bytes: one round trip for a key holder, and all a trickling stranger can take.
inline constexpr Millis kAuthBudget{5000};

// An ERR arriving during the exchange comes from an end not yet trusted: its text is kept short.
inline constexpr uint32_t kMaxAuthErrBytes = 1024;

// A refused or failed exchange; the message contains "authentication failed".
class AuthError : public Error {
 public:
  using Error::Error;
};

// The pre-shared key. Its bytes never appear in a message; they are wiped when it is destroyed.
class PresharedKey {
 public:
  // `what` names the source in errors ("--psk-file 'k.txt'"), never the key.
  PresharedKey(std::string_view bytes, const std::string& what) : bytes_(bytes.begin(), bytes.end()) {
    if (bytes_.size() < kMinKeyBytes || bytes_.size() > kMaxKeyBytes) {
      const std::size_t n = bytes_.size();
      wipe();
      throw Error(what + ": a pre-shared key of " + std::to_string(n) + " bytes is outside [" +
                  std::to_string(kMinKeyBytes) + ", " + std::to_string(kMaxKeyBytes) +
                  "] (e.g. `openssl rand -hex 32`)");
    }
  }
  PresharedKey(const PresharedKey&) = delete;
  PresharedKey& operator=(const PresharedKey&) = delete;
  ~PresharedKey() { wipe(); }

  std::span<const uint8_t> bytes() const { return bytes_; }

 private:
  void wipe() {
    if (!bytes_.empty()) OPENSSL_cleanse(bytes_.data(), bytes_.size());
  }
  std::vector<uint8_t> bytes_;
};

using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

// Which end a proof comes from: the byte that separates the two proofs of one exchange.
enum class AuthRole : uint8_t { worker = 'W', upstream = 'U' };

inline Nonce random_nonce() {
  Nonce n;
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1)
    throw Error("authentication: the system's random number generator failed (RAND_bytes)");
  return n;
}

// HMAC-SHA256(key, "PCPL-AUTH-1" || role || Nu || Nw).
inline Proof auth_proof(const PresharedKey& key, AuthRole role, const Nonce& upstream_nonce,
                        const Nonce& worker_nonce) {
  static constexpr std::string_view kLabel = "PCPL-AUTH-1";
  std::array<uint8_t, kLabel.size() + 1 + 2 * kNonceBytes> msg;
  std::size_t off = 0;
  for (char c : kLabel) msg[off++] = static_cast<uint8_t>(c);
  msg[off++] = static_cast<uint8_t>(role);
  for (uint8_t b : upstream_nonce) msg[off++] = b;
  for (uint8_t b : worker_nonce) msg[off++] = b;
  Proof p;
  unsigned len = 0;
  if (!HMAC(EVP_sha256(), key.bytes().data(), static_cast<int>(key.bytes().size()), msg.data(), msg.size(), p.data(),
            &len) ||
      len != p.size())
    throw Error("authentication: HMAC-SHA256 failed (OpenSSL)");
  return p;
}

// Constant time: how many leading bytes match does not show in the timing.
inline bool auth_proof_matches(const PresharedKey& key, AuthRole role, const Nonce& upstream_nonce,
                               const Nonce& worker_nonce, std::span<const uint8_t> proof) {
  const Proof want = auth_proof(key, role, upstream_nonce, worker_nonce);
  return proof.size() == want.size() && CRYPTO_memcmp(proof.data(), want.data(), want.size()) == 0;
}

namespace detail {

inline void send_auth(Channel& ch, uint8_t type, uint32_t step, std::span<const uint8_t> payload) {
  ModelHeader h;
  h.type = type;
  h.seq = step;
  h.payload_bytes = static_cast<uint32_t>(payload.size());
  const auto head = encode_model_header(h);
  ch.send_encoded(head, payload);
}

// Best effort: the far end may already be gone.
inline void send_auth_err(Channel& ch, std::string_view text) {
  try {
    send_auth(ch, kTypeErr, 0, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  } catch (const Error&) {
  }
}

// An ERR's text from an end not yet trusted: bounded, one line, printable.
inline std::string untrusted_text(Channel& ch, uint32_t payload_bytes) {
  if (payload_bytes > kMaxAuthErrBytes)
    throw FrameError("ERR from " + ch.who() + " during authentication: payload_bytes " +
                     std::to_string(payload_bytes) + " > limit " + std::to_string(kMaxAuthErrBytes));
  std::string s(payload_bytes, '\0');
  ch.read_into(std::span(reinterpret_cast<uint8_t*>(s.data()), s.size()), "ERR payload");
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return s;
}

// The next frame of the exchange: a version-2 header with its extension, or nullopt when the peer closed.
inline std::optional<ModelHeader> read_auth_header(Channel& ch, FrameHeader* common = nullptr) {
  const std::optional<FrameHeader> h = ch.read_header();
  if (!h) return std::nullopt;
  if (common) *common = *h;
  if (h->version != kVersionModel) {
    ModelHeader m;
    m.type = h->type;
    m.payload_bytes = h->payload_bytes;
    return m;  // the caller sees the version through `common`
  }
  std::array<uint8_t, kModelExtBytes> ext;
  ch.read_into(ext, "version-2 header extension");
  return decode_model_header(*h, ext);
}

}  // namespace detail

// The upstream end of the exchange, on a fresh connection before HELLO: checks the worker's proof, then
// sends its own. Throws AuthError naming the worker when the proofs disagree or the worker refuses.
inline void authenticate_with_worker(Channel& ch, const PresharedKey& key) {
  const Nonce mine = random_nonce();
  detail::send_auth(ch, kTypeAuth, kAuthChallenge, mine);
  FrameHeader common;
  const std::optional<ModelHeader> m = detail::read_auth_header(ch, &common);
  if (!m) throw NetError(NetError::Kind::closed, ch.who() + ": closed the connection during authentication");
  if (common.version == kVersionPlaceholder && m->type == kTypeErr)
    throw AuthError(ch.who() + ": authentication failed: it speaks version 1 (a placeholder worker, which has no "
                               "authentication): " + detail::untrusted_text(ch, m->payload_bytes));
  if (common.version != kVersionModel)
    throw FrameError(ch.who() + ": answered AUTH with version " + std::to_string(common.version));
  if (m->type == kTypeErr) throw AuthError(ch.who() + " reports: " + detail::untrusted_text(ch, m->payload_bytes));
  if (m->type != kTypeAuth || m->seq != kAuthResponse || m->payload_bytes != kNonceBytes + kProofBytes)
    throw FrameError(ch.who() + ": answered AUTH with " + model_type_name(m->type) + " seq " + std::to_string(m->seq) +
                     " of " + std::to_string(m->payload_bytes) + " bytes (expected AUTH step 2 of " +
                     std::to_string(kNonceBytes + kProofBytes) + " bytes)");
  std::array<uint8_t, kNonceBytes + kProofBytes> got;
  ch.read_into(got, "AUTH payload");
  Nonce theirs;
  std::copy_n(got.begin(), kNonceBytes, theirs.begin());
  if (!auth_proof_matches(key, AuthRole::worker, mine, theirs, std::span(got).subspan(kNonceBytes))) {
    detail::send_auth_err(ch, "authentication failed: this worker's proof does not match the upstream's "
                              "pre-shared key (the two ends hold different keys)");
    throw AuthError(ch.who() + ": authentication failed: its proof does not match this end's pre-shared key "
                               "(the two ends hold different keys)");
  }
  const Proof p = auth_proof(key, AuthRole::upstream, mine, theirs);
  detail::send_auth(ch, kTypeAuth, kAuthFinish, p);
}

// The worker end, gating a connection whose first frame is `first` (its extension read, its payload not):
// returns once the upstream has proved it holds `key`; otherwise answers ERR and throws AuthError. Reads
// at most the three fixed-size AUTH payloads (or a bounded ERR) before deciding.
inline void admit_upstream(Channel& up, const ModelHeader& first, const PresharedKey& key) {
  auto refuse = [&](const ModelHeader& about, const std::string& why) {
    ModelHeader h = about;
    h.type = kTypeErr;
    h.payload_bytes = static_cast<uint32_t>(why.size());
    try {
      up.send_encoded(encode_model_header(h), std::span(reinterpret_cast<const uint8_t*>(why.data()), why.size()));
    } catch (const Error&) {
    }
    throw AuthError(why);
  };
  if (first.type != kTypeAuth)
    refuse(first, "authentication failed: this worker requires a pre-shared key and the upstream sent " +
                      model_type_name(first.type) +
                      " without authenticating (give every end of the chain the same --psk-file or PP_NODE_PSK)");
  if (first.seq != kAuthChallenge || first.payload_bytes != kNonceBytes)
    refuse(first, "authentication failed: AUTH step " + std::to_string(first.seq) + " of " +
                      std::to_string(first.payload_bytes) + " bytes, expected step 1 with a " +
                      std::to_string(kNonceBytes) + "-byte nonce");
  Nonce theirs;
  up.read_into(theirs, "AUTH payload");
  const Nonce mine = random_nonce();
  std::array<uint8_t, kNonceBytes + kProofBytes> reply;
  const Proof p = auth_proof(key, AuthRole::worker, theirs, mine);
  std::copy(mine.begin(), mine.end(), reply.begin());
  std::copy(p.begin(), p.end(), reply.begin() + kNonceBytes);
  detail::send_auth(up, kTypeAuth, kAuthResponse, reply);

  FrameHeader common;
  const std::optional<ModelHeader> m = detail::read_auth_header(up, &common);
  if (!m) throw NetError(NetError::Kind::closed, up.who() + ": closed the connection during authentication");
  if (common.version != kVersionModel)
    refuse(*m, "authentication failed: version " + std::to_string(common.version) + " frame during authentication");
  if (m->type == kTypeErr) {  // the upstream's verdict on this worker's proof
    const std::string text = detail::untrusted_text(up, m->payload_bytes);
    throw AuthError(text.starts_with("authentication failed") ? text : "authentication failed: the upstream says: " + text);
  }
  if (m->type != kTypeAuth || m->seq != kAuthFinish || m->payload_bytes != kProofBytes)
    refuse(*m, "authentication failed: " + model_type_name(m->type) + " seq " + std::to_string(m->seq) + " of " +
                   std::to_string(m->payload_bytes) + " bytes, expected AUTH step 3 with a " +
                   std::to_string(kProofBytes) + "-byte proof");
  Proof theirs_proof;
  up.read_into(theirs_proof, "AUTH payload");
  if (!auth_proof_matches(key, AuthRole::upstream, theirs, mine, theirs_proof))
    refuse(*m, "authentication failed: the upstream's proof does not match this worker's pre-shared key (the two "
               "ends hold different keys)");
}

}  // namespace pp::net
