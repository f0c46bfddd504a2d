// A streamed (server-sent events) HTTP request on its own thread, for tests that act while it streams (kill a
// worker after a few events, say): the raw body as it comes, its `data: ` events counted, and a callback on
// the client's thread after every read that brought some.
#pragma once

#include "timing.hpp"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

namespace pp::test {

struct BackgroundStream {
  std::string raw;                   // the body so far; read it from other threads only after join()
  int status = 0;                    // the response's status, once its head came
  std::atomic<int> events{0};        // `data: ` lines seen so far
  std::atomic<bool> ended{false};    // the response ended (or the request failed)
  std::thread thread;

  BackgroundStream() = default;
  BackgroundStream(const BackgroundStream&) = delete;
  BackgroundStream& operator=(const BackgroundStream&) = delete;
  ~BackgroundStream() { join(); }

  // POSTs `body` (JSON) to http://127.0.0.1:`port``path`; `read_timeout` (scaled) bounds each wait for bytes.
  // `on_event` runs on the client's thread after every read that brought events.
  void start(uint16_t port, std::string path, std::string body, std::chrono::milliseconds read_timeout,
             std::function<void()> on_event = {}) {
    thread = std::thread([this, port, path = std::move(path), body = std::move(body), read_timeout,
                          on_event = std::move(on_event)] {
      httplib::Client c("127.0.0.1", port);
      c.set_read_timeout(std::chrono::duration_cast<std::chrono::seconds>(slack(read_timeout)).count());
      c.set_connection_timeout(std::chrono::duration_cast<std::chrono::seconds>(slack(std::chrono::seconds(5))).count());
      httplib::Request q;
      q.method = "POST";
      q.path = path;
      q.body = body;
      q.set_header("Content-Type", "application/json");
      q.response_handler = [&](const httplib::Response& r) {
        status = r.status;
        return true;
      };
      q.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
        const std::size_t from = raw.size() >= 5 ? raw.size() - 5 : 0;  // a "data: " split across reads
        raw.append(d, n);
        int k = 0;
        for (std::size_t at = raw.find("data: ", from); at != std::string::npos; at = raw.find("data: ", at + 1)) ++k;
        if (k) {
          events += k;
          if (on_event) on_event();
        }
        return true;
      };
      c.send(q);
      ended = true;
    });
  }

  void join() {
    if (thread.joinable()) thread.join();
  }

  // The stream reported an error (an OpenAI error object as an event). After join().
  bool failed() const { return raw.find("data: {\"error\"") != std::string::npos; }
};

}  // namespace pp::test
