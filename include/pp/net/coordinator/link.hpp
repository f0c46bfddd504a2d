// The coordinator's multiplexed connection to the first worker: the handshake that sets the chain up, and a reader thread for its replies.
//
// One thread (the scheduler) sends; the reader thread takes every reply (OPEN acks, BRES, ERR,
// STATUS) and hands it to a callback. A reply is bounded before its payload is read: a BRES by the
// size its BATCH's entries fix, anything else by kMaxTextPayload. A frame the chain owes for longer
// than the reply wait, a closed connection or a connection-level ERR ends the link (`on_dead`).
#pragma once

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pp/core/error.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/model_link.hpp"
#include "pp/net/mux_frame.hpp"

namespace pp::net {

// A nonzero random id (sessions, connections).
inline uint64_t random_session_id() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32)};
  std::lock_guard lock(mu);
  uint64_t v = 0;
  while (v == 0) v = rng();
  return v;
}

// What the coordinator asks the chain for in HELLO.
struct ChainSpec {
  ModelIdentity id;
  uint32_t ctx = 0;
  std::vector<Hop> hops;        // chain order; hops[0] is the first worker
  NumericProfile coordinator;   // this process's kernels, passed down for the workers' logs
  Timeouts timeouts;
  Millis load_wait{120000};
  // Runs on the connection before HELLO (authentication, when the chain asks for it).
  std::function<void(Channel&)> authenticate;
};

// A reply from the chain.
struct ChainReply {
  ModelHeader h;
  std::vector<uint8_t> payload;
};

class MuxLink {
 public:
  using OnReply = std::function<void(ChainReply)>;
  using OnDead = std::function<void(const std::string&)>;

  // Connects, authenticates, sends HELLO (mux=1) and checks WELCOME: every stage with the range it
  // was assigned, and every one multiplexed. Throws naming the hop (RefusedError / AuthError when a
  // worker refuses for good). Then starts the reader.
  MuxLink(const ChainSpec& spec, OnReply on_reply, OnDead on_dead)
      : on_reply_(std::move(on_reply)), on_dead_(std::move(on_dead)), n_vocab_(spec.id.n_vocab) {
    Hello hello;
    hello.model = spec.id;
    hello.ctx = spec.ctx;
    hello.from = uint32_t(spec.hops.front().range.lo);
    hello.stage = 1;
    hello.chain = spec.hops;
    hello.coordinator = spec.coordinator;
    auto ms = [](Millis t) { return t == kNoTimeout ? 0u : uint32_t(std::min<int64_t>(t.count(), 86400000)); };
    hello.timeout_ms = ms(spec.timeouts.io);
    hello.load_timeout_ms = ms(spec.load_wait);
    hello.mux = true;
    reply_wait_ = reply_wait(spec.timeouts.io, spec.hops.size());
    link_ = std::make_unique<ModelLink>(spec.hops.front(), 1, spec.timeouts, reply_wait_);
    if (spec.authenticate) spec.authenticate(link_->channel());  // before HELLO: nothing goes to an impostor
    connection_ = random_session_id();
    link_->send_hello(hello, connection_);
    Welcome w = link_->read_welcome(reply_wait(spec.load_wait, spec.hops.size()));
    const std::string& who = link_->who();
    if (w.stages.size() != spec.hops.size())
      throw Error(who + ": WELCOME reports " + std::to_string(w.stages.size()) + " stages, the chain has " +
                  std::to_string(spec.hops.size()));
    for (std::size_t i = 0; i < spec.hops.size(); ++i)
      if (w.stages[i].range != spec.hops[i].range || w.stages[i].stage != i + 1)
        throw Error(who + ": WELCOME reports stage " + std::to_string(w.stages[i].stage) + " with layers [" +
                    std::to_string(w.stages[i].range.lo) + ", " + std::to_string(w.stages[i].range.hi) +
                    "), expected stage " + std::to_string(i + 1) + " with [" + std::to_string(spec.hops[i].range.lo) +
                    ", " + std::to_string(spec.hops[i].range.hi) + ")");
    if (!w.mux)
      throw RefusedError(who + ": the chain does not accept multiplexed sessions (no mux=1 in WELCOME): a worker "
                               "runs an older pp_node; every worker must be this version");
    link_->channel().set_timeouts(Timeouts{spec.timeouts.io, kNoTimeout});
    welcome_ = std::move(w);
    first_range_ = spec.hops.front().range;
    reader_ = std::thread([this] { read(); });
  }
  MuxLink(const MuxLink&) = delete;
  MuxLink& operator=(const MuxLink&) = delete;

  // Stops the reader; closing the connection ends every session on every stage.
  ~MuxLink() {
    stop_.store(true);
    ::shutdown(link_->channel().fd().get(), SHUT_RDWR);
    if (reader_.joinable()) reader_.join();
  }

  const Welcome& welcome() const { return welcome_; }
  const std::string& who() const { return link_->who(); }
  uint64_t connection() const { return connection_; }
  uint64_t bytes_sent() const { return link_->bytes_sent(); }
  uint64_t bytes_received() const { return link_->bytes_received(); }
  uint64_t bytes() const { return bytes_sent() + bytes_received(); }

  // A frame other than BATCH; `replies`: the chain owes an answer (the stall timer counts it).
  void send(ModelHeader h, std::span<const uint8_t> payload, bool replies) {
    h.layer_lo = uint32_t(first_range_.lo);
    h.layer_hi = uint32_t(first_range_.hi);
    if (replies) note_sent();
    send_model(link_->channel(), h, payload);
    link_->count_sent(kModelHeaderBytes + payload.size());
  }

  // One BATCH; its BRES must be exactly the size its entries fix.
  void send_batch(ModelHeader h, std::span<const BatchEntry> entries, std::span<const uint8_t> rows) {
    h.type = kTypeBatch;
    h.session = connection_;
    h.layer_lo = uint32_t(first_range_.lo);
    h.layer_hi = uint32_t(first_range_.hi);
    {
      std::lock_guard lock(expect_mu_);
      expected_[h.seq] = batch_res_bytes(entries, n_vocab_);
    }
    note_sent();
    const std::vector<uint8_t> table = encode_batch_table(entries);
    link_->count_sent(net::send_batch(link_->channel(), h, table, rows));
  }

 private:
  void note_sent() {
    if (outstanding_.fetch_add(1) == 0) last_progress_.store(std::chrono::steady_clock::now().time_since_epoch().count());
  }

  void read() {
    Channel& ch = link_->channel();
    const std::string who = link_->who();
    try {
      while (!stop_.load()) {
        if (!detail::wait_ready(ch.fd().get(), POLLIN, Millis{200})) {
          const auto since = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(last_progress_.load()));
          if (outstanding_.load() > 0 && reply_wait_ != kNoTimeout && std::chrono::steady_clock::now() - since > reply_wait_)
            throw NetError(NetError::Kind::timeout, who + ": no reply within " + detail::seconds_text(reply_wait_));
          continue;
        }
        const std::optional<FrameHeader> fh = ch.read_header();
        if (stop_.load()) return;
        if (!fh) throw NetError(NetError::Kind::closed, who + ": closed the connection");
        if (fh->version != kVersionModel) {
          const std::string text = fh->type == kTypeErr ? read_text(ch, fh->payload_bytes, "ERR") : "";
          throw FrameError(who + ": answered with version " + std::to_string(fh->version) + " " + text);
        }
        ChainReply r;
        r.h = read_extension(ch, *fh);
        if (r.h.type != kTypeBatchRes && r.h.type != kTypeOpen && r.h.type != kTypeErr && r.h.type != kTypeStatus)
          throw FrameError(who + ": sent " + model_type_name(r.h.type) + " on the multiplexed connection");
        if (r.h.type == kTypeBatchRes) {
          std::lock_guard lock(expect_mu_);
          const auto it = expected_.find(r.h.seq);
          if (it == expected_.end())
            throw FrameError(who + ": BRES seq " + std::to_string(r.h.seq) + " answers no BATCH in flight");
          if (r.h.payload_bytes != it->second)
            throw FrameError(who + ": BRES seq " + std::to_string(r.h.seq) + " payload_bytes " +
                             std::to_string(r.h.payload_bytes) + " != " + std::to_string(it->second) +
                             " (what its BATCH's entries ask for)");
          expected_.erase(it);
        } else if (r.h.payload_bytes > kMaxTextPayload) {
          throw FrameError(who + ": " + model_type_name(r.h.type) + " payload_bytes " + std::to_string(r.h.payload_bytes) +
                           " > limit " + std::to_string(kMaxTextPayload));
        }
        r.payload.resize(r.h.payload_bytes);
        ch.read_into(r.payload, "reply payload");
        link_->count_received(kModelHeaderBytes + r.payload.size());
        if (r.h.type == kTypeErr && r.h.session == connection_) {
          const std::string text = who + " reports: " + std::string(r.payload.begin(), r.payload.end());
          if (r.h.flags & kErrPermanent) throw RefusedError(text);
          throw Error(text);
        }
        if (r.h.type != kTypeStatus) {
          outstanding_.fetch_sub(1);
          last_progress_.store(std::chrono::steady_clock::now().time_since_epoch().count());
        }
        on_reply_(std::move(r));
      }
    } catch (const std::exception& e) {
      if (!stop_.load()) on_dead_(e.what());
    }
  }

  OnReply on_reply_;
  OnDead on_dead_;
  uint32_t n_vocab_ = 0;
  std::unique_ptr<ModelLink> link_;
  Welcome welcome_;
  LayerRange first_range_;
  uint64_t connection_ = 0;
  Millis reply_wait_{10000};
  std::thread reader_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> outstanding_{0};    // frames sent that the chain still owes a reply
  std::atomic<int64_t> last_progress_{0};  // steady_clock ticks of the last reply (or the first send)
  std::mutex expect_mu_;
  std::map<uint32_t, uint64_t> expected_;  // BATCH seq -> its BRES payload bytes
};

}  // namespace pp::net
