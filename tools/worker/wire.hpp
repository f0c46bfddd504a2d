// Hidden states and logits on the wire: f32 rows <-> little-endian bf16/f16 <-> base64.
#pragma once

#include "base64.hpp"

#include <pp/core/error.hpp>
#include <pp/core/float16.hpp>
#include <pp/core/wire_dtype.hpp>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace pp::worker {

static_assert(std::endian::native == std::endian::little, "the wire is little-endian; add byte swaps here");

// The worker protocol's hidden states are bf16 or f16 (pp::WireDType; startup.hpp refuses f32).
inline constexpr size_t kWireBytesPerValue = 2;

// Appends base64 of rows [n_values] f32 -> wire dtype (bf16 round-to-nearest-even or IEEE half;
// NaN stays NaN, values beyond the half range become infinities). `scratch` is reused storage.
inline void append_hidden_b64(std::string& out, const float* rows, size_t n_values, WireDType dtype,
                              std::vector<uint16_t>& scratch) {
  scratch.resize(n_values);
  uint16_t* w = scratch.data();
  if (dtype == WireDType::BF16) {
    for (size_t i = 0; i < n_values; ++i) w[i] = f32_to_bf16(rows[i]);
  } else {
    for (size_t i = 0; i < n_values; ++i) w[i] = f32_to_f16(rows[i]);
  }
  base64::append(out, w, n_values * kWireBytesPerValue);
}

// Appends base64 of little-endian f32 values (logits_b64).
inline void append_f32_b64(std::string& out, const float* values, size_t n) {
  base64::append(out, values, n * sizeof(float));
}

// Decodes `b64` into rows [seq_len, hidden_dim] f32. The decoded length must be exactly
// seq_len * hidden_dim * 2 bytes. Throws RequestError naming the field, the value and the limit.
// Row r of the array holds position `position + r`. A NaN or infinity anywhere is refused, naming its
// row, position and column: a non-finite state would make every later logit NaN (sampling token 0) and
// poison the cache of every position after it, silently.
inline void decode_hidden_b64(std::string_view b64, int64_t seq_len, int hidden_dim, WireDType dtype,
                              std::vector<uint16_t>& scratch, std::vector<float>& rows, int64_t position = 0) {
  const size_t n_values = size_t(seq_len) * size_t(hidden_dim);
  const size_t want = n_values * kWireBytesPerValue;
  size_t have = 0;
  try {
    have = base64::decoded_size(b64);
  } catch (const base64::Base64Error& e) {
    throw RequestError("field 'hidden_b64' is not valid base64: " + std::string(e.what()));
  }
  // Check the length before decoding so a wrong-sized value costs nothing more; invalid characters
  // in a wrong-sized value are reported as the length mismatch.
  if (have != want)
    throw RequestError("field 'hidden_b64' decodes to " + std::to_string(have) + " bytes, expected " +
                       std::to_string(want) + " (seq_len " + std::to_string(seq_len) + " x hidden_dim " +
                       std::to_string(hidden_dim) + " x " + std::to_string(kWireBytesPerValue) + " bytes)");
  scratch.resize(n_values);
  try {
    base64::decode(b64, reinterpret_cast<uint8_t*>(scratch.data()));
  } catch (const base64::Base64Error& e) {
    throw RequestError("field 'hidden_b64' is not valid base64: " + std::string(e.what()));
  }
  const uint16_t exp_mask = dtype == WireDType::BF16 ? 0x7f80 : 0x7c00;  // all ones: inf or NaN
  const uint16_t mant_mask = dtype == WireDType::BF16 ? 0x007f : 0x03ff;
  for (size_t i = 0; i < n_values; ++i) {
    const uint16_t v = scratch[i];
    if ((v & exp_mask) != exp_mask) continue;
    const int64_t row = int64_t(i / size_t(hidden_dim));
    char bits[8];
    std::snprintf(bits, sizeof bits, "%04x", unsigned(v));
    throw RequestError("field 'hidden_b64': row " + std::to_string(row) + " (position " +
                       std::to_string(position + row) + "), column " + std::to_string(i % size_t(hidden_dim)) +
                       " is " + ((v & mant_mask) ? "NaN" : (v & 0x8000) ? "-inf" : "+inf") + " (" +
                       wire_dtype_name(dtype) + " 0x" + bits + "): hidden states must be finite");
  }
  rows.resize(n_values);
  const uint16_t* w = scratch.data();
  float* r = rows.data();
  if (dtype == WireDType::BF16) {
    for (size_t i = 0; i < n_values; ++i) r[i] = bf16_to_f32(w[i]);
  } else {
    for (size_t i = 0; i < n_values; ++i) r[i] = f16_to_f32(w[i]);
  }
}

}  // namespace pp::worker
