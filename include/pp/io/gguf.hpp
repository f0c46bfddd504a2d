// GGUF v2/v3 parser over a byte span: metadata, tensor directory, alignment; knows no model names.
//
// Every count, length, size and offset read from the bytes is checked against the bytes left and
// against the limits below (overflow-safe) before it is used, following llama.cpp's gguf.cpp and
// its CVE history. Errors are GgufError naming the field, the value and the limit.
#pragma once

#include <pp/core/checked.hpp>
#include <pp/core/error.hpp>
#include <pp/core/printable.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace pp::gguf {

// Bounds on what a GGUF may declare. Real files are far below every one of them.
struct Limits {
  uint64_t max_string_bytes = 16u << 20;   // one metadata string (chat templates are a few KB)
  uint64_t max_key_bytes = 1u << 16;       // one metadata key
  uint64_t max_array_count = 1u << 24;     // one metadata array (Llama-3: 280147 merges)
  uint64_t max_kv = 1u << 16;              // metadata entries
  uint64_t max_tensors = 1u << 16;         // tensor directory entries
  uint32_t max_alignment = 1u << 16;       // general.alignment
};

inline constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read little-endian
inline constexpr uint32_t kDefaultAlignment = 32;
inline constexpr std::size_t kMaxNameBytes = 63;  // ggml's GGML_MAX_NAME is 64 with the NUL
inline constexpr uint32_t kMaxDims = 4;

enum class ValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};

inline const char* value_type_name(ValueType t) {
  static constexpr std::array<const char*, 13> names = {
      "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(t);
  return i < names.size() ? names[i] : "unknown";
}

// Size in bytes of a scalar value type, 0 for string/array/unknown.
inline std::size_t scalar_size(ValueType t) {
  switch (t) {
    case ValueType::U8: case ValueType::I8: case ValueType::BOOL: return 1;
    case ValueType::U16: case ValueType::I16: return 2;
    case ValueType::U32: case ValueType::I32: case ValueType::F32: return 4;
    case ValueType::U64: case ValueType::I64: case ValueType::F64: return 8;
    default: return 0;
  }
}

// ggml tensor types (values as in ggml.h); every known one so files with other types still parse.
enum class TensorType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
  IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35,
};

struct TypeTraits {
  const char* name;
  uint32_t block_elems;  // elements per block (1 for plain types)
  uint32_t block_bytes;  // bytes per block
};

// Block geometry per type; block_elems == 0 marks an unknown type id.
inline TypeTraits type_traits(TensorType t) {
  switch (t) {
    case TensorType::F32: return {"F32", 1, 4};
    case TensorType::F16: return {"F16", 1, 2};
    case TensorType::Q4_0: return {"Q4_0", 32, 18};
    case TensorType::Q4_1: return {"Q4_1", 32, 20};
    case TensorType::Q5_0: return {"Q5_0", 32, 22};
    case TensorType::Q5_1: return {"Q5_1", 32, 24};
    case TensorType::Q8_0: return {"Q8_0", 32, 34};
    case TensorType::Q8_1: return {"Q8_1", 32, 36};
    case TensorType::Q2_K: return {"Q2_K", 256, 84};
    case TensorType::Q3_K: return {"Q3_K", 256, 110};
    case TensorType::Q4_K: return {"Q4_K", 256, 144};
    case TensorType::Q5_K: return {"Q5_K", 256, 176};
    case TensorType::Q6_K: return {"Q6_K", 256, 210};
    case TensorType::Q8_K: return {"Q8_K", 256, 292};
    case TensorType::IQ2_XXS: return {"IQ2_XXS", 256, 66};
    case TensorType::IQ2_XS: return {"IQ2_XS", 256, 74};
    case TensorType::IQ3_XXS: return {"IQ3_XXS", 256, 98};
    case TensorType::IQ1_S: return {"IQ1_S", 256, 50};
    case TensorType::IQ4_NL: return {"IQ4_NL", 32, 18};
    case TensorType::IQ3_S: return {"IQ3_S", 256, 110};
    case TensorType::IQ2_S: return {"IQ2_S", 256, 82};
    case TensorType::IQ4_XS: return {"IQ4_XS", 256, 136};
    case TensorType::I8: return {"I8", 1, 1};
    case TensorType::I16: return {"I16", 1, 2};
    case TensorType::I32: return {"I32", 1, 4};
    case TensorType::I64: return {"I64", 1, 8};
    case TensorType::F64: return {"F64", 1, 8};
    case TensorType::IQ1_M: return {"IQ1_M", 256, 56};
    case TensorType::BF16: return {"BF16", 1, 2};
    case TensorType::TQ1_0: return {"TQ1_0", 256, 54};
    case TensorType::TQ2_0: return {"TQ2_0", 256, 66};
  }
  return {"unknown", 0, 0};
}

inline const char* type_name(TensorType t) { return type_traits(t).name; }

// One metadata value. Strings and arrays are views into the parsed bytes (zero copy).
struct Value {
  ValueType type = ValueType::U8;
  uint64_t u = 0;           // unsigned scalars and bool
  int64_t i = 0;            // signed scalars
  double f = 0;             // f32 / f64
  std::string_view str;     // STRING
  ValueType elem = ValueType::U8;            // ARRAY: element type
  uint64_t count = 0;                        // ARRAY: element count
  std::span<const uint8_t> raw;              // ARRAY of scalars: little-endian element bytes
  std::vector<std::string_view> strings;     // ARRAY of strings
};

struct TensorInfo {
  std::string name;
  TensorType type = TensorType::F32;
  uint32_t n_dims = 0;
  std::array<uint64_t, kMaxDims> ne = {1, 1, 1, 1};  // ne[0] is the row length (contiguous)
  uint64_t n_elements = 0;
  uint64_t offset = 0;  // relative to the data section
  uint64_t n_bytes = 0;
  std::span<const uint8_t> data;  // the tensor's bytes inside the parsed span
};

class File {
 public:
  uint32_t version = 0;
  uint32_t alignment = kDefaultAlignment;
  uint64_t data_offset = 0;  // absolute offset of the data section
  std::vector<std::pair<std::string, Value>> kv;  // in file order
  std::vector<TensorInfo> tensors;                // in file order

  const Value* find(std::string_view key) const {
    auto it = kv_index_.find(std::string(key));
    return it == kv_index_.end() ? nullptr : &kv[it->second].second;
  }
  const TensorInfo* tensor(std::string_view name) const {
    auto it = tensor_index_.find(std::string(name));
    return it == tensor_index_.end() ? nullptr : &tensors[it->second];
  }

  // Typed accessors: throw GgufError naming the key when present with another type.
  bool has(std::string_view key) const { return find(key) != nullptr; }
  std::string_view get_string(std::string_view key) const {
    const Value& v = require(key, ValueType::STRING);
    return v.str;
  }
  // Any integer type whose value fits in uint64 (bool excluded).
  uint64_t get_uint(std::string_view key) const {
    const Value& v = require_present(key);
    switch (v.type) {
      case ValueType::U8: case ValueType::U16: case ValueType::U32: case ValueType::U64:
        return v.u;
      case ValueType::I8: case ValueType::I16: case ValueType::I32: case ValueType::I64:
        if (v.i < 0) throw GgufError(key_msg(key) + ": negative value " + std::to_string(v.i));
        return uint64_t(v.i);
      default:
        throw GgufError(key_msg(key) + ": expected an integer, found " + value_type_name(v.type));
    }
  }
  double get_float(std::string_view key) const {
    const Value& v = require_present(key);
    if (v.type == ValueType::F32 || v.type == ValueType::F64) return v.f;
    throw GgufError(key_msg(key) + ": expected a float, found " + value_type_name(v.type));
  }
  bool get_bool(std::string_view key) const { return require(key, ValueType::BOOL).u != 0; }
  // An array whose elements have exactly type `elem`.
  const Value& get_array(std::string_view key, ValueType elem) const {
    const Value& v = require(key, ValueType::ARRAY);
    if (v.elem != elem)
      throw GgufError(key_msg(key) + ": expected an array of " + value_type_name(elem) +
                      ", found an array of " + value_type_name(v.elem));
    return v;
  }
  // Element i of a scalar array as a number (the element type was checked by get_array).
  template <class T>
  static T array_at(const Value& a, uint64_t i) {
    T out;
    std::memcpy(&out, a.raw.data() + i * sizeof(T), sizeof(T));
    return out;
  }

 private:
  friend File parse(std::span<const uint8_t>, const Limits&);
  std::unordered_map<std::string, std::size_t> kv_index_;
  std::unordered_map<std::string, std::size_t> tensor_index_;

  static std::string key_msg(std::string_view key) { return "metadata '" + printable(key) + "'"; }
  const Value& require_present(std::string_view key) const {
    const Value* v = find(key);
    if (!v) throw GgufError(key_msg(key) + ": missing");
    return *v;
  }
  const Value& require(std::string_view key, ValueType t) const {
    const Value& v = require_present(key);
    if (v.type != t)
      throw GgufError(key_msg(key) + ": expected " + value_type_name(t) + ", found " +
                      value_type_name(v.type));
    return v;
  }
};

namespace detail {

// Sequential little-endian reads, each bounded by the bytes left.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  uint64_t pos() const { return pos_; }
  uint64_t left() const { return b_.size() - pos_; }

  template <class T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::span<const uint8_t> bytes(uint64_t n, const char* what) {
    need(n, what);
    auto s = b_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  std::string_view string(const char* what, uint64_t max_len) {
    const uint64_t n = read<uint64_t>(what);
    if (n > max_len)
      throw GgufError(std::string(what) + ": string length " + std::to_string(n) + " exceeds the limit " +
                      std::to_string(max_len));
    auto s = bytes(n, what);
    return {reinterpret_cast<const char*>(s.data()), s.size()};
  }
  void need(uint64_t n, const char* what) const {
    if (n > left())
      throw GgufError(std::string(what) + ": needs " + std::to_string(n) + " bytes at offset " +
                      std::to_string(pos_) + " but only " + std::to_string(left()) +
                      " remain (truncated file)");
  }

 private:
  std::span<const uint8_t> b_;
  uint64_t pos_ = 0;
};

inline bool valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::F64); }

inline void read_scalar(Reader& r, ValueType t, Value& v, const char* what) {
  switch (t) {
    case ValueType::U8: v.u = r.read<uint8_t>(what); break;
    case ValueType::I8: v.i = r.read<int8_t>(what); break;
    case ValueType::U16: v.u = r.read<uint16_t>(what); break;
    case ValueType::I16: v.i = r.read<int16_t>(what); break;
    case ValueType::U32: v.u = r.read<uint32_t>(what); break;
    case ValueType::I32: v.i = r.read<int32_t>(what); break;
    case ValueType::U64: v.u = r.read<uint64_t>(what); break;
    case ValueType::I64: v.i = r.read<int64_t>(what); break;
    case ValueType::F32: v.f = r.read<float>(what); break;
    case ValueType::F64: v.f = r.read<double>(what); break;
    case ValueType::BOOL: {
      const uint8_t b = r.read<uint8_t>(what);
      if (b > 1) throw GgufError(std::string(what) + ": bool value " + std::to_string(b) + " is not 0 or 1");
      v.u = b;
      break;
    }
    default: break;
  }
}

}  // namespace detail

// Parses a whole GGUF file held in `bytes`. Tensor data views point into `bytes`.
inline File parse(std::span<const uint8_t> bytes, const Limits& lim = {}) {
  using detail::Reader;
  Reader r(bytes);
  File f;

  const uint32_t magic = r.read<uint32_t>("header magic");
  if (magic != kMagic) {
    char m[5] = {};
    std::memcpy(m, &magic, 4);
    for (char& c : m)
      if (c && (c < 32 || c > 126)) c = '?';
    throw GgufError("bad magic '" + std::string(m) + "': not a GGUF file (expected 'GGUF')");
  }
  f.version = r.read<uint32_t>("header version");
  if (f.version == 0x02000000u || f.version == 0x03000000u)
    throw GgufError("version " + std::to_string(f.version) +
                    " looks byte-swapped: big-endian GGUF files are not supported");
  if (f.version == 0) throw GgufError("version 0 is invalid (need 2 or 3)");
  if (f.version == 1) throw GgufError("version 1 is obsolete and not supported (need 2 or 3)");
  if (f.version > 3)
    throw GgufError("version " + std::to_string(f.version) + " is newer than supported (need 2 or 3)");

  const int64_t n_tensors_raw = r.read<int64_t>("header n_tensors");
  const int64_t n_kv_raw = r.read<int64_t>("header n_kv");
  if (n_tensors_raw < 0) throw GgufError("n_tensors " + std::to_string(n_tensors_raw) + " is negative");
  if (n_kv_raw < 0) throw GgufError("n_kv " + std::to_string(n_kv_raw) + " is negative");
  const uint64_t n_tensors = uint64_t(n_tensors_raw), n_kv = uint64_t(n_kv_raw);
  // Minimum encodings: a kv is key length (8) + 1 byte of key + type (4) + 1 byte of value;
  // a tensor entry is name length (8) + 1 + n_dims (4) + one dim (8) + type (4) + offset (8).
  constexpr uint64_t kMinKvBytes = 14, kMinTensorBytes = 33;
  if (n_kv > lim.max_kv)
    throw GgufError("n_kv " + std::to_string(n_kv) + " exceeds the limit " + std::to_string(lim.max_kv));
  if (n_tensors > lim.max_tensors)
    throw GgufError("n_tensors " + std::to_string(n_tensors) + " exceeds the limit " +
                    std::to_string(lim.max_tensors));
  if (n_kv > r.left() / kMinKvBytes)
    throw GgufError("n_kv " + std::to_string(n_kv) + " cannot fit in the " + std::to_string(r.left()) +
                    " bytes left (truncated or corrupt header)");
  if (n_tensors > r.left() / kMinTensorBytes)
    throw GgufError("n_tensors " + std::to_string(n_tensors) + " cannot fit in the " +
                    std::to_string(r.left()) + " bytes left (truncated or corrupt header)");

  // No reserve(n_kv) / reserve(n_tensors): an entry object is ~10x its minimum encoding, so
  // growing with the entries actually parsed keeps memory proportional to the bytes consumed.
  for (uint64_t k = 0; k < n_kv; ++k) {
    const std::string_view key = r.string("metadata key", lim.max_key_bytes);
    if (key.empty()) throw GgufError("metadata entry " + std::to_string(k) + ": empty key");
    const std::string what = "metadata '" + printable(key) + "'";
    if (f.kv_index_.count(std::string(key))) throw GgufError(what + ": duplicate key");
    const uint32_t t = r.read<uint32_t>(what.c_str());
    if (!detail::valid_value_type(t))
      throw GgufError(what + ": unknown value type " + std::to_string(t));
    Value v;
    v.type = ValueType(t);
    if (v.type == ValueType::STRING) {
      v.str = r.string(what.c_str(), lim.max_string_bytes);
    } else if (v.type == ValueType::ARRAY) {
      const uint32_t et = r.read<uint32_t>(what.c_str());
      if (!detail::valid_value_type(et))
        throw GgufError(what + ": unknown array element type " + std::to_string(et));
      v.elem = ValueType(et);
      if (v.elem == ValueType::ARRAY) throw GgufError(what + ": nested arrays are not supported");
      v.count = r.read<uint64_t>(what.c_str());
      const uint64_t min_elem = v.elem == ValueType::STRING ? 8 : scalar_size(v.elem);
      if (v.count > lim.max_array_count)
        throw GgufError(what + ": array count " + std::to_string(v.count) + " exceeds the limit " +
                        std::to_string(lim.max_array_count));
      if (v.count > r.left() / min_elem)
        throw GgufError(what + ": array count " + std::to_string(v.count) + " of " + value_type_name(v.elem) +
                        " cannot fit in the " + std::to_string(r.left()) + " bytes left (truncated file)");
      if (v.elem == ValueType::STRING) {
        v.strings.reserve(v.count);  // count <= bytes left / 8: at most 2x the file
        for (uint64_t i = 0; i < v.count; ++i) v.strings.push_back(r.string(what.c_str(), lim.max_string_bytes));
      } else {
        v.raw = r.bytes(v.count * min_elem, what.c_str());
        if (v.elem == ValueType::BOOL)
          for (uint8_t b : v.raw)
            if (b > 1) throw GgufError(what + ": bool element " + std::to_string(b) + " is not 0 or 1");
      }
    } else {
      detail::read_scalar(r, v.type, v, what.c_str());
    }
    f.kv_index_.emplace(std::string(key), f.kv.size());
    f.kv.emplace_back(std::string(key), std::move(v));
  }

  if (const Value* a = f.find("general.alignment")) {
    if (a->type != ValueType::U32)
      throw GgufError(std::string("metadata 'general.alignment': expected u32, found ") + value_type_name(a->type));
    if (a->u == 0) throw GgufError("metadata 'general.alignment': alignment is zero");
    if ((a->u & (a->u - 1)) != 0)
      throw GgufError("metadata 'general.alignment': " + std::to_string(a->u) + " is not a power of two");
    if (a->u > lim.max_alignment)
      throw GgufError("metadata 'general.alignment': " + std::to_string(a->u) + " exceeds the limit " +
                      std::to_string(lim.max_alignment));
    f.alignment = uint32_t(a->u);
  }

  for (uint64_t k = 0; k < n_tensors; ++k) {
    TensorInfo ti;
    const std::string entry = "tensor entry " + std::to_string(k);
    const std::string_view name = r.string(entry.c_str(), lim.max_string_bytes);
    if (name.empty()) throw GgufError(entry + ": empty tensor name");
    if (name.size() > kMaxNameBytes)
      throw GgufError(entry + ": tensor name of " + std::to_string(name.size()) + " bytes exceeds " +
                      std::to_string(kMaxNameBytes));
    ti.name = std::string(name);
    const std::string what = "tensor '" + printable(ti.name) + "'";
    if (f.tensor_index_.count(ti.name)) throw GgufError(what + ": duplicate tensor name");
    ti.n_dims = r.read<uint32_t>(what.c_str());
    if (ti.n_dims < 1 || ti.n_dims > kMaxDims)
      throw GgufError(what + ": n_dims " + std::to_string(ti.n_dims) + " is outside [1, 4]");
    uint64_t n = 1;
    for (uint32_t d = 0; d < ti.n_dims; ++d) {
      ti.ne[d] = r.read<uint64_t>(what.c_str());
      if (ti.ne[d] < 1)
        throw GgufError(what + ": dimension " + std::to_string(d) + " is 0 (must be >= 1)");
      if (ti.ne[d] > uint64_t(INT64_MAX))  // ggml stores dims as int64
        throw GgufError(what + ": dimension " + std::to_string(d) + " is " + std::to_string(ti.ne[d]) +
                        ", above the int64 maximum");
      auto m = checked_mul(n, ti.ne[d]);
      if (!m || *m > uint64_t(INT64_MAX))
        throw GgufError(what + ": element count overflows at dimension " + std::to_string(d));
      n = *m;
    }
    ti.n_elements = n;
    const uint32_t t = r.read<uint32_t>(what.c_str());
    ti.type = TensorType(t);
    const TypeTraits tt = type_traits(ti.type);
    if (tt.block_elems == 0) throw GgufError(what + ": unknown tensor type " + std::to_string(t));
    if (ti.ne[0] % tt.block_elems != 0)
      throw GgufError(what + ": row length " + std::to_string(ti.ne[0]) + " is not a multiple of the " +
                      tt.name + " block size " + std::to_string(tt.block_elems));
    // n is a multiple of block_elems (ne[0] is); the product can still overflow (2^62 F32 elements).
    const auto n_bytes = checked_mul(n / tt.block_elems, tt.block_bytes);
    if (!n_bytes)
      throw GgufError(what + ": byte size of " + std::to_string(n) + " " + tt.name + " elements overflows u64");
    ti.n_bytes = *n_bytes;
    ti.offset = r.read<uint64_t>(what.c_str());
    if (ti.offset % f.alignment != 0)
      throw GgufError(what + ": offset " + std::to_string(ti.offset) + " is not a multiple of the alignment " +
                      std::to_string(f.alignment));
    f.tensor_index_.emplace(ti.name, f.tensors.size());
    f.tensors.push_back(std::move(ti));
  }

  // The data section starts at the next multiple of the alignment.
  const uint64_t header_end = r.pos();
  const uint64_t data = (header_end + f.alignment - 1) / f.alignment * f.alignment;
  if (n_tensors > 0 && data > bytes.size())
    throw GgufError("data section at offset " + std::to_string(data) + " is past the end of the file (" +
                    std::to_string(bytes.size()) + " bytes): truncated file");
  f.data_offset = data;
  // Tensors must appear in file order without overlap: every byte then belongs to at most one tensor.
  uint64_t prev_begin = 0, prev_end = 0;
  for (TensorInfo& ti : f.tensors) {
    const std::string what = "tensor '" + printable(ti.name) + "'";
    if (ti.offset < prev_begin)
      throw GgufError(what + ": offset " + std::to_string(ti.offset) +
                      " is out of order (the previous tensor starts at " + std::to_string(prev_begin) + ")");
    if (ti.offset < prev_end)
      throw GgufError(what + ": offset " + std::to_string(ti.offset) +
                      " overlaps the previous tensor (which ends at " + std::to_string(prev_end) + ")");
    const auto end = checked_add(ti.offset, ti.n_bytes);
    const auto abs_end = end ? checked_add(data, *end) : std::nullopt;
    if (!abs_end)
      throw GgufError(what + ": offset " + std::to_string(ti.offset) + " + size " + std::to_string(ti.n_bytes) +
                      " overflows u64");
    if (*abs_end > bytes.size())
      throw GgufError(what + ": data [" + std::to_string(ti.offset) + ", +" + std::to_string(ti.n_bytes) +
                      ") extends past the end of the file (" + std::to_string(bytes.size()) +
                      " bytes): truncated file");
    ti.data = bytes.subspan(data + ti.offset, ti.n_bytes);
    prev_begin = ti.offset;
    prev_end = *end;
  }
  return f;
}

// The File views the bytes it parsed: parsing a temporary vector would leave it dangling.
File parse(std::vector<uint8_t>&&, const Limits& = {}) = delete;

}  // namespace pp::gguf
