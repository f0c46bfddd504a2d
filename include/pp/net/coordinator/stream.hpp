// One generation as the coordinator's caller sees it: what it asks for (GenParams) and the queue its output arrives in (GenStream).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "pp/net/sha256.hpp"
#include "pp/text/sampler.hpp"

namespace pp::net {

// What one generation asks for.
struct GenParams {
  SamplingParams sampling;
  uint32_t max_tokens = 16;
  std::vector<std::string> stop;  // cut the text before the first of these
  bool ignore_eos = false;
  // The first `digest_tokens` generated tokens come with the SHA-256 of the f32 logits they were sampled
  // from, the first `logits_tokens` with the logits themselves (verification, --dump-digests, --logits-out).
  std::size_t digest_tokens = 0;
  std::size_t logits_tokens = 0;
};

enum class Finish { none, stop, length, cancelled, error };

inline const char* finish_name(Finish f) {
  switch (f) {
    case Finish::stop: return "stop";
    case Finish::length: return "length";
    case Finish::cancelled: return "cancelled";
    case Finish::error: return "error";
    default: return "none";
  }
}

// One generation's output: written by the coordinator, read by one consumer. Unbounded: a consumer that
// reads slowly holds up nobody else (a generation is bounded by max_tokens).
class GenStream {
 public:
  struct Piece {
    std::string text;             // may be empty (text held back for a stop string, or no tokenizer)
    std::vector<int32_t> tokens;  // the tokens this piece comes from (the end-of-generation token excluded)
    // For a piece of one generated token: what GenParams asked for, and how the step went.
    std::optional<Sha256Digest> digest;
    std::vector<float> logits;    // [n_vocab] or empty
    int32_t token = -1;           // the sampled token (also the end-of-generation one, which `tokens` omits)
    int64_t pos = -1;             // the position the token occupies
    double round_trip_s = 0;      // its BATCH sent to its BRES received
    uint64_t link_bytes = 0;      // bytes on the first hop (both ways) when it arrived
  };

  // Waits up to `wait` for output and moves what arrived into `out` (appended). False once the
  // generation has ended and everything has been taken.
  bool next(std::vector<Piece>& out, std::chrono::milliseconds wait) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, wait, [&] { return !q_.empty() || done_; });
    while (!q_.empty()) out.push_back(std::move(q_.front())), q_.pop_front();
    return !(done_ && q_.empty());
  }

  // The consumer has gone (a closed connection, a client that stopped reading): the coordinator frees
  // the session on every stage.
  void cancel() {
    cancelled_.store(true);
    if (wake_) wake_();
  }
  bool cancelled() const { return cancelled_.load(); }

  bool done() const {
    std::lock_guard lock(mu_);
    return done_;
  }
  Finish finish() const {
    std::lock_guard lock(mu_);
    return finish_;
  }
  std::string error() const {
    std::lock_guard lock(mu_);
    return error_;
  }
  std::size_t prompt_tokens() const { return prompt_tokens_; }
  std::size_t completion_tokens() const {
    std::lock_guard lock(mu_);
    return completion_tokens_;
  }

 private:
  friend class Coordinator;
  void push(Piece p) {
    {
      std::lock_guard lock(mu_);
      q_.push_back(std::move(p));
    }
    cv_.notify_all();
  }
  void end(Finish f, std::size_t completion_tokens, std::string error = {}) {
    {
      std::lock_guard lock(mu_);
      if (done_) return;
      done_ = true;
      finish_ = f;
      completion_tokens_ = completion_tokens;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece> q_;
  bool done_ = false;
  Finish finish_ = Finish::none;
  std::string error_;
  std::size_t completion_tokens_ = 0;
  std::size_t prompt_tokens_ = 0;
  std::atomic<bool> cancelled_{false};
  std::function<void()> wake_;
};

// A conversation (the terminal chat): its session stays open between generations, so each turn feeds
// only its new tokens. Touched by the coordinator's thread only; its owner submits one turn at a time.
class Conversation {
 private:
  friend class Coordinator;
  uint64_t session = 0;                 // 0: none open (the first turn, or the chain was lost)
  std::vector<int32_t> history;         // every token fed so far, to rebuild a lost session
  std::optional<int32_t> unfed;         // the last turn's last token, not fed yet
};

}  // namespace pp::net
