// The version-2 worker: one session per connection, a Stage for the range the handshake assigns, a hop to the next worker.
//
// A worker starts without a layer range. Each coordinator connection opens a session with HELLO,
// which assigns the range, the KV capacity, the sampling parameters and the rest of the chain; the
// worker connects to its next hop (if any) and passes the rest of the chain on, loads (or reuses) a
// Stage for its range, and answers WELCOME with every stage's profile. Then each FWD runs the range
// on a Sequence of its own (its own KV cache) and either goes down the chain or, on the last stage,
// is sampled; the reply comes back up the same connections. Ending the connection ends the session
// and frees its cache; downstream sessions end with it.
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
#include "pp/io/gguf.hpp"
#include "pp/io/llama_loader.hpp"
#include "pp/io/mmap.hpp"
#include "pp/kernels/simd.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/frame.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/model_link.hpp"
#include "pp/stage.hpp"
#include "pp/text/sampler.hpp"

namespace pp::net {

// How long an upstream end waits for a reply that `hops_below` workers must compute: the hop nearest
// a stalled peer times out first and its ERR, which names that peer, arrives before anyone else's
// timeout fires.
inline constexpr Millis kHopSlack{1000};
inline Millis reply_wait(Millis timeout, std::size_t hops_below) {
  if (timeout == kNoTimeout) return timeout;
  return timeout + kHopSlack * static_cast<int64_t>(hops_below > 0 ? hops_below - 1 : 0);
}

inline NumericProfile local_profile(unsigned threads) { return NumericProfile{simd::Best::name(), threads}; }

struct ModelWorkerOptions {
  std::string path;            // the GGUF file (already resolved)
  unsigned threads = 0;        // compute threads per stage; 0 = hardware concurrency
  uint32_t max_ctx = 0;        // largest KV capacity a HELLO may ask for; 0 = min(4096, model context)
  bool prefetch = true;        // fault in a stage's tensors when it loads
  Residency residency = Residency::Mapped;
  Timeouts link;               // the hop to the next worker: connect / stall timeout
  Millis load_wait{120000};    // waiting for the next hop's WELCOME (it loads its stage first)
};

class ModelWorker {
 public:
  using Log = std::function<void(const std::string&)>;

  // Reads the file's header only (fingerprint and geometry); stages map their tensors per session.
  ModelWorker(ModelWorkerOptions opt, Log log) : opt_(std::move(opt)), log_(std::move(log)) {
    MappedFile f(opt_.path);
    const gguf::File g = gguf::parse(f.bytes());
    const Config c = llama::read_config(g);
    id_ = identify_model(f.bytes(), g, c, opt_.path);
    const uint32_t model_ctx = static_cast<uint32_t>(std::min<std::size_t>(c.ctx_len, llama::kMaxCtx));
    if (opt_.max_ctx == 0) opt_.max_ctx = std::min<uint32_t>(4096, model_ctx);
  }

  const ModelIdentity& identity() const { return id_; }
  uint32_t max_ctx() const { return opt_.max_ctx; }
  std::size_t active_sessions() const { return active_.load(); }

  // Serves one connection until the peer closes (returns) or the session must end (throws; the
  // server logs it). Every refusal is answered with an ERR first.
  void serve(Channel& up) {
    std::optional<FrameHeader> h = up.read_header();
    Session s;
    while (h) {
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
      handle(up, m, s);
      h = up.read_header();
    }
  }

  // key=value lines: what a STATUS request is answered with.
  std::string status_text() const {
    std::lock_guard lock(stats_mu_);
    std::string s = "sessions_active=" + std::to_string(active_.load()) + "\n" +
                    "sessions_total=" + std::to_string(total_) + "\n" + "model=" + id_.file + "\n" +
                    "fingerprint=" + id_.fingerprint + "\n" + "n_layer=" + std::to_string(id_.n_layer) + "\n" +
                    "n_embd=" + std::to_string(id_.n_embd) + "\n" + "max_ctx=" + std::to_string(opt_.max_ctx) + "\n" +
                    "arch=" + std::string(simd::Best::name()) + "\n" + "stages_loaded=" + loaded_ + "\n";
    return s;
  }

 private:
  // One connection's state: nothing until HELLO, then the assigned stage and its sequence.
  struct Session {
    ModelWorker* owner = nullptr;  // set once established: the destructor then counts it out
    uint64_t id = 0;
    uint32_t stage_index = 0;
    LayerRange range;
    uint32_t ctx = 0;
    SamplingParams sampling;
    std::shared_ptr<const Stage> stage;
    std::optional<Sequence> seq;
    std::optional<ModelLink> next;
    Sampler sampler;
    Buffer<float> rows;             // [>= rows, n_embd] this FWD's residual, 64-byte aligned, grown on demand
    std::vector<float> logits;      // [n_vocab] last stage
    std::vector<uint8_t> reply;     // RES payload
    uint64_t frames = 0;
    std::string name() const {
      return "session " + to_hex_u64(id) + " (stage " + std::to_string(stage_index) + ", layers [" +
             std::to_string(range.lo) + ", " + std::to_string(range.hi) + "))";
    }
    ~Session() {
      if (!owner) return;
      next.reset();  // closing the next hop ends the sessions below
      seq.reset();
      const std::size_t left = --owner->active_;
      owner->log("session " + to_hex_u64(id) + " ended after " + std::to_string(frames) + " FWD (" +
                 std::to_string(left) + " active)");
    }
  };

  static std::string to_hex_u64(uint64_t v) {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string s(16, '0');
    for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<std::size_t>(i)] = kHex[v & 15];
    return s;
  }

  void log(const std::string& line) const {
    if (log_) log_(line);
  }

  // Sends ERR (best effort: the upstream may be gone) and ends the session with the same message.
  [[noreturn]] void fail(Channel& up, const ModelHeader& about, const std::string& message) {
    try {
      send_model_err(up, about, message);
    } catch (const Error&) {
    }
    throw Error(message);
  }

  void handle(Channel& up, const ModelHeader& m, Session& s) {
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
      case kTypeFwd: return forward(up, m, s);
      default:
        fail(up, m, "unexpected " + model_type_name(m.type) + " (a worker accepts HELLO, FWD, STATUS)");
    }
  }

  void hello(Channel& up, const ModelHeader& m, Session& s) {
    if (s.owner) fail(up, m, "HELLO on a connection whose session is already established");
    Hello hello;
    try {
      hello = decode_hello(read_text(up, m.payload_bytes, "HELLO"));
      check_hello(hello, id_, opt_.max_ctx);
    } catch (const HandshakeError& e) {
      fail(up, m, e.what());
    } catch (const FrameError& e) {
      fail(up, m, e.what());
    }
    s.id = m.session;
    s.stage_index = hello.stage;
    s.range = hello.chain.front().range;
    s.ctx = hello.ctx;
    s.sampling = hello.sampling;
    std::string welcome_text;
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
        s.next->send_hello(down, s.id);
      }
      s.stage = stage_for(s.range, s.ctx);
      s.seq.emplace(s.stage->new_sequence());
      Welcome w;
      w.stages.push_back(StageReport{hello.stage, s.range, local_profile(s.stage->threads()), s.ctx,
                                     s.stage->bytes_used(), hello.chain.front().peer.str()});
      if (s.next) {
        const Welcome below = s.next->read_welcome(reply_wait(load_wait, hello.chain.size() - 1));
        w.stages.insert(w.stages.end(), below.stages.begin(), below.stages.end());
      }
      welcome_text = encode_welcome(w);
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
    if (!hello.coordinator.arch.empty() && hello.coordinator.arch != simd::Best::name())
      log(s.name() + ": the coordinator's kernels are " + hello.coordinator.arch + ", this worker's " +
          simd::Best::name() + ": its byte-identity check is not expected to pass");
    ModelHeader r = m;
    r.type = kTypeWelcome;
    send_model_text(up, r, welcome_text);
  }

  void forward(Channel& up, const ModelHeader& m, Session& s) {
    if (!s.owner) fail(up, m, "FWD before HELLO: the handshake assigns the layer range first");
    const ModelGeometry g{id_.n_embd, id_.n_vocab, s.ctx};
    try {
      check_fwd_v2(m, g, static_cast<uint32_t>(s.range.lo), static_cast<uint32_t>(s.range.hi), s.id);
    } catch (const FrameError& e) {
      fail(up, m, e.what());  // before any byte of the payload is read or allocated
    }
    const std::size_t n = m.rows;
    if (s.rows.size() < n * id_.n_embd) s.rows = Buffer<float>(n * id_.n_embd);  // after the checks above
    up.read_into(std::span(reinterpret_cast<uint8_t*>(s.rows.data()), m.payload_bytes), "FWD payload");
    ++s.frames;
    try {
      s.stage->forward(*s.seq, static_cast<int64_t>(m.pos), s.rows.data(), n);
    } catch (const RequestError& e) {
      fail(up, m, s.name() + ": " + e.what());
    }
    ModelHeader r = m;
    r.type = kTypeRes;
    if (s.next) {
      ModelHeader down = m;
      down.layer_lo = static_cast<uint32_t>(s.next->hop().range.lo);
      down.layer_hi = static_cast<uint32_t>(s.next->hop().range.hi);
      try {
        s.next->send_fwd(down, std::span(reinterpret_cast<const uint8_t*>(s.rows.data()), m.payload_bytes));
        s.next->read_res(down, id_.n_vocab, s.reply);
      } catch (const Error& e) {
        fail(up, m, e.what());  // names the next hop and its stage
      }
    } else {
      s.logits.resize(id_.n_vocab);
      s.stage->head(*s.seq, s.rows.data() + (n - 1) * id_.n_embd, 1, s.logits.data());
      // The token occupies the position after the last row: the same (seed, position) rule as pp_generate.
      const int32_t token = s.sampler.sample(s.logits, s.sampling, static_cast<int64_t>(m.pos + n));
      s.reply = encode_res(token, m.flags, s.logits);
    }
    send_model(up, r, s.reply);
  }

  // The stage for (range, ctx): shared by every session that asks for it; loading one evicts stages no
  // session uses any more, so a worker re-split between sessions does not keep both splits resident.
  std::shared_ptr<const Stage> stage_for(LayerRange r, uint32_t ctx) {
    std::lock_guard lock(load_mu_);
    const auto key = std::make_tuple(r.lo, r.hi, ctx);
    if (auto it = stages_.find(key); it != stages_.end()) return it->second;
    std::erase_if(stages_, [](const auto& kv) { return kv.second.use_count() == 1; });
    StageOptions so;
    so.ctx = ctx;
    so.threads = opt_.threads;
    so.prefetch = opt_.prefetch;
    so.residency = opt_.residency;
    auto st = std::make_shared<const Stage>(opt_.path, r, so);
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
        std::to_string(st->bytes_used()) + " bytes of weights, " + std::to_string(st->threads()) + " threads");
    return st;
  }

  ModelWorkerOptions opt_;
  Log log_;
  ModelIdentity id_;
  std::mutex load_mu_;
  std::map<std::tuple<int, int, uint32_t>, std::shared_ptr<const Stage>> stages_;
  mutable std::mutex stats_mu_;
  std::atomic<std::size_t> active_{0};
  uint64_t total_ = 0;
  std::string loaded_;  // "lo-hi@ctx,..." for STATUS
};

}  // namespace pp::net
