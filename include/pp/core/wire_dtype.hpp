// The dtype of hidden states between stages (a process pipe, a TCP hop, a simulated cut): f32 carries
// them unchanged, bf16 and f16 round each value to nearest even, as every end of a pipeline must agree.
#pragma once

#include <pp/core/error.hpp>
#include <pp/core/float16.hpp>

#include <cstddef>
#include <span>
#include <string>

namespace pp {

enum class WireDType { F32, BF16, F16 };

inline WireDType parse_wire_dtype(const std::string& s) {
  if (s == "f32") return WireDType::F32;
  if (s == "bf16") return WireDType::BF16;
  if (s == "f16") return WireDType::F16;
  throw Error("wire dtype '" + s + "' is not one of f32, bf16, f16");
}

inline const char* wire_dtype_name(WireDType d) {
  return d == WireDType::BF16 ? "bf16" : d == WireDType::F16 ? "f16" : "f32";
}

inline constexpr std::size_t wire_bytes_per_value(WireDType d) { return d == WireDType::F32 ? 4 : 2; }

// Rounds values in place as crossing a wire of dtype `w` would (f32: unchanged).
inline void round_to_wire(std::span<float> x, WireDType w) {
  if (w == WireDType::BF16)
    for (float& v : x) v = bf16_to_f32(f32_to_bf16(v));
  else if (w == WireDType::F16)
    for (float& v : x) v = f16_to_f32(f32_to_f16(v));
}

}  // namespace pp
