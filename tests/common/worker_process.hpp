// Test harness for pp_worker: one child process with stdin/stdout pipes and stderr captured, killed on destruction.
#pragma once

#include <nlohmann/json.hpp>

#include "node_process.hpp"
#include "timing.hpp"

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

namespace pp::test {

using WorkerEnv = std::map<std::string, std::string>;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// Seconds any single wait may take on a fast idle machine; every wait below scales its deadline to the host
// (timing.hpp), so these guard against hangs, not against a slow host.
inline constexpr double kTimeout = 5.0;

inline std::string worker_bin() {
  std::string bin;
  if (const char* b = std::getenv("PP_WORKER_BIN")) {
    bin = b;
  } else {
    const char* root = std::getenv("PP_BUILD_ROOT");
    bin = std::string(root ? root : ".") + "/tools/pp_worker";
  }
  if (::access(bin.c_str(), X_OK) != 0)
    throw std::runtime_error("pp_worker binary '" + bin + "' not found: set PP_WORKER_BIN (meson test does)");
  return bin;
}

inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// One pp_worker child: stdin/stdout pipes, stderr in a temp file, killed on destruction.
class Worker {
 public:
  explicit Worker(const WorkerEnv& env, const std::vector<std::string>& args = {}, const std::string& stdin_preload = "") {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe2");
    if (!stdin_preload.empty()) {
      if (::write(in[1], stdin_preload.data(), stdin_preload.size()) != ssize_t(stdin_preload.size()))
        throw std::runtime_error("preload");
      stdin_probe_ = ::dup(in[0]);  // lets the test see whether the child read its stdin
    }
    char tmpl[] = "/tmp/pp_worker_stderr_XXXXXX";
    err_fd_ = ::mkostemp(tmpl, O_CLOEXEC);
    ::unlink(tmpl);

    std::vector<std::string> env_strings;
    for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string bin = worker_bin();
    std::vector<std::string> argv_strings = {bin};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);

    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork");
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::dup2(err_fd_, 2);
      ::execve(bin.c_str(), argv.data(), envp.data());
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    in_ = in[1];
    out_ = out[0];
    ::fcntl(in_, F_SETFL, O_NONBLOCK);
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker() {
    if (!exited_) {
      ::kill(pid_, SIGKILL);
      int st;
      ::waitpid(pid_, &st, 0);
    }
    for (int fd : {in_, out_, err_fd_, stdin_probe_})
      if (fd >= 0) ::close(fd);
  }

  pid_t pid() const { return pid_; }

  // Writes everything, reading stdout meanwhile so a child blocked on its output cannot deadlock us.
  void send(const std::string& data) {
    size_t done = 0;
    const auto t0 = Clock::now();
    while (done < data.size()) {
      if (seconds_since(t0) > kTimeout * host_factor()) throw std::runtime_error("send timed out");
      pollfd fds[2] = {{in_, POLLOUT, 0}, {out_, POLLIN, 0}};
      ::poll(fds, 2, 100);
      if (fds[1].revents & (POLLIN | POLLHUP)) pump_stdout();
      if (fds[0].revents & (POLLERR | POLLHUP)) throw std::runtime_error("child closed stdin");
      if (fds[0].revents & POLLOUT) {
        const ssize_t w = ::write(in_, data.data() + done, data.size() - done);
        if (w > 0) done += size_t(w);
      }
    }
  }
  void send_line(const std::string& line) { send(line + "\n"); }
  void send_json(const json& j) { send_line(j.dump()); }

  void close_stdin() {
    if (in_ >= 0) ::close(in_);
    in_ = -1;
  }

  // Closes the read end of the child's stdout: its next write fails (EPIPE, or SIGPIPE if not ignored).
  void close_stdout() {
    if (out_ >= 0) ::close(out_);
    out_ = -1;
    eof_ = true;
  }

  // The next stdout line (without '\n'), or nullopt after `timeout` seconds (scaled) or at EOF.
  std::optional<std::string> line(double timeout = kTimeout) {
    const auto t0 = Clock::now();
    timeout *= host_factor();
    while (true) {
      const size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string l = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return l;
      }
      if (eof_) return std::nullopt;
      const double left = timeout - seconds_since(t0);
      if (left <= 0) return std::nullopt;
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, int(left * 1000) + 1) > 0) pump_stdout();
    }
  }

  // The next stdout line that is not an event, parsed.
  json reply(double timeout = kTimeout) {
    while (true) {
      const std::optional<std::string> l = line(timeout);
      if (!l) throw std::runtime_error("no reply within " + std::to_string(timeout) + " s; stderr: " + stderr_text());
      json j = json::parse(*l);
      if (!j.contains("event")) return j;
    }
  }

  json call(const json& request) {
    send_json(request);
    return reply();
  }

  json ready() {
    json r = reply();
    if (r.value("status", "") != "ready") throw std::runtime_error("not a ready line: " + r.dump());
    return r;
  }

  // Exit status (or 128 + signal), nullopt if still running after `timeout` seconds (scaled).
  std::optional<int> wait_exit(double timeout = kTimeout) {
    const auto t0 = Clock::now();
    timeout *= host_factor();
    while (true) {
      int st = 0;
      const pid_t r = ::waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      if (seconds_since(t0) > timeout) return std::nullopt;
      // Keep draining stdout so the child never blocks on a full pipe while we wait.
      pollfd p{out_, POLLIN, 0};
      if (!eof_ && ::poll(&p, 1, 5) > 0) pump_stdout();
      else std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  // Everything left on stdout until EOF, as lines.
  std::vector<std::string> rest_lines(double timeout = kTimeout) {
    std::vector<std::string> lines;
    while (auto l = line(timeout)) lines.push_back(*l);
    if (!buf_.empty()) lines.push_back(std::exchange(buf_, ""));
    return lines;
  }

  std::string stdout_so_far() {
    pollfd p{out_, POLLIN, 0};
    while (!eof_ && ::poll(&p, 1, 0) > 0) pump_stdout();
    return buf_;
  }

  std::string stderr_text() const {
    std::string s;
    char chunk[65536];
    off_t at = 0;
    ssize_t r;
    while ((r = ::pread(err_fd_, chunk, sizeof chunk, at)) > 0) {
      s.append(chunk, size_t(r));
      at += r;
    }
    return s;
  }

  // What is still unread in the child's stdin (needs stdin_preload).
  std::string unread_stdin() const {
    std::string s;
    ::fcntl(stdin_probe_, F_SETFL, O_NONBLOCK);
    char chunk[4096];
    ssize_t r;
    while ((r = ::read(stdin_probe_, chunk, sizeof chunk)) > 0) s.append(chunk, size_t(r));
    return s;
  }

  // Peak resident set of the live child in kB (VmHWM).
  long peak_rss_kb() const { return proc_status_kib(pid_, "VmHWM"); }

 private:
  void pump_stdout() {
    char chunk[1 << 16];
    const ssize_t r = ::read(out_, chunk, sizeof chunk);
    if (r > 0) buf_.append(chunk, size_t(r));
    if (r == 0) eof_ = true;
  }

  pid_t pid_ = -1;
  int in_ = -1, out_ = -1, err_fd_ = -1, stdin_probe_ = -1;
  std::string buf_;
  bool eof_ = false;
  bool exited_ = false;
};

}  // namespace pp::test
