// The version-2 worker: a Stage for the range each connection's handshake assigns, a hop to the next worker, and the connection's sessions.
//
// A worker starts without a layer range. A coordinator connection sends HELLO (with mux=1), which
// assigns the range, the KV capacity and the rest of the chain; the worker connects to its next hop
// (if any) and passes the rest of the chain on, loads (or reuses) a Stage for its range, and answers
// WELCOME with every stage's profile. From then on the connection carries many sessions (OPEN, BATCH,
// CLOSE: mux_worker.hpp). Ending the connection ends its sessions and frees their caches; the
// connections below end with it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "pp/core/buffer.hpp"
#include "pp/core/error.hpp"
#include "pp/core/hex.hpp"
#include "pp/core/printable.hpp"
#include "pp/io/gguf.hpp"
#include "pp/io/held_file.hpp"
#include "pp/io/llama_loader.hpp"
#include "pp/io/mmap.hpp"
#include "pp/kernels/simd.hpp"
#include "pp/net/auth.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/frame.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/model_link.hpp"
#include "pp/net/mux_worker.hpp"
#include "pp/net/probe.hpp"
#include "pp/stage.hpp"
#include "pp/text/sampler.hpp"

namespace pp::net {

inline NumericProfile local_profile(const Stage& s) { return NumericProfile{s.kernel_profile(), s.threads()}; }

// Sessions a worker keeps at once (--max-sessions): each holds a KV cache of up to
// max_ctx x layers x kv_dim x 8 bytes, so this and --max-ctx bound a worker's memory.
inline constexpr std::size_t kDefaultMaxSessions = 16;

struct ModelWorkerOptions {
  std::string path;            // the GGUF file (already resolved)
  std::string name;            // what the operator called it (an Ollama tag), for messages; empty: the file name
  unsigned threads = 0;        // compute threads per stage; 0 = hardware concurrency
  uint32_t max_ctx = 0;        // largest KV capacity a HELLO may ask for; 0 = min(4096, model context)
  bool prefetch = true;        // fault in a stage's tensors when it loads
  Residency residency = Residency::Anonymous;  // see StageOptions
  Timeouts link;               // the hop to the next worker: connect / stall timeout
  std::size_t max_sessions = kDefaultMaxSessions;  // a HELLO beyond it is refused ("worker busy")
  // When set, a connection must prove it holds this key before anything else (auth.hpp), and the
  // worker proves the same to its next hop.
  std::shared_ptr<const PresharedKey> psk;
  Millis load_wait{120000};    // waiting for the next hop's WELCOME (it loads its stage first)
};

class ModelWorker {
 public:
  using Log = std::function<void(const std::string&)>;

  // Reads the file's header only (fingerprint and geometry); stages map their tensors per session.
  // The file stays open: stages map the very file identified here, even if its path is renamed over.
  ModelWorker(ModelWorkerOptions opt, Log log)
      : opt_(std::move(opt)), log_(std::move(log)), file_(opt_.path), model_(Model::open(file_.path())) {
    const Config& c = model_->config();
    id_ = identify_model(*model_, opt_.name.empty() ? opt_.path : opt_.name);
    if (opt_.max_ctx == 0) opt_.max_ctx = static_cast<uint32_t>(model_->default_ctx());
    kv_bytes_per_layer_ = uint64_t{opt_.max_ctx} * c.kv_dim() * 2 * sizeof(float);
  }

  const ModelIdentity& identity() const { return id_; }
  uint32_t max_ctx() const { return opt_.max_ctx; }
  std::size_t active_connections() const { return active_.load(); }
  std::size_t max_sessions() const { return opt_.max_sessions; }
  bool requires_key() const { return opt_.psk != nullptr; }
  // KV bytes one session holds per layer of its range at --max-ctx (K and V, f32).
  uint64_t kv_bytes_per_layer() const { return kv_bytes_per_layer_; }

  // A place among the worker's --max-sessions, held from HELLO until the session's memory is freed.
  class SessionSlot {
   public:
    SessionSlot() = default;
    explicit SessionSlot(std::atomic<std::size_t>* count) : count_(count) {}
    SessionSlot(SessionSlot&& o) noexcept : count_(std::exchange(o.count_, nullptr)) {}
    SessionSlot& operator=(SessionSlot&& o) noexcept {
      if (this != &o) {
        release();
        count_ = std::exchange(o.count_, nullptr);
      }
      return *this;
    }
    SessionSlot(const SessionSlot&) = delete;
    SessionSlot& operator=(const SessionSlot&) = delete;
    ~SessionSlot() { release(); }
    explicit operator bool() const { return count_ != nullptr; }

   private:
    void release() {
      if (count_) count_->fetch_sub(1);
      count_ = nullptr;
    }
    std::atomic<std::size_t>* count_ = nullptr;
  };

  // A slot, or an empty one when --max-sessions are in use: taken before any stage or cache is made.
  SessionSlot reserve_session() {
    std::size_t n = slots_.load();
    while (n < opt_.max_sessions)
      if (slots_.compare_exchange_weak(n, n + 1)) return SessionSlot(&slots_);
    return {};
  }
  std::string busy_text() const {
    return "worker busy: all " + std::to_string(opt_.max_sessions) +
           " sessions of this worker's --max-sessions are in use; try again when one ends";
  }

  // Serves one connection until the peer closes (returns) or the session must end (throws; the
  // server logs it). Every refusal is answered with an ERR first.
  void serve(Channel& up) {
    // Until the upstream has proved itself, the connection is pending (the server may close it for a
    // newer one) and may not sit idle: the first frame must start within the stall timeout, and with a
    // key the whole exchange must be done within kAuthBudget, however the peer paces its bytes.
    const Timeouts timeouts = up.timeouts();
    bool admitted = !opt_.psk;
    bool proven = false;  // no longer pending: the session's waits from here on
    auto prove = [&] {
      up.clear_deadline();
      up.mark_trusted();
      up.set_timeouts(timeouts);
      proven = true;
    };
    up.set_timeouts(Timeouts{timeouts.io, timeouts.io});
    if (!admitted)
      up.set_deadline(Deadline::in(kAuthBudget, "authentication must be done within {} of connecting"));
    std::optional<FrameHeader> h = up.read_header();
    Session s;
    while (h) {
      if (!admitted && h->version != kVersionModel) {
        const std::string why = "authentication failed: this worker requires a pre-shared key (a version-2 AUTH "
                                "exchange before anything else)";
        up.send_err(*h, why);
        throw AuthError(why);
      }
      if (h->version == kVersionPlaceholder) {
        up.send_err(*h, "this worker runs a model ('" + id_.file + "', " + std::to_string(id_.n_layer) +
                            " layers) and speaks version " + std::to_string(kVersionModel) +
                            "; version-1 placeholder frames need a worker started without --model");
        throw FrameError("version-1 " + frame_type_name(h->type) + " refused: this worker runs a model");
      }
      if (h->version != kVersionModel) {
        // Answered in the version-1 layout, the one every PCPL reader can parse.
        const FrameError e("version " + std::to_string(h->version) + " is not spoken here: this worker runs a model and speaks version " +
                           std::to_string(kVersionModel) + " (and answers version 1 with an ERR)");
        up.send_err(*h, e.what());
        throw e;
      }
      const ModelHeader m = read_extension(up, *h);
      if (admitted) {
        if (!proven) prove();  // without a key: a well-formed version-2 header is all a peer can prove
        handle(up, m, s);
      } else {
        admit_upstream(up, m, *opt_.psk);  // throws (after an ERR) unless the upstream holds the key
        admitted = true;
        prove();
      }
      h = up.read_header();
    }
    if (s.mux) s.mux->drain();  // an orderly end (a half-close, say): the replies still owed go up first
  }

  // What a connection over the server's limit is told, in the version this worker speaks.
  static void refuse(Channel& up, const std::string& why) { send_model_err(up, ModelHeader{}, why); }

  // key=value lines: what a STATUS request is answered with.
  std::string status_text() const {
    std::lock_guard lock(stats_mu_);
    std::string s = "connections_active=" + std::to_string(active_.load()) + "\n" +
                    "connections_total=" + std::to_string(total_) + "\n" + "model=" + id_.file + "\n" +
                    "fingerprint=" + id_.fingerprint + "\n" + "n_layer=" + std::to_string(id_.n_layer) + "\n" +
                    "n_embd=" + std::to_string(id_.n_embd) + "\n" + "max_ctx=" + std::to_string(opt_.max_ctx) + "\n" +
                    "max_sessions=" + std::to_string(opt_.max_sessions) + "\n" +
                    "arch=" + std::string(simd::Best::name()) + "\n" + "stages_loaded=" + loaded_ + "\n";
    return s + mux_stats_.text();
  }

 private:
  // One connection's state: nothing until HELLO, then the assigned stage, the next hop and the sessions.
  struct Session {
    ModelWorker* owner = nullptr;  // set once established: the destructor then counts it out
    uint64_t id = 0;
    uint32_t stage_index = 0;
    LayerRange range;
    uint32_t ctx = 0;
    std::shared_ptr<const Stage> stage;
    std::optional<ModelLink> next;
    std::unique_ptr<MuxConnection> mux;  // the connection's sessions
    std::string name() const {
      return "connection " + to_hex_u64(id) + " (stage " + std::to_string(stage_index) + ", layers [" +
             std::to_string(range.lo) + ", " + std::to_string(range.hi) + "))";
    }
    ~Session() {
      mux.reset();  // frees the sessions' caches and stops the relay before the next hop closes
      if (!owner) return;
      next.reset();  // closing the next hop ends the connections below
      const std::size_t left = --owner->active_;
      owner->log("connection " + to_hex_u64(id) + " ended (" + std::to_string(left) + " active)");
    }
  };

  void log(const std::string& line) const {
    if (log_) log_(line);
  }

  // Sends ERR (best effort: the upstream may be gone) and ends the session with the same message.
  // `permanent`: another attempt cannot succeed (kErrPermanent): the coordinator stops resuming.
  [[noreturn]] void fail(Channel& up, const ModelHeader& about, const std::string& message, bool permanent = false) {
    try {
      send_model_err(up, about, message, permanent);
    } catch (const Error&) {
    }
    throw Error(message);
  }

  void handle(Channel& up, const ModelHeader& m, Session& s) {
    if (s.mux) return s.mux->handle(m);
    switch (m.type) {
      case kTypeStatus: {
        if (m.payload_bytes > kMaxTextPayload)
          fail(up, m, "STATUS: payload_bytes " + std::to_string(m.payload_bytes) + " > limit " +
                          std::to_string(kMaxTextPayload));
        up.discard_payload(m.payload_bytes);
        ModelHeader r = m;
        r.type = kTypeStatus;
        send_model_text(up, r, status_text());
        return;
      }
      case kTypeHello: return hello(up, m, s);
      case kTypeAuth:
        fail(up, m, opt_.psk ? "AUTH on a connection that has already authenticated"
                             : "authentication failed: the upstream sent AUTH (it holds a pre-shared key) but this "
                               "worker has none: start it with --psk-file or PP_NODE_PSK, or drop the upstream's key");
      case kTypeProbe: return answer_probe(up, m, opt_.path, opt_.threads, opt_.max_ctx);
      default:
        fail(up, m, "unexpected " + model_type_name(m.type) +
                        " before HELLO (a worker accepts AUTH, HELLO, STATUS, PROBE; after HELLO: OPEN, CLOSE, BATCH, STATUS)");
    }
  }

  void hello(Channel& up, const ModelHeader& m, Session& s) {
    if (s.owner) fail(up, m, "HELLO on a connection whose session is already established");
    Hello hello;
    try {
      hello = decode_hello(read_text(up, m.payload_bytes, "HELLO"));
      check_hello(hello, id_, opt_.max_ctx);
    } catch (const HandshakeError& e) {
      fail(up, m, e.what(), true);
    } catch (const FrameError& e) {
      fail(up, m, e.what(), true);
    }
    if (!hello.mux)
      fail(up, m,
           "handshake: HELLO without mux=1: this worker serves only multiplexed sessions (OPEN, BATCH, CLOSE); the "
           "coordinator runs an older pp_node: every node must be this version",
           true);
    s.id = m.session;
    s.stage_index = hello.stage;
    s.range = hello.chain.front().range;
    s.ctx = hello.ctx;
    std::string welcome_text;
    Millis mux_wait = kNoTimeout;
    try {
      // The next hop loads its stage while this one loads its own.
      // The session's waits follow the coordinator's timeouts when it sent them.
      Timeouts link = opt_.link;
      if (hello.timeout_ms) link = Timeouts{Millis{hello.timeout_ms}, Millis{hello.timeout_ms}};
      const Millis load_wait = hello.load_timeout_ms ? Millis{hello.load_timeout_ms} : opt_.load_wait;
      if (hello.chain.size() > 1) {
        Hello down = hello;
        down.from = static_cast<uint32_t>(s.range.hi);
        down.stage = hello.stage + 1;
        down.chain.erase(down.chain.begin());
        s.next.emplace(down.chain.front(), down.stage, link, reply_wait(link.io, down.chain.size()));
        mux_wait = reply_wait(link.io, down.chain.size());
        if (opt_.psk) s.next->authenticate(*opt_.psk);  // the same key on every hop
        s.next->send_hello(down, s.id);
      }
      s.stage = stage_for(s.range, s.ctx);
      Welcome w;
      w.mux = true;
      w.stages.push_back(StageReport{hello.stage, s.range, local_profile(*s.stage), s.ctx,
                                     s.stage->bytes_used(), hello.chain.front().peer.str()});
      if (s.next) {
        const Welcome below = s.next->read_welcome(reply_wait(load_wait, hello.chain.size() - 1));
        w.stages.insert(w.stages.end(), below.stages.begin(), below.stages.end());
        if (!below.mux)
          throw RefusedError(s.next->who() + " does not accept multiplexed sessions: it runs an older pp_node");
      }
      welcome_text = encode_welcome(w);
    } catch (const RefusedError& e) {
      fail(up, m, e.what(), true);
    } catch (const AuthError& e) {
      fail(up, m, e.what(), true);
    } catch (const Error& e) {
      fail(up, m, e.what());
    } catch (const std::bad_alloc&) {
      fail(up, m, "out of memory loading layers [" + std::to_string(s.range.lo) + ", " + std::to_string(s.range.hi) + ")");
    }
    // Counted before WELCOME leaves, so a STATUS sent after it sees this session.
    s.owner = this;
    std::size_t now;
    {
      std::lock_guard lock(stats_mu_);
      now = ++active_;
      ++total_;
    }
    log(s.name() + " opened from " + up.peer().str() +
        (s.next ? ", next hop " + s.next->who() : ", last stage") + " (" + std::to_string(now) + " active)");
    if (const std::string mine = s.stage->kernel_profile();
        !hello.coordinator.arch.empty() && hello.coordinator.arch != mine)
      log(s.name() + ": the coordinator's kernels are " + hello.coordinator.arch + ", this worker's " + mine +
          ": its byte-identity check is not expected to pass");
    ModelHeader r = m;
    r.type = kTypeWelcome;
    send_model_text(up, r, welcome_text);
    s.mux = std::make_unique<MuxConnection>(
          MuxSetup{id_, s.id, s.stage_index, s.range, s.ctx, s.stage, s.next ? &*s.next : nullptr, mux_wait,
                   &mux_stats_, log_, [this] { return status_text(); },
                   [this]() -> std::shared_ptr<void> {
                     SessionSlot slot = reserve_session();
                     return slot ? std::make_shared<SessionSlot>(std::move(slot)) : nullptr;
                   },
                   [this] { return busy_text(); }},
          up);
  }

  // The stage for (range, ctx): shared by every session that asks for it; loading one evicts stages no
  // session uses any more, so a worker re-split between sessions does not keep both splits resident.
  std::shared_ptr<const Stage> stage_for(LayerRange r, uint32_t ctx) {
    std::lock_guard lock(load_mu_);
    const auto key = std::make_tuple(r.lo, r.hi, ctx);
    if (auto it = stages_.find(key); it != stages_.end()) return it->second;
    std::erase_if(stages_, [](const auto& kv) { return kv.second.use_count() == 1; });
    if (file_.replaced() && !replaced_logged_) {
      replaced_logged_ = true;
      log("'" + opt_.path + "' was replaced on disk after this worker started; it keeps serving the file it "
          "identified (fingerprint " + id_.fingerprint.substr(0, 16) + "): restart it to serve the new one");
    }
    StageOptions so;
    so.ctx = ctx;
    so.threads = opt_.threads;
    so.prefetch = opt_.prefetch;
    so.residency = opt_.residency;
    auto st = std::make_shared<const Stage>(model_, r, so);
    stages_.emplace(key, st);
    std::string desc;
    for (const auto& [k, v] : stages_)
      desc += (desc.empty() ? "" : ",") + std::to_string(std::get<0>(k)) + "-" + std::to_string(std::get<1>(k)) +
              "@" + std::to_string(std::get<2>(k));
    {
      std::lock_guard slock(stats_mu_);
      loaded_ = desc;
    }
    log("loaded layers [" + std::to_string(r.lo) + ", " + std::to_string(r.hi) + ") ctx " + std::to_string(ctx) + ": " +
        format_bytes(st->bytes_used()) + " of weights, " + std::to_string(st->threads()) + " threads");
    return st;
  }

  ModelWorkerOptions opt_;
  Log log_;
  HeldFile file_;               // the model file identified at start; stages map it, not the path
  std::shared_ptr<const Model> model_;  // file_ mapped once, shared by every stage
  bool replaced_logged_ = false;  // under load_mu_
  ModelIdentity id_;
  std::atomic<std::size_t> slots_{0};  // sessions holding a SessionSlot
  uint64_t kv_bytes_per_layer_ = 0;
  std::mutex load_mu_;
  std::map<std::tuple<int, int, uint32_t>, std::shared_ptr<const Stage>> stages_;
  mutable std::mutex stats_mu_;
  std::atomic<std::size_t> active_{0};
  uint64_t total_ = 0;
  std::string loaded_;  // "lo-hi@ctx,..." for STATUS
  MuxStats mux_stats_;  // every multiplexed connection's sessions and work
};

}  // namespace pp::net
