// SIGTERM/SIGINT -> "stop after the request in flight": a flag plus a self-pipe that wakes poll(2).
#pragma once

#include <pp/core/error.hpp>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <string>

#include <fcntl.h>
#include <unistd.h>

namespace pp::worker {

namespace detail {
inline std::atomic<int> g_stop_signal{0};
inline int g_wake_write_fd = -1;
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

inline void on_stop_signal(int sig) {
  const int saved = errno;
  g_stop_signal.store(sig, std::memory_order_relaxed);
  const char byte = 1;
  [[maybe_unused]] const ssize_t ignored = ::write(g_wake_write_fd, &byte, 1);  // non-blocking; full is fine
  errno = saved;
}
}  // namespace detail

// Installs the handlers (without SA_RESTART, so blocking calls return EINTR) and ignores SIGPIPE,
// so a closed stdout is an EPIPE write error rather than a silent death. Returns the descriptor
// that becomes readable once a stop signal has arrived.
inline int install_stop_signals() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0)
    throw Error(std::string("cannot create the signal pipe: ") + std::strerror(errno));
  detail::g_wake_write_fd = fds[1];
  struct sigaction sa {};
  sa.sa_handler = detail::on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;
  for (int sig : {SIGTERM, SIGINT})
    if (::sigaction(sig, &sa, nullptr) != 0)
      throw Error(std::string("cannot install a signal handler: ") + std::strerror(errno));
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  ::sigaction(SIGPIPE, &ign, nullptr);
  return fds[0];
}

inline int stop_signal() { return detail::g_stop_signal.load(std::memory_order_relaxed); }
inline bool stop_requested() { return stop_signal() != 0; }

}  // namespace pp::worker
