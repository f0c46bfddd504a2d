// TCP sockets for the pipeline: an owning fd, listen/accept/connect, and exact reads/writes bounded by timeouts.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "pp/core/error.hpp"

namespace pp::net {

using Millis = std::chrono::milliseconds;
// A timeout that never expires (poll's -1).
inline constexpr Millis kNoTimeout = Millis::max();
using Clock = std::chrono::steady_clock;

// A point by which a whole operation must be done, whatever pace the peer keeps, and why (for the
// error). The default never passes. `why` is static text in which "{}" stands for the budget: the
// message is formatted only if the deadline passes, never on the way (one is made per frame part).
struct Deadline {
  Clock::time_point at = Clock::time_point::max();
  Millis budget{0};
  const char* why = "";

  // A deadline not started yet: `within` from when it starts.
  struct Budget {
    Millis within = kNoTimeout;
    const char* why = "";
  };

  static Deadline in(Millis budget, const char* why) {
    if (budget == kNoTimeout) return Deadline{};
    return Deadline{Clock::now() + budget, budget, why};
  }
  bool never() const { return at == Clock::time_point::max(); }
  // Time left, never negative; kNoTimeout when it never passes.
  Millis left() const {
    if (never()) return kNoTimeout;
    const auto d = std::chrono::duration_cast<Millis>(at - Clock::now());
    return d.count() > 0 ? d : Millis{0};
  }
  // The earlier of the two.
  Deadline min(const Deadline& o) const { return o.at < at ? o : *this; }
};

// Owns one file descriptor; closes it once.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Where a socket leads; every error message names it as host:port.
struct Peer {
  std::string host;
  uint16_t port = 0;
  std::string str() const { return host + ":" + std::to_string(port); }
};

struct Listener {
  Fd fd;
  Peer local;  // numeric bound address and the port actually bound (port 0 asks for an ephemeral one)
};

struct Accepted {
  Fd fd;
  Peer peer;
};

namespace detail {

inline std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (which may or may not be buf).
  return std::string(strerror_r(err, buf, sizeof buf));
}

inline NetError::Kind errno_kind(int err) {
  switch (err) {
    case ECONNRESET: return NetError::Kind::reset;
    case EPIPE: return NetError::Kind::closed;
    case ECONNREFUSED: return NetError::Kind::refused;
    case ETIMEDOUT: return NetError::Kind::timeout;
    default: return NetError::Kind::other;
  }
}

inline std::string errno_what(int err) {
  switch (err) {
    case ECONNRESET: return "connection reset by peer";
    case EPIPE: return "connection closed by peer (broken pipe)";
    case ECONNREFUSED: return "connection refused";
    default: return errno_text(err);
  }
}

inline std::string seconds_text(Millis t) {
  const long long ms = t.count();
  return std::to_string(ms / 1000) + "." + std::to_string((ms % 1000) / 100) + " s";
}

// A passed deadline's reason, its budget in place of "{}".
inline std::string deadline_text(const Deadline& d) {
  std::string s = d.why;
  if (const std::size_t at = s.find("{}"); at != std::string::npos) s.replace(at, 2, seconds_text(d.budget));
  return s;
}

inline int poll_ms(Millis remaining) {
  if (remaining == kNoTimeout) return -1;
  if (remaining.count() <= 0) return 0;
  return remaining.count() > INT32_MAX ? INT32_MAX : static_cast<int>(remaining.count());
}

inline void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw NetError(NetError::Kind::other, "fcntl(O_NONBLOCK): " + errno_text(errno));
  }
}

inline void set_nodelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Waits until fd is ready for `events` or `timeout` passes without it; retries EINTR with the
// time left. Returns false on timeout.
inline bool wait_ready(int fd, short events, Millis timeout) {
  using clock = std::chrono::steady_clock;
  const bool forever = timeout == kNoTimeout;
  const auto deadline = forever ? clock::time_point::max() : clock::now() + timeout;
  for (;;) {
    pollfd p{fd, events, 0};
    const Millis left = forever ? kNoTimeout
                                : std::chrono::duration_cast<Millis>(deadline - clock::now());
    const int r = ::poll(&p, 1, poll_ms(left));
    if (r > 0) return true;  // ready, or HUP/ERR: the following recv/send reports which
    if (r == 0) return false;
    if (errno != EINTR) throw NetError(NetError::Kind::other, "poll: " + errno_text(errno));
  }
}

inline sockaddr_in resolve_ipv4(const Peer& where) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(where.host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    throw NetError(NetError::Kind::other,
                   where.str() + ": cannot resolve host '" + where.host + "': " + gai_strerror(rc));
  }
  sockaddr_in addr{};
  std::memcpy(&addr, res->ai_addr, sizeof addr);
  ::freeaddrinfo(res);
  addr.sin_port = htons(where.port);
  return addr;
}

inline std::string numeric_host(const sockaddr_in& addr) {
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof buf);
  return buf;
}

// Reads into buf; `first_wait` bounds the wait for the first byte, `stall` every later wait for
// progress, and `by` the whole read; once the first byte is in, the rest must also arrive within
// `then` (when given) of it. A peer that trickles bytes cannot stretch the read past either point. Returns the byte
// count, which is short only when the peer closed before any byte and eof_ok is set.
inline std::size_t read_loop(const Fd& fd, std::span<uint8_t> buf, Millis first_wait, Millis stall,
                             const Deadline& by, const std::string& who, std::string_view what,
                             bool eof_ok, const Deadline::Budget* then = nullptr) {
  std::size_t got = 0;
  Deadline limit = by;
  const auto progress = [&] {
    return " while reading " + std::string(what) + " (" + std::to_string(got) + " of " +
           std::to_string(buf.size()) + " bytes)";
  };
  while (got < buf.size()) {
    const ssize_t r = ::recv(fd.get(), buf.data() + got, buf.size() - got, 0);
    if (r > 0) {
      if (got == 0 && then) limit = limit.min(Deadline::in(then->within, then->why));
      got += static_cast<std::size_t>(r);
      continue;
    }
    if (r == 0) {
      if (got == 0 && eof_ok) return 0;
      throw NetError(NetError::Kind::closed, who + ": connection closed" + progress());
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      const int err = errno;
      throw NetError(errno_kind(err), who + ": " + errno_what(err) + progress());
    }
    const Millis wait = got == 0 ? first_wait : stall;
    const Millis left = limit.left();
    if (left <= wait) {
      if (!wait_ready(fd.get(), POLLIN, left)) {
        throw NetError(NetError::Kind::timeout, who + ": timed out" + progress() + ": " + deadline_text(limit));
      }
    } else if (!wait_ready(fd.get(), POLLIN, wait)) {
      throw NetError(NetError::Kind::timeout,
                     who + ": timed out after " + seconds_text(wait) + " without data" + progress());
    }
  }
  return got;
}

}  // namespace detail

// True when host resolves to an IPv4 loopback address (127.0.0.0/8).
inline bool is_loopback_host(const std::string& host) {
  try {
    const sockaddr_in a = detail::resolve_ipv4(Peer{host, 0});
    return (ntohl(a.sin_addr.s_addr) >> 24) == 127;
  } catch (const NetError&) {
    return false;
  }
}

// Binds and listens on host:port (IPv4). Port 0 binds an ephemeral port, reported in `local`.
inline Listener listen_tcp(const std::string& host, uint16_t port, int backlog = SOMAXCONN) {
  const Peer where{host, port};
  sockaddr_in addr = detail::resolve_ipv4(where);
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw NetError(NetError::Kind::other, "socket: " + detail::errno_text(errno));
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    throw NetError(NetError::Kind::other, "bind " + where.str() + ": " + detail::errno_text(errno));
  }
  if (::listen(fd.get(), backlog) != 0) {
    throw NetError(NetError::Kind::other, "listen " + where.str() + ": " + detail::errno_text(errno));
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  return Listener{std::move(fd), Peer{detail::numeric_host(addr), ntohs(addr.sin_port)}};
}

// Accepts one connection, waiting at most `wait`; nullopt when none arrived (or a signal came).
// The accepted socket is non-blocking with TCP_NODELAY.
inline std::optional<Accepted> accept_tcp(const Fd& listener, Millis wait) {
  pollfd p{listener.get(), POLLIN, 0};
  const int r = ::poll(&p, 1, detail::poll_ms(wait));
  if (r <= 0) return std::nullopt;
  sockaddr_in addr{};
  socklen_t len = sizeof addr;
  Fd fd(::accept4(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len,
                  SOCK_NONBLOCK | SOCK_CLOEXEC));
  if (!fd.valid()) {
    // Out of descriptors or memory: the pending connection stays queued and poll() would report
    // it again at once, so back off instead of spinning. Other errors (the client gave up,
    // EINTR) are retried by the caller's next call.
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      ::poll(nullptr, 0, detail::poll_ms(std::min(wait, Millis{100})));
    }
    return std::nullopt;
  }
  detail::set_nodelay(fd.get());
  return Accepted{std::move(fd), Peer{detail::numeric_host(addr), ntohs(addr.sin_port)}};
}

// Connects to `peer` within `timeout`. `who` names it in errors ("worker 10.0.0.2:52100").
// The socket is non-blocking with TCP_NODELAY.
inline Fd connect_tcp(const Peer& peer, Millis timeout, const std::string& who) {
  const sockaddr_in addr = detail::resolve_ipv4(peer);
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) throw NetError(NetError::Kind::other, "socket: " + detail::errno_text(errno));
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno != EINPROGRESS) {
      const int err = errno;
      throw NetError(detail::errno_kind(err), who + ": connect: " + detail::errno_what(err));
    }
    if (!detail::wait_ready(fd.get(), POLLOUT, timeout)) {
      throw NetError(NetError::Kind::timeout,
                     who + ": connect timed out after " + detail::seconds_text(timeout));
    }
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) throw NetError(detail::errno_kind(err), who + ": connect: " + detail::errno_what(err));
  }
  detail::set_nodelay(fd.get());
  return fd;
}

// Fills buf completely or throws NetError (closed / reset / timeout) naming `who` and `what`.
// `timeout` bounds each wait for progress; `by`, when given, the whole read.
inline void read_exact(const Fd& fd, std::span<uint8_t> buf, Millis timeout, const std::string& who,
                       std::string_view what, const Deadline& by = {}) {
  detail::read_loop(fd, buf, timeout, timeout, by, who, what, false);
}

// As read_exact, but a peer that closes before sending any byte returns false (a clean end
// between frames). `first_wait` bounds the wait for the first byte (an idle connection); `then`
// (when given) the rest of the read, from that byte on.
inline bool read_exact_or_eof(const Fd& fd, std::span<uint8_t> buf, Millis first_wait, Millis timeout,
                              const std::string& who, std::string_view what, const Deadline& by = {},
                              const Deadline::Budget* then = nullptr) {
  return detail::read_loop(fd, buf, first_wait, timeout, by, who, what, true, then) == buf.size();
}

// Writes all of buf or throws NetError. Never raises SIGPIPE. `more` tells the kernel more data
// follows at once (MSG_MORE), so a header and its payload leave in one segment despite TCP_NODELAY.
inline void write_all(const Fd& fd, std::span<const uint8_t> buf, Millis timeout, const std::string& who,
                      std::string_view what, bool more = false) {
  std::size_t sent = 0;
  const int flags = MSG_NOSIGNAL | (more ? MSG_MORE : 0);
  while (sent < buf.size()) {
    const ssize_t r = ::send(fd.get(), buf.data() + sent, buf.size() - sent, flags);
    if (r >= 0) {
      sent += static_cast<std::size_t>(r);
      continue;
    }
    if (errno == EINTR) continue;
    const auto progress = [&] {
      return " while writing " + std::string(what) + " (" + std::to_string(sent) + " of " +
             std::to_string(buf.size()) + " bytes)";
    };
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      const int err = errno;
      throw NetError(detail::errno_kind(err), who + ": " + detail::errno_what(err) + progress());
    }
    if (!detail::wait_ready(fd.get(), POLLOUT, timeout)) {
      throw NetError(NetError::Kind::timeout, who + ": timed out after " +
                                                  detail::seconds_text(timeout) +
                                                  " (peer not reading)" + progress());
    }
  }
}

}  // namespace pp::net
