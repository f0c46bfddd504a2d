// Standard base64 (RFC 4648, with padding): table-driven encode and strict, canonical decode.
#pragma once

#include <pp/core/error.hpp>
#include <pp/core/hex.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace pp::worker::base64 {

// Input that is not canonical padded base64; `offset` is the first offending character.
class Base64Error : public Error {
 public:
  Base64Error(size_t offset, const std::string& why) : Error(why), offset_(offset) {}
  size_t offset() const { return offset_; }

 private:
  size_t offset_;
};

inline constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

constexpr size_t encoded_size(size_t n_bytes) { return (n_bytes + 2) / 3 * 4; }

namespace detail {

// Two output characters for every 12-bit group, so a 3-byte block needs two lookups.
inline constexpr auto kPairs = [] {
  std::array<uint16_t, 4096> t{};
  for (unsigned i = 0; i < 4096; ++i) {
    const auto hi = uint8_t(kAlphabet[i >> 6]), lo = uint8_t(kAlphabet[i & 63]);
    t[i] = uint16_t(hi | (lo << 8));  // little-endian: first character in the low byte
  }
  return t;
}();

// Decode tables: character -> its 6-bit value already shifted into place for position 0..3 of a
// quad; kBad (bit 24 up) marks characters outside the alphabet, so OR-ing four lookups and
// testing one threshold validates a whole quad.
inline constexpr uint32_t kBad = 0x01000000u;

inline constexpr auto kDecode = [] {
  std::array<std::array<uint32_t, 256>, 4> t{};
  for (auto& row : t) row.fill(kBad);
  for (uint32_t v = 0; v < 64; ++v) {
    const auto c = uint8_t(kAlphabet[v]);
    t[0][c] = v << 18;
    t[1][c] = v << 12;
    t[2][c] = v << 6;
    t[3][c] = v;
  }
  return t;
}();

inline std::string describe(char c) {
  const auto u = uint8_t(c);
  if (u >= 0x21 && u < 0x7f) return std::string("'") + c + "'";
  std::string s = "byte 0x";
  append_hex(s, u);
  return s;
}

inline Base64Error bad_char(const uint8_t* s, size_t i) {
  if (s[i] == '=') return Base64Error(i, "padding '=' before the end, at offset " + std::to_string(i));
  return Base64Error(i, "invalid character " + describe(char(s[i])) + " at offset " + std::to_string(i));
}

}  // namespace detail

// Writes encoded_size(n) characters to `out`.
inline void encode(const uint8_t* in, size_t n, char* out) {
  const auto& pairs = detail::kPairs;
  size_t i = 0;
  for (; i + 3 <= n; i += 3, out += 4) {
    const uint32_t v = uint32_t(in[i]) << 16 | uint32_t(in[i + 1]) << 8 | in[i + 2];
    const uint16_t a = pairs[v >> 12], b = pairs[v & 0xfff];
    std::memcpy(out, &a, 2);
    std::memcpy(out + 2, &b, 2);
  }
  if (n - i == 1) {
    const uint32_t v = uint32_t(in[i]) << 16;
    out[0] = kAlphabet[v >> 18];
    out[1] = kAlphabet[(v >> 12) & 63];
    out[2] = out[3] = '=';
  } else if (n - i == 2) {
    const uint32_t v = uint32_t(in[i]) << 16 | uint32_t(in[i + 1]) << 8;
    out[0] = kAlphabet[v >> 18];
    out[1] = kAlphabet[(v >> 12) & 63];
    out[2] = kAlphabet[(v >> 6) & 63];
    out[3] = '=';
  }
}

inline void append(std::string& out, const void* data, size_t n) {
  const size_t at = out.size();
  out.resize(at + encoded_size(n));
  encode(static_cast<const uint8_t*>(data), n, out.data() + at);
}

// The decoded length of `in`, after checking its length and padding; the characters are checked by
// decode(). Throws Base64Error.
inline size_t decoded_size(std::string_view in) {
  if (in.size() % 4 != 0)
    throw Base64Error(in.size(), "length " + std::to_string(in.size()) + " is not a multiple of 4");
  if (in.empty()) return 0;
  size_t pad = 0;
  if (in.back() == '=') pad = in[in.size() - 2] == '=' ? 2 : 1;
  return in.size() / 4 * 3 - pad;
}

// Decodes canonical padded base64 into `out` (decoded_size(in) bytes). Rejects characters outside
// the alphabet, '=' anywhere but the last one or two places, and non-zero bits under the padding
// (an encoder never writes them, so they signal a corrupted or truncated value).
inline void decode(std::string_view in, uint8_t* out) {
  const size_t n = decoded_size(in);
  if (n == 0) return;
  const auto& d = detail::kDecode;
  const auto* s = reinterpret_cast<const uint8_t*>(in.data());
  const size_t full_quads = in.size() / 4 - 1;  // the last quad may carry padding

  // Validate in blocks: OR the lookups and test once per block, then find the exact offset only
  // on failure. Bytes written before the error are garbage the caller discards.
  constexpr size_t kBlockQuads = 16;
  size_t q = 0;
  while (q < full_quads) {
    const size_t begin = q;
    const size_t end = q + kBlockQuads < full_quads ? q + kBlockQuads : full_quads;
    uint32_t bad = 0;
    for (; q < end; ++q) {
      const uint8_t* c = s + 4 * q;
      const uint32_t v = d[0][c[0]] | d[1][c[1]] | d[2][c[2]] | d[3][c[3]];
      bad |= v;
      uint8_t* o = out + 3 * q;
      o[0] = uint8_t(v >> 16);
      o[1] = uint8_t(v >> 8);
      o[2] = uint8_t(v);
    }
    if (bad >= detail::kBad) {
      for (size_t i = 4 * begin; i < 4 * end; ++i)
        if (d[0][s[i]] == detail::kBad) throw detail::bad_char(s, i);
    }
  }

  // Last quad: "xxxx", "xxx=" or "xx==".
  const size_t base = 4 * full_quads;
  const uint8_t* c = s + base;
  const size_t pad = in.size() / 4 * 3 - n;
  for (size_t k = 0; k < 4 - pad; ++k)
    if (d[0][c[k]] == detail::kBad) throw detail::bad_char(s, base + k);
  uint8_t* o = out + 3 * full_quads;
  if (pad == 0) {
    const uint32_t v = d[0][c[0]] | d[1][c[1]] | d[2][c[2]] | d[3][c[3]];
    o[0] = uint8_t(v >> 16);
    o[1] = uint8_t(v >> 8);
    o[2] = uint8_t(v);
  } else if (pad == 1) {
    const uint32_t v = d[0][c[0]] | d[1][c[1]] | d[2][c[2]];
    if (v & 0xff) throw Base64Error(base + 2, "non-zero bits under the padding at offset " + std::to_string(base + 2));
    o[0] = uint8_t(v >> 16);
    o[1] = uint8_t(v >> 8);
  } else {
    const uint32_t v = d[0][c[0]] | d[1][c[1]];
    if (v & 0xffff) throw Base64Error(base + 1, "non-zero bits under the padding at offset " + std::to_string(base + 1));
    o[0] = uint8_t(v >> 16);
  }
}

inline std::string decode(std::string_view in) {
  std::string out(decoded_size(in), '\0');
  decode(in, reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

inline std::string encode(std::string_view in) {
  std::string out;
  append(out, in.data(), in.size());
  return out;
}

}  // namespace pp::worker::base64
