// pp_node's real-model coordinator: layers [0, C1) with the tokenizer and embedding, a chain of workers, streamed text, verification, report.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pp/core/buffer.hpp"
#include "pp/core/error.hpp"
#include "pp/io/gguf.hpp"
#include "pp/io/llama_loader.hpp"
#include "pp/io/mmap.hpp"
#include "pp/local_pipeline.hpp"
#include "pp/net/auth.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/latency.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/model_link.hpp"
#include "pp/net/model_worker.hpp"
#include "pp/net/sha256.hpp"
#include "pp/stage.hpp"
#include "pp/text/sampler.hpp"
#include "pp/text/tokenizer.hpp"

namespace pp::node {

constexpr int kExitOk = 0;
constexpr int kExitMismatch = 1;  // byte-identity failed (the prototype's status)
constexpr int kExitUsage = 2;
constexpr int kExitFailure = 3;   // a peer died, stalled, refused or sent garbage; or a local error

// A command line that cannot run; pp_node prints it and exits 2.
struct UsageError {
  std::string message;
};

enum class Verify { probe, all, none };

// Tokens the default bring-up probe verifies.
inline constexpr std::size_t kProbeTokens = 4;

struct ModelRunOptions {
  std::string path;                 // the resolved GGUF file
  std::vector<net::Peer> workers;   // chain order
  std::vector<int> cuts;            // empty: an even split (compute_layer_range)
  std::optional<std::string> prompt;
  std::vector<int32_t> prompt_ids;  // used when non-empty
  uint32_t tokens = 64;
  Verify verify = Verify::probe;
  SamplingParams sampling;
  bool ignore_eos = false;
  unsigned threads = 0;
  Residency residency = Residency::Anonymous;  // of the coordinator's own stage
  uint32_t ctx = 0;                 // 0: min(4096, model context)
  std::string logits_out;           // raw f32 [generated, n_vocab] of every sampled position
  std::string dump_digests;         // "pos token sha256" lines
  net::Timeouts timeouts;
  net::Millis load_wait{120000};
  std::shared_ptr<const net::PresharedKey> psk;  // when set, every worker must prove it holds it (auth.hpp)
  // After the chain fails mid-generation, keep re-establishing it this long and replay the session into
  // it (detail::resume_chain); 0 = stop with the error.
  net::Millis resume{0};
  // Set (by SIGINT/SIGTERM) to end the generation after the current token: the report and the
  // byte-identity line then cover the tokens generated so far. Null: runs to --tokens or end of generation.
  const std::atomic<bool>* stop = nullptr;
};

namespace detail {

inline std::string fixed(double v, int digits = 1) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

inline std::string range_text(LayerRange r) {
  return "[" + std::to_string(r.lo) + ", " + std::to_string(r.hi) + ")";
}

// MemAvailable in bytes, or nullopt when /proc/meminfo says nothing.
inline std::optional<uint64_t> mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return std::nullopt;
}

inline std::vector<int> validated_cuts(std::vector<int> cuts, std::size_t n_workers, int n_layer) {
  const std::size_t n_stages = n_workers + 1;
  if (cuts.empty()) {
    if (std::size_t(n_layer) < n_stages)
      throw UsageError{std::to_string(n_stages) + " stages need at least " + std::to_string(n_stages) +
                       " layers; the model has " + std::to_string(n_layer)};
    for (std::size_t i = 1; i < n_stages; ++i)
      cuts.push_back(compute_layer_range(int(i), int(n_stages), n_layer).lo);
  }
  if (cuts.size() != n_workers)
    throw UsageError{std::to_string(cuts.size()) + " cut(s) for " + std::to_string(n_workers) +
                     " worker(s): the chain needs exactly one cut per worker (--cut C for one, --cuts C1,C2,... for more)"};
  int prev = 0;
  for (int c : cuts) {
    if (!(prev < c && c < n_layer))
      throw UsageError{"--cut must be between 1 and layers-1 and the cuts strictly increasing (got " +
                       std::to_string(c) + " after " + std::to_string(prev) + " with " + std::to_string(n_layer) +
                       " layers)"};
    prev = c;
  }
  return cuts;
}

inline uint64_t random_session_id() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ rd();
}

inline std::string sampling_text(const SamplingParams& p) {
  if (p.greedy()) return "greedy (argmax)";
  std::string s = "sampling";
  if (p.temperature) s += " temperature " + fixed(*p.temperature, 3);
  if (p.top_k) s += " top-k " + std::to_string(*p.top_k);
  if (p.top_p) s += " top-p " + fixed(*p.top_p, 3);
  if (p.min_p) s += " min-p " + fixed(*p.min_p, 3);
  return s + " seed " + std::to_string(p.seed);
}


// Prompt ids: --prompt-ids as given, or --prompt encoded (BOS as the tokenizer says).
inline std::vector<int32_t> prompt_tokens(const ModelRunOptions& o, const Tokenizer* tok,
                                          const std::string& tok_error, const Config& cfg, uint32_t ctx) {
  std::vector<int32_t> prompt = o.prompt_ids;
  if (prompt.empty()) {
    if (!tok) throw UsageError{"the model has no usable tokenizer (" + tok_error + "): give --prompt-ids"};
    prompt = tok->encode(o.prompt.value_or("The capital of France is"), tok->add_bos(), true);
  }
  if (prompt.empty()) throw UsageError{"the prompt encodes to no tokens"};
  if (prompt.size() > ctx)
    throw UsageError{"the prompt has " + std::to_string(prompt.size()) + " tokens > ctx " + std::to_string(ctx) +
                     " (--ctx)"};
  for (int32_t t : prompt)
    if (t < 0 || std::size_t(t) >= cfg.n_vocab)
      throw UsageError{"prompt token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                       std::to_string(cfg.n_vocab) + ")"};
  return prompt;
}

// The workers after the handshake: ranges assigned, every stage's report received.
struct Chain {
  std::vector<net::Hop> hops;
  uint64_t session = 0;
  std::unique_ptr<net::ModelLink> link;  // to the first worker; the rest hang off it
  net::Welcome welcome;
  std::string profile_diff;  // stages whose kernels differ from this process's, empty when none do
};

inline Chain connect_chain(const ModelRunOptions& o, const std::vector<int>& cuts, const net::ModelIdentity& id,
                           uint32_t ctx, const net::NumericProfile& mine) {
  Chain c;
  for (std::size_t i = 0; i < o.workers.size(); ++i)
    c.hops.push_back(net::Hop{LayerRange{cuts[i], i + 1 < cuts.size() ? cuts[i + 1] : int(id.n_layer)}, o.workers[i]});
  net::Hello hello;
  hello.model = id;
  hello.ctx = ctx;
  hello.from = uint32_t(cuts.front());
  hello.stage = 1;
  hello.chain = c.hops;
  hello.sampling = o.sampling;
  hello.coordinator = mine;
  auto ms = [](net::Millis t) { return t == net::kNoTimeout ? 0u : uint32_t(std::min<int64_t>(t.count(), 86400000)); };
  hello.timeout_ms = ms(o.timeouts.io);
  hello.load_timeout_ms = ms(o.load_wait);
  c.session = random_session_id();
  c.link = std::make_unique<net::ModelLink>(c.hops.front(), 1, o.timeouts, net::reply_wait(o.timeouts.io, c.hops.size()));
  if (o.psk) c.link->authenticate(*o.psk);  // before HELLO: nothing about the run goes to an impostor
  c.link->send_hello(hello, c.session);
  c.welcome = c.link->read_welcome(net::reply_wait(o.load_wait, c.hops.size()));
  const std::string& who = c.link->who();
  if (c.welcome.stages.size() != c.hops.size())
    throw Error(who + ": WELCOME reports " + std::to_string(c.welcome.stages.size()) + " stages, the chain has " +
                std::to_string(c.hops.size()));
  for (std::size_t i = 0; i < c.hops.size(); ++i) {
    const net::StageReport& r = c.welcome.stages[i];
    if (r.range != c.hops[i].range || r.stage != i + 1)
      throw Error(who + ": WELCOME reports stage " + std::to_string(r.stage) + " with layers " + range_text(r.range) +
                  ", expected stage " + std::to_string(i + 1) + " with " + range_text(c.hops[i].range));
    if (r.profile.arch != mine.arch) {
      if (!c.profile_diff.empty()) c.profile_diff += ", ";
      c.profile_diff += "stage " + std::to_string(r.stage) + " " + r.profile.arch;
    }
  }
  return c;
}

inline void print_chain(const Stage& stage, const net::ModelIdentity& id, const Chain& c,
                        const net::NumericProfile& mine) {
  const Config& cfg = stage.config();
  std::cout << "pipe coordinator (stage 0, layers " << range_text(stage.range()) << ") -> " << c.hops.size()
            << " worker(s), model '" << id.file << "' (fingerprint " << id.fingerprint.substr(0, 16) << ", "
            << cfg.n_layer << " layers, hidden " << cfg.n_embd << ", vocab " << cfg.n_vocab << ")\n";
  std::cout << "  stage 0  layers " << range_text(stage.range()) << "  coordinator  " << mine.arch << " x "
            << mine.threads << " threads  ctx " << stage.ctx() << "  weights " << stage.bytes_used() << " B\n";
  for (const net::StageReport& r : c.welcome.stages)
    std::cout << "  stage " << r.stage << "  layers " << range_text(r.range) << "  " << r.where << "  "
              << r.profile.arch << " x " << r.profile.threads << " threads  ctx " << r.ctx << "  weights "
              << r.bytes_used << " B\n";
  if (c.profile_diff.empty())
    std::cout << "  numeric profiles: " << mine.arch << " kernels on every stage\n";
  else
    std::cout << "  numeric profiles differ (coordinator " << mine.arch << "; " << c.profile_diff
              << "): byte-identity with this process is not expected\n";
}

// Byte-identity: the same positions recomputed in this process over the whole file (the same cuts,
// an f32 wire: bit-identical to the unsplit model), their logits' digests compared with the chain's.
class Verifier {
 public:
  Verifier(const ModelRunOptions& o, const std::vector<int>& cuts, const StageOptions& so, uint64_t file_bytes) {
    if (o.verify == Verify::all) {
      tokens_ = SIZE_MAX;
      note_ = "every token (--verify all)";
    } else if (o.verify == Verify::probe) {
      const auto avail = mem_available();
      if (avail && file_bytes > *avail) {
        note_ = "skipped: the bring-up probe needs the whole model here (" + std::to_string(file_bytes >> 20) +
                " MiB) but only " + std::to_string(*avail >> 20) + " MiB are available; --verify all forces it";
      } else {
        tokens_ = kProbeTokens;
        note_ = "bring-up probe of the first " + std::to_string(kProbeTokens) + " tokens (--verify all checks every token)";
      }
    } else {
      note_ = "skipped (--verify none)";
    }
    if (tokens_ > 0) ref_ = std::make_unique<LocalPipeline>(o.path, cuts, WireDType::F32, so);
  }

  // Whether generated token i (0-based) is verified: its FWD then asks for the digest.
  bool wants(std::size_t i) const { return ref_ && i < tokens_; }

  // Runs the reference on the rows that produced generated token i and compares the digests.
  void check(std::size_t i, std::span<const int32_t> feed, int64_t pos, const net::StepReply& r) {
    logits_.resize(ref_->config().n_vocab);
    ref_->run(feed, pos, logits_.data(), 1);
    const Sha256Digest want = net::logits_digest(logits_);
    ++verified_;
    if (r.digest && *r.digest == want) {
      ++matched_;
    } else if (verified_ - matched_ <= 3) {
      std::cout << "\n  MISMATCH pos=" << pos + int64_t(feed.size()) << ": distributed "
                << (r.digest ? to_hex(*r.digest).substr(0, 12) : std::string("(none)")) << " local "
                << to_hex(want).substr(0, 12) << std::endl;
    }
    if (i + 1 == tokens_) ref_.reset();  // the probe is done: give the memory back
  }

  std::size_t verified() const { return verified_; }
  std::size_t matched() const { return matched_; }
  const std::string& note() const { return note_; }

 private:
  std::size_t tokens_ = 0;
  std::string note_;
  std::unique_ptr<LocalPipeline> ref_;
  std::vector<float> logits_;  // [n_vocab]
  std::size_t verified_ = 0, matched_ = 0;
};

// What the report says about the run (verification aside).
struct RunStats {
  std::size_t prompt = 0;
  std::vector<int32_t> generated;
  std::vector<double> rtt_ms;  // FWD sent to RES received, per generated token
  double prefill_s = 0, decode_s = 0;
  uint64_t prefill_bytes = 0, total_bytes = 0;  // frame bytes on the first hop, both directions
  std::size_t resumes = 0, replayed = 0;        // chains re-established, positions replayed into them
  double resume_s = 0;
  uint64_t replay_bytes = 0;                    // handshakes and replays after a failure (not in total_bytes)
};

inline void print_report(const RunStats& s, const Config& cfg, std::size_t n_hops, const std::string& verify_note) {
  const std::size_t n_decode = s.generated.empty() ? 0 : s.generated.size() - 1;
  std::cout << "  prefill: " << s.prompt << " tokens in " << fixed(s.prefill_s * 1e3, 2) << " ms = "
            << fixed(s.prefill_s > 0 ? double(s.prompt) / s.prefill_s : 0.0) << " tokens/s\n";
  std::cout << "  decode: " << n_decode << " tokens in " << fixed(s.decode_s * 1e3, 2) << " ms = "
            << fixed(s.decode_s > 0 ? double(n_decode) / s.decode_s : 0.0) << " tokens/s ("
            << fixed(n_decode ? s.decode_s * 1e3 / double(n_decode) : 0.0, 3) << " ms/token)\n";
  const auto [lo, hi] = std::minmax_element(s.rtt_ms.begin(), s.rtt_ms.end());
  auto us = [](double ms) { return fixed(ms * 1e3); };
  std::cout << "  round-trip us: min " << us(*lo) << "  p50 " << us(net::percentile(s.rtt_ms, 50)) << "  p99 "
            << us(net::percentile(s.rtt_ms, 99)) << "  max " << us(*hi) << "\n";
  // Every hop carries the same frames (a middle worker relays them), so one hop's count is every hop's.
  const double per_token = n_decode ? double(s.total_bytes - s.prefill_bytes) / double(n_decode) : 0.0;
  std::cout << "  wire: " << fixed(per_token, 0) << " bytes/token per hop while decoding (FWD "
            << net::kModelHeaderBytes << "+" << cfg.n_embd * 4 << " down, RES " << net::kModelHeaderBytes
            << "+4 up, +32 per digest, +" << cfg.n_vocab * 4 << " per --logits-out row) x " << n_hops
            << " hop(s) = " << fixed(per_token * double(n_hops), 0) << " bytes/token; prefill " << s.prefill_bytes
            << " bytes per hop\n";
  std::cout << "  tokens:";
  for (int32_t t : s.generated) std::cout << ' ' << t;
  if (s.resumes)
    std::cout << "\n  resumed: " << s.resumes << " time(s) after a chain failure, " << s.replayed
              << " positions replayed in " << fixed(s.resume_s * 1e3) << " ms, every replayed token identical";
  std::cout << "\n  verify: " << verify_note << "\n";
  std::cout << "\n"
            << s.generated.size() << " tokens  round-trip ms: min " << fixed(*lo) << "  p50 "
            << fixed(net::percentile(s.rtt_ms, 50)) << "  p99 " << fixed(net::percentile(s.rtt_ms, 99)) << "  max "
            << fixed(*hi) << "\n";
}

// The FWD header of one step of the chain's session.
inline net::ModelHeader fwd_header(const Chain& chain, uint32_t seq_no, int64_t pos, std::size_t rows, uint8_t flags) {
  net::ModelHeader fwd;
  fwd.type = net::kTypeFwd;
  fwd.seq = seq_no;
  fwd.session = chain.session;
  fwd.pos = uint64_t(pos);
  fwd.rows = uint32_t(rows);
  fwd.layer_lo = uint32_t(chain.hops.front().range.lo);
  fwd.layer_hi = uint32_t(chain.hops.front().range.hi);
  fwd.flags = flags;
  return fwd;
}

// What the coordinator knows to set up a chain again.
struct ChainSpec {
  const ModelRunOptions& o;
  const std::vector<int>& cuts;
  const net::ModelIdentity& id;
  uint32_t ctx;
  const net::NumericProfile& mine;
};

// Errors that another attempt cannot cure: the chain now refuses this model, this key or these tokens.
inline bool resume_is_futile(const std::string& what) {
  return what.find("handshake: ") != std::string::npos || what.find("authentication failed") != std::string::npos ||
         what.find("replay diverged") != std::string::npos;
}

// After the chain failed at step `generated.size()`: re-establishes it (a new session on every worker)
// and replays into it what the old session had done, the same FWDs in the same order (the prompt as
// one, then each generated token but the last as one row), from a new sequence of this stage's own.
// Every stage then holds the same cache bits as before, and the last stage samples the same tokens
// again, which is checked. Retries until spec.o.resume has passed, then throws with the last error.
inline void resume_chain(const ChainSpec& spec, const Stage& stage, Sequence& seq, Chain& chain, Buffer<float>& rows,
                         std::span<const int32_t> prompt, std::span<const int32_t> generated,
                         const std::string& failure, RunStats& stats) {
  using clock = std::chrono::steady_clock;
  const std::size_t n_embd = stage.config().n_embd;
  const uint32_t n_vocab = uint32_t(stage.config().n_vocab);
  const std::size_t positions = generated.empty() ? 0 : prompt.size() + generated.size() - 1;
  const auto t0 = clock::now();
  const auto deadline = t0 + spec.o.resume;
  const std::string within = fixed(double(spec.o.resume.count()) / 1e3) + " s";
  std::cout.flush();
  std::cerr << "pp_node coordinator: " << failure << "\n  resuming: re-establishing the chain and replaying "
            << positions << " positions into a new session (for up to " << within << ")" << std::endl;
  stats.total_bytes += chain.link ? chain.link->bytes_sent() + chain.link->bytes_received() : 0;
  chain.link.reset();  // ends what is left of the old session on every worker
  std::string last = failure;
  std::vector<uint8_t> res;
  for (;;) {
    const auto now = clock::now();
    if (now >= deadline)
      throw Error("could not resume within " + within + " (--resume) after: " + failure + "; last error: " + last);
    if (spec.o.stop && spec.o.stop->load())
      throw Error("stopped by a signal while resuming after: " + failure + "; last error: " + last);
    std::this_thread::sleep_for(std::min<clock::duration>(std::chrono::milliseconds(200), deadline - now));
    try {
      Chain fresh = connect_chain(spec.o, spec.cuts, spec.id, spec.ctx, spec.mine);
      seq = stage.new_sequence();
      for (std::size_t j = 0; j < generated.size(); ++j) {
        const std::span<const int32_t> feed = j == 0 ? prompt : generated.subspan(j - 1, 1);
        const int64_t pos = j == 0 ? 0 : int64_t(prompt.size() + j - 1);
        stage.embed(feed, rows.data());
        stage.forward(seq, pos, rows.data(), feed.size());
        const net::ModelHeader fwd = fwd_header(fresh, uint32_t(j), pos, feed.size(), 0);
        fresh.link->send_fwd(fwd, std::span(reinterpret_cast<const uint8_t*>(rows.data()), feed.size() * n_embd * 4));
        fresh.link->read_res(fwd, n_vocab, res);
        const int32_t token = net::decode_res(res, 0, n_vocab).token;
        if (token != generated[j])
          throw Error("replay diverged at position " + std::to_string(pos + int64_t(feed.size())) +
                      ": the new chain sampled token " + std::to_string(token) + " where the session had " +
                      std::to_string(generated[j]) + " (a worker with other kernels or another model file?)");
      }
      stats.replay_bytes += fresh.link->bytes_sent() + fresh.link->bytes_received();
      chain = std::move(fresh);
      break;
    } catch (const Error& e) {
      last = e.what();
      if (resume_is_futile(last)) throw Error("cannot resume after: " + failure + "; " + last);
    }
  }
  const double took = std::chrono::duration<double>(clock::now() - t0).count();
  ++stats.resumes;
  stats.replayed += positions;
  stats.resume_s += took;
  std::cerr << "pp_node coordinator: resumed in " << fixed(took * 1e3) << " ms: new session "
            << std::hex << chain.session << std::dec << ", " << positions << " positions replayed, tokens identical"
            << std::endl;
}

}  // namespace detail

// Runs the whole generation; returns the exit status. Throws UsageError for a bad command line and
// pp::Error (naming the peer and stage) for anything that goes wrong on the way.
inline int run_model_coordinator(const ModelRunOptions& o) {
  using clock = std::chrono::steady_clock;
  if (o.workers.empty()) throw UsageError{"--coordinator needs at least one worker HOST[:PORT]"};

  // Cuts are checked against the file's header before any weight is touched.
  const std::shared_ptr<const Model> model = Model::open(o.path);
  const std::vector<int> cuts = detail::validated_cuts(o.cuts, o.workers.size(), int(model->config().n_layer));
  StageOptions so;
  so.ctx = o.ctx;
  so.threads = o.threads;
  so.residency = o.residency;
  const Stage stage(model, LayerRange{0, cuts.front()}, so);
  const Config& cfg = stage.config();
  const net::ModelIdentity id = net::identify_model(*model);
  const uint32_t ctx = uint32_t(stage.ctx());
  const Tokenizer* tok = model->tokenizer();
  const std::vector<int32_t> prompt = detail::prompt_tokens(o, tok, model->tokenizer_error(), cfg, ctx);

  const net::NumericProfile mine = net::local_profile(stage);
  detail::Chain chain = detail::connect_chain(o, cuts, id, ctx, mine);
  detail::print_chain(stage, id, chain, mine);
  detail::Verifier verifier(o, cuts, so, stage.file().size());

  std::ofstream logits_file, digest_file;
  if (!o.logits_out.empty()) {
    logits_file.open(o.logits_out, std::ios::binary);
    if (!logits_file) throw Error("cannot write --logits-out '" + o.logits_out + "'");
  }
  if (!o.dump_digests.empty()) {
    digest_file.open(o.dump_digests);
    if (!digest_file) throw Error("cannot write --dump-digests '" + o.dump_digests + "'");
  }
  std::cout << "  prompt: " << prompt.size() << " tokens; generating up to " << o.tokens << " ("
            << detail::sampling_text(o.sampling) << (o.ignore_eos ? ", --ignore-eos" : "") << ")\n"
            << std::endl;

  // Each token: this stage's layers, a FWD down the chain, the sampled token back up.
  Sequence seq = stage.new_sequence();
  Buffer<float> rows(prompt.size() * cfg.n_embd);  // [rows, n_embd] the residual crossing the first cut
  std::vector<uint8_t> res;
  std::vector<int32_t> feed = prompt;
  std::optional<StreamDecoder> text;
  if (tok) text.emplace(*tok);
  detail::RunStats stats;
  stats.prompt = prompt.size();
  int64_t pos = 0;
  const detail::ChainSpec spec{o, cuts, id, ctx, mine};
  for (uint32_t i = 0; i < o.tokens; ++i) {
    if (o.stop && o.stop->load()) {
      std::cerr << "pp_node coordinator: stopped by a signal after " << i << " token(s)" << std::endl;
      break;
    }
    const uint8_t flags = uint8_t((verifier.wants(i) || digest_file.is_open() ? net::kFlagDigest : 0) |
                                  (logits_file.is_open() ? net::kFlagLogits : 0));
    net::ModelHeader fwd;
    clock::time_point t0, t1;
    for (;;) {  // once, or again after the chain was re-established (--resume)
      t0 = clock::now();
      stage.embed(feed, rows.data());
      stage.forward(seq, pos, rows.data(), feed.size());
      fwd = detail::fwd_header(chain, i, pos, feed.size(), flags);
      t1 = clock::now();
      try {
        chain.link->send_fwd(fwd, std::span(reinterpret_cast<const uint8_t*>(rows.data()), feed.size() * cfg.n_embd * 4));
        chain.link->read_res(fwd, uint32_t(cfg.n_vocab), res);
        break;
      } catch (const Error& e) {
        if (o.resume.count() == 0) throw;
        detail::resume_chain(spec, stage, seq, chain, rows, prompt, stats.generated, e.what(), stats);
      }
    }
    net::ModelLink& link = *chain.link;
    const auto t2 = clock::now();
    stats.rtt_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    (i == 0 ? stats.prefill_s : stats.decode_s) += std::chrono::duration<double>(t2 - t0).count();
    if (i == 0) stats.prefill_bytes = stats.total_bytes + link.bytes_sent() + link.bytes_received();

    const net::StepReply r = net::decode_res(res, fwd.flags, uint32_t(cfg.n_vocab));
    if (r.token < 0 || std::size_t(r.token) >= cfg.n_vocab)
      throw Error(link.who() + ": RES seq " + std::to_string(i) + " carries token id " + std::to_string(r.token) +
                  " outside the vocabulary [0, " + std::to_string(cfg.n_vocab) + ")");
    if (verifier.wants(i)) verifier.check(i, feed, pos, r);  // not timed: not part of the pipeline's cost
    if (logits_file.is_open())
      logits_file.write(reinterpret_cast<const char*>(r.logits.data()), std::streamsize(r.logits.size() * 4));
    if (digest_file.is_open())
      digest_file << pos + int64_t(feed.size()) << ' ' << r.token << ' ' << to_hex(*r.digest) << std::endl;  // line by line: a stopped run keeps its digests

    pos += int64_t(feed.size());
    feed.assign(1, r.token);
    stats.generated.push_back(r.token);
    if (tok && tok->is_eog(r.token) && !o.ignore_eos) break;
    if (text) std::cout << text->feed(r.token);
    else std::cout << (i ? " " : "") << r.token;  // no tokenizer: the ids
    std::cout.flush();
  }
  if (text) std::cout << text->flush();
  stats.total_bytes += chain.link->bytes_sent() + chain.link->bytes_received() - stats.replay_bytes;
  chain.link.reset();  // ends the session on every worker before the report
  if (logits_file.is_open() && !logits_file.flush()) throw Error("writing --logits-out '" + o.logits_out + "' failed");

  // Report: extra lines first, the prototype's two lines last for scripts.
  std::cout << "\n\n";
  detail::print_report(stats, cfg, chain.hops.size(), verifier.note());
  const std::size_t verified = verifier.verified(), matched = verifier.matched();
  if (verified == 0) {
    std::cout << "byte-identity: " << verifier.note() << "; workers hold the far layers" << std::endl;
    return kExitOk;
  }
  if (matched == verified) {
    std::cout << "byte-identity: " << verified << "/" << verified << " IDENTICAL  == pipeline split PASSED =="
              << std::endl;
    return kExitOk;
  }
  std::cout << "byte-identity: " << matched << "/" << verified << " identical  FAIL (" << (verified - matched) << ")"
            << (chain.profile_diff.empty() ? "" : "  (numeric profiles differ: identity was not expected)")
            << std::endl;
  return kExitMismatch;
}

}  // namespace pp::node
