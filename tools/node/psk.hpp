// pp_node's pre-shared key: read once from --psk-file FILE or the environment (PP_NODE_PSK), never printed.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>

#include "pp/core/error.hpp"
#include "pp/net/auth.hpp"

namespace pp::node {

inline constexpr const char* kPskEnv = "PP_NODE_PSK";

namespace detail {

// Trailing newlines and spaces are not part of the key (`openssl rand -hex 32 > key` writes one).
inline void strip_trailing_space(std::string& s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '\t')) s.pop_back();
}

// Holds secret bytes and wipes them on every way out.
struct Wiped {
  std::string bytes;
  ~Wiped() {
    if (bytes.capacity()) OPENSSL_cleanse(bytes.data(), bytes.capacity());  // stripped bytes too
  }
};

inline std::string read_key_file(const std::string& path, std::ostream& warn) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error("--psk-file '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error("--psk-file '" + path + "' is not a regular file");
  }
  // Bounded before reading: a key is at most kMaxKeyBytes plus its newline.
  if (uint64_t(st.st_size) > net::kMaxKeyBytes + 2) {
    ::close(fd);
    throw Error("--psk-file '" + path + "' has " + std::to_string(st.st_size) + " bytes > limit " +
                std::to_string(net::kMaxKeyBytes) + " for a key");
  }
  if (st.st_mode & (S_IRWXG | S_IRWXO)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    warn << "pp_node: warning: --psk-file '" << path << "' is accessible to other users (mode " << mode
         << "): chmod 600 it" << std::endl;
  }
  std::string s(std::size_t(st.st_size), '\0');
  std::size_t got = 0;
  while (got < s.size()) {
    const ssize_t r = ::read(fd, s.data() + got, s.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += std::size_t(r);
  }
  ::close(fd);
  s.resize(got);
  return s;
}

}  // namespace detail

// The key from --psk-file when given, else from $PP_NODE_PSK (which is then wiped from the process's
// environment block and removed, so neither /proc/PID/environ nor anything this process starts shows it),
// else none. Errors name the source, never the key.
inline std::shared_ptr<const net::PresharedKey> load_psk(const std::string& psk_file, std::ostream& warn = std::cerr) {
  detail::Wiped key;
  std::string source;
  if (!psk_file.empty()) {
    key.bytes = detail::read_key_file(psk_file, warn);
    source = "--psk-file '" + psk_file + "'";
  } else if (char* env = std::getenv(kPskEnv); env && *env) {
    key.bytes = env;
    // unsetenv only drops the pointer: the bytes stay in the block the kernel shows as /proc/PID/environ
    // (getenv points into it), so overwrite them there first.
    OPENSSL_cleanse(env, std::strlen(env));
    ::unsetenv(kPskEnv);
    source = kPskEnv;
  } else {
    return nullptr;
  }
  detail::strip_trailing_space(key.bytes);
  return std::make_shared<const net::PresharedKey>(key.bytes, source);
}

}  // namespace pp::node
