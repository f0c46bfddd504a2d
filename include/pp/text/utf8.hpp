// UTF-8 decoding, validation and repair (U+FFFD per bad byte), plus an incremental decoder for streams.
//
// Validity is Unicode's well-formed UTF-8 (Table 3-7): no overlong forms, no surrogates
// (U+D800..U+DFFF), nothing above U+10FFFF. Repair is byte by byte, as llama.cpp's
// unicode_cpts_from_utf8 does: at each position a well-formed sequence is kept, otherwise ONE
// byte is replaced by U+FFFD and decoding resumes at the next byte. A truncated sequence
// "E4 B8" therefore becomes two U+FFFD, a lone continuation byte one. This per-byte rule makes
// repair local, so the incremental decoder below gives exactly the one-shot result.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace pp::utf8 {

inline constexpr char32_t kReplacement = 0xFFFD;
inline constexpr std::string_view kReplacementUtf8 = "\xEF\xBF\xBD";
inline constexpr std::size_t kMaxSequence = 4;

enum class Status : uint8_t {
  ok,          // a well-formed sequence of `len` bytes encoding `cp`
  invalid,     // the byte at the position cannot start a well-formed sequence here (len 1)
  incomplete,  // the input ends inside a sequence whose bytes so far are valid (len = bytes present)
};

struct Decoded {
  char32_t cp = 0;
  uint8_t len = 1;
  Status status = Status::invalid;
};

// Decodes the sequence starting at s[pos] (pos < s.size()).
inline Decoded decode_one(std::string_view s, std::size_t pos) noexcept {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  if (b0 < 0x80) return {b0, 1, Status::ok};
  // Lead byte -> number of continuation bytes and the allowed range of the FIRST continuation
  // byte (Table 3-7: E0 A0..BF, ED 80..9F, F0 90..BF, F4 80..8F exclude overlongs, surrogates
  // and code points above U+10FFFF); later continuation bytes are always 80..BF.
  std::size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  char32_t cp = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1, cp = b0 & 0x1Fu;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2, cp = b0 & 0x0Fu;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3, cp = b0 & 0x07u;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {0, 1, Status::invalid};  // 80..BF (continuation), C0/C1 (overlong), F5..FF
  }
  for (std::size_t i = 1; i <= need; ++i) {
    if (pos + i >= s.size()) return {0, static_cast<uint8_t>(i), Status::incomplete};
    const auto b = static_cast<uint8_t>(s[pos + i]);
    if (b < lo || b > hi) return {0, 1, Status::invalid};
    cp = (cp << 6) | (b & 0x3Fu);
    lo = 0x80, hi = 0xBF;
  }
  return {cp, static_cast<uint8_t>(need + 1), Status::ok};
}

// Length of the longest well-formed prefix of s (== s.size() when s is valid).
inline std::size_t valid_prefix(std::string_view s) noexcept {
  std::size_t i = 0;
  const std::size_t n = s.size();
  while (i < n) {
    // ASCII runs dominate real text: test eight bytes at a time.
    if (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      if ((w & 0x8080808080808080ull) == 0) {
        i += 8;
        continue;
      }
    }
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Decoded d = decode_one(s, i);
    if (d.status != Status::ok) return i;
    i += d.len;
  }
  return n;
}

inline bool is_valid(std::string_view s) noexcept { return valid_prefix(s) == s.size(); }

// Appends the UTF-8 encoding of cp; surrogates and values above U+10FFFF become U+FFFD.
inline void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    if (cp >= 0xD800 && cp <= 0xDFFF) {
      out += kReplacementUtf8;
      return;
    }
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp <= 0x10FFFF) {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += kReplacementUtf8;
  }
}

// Appends s with every byte that does not belong to a well-formed sequence replaced by U+FFFD
// (an incomplete sequence at the end counts as bad bytes too).
inline void append_sanitized(std::string& out, std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const std::size_t good = valid_prefix(s.substr(i));
    out.append(s.data() + i, good);
    i += good;
    if (i < s.size()) {
      out += kReplacementUtf8;
      ++i;
    }
  }
}

inline std::string sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  append_sanitized(out, s);
  return out;
}

// Incremental decoder for a byte stream arriving in arbitrary pieces (e.g. one token at a
// time): emits only complete characters, holds back an incomplete trailing sequence (at most
// 3 bytes), and repairs bad bytes exactly as append_sanitized does, so the concatenation of
// every feed() plus flush() equals sanitize(all bytes).
class IncrementalDecoder {
 public:
  // Appends the characters completed by `bytes` to out.
  void feed(std::string_view bytes, std::string& out) {
    if (bytes.empty()) return;
    std::string_view s = bytes;
    if (held_.size() > 0) {
      held_.append(bytes);
      s = held_;
    }
    std::size_t i = 0;
    while (i < s.size()) {
      const std::size_t good = valid_prefix(s.substr(i));
      out.append(s.data() + i, good);
      i += good;
      if (i == s.size()) break;
      const Decoded d = decode_one(s, i);
      if (d.status == Status::incomplete) break;  // keep s[i..] for the next feed
      out += kReplacementUtf8;
      ++i;
    }
    // Copy the tail before touching held_ (s may point into it).
    std::string tail(s.substr(i));
    held_ = std::move(tail);
  }

  // Ends the stream: a held-back incomplete sequence becomes U+FFFD per byte.
  void flush(std::string& out) {
    append_sanitized(out, held_);
    held_.clear();
  }

  // Bytes held back waiting for the rest of a character (0..3).
  std::size_t pending() const noexcept { return held_.size(); }

 private:
  std::string held_;  // [0, 3] bytes: a valid but incomplete sequence
};

}  // namespace pp::utf8
