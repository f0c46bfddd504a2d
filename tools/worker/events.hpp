// pp_worker diagnostics: JSON event lines ({"event": kind, ...}, never a request_id) and the heartbeat.
#pragma once

#include "line_io.hpp"

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

namespace pp::worker {

using ordered_json = nlohmann::ordered_json;

// Resident set size of this process in MB (0 when /proc is unavailable).
inline double resident_mb() {
  std::ifstream statm("/proc/self/statm");
  uint64_t pages_total = 0, pages_resident = 0;
  if (!(statm >> pages_total >> pages_resident)) return 0.0;
  return double(pages_resident) * double(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

inline double unix_time_s() {
  using namespace std::chrono;
  return double(duration_cast<microseconds>(system_clock::now().time_since_epoch()).count()) / 1e6;
}

// Writes events to stderr, or to stdout (sharing the reply writer) with PP_WORKER_EVENTS=1.
// Every event starts with "event" and "ts" (unix seconds); emit() never throws.
class Events {
 public:
  explicit Events(LineWriter& out) : out_(out) {}

  void emit(const std::string& kind, const ordered_json& fields = ordered_json::object()) noexcept {
    try {
      ordered_json ev;
      ev["event"] = kind;
      ev["ts"] = unix_time_s();
      for (auto it = fields.begin(); it != fields.end(); ++it)
        if (it.key() != "request_id") ev[it.key()] = it.value();  // events never carry one
      out_.write(ev.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
    } catch (...) {
      // Diagnostics must not take the worker down; a closed event stream surfaces on the next reply.
    }
  }

 private:
  LineWriter& out_;
};

// What the heartbeat reports; the serving loop updates it.
struct ServeStats {
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> errors{0};
  std::atomic<bool> busy{false};
};

// Emits {"event":"heartbeat", ...} every `period_s` seconds until destroyed (period 0: never).
class Heartbeat {
 public:
  Heartbeat(Events& events, const ServeStats& stats, int64_t period_s)
      : events_(events), stats_(stats), period_(period_s), start_(std::chrono::steady_clock::now()) {
    if (period_s > 0) {
      // The thread inherits a mask with the stop signals blocked, so they reach the serving thread.
      sigset_t stop, old;
      sigemptyset(&stop);
      sigaddset(&stop, SIGTERM);
      sigaddset(&stop, SIGINT);
      ::pthread_sigmask(SIG_BLOCK, &stop, &old);
      thread_ = std::thread([this] { loop(); });
      ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    }
  }
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  ~Heartbeat() {
    {
      const std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    while (!cv_.wait_for(lock, period_, [this] { return done_; })) {
      const double uptime = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      events_.emit("heartbeat", {{"uptime_s", uptime},
                                 {"requests", stats_.requests.load()},
                                 {"errors", stats_.errors.load()},
                                 {"busy", stats_.busy.load()},
                                 {"resident_mb", resident_mb()}});
    }
  }

  Events& events_;
  const ServeStats& stats_;
  std::chrono::seconds period_;
  std::chrono::steady_clock::time_point start_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace pp::worker
