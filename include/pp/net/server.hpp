// A bounded thread-per-connection TCP server: the accept loop every pp_node worker mode shares.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
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

struct ServerOptions {
  std::size_t max_connections = kDefaultMaxConnections;  // more are answered with ERR and closed
  Timeouts timeouts;
  std::string peer_role = "peer";  // how errors name the far end of an accepted connection
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
    if (running_ >= options_.max_connections) {
      const std::size_t n = running_;
      lock.unlock();
      refuse(std::move(conn), n);
      return;
    }
    const int raw = conn.fd.get();
    const std::string name = conn.peer.str();
    open_.insert(raw);
    ++running_;
    // Still under the lock: if the thread cannot start, the fd closes before stop() can see it.
    try {
      std::thread([this, c = std::move(conn)]() mutable { run(std::move(c)); }).detach();
    } catch (const std::system_error& e) {
      open_.erase(raw);  // the lambda holding the connection is gone, and with it the fd
      --running_;
      log_locked("cannot start a thread for " + name + ": " + e.what());
      finished_.notify_all();
    }
  }

  // Over the connection limit: say so in an ERR (the fresh socket's buffer takes it at once) and close.
  void refuse(Accepted conn, std::size_t open) {
    Channel ch(std::move(conn.fd), conn.peer, options_.peer_role, Timeouts{Millis{200}, Millis{0}});
    const std::string why = "worker busy: " + std::to_string(open) + " connections open (limit " +
                            std::to_string(options_.max_connections) + ")";
    try {
      ch.send_err(FrameHeader{}, why);
    } catch (const Error&) {
    }
    std::lock_guard lock(mutex_);
    log_locked(ch.who() + ": refused: " + why);
  }

  void run(Accepted conn) {
    const int raw = conn.fd.get();
    std::string failure;
    {
      Channel ch(std::move(conn.fd), conn.peer, options_.peer_role, options_.timeouts);
      try {
        handler_(ch);
      } catch (const std::bad_alloc&) {
        failure = ch.who() + ": out of memory; connection closed";
      } catch (const std::exception& e) {
        failure = ch.who() + ": " + e.what() + "; connection closed";
      }
      // Forget the fd before the Channel closes it, so stop() never shuts down a reused number.
      std::lock_guard lock(mutex_);
      open_.erase(raw);
    }
    std::lock_guard lock(mutex_);
    if (!failure.empty() && !stopping_.load()) log_locked(failure);
    --running_;  // the last access to *this from this thread
    finished_.notify_all();
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
  std::set<int> open_;  // fds of live connections, for stop()
  std::size_t running_ = 0;  // connection threads not yet finished
};

}  // namespace pp::net
