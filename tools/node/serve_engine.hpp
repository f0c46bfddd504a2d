// The serving engine of pp_node's coordinator: many generations at once through one multiplexed chain, in micro-batches.
//
// Each generation is a session on every stage (OPEN ... CLOSE on one multiplexed connection,
// docs/PROTOCOL-TCP.md "Multiplexed sessions"). One scheduler thread owns stage 0 (layers [0, C1), the
// embedding and the tokenizer) and every session's state; a reader thread takes the chain's replies.
// The scheduler keeps the pipeline full: the live sessions are split into up to n_stages micro-batches,
// each one BATCH frame (one pass over every stage's weights for all its sessions), and up to n_stages
// batches are in flight at once, so while stage 1 runs one batch stage 0 runs the next. A prompt is fed
// in chunks of at most kPrefillChunk rows, so a long prompt delays the others' next token by one chunk
// at most.
//
// Output goes into each generation's own GenStream (an unbounded queue): a consumer that reads slowly or
// never holds up nobody else. A cancelled generation (its consumer went away) is closed on every stage
// as soon as none of its rows is in flight.
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "node/stop_strings.hpp"
#include "pp/core/buffer.hpp"
#include "pp/core/error.hpp"
#include "pp/io/gguf.hpp"
#include "pp/io/llama_loader.hpp"
#include "pp/io/mmap.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/model_link.hpp"
#include "pp/net/model_worker.hpp"
#include "pp/net/mux_frame.hpp"
#include "pp/stage.hpp"
#include "pp/text/sampler.hpp"
#include "pp/text/tokenizer.hpp"

namespace pp::node {

using SteadyClock = std::chrono::steady_clock;

// What one generation asks for.
struct GenParams {
  SamplingParams sampling;
  uint32_t max_tokens = 16;
  std::vector<std::string> stop;  // cut the text before the first of these
  bool ignore_eos = false;
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

// One generation's output: written by the engine, read by one consumer.
class GenStream {
 public:
  struct Piece {
    std::string text;             // may be empty (text held back for a stop string, or no tokenizer)
    std::vector<int32_t> tokens;  // the tokens this piece comes from (the end-of-generation token excluded)
  };

  // Waits up to `wait` for output and moves what arrived into `out` (appended). False once the
  // generation has ended and everything has been taken.
  bool next(std::vector<Piece>& out, std::chrono::milliseconds wait) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, wait, [&] { return !q_.empty() || done_; });
    while (!q_.empty()) out.push_back(std::move(q_.front())), q_.pop_front();
    return !(done_ && q_.empty());
  }

  // The consumer has gone (a closed connection, a client that stopped reading): the engine frees the
  // session on every stage.
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
  friend class ServeEngine;
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
// only its new tokens. Touched by the engine thread only; its owner submits one turn at a time.
class Conversation {
 private:
  friend class ServeEngine;
  uint64_t session = 0;                 // 0: none open (the first turn, or the chain was lost)
  std::vector<int32_t> history;         // every token fed so far, to rebuild a lost session
  std::optional<int32_t> unfed;         // the last turn's last token, not fed yet
};

struct ServeConfig {
  std::string path;
  std::shared_ptr<const Model> model;  // path opened; null: the engine opens it
  std::vector<net::Peer> workers;  // chain order
  std::vector<int> cuts;           // validated: one per worker
  uint32_t ctx = 0;                // 0: min(4096, model context)
  unsigned threads = 0;
  Residency residency = Residency::Anonymous;  // of the coordinator's own stage
  net::Timeouts timeouts;
  net::Millis load_wait{120000};
  std::size_t parallel = 16;       // generations decoding at once; more wait in the queue
  std::chrono::seconds keepalive{30};
  // Runs on the link to the first worker before HELLO (authentication, when the chain asks for it).
  std::function<void(net::Channel&)> authenticate;
};

// Counters for /metrics.
struct EngineMetrics {
  uint64_t tokens_generated = 0, prompt_tokens = 0;
  uint64_t requests_ok = 0, requests_error = 0, requests_cancelled = 0;
  double tokens_per_second = 0;  // over the last 10 s
  std::size_t sessions_active = 0, queue_depth = 0, sessions_ready = 0, batches_in_flight = 0;
  uint64_t batches = 0, batch_rows = 0;
  double stage0_compute_s = 0, stage0_transfer_s = 0, batch_round_trip_s = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;
  double ttft_sum_s = 0;
  uint64_t ttft_count = 0;
  bool link_up = false;
  std::string link_error;
  uint64_t link_epoch = 0;  // connections to the chain made so far: /health ignores probes of an older link
};

class ServeEngine {
 public:
  // Rows of one session's prompt in one batch, and of one batch: a batch's compute on the slowest stage
  // must stay well inside --timeout, which bounds every wait for a reply.
  static constexpr std::size_t kPrefillChunk = 128;
  static constexpr std::size_t kBatchRows = 128;

  // Reads the file's header (identity, geometry) and the tokenizer; maps nothing else yet.
  explicit ServeEngine(ServeConfig cfg)
      : cfg_(std::move(cfg)), model_(cfg_.model ? cfg_.model : Model::open(cfg_.path)), config_(model_->config()) {
    id_ = net::identify_model(*model_, cfg_.path);
    ctx_ = cfg_.ctx ? cfg_.ctx : uint32_t(model_->default_ctx());
    tok_ = model_->tokenizer();
    int lo = cfg_.cuts.front();
    for (std::size_t i = 0; i < cfg_.workers.size(); ++i) {
      const int hi = i + 1 < cfg_.cuts.size() ? cfg_.cuts[i + 1] : int(config_.n_layer);
      hops_.push_back(net::Hop{LayerRange{lo, hi}, cfg_.workers[i]});
      lo = hi;
    }
  }
  ServeEngine(const ServeEngine&) = delete;
  ServeEngine& operator=(const ServeEngine&) = delete;

  ~ServeEngine() {
    shutdown();
    drop_link();
  }

  // Ends every generation ("the server is shutting down") and stops the scheduler; later submissions
  // end at once. Idempotent.
  void shutdown() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  const Config& config() const { return config_; }
  const net::ModelIdentity& identity() const { return id_; }
  const gguf::File& gguf() const { return model_->gguf(); }
  uint32_t ctx() const { return ctx_; }
  const Tokenizer* tokenizer() const { return tok_; }
  const std::string& tokenizer_error() const { return model_->tokenizer_error(); }
  const std::vector<net::Hop>& hops() const { return hops_; }
  std::size_t n_stages() const { return hops_.size() + 1; }
  const Stage& stage() const { return *stage_; }
  LayerRange stage_range() const { return LayerRange{0, cfg_.cuts.front()}; }
  const net::Welcome& welcome() const { return welcome_; }

  // Maps and loads stage 0 (may run while connect() waits for the workers to load theirs).
  void load_stage() {
    StageOptions so;
    so.ctx = ctx_;
    so.threads = cfg_.threads;
    so.residency = cfg_.residency;
    stage_ = std::make_unique<Stage>(model_, LayerRange{0, cfg_.cuts.front()}, so);
  }

  // The handshake with mux=1; throws naming the hop. Called before start(), and again by the scheduler
  // after the chain was lost.
  void connect() {
    net::Hello hello;
    hello.model = id_;
    hello.ctx = ctx_;
    hello.from = uint32_t(cfg_.cuts.front());
    hello.stage = 1;
    hello.chain = hops_;
    hello.coordinator = stage_ ? net::local_profile(*stage_) : net::NumericProfile{simd::Best::name(), cfg_.threads};
    auto ms = [](net::Millis t) { return t == net::kNoTimeout ? 0u : uint32_t(std::min<int64_t>(t.count(), 86400000)); };
    hello.timeout_ms = ms(cfg_.timeouts.io);
    hello.load_timeout_ms = ms(cfg_.load_wait);
    hello.mux = true;
    const net::Millis wait = net::reply_wait(cfg_.timeouts.io, hops_.size());
    auto link = std::make_unique<net::ModelLink>(hops_.front(), 1, cfg_.timeouts, wait);
    if (cfg_.authenticate) cfg_.authenticate(link->channel());
    const uint64_t session = random_id();
    link->send_hello(hello, session);
    net::Welcome w = link->read_welcome(net::reply_wait(cfg_.load_wait, hops_.size()));
    const std::string& who = link->who();
    if (w.stages.size() != hops_.size())
      throw Error(who + ": WELCOME reports " + std::to_string(w.stages.size()) + " stages, the chain has " +
                  std::to_string(hops_.size()));
    for (std::size_t i = 0; i < hops_.size(); ++i)
      if (w.stages[i].range != hops_[i].range || w.stages[i].stage != i + 1)
        throw Error(who + ": WELCOME reports stage " + std::to_string(w.stages[i].stage) + " with other layers than assigned");
    if (!w.mux)
      throw Error(who + ": the chain does not accept multiplexed sessions (no mux=1 in WELCOME): a worker runs an "
                        "older pp_node; serving needs every worker to be this version");
    link->channel().set_timeouts(net::Timeouts{cfg_.timeouts.io, net::kNoTimeout});
    welcome_ = std::move(w);
    conn_session_ = session;
    link_ = std::move(link);
    reply_wait_ = wait;
    reader_stop_.store(false);
    outstanding_.store(0);
    reader_ = std::thread([this] { read_replies(); });
    {
      std::lock_guard lock(metrics_mu_);
      metrics_.link_up = true;
      metrics_.link_error.clear();
      ++metrics_.link_epoch;
    }
  }

  // Starts the scheduler (after load_stage and connect).
  void start() { thread_ = std::thread([this] { schedule(); }); }

  // Queues a generation of `prompt` (appended to the conversation's tokens when `conv` is given).
  std::shared_ptr<GenStream> submit(std::vector<int32_t> prompt, GenParams params,
                                    std::shared_ptr<Conversation> conv = nullptr) {
    auto out = std::make_shared<GenStream>();
    out->prompt_tokens_ = prompt.size();
    out->wake_ = [this] {
      {
        std::lock_guard lock(mu_);
        cancel_seen_ = true;
      }
      cv_.notify_all();
    };
    {
      std::lock_guard lock(mu_);
      if (stop_) {
        out->end(Finish::error, 0, "the server is shutting down");
        return out;
      }
      submits_.push_back(Submission{std::move(prompt), std::move(params), out, std::move(conv), SteadyClock::now()});
    }
    cv_.notify_all();
    return out;
  }

  // Ends a conversation: its session is closed on every stage.
  void end_conversation(const std::shared_ptr<Conversation>& conv) {
    {
      std::lock_guard lock(mu_);
      conv_ends_.push_back(conv);
    }
    cv_.notify_all();
  }

  EngineMetrics metrics() const {
    std::lock_guard lock(metrics_mu_);
    EngineMetrics m = metrics_;
    const auto now = SteadyClock::now();
    uint64_t recent = 0;
    for (const auto& [t, n] : recent_)
      if (now - t <= std::chrono::seconds(10)) recent += n;
    const double window = std::min(10.0, std::chrono::duration<double>(now - started_).count());
    m.tokens_per_second = window > 0 ? double(recent) / window : 0.0;
    return m;
  }

 private:
  struct Submission {
    std::vector<int32_t> prompt;
    GenParams params;
    std::shared_ptr<GenStream> out;
    std::shared_ptr<Conversation> conv;
    SteadyClock::time_point t_submit;
  };

  enum class State { opening, ready, in_flight, idle };

  struct Session {
    uint64_t id = 0;
    State state = State::opening;
    std::optional<Sequence> seq;  // stage 0's KV cache
    int64_t pos = 0;              // rows fed so far
    std::vector<int32_t> feed;    // tokens still to feed, from feed_at
    std::size_t feed_at = 0;
    std::size_t rows_in_flight = 0;
    std::shared_ptr<GenStream> out;  // null while a conversation waits for its next turn
    std::shared_ptr<Conversation> conv;
    GenParams params;
    std::optional<StreamDecoder> dec;
    StopMatcher stop;
    uint32_t generated = 0;
    std::optional<int32_t> unfed;  // the last sampled token, not yet fed
    SteadyClock::time_point t_submit;
    bool got_first = false;
  };

  struct Reply {
    net::ModelHeader h;
    std::vector<uint8_t> payload;
  };

  struct InFlight {
    std::vector<std::pair<uint64_t, uint32_t>> entries;  // session, rows
    SteadyClock::time_point sent;
  };

  static uint64_t random_id() {
    static std::mutex mu;
    static std::mt19937_64 rng{std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32)};
    std::lock_guard lock(mu);
    uint64_t v = 0;
    while (v == 0) v = rng();
    return v;
  }

  // ---- the reader thread ----

  void read_replies() {
    net::Channel& ch = link_->channel();
    const std::string who = link_->who();
    try {
      while (!reader_stop_.load()) {
        if (!net::detail::wait_ready(ch.fd().get(), POLLIN, net::Millis{200})) {
          if (outstanding_.load() > 0 && reply_wait_ != net::kNoTimeout &&
              SteadyClock::now() - SteadyClock::time_point(SteadyClock::duration(last_progress_.load())) > reply_wait_)
            throw NetError(NetError::Kind::timeout,
                           who + ": no reply within " + net::detail::seconds_text(reply_wait_));
          continue;
        }
        const std::optional<net::FrameHeader> fh = ch.read_header();
        if (reader_stop_.load()) return;
        if (!fh) throw NetError(NetError::Kind::closed, who + ": closed the connection");
        const auto t0 = SteadyClock::now();
        if (fh->version != net::kVersionModel) {
          const std::string text = fh->type == net::kTypeErr ? net::read_text(ch, fh->payload_bytes, "ERR") : "";
          throw FrameError(who + ": answered with version " + std::to_string(fh->version) + " " + text);
        }
        Reply r;
        r.h = net::read_extension(ch, *fh);
        const uint64_t limit =
            r.h.type == net::kTypeBatchRes ? net::max_batch_res_bytes(uint32_t(config_.n_vocab)) : net::kMaxTextPayload;
        if (r.h.type != net::kTypeBatchRes && r.h.type != net::kTypeOpen && r.h.type != net::kTypeErr &&
            r.h.type != net::kTypeStatus)
          throw FrameError(who + ": sent " + net::mux_type_name(r.h.type) + " on the multiplexed connection");
        if (r.h.payload_bytes > limit)
          throw FrameError(who + ": " + net::mux_type_name(r.h.type) + " payload_bytes " +
                           std::to_string(r.h.payload_bytes) + " > limit " + std::to_string(limit));
        r.payload.resize(r.h.payload_bytes);
        ch.read_into(r.payload, "reply payload");
        link_->count_received(net::kModelHeaderBytes + r.payload.size());
        if (r.h.type == net::kTypeErr && r.h.session == conn_session_)
          throw Error(who + " reports: " + std::string(r.payload.begin(), r.payload.end()));
        if (r.h.type != net::kTypeStatus) {
          outstanding_.fetch_sub(1);
          last_progress_.store(SteadyClock::now().time_since_epoch().count());
        }
        {
          std::lock_guard lock(metrics_mu_);
          metrics_.stage0_transfer_s += std::chrono::duration<double>(SteadyClock::now() - t0).count();
        }
        {
          std::lock_guard lock(mu_);
          replies_.push_back(std::move(r));
        }
        cv_.notify_all();
      }
    } catch (const std::exception& e) {
      if (reader_stop_.load()) return;
      {
        std::lock_guard lock(mu_);
        link_dead_ = true;
        link_error_ = e.what();
      }
      cv_.notify_all();
    }
  }

  void drop_link() {
    reader_stop_.store(true);
    if (link_) ::shutdown(link_->channel().fd().get(), SHUT_RDWR);
    if (reader_.joinable()) reader_.join();
    if (link_) {
      std::lock_guard lock(metrics_mu_);
      metrics_.bytes_sent_base += link_->bytes_sent();
      metrics_.bytes_received_base += link_->bytes_received();
    }
    link_.reset();
    std::lock_guard lock(metrics_mu_);
    metrics_.link_up = false;
  }

  // ---- the scheduler thread ----

  bool can_send() const { return link_ && !loss_ && in_flight_.size() < n_stages(); }

  // A send or a reply failed: the link is dropped at the end of this round of the scheduler (callers
  // may be iterating over the sessions that losing it clears).
  void defer_loss(std::string why) {
    if (!loss_) loss_ = std::move(why);
  }

  void schedule() {
    std::vector<Submission> submits;
    std::vector<Reply> replies;
    std::vector<std::shared_ptr<Conversation>> ends;
    auto last_send = SteadyClock::now();
    for (;;) {
      bool dead = false, cancels = false;
      std::string dead_why;
      {
        std::unique_lock lock(mu_);
        cv_.wait_for(lock, std::chrono::seconds(1), [&] {
          return stop_ || !submits_.empty() || !replies_.empty() || !conv_ends_.empty() || link_dead_ ||
                 cancel_seen_ || (can_send() && !ready_.empty());
        });
        if (stop_) break;
        for (auto& s : submits_) submits.push_back(std::move(s));
        submits_.clear();
        for (auto& r : replies_) replies.push_back(std::move(r));
        replies_.clear();
        for (auto& c : conv_ends_) ends.push_back(std::move(c));
        conv_ends_.clear();
        dead = std::exchange(link_dead_, false);
        dead_why = link_error_;
        cancels = std::exchange(cancel_seen_, false);
      }
      if (dead) lose_link(dead_why);
      loss_.reset();
      for (Reply& r : replies) on_reply(r);
      replies.clear();
      for (auto& c : ends) end_conv(*c);
      ends.clear();
      if (cancels) sweep_cancelled();
      for (Submission& s : submits) waiting_.push_back(std::move(s));
      submits.clear();
      admit();
      while (can_send() && !ready_.empty()) {
        if (!send_batch()) break;
        last_send = SteadyClock::now();
      }
      if (link_ && SteadyClock::now() - last_send > cfg_.keepalive) {
        send_close(net::kKeepaliveSession);
        last_send = SteadyClock::now();
      }
      if (loss_) lose_link(*std::exchange(loss_, std::nullopt));
      publish_gauges();
    }
    // Shutting down: every open generation ends.
    for (auto& [id, s] : sessions_)
      if (s.out) s.out->end(Finish::error, s.generated, "the server is shutting down");
    for (Submission& s : waiting_) s.out->end(Finish::error, 0, "the server is shutting down");
    std::lock_guard lock(mu_);
    for (Submission& s : submits_) s.out->end(Finish::error, 0, "the server is shutting down");
  }

  std::size_t busy_sessions() const {
    std::size_t n = 0;
    for (const auto& [id, s] : sessions_) n += s.out ? 1 : 0;
    return n;
  }

  // Starts waiting generations while fewer than `parallel` run.
  void admit() {
    while (!waiting_.empty() && busy_sessions() < cfg_.parallel) {
      Submission sub = std::move(waiting_.front());
      waiting_.pop_front();
      if (sub.out->cancelled()) {
        count_end(Finish::cancelled);
        sub.out->end(Finish::cancelled, 0);
        continue;
      }
      open_generation(std::move(sub));
      if (loss_) return;
    }
  }

  void open_generation(Submission sub) {
    for (int32_t t : sub.prompt)
      if (t < 0 || std::size_t(t) >= config_.n_vocab) {
        count_end(Finish::error);
        return sub.out->end(Finish::error, 0, "token id " + std::to_string(t) + " is outside the vocabulary");
      }
    if (!link_) {
      try {
        connect();
      } catch (const std::exception& e) {
        count_end(Finish::error);
        return sub.out->end(Finish::error, 0, std::string("the pipeline is unavailable: ") + e.what());
      }
    }
    {
      std::lock_guard lock(metrics_mu_);
      metrics_.prompt_tokens += sub.prompt.size();
    }
    // A conversation whose session is still open feeds only what is new.
    if (sub.conv && sub.conv->session) {
      const auto it = sessions_.find(sub.conv->session);
      if (it != sessions_.end() && it->second.state == State::idle) {
        Session& s = it->second;
        s.feed.clear();
        if (sub.conv->unfed) s.feed.push_back(*sub.conv->unfed);
        sub.conv->unfed.reset();
        s.feed.insert(s.feed.end(), sub.prompt.begin(), sub.prompt.end());
        if (s.feed.empty()) {
          count_end(Finish::error);
          return sub.out->end(Finish::error, 0, "nothing to feed: the prompt is empty");
        }
        s.feed_at = 0;
        begin_generation(s, sub);
        s.state = State::ready;
        ready_.push_back(s.id);
        return;
      }
      sub.conv->session = 0;
    }
    Session s;
    s.id = random_id();
    try {
      s.seq.emplace(stage_->new_sequence());
    } catch (const std::bad_alloc&) {
      count_end(Finish::error);
      return sub.out->end(Finish::error, 0, "out of memory for a KV cache on stage 0");
    }
    if (sub.conv) {
      s.feed = sub.conv->history;  // a lost session is rebuilt from everything said so far
      if (sub.conv->unfed) s.feed.push_back(*sub.conv->unfed);
      sub.conv->history.clear();
      sub.conv->unfed.reset();
      sub.conv->session = s.id;
    }
    s.feed.insert(s.feed.end(), sub.prompt.begin(), sub.prompt.end());
    if (s.feed.empty()) {
      count_end(Finish::error);
      return sub.out->end(Finish::error, 0, "nothing to feed: the prompt is empty");
    }
    s.conv = sub.conv;
    begin_generation(s, sub);
    const uint64_t id = s.id;
    const SamplingParams sampling = s.params.sampling;
    sessions_.emplace(id, std::move(s));
    net::ModelHeader h;
    h.type = net::kTypeOpen;
    h.session = id;
    h.seq = next_seq_++;
    const std::string text = net::encode_sampling(sampling);
    send_frame(h, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()), true);
  }

  void begin_generation(Session& s, Submission& sub) {
    s.out = sub.out;
    s.params = std::move(sub.params);
    s.dec.reset();
    if (tok_) s.dec.emplace(*tok_);
    s.stop = StopMatcher(s.params.stop);
    s.generated = 0;
    s.got_first = false;
    s.t_submit = sub.t_submit;
  }

  // Frames other than BATCH; `replies`: the chain answers it (the stall timer counts it).
  void send_frame(net::ModelHeader h, std::span<const uint8_t> payload, bool replies) {
    if (!link_ || loss_) return;
    h.layer_lo = uint32_t(hops_.front().range.lo);
    h.layer_hi = uint32_t(hops_.front().range.hi);
    if (replies && outstanding_.fetch_add(1) == 0) last_progress_.store(SteadyClock::now().time_since_epoch().count());
    const auto t0 = SteadyClock::now();
    try {
      net::send_model(link_->channel(), h, payload);
      link_->count_sent(net::kModelHeaderBytes + payload.size());
    } catch (const std::exception& e) {
      return defer_loss(e.what());
    }
    std::lock_guard lock(metrics_mu_);
    metrics_.stage0_transfer_s += std::chrono::duration<double>(SteadyClock::now() - t0).count();
  }

  void send_close(uint64_t session) {
    net::ModelHeader h;
    h.type = net::kTypeClose;
    h.session = session;
    send_frame(h, {}, false);
  }

  // Frees a session here and on every stage.
  void close_session(uint64_t id) {
    const auto it = sessions_.find(id);
    if (it == sessions_.end()) return;
    if (it->second.conv && it->second.conv->session == id) it->second.conv->session = 0;
    sessions_.erase(it);
    std::erase(ready_, id);
    send_close(id);
  }

  void count_end(Finish f) {
    std::lock_guard lock(metrics_mu_);
    if (f == Finish::error) ++metrics_.requests_error;
    else if (f == Finish::cancelled) ++metrics_.requests_cancelled;
    else ++metrics_.requests_ok;
  }

  void finish(Session& s, Finish f, std::string error = {}) {
    if (f == Finish::stop || f == Finish::length) {
      std::string tail = s.dec ? s.stop.feed(s.dec->flush()) : std::string{};
      tail += s.stop.flush();
      if (!tail.empty()) s.out->push(GenStream::Piece{std::move(tail), {}});
    }
    count_end(f);
    s.out->end(f, s.generated, std::move(error));
    s.out.reset();
    if (s.conv && f != Finish::error && f != Finish::cancelled) {
      s.conv->unfed = s.unfed;
      s.state = State::idle;  // the conversation's next turn continues this session
      return;
    }
    close_session(s.id);
  }

  void sweep_cancelled() {
    std::vector<uint64_t> gone;
    for (auto& [id, s] : sessions_)
      if (s.out && s.out->cancelled() && s.state == State::ready) gone.push_back(id);
    for (uint64_t id : gone) {
      Session& s = sessions_.at(id);
      count_end(Finish::cancelled);
      s.out->end(Finish::cancelled, s.generated);
      close_session(id);
    }
    // Waiting ones are dropped when admitted; opening and in-flight ones when their reply comes.
  }

  void end_conv(Conversation& c) {
    if (c.session) {
      const auto it = sessions_.find(c.session);
      if (it != sessions_.end() && it->second.state == State::idle) close_session(c.session);
      else if (it != sessions_.end()) it->second.conv.reset();  // closed when this generation ends
    }
    c.session = 0;
    c.history.clear();
  }

  void on_reply(const Reply& r) {
    if (r.h.type == net::kTypeStatus) return;
    if (r.h.type == net::kTypeOpen || r.h.type == net::kTypeErr) {
      const auto it = sessions_.find(r.h.session);
      if (it == sessions_.end()) return;
      Session& s = it->second;
      if (r.h.type == net::kTypeErr) {
        const std::string why(r.payload.begin(), r.payload.end());
        if (s.out) {
          count_end(Finish::error);
          s.out->end(Finish::error, 0, why);
        }
        close_session(s.id);  // the stages above the refusal opened it
        return;
      }
      if (s.out && s.out->cancelled()) {
        count_end(Finish::cancelled);
        s.out->end(Finish::cancelled, 0);
        return close_session(s.id);
      }
      s.state = State::ready;
      ready_.push_back(s.id);
      return;
    }
    // BRES
    const auto fl = in_flight_.find(r.h.seq);
    if (fl == in_flight_.end()) return defer_loss("BRES seq " + std::to_string(r.h.seq) + " answers no batch in flight");
    const InFlight batch = std::move(fl->second);
    in_flight_.erase(fl);
    std::vector<net::EntryResult> res;
    try {  // the engine sends every entry with flags 0: a token each
      res = net::decode_batch_res(r.payload, std::vector<net::BatchEntry>(batch.entries.size()), uint32_t(config_.n_vocab));
    } catch (const FrameError& e) {
      return defer_loss(std::string(e.what()) + " (seq " + std::to_string(r.h.seq) + ")");
    }
    uint64_t produced = 0;
    for (std::size_t i = 0; i < batch.entries.size(); ++i) {
      const auto it = sessions_.find(batch.entries[i].first);
      if (it == sessions_.end()) continue;
      Session& s = it->second;
      s.state = State::ready;
      s.rows_in_flight = 0;
      if (!s.out) {  // its conversation ended meanwhile
        close_session(s.id);
        continue;
      }
      if (s.out->cancelled()) {
        count_end(Finish::cancelled);
        s.out->end(Finish::cancelled, s.generated);
        close_session(s.id);
        continue;
      }
      if (s.feed_at < s.feed.size()) {  // more of the prompt to feed: this token is not the answer yet
        ready_.push_back(s.id);
        continue;
      }
      ++produced;
      on_token(s, res[i].token);
    }
    std::lock_guard lock(metrics_mu_);
    metrics_.batch_round_trip_s += std::chrono::duration<double>(SteadyClock::now() - batch.sent).count();
    recent_.emplace_back(SteadyClock::now(), produced);
    while (!recent_.empty() && SteadyClock::now() - recent_.front().first > std::chrono::seconds(10)) recent_.pop_front();
  }

  void on_token(Session& s, int32_t t) {
    if (t < 0 || std::size_t(t) >= config_.n_vocab) return defer_loss("a BRES carries token id " + std::to_string(t));
    ++s.generated;
    {
      // Counted before the generation can end: a client that reads /metrics after its reply sees it.
      std::lock_guard lock(metrics_mu_);
      ++metrics_.tokens_generated;
      if (!s.got_first) {
        s.got_first = true;
        metrics_.ttft_sum_s += std::chrono::duration<double>(SteadyClock::now() - s.t_submit).count();
        ++metrics_.ttft_count;
      }
    }
    s.unfed = t;
    if (tok_ && tok_->is_eog(t) && !s.params.ignore_eos) return finish(s, Finish::stop);
    std::string text = s.dec ? s.stop.feed(s.dec->feed(t)) : std::string{};
    s.out->push(GenStream::Piece{std::move(text), {t}});
    if (s.stop.stopped()) return finish(s, Finish::stop);
    if (s.generated >= s.params.max_tokens) return finish(s, Finish::length);
    s.feed.assign(1, t);
    s.feed_at = 0;
    s.unfed.reset();
    ready_.push_back(s.id);
  }

  // Rows of a prompt with `left` rows to go fed in the next entry. Depends on the prompt only, not on
  // what else is in the batch: a row's arithmetic depends on its request's size (kernels::kBulkRows),
  // so a session's output is the same whether it runs alone or with others. The last piece of a bulk
  // prompt is kept bulk too, so the rows take the path they take when the prompt runs in one piece.
  std::size_t feed_rows(std::size_t left) const {
    const std::size_t chunk = std::min<std::size_t>({kPrefillChunk, kBatchRows, ctx_});
    if (left <= chunk) return left;
    if (chunk > 2 * kernels::kBulkRows && left - chunk < kernels::kBulkRows) return left - kernels::kBulkRows;
    return chunk;
  }

  // One micro-batch: up to ceil(live / n_stages) ready sessions, stage 0's layers for all of them in
  // one pass, one BATCH frame down the chain.
  bool send_batch() {
    std::size_t live = 0;
    for (const auto& [id, s] : sessions_) live += (s.state == State::ready || s.state == State::in_flight) ? 1 : 0;
    const std::size_t cap = std::min<std::size_t>(net::kMaxBatchEntries, (live + n_stages() - 1) / n_stages());
    const std::size_t budget = std::min<std::size_t>(kBatchRows, ctx_);
    std::vector<net::BatchEntry> entries;
    std::vector<Stage::BatchEntry> run;
    std::size_t rows = 0;
    while (!ready_.empty() && entries.size() < std::max<std::size_t>(cap, 1) && rows < budget) {
      Session& s = sessions_.at(ready_.front());
      const std::size_t n = feed_rows(s.feed.size() - s.feed_at);
      if (n == 0 || (rows > 0 && rows + n > budget)) break;  // the next batch takes it whole
      ready_.pop_front();
      entries.push_back(net::BatchEntry{s.id, uint64_t(s.pos), uint32_t(n), 0});
      run.push_back(Stage::BatchEntry{&*s.seq, s.pos, n});
      rows += n;
    }
    if (entries.empty()) return false;
    const std::size_t E = config_.n_embd;
    if (rows_.size() < rows * E) rows_ = Buffer<float>(std::max(rows, std::size_t(kBatchRows)) * E);
    const auto t0 = SteadyClock::now();
    std::size_t off = 0;
    for (const net::BatchEntry& e : entries) {
      Session& s = sessions_.at(e.session);
      stage_->embed(std::span(s.feed).subspan(s.feed_at, e.rows), rows_.data() + off * E);
      off += e.rows;
    }
    stage_->forward_batch(run, rows_.data());
    const auto t1 = SteadyClock::now();
    InFlight fl;
    fl.sent = t0;
    for (const net::BatchEntry& e : entries) {
      Session& s = sessions_.at(e.session);
      if (s.conv) s.conv->history.insert(s.conv->history.end(), s.feed.begin() + std::ptrdiff_t(s.feed_at),
                                         s.feed.begin() + std::ptrdiff_t(s.feed_at + e.rows));
      s.feed_at += e.rows;
      s.pos += int64_t(e.rows);
      s.rows_in_flight = e.rows;
      s.state = State::in_flight;
      fl.entries.emplace_back(e.session, e.rows);
    }
    net::ModelHeader h;
    h.type = net::kTypeBatch;
    h.seq = next_seq_++;
    h.session = conn_session_;
    h.rows = uint32_t(rows);
    h.layer_lo = uint32_t(hops_.front().range.lo);
    h.layer_hi = uint32_t(hops_.front().range.hi);
    in_flight_.emplace(h.seq, std::move(fl));
    if (outstanding_.fetch_add(1) == 0) last_progress_.store(SteadyClock::now().time_since_epoch().count());
    const std::vector<uint8_t> table = net::encode_batch_table(entries);
    try {
      const uint64_t sent = net::send_batch(link_->channel(), h, table,
                                            std::span(reinterpret_cast<const uint8_t*>(rows_.data()), rows * E * 4));
      link_->count_sent(sent);
    } catch (const std::exception& e) {
      defer_loss(e.what());
      return false;
    }
    std::lock_guard lock(metrics_mu_);
    ++metrics_.batches;
    metrics_.batch_rows += rows;
    metrics_.stage0_compute_s += std::chrono::duration<double>(t1 - t0).count();
    metrics_.stage0_transfer_s += std::chrono::duration<double>(SteadyClock::now() - t1).count();
    return true;
  }

  // The chain is gone: every generation in progress ends with the reason; the next one reconnects.
  void lose_link(const std::string& why) {
    drop_link();
    {
      std::lock_guard lock(metrics_mu_);
      metrics_.link_error = why;
    }
    for (auto& [id, s] : sessions_) {
      if (s.out) {
        count_end(Finish::error);
        s.out->end(Finish::error, s.generated, "the pipeline failed: " + why);
      }
      if (s.conv && s.conv->session == id) s.conv->session = 0;
    }
    sessions_.clear();
    ready_.clear();
    in_flight_.clear();
    std::lock_guard lock(mu_);
    replies_.clear();  // answers on the lost connection
    link_dead_ = false;
  }

  void publish_gauges() {
    std::size_t ready = 0;
    for (const auto& [id, s] : sessions_) ready += s.state == State::ready ? 1 : 0;
    std::lock_guard lock(metrics_mu_);
    metrics_.sessions_active = busy_sessions();
    metrics_.queue_depth = waiting_.size();
    metrics_.sessions_ready = ready;
    metrics_.batches_in_flight = in_flight_.size();
    metrics_.bytes_sent = metrics_.bytes_sent_base + (link_ ? link_->bytes_sent() : 0);
    metrics_.bytes_received = metrics_.bytes_received_base + (link_ ? link_->bytes_received() : 0);
  }

  ServeConfig cfg_;
  std::shared_ptr<const Model> model_;
  Config config_;
  net::ModelIdentity id_;
  uint32_t ctx_ = 0;
  const Tokenizer* tok_ = nullptr;  // model_'s, if it has one
  std::vector<net::Hop> hops_;
  std::unique_ptr<Stage> stage_;
  net::Welcome welcome_;

  // The link (the scheduler thread sends, the reader thread reads).
  std::unique_ptr<net::ModelLink> link_;
  uint64_t conn_session_ = 0;
  net::Millis reply_wait_{10000};
  std::thread reader_;
  std::atomic<bool> reader_stop_{false};
  std::atomic<int64_t> outstanding_{0};     // frames sent that the chain still owes a reply
  std::atomic<int64_t> last_progress_{0};   // steady_clock ticks of the last reply (or the first send)

  // Inbox (under mu_).
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::deque<Submission> submits_;
  std::deque<Reply> replies_;
  std::vector<std::shared_ptr<Conversation>> conv_ends_;
  bool link_dead_ = false, cancel_seen_ = false;
  std::string link_error_;

  // The scheduler's own state.
  std::thread thread_;
  std::map<uint64_t, Session> sessions_;
  std::deque<uint64_t> ready_;
  std::deque<Submission> waiting_;
  std::map<uint32_t, InFlight> in_flight_;
  std::optional<std::string> loss_;  // why the link must be dropped (defer_loss)
  uint32_t next_seq_ = 1;
  Buffer<float> rows_;  // [rows, n_embd] one batch's residual

  struct Counters : EngineMetrics {
    uint64_t bytes_sent_base = 0, bytes_received_base = 0;  // of links already closed
  };
  mutable std::mutex metrics_mu_;
  Counters metrics_;
  std::deque<std::pair<SteadyClock::time_point, uint64_t>> recent_;
  SteadyClock::time_point started_ = SteadyClock::now();
};

}  // namespace pp::node
