// An anonymous private memory region advised for transparent huge pages (RAII): resident weights, KV
// caches. Zero-filled, and pages are only backed once touched.
#pragma once

#include <pp/core/error.hpp>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <sys/mman.h>

namespace pp {

class AnonymousRegion {
 public:
  AnonymousRegion() = default;
  explicit AnonymousRegion(std::size_t bytes, const char* what = "resident weights") : size_(bytes) {
    if (bytes == 0) return;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw Error("cannot allocate " + std::to_string(bytes >> 20) + " MiB for " + what + ": " + std::strerror(errno));
    ::madvise(p, bytes, MADV_HUGEPAGE);  // best effort: THP may be off
    data_ = static_cast<uint8_t*>(p);
  }
  AnonymousRegion(const AnonymousRegion&) = delete;
  AnonymousRegion& operator=(const AnonymousRegion&) = delete;
  AnonymousRegion(AnonymousRegion&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  AnonymousRegion& operator=(AnonymousRegion&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~AnonymousRegion() { release(); }
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  void release() {
    if (data_) ::munmap(data_, size_);
    data_ = nullptr;
  }
  uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace pp
