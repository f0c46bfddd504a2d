// Lowercase hex: bytes as digit pairs (digests, escapes in messages) and 64-bit ids as 16 digits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace pp {

inline constexpr char kHexDigits[] = "0123456789abcdef";

// Appends b's two hex digits to s.
inline void append_hex(std::string& s, uint8_t b) {
  s += kHexDigits[b >> 4];
  s += kHexDigits[b & 15];
}

// Two digits per byte, in order.
inline std::string to_hex(std::span<const uint8_t> bytes) {
  std::string s;
  s.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) append_hex(s, b);
  return s;
}

// v as 16 digits, most significant first (zero-padded).
inline std::string to_hex_u64(uint64_t v) {
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<std::size_t>(i)] = kHexDigits[v & 15];
  return s;
}

}  // namespace pp
