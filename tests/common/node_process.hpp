// Test helpers for tools that run as processes: spawn with captured output, wait for events, raw loopback
// sockets. Every deadline a helper takes guards against a hang and is scaled to the host (timing.hpp): a
// test states how long an event may take on a fast idle machine, and a slower or busier host gets more.
#pragma once

#include "timing.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace pp::test {

using Millis = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

inline std::string read_text_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A child process with stdout/stderr captured to files; killed (by its pid) if still running at the end.
class Process {
 public:
  explicit Process(const std::vector<std::string>& argv) {
    char tmpl[] = "/tmp/pp_proc_test.XXXXXX";
    dir_ = mkdtemp(tmpl);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, (dir_ / "out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, (dir_ / "err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawnp(&pid_, args[0], &fa, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() {
    kill_hard();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  std::string out() const { return read_text_file(dir_ / "out"); }
  std::string err() const { return read_text_file(dir_ / "err"); }

  bool running() {
    if (exit_code_ || pid_ <= 0) return false;
    int st = 0;
    if (waitpid(pid_, &st, WNOHANG) == pid_) {
      exit_code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      return false;
    }
    return true;
  }

  // Exit status (128 + signal when killed), or nullopt if still running after `timeout` (scaled).
  std::optional<int> wait(Millis timeout) {
    const auto deadline = Clock::now() + slack(timeout);
    while (running()) {
      if (Clock::now() > deadline) return std::nullopt;
      std::this_thread::sleep_for(Millis{5});
    }
    return exit_code_;
  }

  bool wait_output(const std::string& needle, Millis timeout) {
    const auto deadline = Clock::now() + slack(timeout);
    for (;;) {
      if (out().find(needle) != std::string::npos) return true;
      if (!running() || Clock::now() > deadline) return out().find(needle) != std::string::npos;
      std::this_thread::sleep_for(Millis{5});
    }
  }

  bool wait_stderr(const std::string& needle, Millis timeout) {
    const auto deadline = Clock::now() + slack(timeout);
    while (err().find(needle) == std::string::npos) {
      if (Clock::now() > deadline) return false;
      std::this_thread::sleep_for(Millis{10});
    }
    return true;
  }

  void signal(int sig) {
    if (running()) ::kill(pid_, sig);
  }

  void kill_hard() {
    if (running()) {
      ::kill(pid_, SIGCONT);  // a stopped process must be able to die
      ::kill(pid_, SIGKILL);
      int st = 0;
      waitpid(pid_, &st, 0);
      exit_code_ = 128 + SIGKILL;
    }
  }

 private:
  std::filesystem::path dir_;
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
};

struct RunResult {
  int code = -1;
  std::string out;
  std::string err;
  double seconds = 0;
  bool timed_out = false;
};

// Runs to completion (killed after `timeout`, which the result records).
inline RunResult run_process(const std::vector<std::string>& argv, Millis timeout) {
  const auto t0 = Clock::now();
  Process p(argv);
  RunResult r;
  if (!p.started()) return r;
  const auto code = p.wait(timeout);
  if (!code) {
    r.timed_out = true;
    p.kill_hard();
  }
  r.code = code.value_or(-1);
  r.out = p.out();
  r.err = p.err();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

// A free loopback port (for processes that cannot bind port 0 themselves).
inline uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// A blocking loopback TCP client with deadlines on every read.
class RawSocket {
 public:
  explicit RawSocket(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    const int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    timeval tv{5, 0};  // no send may block a test for long
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  RawSocket(const RawSocket&) = delete;
  RawSocket& operator=(const RawSocket&) = delete;
  ~RawSocket() {
    if (fd_ >= 0) ::close(fd_);
  }

  bool connected() const { return connected_; }

  bool send(const std::vector<uint8_t>& b) {
    std::size_t sent = 0;
    while (sent < b.size()) {
      const ssize_t r = ::send(fd_, b.data() + sent, b.size() - sent, MSG_NOSIGNAL);
      if (r <= 0) return false;
      sent += static_cast<std::size_t>(r);
    }
    return true;
  }

  // Exactly n bytes within `timeout` (scaled), or nullopt (timeout, close or reset).
  std::optional<std::vector<uint8_t>> read_n(std::size_t n, Millis timeout) {
    std::vector<uint8_t> b(n);
    std::size_t got = 0;
    const auto deadline = Clock::now() + slack(timeout);
    while (got < n) {
      const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
      if (left <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      const ssize_t r = ::recv(fd_, b.data() + got, n - got, 0);
      if (r <= 0) return std::nullopt;
      got += static_cast<std::size_t>(r);
    }
    return b;
  }

  // True when the peer ends the connection (EOF or reset) within `timeout` (scaled); data is discarded.
  bool closed_by_peer(Millis timeout) {
    const auto deadline = Clock::now() + slack(timeout);
    std::array<uint8_t, 4096> sink;
    for (;;) {
      const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      const ssize_t r = ::recv(fd_, sink.data(), sink.size(), 0);
      if (r == 0 || (r < 0 && errno == ECONNRESET)) return true;
    }
  }

  // Closes with SO_LINGER 0, so the peer sees a reset rather than an orderly close.
  void reset() {
    linger l{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    ::close(fd_);
    fd_ = -1;
  }

  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // Half-closes: the peer reads end-of-stream, but this end can still read its replies.
  void shutdown_write() { ::shutdown(fd_, SHUT_WR); }

  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

}  // namespace pp::test
