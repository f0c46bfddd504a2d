// The coordinator: stage 0 (layers [0, C1), the embedding, the tokenizer) and many generations at once through one multiplexed chain, in micro-batches.
//
// Each generation is a session on every stage (OPEN ... CLOSE on one multiplexed connection,
// docs/PROTOCOL-TCP.md "Multiplexed sessions"). One scheduler thread owns stage 0 and every session's
// state; the link's reader thread hands it the chain's replies (link.hpp). The scheduler keeps the
// pipeline full: the live sessions are split into up to n_stages micro-batches, each one BATCH frame
// (one pass over every stage's weights for all its sessions), and up to n_stages batches are in flight
// at once, so while stage 1 runs one batch stage 0 runs the next. A prompt is fed in chunks: alone, of
// kPrefillChunk rows; while other generations decode, of as many rows as cost about half a decoding
// batch (PrefillPace, measured on stage 0), so a long prompt does not stall the streams already running.
//
// Output goes into each generation's own GenStream (stream.hpp). A cancelled generation (its consumer
// went away) is closed on every stage as soon as none of its rows is in flight.
//
// With `resume` set, a lost chain is re-established and every session replayed into it: the same
// entries in the same order from a fresh stage-0 cache, each answer checked against the token the
// session got the first time (the arithmetic of an entry depends only on its own rows, so it must be
// identical). A generation then goes on as if nothing had happened.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pp/core/buffer.hpp"
#include "pp/core/error.hpp"
#include "pp/core/hex.hpp"
#include "pp/core/printable.hpp"
#include "pp/kernels/matmul.hpp"
#include "pp/model.hpp"
#include "pp/net/auth.hpp"
#include "pp/net/coordinator/link.hpp"
#include "pp/net/coordinator/stream.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/mux_frame.hpp"
#include "pp/stage.hpp"
#include "pp/text/sampler.hpp"
#include "pp/text/stop_strings.hpp"
#include "pp/text/tokenizer.hpp"

namespace pp::net {

using SteadyClock = std::chrono::steady_clock;

struct CoordinatorConfig {
  std::shared_ptr<const Model> model;
  std::string name;                // what the HELLO calls the model file (default: its path)
  std::vector<Peer> workers;       // chain order
  std::vector<int> cuts;           // validated: one per worker, strictly increasing in (0, n_layer)
  uint32_t ctx = 0;                // 0: Model::default_ctx()
  unsigned threads = 0;
  Residency residency = Residency::Anonymous;  // of stage 0
  Timeouts timeouts;
  Millis load_wait{120000};
  std::size_t parallel = 16;       // generations decoding at once; more wait in the queue
  // Micro-batches the live sessions are split into, each in flight at once, at most one per stage;
  // 0 = measured: one, or one per stage, whichever serves more tokens (Coordinator::MicroBatchTuner).
  // Fewer stream each stage's weights fewer times per round of tokens, which wins where a step's cost
  // barely grows with its rows; more keep every stage busy.
  std::size_t micro_batches = 0;
  std::chrono::seconds keepalive{30};
  std::function<void(Channel&)> authenticate;  // before HELLO, when the chain asks for a key
  // After the chain fails, keep re-establishing it this long and replay every session into it; 0 = every
  // generation in progress ends with the error (the next one reconnects).
  Millis resume{0};
  std::function<void(const std::string&)> log;  // a line about the chain (losing it, resuming)
};

// Counters for /metrics and the run report.
struct CoordinatorMetrics {
  uint64_t tokens_generated = 0, prompt_tokens = 0;
  uint64_t requests_ok = 0, requests_error = 0, requests_cancelled = 0;
  double tokens_per_second = 0;  // over the last 10 s
  std::size_t sessions_active = 0, queue_depth = 0, sessions_ready = 0, batches_in_flight = 0;
  uint64_t batches = 0, batch_rows = 0;
  double stage0_compute_s = 0, stage0_transfer_s = 0, batch_round_trip_s = 0;
  // Wall time with at least one generation in progress, and the part of it stage 0 sat waiting (for
  // a reply, with its share of the batches in flight, or with nothing ready): its pipeline bubbles.
  double active_s = 0, stage0_wait_s = 0;
  std::size_t prefill_pace_rows = 0;  // prompt rows per batch while other generations decode
  std::size_t micro_batches = 0;      // the decoding sessions are split into this many (Coordinator::MicroBatchTuner)
  uint64_t micro_batch_switches = 0;  // times --micro-batches 0 changed its count
  uint64_t bytes_sent = 0, bytes_received = 0;
  double ttft_sum_s = 0;
  uint64_t ttft_count = 0;
  bool link_up = false;
  std::string link_error;
  uint64_t link_epoch = 0;  // connections to the chain made so far: /health ignores probes of an older link
  uint64_t resumes = 0, replayed_positions = 0;  // chains re-established, positions replayed into them
  double resume_s = 0;
};

class Coordinator {
 public:
  // Rows of one session's prompt in one batch, and of one batch: a batch's compute on the slowest stage
  // must stay well inside --timeout, which bounds every wait for a reply.
  static constexpr std::size_t kPrefillChunk = 128;
  static constexpr std::size_t kBatchRows = 128;

  // Reads the model's identity and geometry; maps nothing yet.
  // No workers: the whole model runs here (stage 0 is every layer and the head), through the same
  // scheduler, batches and metrics.
  explicit Coordinator(CoordinatorConfig cfg) : cfg_(std::move(cfg)), config_(cfg_.model->config()) {
    if (cfg_.cuts.size() != cfg_.workers.size())
      throw RequestError("a coordinator needs one cut per worker (" + std::to_string(cfg_.cuts.size()) + " for " +
                         std::to_string(cfg_.workers.size()) + ")");
    id_ = identify_model(*cfg_.model, cfg_.name);
    ctx_ = cfg_.ctx ? cfg_.ctx : uint32_t(cfg_.model->default_ctx());
    tok_ = cfg_.model->tokenizer();
    for (std::size_t i = 0; i < cfg_.workers.size(); ++i) {
      const int hi = i + 1 < cfg_.cuts.size() ? cfg_.cuts[i + 1] : int(config_.n_layer);
      hops_.push_back(Hop{LayerRange{cfg_.cuts[i], hi}, cfg_.workers[i]});
    }
    tuner_ = MicroBatchTuner(n_stages());
    metrics_.micro_batches = micro_batches();
  }
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  ~Coordinator() {
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
  const ModelIdentity& identity() const { return id_; }
  const Model& model() const { return *cfg_.model; }
  uint32_t ctx() const { return ctx_; }
  const Tokenizer* tokenizer() const { return tok_; }
  const std::vector<Hop>& hops() const { return hops_; }
  std::size_t n_stages() const { return hops_.size() + 1; }
  const Stage& stage() const { return *stage_; }
  LayerRange stage_range() const { return LayerRange{0, local() ? int(config_.n_layer) : cfg_.cuts.front()}; }
  // Every layer in this process: no chain.
  bool local() const { return hops_.empty(); }
  // The chain's WELCOME (after connect(); not while the scheduler runs, which may reconnect).
  const Welcome& welcome() const { return welcome_; }
  // Its stages, safe while the scheduler runs (a reconnect replaces them).
  std::vector<StageReport> stage_reports() const {
    std::lock_guard lock(metrics_mu_);
    return welcome_.stages;
  }

  // Maps and loads stage 0 (may run while connect() waits for the workers to load theirs).
  void load_stage() { stage_ = std::make_unique<Stage>(cfg_.model, stage_range(), stage_options()); }

  // The handshake; throws naming the hop. Called before start(), and again by the scheduler after the
  // chain was lost.
  void connect() {
    if (local()) {
      std::lock_guard lock(metrics_mu_);
      metrics_.link_up = true;
      ++metrics_.link_epoch;
      return;
    }
    ChainSpec spec;
    spec.id = id_;
    spec.ctx = ctx_;
    spec.hops = hops_;
    spec.coordinator = stage_ ? NumericProfile{stage_->kernel_profile(), stage_->threads()}
                              : NumericProfile{Stage::kernel_profile_for(*cfg_.model, stage_options()),
                                               ThreadPool::resolve(cfg_.threads)};
    spec.timeouts = cfg_.timeouts;
    spec.load_wait = cfg_.load_wait;
    spec.authenticate = cfg_.authenticate;
    auto link = std::make_unique<MuxLink>(
        spec,
        [this](ChainReply r) {
          {
            std::lock_guard lock(mu_);
            replies_.push_back(std::move(r));
          }
          cv_.notify_all();
        },
        [this](const std::string& why) {
          {
            std::lock_guard lock(mu_);
            link_dead_ = true;
            link_error_ = why;
          }
          cv_.notify_all();
        });
    link_ = std::move(link);
    std::lock_guard lock(metrics_mu_);
    welcome_ = link_->welcome();
    metrics_.link_up = true;
    metrics_.link_error.clear();
    ++metrics_.link_epoch;
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

  CoordinatorMetrics metrics() const {
    std::lock_guard lock(metrics_mu_);
    CoordinatorMetrics m = metrics_;
    const auto now = SteadyClock::now();
    uint64_t recent = 0;
    for (const auto& [t, n] : recent_)
      if (now - t <= std::chrono::seconds(10)) recent += n;
    const double window = std::min(10.0, std::chrono::duration<double>(now - started_).count());
    m.tokens_per_second = window > 0 ? double(recent) / window : 0.0;
    return m;
  }

  // Rows of a prompt with `left` rows to go fed in the next entry, about `want` of them. A row's
  // arithmetic depends on its request's path (kernels::kBulkRows), not on the request's size: so every
  // piece of a prompt of kBulkRows rows or more is kept at kBulkRows or more, whatever `want` is, and the
  // rows take the path they take when the prompt runs in one piece. A session's output is then the same
  // however its prompt is chunked and whatever else is in the batch.
  static std::size_t feed_rows(std::size_t left, std::size_t ctx, std::size_t want = kPrefillChunk) {
    const std::size_t cap = std::min<std::size_t>(kBatchRows, ctx);  // rows one entry may carry
    const std::size_t chunk = std::clamp<std::size_t>(want, std::min(kernels::kBulkRows, cap), cap);
    if (left <= chunk) return left;
    if (left - chunk >= kernels::kBulkRows || cap <= 2 * kernels::kBulkRows) return chunk;
    return left <= cap ? left : left - kernels::kBulkRows;  // no short bulk piece at the end
  }

  // How many rows of a prompt a batch carries while other generations decode: a prompt row costs about
  // `bulk_row_s` on stage 0, a batch of decode steps `decode_batch_s`; a prompt's piece is held to half
  // of the latter (kBulkRows at least), so the streams' next tokens come about 1.5x later while a long
  // prompt is fed, instead of waiting for kPrefillChunk rows (the stages are balanced, so stage 0's ratio
  // is every stage's). Estimates from stage 0's compute, exponentially averaged; before any, kBulkRows.
  struct PrefillPace {
    double decode_batch_s = 0, bulk_row_s = 0;
    std::size_t rows() const {
      if (decode_batch_s <= 0 || bulk_row_s <= 0) return kernels::kBulkRows;
      const double r = 0.5 * decode_batch_s / bulk_row_s;
      if (!(r < double(kPrefillChunk))) return kPrefillChunk;
      return std::max(kernels::kBulkRows, std::size_t(r) / kernels::kBulkRows * kernels::kBulkRows);
    }
    // One stage-0 forward of `bulk` prompt rows (pieces of kBulkRows or more) and `other` rows.
    void observe(std::size_t bulk, std::size_t other, double seconds) {
      auto avg = [](double& a, double x) { a = a > 0 ? 0.8 * a + 0.2 * x : x; };
      if (bulk == 0) {
        if (other > 0) avg(decode_batch_s, seconds);
        return;
      }
      // The decode rows' share is estimated, and capped so a prompt row never looks nearly free.
      const double rest = other > 0 ? std::min(decode_batch_s, 0.75 * seconds) : 0.0;
      avg(bulk_row_s, (seconds - rest) / double(bulk));
    }
  };

  // --micro-batches 0: how many micro-batches the decoding sessions are split into, chosen by measuring.
  // One per stage keeps every stage busy, but each micro-batch streams every stage's weights again; one
  // batch streams them once per round of tokens and leaves all stages but one idle. Which serves more
  // tokens depends on how a step's cost grows with its rows (weight type, kernels, threads, shared or
  // separate cores), so both are tried while at least two sessions decode: a window of decode replies
  // under each count (the first replies after a switch are skipped: they were sent under the old count),
  // then the faster one, with one window of the other after kExploitWindows to follow a changed load;
  // each look that finds the other still slower doubles the wait for the next (up to kMaxExploitWindows:
  // a look costs a window at the slower count and two switches). A window that saw prompt rows or a
  // change in the number of decoding sessions is discarded.
  struct MicroBatchTuner {
    static constexpr std::size_t kExploitWindows = 8, kMaxExploitWindows = 64;
    std::size_t stages = 1;
    std::size_t pick = 1;               // 0: one micro-batch, 1: one per stage
    double rate[2] = {0, 0};            // tokens/s measured for each, exponentially averaged
    std::size_t rate_live[2] = {0, 0};  // the decoding sessions those rates were measured with
    std::size_t skip = 0, replies = 0, live = 0, exploit = 0;
    std::size_t wait = kExploitWindows;  // exploit windows before the next look at the other count
    bool looking = false;                // this window is such a look
    uint64_t tokens = 0;
    SteadyClock::time_point start{};
    uint64_t switches = 0;

    explicit MicroBatchTuner(std::size_t n_stages = 1) : stages(n_stages) {}
    std::size_t count() const { return pick == 0 || stages < 2 ? 1 : stages; }

    // A BRES at `now` that produced `produced` tokens while `decoding` sessions decoded; `prompt`: a
    // batch carried prompt rows (kBulkRows or more of one prompt) since the last reply.
    void observe(SteadyClock::time_point now, uint64_t produced, std::size_t decoding, bool prompt) {
      if (stages < 2) return;
      if (skip > 0) {
        --skip;
        restart(now, decoding);
        return;
      }
      if (decoding < 2 || prompt || decoding != live) return restart(now, decoding);
      tokens += produced;
      if (++replies < 2 * stages || tokens < 4 * decoding) return;
      const double r = double(tokens) / std::max(1e-6, std::chrono::duration<double>(now - start).count());
      rate[pick] = rate_live[pick] == decoding && rate[pick] > 0 ? 0.7 * rate[pick] + 0.3 * r : r;
      rate_live[pick] = decoding;
      const std::size_t other = 1 - pick;
      const bool was_looking = std::exchange(looking, false);
      std::size_t next = pick;
      if (rate_live[other] != decoding) {
        next = other;  // not measured with this load yet
      } else if (rate[other] > rate[pick]) {
        next = other;
        // A look that found the other still the faster: look again later each time it does.
        wait = was_looking ? std::min(2 * wait, kMaxExploitWindows) : kExploitWindows;
      } else if (++exploit >= wait) {
        next = other;  // a look at the other: the load or the host may have changed
        looking = true;
      } else if (was_looking) {
        wait = kExploitWindows;  // the look found this count the faster: the host changed
      }
      if (next != pick) {
        exploit = 0;
        pick = next;
        ++switches;
        skip = stages;
      }
      restart(now, decoding);
    }

   private:
    void restart(SteadyClock::time_point now, std::size_t decoding) {
      start = now, tokens = 0, replies = 0, live = decoding;
    }
  };

 private:
  struct Submission {
    std::vector<int32_t> prompt;
    GenParams params;
    std::shared_ptr<GenStream> out;
    std::shared_ptr<Conversation> conv;
    SteadyClock::time_point t_submit;
  };

  enum class State { opening, ready, in_flight, idle };

  // One answered entry, kept to replay the session into a new chain (resume).
  struct Step {
    uint32_t rows = 0;
    int32_t token = 0;
  };

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
    // With resume: every row fed and every entry answered, and how far a replay has come.
    std::vector<int32_t> fed;
    std::vector<Step> steps;
    std::size_t replay_at = SIZE_MAX;  // < steps.size(): replaying
    bool replaying() const { return replay_at < steps.size(); }
  };

  struct Sent {
    uint64_t session = 0;
    uint32_t rows = 0;
    uint8_t flags = 0;
    bool replay = false;
  };

  struct InFlight {
    std::vector<Sent> entries;
    std::vector<BatchEntry> wire;  // as sent: the BRES layout follows their flags
    SteadyClock::time_point sent;
    bool prompt = false;  // carried prompt rows (kBulkRows or more of one prompt) or a replay
  };

  StageOptions stage_options() const {
    StageOptions so;
    so.ctx = ctx_;
    so.threads = cfg_.threads;
    so.residency = cfg_.residency;
    return so;
  }

  // ---- the link ----

  void drop_link() {
    if (link_) {
      std::lock_guard lock(metrics_mu_);
      metrics_.bytes_sent_base += link_->bytes_sent();
      metrics_.bytes_received_base += link_->bytes_received();
    }
    link_.reset();  // joins the reader
    std::lock_guard lock(metrics_mu_);
    metrics_.link_up = false;
  }

  uint64_t link_bytes() const {
    std::lock_guard lock(metrics_mu_);
    return metrics_.bytes_sent_base + metrics_.bytes_received_base + (link_ ? link_->bytes() : 0);
  }

  // ---- the scheduler thread ----

  std::size_t micro_batches() const {
    return cfg_.micro_batches ? std::min(cfg_.micro_batches, n_stages()) : tuner_.count();
  }
  bool can_send() const { return (link_ || local()) && !loss_ && in_flight_.size() < micro_batches(); }

  // A send or a reply failed: the link is dropped at the end of this round of the scheduler (callers
  // may be iterating over the sessions that losing it clears).
  void defer_loss(std::string why) {
    if (!loss_) loss_ = std::move(why);
  }

  void schedule() {
    std::vector<Submission> submits;
    std::vector<ChainReply> replies;
    std::vector<std::shared_ptr<Conversation>> ends;
    auto last_send = SteadyClock::now();
    for (;;) {
      bool dead = false, cancels = false;
      std::string dead_why;
      const bool active = busy_sessions() > 0;
      const auto w0 = SteadyClock::now();
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
      const auto w1 = SteadyClock::now();
      if (active) {
        std::lock_guard lock(metrics_mu_);
        metrics_.stage0_wait_s += std::chrono::duration<double>(w1 - w0).count();
        metrics_.active_s += std::chrono::duration<double>(w1 - std::exchange(active_mark_, w1)).count();
      }
      active_mark_ = w1;
      if (dead) {
        replies.clear();  // answers on the lost connection
        lose_link(dead_why);
      }
      loss_.reset();
      for (ChainReply& r : replies) on_reply(r);
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
        send_close(kKeepaliveSession);
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

  bool stopping() {
    std::lock_guard lock(mu_);
    return stop_;
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
    if (!link_ && !local()) {
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
    s.id = random_session_id();
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
    sessions_.emplace(id, std::move(s));
    send_open(sessions_.at(id));
  }

  void send_open(const Session& s) {
    ModelHeader h;
    h.type = kTypeOpen;
    h.session = s.id;
    h.seq = next_seq_++;
    if (local()) return answer_locally(ChainReply{h, {}});
    const std::string text = encode_sampling(s.params.sampling);
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
  void send_frame(ModelHeader h, std::span<const uint8_t> payload, bool replies) {
    if (!link_ || loss_) return;
    const auto t0 = SteadyClock::now();
    try {
      link_->send(h, payload, replies);
    } catch (const std::exception& e) {
      return defer_loss(e.what());
    }
    std::lock_guard lock(metrics_mu_);
    metrics_.stage0_transfer_s += std::chrono::duration<double>(SteadyClock::now() - t0).count();
  }

  void send_close(uint64_t session) {
    ModelHeader h;
    h.type = kTypeClose;
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
      if (!tail.empty()) {
        GenStream::Piece p;
        p.text = std::move(tail);
        s.out->push(std::move(p));
      }
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

  void on_reply(const ChainReply& r) {
    if (r.h.type == kTypeStatus) return;
    if (r.h.type == kTypeOpen || r.h.type == kTypeErr) {
      const auto it = sessions_.find(r.h.session);
      if (it == sessions_.end()) return;
      Session& s = it->second;
      if (r.h.type == kTypeErr) {
        const std::string why = (link_ ? link_->who() + " reports: " : std::string()) +
                                printable(std::string_view(reinterpret_cast<const char*>(r.payload.data()), r.payload.size()), kMaxErrMessageBytes);
        if (s.out) {
          count_end(Finish::error);
          s.out->end(Finish::error, s.generated, why);
        }
        close_session(s.id);  // the stages above the refusal opened it
        return;
      }
      if (s.out && s.out->cancelled()) {
        count_end(Finish::cancelled);
        s.out->end(Finish::cancelled, s.generated);
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
    std::vector<EntryResult> results;
    try {
      results = decode_batch_res(r.payload, batch.wire, uint32_t(config_.n_vocab));
    } catch (const FrameError& e) {
      return defer_loss(e.what());
    }
    const double round_trip = std::chrono::duration<double>(SteadyClock::now() - batch.sent).count();
    const uint64_t bytes = link_bytes();
    uint64_t produced = 0;
    for (std::size_t i = 0; i < batch.entries.size(); ++i) {
      const Sent& e = batch.entries[i];
      const auto it = sessions_.find(e.session);
      if (it == sessions_.end()) continue;
      Session& s = it->second;
      s.state = State::ready;
      s.rows_in_flight = 0;
      EntryResult& res = results[i];
      if (res.token < 0 || std::size_t(res.token) >= config_.n_vocab) {
        defer_loss("a BRES carries token id " + std::to_string(res.token) + " outside the vocabulary");
        return;
      }
      if (e.replay) {
        if (!replayed(s, res.token)) continue;
      } else if (recording()) {
        const auto end = s.feed.begin() + std::ptrdiff_t(s.feed_at);
        s.fed.insert(s.fed.end(), end - std::ptrdiff_t(e.rows), end);
        s.steps.push_back(Step{e.rows, res.token});
        s.replay_at = s.steps.size();
      }
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
      if (e.replay || s.feed_at < s.feed.size()) {  // replaying, or more of the prompt to feed
        ready_.push_back(s.id);
        continue;
      }
      ++produced;
      GenStream::Piece p;
      p.token = res.token;
      p.pos = s.pos;
      p.digest = res.digest;
      p.logits = std::move(res.logits);
      p.round_trip_s = round_trip;
      p.link_bytes = bytes;
      on_token(s, std::move(p));
    }
    if (!cfg_.micro_batches) tuner_.observe(SteadyClock::now(), produced, busy_sessions(), batch.prompt);
    std::lock_guard lock(metrics_mu_);
    metrics_.batch_round_trip_s += round_trip;
    recent_.emplace_back(SteadyClock::now(), produced);
    while (!recent_.empty() && SteadyClock::now() - recent_.front().first > std::chrono::seconds(10)) recent_.pop_front();
  }

  // A replayed entry's answer: it must be the token the session had. False when the session ended.
  bool replayed(Session& s, int32_t token) {
    const Step& want = s.steps[s.replay_at];
    if (token != want.token) {
      const std::string why = "replay diverged at position " + std::to_string(s.pos) + ": the new chain sampled token " +
                              std::to_string(token) + " where the session had " + std::to_string(want.token) +
                              " (a worker with other kernels or another model file?)";
      if (s.out) {
        count_end(Finish::error);
        s.out->end(Finish::error, s.generated, why);
      }
      close_session(s.id);
      return false;
    }
    ++s.replay_at;
    return true;
  }

  void on_token(Session& s, GenStream::Piece p) {
    const int32_t t = p.token;
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
    if (tok_ && tok_->is_eog(t) && !s.params.ignore_eos) {
      s.out->push(std::move(p));  // no text and no tokens: the token and what came with it
      return finish(s, Finish::stop);
    }
    p.text = s.dec ? s.stop.feed(s.dec->feed(t)) : std::string{};
    p.tokens = {t};
    s.out->push(std::move(p));
    if (s.stop.stopped()) return finish(s, Finish::stop);
    if (s.generated >= s.params.max_tokens) return finish(s, Finish::length);
    s.feed.assign(1, t);
    s.feed_at = 0;
    s.unfed.reset();
    ready_.push_back(s.id);
  }

  bool recording() const { return cfg_.resume.count() > 0; }

  // What the next entry of `s` asks the last stage for: only an entry that produces a generated token.
  static uint8_t entry_flags(const Session& s, std::size_t rows) {
    if (s.feed_at + rows < s.feed.size()) return 0;
    return uint8_t((s.generated < s.params.digest_tokens ? kEntryDigest : 0) |
                   (s.generated < s.params.logits_tokens ? kEntryLogits : 0));
  }

  // One micro-batch: up to ceil(live / n_stages) ready sessions, stage 0's layers for all of them in
  // one pass, one BATCH frame down the chain.
  static bool prefilling(const Session& s) { return s.feed.size() - s.feed_at >= kernels::kBulkRows; }

  bool send_batch() {
    std::size_t live = 0, decoding = 0;
    for (const auto& [id, s] : sessions_) {
      if (s.state != State::ready && s.state != State::in_flight) continue;
      ++live;
      decoding += prefilling(s) ? 0 : 1;
    }
    const std::size_t cap = std::min<std::size_t>(kMaxBatchEntries, (live + micro_batches() - 1) / micro_batches());
    const std::size_t budget = std::min<std::size_t>(kBatchRows, ctx_);
    const std::size_t paced = pace_.rows();
    InFlight fl;
    std::vector<Stage::BatchEntry> run;
    std::size_t rows = 0, with_logits = 0, bulk = 0;
    while (!ready_.empty() && fl.entries.size() < std::max<std::size_t>(cap, 1) && rows < budget) {
      Session& s = sessions_.at(ready_.front());
      const bool replay = s.replaying();
      std::size_t n = 0;
      if (replay) {
        n = s.steps[s.replay_at].rows;
      } else {
        // While others decode, each prompt takes a paced share (kBulkRows at least: a burst of short
        // prompts is not served one per batch).
        n = feed_rows(s.feed.size() - s.feed_at, ctx_, decoding > 0 ? paced : kPrefillChunk);
      }
      const uint8_t flags = replay ? 0 : entry_flags(s, n);
      if (n == 0 || (rows > 0 && rows + n > budget)) break;  // the next batch takes it whole
      if ((flags & kEntryLogits) && with_logits == kMaxLogitsEntries) break;
      ready_.pop_front();
      bulk += n >= kernels::kBulkRows ? n : 0;
      with_logits += (flags & kEntryLogits) ? 1 : 0;
      fl.entries.push_back(Sent{s.id, uint32_t(n), flags, replay});
      fl.wire.push_back(BatchEntry{s.id, uint64_t(s.pos), uint32_t(n), flags});
      run.push_back(Stage::BatchEntry{&*s.seq, s.pos, n});
      rows += n;
    }
    if (fl.entries.empty()) return false;
    const std::size_t E = config_.n_embd;
    if (rows_.size() < rows * E) rows_ = Buffer<float>(std::max(rows, std::size_t(kBatchRows)) * E);
    const auto t0 = SteadyClock::now();
    std::size_t off = 0;
    for (const Sent& e : fl.entries) {
      Session& s = sessions_.at(e.session);
      const std::span<const int32_t> tokens = e.replay ? std::span<const int32_t>(s.fed).subspan(std::size_t(s.pos), e.rows)
                                                       : std::span<const int32_t>(s.feed).subspan(s.feed_at, e.rows);
      stage_->embed(tokens, rows_.data() + off * E);
      off += e.rows;
    }
    stage_->forward_batch(run, rows_.data());
    const auto t1 = SteadyClock::now();
    pace_.observe(bulk, rows - bulk, std::chrono::duration<double>(t1 - t0).count());
    fl.prompt = bulk > 0 || std::any_of(fl.entries.begin(), fl.entries.end(), [](const Sent& e) { return e.replay; });
    for (const Sent& e : fl.entries) {
      Session& s = sessions_.at(e.session);
      if (!e.replay) {
        if (s.conv) s.conv->history.insert(s.conv->history.end(), s.feed.begin() + std::ptrdiff_t(s.feed_at),
                                           s.feed.begin() + std::ptrdiff_t(s.feed_at + e.rows));
        s.feed_at += e.rows;
      }
      s.pos += int64_t(e.rows);
      s.rows_in_flight = e.rows;
      s.state = State::in_flight;
    }
    ModelHeader h;
    h.seq = next_seq_++;
    h.rows = uint32_t(rows);
    fl.sent = t1;
    const std::vector<BatchEntry>& wire = in_flight_.emplace(h.seq, std::move(fl)).first->second.wire;
    if (local()) {
      head_and_sample(h, wire, run);
      std::lock_guard lock(metrics_mu_);
      ++metrics_.batches;
      metrics_.batch_rows += rows;
      metrics_.stage0_compute_s += std::chrono::duration<double>(SteadyClock::now() - t0).count();
      return true;
    }
    try {
      link_->send_batch(h, wire, std::span(reinterpret_cast<const uint8_t*>(rows_.data()), rows * E * 4));
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

  // Without a chain: what the last stage does (the final norm and the output projection of each entry's
  // last row in one pass, each token drawn at its position) and its answer, queued as if it had arrived.
  void head_and_sample(const ModelHeader& batch, std::span<const BatchEntry> wire, std::span<const Stage::BatchEntry> run) {
    const std::size_t E = config_.n_embd, V = config_.n_vocab, n = wire.size();
    if (last_.size() < n * E) last_ = Buffer<float>(n * E);
    std::size_t off = 0;
    for (std::size_t i = 0; i < n; ++i) {
      off += wire[i].rows;
      std::memcpy(last_.data() + i * E, rows_.data() + (off - 1) * E, E * sizeof(float));
    }
    logits_.resize(n * V);
    stage_->head(*run[0].seq, last_.data(), n, logits_.data());
    tokens_.resize(n);
    for (std::size_t i = 0; i < n; ++i)
      tokens_[i] = sampler_.sample(std::span<const float>(logits_.data() + i * V, V),
                                  sessions_.at(wire[i].session).params.sampling, int64_t(wire[i].pos + wire[i].rows));
    ModelHeader r = batch;
    r.type = kTypeBatchRes;
    r.rows = uint32_t(n);
    answer_locally(ChainReply{r, encode_batch_res(wire, tokens_, logits_, uint32_t(V))});
  }

  void answer_locally(ChainReply r) {
    std::lock_guard lock(mu_);
    replies_.push_back(std::move(r));
  }

  // Ends a generation with the chain's failure; a conversation's next turn rebuilds its session.
  void fail_session(Session& s, const std::string& why) {
    if (s.out) {
      count_end(Finish::error);
      s.out->end(Finish::error, s.generated, why);
    }
    if (s.conv && s.conv->session == s.id) s.conv->session = 0;
  }

  // The chain is gone. Without resume, every generation in progress ends with the reason and the next
  // one reconnects. With it: the chain is re-established and every session replayed into it.
  void lose_link(const std::string& why) {
    drop_link();
    {
      std::lock_guard lock(metrics_mu_);
      metrics_.link_error = why;
    }
    ready_.clear();
    in_flight_.clear();
    {
      std::lock_guard lock(mu_);
      replies_.clear();  // answers on the lost connection
      link_dead_ = false;
    }
    if (!recording() || !resume(why)) {
      for (auto& [id, s] : sessions_) fail_session(s, "the pipeline failed: " + why);
      sessions_.clear();
    }
  }

  // Re-establishes the chain within cfg_.resume and reopens every session for its replay. False when
  // it could not (the sessions are then ended by the caller).
  bool resume(const std::string& why) {
    const auto t0 = SteadyClock::now();
    std::size_t positions = 0;
    for (auto it = sessions_.begin(); it != sessions_.end();) {
      Session& s = it->second;
      if (s.state == State::in_flight && s.rows_in_flight) {  // not answered: fed again after the replay
        const std::size_t n = s.rows_in_flight;
        const bool was_replay = s.replaying();
        if (!was_replay) {
          s.feed_at -= n;
          if (s.conv) s.conv->history.resize(s.conv->history.size() - n);
        }
        s.rows_in_flight = 0;
      }
      if (s.state == State::idle || !s.out) {  // a conversation between turns: its next turn rebuilds it
        if (s.conv && s.conv->session == s.id) s.conv->session = 0;
        it = sessions_.erase(it);
        continue;
      }
      s.seq.emplace(stage_->new_sequence());
      s.pos = 0;
      s.replay_at = s.steps.empty() ? SIZE_MAX : 0;
      s.state = State::opening;
      positions += s.fed.size();
      ++it;
    }
    if (sessions_.empty()) return false;
    say(why + "\n  resuming: re-establishing the chain and replaying " + std::to_string(positions) + " positions of " +
        std::to_string(sessions_.size()) + " session(s) into it (for up to " + detail::seconds_text(cfg_.resume) + ")");
    std::string last = why;
    auto give_up = [&](const std::string& msg) {
      {
        std::lock_guard lock(metrics_mu_);
        metrics_.link_error = msg;  // why the chain is still down (/health), not only the failure it followed
      }
      say("not resumed: " + std::to_string(sessions_.size()) + " session(s) end with the error (" +
          msg.substr(0, msg.find(" after: ")) + ")");
      for (auto& [id, s] : sessions_) fail_session(s, msg);
      sessions_.clear();
    };
    for (int attempt = 0;; ++attempt) {
      if (SteadyClock::now() - t0 >= cfg_.resume) {
        give_up("could not resume within " + detail::seconds_text(cfg_.resume) + " (--resume) after: " + why +
                "; last error: " + last);
        return true;
      }
      if (stopping()) return false;
      if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      try {
        connect();
        break;
      } catch (const RefusedError& e) {  // the chain refuses this model or split: retrying cannot help
        give_up("cannot resume after: " + why + "; " + e.what());
        return true;
      } catch (const AuthError& e) {
        give_up("cannot resume after: " + why + "; " + e.what());
        return true;
      } catch (const std::exception& e) {
        last = e.what();
      }
    }
    for (auto& [id, s] : sessions_) send_open(s);
    const double took = std::chrono::duration<double>(SteadyClock::now() - t0).count();
    say("resumed in " + std::to_string(int64_t(took * 1e3)) + " ms: new connection " + to_hex_u64(link_->connection()) +
        ", " + std::to_string(positions) + " positions to replay");
    std::lock_guard lock(metrics_mu_);
    ++metrics_.resumes;
    metrics_.replayed_positions += positions;
    metrics_.resume_s += took;
    return true;
  }

  void say(const std::string& line) const {
    if (cfg_.log) cfg_.log(line);
  }

  void publish_gauges() {
    std::size_t ready = 0;
    for (const auto& [id, s] : sessions_) ready += s.state == State::ready ? 1 : 0;
    std::lock_guard lock(metrics_mu_);
    metrics_.sessions_active = busy_sessions();
    metrics_.queue_depth = waiting_.size();
    metrics_.sessions_ready = ready;
    metrics_.batches_in_flight = in_flight_.size();
    metrics_.prefill_pace_rows = pace_.rows();
    metrics_.micro_batches = micro_batches();
    metrics_.micro_batch_switches = tuner_.switches;
    metrics_.bytes_sent = metrics_.bytes_sent_base + (link_ ? link_->bytes_sent() : 0);
    metrics_.bytes_received = metrics_.bytes_received_base + (link_ ? link_->bytes_received() : 0);
  }

  CoordinatorConfig cfg_;
  Config config_;
  ModelIdentity id_;
  uint32_t ctx_ = 0;
  const Tokenizer* tok_ = nullptr;  // the model's, if it has one
  std::vector<Hop> hops_;
  std::unique_ptr<Stage> stage_;
  Welcome welcome_;
  std::unique_ptr<MuxLink> link_;

  // Inbox (under mu_).
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::deque<Submission> submits_;
  std::deque<ChainReply> replies_;
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
  // Without a chain: the last row of each entry, their logits, the sampler.
  Buffer<float> last_;
  std::vector<float> logits_;
  std::vector<int32_t> tokens_;
  Sampler sampler_;
  PrefillPace pace_;  // the scheduler thread's
  MicroBatchTuner tuner_;  // likewise
  SteadyClock::time_point active_mark_ = SteadyClock::now();  // end of the last wait

  struct Counters : CoordinatorMetrics {
    uint64_t bytes_sent_base = 0, bytes_received_base = 0;  // of links already closed
  };
  mutable std::mutex metrics_mu_;
  Counters metrics_;
  std::deque<std::pair<SteadyClock::time_point, uint64_t>> recent_;
  SteadyClock::time_point started_ = SteadyClock::now();
};

}  // namespace pp::net
