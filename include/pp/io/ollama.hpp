// Resolves a model argument (a GGUF path or an Ollama tag like "llama3.2:1b") to a GGUF file on disk.
#pragma once

#include <pp/core/error.hpp>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

namespace pp {

// A model argument that names no usable GGUF file; the message says what was tried.
class ModelResolveError : public Error {
 public:
  explicit ModelResolveError(const std::string& what) : Error("model: " + what) {}
};

struct ResolvedModel {
  std::string path;      // the GGUF file to map
  std::string how;       // "path" or "ollama"
  std::string manifest;  // the Ollama manifest read (empty for a plain path)
  uint64_t size = 0;     // bytes of the GGUF file
};

namespace ollama {

inline constexpr std::string_view kModelMediaType = "application/vnd.ollama.image.model";
inline constexpr std::string_view kRegistry = "registry.ollama.ai";
inline constexpr std::string_view kDefaultNamespace = "library";
inline constexpr std::string_view kDefaultTag = "latest";

// "name[:tag]", "namespace/name[:tag]" or "host/namespace/name[:tag]" split into manifest path parts.
struct TagRef {
  std::string host = std::string(kRegistry);
  std::string ns = std::string(kDefaultNamespace);
  std::string name;
  std::string tag = std::string(kDefaultTag);
  std::string manifest_rel() const { return "manifests/" + host + "/" + ns + "/" + name + "/" + tag; }
};

// Path components come from user input: allow only what Ollama names use, so a tag cannot walk
// out of the store ("..", "/", NUL).
inline bool valid_component(std::string_view s) {
  if (s.empty() || s == "." || s == "..") return false;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

inline TagRef parse_tag(std::string_view ref) {
  TagRef t;
  std::string_view path = ref;
  const size_t colon = ref.rfind(':');
  if (colon != std::string_view::npos) {
    path = ref.substr(0, colon);
    t.tag = std::string(ref.substr(colon + 1));
  }
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t slash = path.find('/', start);
    parts.emplace_back(path.substr(start, slash == std::string_view::npos ? std::string_view::npos : slash - start));
    if (slash == std::string_view::npos) break;
    start = slash + 1;
  }
  if (parts.size() > 3)
    throw ModelResolveError("ollama tag '" + std::string(ref) + "' has " + std::to_string(parts.size()) +
                            " path parts, at most 3 (host/namespace/name)");
  t.name = parts.back();
  if (parts.size() >= 2) t.ns = parts[parts.size() - 2];
  if (parts.size() == 3) t.host = parts[0];
  for (const std::string* c : {&t.host, &t.ns, &t.name, &t.tag})
    if (!valid_component(*c))
      throw ModelResolveError("ollama tag '" + std::string(ref) + "': component '" + *c +
                              "' is not a valid name (letters, digits, '.', '_', '-')");
  return t;
}

// The store roots in search order: $OLLAMA_MODELS (when set and non-empty), ~/.ollama/models,
// /usr/share/ollama/.ollama/models (the Linux service's store).
inline std::vector<std::string> default_roots() {
  std::vector<std::string> roots;
  if (const char* env = std::getenv("OLLAMA_MODELS"); env && *env) roots.emplace_back(env);
  std::string home;
  if (const char* h = std::getenv("HOME"); h && *h) {
    home = h;
  } else if (const passwd* pw = ::getpwuid(::getuid()); pw && pw->pw_dir) {
    home = pw->pw_dir;
  }
  if (!home.empty()) roots.push_back(home + "/.ollama/models");
  roots.emplace_back("/usr/share/ollama/.ollama/models");
  return roots;
}

inline bool is_sha256_hex(std::string_view h) {
  if (h.size() != 64) return false;
  for (char c : h)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

}  // namespace ollama

namespace detail {

inline bool is_regular_file(const std::string& path, uint64_t* size = nullptr) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (size) *size = uint64_t(st.st_size);
  return true;
}

// Checks the first four bytes are "GGUF"; `what` says where the file came from, for the message.
inline void require_gguf_magic(const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw ModelResolveError(what + " '" + path + "': cannot open: " + std::strerror(errno));
  char magic[4] = {};
  ssize_t got = 0;
  while (got < 4) {
    const ssize_t r = ::read(fd, magic + got, size_t(4 - got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += r;
  }
  ::close(fd);
  if (got < 4 || std::memcmp(magic, "GGUF", 4) != 0)
    throw ModelResolveError(what + " '" + path + "' is not a GGUF file (its first bytes are not 'GGUF')");
}

}  // namespace detail

// Resolves an Ollama tag against `roots` (searched in order; the first root holding the manifest
// wins). Validates the manifest's model layer, the digest format, the blob's size and its magic.
inline ResolvedModel resolve_ollama_tag(const std::string& ref, const std::vector<std::string>& roots) {
  const ollama::TagRef tag = ollama::parse_tag(ref);
  std::string manifest;
  std::string root;
  std::string tried;
  for (const std::string& r : roots) {
    const std::string m = r + "/" + tag.manifest_rel();
    tried += (tried.empty() ? "" : ", ") + m;
    if (detail::is_regular_file(m)) {
      manifest = m;
      root = r;
      break;
    }
  }
  if (manifest.empty())
    throw ModelResolveError("'" + ref + "' is neither a GGUF file nor an Ollama tag in the local store (tried " +
                            tried + ")");

  std::ifstream in(manifest, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json doc = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object())
    throw ModelResolveError("ollama manifest '" + manifest + "' is not a JSON object");
  const auto layers = doc.find("layers");
  if (layers == doc.end() || !layers->is_array())
    throw ModelResolveError("ollama manifest '" + manifest + "' has no 'layers' array");
  const nlohmann::json* model = nullptr;
  std::string media_types;
  for (const auto& layer : *layers) {
    if (!layer.is_object()) continue;
    const auto mt = layer.find("mediaType");
    if (mt == layer.end() || !mt->is_string()) continue;
    media_types += (media_types.empty() ? "" : ", ") + mt->get<std::string>();
    if (*mt == ollama::kModelMediaType) {
      model = &layer;  // the first model layer; Ollama writes exactly one
      break;
    }
  }
  if (!model)
    throw ModelResolveError("ollama manifest '" + manifest + "' has no layer of mediaType '" +
                            std::string(ollama::kModelMediaType) + "' (layers: " +
                            (media_types.empty() ? "none" : media_types) + ")");

  const auto digest_it = model->find("digest");
  const std::string digest = digest_it != model->end() && digest_it->is_string() ? digest_it->get<std::string>() : "";
  constexpr std::string_view kPrefix = "sha256:";
  if (digest.rfind(kPrefix, 0) != 0 || !ollama::is_sha256_hex(std::string_view(digest).substr(kPrefix.size())))
    throw ModelResolveError("ollama manifest '" + manifest + "': model layer digest '" + digest +
                            "' is not 'sha256:' followed by 64 lowercase hex digits");
  const auto size_it = model->find("size");
  if (size_it == model->end() || !size_it->is_number_integer() || size_it->get<int64_t>() < 0)
    throw ModelResolveError("ollama manifest '" + manifest + "': model layer has no non-negative integer 'size'");
  const uint64_t want = size_it->get<uint64_t>();

  const std::string blob = root + "/blobs/sha256-" + digest.substr(kPrefix.size());
  uint64_t have = 0;
  if (!detail::is_regular_file(blob, &have))
    throw ModelResolveError("ollama blob '" + blob + "' (model layer of manifest '" + manifest +
                            "') is missing or not a regular file");
  if (have != want)
    throw ModelResolveError("ollama blob '" + blob + "' has " + std::to_string(have) + " bytes, manifest '" +
                            manifest + "' says " + std::to_string(want) + " (incomplete download?)");
  detail::require_gguf_magic(blob, "ollama blob");
  return ResolvedModel{blob, "ollama", manifest, have};
}

// A value ending in ".gguf" or naming an existing file is a path; anything else is an Ollama tag.
inline ResolvedModel resolve_model(const std::string& arg, const std::vector<std::string>& roots = ollama::default_roots()) {
  if (arg.empty()) throw ModelResolveError("empty model argument");
  uint64_t size = 0;
  const bool exists = detail::is_regular_file(arg, &size);
  const bool gguf_suffix = arg.size() >= 5 && arg.compare(arg.size() - 5, 5, ".gguf") == 0;
  if (exists) {
    detail::require_gguf_magic(arg, "model file");
    return ResolvedModel{arg, "path", "", size};
  }
  if (struct stat st {}; ::stat(arg.c_str(), &st) == 0)
    throw ModelResolveError("model path '" + arg + "' exists but is not a regular file");
  if (gguf_suffix) throw ModelResolveError("model file '" + arg + "' does not exist or is not a regular file");
  return resolve_ollama_tag(arg, roots);
}

}  // namespace pp
