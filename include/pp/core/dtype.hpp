// Element types of weights the kernels can read, independent of any file format.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pp {

enum class DType : uint8_t { F32, F16, BF16 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
  }
  return "?";
}

// Bytes of one row of `cols` elements.
inline std::size_t row_bytes(DType t, std::size_t cols) {
  return t == DType::F32 ? cols * 4 : cols * 2;
}

// A weight matrix [rows, cols] (row-major; row r starts at data + r * row_stride bytes). Non-owning.
struct MatView {
  DType type = DType::F32;
  const uint8_t* data = nullptr;
  std::size_t rows = 0, cols = 0;
  std::size_t row_stride = 0;  // bytes
  const uint8_t* row(std::size_t r) const { return data + r * row_stride; }
};

}  // namespace pp
