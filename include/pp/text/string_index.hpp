// Open-addressing hash map from byte strings to token ids, built once and probed on every piece.
//
// std::unordered_map<std::string_view, int32_t> costs a node (and a cache miss) per entry; with
// 128K Llama-3 tokens that dominated both load time and encode time. Here the keys live in
// one byte buffer and each 16-byte slot holds half of the key's hash, so a probe touches one
// slot and compares key bytes only when the hashes agree.
#pragma once

#include <algorithm>
#include <bit>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace pp {

// 64-bit hash of a short byte string: eight bytes per multiply-xorshift round.
inline uint64_t hash_bytes(std::string_view s) noexcept {
  constexpr uint64_t k1 = 0x9E3779B97F4A7C15ull, k2 = 0xBF58476D1CE4E5B9ull, k3 = 0x94D049BB133111EBull;
  uint64_t h = k1 ^ (uint64_t(s.size()) * k3);
  const char* p = s.data();
  std::size_t n = s.size();
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * k2;
    h ^= h >> 31;
  }
  if (n > 0) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * k3;
  }
  h ^= h >> 29;
  h *= k2;
  h ^= h >> 32;
  return h;
}

class StringIndex {
 public:
  static constexpr int32_t kMissing = -1;

  void reserve(std::size_t n_keys, std::size_t n_bytes) {
    bytes_.reserve(n_bytes);
    if (n_keys * 2 > slots_.size()) rehash(std::bit_ceil(std::max<std::size_t>(16, n_keys * 2)));
  }

  // Maps key -> value; an existing key is overwritten (llama.cpp's token_to_id: last id wins).
  void set(std::string_view key, int32_t value) {
    assert(value >= 0);
    if ((size_ + 1) * 2 > slots_.size()) rehash(std::max<std::size_t>(16, slots_.size() * 2));
    const uint64_t h = hash_bytes(key);
    for (std::size_t i = h & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.value == kMissing) {
        s = {tag(h), uint32_t(bytes_.size()), uint32_t(key.size()), value};
        bytes_.append(key);
        ++size_;
        return;
      }
      if (s.tag == tag(h) && key_of(s) == key) {
        s.value = value;
        return;
      }
    }
  }

  // The value for key, or kMissing.
  int32_t find(std::string_view key) const noexcept {
    if (size_ == 0) return kMissing;
    const uint64_t h = hash_bytes(key);
    for (std::size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.value == kMissing) return kMissing;
      if (s.tag == tag(h) && s.length == key.size() && key_of(s) == key) return s.value;
    }
  }

  std::size_t size() const noexcept { return size_; }

 private:
  // 16 bytes, so four slots share a cache line.
  struct Slot {
    uint32_t tag = 0;                 // the hash's high half: most mismatches stop here
    uint32_t offset = 0, length = 0;  // the key's bytes in bytes_
    int32_t value = kMissing;         // kMissing marks an empty slot (values are ids >= 0)
  };
  static uint32_t tag(uint64_t h) noexcept { return uint32_t(h >> 32); }

  std::string_view key_of(const Slot& s) const noexcept {
    return std::string_view(bytes_).substr(s.offset, s.length);
  }
  void rehash(std::size_t cap) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    for (const Slot& s : old) {
      if (s.value == kMissing) continue;
      std::size_t i = hash_bytes(key_of(s)) & mask_;
      while (slots_[i].value != kMissing) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }

  std::string bytes_;        // every key, concatenated
  std::vector<Slot> slots_;  // power-of-two capacity, load factor <= 0.5
  std::size_t size_ = 0;
  std::size_t mask_ = 0;
};

}  // namespace pp
