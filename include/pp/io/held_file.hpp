// A model file held open by descriptor: whatever is renamed over its path later, opening path() reaches the same file.
//
// A worker identifies its model once (the handshake's fingerprint) and maps layer ranges later, per
// session. Opening the path again at that point could map a different file than the one it
// identified, if the file was replaced meanwhile; opening /proc/self/fd/N cannot.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "pp/core/error.hpp"

namespace pp {

class HeldFile {
 public:
  explicit HeldFile(const std::string& path) : original_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw Error("cannot open '" + path + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      const int e = errno;
      ::close(fd_);
      throw Error("cannot stat '" + path + "': " + std::strerror(e));
    }
    dev_ = st.st_dev;
    ino_ = st.st_ino;
    path_ = "/proc/self/fd/" + std::to_string(fd_);
    if (::access(path_.c_str(), R_OK) != 0) path_ = original_;  // no /proc: the best there is
  }
  HeldFile(const HeldFile&) = delete;
  HeldFile& operator=(const HeldFile&) = delete;
  ~HeldFile() { ::close(fd_); }

  // What to open to reach the held file.
  const std::string& path() const { return path_; }
  // The path it was opened by.
  const std::string& original() const { return original_; }

  // True when the original path no longer names the held file (renamed over or removed).
  bool replaced() const {
    struct stat st {};
    return ::stat(original_.c_str(), &st) != 0 || st.st_dev != dev_ || st.st_ino != ino_;
  }

 private:
  std::string original_;
  std::string path_;
  int fd_ = -1;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

}  // namespace pp
