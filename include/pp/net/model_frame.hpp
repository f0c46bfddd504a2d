// PCPL version-2 frames (real model): the common 24-byte header plus a 24-byte extension, the handshake and control types.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "pp/core/error.hpp"
#include "pp/net/frame.hpp"
#include "pp/net/sha256.hpp"

namespace pp::net {

// Wire layout (network byte order), docs/PROTOCOL-TCP.md "Version 2":
//   0..23  the common header (frame.hpp) with version 2
//   24 session u64 | 32 pos u64 | 40 rows u32 | 44 dtype u8 | 45 flags u8 | 46 reserved u16 | 48 payload
inline constexpr std::size_t kModelExtBytes = 24;
inline constexpr std::size_t kModelHeaderBytes = kFrameHeaderBytes + kModelExtBytes;

// Version-2 frame types. ERR keeps version 1's number (frame.hpp); 1 and 2 (FWD, RES) are version 1's only.
inline constexpr uint8_t kTypeHello = 3;    // handshake request: text payload (handshake.hpp)
inline constexpr uint8_t kTypeWelcome = 4;  // handshake accepted: text payload
inline constexpr uint8_t kTypeStatus = 5;   // request: empty payload; reply: text payload
inline constexpr uint8_t kTypeAuth = 16;    // pre-shared-key challenge-response before anything else (auth.hpp)
// After HELLO: the connection's sessions (mux_frame.hpp).
inline constexpr uint8_t kTypeOpen = 6;      // open a session; answered by OPEN or ERR
inline constexpr uint8_t kTypeClose = 7;     // close a session (free its KV cache on every stage); no reply
inline constexpr uint8_t kTypeBatch = 8;     // one step of several sessions: entry table, then their rows
inline constexpr uint8_t kTypeBatchRes = 9;  // BRES: per BATCH entry, in entry order, its token (+ digest, logits)
inline constexpr uint8_t kTypeProbe = 10;    // measure this worker: per-layer time, free memory (probe.hpp)

// Residual element types on the wire. Only f32 exists: the residual crosses a cut unrounded, which is
// what makes a distributed run bit-identical to one process.
inline constexpr uint8_t kDTypeF32 = 0;

// ERR flags: kErrPermanent says another attempt cannot succeed (the peer refuses this model, key or
// chain), as opposed to a peer that is down, busy or still loading. A coordinator stops resuming on it.
inline constexpr uint8_t kErrPermanent = 1;

// An ERR with kErrPermanent, or a refusal this end knows to be final: retrying will not help.
class RefusedError : public Error {
 public:
  using Error::Error;
};

// Handshake texts and STATUS replies are small; anything larger is refused before it is read.
inline constexpr uint32_t kMaxTextPayload = 64u << 10;

struct ModelHeader {
  uint8_t type = kTypeFwd;
  uint32_t seq = 0;
  uint32_t layer_lo = 0;  // the receiver's range, echoed in the reply
  uint32_t layer_hi = 0;
  uint32_t payload_bytes = 0;
  uint64_t session = 0;  // chosen by the coordinator, the same on every hop of a chain
  uint64_t pos = 0;      // absolute position of the first row
  uint32_t rows = 0;     // rows of the residual in the payload ([rows, hidden])
  uint8_t dtype = kDTypeF32;
  uint8_t flags = 0;
};

inline std::string model_type_name(uint8_t type) {
  switch (type) {
    case kTypeHello: return "HELLO";
    case kTypeWelcome: return "WELCOME";
    case kTypeStatus: return "STATUS";
    case kTypeAuth: return "AUTH";
    case kTypeOpen: return "OPEN";
    case kTypeClose: return "CLOSE";
    case kTypeBatch: return "BATCH";
    case kTypeBatchRes: return "BRES";
    case kTypeProbe: return "PROBE";
    default: return frame_type_name(type);
  }
}

inline std::array<uint8_t, kModelHeaderBytes> encode_model_header(const ModelHeader& m) {
  FrameHeader h;
  h.version = kVersionModel;
  h.type = m.type;
  h.seq = m.seq;
  h.layer_lo = m.layer_lo;
  h.layer_hi = m.layer_hi;
  h.payload_bytes = m.payload_bytes;
  const auto common = encode_header(h);
  std::array<uint8_t, kModelHeaderBytes> out{};
  for (std::size_t i = 0; i < common.size(); ++i) out[i] = common[i];
  uint8_t* e = out.data() + kFrameHeaderBytes;
  detail::put_be32(e + 0, static_cast<uint32_t>(m.session >> 32));
  detail::put_be32(e + 4, static_cast<uint32_t>(m.session));
  detail::put_be32(e + 8, static_cast<uint32_t>(m.pos >> 32));
  detail::put_be32(e + 12, static_cast<uint32_t>(m.pos));
  detail::put_be32(e + 16, m.rows);
  e[20] = m.dtype;
  e[21] = m.flags;
  detail::put_be16(e + 22, 0);
  return out;
}

// The version-2 header from its already-decoded common part and the 24 extension bytes after it.
inline ModelHeader decode_model_header(const FrameHeader& h, std::span<const uint8_t> ext) {
  if (ext.size() < kModelExtBytes)
    throw FrameError("version-2 extension: " + std::to_string(ext.size()) + " bytes < " +
                     std::to_string(kModelExtBytes));
  ModelHeader m;
  m.type = h.type;
  m.seq = h.seq;
  m.layer_lo = h.layer_lo;
  m.layer_hi = h.layer_hi;
  m.payload_bytes = h.payload_bytes;
  m.session = (uint64_t{detail::get_be32(&ext[0])} << 32) | detail::get_be32(&ext[4]);
  m.pos = (uint64_t{detail::get_be32(&ext[8])} << 32) | detail::get_be32(&ext[12]);
  m.rows = detail::get_be32(&ext[16]);
  m.dtype = ext[20];
  m.flags = ext[21];
  return m;
}

// What a version-2 receiver knows before it reads a payload: the geometry fixes every size.
struct ModelGeometry {
  uint32_t n_embd = 0;   // residual width
  uint32_t n_vocab = 0;
  uint32_t ctx = 0;      // KV capacity: the most rows one BATCH may carry
};

// Where the first NaN or infinity of `rows` [n, n_embd] f32 is, named for an ERR: "row R (position P),
// column C is NaN" with row r at position pos0 + r; empty when every value is finite. A non-finite
// residual would make every later logit NaN and poison the cache of the positions after it.
inline std::string first_non_finite(const float* rows, std::size_t n, std::size_t n_embd, uint64_t pos0) {
  for (std::size_t i = 0; i < n * n_embd; ++i) {
    uint32_t bits;
    std::memcpy(&bits, rows + i, 4);
    if ((bits & 0x7f800000u) != 0x7f800000u) continue;
    const std::size_t r = i / n_embd;
    return "row " + std::to_string(r) + " (position " + std::to_string(pos0 + r) + "), column " +
           std::to_string(i % n_embd) + " is " + ((bits & 0x007fffffu) ? "NaN" : (bits >> 31) ? "-inf" : "+inf") +
           ": hidden states must be finite";
  }
  return {};
}

// Bytes of `rows` f32 residual rows. rows is a u32 and n_embd at most 2^17, so the product cannot
// overflow 64 bits; callers compare it with the u32 payload_bytes before allocating anything.
inline uint64_t rows_payload_bytes(uint64_t rows, uint32_t n_embd) { return rows * n_embd * 4; }

// Residual rows and logits go on the wire as the host's f32 bytes; the wire is little-endian.
static_assert(std::endian::native == std::endian::little, "pp_node sends f32 as host bytes: little-endian only");

inline std::span<const uint8_t> f32_bytes(std::span<const float> v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float)};
}

// What verification compares: SHA-256 of a position's [n_vocab] f32 logits as little-endian bytes
// (what a BATCH entry's kEntryDigest asks for).
inline Sha256Digest logits_digest(std::span<const float> logits) { return sha256(f32_bytes(logits)); }

}  // namespace pp::net
