// Element types of weights the kernels can read, independent of any file format.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pp {

// F32 / F16 / BF16 are plain elements; the rest are ggml's block-quantized formats (see kernels/quant_blocks.hpp).
enum class DType : uint8_t { F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };

inline bool is_quantized(DType t) { return t >= DType::Q8_0; }

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::Q8_0: return "Q8_0";
    case DType::Q4_0: return "Q4_0";
    case DType::Q4_1: return "Q4_1";
    case DType::Q5_0: return "Q5_0";
    case DType::Q5_1: return "Q5_1";
    case DType::Q4_K: return "Q4_K";
    case DType::Q5_K: return "Q5_K";
    case DType::Q6_K: return "Q6_K";
  }
  return "?";
}

// Elements per block (1 for plain types) and bytes per block, as ggml stores them.
inline std::size_t block_elems(DType t) {
  switch (t) {
    case DType::F32: case DType::F16: case DType::BF16: return 1;
    case DType::Q8_0: case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: return 32;
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: return 256;
  }
  return 1;
}
inline std::size_t block_bytes(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::Q8_0: return 34;
    case DType::Q4_0: return 18;
    case DType::Q4_1: return 20;
    case DType::Q5_0: return 22;
    case DType::Q5_1: return 24;
    case DType::Q4_K: return 144;
    case DType::Q5_K: return 176;
    case DType::Q6_K: return 210;
  }
  return 0;
}

// Bytes of one row of `cols` elements (a multiple of block_elems(t): the GGUF parser checks rows).
inline std::size_t row_bytes(DType t, std::size_t cols) {
  return cols / block_elems(t) * block_bytes(t);
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
