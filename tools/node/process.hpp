// What every pp_node mode shares with the process: exit statuses, usage errors, the stop flag set by SIGINT/SIGTERM, the worker log.
#pragma once

#include <signal.h>

#include "common/exit_status.hpp"

#include <atomic>
#include <iostream>
#include <mutex>
#include <string>

namespace pp::node {

// pp_node's names for the statuses every tool shares (tools/common/exit_status.hpp).
inline constexpr int kExitOk = tools::kExitOk;
inline constexpr int kExitMismatch = tools::kExitFailed;  // byte-identity failed (the prototype's status)
inline constexpr int kExitUsage = tools::kExitUsage;
inline constexpr int kExitFailure = tools::kExitPeer;     // a peer died, stalled, refused or sent garbage

// A command line that cannot run; pp_node prints it and exits 2.
struct UsageError {
  std::string message;
};

// Set by SIGINT/SIGTERM; accept loops and generations poll it. The terminal chat takes it back (sets it
// to false) for "stop this reply"; g_terminate_requested, set by SIGTERM alone, tells it to end.
inline std::atomic<bool> g_stop_requested{false};
inline std::atomic<bool> g_terminate_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free);
// C++ linkage on purpose: a C-linkage name has no namespace, so in a dispatch build every kernel target's
// copy would share one handler, setting the lowest copy's flag (tools/dispatch/isolate.py refuses such a
// symbol). GCC and clang give both linkages the same calling convention.
inline void on_stop_signal(int sig) {
  if (sig == SIGTERM) g_terminate_requested.store(true);
  g_stop_requested.store(true);
}

inline void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: poll() returns EINTR and the loop sees the flag at once
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

// Called from every connection thread (and several workers in a self-test): one line at a time.
inline void worker_log(const std::string& line) {
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  std::cerr << "pp_node worker: " << line << std::endl;
}

}  // namespace pp::node
