// Where the terminal chat's lines come from: one line at a time after a prompt, told apart from an interrupt (the stop flag) and the end of input.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <ostream>
#include <string>

namespace pp::node {

struct InputEvent {
  enum Kind { line, interrupt, eof };
  Kind kind = eof;
  std::string text;  // line: the line without its newline; interrupt: what had been typed (dropped)
};

// A source of the chat's lines. read() shows the prompt, then waits for a line, the end of input, or *stop
// becoming true (a signal): it leaves the flag set; the caller decides what an interrupt means.
class LineInput {
 public:
  virtual ~LineInput() = default;
  virtual InputEvent read(const std::string& prompt) = 0;
  virtual bool editing() const { return false; }  // line editing and history (a terminal)
};

// Plain lines from a file descriptor (a pipe, a file, a terminal without line editing): the prompt is written
// to `out`. Reads with poll() so a signal (or the flag, checked every 100 ms) interrupts the wait at once.
class FdLineInput final : public LineInput {
 public:
  FdLineInput(int fd, std::ostream& out, const std::atomic<bool>* stop) : fd_(fd), out_(out), stop_(stop) {}

  InputEvent read(const std::string& prompt) override {
    out_ << prompt << std::flush;
    for (;;) {
      if (const std::size_t nl = buf_.find('\n'); nl != std::string::npos) {
        InputEvent e{InputEvent::line, buf_.substr(0, nl)};
        buf_.erase(0, nl + 1);
        if (!e.text.empty() && e.text.back() == '\r') e.text.pop_back();
        return e;
      }
      if (eof_) {  // a last line without its newline, then the end
        InputEvent e{buf_.empty() ? InputEvent::eof : InputEvent::line, std::move(buf_)};
        buf_.clear();
        return e;
      }
      if (stop_ && stop_->load()) {
        InputEvent e{InputEvent::interrupt, std::move(buf_)};
        buf_.clear();
        return e;
      }
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;  // EINTR (a signal) or the flag's period: look at the flag
      char chunk[4096];
      const ssize_t n = ::read(fd_, chunk, sizeof chunk);
      if (n > 0) buf_.append(chunk, std::size_t(n));
      else if (n == 0 || errno != EINTR) eof_ = true;  // a read error ends the input like EOF
    }
  }

 private:
  int fd_;
  std::ostream& out_;
  const std::atomic<bool>* stop_;
  std::string buf_;  // read, not yet returned
  bool eof_ = false;
};

}  // namespace pp::node
