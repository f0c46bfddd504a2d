// Test helpers for tools that run as processes: spawn with captured output, wait for events, pp_node workers
// and their reports, raw loopback sockets. Every deadline a helper takes guards against a hang and is scaled
// to the host (timing.hpp): a test states how long an event may take on a fast idle machine, and a slower or
// busier host gets more.
#pragma once

#include "timing.hpp"

#include <gtest/gtest.h>

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
#include <cerrno>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <optional>
#include <ranges>
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
// Its stdin is /dev/null, or with `Stdin::pipe` a pipe the test writes (write_stdin) and closes (close_stdin).
class Process {
 public:
  enum class Stdin { null, pipe };
  explicit Process(const std::vector<std::string>& argv, Stdin in = Stdin::null) {
    char tmpl[] = "/tmp/pp_proc_test.XXXXXX";
    dir_ = mkdtemp(tmpl);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    int pipe_fds[2] = {-1, -1};
    if (in == Stdin::pipe && ::pipe2(pipe_fds, O_CLOEXEC) == 0) {
      ::signal(SIGPIPE, SIG_IGN);  // a child that died makes write_stdin fail, not the test process die
      posix_spawn_file_actions_adddup2(&fa, pipe_fds[0], 0);
      stdin_ = pipe_fds[1];
    } else {
      posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    }
    posix_spawn_file_actions_addopen(&fa, 1, (dir_ / "out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, (dir_ / "err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawnp(&pid_, args[0], &fa, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    if (pipe_fds[0] >= 0) ::close(pipe_fds[0]);
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() {
    close_stdin();
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

  // True once stdout holds more than `size` bytes (something new after a point the test noted).
  bool wait_output_longer(std::size_t size, Millis timeout) {
    const auto deadline = Clock::now() + slack(timeout);
    for (;;) {
      if (out().size() > size) return true;
      if (!running() || Clock::now() > deadline) return out().size() > size;
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

  // Writes all of `text` to the child's stdin pipe; false when there is none or the child has closed it.
  bool write_stdin(const std::string& text) {
    std::size_t done = 0;
    while (stdin_ >= 0 && done < text.size()) {
      const ssize_t n = ::write(stdin_, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += std::size_t(n);
    }
    return stdin_ >= 0;
  }

  // The child reads the end of its input.
  void close_stdin() {
    if (stdin_ >= 0) ::close(stdin_);
    stdin_ = -1;
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
  int stdin_ = -1;  // the write end of the child's stdin pipe, or -1
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

// Runs to completion like run_process; a run killed after `timeout` (scaled) is also a test failure.
inline RunResult run_checked(const std::vector<std::string>& argv, Millis timeout) {
  RunResult r = run_process(argv, timeout);
  if (r.timed_out) ADD_FAILURE() << argv[0] << " did not finish within " << timeout.count() << " ms (scaled); killed";
  return r;
}

// A field of /proc/<pid>/status in kB ("VmRSS", "VmHWM"), or -1 when absent.
inline long proc_status_kib(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  return -1;
}

// pp_node's binary: $PP_NODE_BIN (set by meson), else "".
inline std::string node_bin() {
  const char* p = std::getenv("PP_NODE_BIN");
  return p ? p : "";
}

// pp_node's argv: node_bin() then `args`.
inline std::vector<std::string> node_argv(std::initializer_list<std::string> args) {
  std::vector<std::string> v{node_bin()};
  v.insert(v.end(), args);
  return v;
}

// A pp_node worker process on a loopback port (0: ephemeral, learnt from its listening line).
struct NodeWorker {
  std::unique_ptr<Process> proc;
  uint16_t port = 0;
  std::string addr() const { return "127.0.0.1:" + std::to_string(port); }
};

// Spawns `argv` and waits up to `timeout` (scaled) for its listening line, which `line` (a regex whose group 1
// is the port) must match; nullopt and a test failure if it does not come.
inline std::optional<NodeWorker> start_listening(const std::vector<std::string>& argv, Millis timeout,
                                                 const std::string& line) {
  NodeWorker w{std::make_unique<Process>(argv), 0};
  if (!w.proc->started() || !w.proc->wait_output("  (Ctrl-C to stop)", timeout)) {
    ADD_FAILURE() << "worker did not start; stdout: " << w.proc->out() << " stderr: " << w.proc->err();
    return std::nullopt;
  }
  std::smatch m;
  const std::string out = w.proc->out();
  if (!std::regex_search(out, m, std::regex(line))) {
    ADD_FAILURE() << "no listening line in: " << out;
    return std::nullopt;
  }
  w.port = static_cast<uint16_t>(std::stoi(m[1]));
  return w;
}

// `pp_node --worker --model model` on 127.0.0.1:`port` (0: ephemeral; a fixed one lets a test restart a
// killed worker where its chain expects it), one thread, then `extra`.
inline std::optional<NodeWorker> start_node_worker(const std::string& model, uint16_t port,
                                                   const std::vector<std::string>& extra = {},
                                                   Millis timeout = Millis{10000}) {
  std::vector<std::string> argv = {node_bin(), "--worker", "--model", model, "--host", "127.0.0.1",
                                   "--port", std::to_string(port), "--threads", "1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return start_listening(argv, timeout, R"(listening on 127\.0\.0\.1:(\d+))");
}

// "addr,addr,...": the --coordinator chain of workers.
inline std::string chain_of(const std::vector<const NodeWorker*>& ws) {
  std::string s;
  for (const NodeWorker* w : ws) {
    if (!s.empty()) s += ',';
    s += w->addr();
  }
  return s;
}
template <class R>  // a range of NodeWorker (a template: {&w1, &w2} must not read as an iterator pair)
  requires std::same_as<std::ranges::range_value_t<R>, NodeWorker>
std::string chain_of(const R& ws) {
  std::vector<const NodeWorker*> p;
  for (const NodeWorker& w : ws) p.push_back(&w);
  return chain_of(p);
}

// A coordinator's (or --selftest's) report of a passed run: exit 0, its round-trip line for `tokens` tokens
// and `verified` of them byte-identical.
inline void expect_passed(const RunResult& r, std::size_t tokens, std::size_t verified) {
  static const std::regex round_trip(
      R"((\d+) tokens  round-trip ms: min \d+\.\d  p50 \d+\.\d  p99 \d+\.\d  max \d+\.\d\n)");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, round_trip)) << r.out << r.err;
  EXPECT_EQ(m[1], std::to_string(tokens));
  const std::string passed = "byte-identity: " + std::to_string(verified) + "/" + std::to_string(verified) +
                             " IDENTICAL  == pipeline split PASSED ==\n";
  EXPECT_NE(r.out.find(passed), std::string::npos) << r.out;
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

// Exactly n bytes from a raw fd within `timeout` (scaled), or nullopt (timeout, close or reset).
inline std::optional<std::vector<uint8_t>> read_exact(int fd, std::size_t n, Millis timeout) {
  std::vector<uint8_t> b(n);
  std::size_t got = 0;
  const auto deadline = Clock::now() + slack(timeout);
  while (got < n) {
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
    if (left <= 0) return std::nullopt;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t r = ::recv(fd, b.data() + got, n - got, 0);
    if (r <= 0) return std::nullopt;
    got += static_cast<std::size_t>(r);
  }
  return b;
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
  std::optional<std::vector<uint8_t>> read_n(std::size_t n, Millis timeout) { return read_exact(fd_, n, timeout); }

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
