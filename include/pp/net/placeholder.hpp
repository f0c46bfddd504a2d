// The placeholder "forward" of the TCP pipeline: a bit-exact stand-in for running layers, to prove the transport.
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace pp::net {

namespace detail {

inline uint32_t load_le32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}
inline void store_le32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
  p[2] = static_cast<uint8_t>(v >> 16);
  p[3] = static_cast<uint8_t>(v >> 24);
}

}  // namespace detail

// Runs placeholder layers [lo, hi) in place on `words`, an array of little-endian uint32
// ([n_words * 4] bytes). Arithmetic is modulo 2^32. Sequential and order-sensitive, so
// [0, cut) then [cut, L) equals [0, L) exactly, and any corruption in transit cascades.
inline void run_layers(std::span<uint8_t> words, uint32_t lo, uint32_t hi) {
  assert(words.size() % 4 == 0);
  const std::size_t n_words = words.size() / 4;
  for (uint32_t layer = lo; layer < hi; ++layer) {
    const uint32_t c = layer * 2654435761u + 0x9E3779B1u;
    uint32_t prev = 0;
    uint8_t* p = words.data();
    for (std::size_t i = 0; i < n_words; ++i, p += 4) {
      uint32_t x = detail::load_le32(p) + c;
      x ^= x >> 15;
      x = x * 0x2545F491u + prev;
      detail::store_le32(p, x);
      prev = x;
    }
  }
}

// The coordinator's input activation for token `seq`: nbytes (a multiple of 4) of little-endian
// uint32 from a linear congruential generator seeded by seq.
inline std::vector<uint8_t> make_input(uint32_t seq, std::size_t nbytes) {
  assert(nbytes % 4 == 0);
  std::vector<uint8_t> out(nbytes);
  uint32_t x = seq * 2246822519u + 3266489917u;
  for (std::size_t i = 0; i + 4 <= nbytes; i += 4) {
    x = x * 1664525u + 1013904223u;
    detail::store_le32(&out[i], x);
  }
  return out;
}

}  // namespace pp::net
