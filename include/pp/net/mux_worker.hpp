// A worker's multiplexed connection: many sessions on one upstream connection, BATCH steps through forward_batch.
//
// After a HELLO with mux=1 the connection's frames are OPEN, CLOSE, BATCH and STATUS
// (docs/PROTOCOL-TCP.md "Multiplexed sessions"). The connection's thread reads a frame, runs it and,
// on a middle stage, sends it on to the next hop without waiting: a relay thread carries the next
// hop's replies (OPEN acks, BRES, ERR) back upstream, so several batches can be in flight on the
// chain and every stage computes while the others do. Sends upstream come from both threads and go
// out under one lock, a whole frame at a time.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
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
#include "pp/net/channel.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/model_link.hpp"
#include "pp/net/mux_frame.hpp"
#include "pp/stage.hpp"
#include "pp/text/sampler.hpp"

namespace pp::net {

// What a worker reports about its multiplexed sessions in STATUS (every connection adds to one).
struct MuxStats {
  std::atomic<uint64_t> sessions_active{0}, sessions_total{0};
  std::atomic<uint64_t> batches{0}, rows{0};
  std::atomic<uint64_t> compute_ns{0};   // forward_batch, head and sampling
  std::atomic<uint64_t> transfer_ns{0};  // reading payloads once their header arrived, and sending frames
  std::atomic<uint64_t> bytes_received{0}, bytes_sent{0};  // upstream and downstream, headers included

  std::string text() const {
    auto sec = [](uint64_t ns) { return detail::double_text(double(ns) * 1e-9); };
    return "sessions_active=" + std::to_string(sessions_active.load()) + "\n" +
           "sessions_total=" + std::to_string(sessions_total.load()) + "\n" +
           "batches=" + std::to_string(batches.load()) + "\n" + "batch_rows=" + std::to_string(rows.load()) + "\n" +
           "compute_seconds=" + sec(compute_ns.load()) + "\n" + "transfer_seconds=" + sec(transfer_ns.load()) + "\n" +
           "bytes_received=" + std::to_string(bytes_received.load()) + "\n" +
           "bytes_sent=" + std::to_string(bytes_sent.load()) + "\n";
  }
};

// Everything a multiplexed connection needs from the worker that accepted it.
struct MuxSetup {
  ModelIdentity id;
  uint64_t connection = 0;  // the HELLO's session id: BATCH frames carry it
  uint32_t stage_index = 0;
  LayerRange range;
  uint32_t ctx = 0;
  std::shared_ptr<const Stage> stage;
  ModelLink* next = nullptr;   // the next hop, or nullptr on the last stage; outlives the MuxConnection
  Millis reply_wait{10000};    // how long a frame sent down may go unanswered
  MuxStats* stats = nullptr;
  std::function<void(const std::string&)> log;
  std::function<std::string()> status;  // the STATUS reply text
  // A place among the worker's --max-sessions for one session (released when the holder is), or null
  // when every place is taken; `busy` says so. Unset: no limit but kMaxMuxSessions.
  std::function<std::shared_ptr<void>()> reserve;
  std::function<std::string()> busy;
};

class MuxConnection {
 public:
  MuxConnection(MuxSetup setup, Channel& up) : s_(std::move(setup)), up_(up) {
    if (s_.next) relay_ = std::thread([this] { relay(); });
  }
  MuxConnection(const MuxConnection&) = delete;
  MuxConnection& operator=(const MuxConnection&) = delete;

  // Stops the relay (its read is woken by shutting the next hop's socket down; the caller closes that
  // connection next, which ends every session below) and frees every session's cache.
  ~MuxConnection() {
    stopping_.store(true);
    if (s_.next) ::shutdown(s_.next->channel().fd().get(), SHUT_RDWR);
    if (relay_.joinable()) relay_.join();
    const std::size_t n = sessions_.size();
    sessions_.clear();
    s_.stats->sessions_active -= n;
    if (n) log(std::to_string(n) + " session(s) freed as the connection ended");
  }

  std::size_t sessions() const { return sessions_.size(); }

  // The upstream ended cleanly (it may have half-closed after its last BATCH): waits, at most the reply
  // wait, until the next hop has answered everything sent down, so those answers still go up.
  void drain() {
    if (!s_.next) return;
    std::unique_lock lock(wait_mu_);
    auto done = [&] { return outstanding_ == 0 || relay_done_; };
    if (s_.reply_wait == kNoTimeout) drained_.wait(lock, done);
    else drained_.wait_for(lock, s_.reply_wait, done);
  }

  // One frame from upstream (its common header and extension read, its payload not). Throws to end the
  // connection after answering ERR; per-session refusals are answered and do not throw.
  void handle(const ModelHeader& m) {
    switch (m.type) {
      case kTypeBatch: return batch(m);
      case kTypeOpen: return open(m);
      case kTypeClose: return close(m);
      case kTypeStatus: {
        if (m.payload_bytes > kMaxTextPayload) fail(m, "STATUS: payload_bytes " + std::to_string(m.payload_bytes) + " too large");
        up_.discard_payload(m.payload_bytes);
        ModelHeader r = m;
        const std::string text = s_.status();
        send_up(r, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
        return;
      }
      default:
        fail(m, "unexpected " + model_type_name(m.type) +
                    " on a multiplexed connection (it accepts OPEN, CLOSE, BATCH, STATUS)");
    }
  }

 private:
  struct Session {
    Session(std::shared_ptr<void> place, Sequence s) : slot(std::move(place)), seq(std::move(s)) {}
    std::shared_ptr<void> slot;  // first: released after the cache is freed
    Sequence seq;
    SamplingParams sampling;
  };

  void log(const std::string& line) const {
    if (s_.log)
      s_.log("connection " + to_hex_u64(s_.connection) + " (stage " + std::to_string(s_.stage_index) + "): " + line);
  }

  void send_up(ModelHeader h, std::span<const uint8_t> payload) {
    const auto t0 = std::chrono::steady_clock::now();
    {
      std::lock_guard lock(up_mu_);
      send_model(up_, h, payload);
    }
    s_.stats->bytes_sent += kModelHeaderBytes + payload.size();
    s_.stats->transfer_ns += elapsed_ns(t0);
  }

  void send_err_up(const ModelHeader& about, const std::string& message) {
    ModelHeader h = about;
    h.type = kTypeErr;
    const std::string_view text = std::string_view(message).substr(0, kMaxErrMessageBytes);
    send_up(h, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  }

  // A connection-level ERR (best effort), then the connection ends.
  [[noreturn]] void fail(const ModelHeader& about, const std::string& message) {
    ModelHeader h = about;
    h.session = s_.connection;
    try {
      send_err_up(h, message);
    } catch (const Error&) {
    }
    throw Error(message);
  }

  static uint64_t elapsed_ns(std::chrono::steady_clock::time_point t0) {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  }

  // Sends a frame to the next hop; `replies` says whether the relay must expect an answer.
  void send_down(ModelHeader h, std::span<const uint8_t> payload, bool replies) {
    h.layer_lo = uint32_t(s_.next->hop().range.lo);
    h.layer_hi = uint32_t(s_.next->hop().range.hi);
    if (replies) note_sent();
    const auto t0 = std::chrono::steady_clock::now();
    try {
      send_model(s_.next->channel(), h, payload);
    } catch (const Error& e) {
      fail(h, e.what());
    }
    s_.next->count_sent(kModelHeaderBytes + payload.size());
    s_.stats->bytes_sent += kModelHeaderBytes + payload.size();
    s_.stats->transfer_ns += elapsed_ns(t0);
  }

  void note_sent() {
    std::lock_guard lock(wait_mu_);
    if (outstanding_++ == 0) last_progress_ = std::chrono::steady_clock::now();
  }

  void open(const ModelHeader& m) {
    std::string text;
    try {
      text = read_text(up_, m.payload_bytes, "OPEN");
    } catch (const FrameError& e) {
      fail(m, e.what());  // the payload was not read: the stream cannot go on
    }
    s_.stats->bytes_received += kModelHeaderBytes + text.size();
    const std::string who = "OPEN session " + std::to_string(m.session) + ": ";
    if (m.session == kKeepaliveSession || m.session == s_.connection)
      return send_err_up(m, who + "the session id is reserved (0, or the connection's own)");
    if (sessions_.count(m.session)) return send_err_up(m, who + "already open on this connection");
    if (sessions_.size() >= kMaxMuxSessions)
      return send_err_up(m, who + "this connection already has " + std::to_string(sessions_.size()) +
                                " sessions open (limit " + std::to_string(kMaxMuxSessions) + ")");
    SamplingParams sampling;
    try {
      sampling = decode_sampling(text);
    } catch (const HandshakeError& e) {
      return send_err_up(m, who + e.what());
    }
    std::shared_ptr<void> slot;
    if (s_.reserve && !(slot = s_.reserve())) return send_err_up(m, who + (s_.busy ? s_.busy() : "worker busy"));
    try {
      auto sess = std::make_unique<Session>(std::move(slot), s_.stage->new_sequence());
      sess->sampling = sampling;
      sessions_.emplace(m.session, std::move(sess));
    } catch (const std::bad_alloc&) {
      return send_err_up(m, who + "out of memory for a KV cache of " + std::to_string(s_.ctx) + " positions");
    }
    ++s_.stats->sessions_active;
    ++s_.stats->sessions_total;
    if (s_.next) {
      send_down(m, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()), true);
    } else {
      ModelHeader ack = m;
      send_up(ack, {});
    }
  }

  void close(const ModelHeader& m) {
    if (m.payload_bytes != 0) fail(m, "CLOSE session " + std::to_string(m.session) + ": payload_bytes " +
                                          std::to_string(m.payload_bytes) + " != 0");
    s_.stats->bytes_received += kModelHeaderBytes;
    if (sessions_.erase(m.session)) --s_.stats->sessions_active;
    if (s_.next) send_down(m, {}, false);  // unknown sessions too: the stages below may hold it
  }

  void batch(const ModelHeader& m) {
    const auto t_read = std::chrono::steady_clock::now();
    const uint32_t n_embd = s_.id.n_embd;
    try {
      check_batch_header(m, ModelGeometry{n_embd, s_.id.n_vocab, s_.ctx}, uint32_t(s_.range.lo),
                         uint32_t(s_.range.hi), s_.connection);
    } catch (const FrameError& e) {
      fail(m, e.what());  // before any byte of the payload is read
    }
    uint8_t count[4];
    up_.read_into(count, "BATCH entry count");
    const uint32_t n = detail::get_be32(count);
    try {
      check_batch_count(m, n, n_embd);
    } catch (const FrameError& e) {
      fail(m, e.what());
    }
    table_.resize(4 + std::size_t(n) * kBatchEntryBytes);
    std::memcpy(table_.data(), count, 4);
    up_.read_into(std::span(table_).subspan(4), "BATCH entries");
    entries_.clear();
    for (uint32_t i = 0; i < n; ++i)
      entries_.push_back(decode_batch_entry(std::span<const uint8_t, kBatchEntryBytes>(table_.data() + 4 + i * kBatchEntryBytes, kBatchEntryBytes)));
    try {
      check_batch_entries(m, entries_);
    } catch (const FrameError& e) {
      fail(m, e.what());
    }
    batch_.clear();
    for (const BatchEntry& e : entries_) {
      const auto it = sessions_.find(e.session);
      if (it == sessions_.end())
        fail(m, "BATCH seq " + std::to_string(m.seq) + ": session " + std::to_string(e.session) +
                    " is not open on this connection");
      batch_.push_back(Stage::BatchEntry{&it->second->seq, int64_t(e.pos), e.rows});
    }
    const std::size_t rows = m.rows;
    if (rows_.size() < rows * n_embd) rows_ = Buffer<float>(rows * n_embd);  // after every check
    const std::size_t row_bytes = rows * n_embd * 4;
    up_.read_into(std::span(reinterpret_cast<uint8_t*>(rows_.data()), row_bytes), "BATCH rows");
    s_.stats->bytes_received += kModelHeaderBytes + m.payload_bytes;
    s_.stats->transfer_ns += elapsed_ns(t_read);
    for (std::size_t i = 0, off = 0; i < entries_.size(); off += entries_[i].rows, ++i) {
      const std::string bad = first_non_finite(rows_.data() + off * n_embd, entries_[i].rows, n_embd, entries_[i].pos);
      if (!bad.empty())
        fail(m, "BATCH seq " + std::to_string(m.seq) + ", session " + std::to_string(entries_[i].session) + ": " + bad);
    }

    const auto t0 = std::chrono::steady_clock::now();
    try {
      s_.stage->forward_batch(batch_, rows_.data());
    } catch (const RequestError& e) {
      fail(m, "BATCH seq " + std::to_string(m.seq) + ": " + e.what());
    }
    ++s_.stats->batches;
    s_.stats->rows += rows;
    if (s_.next) {
      s_.stats->compute_ns += elapsed_ns(t0);
      ModelHeader down = m;
      down.layer_lo = uint32_t(s_.next->hop().range.lo);
      down.layer_hi = uint32_t(s_.next->hop().range.hi);
      bool fresh = false;
      {
        // The relay bounds the BRES by what these entries ask before it reads a byte of it.
        std::lock_guard lock(wait_mu_);
        fresh = bres_bytes_.emplace(m.seq, batch_res_bytes(entries_, s_.id.n_vocab)).second;
      }
      if (!fresh) fail(m, "BATCH seq " + std::to_string(m.seq) + ": a BATCH with this seq is still unanswered below");
      note_sent();
      const auto t1 = std::chrono::steady_clock::now();
      uint64_t sent = 0;
      try {
        sent = send_batch(s_.next->channel(), down, table_,
                          std::span(reinterpret_cast<const uint8_t*>(rows_.data()), row_bytes));
      } catch (const Error& e) {
        fail(m, e.what());
      }
      s_.next->count_sent(sent);
      s_.stats->bytes_sent += sent;
      s_.stats->transfer_ns += elapsed_ns(t1);
      return;
    }
    // Last stage: the final norm and output projection of each entry's last row, in one pass.
    const std::size_t V = s_.id.n_vocab;
    if (last_.size() < n * n_embd) last_ = Buffer<float>(std::size_t(n) * n_embd);
    std::size_t off = 0;
    for (uint32_t i = 0; i < n; ++i) {
      off += entries_[i].rows;
      std::memcpy(last_.data() + i * n_embd, rows_.data() + (off - 1) * n_embd, n_embd * 4);
    }
    logits_.resize(std::size_t(n) * V);
    s_.stage->head(*batch_[0].seq, last_.data(), n, logits_.data());
    tokens_.resize(n);
    for (uint32_t i = 0; i < n; ++i) {
      const BatchEntry& e = entries_[i];
      // The token occupies the position after the entry's last row: pp_generate's (seed, position) rule.
      tokens_[i] = sampler_.sample(std::span<const float>(logits_.data() + i * V, V), sessions_[e.session]->sampling,
                                   int64_t(e.pos + e.rows));
    }
    s_.stats->compute_ns += elapsed_ns(t0);
    ModelHeader r = m;
    r.type = kTypeBatchRes;
    r.rows = n;
    send_up(r, encode_batch_res(entries_, tokens_, logits_, uint32_t(V)));
  }

  // The relay thread (middle stages): the next hop's replies, sent on upstream as they come.
  void relay() {
    Channel& down = s_.next->channel();
    const std::string who = s_.next->who();
    struct Done {
      MuxConnection& c;
      ~Done() {
        {
          std::lock_guard lock(c.wait_mu_);
          c.relay_done_ = true;
        }
        c.drained_.notify_all();
      }
    } done{*this};
    try {
      while (!stopping_.load()) {
        if (!detail::wait_ready(down.fd().get(), POLLIN, Millis{200})) {
          std::lock_guard lock(wait_mu_);
          if (outstanding_ > 0 && s_.reply_wait != kNoTimeout &&
              std::chrono::steady_clock::now() - last_progress_ > s_.reply_wait)
            throw NetError(NetError::Kind::timeout, who + ": timed out after " + detail::seconds_text(s_.reply_wait) +
                                                        " without a reply");
          continue;
        }
        const std::optional<FrameHeader> fh = down.read_header();
        if (stopping_.load()) return;
        if (!fh) throw NetError(NetError::Kind::closed, who + ": closed the connection");
        if (fh->version != kVersionModel)
          throw FrameError(who + ": sent version " + std::to_string(fh->version) + " (expected 2)");
        const auto t0 = std::chrono::steady_clock::now();
        ModelHeader h = read_extension(down, *fh);
        if (h.type != kTypeBatchRes && h.type != kTypeOpen && h.type != kTypeErr)
          throw FrameError(who + ": sent " + model_type_name(h.type) + " (expected BRES, OPEN or ERR)");
        if (h.type == kTypeBatchRes) {
          // Exactly the size the BATCH's entries asked for, checked before the payload is read.
          std::lock_guard lock(wait_mu_);
          const auto it = bres_bytes_.find(h.seq);
          if (it == bres_bytes_.end())
            throw FrameError(who + ": BRES seq " + std::to_string(h.seq) + " answers no BATCH sent to it");
          if (h.payload_bytes != it->second)
            throw FrameError(who + ": BRES seq " + std::to_string(h.seq) + " payload_bytes " +
                             std::to_string(h.payload_bytes) + " != " + std::to_string(it->second) +
                             " (token, digest and logits as the BATCH entries' flags ask)");
          bres_bytes_.erase(it);
        } else if (h.payload_bytes > kMaxTextPayload) {
          throw FrameError(who + ": " + model_type_name(h.type) + " payload_bytes " + std::to_string(h.payload_bytes) +
                           " > limit " + std::to_string(kMaxTextPayload));
        }
        payload_.resize(h.payload_bytes);
        down.read_into(payload_, "reply payload");
        s_.next->count_received(kModelHeaderBytes + h.payload_bytes);
        s_.stats->bytes_received += kModelHeaderBytes + h.payload_bytes;
        s_.stats->transfer_ns += elapsed_ns(t0);
        h.layer_lo = uint32_t(s_.range.lo);
        h.layer_hi = uint32_t(s_.range.hi);
        if (h.type == kTypeErr) {
          // Named by the hop that relays it, as single-session refusals are.
          const std::string text = who + " reports: " + std::string(payload_.begin(), payload_.end());
          if (h.session == s_.connection) throw Error(text);  // the connection below is gone
          send_err_up(h, text);  // one session's OPEN was refused below
        } else {
          send_up(h, payload_);
        }
        {
          std::lock_guard lock(wait_mu_);
          if (outstanding_ > 0) --outstanding_;
          last_progress_ = std::chrono::steady_clock::now();
        }
        drained_.notify_all();
      }
    } catch (const std::exception& e) {
      if (stopping_.load()) return;
      ModelHeader h;
      h.session = s_.connection;
      h.layer_lo = uint32_t(s_.range.lo);
      h.layer_hi = uint32_t(s_.range.hi);
      try {
        send_err_up(h, e.what());
      } catch (const std::exception&) {
      }
      log(std::string("next hop failed: ") + e.what());
      // Wakes the connection's thread, blocked reading upstream: the connection ends.
      ::shutdown(up_.fd().get(), SHUT_RDWR);
    }
  }

  MuxSetup s_;
  Channel& up_;
  std::map<uint64_t, std::unique_ptr<Session>> sessions_;  // the connection's thread only
  std::mutex up_mu_;  // one frame at a time upstream
  std::thread relay_;
  std::atomic<bool> stopping_{false};
  std::mutex wait_mu_;
  int64_t outstanding_ = 0;  // frames sent down still owed a reply
  bool relay_done_ = false;  // under wait_mu_
  std::condition_variable drained_;  // outstanding_ fell, or the relay ended
  std::map<uint32_t, uint64_t> bres_bytes_;  // seq of each BATCH sent down and not yet answered -> its BRES bytes
  std::chrono::steady_clock::time_point last_progress_{};
  // Per-frame buffers, reused.
  std::vector<uint8_t> table_;
  std::vector<BatchEntry> entries_;
  std::vector<Stage::BatchEntry> batch_;
  Buffer<float> rows_;  // [rows, n_embd]
  Buffer<float> last_;  // [n_entries, n_embd] the last row of each entry (last stage)
  std::vector<float> logits_;  // [n_entries, n_vocab]
  std::vector<int32_t> tokens_;
  Sampler sampler_;
  std::vector<uint8_t> payload_;  // the relay's
};

}  // namespace pp::net
