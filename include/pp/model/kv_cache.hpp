// Ring-buffer KV cache of one sequence for the blocks of one stage (f32, keys stored after RoPE).
// Keys are stored transposed per KV head ([head_dim][slots], see kernels/attention.hpp), values by slot.
//
// Semantics: position `pos` lives in slot pos % capacity, so once more than `capacity` positions
// have been written the oldest are overwritten and attention sees the last `capacity` positions
// (a query at pos attends to [window_lo(pos), pos]). A request (pos, n) keeps the cached positions
// below pos and drops the rest (pos == 0 starts a new sequence). It is refused, before anything
// changes, when pos is beyond the cached length, when n exceeds the capacity, or when it rewinds to
// a pos whose window needs positions the ring has already overwritten.
#pragma once

#include <pp/core/anonymous_region.hpp>
#include <pp/core/error.hpp>
#include <pp/kernels/attention.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

namespace pp {

// Keys and values of consecutive positions as the attention kernels read them: key j's element d at
// kt[d * ld + j], its value row at v + j * v_stride (kernels/attention.hpp), for j < n.
struct KeyRun {
  const float* kt;
  std::size_t ld;
  const float* v;
  std::size_t n;
};

class KvCache {
 public:
  KvCache() = default;
  KvCache(std::size_t n_layers, std::size_t capacity, std::size_t n_head_kv, std::size_t head_dim)
      : n_layers_(n_layers), cap_(capacity), kv_dim_(n_head_kv * head_dim), head_dim_(head_dim),
        ld_((capacity + 15) / 16 * 16),
        k_((n_layers * kv_dim_ * ld_ + kernels::kAttnPad) * sizeof(float), "a KV cache", AnonymousRegion::Pages::small),
        v_(n_layers * capacity * kv_dim_ * sizeof(float), "a KV cache", AnonymousRegion::Pages::small) {}

  std::size_t capacity() const { return cap_; }
  std::size_t kv_dim() const { return kv_dim_; }
  int64_t n_past() const { return n_past_; }   // positions [0, n_past) have been processed
  int64_t oldest() const { return oldest_; }   // lowest position still held by the ring
  std::size_t bytes() const { return k_.size() + v_.size(); }
  // What one layer's keys and values of `capacity` positions take (f32; before the keys' row padding).
  static uint64_t bytes_per_layer(uint64_t capacity, uint64_t kv_dim) { return 2 * capacity * kv_dim * sizeof(float); }

  std::size_t slot(int64_t pos) const { return std::size_t(pos) % cap_; }
  int64_t window_lo(int64_t pos) const { return std::max<int64_t>(0, pos - int64_t(cap_) + 1); }

  // Keys of block `layer` (0-based within the stage), KV head g: element d of the key in slot s is
  // kt(layer, g)[d * k_ld() + s]. Padded by kernels::kAttnPad floats at the end.
  const float* kt(std::size_t layer, std::size_t g) const { return kf() + (layer * kv_dim_ + g * head_dim_) * ld_; }
  std::size_t k_ld() const { return ld_; }
  // Element e of the key in slot `slot` of block `layer` (writes along slots are contiguous).
  float& k_at(std::size_t layer, std::size_t slot, std::size_t e) { return kf()[(layer * kv_dim_ + e) * ld_ + slot]; }
  // [kv_dim] value row of block `layer` at ring slot `slot`.
  float* v(std::size_t layer, std::size_t slot) { return vf() + (layer * cap_ + slot) * kv_dim_; }
  const float* v(std::size_t layer, std::size_t slot) const { return vf() + (layer * cap_ + slot) * kv_dim_; }

  // The cached positions [lo, end) of KV head g in block `layer`, in position order: one run, or two
  // where the ring wraps. Returns the number of runs written to out. The values' row stride is kv_dim().
  std::size_t runs(std::size_t layer, std::size_t g, int64_t lo, int64_t end, KeyRun out[2]) const {
    if (lo >= end) return 0;
    const std::size_t first = slot(lo), count = std::size_t(end - lo);
    const std::size_t n1 = std::min(count, cap_ - first);
    out[0] = {kt(layer, g) + first, ld_, v(layer, first) + g * head_dim_, n1};
    if (n1 == count) return 1;
    out[1] = {kt(layer, g), ld_, v(layer, 0) + g * head_dim_, count - n1};
    return 2;
  }

  // Appending a segment, rows [pos, pos + n) of block `layer` (after validate; commit when every block
  // has stored). Keys go by element, [e0, e1) of each row's keys[i * kv_dim + e], so that threads split
  // the elements and each writes along slots; values go by row.
  void store_keys(std::size_t layer, int64_t pos, std::size_t n, const float* keys, std::size_t e0, std::size_t e1) {
    for (std::size_t e = e0; e < e1; ++e)
      for (std::size_t i = 0; i < n; ++i) k_at(layer, slot(pos + int64_t(i)), e) = keys[i * kv_dim_ + e];
  }
  void store_value(std::size_t layer, int64_t pos, const float* value) {
    std::copy(value, value + kv_dim_, v(layer, slot(pos)));
  }

  // Throws RequestError when rows [pos, pos + n) cannot be appended; changes nothing.
  void validate(int64_t pos, std::size_t n) const {
    if (n == 0) throw RequestError("seq_len must be at least 1");
    if (pos < 0) throw RequestError("position " + std::to_string(pos) + " is negative");
    if (n > cap_)
      throw RequestError("seq_len " + std::to_string(n) + " exceeds the KV capacity " + std::to_string(cap_) +
                         " (raise PP_CTX / --ctx)");
    if (pos > n_past_)
      throw RequestError("position " + std::to_string(pos) + " is beyond the cached length " +
                         std::to_string(n_past_) + ": a skipped position would corrupt attention");
    if (pos > 0 && window_lo(pos) < oldest_)
      throw RequestError("position " + std::to_string(pos) + " rewinds to a window starting at " +
                         std::to_string(window_lo(pos)) + ", but the ring (capacity " + std::to_string(cap_) +
                         ") has already overwritten positions below " + std::to_string(oldest_));
  }

  // Records that rows [pos, pos + n) were written (after validate).
  void commit(int64_t pos, std::size_t n) {
    if (pos == 0) oldest_ = 0;
    n_past_ = pos + int64_t(n);
    oldest_ = std::max(oldest_, n_past_ - int64_t(cap_));
  }

  void reset() { n_past_ = oldest_ = 0; }

 private:
  std::size_t n_layers_ = 0, cap_ = 0, kv_dim_ = 0, head_dim_ = 0, ld_ = 0;
  float* kf() { return reinterpret_cast<float*>(k_.data()); }
  float* vf() { return reinterpret_cast<float*>(v_.data()); }
  const float* kf() const { return reinterpret_cast<const float*>(k_.data()); }
  const float* vf() const { return reinterpret_cast<const float*>(v_.data()); }
  // Huge-page advised and backed as they fill: a long context costs memory only as it is used.
  AnonymousRegion k_;  // f32 [n_layers, n_head_kv, head_dim, ld] + pad
  AnonymousRegion v_;  // f32 [n_layers, capacity, kv_dim]
  int64_t n_past_ = 0, oldest_ = 0;
};

}  // namespace pp
