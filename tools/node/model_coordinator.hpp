// pp_node's real-model coordinator: layers [0, C1) with the tokenizer and embedding, a chain of workers, streamed text, verification, report.
#pragma once

#include <algorithm>
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
#include <vector>

#include "pp/core/buffer.hpp"
#include "pp/core/error.hpp"
#include "pp/core/sha256.hpp"
#include "pp/io/gguf.hpp"
#include "pp/io/llama_loader.hpp"
#include "pp/io/mmap.hpp"
#include "pp/model/local_pipeline.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/latency.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/model_link.hpp"
#include "pp/net/model_worker.hpp"
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
  uint32_t ctx = 0;                 // 0: min(4096, model context)
  std::string logits_out;           // raw f32 [generated, n_vocab] of every sampled position
  std::string dump_digests;         // "pos token sha256" lines
  net::Timeouts timeouts;
  net::Millis load_wait{120000};
  bool quiet_text = false;          // do not stream the generated text
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

}  // namespace detail

// Runs the whole generation; returns the exit status. Throws UsageError for a bad command line and
// pp::Error (naming the peer and stage) for anything that goes wrong on the way.
inline int run_model_coordinator(const ModelRunOptions& o) {
  using clock = std::chrono::steady_clock;
  if (o.workers.empty()) throw UsageError{"--coordinator needs at least one worker HOST[:PORT]"};

  // Cuts are checked against the file's header before any weight is touched.
  std::vector<int> cuts;
  {
    MappedFile f(o.path);
    const Config c = llama::read_config(gguf::parse(f.bytes()));
    cuts = detail::validated_cuts(o.cuts, o.workers.size(), int(c.n_layer));
  }
  StageOptions so;
  so.ctx = o.ctx;
  so.threads = o.threads;
  const Stage stage(o.path, LayerRange{0, cuts.front()}, so);
  const Config& cfg = stage.config();
  const net::ModelIdentity id = net::identify_model(stage.file().bytes(), stage.gguf(), cfg, o.path);
  const uint32_t ctx = uint32_t(stage.ctx());

  // Prompt and streaming text.
  std::optional<Tokenizer> tok;
  std::string tok_error;
  try {
    tok = Tokenizer::from_gguf(stage.gguf());
  } catch (const Error& e) {
    tok_error = e.what();
  }
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

  // The chain and the handshake.
  std::vector<net::Hop> hops;
  for (std::size_t i = 0; i < o.workers.size(); ++i)
    hops.push_back(net::Hop{LayerRange{cuts[i], i + 1 < cuts.size() ? cuts[i + 1] : int(cfg.n_layer)}, o.workers[i]});
  net::Hello hello;
  hello.model = id;
  hello.ctx = ctx;
  hello.from = uint32_t(cuts.front());
  hello.stage = 1;
  hello.chain = hops;
  hello.sampling = o.sampling;
  auto ms = [](net::Millis t) { return t == net::kNoTimeout ? 0u : uint32_t(std::min<int64_t>(t.count(), 86400000)); };
  hello.timeout_ms = ms(o.timeouts.io);
  hello.load_timeout_ms = ms(o.load_wait);
  const uint64_t session = detail::random_session_id();
  auto link = std::make_unique<net::ModelLink>(hops.front(), 1, o.timeouts, net::reply_wait(o.timeouts.io, hops.size()));
  link->send_hello(hello, session);
  const net::Welcome welcome = link->read_welcome(net::reply_wait(o.load_wait, hops.size()));
  if (welcome.stages.size() != hops.size())
    throw Error(link->who() + ": WELCOME reports " + std::to_string(welcome.stages.size()) + " stages, the chain has " +
                std::to_string(hops.size()));
  const net::NumericProfile mine = net::local_profile(stage.threads());
  std::string profile_diff;
  for (std::size_t i = 0; i < hops.size(); ++i) {
    const net::StageReport& r = welcome.stages[i];
    if (r.range != hops[i].range || r.stage != i + 1)
      throw Error(link->who() + ": WELCOME reports stage " + std::to_string(r.stage) + " with layers " +
                  detail::range_text(r.range) + ", expected stage " + std::to_string(i + 1) + " with " +
                  detail::range_text(hops[i].range));
    if (r.profile.arch != mine.arch)
      profile_diff += (profile_diff.empty() ? "" : ", ") + std::string("stage ") + std::to_string(r.stage) + " " +
                      r.profile.arch;
  }

  std::cout << "pipe coordinator (stage 0, layers " << detail::range_text(stage.range()) << ") -> "
            << hops.size() << " worker(s), model '" << id.file << "' (fingerprint " << id.fingerprint.substr(0, 16)
            << ", " << cfg.n_layer << " layers, hidden " << cfg.n_embd << ", vocab " << cfg.n_vocab << ")\n";
  std::cout << "  stage 0  layers " << detail::range_text(stage.range()) << "  coordinator  " << mine.arch << " x "
            << mine.threads << " threads  ctx " << ctx << "  weights " << stage.bytes_used() << " B\n";
  for (const net::StageReport& r : welcome.stages)
    std::cout << "  stage " << r.stage << "  layers " << detail::range_text(r.range) << "  " << r.where << "  "
              << r.profile.arch << " x " << r.profile.threads << " threads  ctx " << r.ctx << "  weights "
              << r.bytes_used << " B\n";
  if (profile_diff.empty())
    std::cout << "  numeric profiles: " << mine.arch << " kernels on every stage\n";
  else
    std::cout << "  numeric profiles differ (coordinator " << mine.arch << "; " << profile_diff
              << "): byte-identity with this process is not expected\n";

  // Verification plan: the reference runs in this process over the whole file, the same cuts, f32.
  const uint64_t file_bytes = stage.file().size();
  std::size_t verify_tokens = 0;
  std::string verify_note;
  if (o.verify == Verify::all) {
    verify_tokens = SIZE_MAX;
    verify_note = "every token (--verify all)";
  } else if (o.verify == Verify::probe) {
    const auto avail = detail::mem_available();
    if (avail && file_bytes > *avail) {
      verify_note = "skipped: the bring-up probe needs the whole model here (" + std::to_string(file_bytes >> 20) +
                    " MiB) but only " + std::to_string(*avail >> 20) + " MiB are available; --verify all forces it";
    } else {
      verify_tokens = kProbeTokens;
      verify_note = "bring-up probe of the first " + std::to_string(kProbeTokens) +
                    " tokens (--verify all checks every token)";
    }
  } else {
    verify_note = "skipped (--verify none)";
  }
  std::unique_ptr<LocalPipeline> ref;
  if (verify_tokens > 0) ref = std::make_unique<LocalPipeline>(o.path, cuts, WireDType::F32, so);
  std::vector<float> ref_logits(cfg.n_vocab);

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

  // Generation: the coordinator's layers, then FWD down the chain; the token comes back.
  Sequence seq = stage.new_sequence();
  Buffer<float> rows(prompt.size() * cfg.n_embd);  // [rows, n_embd]
  std::vector<uint8_t> res;
  std::vector<int32_t> feed = prompt, generated;
  std::vector<double> rtt_ms;
  double prefill_s = 0, decode_s = 0;
  uint64_t prefill_bytes = 0;
  std::size_t verified = 0, matched = 0;
  std::optional<StreamDecoder> text;
  if (tok) text.emplace(*tok);
  int64_t pos = 0;
  for (uint32_t i = 0; i < o.tokens; ++i) {
    const bool check = ref && i < verify_tokens;
    const auto t0 = clock::now();
    stage.embed(feed, rows.data());
    stage.forward(seq, pos, rows.data(), feed.size());
    net::ModelHeader fwd;
    fwd.type = net::kTypeFwd;
    fwd.seq = i;
    fwd.session = session;
    fwd.pos = uint64_t(pos);
    fwd.rows = uint32_t(feed.size());
    fwd.layer_lo = uint32_t(hops.front().range.lo);
    fwd.layer_hi = uint32_t(hops.front().range.hi);
    fwd.flags = uint8_t((check || digest_file.is_open() ? net::kFlagDigest : 0) |
                        (logits_file.is_open() ? net::kFlagLogits : 0));
    const auto t1 = clock::now();
    link->send_fwd(fwd, std::span(reinterpret_cast<const uint8_t*>(rows.data()), feed.size() * cfg.n_embd * 4));
    link->read_res(fwd, uint32_t(cfg.n_vocab), res);
    const auto t2 = clock::now();
    rtt_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    (i == 0 ? prefill_s : decode_s) += std::chrono::duration<double>(t2 - t0).count();
    if (i == 0) prefill_bytes = link->bytes_sent() + link->bytes_received();

    const net::StepReply r = net::decode_res(res, fwd.flags, uint32_t(cfg.n_vocab));
    if (r.token < 0 || std::size_t(r.token) >= cfg.n_vocab)
      throw Error(link->who() + ": RES seq " + std::to_string(i) + " carries token id " + std::to_string(r.token) +
                  " outside the vocabulary [0, " + std::to_string(cfg.n_vocab) + ")");
    if (check) {
      // Not timed: the reference doubles the work, it is not part of the pipeline's cost.
      ref->run(feed, pos, ref_logits.data(), 1);
      const Sha256Digest want = net::logits_digest(ref_logits);
      ++verified;
      if (r.digest && *r.digest == want) {
        ++matched;
      } else if (verified - matched <= 3) {
        std::cout << "\n  MISMATCH pos=" << pos + int64_t(feed.size()) << ": distributed "
                  << (r.digest ? to_hex(*r.digest).substr(0, 12) : std::string("(none)")) << " local "
                  << to_hex(want).substr(0, 12) << std::endl;
      }
      if (i + 1 == verify_tokens) ref.reset();  // the probe is done: give the memory back
    }
    if (logits_file.is_open())
      logits_file.write(reinterpret_cast<const char*>(r.logits.data()), std::streamsize(r.logits.size() * 4));
    if (digest_file.is_open())
      digest_file << pos + int64_t(feed.size()) << ' ' << r.token << ' ' << to_hex(*r.digest) << '\n';

    pos += int64_t(feed.size());
    feed.assign(1, r.token);
    generated.push_back(r.token);
    const bool eog = tok && tok->is_eog(r.token);
    if (eog && !o.ignore_eos) break;
    if (!o.quiet_text) {
      if (text) std::cout << text->feed(r.token);
      else std::cout << (i ? " " : "") << r.token;
      std::cout.flush();
    }
  }
  if (text && !o.quiet_text) std::cout << text->flush();
  const uint64_t wire_total = link->bytes_sent() + link->bytes_received();
  link.reset();  // ends the session on every worker before the report
  if (logits_file.is_open() && !logits_file.flush()) throw Error("writing --logits-out '" + o.logits_out + "' failed");

  // Report: extra lines first, the prototype's two lines last for scripts.
  const std::size_t n = generated.size();
  const std::size_t n_decode = n > 0 ? n - 1 : 0;
  const std::size_t n_hops = hops.size();
  std::cout << "\n\n";
  std::cout << "  prefill: " << prompt.size() << " tokens in " << detail::fixed(prefill_s * 1e3, 2) << " ms = "
            << detail::fixed(prefill_s > 0 ? double(prompt.size()) / prefill_s : 0.0) << " tokens/s\n";
  std::cout << "  decode: " << n_decode << " tokens in " << detail::fixed(decode_s * 1e3, 2) << " ms = "
            << detail::fixed(decode_s > 0 ? double(n_decode) / decode_s : 0.0) << " tokens/s ("
            << detail::fixed(n_decode ? decode_s * 1e3 / double(n_decode) : 0.0, 3) << " ms/token)\n";
  auto us = [](double ms) { return detail::fixed(ms * 1e3); };
  std::cout << "  round-trip us: min " << us(*std::min_element(rtt_ms.begin(), rtt_ms.end())) << "  p50 "
            << us(net::percentile(rtt_ms, 50)) << "  p99 " << us(net::percentile(rtt_ms, 99)) << "  max "
            << us(*std::max_element(rtt_ms.begin(), rtt_ms.end())) << "\n";
  const double per_token = n_decode ? double(wire_total - prefill_bytes) / double(n_decode) : 0.0;
  std::cout << "  wire: " << detail::fixed(per_token, 0) << " bytes/token per hop while decoding (FWD "
            << net::kModelHeaderBytes << "+" << cfg.n_embd * 4 << " down, RES " << net::kModelHeaderBytes
            << "+4 up, +32 per digest, +" << cfg.n_vocab * 4 << " per --logits-out row) x " << n_hops
            << " hop(s) = " << detail::fixed(per_token * double(n_hops), 0) << " bytes/token; prefill "
            << prefill_bytes << " bytes per hop\n";
  std::cout << "  tokens:";
  for (int32_t t : generated) std::cout << ' ' << t;
  std::cout << "\n  verify: " << verify_note << "\n";

  std::cout << "\n"
            << n << " tokens  round-trip ms: min " << detail::fixed(*std::min_element(rtt_ms.begin(), rtt_ms.end()))
            << "  p50 " << detail::fixed(net::percentile(rtt_ms, 50)) << "  p99 "
            << detail::fixed(net::percentile(rtt_ms, 99)) << "  max "
            << detail::fixed(*std::max_element(rtt_ms.begin(), rtt_ms.end())) << "\n";
  if (verified == 0) {
    std::cout << "byte-identity: " << (o.verify == Verify::none ? "skipped (--verify none)" : verify_note)
              << "; workers hold the far layers" << std::endl;
    return kExitOk;
  }
  if (matched == verified) {
    std::cout << "byte-identity: " << verified << "/" << verified << " IDENTICAL  == pipeline split PASSED =="
              << std::endl;
    return kExitOk;
  }
  std::cout << "byte-identity: " << matched << "/" << verified << " identical  FAIL (" << (verified - matched) << ")"
            << (profile_diff.empty() ? "" : "  (numeric profiles differ: identity was not expected)") << std::endl;
  return kExitMismatch;
}

}  // namespace pp::node
