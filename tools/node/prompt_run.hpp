// pp_node --coordinator with a prompt: one generation as one session of the coordinator (pp/net/coordinator), streamed, verified and reported.
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
#include <span>
#include <string>
#include <vector>

#include "node/process.hpp"
#include "pp/core/error.hpp"
#include "pp/core/hex.hpp"
#include "pp/core/printable.hpp"
#include "pp/local_pipeline.hpp"
#include "pp/model.hpp"
#include "pp/net/auth.hpp"
#include "pp/net/coordinator/scheduler.hpp"
#include "pp/net/latency.hpp"
#include "pp/net/model_link.hpp"
#include "pp/net/sha256.hpp"
#include "pp/text/sampler.hpp"
#include "pp/text/tokenizer.hpp"

namespace pp::node {

enum class Verify { probe, all, none };

// Tokens the default bring-up probe verifies.
inline constexpr std::size_t kProbeTokens = 4;

struct ModelRunOptions {
  std::string path;                 // the resolved GGUF file
  std::string name;                 // what the user called it (an Ollama tag), for messages; empty: the file name
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
  // it; 0 = stop with the error.
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
inline std::vector<int32_t> prompt_tokens(const ModelRunOptions& o, const Model& model, uint32_t ctx) {
  const Config& cfg = model.config();
  std::vector<int32_t> prompt = o.prompt_ids;
  if (prompt.empty()) {
    const Tokenizer* tok = model.tokenizer();
    if (!tok) throw UsageError{"the model has no usable tokenizer (" + model.tokenizer_error() + "): give --prompt-ids"};
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

// Stages whose kernels differ from this process's, empty when none do.
inline std::string profile_diff(const net::Welcome& w, const std::string& mine) {
  std::string diff;
  for (const net::StageReport& r : w.stages)
    if (r.profile.arch != mine) diff += (diff.empty() ? "" : ", ") + ("stage " + std::to_string(r.stage) + " " + r.profile.arch);
  return diff;
}

inline void print_chain(const net::Coordinator& c, const std::string& diff) {
  const Config& cfg = c.config();
  const Stage& stage = c.stage();
  const net::ModelIdentity& id = c.identity();
  const std::string mine = stage.kernel_profile();
  std::cout << "pipe coordinator (stage 0, layers " << range_text(stage.range()) << ") -> " << c.hops().size()
            << " worker(s), model '" << id.file << "' (fingerprint " << id.fingerprint.substr(0, 16) << ", "
            << cfg.n_layer << " layers, hidden " << cfg.n_embd << ", vocab " << cfg.n_vocab << ")\n";
  std::cout << "  stage 0  layers " << range_text(stage.range()) << "  coordinator  " << mine << " x "
            << stage.threads() << " threads  ctx " << stage.ctx() << "  weights " << format_bytes(stage.bytes_used()) << "\n";
  for (const net::StageReport& r : c.welcome().stages)
    std::cout << "  stage " << r.stage << "  layers " << range_text(r.range) << "  " << r.where << "  "
              << r.profile.arch << " x " << r.profile.threads << " threads  ctx " << r.ctx << "  weights "
              << format_bytes(r.bytes_used) << "\n";
  if (diff.empty())
    std::cout << "  numeric profiles: " << mine << " kernels on every stage\n";
  else
    std::cout << "  numeric profiles differ (coordinator " << mine << "; " << diff
              << "): byte-identity with this process is not expected\n";
}

// How many generated tokens are verified, and what the report says about it.
struct VerifyPlan {
  std::size_t tokens = 0;
  std::string note;
};

inline VerifyPlan plan_verification(Verify v, uint64_t file_bytes) {
  if (v == Verify::all) return {SIZE_MAX, "every token (--verify all)"};
  if (v == Verify::none) return {0, "skipped (--verify none)"};
  const auto avail = mem_available();
  if (avail && file_bytes > *avail)
    return {0, "skipped: the bring-up probe needs the whole model here (" + std::to_string(file_bytes >> 20) +
                   " MiB) but only " + std::to_string(*avail >> 20) + " MiB are available; --verify all forces it"};
  return {kProbeTokens, "bring-up probe of the first " + std::to_string(kProbeTokens) +
                            " tokens (--verify all checks every token)"};
}

// Byte-identity: the same positions recomputed in this process over the whole model (the same cuts, an
// f32 wire: bit-identical to the unsplit model) and the same prompt chunks as the coordinator fed,
// their logits' digests compared with the ones the chain's last stage sent.
struct Verdict {
  std::size_t verified = 0, matched = 0;
};

inline Verdict verify_tokens(std::shared_ptr<const Model> model, const std::vector<int>& cuts, const StageOptions& so,
                             std::span<const int32_t> prompt, std::span<const net::GenStream::Piece> steps, std::size_t n) {
  Verdict v;
  LocalPipeline ref(std::move(model), cuts, WireDType::F32, so);
  std::vector<float> logits(ref.config().n_vocab);
  const uint32_t ctx = uint32_t(ref.stage(0).ctx());
  int64_t pos = 0;
  for (std::size_t i = 0; i < std::min(n, steps.size()); ++i) {
    if (i == 0) {
      for (std::size_t at = 0; at < prompt.size();) {
        const std::size_t rows = net::Coordinator::feed_rows(prompt.size() - at, ctx);
        ref.run(prompt.subspan(at, rows), pos, logits.data(), 1);
        at += rows;
        pos += int64_t(rows);
      }
    } else {
      ref.run(std::span(&steps[i - 1].token, 1), pos, logits.data(), 1);
      pos += 1;
    }
    const Sha256Digest want = net::logits_digest(logits);
    const auto& got = steps[i].digest;
    ++v.verified;
    if (got && *got == want) {
      ++v.matched;
    } else if (v.verified - v.matched <= 3) {
      std::cout << "  MISMATCH pos=" << pos << ": distributed " << (got ? to_hex(*got).substr(0, 12) : std::string("(none)"))
                << " local " << to_hex(want).substr(0, 12) << std::endl;
    }
  }
  return v;
}

inline void print_report(std::span<const net::GenStream::Piece> steps, std::size_t prompt, double prefill_s, double decode_s,
                         uint64_t prefill_bytes, uint64_t decode_bytes, const net::CoordinatorMetrics& m,
                         const Config& cfg, std::size_t n_hops, const std::string& verify_note) {
  const std::size_t n_decode = steps.empty() ? 0 : steps.size() - 1;
  std::vector<double> rtt_ms;
  for (const auto& s : steps) rtt_ms.push_back(s.round_trip_s * 1e3);
  if (rtt_ms.empty()) rtt_ms.push_back(0);
  std::cout << "  prefill: " << prompt << " tokens in " << fixed(prefill_s * 1e3, 2) << " ms = "
            << fixed(prefill_s > 0 ? double(prompt) / prefill_s : 0.0) << " tokens/s\n";
  std::cout << "  decode: " << n_decode << " tokens in " << fixed(decode_s * 1e3, 2) << " ms = "
            << fixed(decode_s > 0 ? double(n_decode) / decode_s : 0.0) << " tokens/s ("
            << fixed(n_decode ? decode_s * 1e3 / double(n_decode) : 0.0, 3) << " ms/token)\n";
  const auto [lo, hi] = std::minmax_element(rtt_ms.begin(), rtt_ms.end());
  auto us = [](double ms) { return fixed(ms * 1e3); };
  std::cout << "  round-trip us: min " << us(*lo) << "  p50 " << us(net::percentile(rtt_ms, 50)) << "  p99 "
            << us(net::percentile(rtt_ms, 99)) << "  max " << us(*hi) << "\n";
  // Every hop carries the same frames (a middle worker relays them), so one hop's count is every hop's.
  const double per_token = n_decode ? double(decode_bytes) / double(n_decode) : 0.0;
  std::cout << "  wire: " << fixed(per_token, 0) << " bytes/token per hop while decoding (BATCH "
            << net::kModelHeaderBytes << "+" << 4 + net::kBatchEntryBytes << "+" << cfg.n_embd * 4 << " down, BRES "
            << net::kModelHeaderBytes << "+4 up, +32 per digest, +" << cfg.n_vocab * 4 << " per --logits-out row) x "
            << n_hops << " hop(s) = " << fixed(per_token * double(n_hops), 0) << " bytes/token; prefill "
            << prefill_bytes << " bytes per hop\n";
  std::cout << "  tokens:";
  for (const auto& s : steps) std::cout << ' ' << s.token;
  if (m.resumes)
    std::cout << "\n  resumed: " << m.resumes << " time(s) after a chain failure, " << m.replayed_positions
              << " positions replayed in " << fixed(m.resume_s * 1e3) << " ms, every replayed token identical";
  std::cout << "\n  verify: " << verify_note << "\n";
  std::cout << "\n"
            << steps.size() << " tokens  round-trip ms: min " << fixed(*lo) << "  p50 "
            << fixed(net::percentile(rtt_ms, 50)) << "  p99 " << fixed(net::percentile(rtt_ms, 99)) << "  max "
            << fixed(*hi) << "\n";
}

}  // namespace detail

// Runs the whole generation; returns the exit status. Throws UsageError for a bad command line and
// pp::Error (naming the peer and stage) for anything that goes wrong on the way.
inline int run_model_coordinator(const ModelRunOptions& o) {
  using clock = std::chrono::steady_clock;
  if (o.workers.empty()) throw UsageError{"--coordinator needs at least one worker HOST[:PORT]"};

  // Cuts and the prompt are checked against the file's header before any weight is touched.
  const std::shared_ptr<const Model> model = Model::open(o.path);
  const std::vector<int> cuts = detail::validated_cuts(o.cuts, o.workers.size(), int(model->config().n_layer));
  const uint32_t ctx = o.ctx ? o.ctx : uint32_t(model->default_ctx());
  const std::vector<int32_t> prompt = detail::prompt_tokens(o, *model, ctx);
  const Config& cfg = model->config();

  net::CoordinatorConfig cc;
  cc.model = model;
  cc.name = o.name;
  cc.workers = o.workers;
  cc.cuts = cuts;
  cc.ctx = ctx;
  cc.threads = o.threads;
  cc.residency = o.residency;
  cc.timeouts = o.timeouts;
  cc.load_wait = o.load_wait;
  cc.parallel = 1;
  cc.resume = o.resume;
  if (o.psk) cc.authenticate = [psk = o.psk](net::Channel& ch) { net::authenticate_with_worker(ch, *psk); };
  cc.log = [](const std::string& line) {
    std::cout.flush();
    std::cerr << "pp_node coordinator: " << line << std::endl;
  };
  net::Coordinator coord(cc);
  coord.load_stage();
  coord.connect();
  const std::string diff = detail::profile_diff(coord.welcome(), coord.stage().kernel_profile());
  detail::print_chain(coord, diff);
  const detail::VerifyPlan plan = detail::plan_verification(o.verify, model->file().size());

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

  net::GenParams params;
  params.sampling = o.sampling;
  params.max_tokens = o.tokens;
  params.ignore_eos = o.ignore_eos;
  params.digest_tokens = digest_file.is_open() ? SIZE_MAX : plan.tokens;
  params.logits_tokens = logits_file.is_open() ? SIZE_MAX : 0;
  coord.start();
  const auto t0 = clock::now();
  const std::shared_ptr<net::GenStream> out = coord.submit(prompt, params);
  std::vector<net::GenStream::Piece> steps;  // one per generated token, text and logits dropped
  std::vector<net::GenStream::Piece> got;
  clock::time_point t_first, t_last;
  uint64_t first_bytes = 0, last_bytes = 0;
  const bool ids = coord.tokenizer() == nullptr;
  bool stopped = false;
  for (bool more = true; more;) {
    got.clear();
    more = out->next(got, std::chrono::milliseconds(100));
    for (net::GenStream::Piece& p : got) {
      if (!p.text.empty()) std::cout << p.text;
      if (p.token < 0) continue;  // the text held back until the end
      (steps.empty() ? t_first : t_last) = clock::now();
      (steps.empty() ? first_bytes : last_bytes) = p.link_bytes;
      if (logits_file.is_open())
        logits_file.write(reinterpret_cast<const char*>(p.logits.data()), std::streamsize(p.logits.size() * 4));
      if (digest_file.is_open() && p.digest)
        digest_file << p.pos << ' ' << p.token << ' ' << to_hex(*p.digest) << std::endl;  // line by line: a stopped run keeps its digests
      if (ids && !p.tokens.empty()) std::cout << (steps.empty() ? "" : " ") << p.token;
      p.logits = {};
      p.text.clear();
      steps.push_back(std::move(p));
    }
    std::cout.flush();
    if (!stopped && o.stop && o.stop->load()) {
      stopped = true;
      std::cerr << "pp_node coordinator: stopped by a signal after " << steps.size() << " token(s)" << std::endl;
      out->cancel();
    }
  }
  if (out->finish() == net::Finish::error) throw Error(out->error());
  const net::CoordinatorMetrics m = coord.metrics();
  coord.shutdown();
  if (logits_file.is_open() && !logits_file.flush()) throw Error("writing --logits-out '" + o.logits_out + "' failed");
  if (steps.size() < 2) t_last = t_first, last_bytes = first_bytes;

  // Report: extra lines first, the prototype's two lines last for scripts. Verification runs now, after
  // the generation: not part of the pipeline's cost.
  std::cout << "\n\n";
  StageOptions so;
  so.ctx = ctx;
  so.threads = o.threads;
  so.residency = o.residency;
  const detail::Verdict v = plan.tokens ? detail::verify_tokens(model, cuts, so, prompt, steps, plan.tokens) : detail::Verdict{};
  detail::print_report(steps, prompt.size(), std::chrono::duration<double>(t_first - t0).count(),
                       std::chrono::duration<double>(t_last - t_first).count(), first_bytes, last_bytes - first_bytes,
                       m, cfg, coord.hops().size(), plan.note);
  if (v.verified == 0) {
    std::cout << "byte-identity: " << plan.note << "; workers hold the far layers" << std::endl;
    return kExitOk;
  }
  if (v.matched == v.verified) {
    std::cout << "byte-identity: " << v.verified << "/" << v.verified << " IDENTICAL  == pipeline split PASSED =="
              << std::endl;
    return kExitOk;
  }
  std::cout << "byte-identity: " << v.matched << "/" << v.verified << " identical  FAIL (" << (v.verified - v.matched)
            << ")" << (diff.empty() ? "" : "  (numeric profiles differ: identity was not expected)") << std::endl;
  return kExitMismatch;
}

}  // namespace pp::node
