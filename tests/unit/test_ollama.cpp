// Model argument resolution against a fake Ollama store in a temp dir: one test per outcome.
#include <pp/io/ollama.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;

constexpr const char* kHex = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

// A store root with manifests/ and blobs/, removed afterwards.
class FakeStore : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/pp_ollama_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    fs::create_directories(root_ / "blobs");
  }
  void TearDown() override { fs::remove_all(root_); }

  static void write(const fs::path& p, const std::string& bytes) {
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
  }
  fs::path manifest_path(const std::string& name, const std::string& tag) const {
    return root_ / "manifests/registry.ollama.ai/library" / name / tag;
  }
  static std::string manifest(const std::string& digest, uint64_t size,
                              const std::string& media = "application/vnd.ollama.image.model") {
    return R"({"schemaVersion":2,"config":{"mediaType":"application/vnd.docker.container.image.v1+json",)"
           R"("digest":"sha256:aaaa","size":10},"layers":[{"mediaType":"application/vnd.ollama.image.template",)"
           R"("digest":"sha256:bbbb","size":5},{"mediaType":")" +
           media + R"(","digest":")" + digest + R"(","size":)" + std::to_string(size) + "}]}";
  }
  // A good store entry for name:tag whose blob holds `blob`.
  void add_model(const std::string& name, const std::string& tag, const std::string& blob) {
    write(manifest_path(name, tag), manifest(std::string("sha256:") + kHex, blob.size()));
    write(root_ / "blobs" / (std::string("sha256-") + kHex), blob);
  }
  std::vector<std::string> roots() const { return {root_.string()}; }

  // The message of the ModelResolveError that resolving `arg` throws ("" if none).
  std::string error_of(const std::string& arg) const {
    try {
      pp::resolve_model(arg, roots());
    } catch (const pp::ModelResolveError& e) {
      return e.what();
    }
    return "";
  }

  fs::path root_;
  const std::string gguf_ = std::string("GGUF\x03\0\0\0", 8) + std::string(56, '\0');
};

TEST_F(FakeStore, GoodTagResolvesToTheBlob) {
  add_model("llama3.2", "1b", gguf_);
  const pp::ResolvedModel m = pp::resolve_model("llama3.2:1b", roots());
  EXPECT_EQ(m.path, (root_ / "blobs" / (std::string("sha256-") + kHex)).string());
  EXPECT_EQ(m.how, "ollama");
  EXPECT_EQ(m.size, gguf_.size());
  EXPECT_EQ(m.manifest, manifest_path("llama3.2", "1b").string());
}

TEST_F(FakeStore, NoTagMeansLatest) {
  add_model("llama3.2", "latest", gguf_);
  EXPECT_EQ(pp::resolve_model("llama3.2", roots()).how, "ollama");
}

TEST_F(FakeStore, LaterRootIsSearchedWhenTheFirstLacksTheManifest) {
  add_model("llama3.2", "1b", gguf_);
  const pp::ResolvedModel m = pp::resolve_model("llama3.2:1b", {(root_ / "nothing").string(), root_.string()});
  EXPECT_EQ(m.how, "ollama");
}

TEST_F(FakeStore, MissingTagListsThePathsTried) {
  add_model("llama3.2", "1b", gguf_);
  const std::string e = error_of("llama3.2:3b");
  EXPECT_NE(e.find(manifest_path("llama3.2", "3b").string()), std::string::npos) << e;
  EXPECT_NE(e.find("tried"), std::string::npos) << e;
}

TEST_F(FakeStore, BadDigestFormatIsRefused) {
  for (const std::string& digest : {std::string("sha256:") + std::string(kHex).substr(1),       // 63 digits
                                   std::string("sha256:") + std::string(63, 'a') + "G",          // not hex
                                   std::string("sha256:") + std::string(64, 'A'),                // uppercase
                                   std::string("md5:") + kHex, std::string(kHex)}) {            // wrong scheme
    write(manifest_path("m", "t"), manifest(digest, gguf_.size()));
    const std::string e = error_of("m:t");
    EXPECT_NE(e.find("digest"), std::string::npos) << digest << ": " << e;
  }
}

TEST_F(FakeStore, MissingBlobIsRefused) {
  write(manifest_path("m", "t"), manifest(std::string("sha256:") + kHex, gguf_.size()));
  const std::string e = error_of("m:t");
  EXPECT_NE(e.find("missing"), std::string::npos) << e;
  EXPECT_NE(e.find(std::string("sha256-") + kHex), std::string::npos) << e;
}

TEST_F(FakeStore, BlobSizeMismatchIsRefused) {
  add_model("m", "t", gguf_);
  write(manifest_path("m", "t"), manifest(std::string("sha256:") + kHex, gguf_.size() + 1));
  const std::string e = error_of("m:t");
  EXPECT_NE(e.find(std::to_string(gguf_.size()) + " bytes"), std::string::npos) << e;
}

TEST_F(FakeStore, NonGgufBlobIsRefused) {
  add_model("m", "t", std::string(64, 'x'));
  const std::string e = error_of("m:t");
  EXPECT_NE(e.find("not a GGUF file"), std::string::npos) << e;
}

TEST_F(FakeStore, ManifestWithoutModelLayerIsRefused) {
  add_model("m", "t", gguf_);
  write(manifest_path("m", "t"),
        manifest(std::string("sha256:") + kHex, gguf_.size(), "application/vnd.ollama.image.license"));
  const std::string e = error_of("m:t");
  EXPECT_NE(e.find("no layer of mediaType 'application/vnd.ollama.image.model'"), std::string::npos) << e;
}

TEST_F(FakeStore, ManifestThatIsNotJsonIsRefused) {
  write(manifest_path("m", "t"), "{not json");
  EXPECT_NE(error_of("m:t").find("not a JSON object"), std::string::npos);
}

TEST_F(FakeStore, TagCannotEscapeTheStore) {
  EXPECT_NE(error_of("../../etc:passwd").find("not a valid name"), std::string::npos);
  EXPECT_NE(error_of("a/b/c/d:t").find("at most 3"), std::string::npos);
}

TEST_F(FakeStore, ExistingFileIsAPath) {
  const fs::path p = root_ / "model.bin";
  write(p, gguf_);
  const pp::ResolvedModel m = pp::resolve_model(p.string(), roots());
  EXPECT_EQ(m.how, "path");
  EXPECT_EQ(m.path, p.string());
}

TEST_F(FakeStore, MissingGgufPathIsNotTreatedAsATag) {
  const std::string e = error_of((root_ / "absent.gguf").string());
  EXPECT_NE(e.find("does not exist"), std::string::npos) << e;
}

TEST_F(FakeStore, ExistingNonGgufFileIsRefused) {
  const fs::path p = root_ / "model.gguf";
  write(p, "not a model");
  EXPECT_NE(error_of(p.string()).find("not a GGUF file"), std::string::npos);
}

TEST(OllamaRoots, EnvironmentFirstThenHomeThenService) {
  ::setenv("OLLAMA_MODELS", "/x/models", 1);
  ::setenv("HOME", "/home/someone", 1);
  const std::vector<std::string> r = pp::ollama::default_roots();
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0], "/x/models");
  EXPECT_EQ(r[1], "/home/someone/.ollama/models");
  EXPECT_EQ(r[2], "/usr/share/ollama/.ollama/models");
  ::unsetenv("OLLAMA_MODELS");
  EXPECT_EQ(pp::ollama::default_roots().size(), 2u);
}

TEST(OllamaTag, Parts) {
  const auto t = pp::ollama::parse_tag("llama3.2:1b");
  EXPECT_EQ(t.manifest_rel(), "manifests/registry.ollama.ai/library/llama3.2/1b");
  EXPECT_EQ(pp::ollama::parse_tag("me/model").manifest_rel(), "manifests/registry.ollama.ai/me/model/latest");
  EXPECT_EQ(pp::ollama::parse_tag("host.io/me/model:q4").manifest_rel(), "manifests/host.io/me/model/q4");
}

}  // namespace
