// Model argument resolution against a fake Ollama store in a temp dir: one test per outcome.
#include <pp/io/ollama.hpp>

#include "../common/fake_store.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

namespace fs = std::filesystem;

constexpr const char* kHex = pp::test::kFakeHex;
using pp::test::FakeStore;  // tests/common/fake_store.hpp: an empty store per test

const std::string kGguf = std::string("GGUF\x03\0\0\0", 8) + std::string(56, '\0');

// The message of the ModelResolveError that resolving `arg` against `roots` throws ("" if none).
std::string error_of(const std::string& arg, const std::vector<std::string>& roots) {
  try {
    pp::resolve_model(arg, roots);
  } catch (const pp::ModelResolveError& e) {
    return e.what();
  }
  return "";
}

TEST_F(FakeStore, GoodTagResolvesToTheBlob) {
  add_model("llama3.2", "1b", kGguf);
  const pp::ResolvedModel m = pp::resolve_model("llama3.2:1b", roots());
  EXPECT_EQ(m.path, (root_ / "blobs" / (std::string("sha256-") + kHex)).string());
  EXPECT_EQ(m.how, "ollama");
  EXPECT_EQ(m.size, kGguf.size());
  EXPECT_EQ(m.manifest, manifest_path("llama3.2", "1b").string());
}

TEST_F(FakeStore, NoTagMeansLatest) {
  add_model("llama3.2", "latest", kGguf);
  EXPECT_EQ(pp::resolve_model("llama3.2", roots()).how, "ollama");
}

TEST_F(FakeStore, LaterRootIsSearchedWhenTheFirstLacksTheManifest) {
  add_model("llama3.2", "1b", kGguf);
  const pp::ResolvedModel m = pp::resolve_model("llama3.2:1b", {(root_ / "nothing").string(), root_.string()});
  EXPECT_EQ(m.how, "ollama");
}

TEST_F(FakeStore, MissingTagListsThePathsTried) {
  add_model("llama3.2", "1b", kGguf);
  const std::string e = error_of("llama3.2:3b", roots());
  EXPECT_NE(e.find(manifest_path("llama3.2", "3b").string()), std::string::npos) << e;
  EXPECT_NE(e.find("tried"), std::string::npos) << e;
}

TEST_F(FakeStore, BadDigestFormatIsRefused) {
  for (const std::string& digest : {std::string("sha256:") + std::string(kHex).substr(1),       // 63 digits
                                   std::string("sha256:") + std::string(63, 'a') + "G",          // not hex
                                   std::string("sha256:") + std::string(64, 'A'),                // uppercase
                                   std::string("md5:") + kHex, std::string(kHex)}) {            // wrong scheme
    write(manifest_path("m", "t"), manifest(digest, kGguf.size()));
    const std::string e = error_of("m:t", roots());
    EXPECT_NE(e.find("digest"), std::string::npos) << digest << ": " << e;
  }
}

TEST_F(FakeStore, MissingBlobIsRefused) {
  write(manifest_path("m", "t"), manifest(std::string("sha256:") + kHex, kGguf.size()));
  const std::string e = error_of("m:t", roots());
  EXPECT_NE(e.find("missing"), std::string::npos) << e;
  EXPECT_NE(e.find(std::string("sha256-") + kHex), std::string::npos) << e;
}

TEST_F(FakeStore, BlobSizeMismatchIsRefused) {
  add_model("m", "t", kGguf);
  write(manifest_path("m", "t"), manifest(std::string("sha256:") + kHex, kGguf.size() + 1));
  const std::string e = error_of("m:t", roots());
  EXPECT_NE(e.find(std::to_string(kGguf.size()) + " bytes"), std::string::npos) << e;
}

TEST_F(FakeStore, NonGgufBlobIsRefused) {
  add_model("m", "t", std::string(64, 'x'));
  const std::string e = error_of("m:t", roots());
  EXPECT_NE(e.find("not a GGUF file"), std::string::npos) << e;
}

TEST_F(FakeStore, ManifestWithoutModelLayerIsRefused) {
  add_model("m", "t", kGguf);
  write(manifest_path("m", "t"),
        manifest(std::string("sha256:") + kHex, kGguf.size(), "application/vnd.ollama.image.license"));
  const std::string e = error_of("m:t", roots());
  EXPECT_NE(e.find("no layer of mediaType 'application/vnd.ollama.image.model'"), std::string::npos) << e;
}

TEST_F(FakeStore, ManifestThatIsNotJsonIsRefused) {
  write(manifest_path("m", "t"), "{not json");
  EXPECT_NE(error_of("m:t", roots()).find("not a JSON object"), std::string::npos);
}

TEST_F(FakeStore, TagCannotEscapeTheStore) {
  EXPECT_NE(error_of("../../etc:passwd", roots()).find("not a valid name"), std::string::npos);
  EXPECT_NE(error_of("a/b/c/d:t", roots()).find("at most 3"), std::string::npos);
}

TEST_F(FakeStore, ExistingFileIsAPath) {
  const fs::path p = root_ / "model.bin";
  write(p, kGguf);
  const pp::ResolvedModel m = pp::resolve_model(p.string(), roots());
  EXPECT_EQ(m.how, "path");
  EXPECT_EQ(m.path, p.string());
}

TEST_F(FakeStore, MissingGgufPathIsNotTreatedAsATag) {
  const std::string e = error_of((root_ / "absent.gguf").string(), roots());
  EXPECT_NE(e.find("does not exist"), std::string::npos) << e;
}

TEST_F(FakeStore, ExistingNonGgufFileIsRefused) {
  const fs::path p = root_ / "model.gguf";
  write(p, "not a model");
  EXPECT_NE(error_of(p.string(), roots()).find("not a GGUF file"), std::string::npos);
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
