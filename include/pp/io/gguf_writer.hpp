// GGUF v3 writer: metadata and tensors into a byte vector (synthetic models, handcrafted test files).
#pragma once

#include <pp/io/gguf.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace pp::gguf {

// Tensor data is laid out with `alignment`; a non-default alignment must also be declared by the
// caller with add_u32("general.alignment", ...) (the writer does not add keys on its own).
class Writer {
 public:
  explicit Writer(uint32_t alignment = kDefaultAlignment) : alignment_(alignment) {}

  // Metadata, in the order added.
  void add_u8(std::string_view key, uint8_t v) { kv_header(key, ValueType::U8); put(meta_, v); ++n_kv_; }
  void add_i8(std::string_view key, int8_t v) { kv_header(key, ValueType::I8); put(meta_, v); ++n_kv_; }
  void add_u16(std::string_view key, uint16_t v) { kv_header(key, ValueType::U16); put(meta_, v); ++n_kv_; }
  void add_i16(std::string_view key, int16_t v) { kv_header(key, ValueType::I16); put(meta_, v); ++n_kv_; }
  void add_i64(std::string_view key, int64_t v) { kv_header(key, ValueType::I64); put(meta_, v); ++n_kv_; }
  void add_f64(std::string_view key, double v) { kv_header(key, ValueType::F64); put(meta_, v); ++n_kv_; }
  void add_u32(std::string_view key, uint32_t v) { kv_header(key, ValueType::U32); put(meta_, v); ++n_kv_; }
  void add_i32(std::string_view key, int32_t v) { kv_header(key, ValueType::I32); put(meta_, v); ++n_kv_; }
  void add_u64(std::string_view key, uint64_t v) { kv_header(key, ValueType::U64); put(meta_, v); ++n_kv_; }
  void add_f32(std::string_view key, float v) { kv_header(key, ValueType::F32); put(meta_, v); ++n_kv_; }
  void add_bool(std::string_view key, bool v) { kv_header(key, ValueType::BOOL); put(meta_, uint8_t(v)); ++n_kv_; }
  void add_string(std::string_view key, std::string_view v) {
    kv_header(key, ValueType::STRING);
    put_string(meta_, v);
    ++n_kv_;
  }
  void add_strings(std::string_view key, const std::vector<std::string>& v) {
    kv_header(key, ValueType::ARRAY);
    put(meta_, uint32_t(ValueType::STRING));
    put(meta_, uint64_t(v.size()));
    for (const auto& s : v) put_string(meta_, s);
    ++n_kv_;
  }
  // A scalar array; sizeof(T) must match `elem` (use uint8_t for BOOL).
  template <class T>
  void add_array(std::string_view key, ValueType elem, const std::vector<T>& v) {
    kv_header(key, ValueType::ARRAY);
    put(meta_, uint32_t(elem));
    put(meta_, uint64_t(v.size()));
    for (const T& x : v) put(meta_, x);
    ++n_kv_;
  }
  // Raw access for handcrafted (possibly invalid) entries: key + type id, then any bytes.
  std::vector<uint8_t>& raw_meta() { return meta_; }
  void count_raw_kv() { ++n_kv_; }
  // Raw tensor directory entry (name, n_dims, dims, type, offset written by the caller) and raw
  // data bytes, for handcrafted invalid directories.
  std::vector<uint8_t>& raw_dir() { return dir_; }
  std::vector<uint8_t>& raw_data() { return blob_; }
  void count_raw_tensor() { ++n_tensors_; }

  // A tensor: dims with ne[0] the row length; `data` already in the type's block layout.
  void add_tensor(std::string_view name, TensorType type, const std::vector<uint64_t>& ne,
                  const void* data, std::size_t n_bytes) {
    put_string(dir_, name);
    put(dir_, uint32_t(ne.size()));
    for (uint64_t d : ne) put(dir_, d);
    put(dir_, uint32_t(type));
    const uint64_t off = (blob_.size() + alignment_ - 1) / alignment_ * alignment_;
    blob_.resize(off);
    put(dir_, off);
    const auto* p = static_cast<const uint8_t*>(data);
    blob_.insert(blob_.end(), p, p + n_bytes);
    ++n_tensors_;
  }

  std::vector<uint8_t> bytes(uint32_t version = 3) const {
    std::vector<uint8_t> out;
    put(out, kMagic);
    put(out, version);
    put(out, int64_t(n_tensors_));
    put(out, int64_t(n_kv_));
    out.insert(out.end(), meta_.begin(), meta_.end());
    out.insert(out.end(), dir_.begin(), dir_.end());
    out.resize((out.size() + alignment_ - 1) / alignment_ * alignment_);
    out.insert(out.end(), blob_.begin(), blob_.end());
    return out;
  }

  template <class T>
  static void put(std::vector<uint8_t>& out, const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  static void put_string(std::vector<uint8_t>& out, std::string_view s) {
    put(out, uint64_t(s.size()));
    out.insert(out.end(), s.begin(), s.end());
  }

 private:
  void kv_header(std::string_view key, ValueType t) {
    put_string(meta_, key);
    put(meta_, uint32_t(t));
  }
  uint32_t alignment_;
  std::vector<uint8_t> meta_, dir_, blob_;
  uint64_t n_kv_ = 0, n_tensors_ = 0;
};

}  // namespace pp::gguf
