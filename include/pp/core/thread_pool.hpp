// A persistent pool of worker threads running one parallel loop at a time, with no allocation per call.
//
// Work is split statically into contiguous chunks (parallel_for), or claimed item by item
// (parallel_for_claimed, for items that are independent); either way which thread computes an item never
// changes the item's result: kernels compute each output element the same way whatever the thread count.
//
// A decode step is ~130 short loops back to back. Waking a blocked thread costs tens of microseconds on
// a VM (the idle vCPU has to be kicked), so a worker that has finished a loop, and a caller waiting for
// the workers, first watch for the next event for up to kSpin before blocking on a condition variable.
// They yield between looks: on an idle core that returns at once, and on an oversubscribed one the
// threads with work run first (a pause-spin there made small loops ~8x slower).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pp {

class ThreadPool {
 public:
  // n_threads counts the calling thread; 0 means the hardware concurrency.
  explicit ThreadPool(unsigned n_threads = 0) {
    n_threads = resolve(n_threads);
    n_ = n_threads;
    for (unsigned t = 1; t < n_; ++t) workers_.emplace_back([this, t] { loop(t); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }

  unsigned size() const { return n_; }
  // The threads a pool asked for `n_threads` has.
  static unsigned resolve(unsigned n_threads) {
    return n_threads ? n_threads : std::max(1u, std::thread::hardware_concurrency());
  }

  // Calls fn(begin, end, t) over [0, n) split into size() contiguous chunks, t being the chunk (thread)
  // index in [0, size()); returns when all are done.
  template <class Fn>
  void parallel_for(std::size_t n, Fn&& fn) {
    if (n == 0) return;
    if (n_ == 1 || n == 1) {
      fn(std::size_t(0), n, 0u);
      return;
    }
    std::lock_guard call(call_mu_);  // one loop at a time per pool
    auto body = [&](unsigned t) {
      const std::size_t b = n * t / n_, e = n * (t + 1) / n_;
      if (b < e) fn(b, e, t);
    };
    using Body = decltype(body);
    {
      std::lock_guard lk(mu_);
      ctx_ = &body;
      call_ = [](void* c, unsigned t) { (*static_cast<Body*>(c))(t); };
      pending_.store(n_ - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    body(0);
    if (spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; })) return;
    std::unique_lock lk(mu_);
    done_cv_.wait(lk, [&] { return pending_.load(std::memory_order_acquire) == 0; });
  }

  // Calls fn(i, t) for every i in [0, n), each thread (t) claiming the next item as it finishes one: a
  // core that runs slower for a while (a busy SMT sibling or neighbour on the host, an efficiency core, a
  // thread of the server beside it) takes fewer items instead of holding up the loop, as a static split
  // would. Only for items whose results do not depend on the thread or the order (a matmul's row blocks).
  template <class Fn>
  void parallel_for_claimed(std::size_t n, Fn&& fn) {
    if (n_ == 1 || n <= 1) {
      for (std::size_t i = 0; i < n; ++i) fn(i, 0u);
      return;
    }
    std::atomic<std::size_t> next{0};
    parallel_for(n_, [&](std::size_t, std::size_t, unsigned t) {
      for (std::size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i, t);
    });
  }

 private:
  static constexpr std::chrono::microseconds kSpin{50};

  // Polls ready() for up to kSpin, yielding between polls; whether it became true.
  template <class Ready>
  static bool spin_until(Ready&& ready) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (unsigned i = 1;; ++i) {
      if (ready()) return true;
      std::this_thread::yield();  // returns at once on an idle core; else lets the runnable threads go first
      if (i % 16 == 0 && std::chrono::steady_clock::now() > until) return false;
    }
  }

  void loop(unsigned t) {
    uint64_t seen = 0;
    for (;;) {
      void (*call)(void*, unsigned);
      void* ctx;
      if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
      // call_ / ctx_ / stop_ were written before the release increment this acquire load saw.
      seen = generation_.load(std::memory_order_acquire);
      if (stop_) return;
      call = call_;
      ctx = ctx_;
      call(ctx, t);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        { std::lock_guard lk(mu_); }  // the caller is either spinning or waits under mu_: no lost wake-up
        done_cv_.notify_one();
      }
    }
  }

  unsigned n_ = 1;
  std::vector<std::thread> workers_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  void (*call_)(void*, unsigned) = nullptr;  // the current loop body, type-erased without allocation
  void* ctx_ = nullptr;
  std::atomic<unsigned> pending_{0};
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
};

}  // namespace pp
