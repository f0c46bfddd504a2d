// Read-only memory mapping of a whole file (RAII); the GGUF parser works on its byte span.
#pragma once

#include <pp/core/error.hpp>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace pp {

class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error("cannot open '" + path + "': " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw Error("cannot stat '" + path + "': " + std::strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw Error("'" + path + "' is not a regular file");
    }
    size_ = std::size_t(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        throw Error("cannot map '" + path + "': " + std::strerror(e));
      }
      data_ = static_cast<const uint8_t*>(p);
      // Pages are faulted in only where a stage reads: do not read ahead the whole file.
      ::madvise(const_cast<uint8_t*>(data_), size_, MADV_RANDOM);
    }
    ::close(fd);  // the mapping keeps the file alive, even if it is renamed over
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& o) noexcept
      : path_(std::move(o.path_)), data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  MappedFile& operator=(MappedFile&& o) noexcept {
    if (this != &o) {
      unmap();
      path_ = std::move(o.path_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~MappedFile() { unmap(); }

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }
  std::size_t size() const { return size_; }

  // Faults in [p, p + n) ahead of use (a stage's own tensors), leaving the rest unread.
  void prefetch(std::span<const uint8_t> range) const {
    if (range.empty()) return;
    const long page = ::sysconf(_SC_PAGESIZE);
    auto begin = reinterpret_cast<uintptr_t>(range.data()) / page * page;
    auto end = reinterpret_cast<uintptr_t>(range.data() + range.size());
    ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_WILLNEED);
  }

  // Drops this process's view of the whole pages inside [p, p + n) (a tensor copied elsewhere): they stop
  // counting in its RSS; the page cache keeps them for other readers, and reading them again faults them
  // back in from the file.
  void release(std::span<const uint8_t> range) const {
    if (range.empty()) return;
    const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(range.data()) + page - 1) / page * page;
    const uintptr_t end = reinterpret_cast<uintptr_t>(range.data() + range.size()) / page * page;
    if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }

 private:
  void unmap() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    data_ = nullptr;
  }
  std::string path_;
  const uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace pp
