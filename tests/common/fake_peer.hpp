// A listening loopback socket that plays a misbehaving peer, for the coordinator-side fault tests:
// `behaviour` runs on each accepted connection (up to `connections` of them, one after the other, with
// its index), which is then held open until the peer is destroyed, so the client sees only what the
// behaviour did.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "timing.hpp"

namespace pp::test {

class FakePeer {
 public:
  explicit FakePeer(std::function<void(int)> behaviour)
      : FakePeer([b = std::move(behaviour)](int fd, int) { b(fd); }, 1) {}
  FakePeer(std::function<void(int, int)> behaviour, int connections) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(fd_, 16);
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this, connections, behaviour = std::move(behaviour)] {
      std::vector<int> open;
      for (int i = 0; i < connections && !done_.load(); ++i) {
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, int(slack(std::chrono::seconds(10)).count())) <= 0) break;
        const int conn = ::accept(fd_, nullptr, nullptr);
        if (conn < 0) break;
        open.push_back(conn);
        behaviour(conn, i);
      }
      while (!done_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      for (int conn : open) ::close(conn);
    });
  }
  FakePeer(const FakePeer&) = delete;
  FakePeer& operator=(const FakePeer&) = delete;
  ~FakePeer() {
    done_.store(true);
    thread_.join();
    ::close(fd_);
  }
  uint16_t port() const { return port_; }
  std::string addr() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// Waits for readable data on a raw fd for up to `timeout` (scaled): false on timeout.
inline bool wait_readable(int fd, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, int(slack(timeout).count())) > 0;
}

}  // namespace pp::test
