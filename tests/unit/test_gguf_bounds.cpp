// GGUF parser bounds at the shipped limits (gguf::Limits defaults): each accepted at the limit and refused one past it.
//
// docs/HARDENING.md "Bounds" lists these with the rest; the rejections' messages are also covered, one
// handcrafted file per check, in test_gguf.cpp.
#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "pp/core/error.hpp"
#include "pp/io/gguf.hpp"
#include "pp/io/gguf_writer.hpp"

namespace {

using pp::gguf::Limits;
using pp::gguf::ValueType;
using pp::gguf::Writer;

std::string refusal(const std::vector<uint8_t>& bytes) {
  try {
    (void)pp::gguf::parse(bytes);
  } catch (const pp::GgufError& e) {
    return e.what();
  }
  return "";
}

TEST(GgufBounds, MetadataStringAtAndPastTheLimit) {
  const uint64_t limit = Limits{}.max_string_bytes;
  for (const uint64_t n : {limit, limit + 1}) {
    Writer w;
    w.add_string("general.description", std::string(n, 'x'));
    const std::string why = refusal(w.bytes());
    if (n == limit) {
      EXPECT_EQ(why, "") << "a string of exactly the limit is refused";
    } else {
      EXPECT_NE(why.find("string length " + std::to_string(n) + " exceeds the limit " + std::to_string(limit)),
                std::string::npos)
          << why;
    }
  }
}

TEST(GgufBounds, MetadataArrayAtAndPastTheLimit) {
  const uint64_t limit = Limits{}.max_array_count;
  for (const uint64_t n : {limit, limit + 1}) {
    Writer w;
    w.add_array("a", ValueType::U8, std::vector<uint8_t>(n, 7));
    const std::string why = refusal(w.bytes());
    if (n == limit) {
      EXPECT_EQ(why, "");
    } else {
      EXPECT_NE(why.find("array count " + std::to_string(n) + " exceeds the limit " + std::to_string(limit)),
                std::string::npos)
          << why;
    }
  }
}

TEST(GgufBounds, StringArrayElementsAreBoundedToo) {
  // Each element of a string array is a string: the same per-string limit applies to it.
  const uint64_t limit = Limits{}.max_string_bytes;
  Writer ok;
  ok.add_strings("tokens", {"a", std::string(limit, 'y')});
  EXPECT_EQ(refusal(ok.bytes()), "");
  Writer past;
  past.add_strings("tokens", {"a", std::string(limit + 1, 'y')});
  EXPECT_NE(refusal(past.bytes()).find("exceeds the limit " + std::to_string(limit)), std::string::npos);
}

TEST(GgufBounds, MetadataKeyAtAndPastTheLimit) {
  const uint64_t limit = Limits{}.max_key_bytes;
  for (const uint64_t n : {limit, limit + 1}) {
    Writer w;
    w.add_u32(std::string(n, 'k'), 1);
    const std::string why = refusal(w.bytes());
    if (n == limit) {
      EXPECT_EQ(why, "");
    } else {
      EXPECT_NE(why.find("string length " + std::to_string(n) + " exceeds the limit " + std::to_string(limit)),
                std::string::npos)
          << why;
    }
  }
}

TEST(GgufBounds, MetadataEntriesAtAndPastTheLimit) {
  const uint64_t limit = Limits{}.max_kv;
  for (const uint64_t n : {limit, limit + 1}) {
    Writer w;
    for (uint64_t i = 0; i < n; ++i) w.add_u8(std::to_string(i), 1);
    const std::string why = refusal(w.bytes());
    if (n == limit) {
      EXPECT_EQ(why, "");
    } else {
      EXPECT_NE(why.find("n_kv " + std::to_string(n) + " exceeds the limit " + std::to_string(limit)),
                std::string::npos)
          << why;
    }
  }
}

}  // namespace
