// An anonymous private memory region (RAII), advised for transparent huge pages unless asked not to:
// resident weights, KV caches, scratch. Zero-filled, and pages are only backed once touched.
#pragma once

#include <pp/core/error.hpp>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>

#include <sys/mman.h>

namespace pp {

class AnonymousRegion {
 public:
  AnonymousRegion() = default;
  // huge: asked for (weights: read whole every step); small: refused (KV caches: a session's first rows
  // write into every layer's keys, and a fresh huge page is zeroed and backed 2 MiB at a time, which on
  // a VM host cost a new session ~0.3 s); system: as the kernel's THP setting says (scratch).
  enum class Pages { huge, small, system };
  explicit AnonymousRegion(std::size_t bytes, const char* what = "resident weights", Pages pages = Pages::huge)
      : size_(bytes) {
    if (bytes == 0) return;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw Error("cannot allocate " + std::to_string(bytes >> 20) + " MiB for " + what + ": " + std::strerror(errno));
    if (pages != Pages::system) ::madvise(p, bytes, pages == Pages::huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);  // best effort
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

// n zero-initialised T whose pages are backed on first touch, in 4 KiB steps: buffers sized for the
// largest request that cost memory only for the part a request uses.
template <class T>
class LazyArray {
 public:
  LazyArray() = default;
  explicit LazyArray(std::size_t n, const char* what = "scratch") : region_(n * sizeof(T), what, AnonymousRegion::Pages::system), n_(n) {}
  T* data() { return reinterpret_cast<T*>(region_.data()); }
  const T* data() const { return reinterpret_cast<const T*>(region_.data()); }
  std::size_t size() const { return n_; }
  T& operator[](std::size_t i) { return data()[i]; }
  const T& operator[](std::size_t i) const { return data()[i]; }
  std::span<T> span() { return {data(), n_}; }
  std::span<const T> span() const { return {data(), n_}; }

 private:
  AnonymousRegion region_;
  std::size_t n_ = 0;
};

}  // namespace pp
