// A fake Ollama store (manifests/ and blobs/ in a temp dir, removed afterwards) for the model-resolution
// tests: as a plain object (OllamaStore) or as a GoogleTest fixture with a fresh store per test (FakeStore).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace pp::test {

// A digest for stores whose blob's bytes need not hash to it (the resolver does not check).
inline constexpr const char* kFakeHex = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

class OllamaStore {
 public:
  OllamaStore() {
    char tmpl[] = "/tmp/pp_fake_store_XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp");
    root_ = tmpl;
    std::filesystem::create_directories(root_ / "blobs");
  }
  OllamaStore(const OllamaStore&) = delete;
  OllamaStore& operator=(const OllamaStore&) = delete;
  ~OllamaStore() {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }

  static void write(const std::filesystem::path& p, const std::string& bytes) {
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
  }
  std::filesystem::path manifest_path(const std::string& name, const std::string& tag) const {
    return root_ / "manifests/registry.ollama.ai/library" / name / tag;
  }
  std::filesystem::path blob_path(const std::string& hex) const { return root_ / "blobs" / ("sha256-" + hex); }
  // A manifest as Ollama writes it: a config, a template layer, then the layer of `media`.
  static std::string manifest(const std::string& digest, uint64_t size,
                              const std::string& media = "application/vnd.ollama.image.model") {
    return R"({"schemaVersion":2,"config":{"mediaType":"application/vnd.docker.container.image.v1+json",)"
           R"("digest":"sha256:aaaa","size":10},"layers":[{"mediaType":"application/vnd.ollama.image.template",)"
           R"("digest":"sha256:bbbb","size":5},{"mediaType":")" +
           media + R"(","digest":")" + digest + R"(","size":)" + std::to_string(size) + "}]}";
  }
  // A good entry for name:tag whose model blob (blobs/sha256-<hex>) holds `blob`; returns the blob's path.
  std::filesystem::path add_model(const std::string& name, const std::string& tag, const std::string& blob,
                                  const std::string& hex = kFakeHex) {
    write(manifest_path(name, tag), manifest("sha256:" + hex, blob.size()));
    write(blob_path(hex), blob);
    return blob_path(hex);
  }
  std::vector<std::string> roots() const { return {root_.string()}; }
  // $OLLAMA_MODELS and $HOME both at the store, for a process that resolves tags.
  std::map<std::string, std::string> env() const { return {{"OLLAMA_MODELS", root_.string()}, {"HOME", root_.string()}}; }

  std::filesystem::path root_;
};

// TEST_F(FakeStore, ...): an empty store per test.
class FakeStore : public ::testing::Test, public OllamaStore {};

}  // namespace pp::test
