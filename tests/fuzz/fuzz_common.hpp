// Shared by the libFuzzer targets: fixture paths, reporting a broken invariant, touching views.
#pragma once

#include "fuzz_paths.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

namespace pp::fuzz {

// $PP_TEST_DATA, else the source tree's tests/data (fuzz_paths.hpp, written by meson).
inline std::filesystem::path test_data() {
  const char* d = std::getenv("PP_TEST_DATA");
  return d && *d ? std::filesystem::path(d) : std::filesystem::path(kTestData);
}

// $PP_SHARED_FIXTURES, else ../shared/fixtures beside the source tree; empty when absent.
inline std::filesystem::path shared_fixtures() {
  const char* d = std::getenv("PP_SHARED_FIXTURES");
  const std::filesystem::path p = d && *d ? std::filesystem::path(d) : std::filesystem::path(kSharedFixtures);
  return std::filesystem::exists(p) ? p : std::filesystem::path();
}

// An invariant the code under test broke: say which and abort, so libFuzzer keeps the input.
[[noreturn]] inline void fail(std::string_view what, std::string_view detail = {}) {
  std::fprintf(stderr, "\nfuzz invariant broken: %.*s\n%.*s\n", int(what.size()), what.data(), int(detail.size()),
               detail.data());
  std::abort();
}

inline volatile uint8_t g_sink;  // keeps touch()'s reads

// Reads the first and last byte of [p, p + n): AddressSanitizer then reports any view that reaches
// past the fuzz input (libFuzzer hands the input over in a heap block of exactly its size).
inline void touch(const void* p, std::size_t n) {
  if (n == 0) return;
  const auto* b = static_cast<const volatile uint8_t*>(p);
  g_sink = b[0] ^ b[n - 1];
}

}  // namespace pp::fuzz
