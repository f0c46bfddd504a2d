// A bounded thread-per-connection TCP server: the accept loop every pp_node worker mode shares.
//
// A connection is *pending* until its handler calls Channel::mark_trusted() (the peer authenticated, or
// sent a well-formed first frame where no key is required). Pending connections are few and short-lived
// by design: at most kMaxPendingPerHost from one address and kMaxPending in all; a newer one displaces
// the oldest (closing it), so connections that trickle bytes or sit idle cannot keep a key holder out:
// its connection is the newest, and authenticates in one round trip. Handlers bound how long a pending
// connection may take (ModelWorker: the whole key exchange within kAuthBudget).
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "pp/core/error.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/socket.hpp"

namespace pp::net {

inline constexpr std::size_t kDefaultMaxConnections = 256;
inline constexpr std::size_t kMaxPendingPerHost = 16;  // unproven connections from one address
inline constexpr std::size_t kMaxPending = 64;         // unproven connections in all

struct ServerOptions {
  std::size_t max_connections = kDefaultMaxConnections;  // more are answered with ERR and closed
  Timeouts timeouts;
  std::string peer_role = "peer";  // how errors name the far end of an accepted connection
  // Answers a connection refused for being over max_connections, in the protocol the server speaks
  // (best effort, short timeout). Empty: a version-1 ERR.
  std::function<void(Channel&, const std::string& why)> refuse;
};

// Accepts connections and runs `handler` on each in its own thread until the handler returns or
// throws. A handler serves one connection (one session); what it throws is logged with the peer's
// name and ends that connection only.
class Server {
 public:
  using Handler = std::function<void(Channel&)>;
  using Log = std::function<void(const std::string&)>;  // called under the server's lock

  Server(Listener listener, ServerOptions options, Handler handler, Log log)
      : listener_(std::move(listener)), options_(std::move(options)), handler_(std::move(handler)),
        log_(std::move(log)) {}
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  ~Server() {
    stop();
    drain();
  }

  const Peer& local() const { return listener_.local; }

  std::size_t active_connections() const {
    std::lock_guard lock(mutex_);
    return running_;
  }

  // Serves until stop() is called or *external_stop becomes true (a flag a signal handler may
  // set), then ends every open connection and waits for their threads.
  void serve(const std::atomic<bool>* external_stop = nullptr) {
    constexpr Millis kStopPoll{100};
    while (!stopping_.load() && !(external_stop && external_stop->load())) {
      auto conn = accept_tcp(listener_.fd, kStopPoll);
      if (conn) admit(std::move(*conn));
      std::lock_guard lock(mutex_);
      flush_suppressed_locked();
    }
    stop();
    drain();
  }

  // Thread-safe: ends the accept loop and wakes every connection blocked on I/O.
  void stop() {
    stopping_.store(true);
    std::lock_guard lock(mutex_);
    for (int fd : open_) ::shutdown(fd, SHUT_RDWR);
  }

 private:
  void admit(Accepted conn) {
    std::unique_lock lock(mutex_);
    make_room_for_pending(conn.peer.host);
    if (running_ >= options_.max_connections) {
      const std::size_t n = running_;
      lock.unlock();
      refuse(std::move(conn), n);
      return;
    }
    const int raw = conn.fd.get();
    const std::string name = conn.peer.str();
    open_.insert(raw);
    pending_.push_back(Pending{raw, conn.peer.host});
    ++pending_per_host_[conn.peer.host];
    ++running_;
    // Still under the lock: if the thread cannot start, the fd closes before stop() can see it.
    try {
      std::thread([this, c = std::move(conn)]() mutable { run(std::move(c)); }).detach();
    } catch (const std::system_error& e) {
      open_.erase(raw);  // the lambda holding the connection is gone, and with it the fd
      forget_pending(raw);
      --running_;
      log_locked("cannot start a thread for " + name + ": " + e.what());
      finished_.notify_all();
    }
  }

  // Under the lock, before admitting a connection from `host`: when that host already has
  // kMaxPendingPerHost unproven connections, or all hosts together kMaxPending, closes the oldest such
  // (of that host first). Its thread sees the shutdown at its next read and ends.
  void make_room_for_pending(const std::string& host) {
    auto evict = [&](std::list<Pending>::iterator it) {
      ::shutdown(it->fd, SHUT_RDWR);
      evicted_.insert(it->fd);
      if (--pending_per_host_[it->host] == 0) pending_per_host_.erase(it->host);
      pending_.erase(it);
    };
    const auto per = pending_per_host_.find(host);
    if (per != pending_per_host_.end() && per->second >= kMaxPendingPerHost) {
      for (auto it = pending_.begin(); it != pending_.end(); ++it)
        if (it->host == host) return evict(it);
    }
    if (pending_.size() >= kMaxPending) evict(pending_.begin());
  }

  void forget_pending(int fd) {
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->fd != fd) continue;
      if (--pending_per_host_[it->host] == 0) pending_per_host_.erase(it->host);
      pending_.erase(it);
      return;
    }
  }

  // Over the connection limit: say so in an ERR (the fresh socket's buffer takes it at once) and close.
  void refuse(Accepted conn, std::size_t open) {
    Channel ch(std::move(conn.fd), conn.peer, options_.peer_role, Timeouts{Millis{200}, Millis{0}});
    const std::string why = "worker busy: " + std::to_string(open) + " connections open (limit " +
                            std::to_string(options_.max_connections) + ")";
    try {
      if (options_.refuse)
        options_.refuse(ch, why);
      else
        ch.send_err(FrameHeader{}, why);
    } catch (const Error&) {
    }
    std::lock_guard lock(mutex_);
    note_failure(ch.who(), "refused: " + why);
  }

  void run(Accepted conn) {
    const int raw = conn.fd.get();
    std::string failure;
    std::string who;
    {
      Channel ch(std::move(conn.fd), conn.peer, options_.peer_role, options_.timeouts);
      who = ch.who();
      ch.on_trusted([this, raw] {
        std::lock_guard lock(mutex_);
        forget_pending(raw);
      });
      try {
        handler_(ch);
      } catch (const std::bad_alloc&) {
        failure = "out of memory; connection closed";
      } catch (const std::exception& e) {
        failure = std::string(e.what()) + "; connection closed";
      }
      // Forget the fd before the Channel closes it, so stop() never shuts down a reused number.
      std::lock_guard lock(mutex_);
      open_.erase(raw);
      forget_pending(raw);
      if (evicted_.erase(raw)) failure = "closed to make room: newer unauthenticated connections arrived (at most " +
                                         std::to_string(kMaxPendingPerHost) + " per address, " +
                                         std::to_string(kMaxPending) + " in all)";
    }
    std::lock_guard lock(mutex_);
    if (!failure.empty() && !stopping_.load()) note_failure(who, failure);
    --running_;  // the last access to *this from this thread
    finished_.notify_all();
  }

  // Under the lock. A failed or refused connection is logged, but at most kLogBurst lines per
  // kLogWindow: past that, one line per window counts what was not shown (a flood of bad
  // connections cannot flood the log).
  static constexpr std::size_t kLogBurst = 10;
  static constexpr auto kLogWindow = std::chrono::seconds(1);

  void flush_suppressed_locked() {
    const auto now = Clock::now();
    if (now - window_start_ < kLogWindow) return;
    if (suppressed_ > 0)
      log_locked(std::to_string(suppressed_) + " more failed or refused connections not shown (last: " +
                 last_suppressed_ + ")");
    window_start_ = now;
    logged_in_window_ = 0;
    suppressed_ = 0;
  }

  void note_failure(const std::string& who, const std::string& what) {
    flush_suppressed_locked();
    if (logged_in_window_ < kLogBurst) {
      ++logged_in_window_;
      log_locked(who + ": " + what);
    } else {
      ++suppressed_;
      last_suppressed_ = who + ": " + what;
    }
  }

  void drain() {
    std::unique_lock lock(mutex_);
    finished_.wait(lock, [this] { return running_ == 0; });
  }

  void log_locked(const std::string& line) {
    if (log_) log_(line);
  }

  Listener listener_;
  ServerOptions options_;
  Handler handler_;
  Log log_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mutex_;
  std::condition_variable finished_;
  struct Pending {
    int fd;
    std::string host;
  };
  std::set<int> open_;  // fds of live connections, for stop()
  std::list<Pending> pending_;  // connections not yet trusted, oldest first
  std::map<std::string, std::size_t> pending_per_host_;
  std::set<int> evicted_;  // pending connections closed to make room, until their thread ends
  std::size_t running_ = 0;  // connection threads not yet finished
  Clock::time_point window_start_{};
  std::size_t logged_in_window_ = 0;
  std::size_t suppressed_ = 0;
  std::string last_suppressed_;
};

}  // namespace pp::net
