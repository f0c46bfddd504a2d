// Test helpers: locating test data and the shared fixtures, reading golden JSON files.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace pp::test {

// tests/data (PP_TEST_DATA, set by meson).
inline std::filesystem::path data_dir() {
  const char* d = std::getenv("PP_TEST_DATA");
  return d ? std::filesystem::path(d) : std::filesystem::path("tests/data");
}

// ../shared/fixtures when present (CI has it), else empty.
inline std::filesystem::path shared_fixtures() {
  const char* d = std::getenv("PP_SHARED_FIXTURES");
  if (d && std::filesystem::exists(d)) return d;
  return {};
}

inline nlohmann::json load_json(const std::filesystem::path& p) {
  std::ifstream in(p);
  if (!in) throw std::runtime_error("cannot open " + p.string());
  return nlohmann::json::parse(in);
}

// A path to a built binary (PP_BUILD_ROOT/tools/<name>).
inline std::string tool_path(const std::string& name) {
  const char* b = std::getenv("PP_BUILD_ROOT");
  return (std::filesystem::path(b ? b : ".") / "tools" / name).string();
}

}  // namespace pp::test
