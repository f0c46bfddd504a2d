// GPT-2 byte-level alphabet: the bijection between the 256 byte values and printable code points.
//
// Byte-level BPE vocabularies (GPT-2, Llama-3) store every token as text over this alphabet:
// printable bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) stand for themselves, the other 68
// bytes map in ascending order to U+0100.. (space 0x20 -> U+0120 'Ġ', '\n' -> U+010A 'Ċ').
// The tokenizer converts token texts to raw bytes once at load time so encoding works on raw
// bytes and never has to build the mapped text.
#pragma once

#include <pp/text/utf8.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pp::byte_level {

namespace detail {

constexpr bool printable(unsigned b) {
  return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

constexpr std::array<char32_t, 256> make_byte_to_cp() {
  std::array<char32_t, 256> t{};
  char32_t next = 256;
  for (unsigned b = 0; b < 256; ++b) t[b] = printable(b) ? char32_t(b) : next++;
  return t;
}

}  // namespace detail

// [256] byte value -> code point of its stand-in character (all below U+0144).
inline constexpr std::array<char32_t, 256> kByteToCp = detail::make_byte_to_cp();
inline constexpr char32_t kMaxCp = 0x143;  // 256 + 68 - 1

// Code point -> the byte it stands for, or -1 when cp is not in the alphabet.
constexpr int cp_to_byte(char32_t cp) {
  if (cp > kMaxCp) return -1;
  if (cp < 256) return detail::printable(unsigned(cp)) ? int(cp) : -1;
  unsigned n = 0;  // cp is the n-th non-printable byte's stand-in
  for (unsigned b = 0; b < 256; ++b)
    if (!detail::printable(b) && 256 + n++ == cp) return int(b);
  return -1;
}

namespace detail {

constexpr std::array<int16_t, kMaxCp + 1> make_cp_to_byte() {
  std::array<int16_t, kMaxCp + 1> t{};
  for (char32_t cp = 0; cp <= kMaxCp; ++cp) t[cp] = int16_t(cp_to_byte(cp));
  return t;
}

}  // namespace detail

// [kMaxCp + 1] code point -> byte, -1 outside the alphabet.
inline constexpr std::array<int16_t, kMaxCp + 1> kCpToByte = detail::make_cp_to_byte();

// Raw bytes -> their byte-level text (what a vocabulary stores).
inline std::string encode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) utf8::append(out, kByteToCp[static_cast<uint8_t>(c)]);
  return out;
}

// Appends the raw bytes of byte-level `text` to out and returns true; returns false (out
// unchanged) when the text is not well-formed UTF-8 or uses a character outside the alphabet
// (e.g. a control token written as plain text with a space).
inline bool decode_append(std::string_view text, std::string& out) {
  const std::size_t start = out.size();
  std::size_t i = 0;
  while (i < text.size()) {
    const utf8::Decoded d = utf8::decode_one(text, i);
    if (d.status != utf8::Status::ok || d.cp > kMaxCp || kCpToByte[d.cp] < 0) {
      out.resize(start);
      return false;
    }
    out += static_cast<char>(kCpToByte[d.cp]);
    i += d.len;
  }
  return true;
}

// Byte-level text -> raw bytes; nullopt when decode_append refuses it.
inline std::optional<std::string> decode(std::string_view text) {
  std::string out;
  if (!decode_append(text, out)) return std::nullopt;
  return out;
}

}  // namespace pp::byte_level
