// GGUF parser: round trips through the Writer, the real fixtures, and one handcrafted rejection per check.
#include <pp/core/error.hpp>
#include <pp/io/gguf.hpp>
#include <pp/io/gguf_writer.hpp>
#include <pp/io/mmap.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>
#include <numeric>
#include <string>
#include <vector>

// Largest single allocation since the last reset: proves that lying counts never turn into huge
// allocations. Replacing every form of new/delete keeps malloc/free paired (also under ASan).
namespace {
std::atomic<std::size_t> g_max_alloc{0};
void* counted_alloc(std::size_t n) {
  std::size_t seen = g_max_alloc.load(std::memory_order_relaxed);
  while (n > seen && !g_max_alloc.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
}  // namespace
void* operator new(std::size_t n) { return counted_alloc(n); }
void* operator new[](std::size_t n) { return counted_alloc(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

using pp::GgufError;
using pp::gguf::File;
using pp::gguf::Limits;
using pp::gguf::TensorType;
using pp::gguf::ValueType;
using pp::gguf::Writer;
using testing::HasSubstr;
using Bytes = std::vector<uint8_t>;
namespace fs = std::filesystem;

// The File views `b`: keep the bytes alive (a temporary would dangle, hence the deleted overload).
File parse(const Bytes& b, const Limits& lim = {}) { return pp::gguf::parse(std::span<const uint8_t>(b), lim); }
File parse(Bytes&&, const Limits& = {}) = delete;

// The message of the GgufError that parsing `b` throws ("" with a test failure when it parses).
std::string rejection(const Bytes& b, const Limits& lim = {}) {
  try {
    parse(b, lim);
  } catch (const GgufError& e) {
    return e.what();
  }
  ADD_FAILURE() << "parsed without error";
  return "";
}

template <class T>
void put(Bytes& b, T v) {
  Writer::put(b, v);
}
void put_str(Bytes& b, std::string_view s) { Writer::put_string(b, s); }

// Overwrites the header's n_tensors / n_kv (bytes 8..23).
Bytes with_counts(Bytes b, int64_t n_tensors, int64_t n_kv) {
  std::memcpy(b.data() + 8, &n_tensors, 8);
  std::memcpy(b.data() + 16, &n_kv, 8);
  return b;
}

Bytes with_version(uint32_t version) { return Writer().bytes(version); }

// A raw metadata entry: key, type id, then whatever `body` appends.
template <class Body>
Bytes raw_kv(std::string_view key, uint32_t type, Body body) {
  Writer w;
  put_str(w.raw_meta(), key);
  put(w.raw_meta(), type);
  body(w.raw_meta());
  w.count_raw_kv();
  return w.bytes();
}

// A raw tensor directory entry with the given dims (n_dims = ne.size()), type id and offset.
void raw_tensor(Writer& w, std::string_view name, const std::vector<uint64_t>& ne, uint32_t type, uint64_t offset) {
  put_str(w.raw_dir(), name);
  put(w.raw_dir(), uint32_t(ne.size()));
  for (uint64_t d : ne) put(w.raw_dir(), d);
  put(w.raw_dir(), type);
  put(w.raw_dir(), offset);
  w.count_raw_tensor();
}

// A file with one raw tensor entry and `data_bytes` bytes of tensor data.
Bytes one_tensor(std::string_view name, const std::vector<uint64_t>& ne, uint32_t type, uint64_t offset = 0,
                 std::size_t data_bytes = 64) {
  Writer w;
  raw_tensor(w, name, ne, type, offset);
  w.raw_data().resize(data_bytes);
  return w.bytes();
}

constexpr uint32_t kF32 = uint32_t(TensorType::F32);
constexpr uint32_t kQ4_0 = uint32_t(TensorType::Q4_0);

// ---------------------------------------------------------------------------------------------
// Round trips

class Versions : public testing::TestWithParam<uint32_t> {};

TEST_P(Versions, EveryScalarTypeRoundTrips) {
  Writer w;
  w.add_u8("u8", 250);
  w.add_i8("i8", -120);
  w.add_u16("u16", 65000);
  w.add_i16("i16", -32000);
  w.add_u32("u32", 4000000000u);
  w.add_i32("i32", -2000000000);
  w.add_u64("u64", 18000000000000000000ull);
  w.add_i64("i64", -9000000000000000000ll);
  w.add_f32("f32", 1.5e-5f);
  w.add_f64("f64", -2.25e300);
  w.add_bool("bool_true", true);
  w.add_bool("bool_false", false);
  w.add_string("string", "héllo\n");
  w.add_string("empty_string", "");
  const Bytes bytes = w.bytes(GetParam());
  const File f = parse(bytes);

  EXPECT_EQ(f.version, GetParam());
  ASSERT_EQ(f.kv.size(), 14u);
  EXPECT_EQ(f.kv[0].first, "u8");  // file order is kept
  EXPECT_EQ(f.find("u8")->type, ValueType::U8);
  EXPECT_EQ(f.get_uint("u8"), 250u);
  EXPECT_EQ(f.find("i8")->type, ValueType::I8);
  EXPECT_EQ(f.find("i8")->i, -120);
  EXPECT_EQ(f.get_uint("u16"), 65000u);
  EXPECT_EQ(f.find("i16")->i, -32000);
  EXPECT_EQ(f.get_uint("u32"), 4000000000u);
  EXPECT_EQ(f.find("i32")->i, -2000000000);
  EXPECT_EQ(f.get_uint("u64"), 18000000000000000000ull);
  EXPECT_EQ(f.find("i64")->i, -9000000000000000000ll);
  EXPECT_EQ(f.find("f32")->type, ValueType::F32);
  EXPECT_EQ(f.get_float("f32"), double(1.5e-5f));
  EXPECT_EQ(f.get_float("f64"), -2.25e300);
  EXPECT_TRUE(f.get_bool("bool_true"));
  EXPECT_FALSE(f.get_bool("bool_false"));
  EXPECT_EQ(f.get_string("string"), "héllo\n");
  EXPECT_EQ(f.get_string("empty_string"), "");
  EXPECT_TRUE(f.tensors.empty());
  EXPECT_EQ(f.find("missing"), nullptr);
}

template <class T>
void expect_array(const File& f, const char* key, ValueType elem, const std::vector<T>& want) {
  SCOPED_TRACE(key);
  const auto& a = f.get_array(key, elem);
  ASSERT_EQ(a.count, want.size());
  ASSERT_EQ(a.raw.size(), want.size() * sizeof(T));
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(File::array_at<T>(a, i), want[i]) << i;
}

TEST_P(Versions, ArraysOfEveryElementTypeRoundTrip) {
  const std::vector<uint8_t> u8 = {0, 1, 255};
  const std::vector<int8_t> i8 = {-128, 0, 127};
  const std::vector<uint16_t> u16 = {0, 65535};
  const std::vector<int16_t> i16 = {-32768, 32767};
  const std::vector<uint32_t> u32 = {1, 4294967295u};
  const std::vector<int32_t> i32 = {-1, 3, 2147483647};
  const std::vector<uint64_t> u64 = {18446744073709551615ull};
  const std::vector<int64_t> i64 = {-9223372036854775807ll - 1, 5};
  const std::vector<float> f32 = {1.0f, 3.29226279f, 32.0f};
  const std::vector<double> f64 = {0.1, -1e-300};
  const std::vector<uint8_t> bools = {1, 0, 1};
  const std::vector<std::string> strings = {"a", "", "Ġthe", std::string(300, 'x')};
  Writer w;
  w.add_array("u8", ValueType::U8, u8);
  w.add_array("i8", ValueType::I8, i8);
  w.add_array("u16", ValueType::U16, u16);
  w.add_array("i16", ValueType::I16, i16);
  w.add_array("u32", ValueType::U32, u32);
  w.add_array("i32", ValueType::I32, i32);
  w.add_array("u64", ValueType::U64, u64);
  w.add_array("i64", ValueType::I64, i64);
  w.add_array("f32", ValueType::F32, f32);
  w.add_array("f64", ValueType::F64, f64);
  w.add_array("bool", ValueType::BOOL, bools);
  w.add_strings("string", strings);
  w.add_array("empty", ValueType::I32, std::vector<int32_t>{});
  w.add_strings("empty_strings", {});
  const Bytes bytes = w.bytes(GetParam());
  const File f = parse(bytes);

  expect_array(f, "u8", ValueType::U8, u8);
  expect_array(f, "i8", ValueType::I8, i8);
  expect_array(f, "u16", ValueType::U16, u16);
  expect_array(f, "i16", ValueType::I16, i16);
  expect_array(f, "u32", ValueType::U32, u32);
  expect_array(f, "i32", ValueType::I32, i32);
  expect_array(f, "u64", ValueType::U64, u64);
  expect_array(f, "i64", ValueType::I64, i64);
  expect_array(f, "f32", ValueType::F32, f32);
  expect_array(f, "f64", ValueType::F64, f64);
  expect_array(f, "bool", ValueType::BOOL, bools);
  expect_array(f, "empty", ValueType::I32, std::vector<int32_t>{});
  const auto& s = f.get_array("string", ValueType::STRING);
  ASSERT_EQ(s.count, strings.size());
  ASSERT_EQ(s.strings.size(), strings.size());
  for (std::size_t i = 0; i < strings.size(); ++i) EXPECT_EQ(s.strings[i], strings[i]);
  EXPECT_EQ(f.get_array("empty_strings", ValueType::STRING).count, 0u);
}

TEST_P(Versions, TensorDataViewsPointAtTheirBytes) {
  Writer w;
  std::vector<float> a(5);  // odd size: the next tensor needs padding
  std::iota(a.begin(), a.end(), 1.0f);
  std::vector<uint16_t> b(3 * 4);
  std::iota(b.begin(), b.end(), uint16_t(100));
  std::vector<uint8_t> q(2 * 3 * 18);  // Q4_0 [64, 3]: 2 blocks of 18 bytes per row
  std::iota(q.begin(), q.end(), uint8_t(7));
  w.add_tensor("a", TensorType::F32, {5}, a.data(), a.size() * 4);
  w.add_tensor("b", TensorType::BF16, {3, 4}, b.data(), b.size() * 2);
  w.add_tensor("q", TensorType::Q4_0, {64, 3}, q.data(), q.size());
  w.add_tensor("h", TensorType::F16, {1, 1, 1, 2}, b.data(), 4);
  const Bytes bytes = w.bytes(GetParam());
  const File f = parse(bytes);

  ASSERT_EQ(f.tensors.size(), 4u);
  EXPECT_EQ(f.alignment, 32u);
  EXPECT_EQ(f.data_offset % 32, 0u);
  const auto check = [&](const char* name, TensorType type, uint32_t n_dims, std::array<uint64_t, 4> ne,
                         uint64_t n_elements, const void* want, std::size_t n_bytes) {
    SCOPED_TRACE(name);
    const auto* t = f.tensor(name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->type, type);
    EXPECT_EQ(t->n_dims, n_dims);
    EXPECT_EQ(t->ne, ne);
    EXPECT_EQ(t->n_elements, n_elements);
    EXPECT_EQ(t->n_bytes, n_bytes);
    EXPECT_EQ(t->offset % 32, 0u);
    ASSERT_EQ(t->data.size(), n_bytes);
    EXPECT_EQ(t->data.data(), bytes.data() + f.data_offset + t->offset);
    EXPECT_EQ(std::memcmp(t->data.data(), want, n_bytes), 0);
  };
  check("a", TensorType::F32, 1, {5, 1, 1, 1}, 5, a.data(), 20);
  check("b", TensorType::BF16, 2, {3, 4, 1, 1}, 12, b.data(), 24);
  check("q", TensorType::Q4_0, 2, {64, 3, 1, 1}, 192, q.data(), q.size());
  check("h", TensorType::F16, 4, {1, 1, 1, 2}, 2, b.data(), 4);
  EXPECT_EQ(f.tensor("missing"), nullptr);
}

INSTANTIATE_TEST_SUITE_P(V, Versions, testing::Values(2u, 3u), [](const auto& info) {
  return "v" + std::to_string(info.param);
});

TEST(GgufParse, AlignmentKeyIsHonoured) {
  for (uint32_t align : {1u, 8u, 64u, 4096u}) {
    SCOPED_TRACE(align);
    Writer w(align);
    w.add_u32("general.alignment", align);
    const std::vector<uint8_t> x = {1, 2, 3}, y = {4, 5, 6, 7, 8};
    w.add_tensor("x", TensorType::I8, {3}, x.data(), 3);
    w.add_tensor("y", TensorType::I8, {5}, y.data(), 5);
    const Bytes bytes = w.bytes();
    const File f = parse(bytes);
    EXPECT_EQ(f.alignment, align);
    EXPECT_EQ(f.data_offset % align, 0u);
    EXPECT_EQ(f.tensor("y")->offset, (3 + align - 1) / align * align);
    EXPECT_EQ(f.tensor("y")->data[4], 8);
    EXPECT_EQ(f.tensor("y")->data.data(), bytes.data() + f.data_offset + f.tensor("y")->offset);
  }
}

TEST(GgufParse, NameOf63BytesIsAccepted) {
  const std::string name(63, 'n');
  const Bytes bytes = one_tensor(name, {16}, kF32);
  const File f = parse(bytes);
  EXPECT_NE(f.tensor(name), nullptr);
}

TEST(GgufParse, EmptyFileWithoutTensorsParses) {
  Bytes b;
  put(b, pp::gguf::kMagic);
  put(b, uint32_t(3));
  put(b, int64_t(0));
  put(b, int64_t(0));
  const File f = parse(b);  // no data section padding needed without tensors
  EXPECT_TRUE(f.kv.empty());
  EXPECT_TRUE(f.tensors.empty());
}

TEST(GgufParse, TypedAccessorsNameKeyAndType) {
  Writer w;
  w.add_i32("neg", -3);
  w.add_u32("n", 3);
  w.add_strings("toks", {"a"});
  const Bytes bytes = w.bytes();
  const File f = parse(bytes);
  const auto msg = [&](auto fn) {
    try {
      fn();
    } catch (const GgufError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(msg([&] { f.get_uint("neg"); }), HasSubstr("metadata 'neg': negative value -3"));
  EXPECT_THAT(msg([&] { f.get_string("n"); }), HasSubstr("metadata 'n': expected string, found u32"));
  EXPECT_THAT(msg([&] { f.get_float("n"); }), HasSubstr("metadata 'n': expected a float, found u32"));
  EXPECT_THAT(msg([&] { f.get_uint("absent"); }), HasSubstr("metadata 'absent': missing"));
  EXPECT_THAT(msg([&] { f.get_array("toks", ValueType::I32); }),
              HasSubstr("metadata 'toks': expected an array of i32, found an array of string"));
  EXPECT_THAT(msg([&] { f.get_array("n", ValueType::I32); }), HasSubstr("expected array, found u32"));
}

// ---------------------------------------------------------------------------------------------
// Rejections: one handcrafted buffer per check, each with a substring only its own message has.

struct Reject {
  const char* name;
  Bytes bytes;
  std::string message;  // distinctive substring of the expected message
  Limits limits = {};
};

std::vector<Reject> rejections() {
  std::vector<Reject> r;
  const auto add = [&](const char* name, Bytes b, std::string msg, Limits lim = {}) {
    r.push_back({name, std::move(b), std::move(msg), lim});
  };
  // Header.
  {
    Bytes b = with_version(3);
    b[3] = 'X';
    add("BadMagic", b, "bad magic 'GGUX'");
  }
  add("Version0", with_version(0), "version 0 is invalid");
  add("Version1", with_version(1), "version 1 is obsolete");
  add("Version2ByteSwapped", with_version(0x02000000u), "version 33554432 looks byte-swapped");
  add("Version3ByteSwapped", with_version(0x03000000u), "version 50331648 looks byte-swapped");
  add("Version4", with_version(4), "version 4 is newer than supported");
  add("NTensorsNegative", with_counts(Writer().bytes(), -1, 0), "n_tensors -1 is negative");
  add("NKvNegative", with_counts(Writer().bytes(), 0, -5), "n_kv -5 is negative");
  add("NKvPastBytesLeft", with_counts(Writer().bytes(), 0, 1000), "n_kv 1000 cannot fit in the 8 bytes left");
  add("NTensorsPastBytesLeft", with_counts(Writer().bytes(), 1000, 0),
      "n_tensors 1000 cannot fit in the 8 bytes left");
  add("NKvOverLimit", with_counts(Writer().bytes(), 0, int64_t(1) << 40), "n_kv 1099511627776 exceeds the limit");
  add("NTensorsOverLimit", with_counts(Writer().bytes(), 100, 0), "n_tensors 100 exceeds the limit 99",
      Limits{.max_tensors = 99});

  // Metadata.
  const auto u64 = [](uint64_t v) { return [v](Bytes& b) { put(b, v); }; };
  const auto str_of_len = [](uint64_t len, std::string_view bytes) {
    return [=](Bytes& b) {
      put(b, len);
      b.insert(b.end(), bytes.begin(), bytes.end());
    };
  };
  const auto array_of = [](ValueType elem, uint64_t count) {
    return [=](Bytes& b) {
      put(b, uint32_t(elem));
      put(b, count);
    };
  };
  {
    Writer w;
    put(w.raw_meta(), uint64_t(1) << 20);  // key length
    w.raw_meta().resize(64, 'k');           // enough bytes that n_kv = 1 fits
    w.count_raw_kv();
    add("KeyOverLimit", w.bytes(), "metadata key: string length 1048576 exceeds the limit 65536");
  }
  add("StringPastBytesLeft", raw_kv("s", uint32_t(ValueType::STRING), str_of_len(1000, "abc")),
      "metadata 's': needs 1000 bytes");
  add("StringOverLimit", raw_kv("s", uint32_t(ValueType::STRING), str_of_len(uint64_t(1) << 40, "abc")),
      "metadata 's': string length 1099511627776 exceeds the limit 16777216");
  add("ArrayCountPastBytesLeft", raw_kv("a", uint32_t(ValueType::ARRAY), array_of(ValueType::U32, 1000)),
      "metadata 'a': array count 1000 of u32 cannot fit");
  add("StringArrayCountPastBytesLeft", raw_kv("a", uint32_t(ValueType::ARRAY), array_of(ValueType::STRING, 1000)),
      "metadata 'a': array count 1000 of string cannot fit");
  add("ArrayCountOverLimit", raw_kv("a", uint32_t(ValueType::ARRAY), array_of(ValueType::U8, uint64_t(1) << 25)),
      "metadata 'a': array count 33554432 exceeds the limit 16777216");
  add("ArrayStringPastBytesLeft",
      raw_kv("a", uint32_t(ValueType::ARRAY),
             [](Bytes& b) {
               put(b, uint32_t(ValueType::STRING));
               put(b, uint64_t(1));
               put(b, uint64_t(500));
             }),
      "metadata 'a': needs 500 bytes");
  add("NestedArray", raw_kv("a", uint32_t(ValueType::ARRAY), array_of(ValueType::ARRAY, 1)),
      "metadata 'a': nested arrays are not supported");
  add("UnknownValueType", raw_kv("k", 13, u64(0)), "metadata 'k': unknown value type 13");
  add("UnknownArrayElementType",
      raw_kv("a", uint32_t(ValueType::ARRAY),
             [](Bytes& b) {
               put(b, uint32_t(99));
               put(b, uint64_t(1));
             }),
      "metadata 'a': unknown array element type 99");
  add("BoolNot01", raw_kv("b", uint32_t(ValueType::BOOL), [](Bytes& b) { b.push_back(2); }),
      "metadata 'b': bool value 2 is not 0 or 1");
  add("BoolArrayElementNot01",
      raw_kv("b", uint32_t(ValueType::ARRAY),
             [](Bytes& b) {
               put(b, uint32_t(ValueType::BOOL));
               put(b, uint64_t(2));
               b.push_back(1);
               b.push_back(7);
             }),
      "metadata 'b': bool element 7 is not 0 or 1");
  add("EmptyKey", raw_kv("", uint32_t(ValueType::U32), u64(0)), "metadata entry 0: empty key");
  {
    Writer w;
    w.add_u32("dup", 1);
    w.add_string("dup", "x");
    add("DuplicateKey", w.bytes(), "metadata 'dup': duplicate key");
  }
  {
    Writer w;
    w.add_u64("general.alignment", 32);
    add("AlignmentNotU32", w.bytes(), "'general.alignment': expected u32, found u64");
  }
  {
    Writer w;
    w.add_u32("general.alignment", 0);
    add("AlignmentZero", w.bytes(), "'general.alignment': alignment is zero");
  }
  {
    Writer w;
    w.add_u32("general.alignment", 48);
    add("AlignmentNotPowerOfTwo", w.bytes(), "'general.alignment': 48 is not a power of two");
  }
  {
    Writer w;
    w.add_u32("general.alignment", 1u << 20);
    add("AlignmentTooLarge", w.bytes(), "'general.alignment': 1048576 exceeds the limit 65536");
  }

  // Tensor directory.
  add("EmptyTensorName", one_tensor("", {16}, kF32), "tensor entry 0: empty tensor name");
  add("TensorName64Bytes", one_tensor(std::string(64, 'n'), {16}, kF32),
      "tensor entry 0: tensor name of 64 bytes exceeds 63");
  {
    Writer w;
    raw_tensor(w, "t", {16}, kF32, 0);
    raw_tensor(w, "t", {16}, kF32, 64);
    w.raw_data().resize(128);
    add("DuplicateTensorName", w.bytes(), "tensor 't': duplicate tensor name");
  }
  add("NDims0", one_tensor("t", {}, kF32), "tensor 't': n_dims 0 is outside [1, 4]");
  add("NDims5", one_tensor("t", {1, 1, 1, 1, 1}, kF32), "tensor 't': n_dims 5 is outside [1, 4]");
  add("Dim0", one_tensor("t", {4, 0}, kF32), "tensor 't': dimension 1 is 0");
  add("DimAboveInt64", one_tensor("t", {uint64_t(1) << 63}, kF32), "above the int64 maximum");
  add("ElementCountOverflow", one_tensor("t", {uint64_t(1) << 32, uint64_t(1) << 31}, kF32),
      "tensor 't': element count overflows at dimension 1");
  add("ByteSizeOverflow", one_tensor("t", {uint64_t(1) << 31, uint64_t(1) << 31}, kF32),
      "tensor 't': byte size of 4611686018427387904 F32 elements overflows u64");
  add("UnknownTensorType", one_tensor("t", {16}, 4), "tensor 't': unknown tensor type 4");
  add("UnknownTensorTypeLarge", one_tensor("t", {16}, 1000), "tensor 't': unknown tensor type 1000");
  add("RowNotMultipleOfBlock", one_tensor("t", {33, 2}, kQ4_0, 0, 128),
      "tensor 't': row length 33 is not a multiple of the Q4_0 block size 32");
  add("OffsetNotAligned", one_tensor("t", {4}, kF32, 4), "tensor 't': offset 4 is not a multiple of the alignment 32");
  {
    Writer w;
    raw_tensor(w, "a", {32}, kF32, 0);  // [0, 128)
    raw_tensor(w, "b", {8}, kF32, 64);
    w.raw_data().resize(256);
    add("OverlappingOffsets", w.bytes(), "tensor 'b': offset 64 overlaps the previous tensor");
  }
  {
    Writer w;
    raw_tensor(w, "a", {8}, kF32, 64);
    raw_tensor(w, "b", {8}, kF32, 0);
    w.raw_data().resize(256);
    add("OutOfOrderOffsets", w.bytes(), "tensor 'b': offset 0 is out of order");
  }
  add("DataPastEndOfFile", one_tensor("t", {32}, kF32, 0, 100),
      "tensor 't': data [0, +128) extends past the end of the file");
  add("OffsetPlusSizeOverflows", one_tensor("t", {32}, kF32, ~uint64_t(0) - 31, 128),
      "tensor 't': offset 18446744073709551584 + size 128 overflows u64");
  {
    Bytes b = one_tensor("t", {8}, kF32, 0, 0);
    const auto dir_end = std::size_t(24 + 8 + 1 + 4 + 8 + 4 + 8);
    b.resize(dir_end);  // cut inside the padding before the data section
    add("DataSectionPastEnd", b, "data section at offset 64 is past the end of the file (57 bytes)");
  }
  return r;
}

void PrintTo(const Reject& r, std::ostream* os) { *os << r.name; }

class Rejects : public testing::TestWithParam<Reject> {};

TEST_P(Rejects, WithItsOwnMessage) {
  const Reject& c = GetParam();
  g_max_alloc = 0;
  const std::string msg = rejection(c.bytes, c.limits);
  EXPECT_THAT(msg, HasSubstr(c.message));
  EXPECT_THAT(msg, testing::StartsWith("gguf: "));
  EXPECT_LE(g_max_alloc.load(), 64u * 1024) << "a lying count became an allocation";
}

INSTANTIATE_TEST_SUITE_P(Gguf, Rejects, testing::ValuesIn(rejections()),
                         [](const auto& info) { return std::string(info.param.name); });

// Each expected substring matches its own message only: no two checks share a message.
TEST(GgufRejects, MessagesAreDistinct) {
  const auto cases = rejections();
  std::vector<std::string> messages;
  for (const auto& c : cases) messages.push_back(rejection(c.bytes, c.limits));
  for (std::size_t i = 0; i < cases.size(); ++i) {
    for (std::size_t j = 0; j < cases.size(); ++j) {
      if (i == j) continue;
      EXPECT_THAT(messages[j], testing::Not(HasSubstr(cases[i].message)))
          << cases[i].name << "'s substring also matches " << cases[j].name;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Truncation

// A small file with every kind of section: scalar, string and array metadata, three tensors.
struct Small {
  Bytes bytes;
  std::vector<std::size_t> boundaries;  // offsets where a section ends (a cut there is a clean cut)
};

Small small_file() {
  Writer w;
  w.add_u32("general.alignment", 32);
  w.add_string("general.architecture", "llama");
  w.add_strings("tokenizer.ggml.tokens", {"a", "bc", ""});
  w.add_array("tokenizer.ggml.token_type", ValueType::I32, std::vector<int32_t>{1, 3, 1});
  w.add_bool("flag", true);
  std::vector<uint8_t> data(200, 0x5a);
  w.add_tensor("a", TensorType::F32, {3, 2}, data.data(), 24);
  w.add_tensor("b", TensorType::Q4_0, {32}, data.data(), 18);
  w.add_tensor("c", TensorType::F16, {1, 1, 5}, data.data(), 10);
  Small s{w.bytes(), {}};
  // Section ends, found by walking the layout the writer just produced.
  const File f = parse(s.bytes);
  s.boundaries = {4, 8, 16, 24};
  std::size_t pos = 24;
  for (const auto& [key, v] : f.kv) {
    pos += 8 + key.size() + 4;
    if (v.type == ValueType::STRING) {
      pos += 8 + v.str.size();
    } else if (v.type == ValueType::ARRAY) {
      pos += 4 + 8 + v.raw.size();
      for (auto str : v.strings) pos += 8 + str.size();
    } else {
      pos += pp::gguf::scalar_size(v.type);
    }
    s.boundaries.push_back(pos);
  }
  for (const auto& t : f.tensors) {
    pos += 8 + t.name.size() + 4 + 8 * t.n_dims + 4 + 8;
    s.boundaries.push_back(pos);
  }
  s.boundaries.push_back(f.data_offset);
  for (const auto& t : f.tensors) {
    s.boundaries.push_back(f.data_offset + t.offset);
    s.boundaries.push_back(f.data_offset + t.offset + t.n_bytes);
  }
  EXPECT_EQ(s.boundaries.back(), s.bytes.size());
  return s;
}

TEST(GgufTruncation, AtEverySectionBoundary) {
  const Small s = small_file();
  for (std::size_t cut : s.boundaries) {
    if (cut >= s.bytes.size()) continue;
    SCOPED_TRACE(cut);
    for (std::size_t len : {cut - 1, cut}) {  // one byte into the section, and a cut exactly at it
      const Bytes b(s.bytes.begin(), s.bytes.begin() + std::ptrdiff_t(len));
      EXPECT_THAT(rejection(b), HasSubstr("truncated")) << "length " << len;
    }
  }
}

TEST(GgufTruncation, AtEveryByteLength) {
  const Small s = small_file();
  const Limits tight{.max_string_bytes = 1024, .max_key_bytes = 256, .max_array_count = 1024,
                     .max_kv = 64, .max_tensors = 64, .max_alignment = 4096};
  ASSERT_NO_THROW(parse(s.bytes, tight));
  for (std::size_t len = 0; len < s.bytes.size(); ++len) {
    const Bytes b(s.bytes.begin(), s.bytes.begin() + std::ptrdiff_t(len));
    g_max_alloc = 0;
    for (const Limits& lim : {Limits{}, tight}) {
      try {
        parse(b, lim);
        ADD_FAILURE() << "length " << len << " parsed";
      } catch (const GgufError& e) {
        EXPECT_THAT(e.what(), HasSubstr("truncated")) << "length " << len;
      }
    }
    EXPECT_LE(g_max_alloc.load(), 4096u) << "length " << len;
  }
}

// Every byte of the small file flipped to a few bad values: anything may be refused, nothing may
// crash or allocate hugely (a cheap deterministic fuzz of the structure).
TEST(GgufTruncation, CorruptedBytesNeverCrash) {
  const Small s = small_file();
  for (std::size_t i = 0; i < s.bytes.size(); ++i)
    for (uint8_t v : {uint8_t(0x00), uint8_t(0x01), uint8_t(0x7f), uint8_t(0x80), uint8_t(0xff)}) {
      Bytes b = s.bytes;
      b[i] = v;
      g_max_alloc = 0;
      try {
        parse(b);
      } catch (const GgufError&) {
      }
      EXPECT_LE(g_max_alloc.load(), 4096u) << "byte " << i << " = " << int(v);
    }
}

// ---------------------------------------------------------------------------------------------
// Real fixture files

// The fixture at `rel`, from tests/data (PP_TEST_DATA) or ../shared/fixtures (PP_SHARED_FIXTURES);
// "" when neither has it.
std::string fixture(const std::string& rel) {
  for (const char* var : {"PP_TEST_DATA", "PP_SHARED_FIXTURES"}) {
    const char* dir = std::getenv(var);
    if (dir && *dir && fs::exists(fs::path(dir) / rel)) return (fs::path(dir) / rel).string();
  }
  return "";
}

// Structural invariants every parsed file must satisfy.
void expect_consistent(const File& f, std::span<const uint8_t> bytes) {
  uint64_t prev_end = 0;
  for (const auto& t : f.tensors) {
    SCOPED_TRACE(t.name);
    EXPECT_EQ(t.offset % f.alignment, 0u);
    EXPECT_GE(t.offset, prev_end);
    prev_end = t.offset + t.n_bytes;
    EXPECT_EQ(t.data.data(), bytes.data() + f.data_offset + t.offset);
    EXPECT_EQ(t.data.size(), t.n_bytes);
    EXPECT_LE(f.data_offset + prev_end, bytes.size());
  }
}

TEST(GgufFixtures, GoldenTiny) {
  for (const char* dtype : {"f32", "f16", "bf16"}) {
    SCOPED_TRACE(dtype);
    const std::string path = fixture(std::string("golden-tiny/golden-tiny-") + dtype + ".gguf");
    if (path.empty()) GTEST_SKIP() << "golden-tiny fixtures absent (PP_TEST_DATA, PP_SHARED_FIXTURES)";
    const pp::MappedFile m(path);
    const File f = pp::gguf::parse(m.bytes());
    expect_consistent(f, m.bytes());
    EXPECT_EQ(f.version, 3u);
    EXPECT_EQ(f.get_string("general.architecture"), "llama");
    EXPECT_EQ(f.get_uint("llama.block_count"), 4u);
    EXPECT_EQ(f.get_uint("llama.embedding_length"), 64u);
    EXPECT_EQ(f.get_uint("llama.attention.head_count_kv"), 2u);
    EXPECT_FLOAT_EQ(float(f.get_float("llama.rope.freq_base")), 500000.0f);
    EXPECT_EQ(f.get_array("tokenizer.ggml.tokens", ValueType::STRING).count, 512u);
    EXPECT_EQ(f.get_array("tokenizer.ggml.merges", ValueType::STRING).count, 240u);
    EXPECT_EQ(f.get_uint("tokenizer.ggml.bos_token_id"), 496u);
    ASSERT_EQ(f.tensors.size(), 39u);  // 9 per block x 4 + token_embd, output_norm, rope_freqs
    EXPECT_EQ(f.tensor("output.weight"), nullptr);  // tied output
    const auto* embd = f.tensor("token_embd.weight");
    ASSERT_NE(embd, nullptr);
    const TensorType want = std::string(dtype) == "f32"   ? TensorType::F32
                            : std::string(dtype) == "f16" ? TensorType::F16
                                                          : TensorType::BF16;
    EXPECT_EQ(embd->type, want);
    EXPECT_EQ(embd->ne[0], 64u);
    EXPECT_EQ(embd->ne[1], 512u);
    const auto* ffn_down = f.tensor("blk.3.ffn_down.weight");
    ASSERT_NE(ffn_down, nullptr);
    EXPECT_EQ(ffn_down->ne[0], 192u);
    EXPECT_EQ(ffn_down->ne[1], 64u);
    const auto* rope = f.tensor("rope_freqs.weight");
    ASSERT_NE(rope, nullptr);
    ASSERT_EQ(rope->type, TensorType::F32);
    ASSERT_EQ(rope->n_elements, 8u);
    float freqs[8];
    std::memcpy(freqs, rope->data.data(), sizeof freqs);
    EXPECT_FLOAT_EQ(freqs[0], 1.0f);
    EXPECT_NEAR(freqs[4], 3.29226279f, 1e-6);
    EXPECT_FLOAT_EQ(freqs[7], 32.0f);
  }
}

TEST(GgufFixtures, GoldenKq) {
  struct Want {
    const char* file;
    TensorType embd, attn_q;
  };
  const Want files[] = {
      {"f32", TensorType::F32, TensorType::F32},       {"q8_0", TensorType::Q8_0, TensorType::Q8_0},
      {"q6_k", TensorType::Q6_K, TensorType::Q6_K},    {"q4_k_m", TensorType::Q6_K, TensorType::Q4_K},
      {"q4_0", TensorType::Q6_K, TensorType::Q4_0},    {"q4_1", TensorType::Q6_K, TensorType::Q4_1},
      {"q5_0", TensorType::Q6_K, TensorType::Q5_0},    {"q5_1", TensorType::Q6_K, TensorType::Q5_1},
      {"q5_k_m", TensorType::Q6_K, TensorType::Q5_K},  {"q5_k_s", TensorType::Q6_K, TensorType::Q5_K},
  };
  for (const Want& w : files) {
    SCOPED_TRACE(w.file);
    const std::string path = fixture(std::string("golden-kq/golden-kq-") + w.file + ".gguf");
    if (path.empty()) GTEST_SKIP() << "golden-kq fixtures absent (PP_SHARED_FIXTURES)";
    const pp::MappedFile m(path);
    const File f = pp::gguf::parse(m.bytes());
    expect_consistent(f, m.bytes());
    EXPECT_EQ(f.get_uint("llama.block_count"), 2u);
    EXPECT_EQ(f.get_uint("llama.attention.head_count_kv"), 1u);
    ASSERT_EQ(f.tensors.size(), 21u);
    ASSERT_NE(f.tensor("token_embd.weight"), nullptr);
    EXPECT_EQ(f.tensor("token_embd.weight")->type, w.embd);
    ASSERT_NE(f.tensor("blk.0.attn_q.weight"), nullptr);
    EXPECT_EQ(f.tensor("blk.0.attn_q.weight")->type, w.attn_q);
    EXPECT_EQ(f.tensor("blk.1.ffn_norm.weight")->type, TensorType::F32);
    EXPECT_EQ(f.tensor("blk.0.ffn_down.weight")->ne[0], 512u);
  }
}

TEST(GgufFixtures, Llama3VocabOnly) {
  const std::string path = fixture("llama3-vocab-only.gguf");
  if (path.empty()) GTEST_SKIP() << "llama3-vocab-only.gguf absent (PP_SHARED_FIXTURES)";
  const pp::MappedFile m(path);
  const File f = pp::gguf::parse(m.bytes());
  EXPECT_TRUE(f.tensors.empty());
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f.get_string("tokenizer.ggml.pre"), "llama-bpe");
  const auto& tokens = f.get_array("tokenizer.ggml.tokens", ValueType::STRING);
  ASSERT_EQ(tokens.count, 128256u);
  EXPECT_EQ(tokens.strings[128000], "<|begin_of_text|>");
  EXPECT_EQ(tokens.strings[128009], "<|eot_id|>");
  EXPECT_EQ(f.get_array("tokenizer.ggml.merges", ValueType::STRING).count, 280147u);
  const auto& types = f.get_array("tokenizer.ggml.token_type", ValueType::I32);
  ASSERT_EQ(types.count, 128256u);
  EXPECT_EQ(File::array_at<int32_t>(types, 0), 1);
  EXPECT_EQ(File::array_at<int32_t>(types, 128000), 3);
  EXPECT_EQ(f.get_uint("tokenizer.ggml.bos_token_id"), 128000u);
  EXPECT_EQ(f.get_uint("tokenizer.ggml.eos_token_id"), 128009u);
  EXPECT_THAT(std::string(f.get_string("tokenizer.chat_template")), HasSubstr("start_header_id"));

  // The limits bite on a real file too, naming the key.
  EXPECT_THAT(rejection(Bytes(m.bytes().begin(), m.bytes().end()), Limits{.max_array_count = 200000}),
              HasSubstr("metadata 'tokenizer.ggml.merges': array count 280147 exceeds the limit 200000"));
}

// A real file cut inside its header (every 7th length, plus every section of the data) always
// fails cleanly.
TEST(GgufFixtures, GoldenTinyTruncated) {
  const std::string path = fixture("golden-tiny/golden-tiny-f32.gguf");
  if (path.empty()) GTEST_SKIP() << "golden-tiny fixtures absent (PP_TEST_DATA, PP_SHARED_FIXTURES)";
  const pp::MappedFile m(path);
  const auto all = m.bytes();
  const File f = pp::gguf::parse(all);
  std::vector<std::size_t> lengths;
  for (std::size_t len = 0; len < f.data_offset; len += 7) lengths.push_back(len);
  lengths.push_back(f.data_offset - 1);
  for (const auto& t : f.tensors) {
    lengths.push_back(f.data_offset + t.offset);
    lengths.push_back(f.data_offset + t.offset + t.n_bytes - 1);
  }
  for (std::size_t len : lengths) {
    g_max_alloc = 0;
    EXPECT_THAT(rejection(Bytes(all.begin(), all.begin() + std::ptrdiff_t(len))), HasSubstr("truncated"))
        << "length " << len;
    EXPECT_LE(g_max_alloc.load(), 2 * len + 64 * 1024) << "length " << len;
  }
}

}  // namespace
