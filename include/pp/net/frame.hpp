// PCPL frames of the TCP pipeline: the 24-byte big-endian header and its bounds, encoded and decoded from bytes only.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pp/core/error.hpp"
#include "pp/core/printable.hpp"

namespace pp::net {

// Wire layout (network byte order), docs/PROTOCOL-TCP.md:
//   0 magic "PCPL" | 4 version u8 | 5 type u8 | 6 reserved u16 | 8 seq u32
//   12 layer_lo u32 | 16 layer_hi u32 | 20 payload_bytes u32 | 24 payload
inline constexpr std::array<uint8_t, 4> kFrameMagic{'P', 'C', 'P', 'L'};
inline constexpr std::size_t kFrameHeaderBytes = 24;

// Version 1: the placeholder transform (uint32 words, spec "Placeholder transform").
inline constexpr uint8_t kVersionPlaceholder = 1;
// Version 2: real-model frames. Reserved here; its extra header fields (position, rows, session,
// dtype, flags) are defined by the model stage. decode_header() returns any version and leaves the
// decision to the caller, so a version-2 reader can decode the common 24 bytes, then read its own
// extension.
inline constexpr uint8_t kVersionModel = 2;

// Frame types. The header keeps the raw byte: an unknown type is not a decode error, it gets an ERR.
inline constexpr uint8_t kTypeFwd = 1;    // run layers [layer_lo, layer_hi) on this activation
inline constexpr uint8_t kTypeRes = 2;    // the resulting activation, same seq
inline constexpr uint8_t kTypeErr = 255;  // payload: UTF-8 message

// Defaults of the placeholder bounds (spec "Placeholder bounds").
inline constexpr uint32_t kDefaultMaxPayload = 64u << 20;      // bytes, --max-payload
inline constexpr uint32_t kDefaultMaxLayerRange = 65536;       // layers, --max-layer-range
inline constexpr uint32_t kMaxErrMessageBytes = 64u << 10;     // an ERR payload longer than this is refused

struct FrameHeader {
  uint8_t version = kVersionPlaceholder;
  uint8_t type = kTypeFwd;
  uint16_t reserved = 0;  // sent as 0, ignored on receipt (free for a later version)
  uint32_t seq = 0;
  uint32_t layer_lo = 0;
  uint32_t layer_hi = 0;
  uint32_t payload_bytes = 0;
};

// A decoded frame whose payload still points into the decoded bytes.
struct FrameView {
  FrameHeader header;
  std::span<const uint8_t> payload;  // [header.payload_bytes]
};

// What a receiver accepts before it reads (and allocates for) a payload.
struct FrameLimits {
  uint32_t max_payload = kDefaultMaxPayload;          // bytes
  uint32_t max_layer_range = kDefaultMaxLayerRange;   // layer_hi - layer_lo
};

inline std::string frame_type_name(uint8_t type) {
  switch (type) {
    case kTypeFwd: return "FWD";
    case kTypeRes: return "RES";
    case kTypeErr: return "ERR";
    default: return "type " + std::to_string(type);
  }
}

namespace detail {

inline void put_be16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v >> 8);
  p[1] = static_cast<uint8_t>(v);
}
inline void put_be32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (24 - 8 * i));
}
inline uint16_t get_be16(const uint8_t* p) { return static_cast<uint16_t>((p[0] << 8) | p[1]); }
inline uint32_t get_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace detail

inline std::array<uint8_t, kFrameHeaderBytes> encode_header(const FrameHeader& h) {
  std::array<uint8_t, kFrameHeaderBytes> out{};
  for (std::size_t i = 0; i < kFrameMagic.size(); ++i) out[i] = kFrameMagic[i];
  out[4] = h.version;
  out[5] = h.type;
  detail::put_be16(&out[6], h.reserved);
  detail::put_be32(&out[8], h.seq);
  detail::put_be32(&out[12], h.layer_lo);
  detail::put_be32(&out[16], h.layer_hi);
  detail::put_be32(&out[20], h.payload_bytes);
  return out;
}

// Decodes the common 24-byte header. Checks length and magic only: the version is returned for
// the caller to accept or refuse (require_version), the type for it to dispatch on.
inline FrameHeader decode_header(std::span<const uint8_t> bytes) {
  if (bytes.size() < kFrameHeaderBytes) {
    throw FrameError("header: " + std::to_string(bytes.size()) + " bytes < " +
                     std::to_string(kFrameHeaderBytes));
  }
  for (std::size_t i = 0; i < kFrameMagic.size(); ++i) {
    if (bytes[i] != kFrameMagic[i]) {
      throw FrameError("magic: '" + printable(std::string_view(reinterpret_cast<const char*>(bytes.data()), 4)) + "' != 'PCPL'");
    }
  }
  FrameHeader h;
  h.version = bytes[4];
  h.type = bytes[5];
  h.reserved = detail::get_be16(&bytes[6]);
  h.seq = detail::get_be32(&bytes[8]);
  h.layer_lo = detail::get_be32(&bytes[12]);
  h.layer_hi = detail::get_be32(&bytes[16]);
  h.payload_bytes = detail::get_be32(&bytes[20]);
  return h;
}

inline void require_version(const FrameHeader& h, uint8_t expected) {
  if (h.version != expected) {
    throw FrameError("version: " + std::to_string(h.version) + " != " + std::to_string(expected) +
                     " (this end speaks version " + std::to_string(expected) + ")");
  }
}

// The checks a version-1 FWD must pass before its payload is read or any memory is reserved for it.
inline void check_fwd_v1(const FrameHeader& h, const FrameLimits& limits) {
  const std::string where = "FWD seq " + std::to_string(h.seq) + ": ";
  if (h.payload_bytes > limits.max_payload) {
    throw FrameError(where + "payload_bytes " + std::to_string(h.payload_bytes) + " > limit " +
                     std::to_string(limits.max_payload) + " (--max-payload)");
  }
  if (h.payload_bytes % 4 != 0) {
    throw FrameError(where + "payload_bytes " + std::to_string(h.payload_bytes) +
                     " is not a multiple of 4 (payload is uint32 words)");
  }
  if (h.layer_lo > h.layer_hi) {
    throw FrameError(where + "layer_lo " + std::to_string(h.layer_lo) + " > layer_hi " +
                     std::to_string(h.layer_hi));
  }
  if (h.layer_hi - h.layer_lo > limits.max_layer_range) {
    throw FrameError(where + "layer range [" + std::to_string(h.layer_lo) + ", " +
                     std::to_string(h.layer_hi) + ") spans " +
                     std::to_string(h.layer_hi - h.layer_lo) + " layers > limit " +
                     std::to_string(limits.max_layer_range) + " (--max-layer-range)");
  }
}

// Header followed by payload; header.payload_bytes is taken from the payload's size.
inline std::vector<uint8_t> encode_frame(FrameHeader h, std::span<const uint8_t> payload) {
  if (payload.size() > UINT32_MAX) {
    throw FrameError("payload_bytes " + std::to_string(payload.size()) + " > limit " +
                     std::to_string(UINT32_MAX) + " (u32 field)");
  }
  h.payload_bytes = static_cast<uint32_t>(payload.size());
  const auto head = encode_header(h);
  std::vector<uint8_t> out;
  out.reserve(head.size() + payload.size());
  out.insert(out.end(), head.begin(), head.end());
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

// Decodes one whole frame from the front of `bytes` (magic and length checked, version returned).
inline FrameView decode_frame(std::span<const uint8_t> bytes) {
  const FrameHeader h = decode_header(bytes);
  const std::size_t available = bytes.size() - kFrameHeaderBytes;
  if (h.payload_bytes > available) {
    throw FrameError("payload_bytes " + std::to_string(h.payload_bytes) + " > " +
                     std::to_string(available) + " bytes available after the header");
  }
  return FrameView{h, bytes.subspan(kFrameHeaderBytes, h.payload_bytes)};
}

}  // namespace pp::net
