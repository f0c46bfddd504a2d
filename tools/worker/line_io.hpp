// Line-framed stdio for pp_worker: chunked reads with a length limit, whole-line writes.
#pragma once

#include <pp/core/error.hpp>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include <poll.h>
#include <unistd.h>

namespace pp::worker {

// The peer closed our output (EPIPE) or the descriptor failed.
class OutputError : public Error {
 public:
  using Error::Error;
};

// Splits a descriptor into lines ('\n'-terminated; a last line without '\n' still counts).
// A line longer than max_line is consumed without being buffered and reported as too_long.
// Waiting for input also watches wake_fd (the signal self-pipe), so a signal ends a blocked read.
class LineReader {
 public:
  enum class Kind { line, too_long, eof, interrupted };
  struct Next {
    Kind kind;
    std::string_view line;  // Kind::line: valid until the next call
    size_t length = 0;      // Kind::too_long: bytes of the discarded line, without its '\n'
  };

  static constexpr size_t kChunk = size_t(1) << 20;  // bytes asked of each read(2)

  LineReader(int fd, size_t max_line, int wake_fd) : fd_(fd), wake_fd_(wake_fd), max_line_(max_line) {}

  size_t max_line() const { return max_line_; }

  Next next() {
    while (true) {
      if (draining_) {
        // (the buffer is allocated on the first read: no memchr on a null pointer, even for 0 bytes)
        const void* nl = end_ > begin_ ? std::memchr(buf_.get() + begin_, '\n', end_ - begin_) : nullptr;
        if (nl) {
          const size_t at = size_t(static_cast<const char*>(nl) - buf_.get());
          drained_ += at - begin_;
          begin_ = scan_ = at + 1;
          draining_ = false;
          return {Kind::too_long, {}, drained_};
        }
        drained_ += end_ - begin_;
        begin_ = end_ = scan_ = 0;
      } else {
        const void* nl = end_ > scan_ ? std::memchr(buf_.get() + scan_, '\n', end_ - scan_) : nullptr;
        if (nl) {
          const size_t at = size_t(static_cast<const char*>(nl) - buf_.get());
          const size_t len = at - begin_;
          if (len > max_line_) {  // found its end in the same chunk that crossed the limit
            begin_ = scan_ = at + 1;
            return {Kind::too_long, {}, len};
          }
          const std::string_view line(buf_.get() + begin_, len);
          begin_ = scan_ = at + 1;
          return {Kind::line, line, 0};
        }
        scan_ = end_;
        if (end_ - begin_ > max_line_) {
          draining_ = true;
          drained_ = 0;
          continue;
        }
      }
      if (eof_) {
        if (draining_) {
          draining_ = false;
          return {Kind::too_long, {}, drained_};
        }
        if (begin_ < end_) {
          const std::string_view line(buf_.get() + begin_, end_ - begin_);
          begin_ = scan_ = end_;
          return {Kind::line, line, 0};
        }
        return {Kind::eof, {}, 0};
      }
      if (!fill()) return {Kind::interrupted, {}, 0};
    }
  }

 private:
  // Reads one chunk (or sees EOF). False when the wake descriptor fired first.
  bool fill() {
    if (begin_ > 0) {  // keep the partial line at the front
      std::memmove(buf_.get(), buf_.get() + begin_, end_ - begin_);
      end_ -= begin_;
      scan_ -= begin_;
      begin_ = 0;
    }
    if (cap_ - end_ < kChunk) {
      size_t cap = cap_ ? cap_ * 2 : kChunk;
      while (cap - end_ < kChunk) cap *= 2;
      auto bigger = std::make_unique_for_overwrite<char[]>(cap);
      if (end_) std::memcpy(bigger.get(), buf_.get(), end_);
      buf_ = std::move(bigger);
      cap_ = cap;
    }
    while (true) {
      pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      const int n = ::poll(fds, wake_fd_ >= 0 ? 2 : 1, -1);
      if (n < 0) {
        if (errno == EINTR) continue;  // the handler also wrote to wake_fd: poll again to see it
        throw Error(std::string("poll on stdin failed: ") + std::strerror(errno));
      }
      if (wake_fd_ >= 0 && (fds[1].revents & POLLIN)) return false;
      if (fds[0].revents == 0) continue;
      const ssize_t r = ::read(fd_, buf_.get() + end_, cap_ - end_);
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        throw Error(std::string("read from stdin failed: ") + std::strerror(errno));
      }
      if (r == 0) eof_ = true;
      end_ += size_t(r);
      return true;
    }
  }

  int fd_;
  int wake_fd_;
  size_t max_line_;
  std::unique_ptr<char[]> buf_;
  size_t cap_ = 0;
  size_t begin_ = 0;  // start of the current (partial) line
  size_t end_ = 0;    // end of the bytes read
  size_t scan_ = 0;   // bytes before this hold no '\n'
  bool eof_ = false;
  bool draining_ = false;
  size_t drained_ = 0;
};

// Writes whole lines to a descriptor, one write(2) per line where the kernel allows; the mutex
// keeps replies and events (which a heartbeat thread also writes) from interleaving.
class LineWriter {
 public:
  explicit LineWriter(int fd) : fd_(fd) {}

  void write(std::string_view text) {
    const std::lock_guard lock(mutex_);
    const char* p = text.data();
    size_t left = text.size();
    while (left > 0) {
      const ssize_t w = ::write(fd_, p, left);
      if (w < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        throw OutputError("write to fd " + std::to_string(fd_) + " failed: " + std::strerror(errno));
      }
      p += w;
      left -= size_t(w);
    }
  }

 private:
  int fd_;
  std::mutex mutex_;
};

}  // namespace pp::worker
