// `--cuts auto`: layer ranges in proportion to each stage's measured speed, within each stage's free memory.
//
// Every stage runs one decoder layer on one row (net::measure_probe; workers answer PROBE with it), all
// stages in turn, kProbeRounds times; combine_probe_rounds compares the stages within each round. A
// stage's time per token is modelled as layers x its layer time, plus, on the last stage, the output
// projection, costed as a layer scaled by its share of weight bytes (both are memory-bound reads). Layers
// are handed out one at a time to the stage whose time grows least, so the slowest stage's time is as
// small as the split allows; a stage never gets more layers than 90% of its free memory holds (weights
// plus the KV caches of `sessions` sessions). A split in which some stage cannot hold its share is refused,
// naming each such stage, what it would need and the shortfall.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "pp/core/error.hpp"
#include "pp/core/printable.hpp"
#include "pp/net/probe.hpp"

namespace pp::node {

struct StageProbe {
  std::string who;         // "coordinator" or host:port
  net::ProbeReport report;
};

struct CutPlan {
  std::vector<int> cuts;         // one per worker
  std::vector<int> layers;       // per stage
  std::vector<double> ms;        // estimated per-token time per stage
  std::vector<uint64_t> weights;  // bytes of weights per stage (its layers; the embedding on the first, the output on the last)
  std::vector<uint64_t> kv;       // bytes of KV caches per stage (`sessions` sessions at the probe's ctx)
};

// Rounds of probes `--cuts auto` takes: all stages in turn, then again.
inline constexpr std::size_t kProbeRounds = 3;

// Each stage's layer time from rounds of probes (us[round][stage], microseconds). A machine's memory speed
// drifts by tens of percent over seconds (other tenants of a VM host: two identical cores of one host, each
// at its best of two rounds, timed 3.1 and 4.2 ms a layer, then served at about the same speed per byte), and
// what the split needs is how the stages compare. So stage 0 keeps its best time, and every other stage gets
// that time x its median ratio to stage 0 within a round: a drift shared by the stages cancels within the
// round, and one outlying round is outvoted.
inline std::vector<double> combine_probe_rounds(const std::vector<std::vector<double>>& us) {
  if (us.empty() || us[0].empty()) throw Error("--cuts auto: no probe rounds");
  const std::size_t S = us[0].size();
  for (const auto& round : us)
    if (round.size() != S) throw Error("--cuts auto: probe rounds of different sizes");
  std::vector<double> out(S);
  out[0] = us[0][0];
  for (const auto& round : us) out[0] = std::min(out[0], round[0]);
  for (std::size_t i = 1; i < S; ++i) {
    std::vector<double> ratio;
    for (const auto& round : us) ratio.push_back(round[i] / round[0]);
    std::sort(ratio.begin(), ratio.end());
    const std::size_t n = ratio.size();
    out[i] = out[0] * (n % 2 ? ratio[n / 2] : 0.5 * (ratio[n / 2 - 1] + ratio[n / 2]));
  }
  return out;
}

inline double head_ms(const net::ProbeReport& r) {
  return r.layer_bytes ? r.layer_us * 1e-3 * double(r.head_bytes) / double(r.layer_bytes) : 0.0;
}

inline CutPlan plan_cuts(const std::vector<StageProbe>& stages, int n_layer, std::size_t sessions) {
  const std::size_t S = stages.size();
  if (S < 2 || std::size_t(n_layer) < S)
    throw Error("--cuts auto: " + std::to_string(S) + " stages cannot share " + std::to_string(n_layer) + " layers");
  auto time = [&](std::size_t i, int n) {
    const net::ProbeReport& r = stages[i].report;
    return n * r.layer_us * 1e-3 + (i + 1 == S ? head_ms(r) : 0.0);
  };
  auto weights = [&](std::size_t i, int n) {
    const net::ProbeReport& r = stages[i].report;
    return uint64_t(n) * r.layer_bytes + (i == 0 ? r.embd_bytes : 0) + (i + 1 == S ? r.head_bytes : 0);
  };
  auto kv = [&](std::size_t i, int n) { return uint64_t(n) * stages[i].report.kv_bytes_per_layer * sessions; };
  auto room = [&](std::size_t i) { return uint64_t(0.9 * double(stages[i].report.mem_available)); };
  auto fits = [&](std::size_t i, int n) {
    return stages[i].report.mem_available == 0 || weights(i, n) + kv(i, n) <= room(i);
  };
  CutPlan p;
  p.layers.assign(S, 1);
  for (int left = n_layer - int(S); left > 0; --left) {
    std::size_t best = S;
    for (int pass = 0; pass < 2 && best == S; ++pass)  // pass 1: ignore memory when nothing fits
      for (std::size_t i = 0; i < S; ++i) {
        if (pass == 0 && !fits(i, p.layers[i] + 1)) continue;
        if (best == S || time(i, p.layers[i] + 1) < time(best, p.layers[best] + 1)) best = i;
      }
    ++p.layers[best];
  }
  int at = 0;
  std::string short_of;
  for (std::size_t i = 0; i < S; ++i) {
    if (i > 0) p.cuts.push_back(at);
    const int n = p.layers[i];
    p.ms.push_back(time(i, n));
    p.weights.push_back(weights(i, n));
    p.kv.push_back(kv(i, n));
    if (!fits(i, n)) {
      const uint64_t need = p.weights.back() + p.kv.back();
      short_of += "; stage " + std::to_string(i) + " (" + stages[i].who + ") would hold layers [" + std::to_string(at) +
                  ", " + std::to_string(at + n) + ")" + (i + 1 == S ? " and the output" : "") + ": weights " +
                  format_bytes(p.weights.back()) + " + KV of " + std::to_string(sessions) + " session(s) " +
                  format_bytes(p.kv.back()) + " = " + format_bytes(need) + ", over 90% of its free memory (" +
                  format_bytes(room(i)) + "), short by " + format_bytes(need - room(i));
    }
    at += n;
  }
  if (!short_of.empty())
    throw RequestError("--cuts auto: the model does not fit in the stages' memory" + short_of +
                       ". Lower --parallel or --ctx, or add a worker");
  return p;
}

inline std::string plan_text(const std::vector<StageProbe>& stages, const CutPlan& p) {
  auto fixed = [](double v, int d) {
    char b[64];
    std::snprintf(b, sizeof b, "%.*f", d, v);
    return std::string(b);
  };
  std::string s = "cut plan (--cuts auto): one decoder layer timed on one row on every stage (" +
                  std::to_string(kProbeRounds) + " rounds, compared within each)\n";
  int lo = 0;
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const net::ProbeReport& r = stages[i].report;
    const int hi = lo + p.layers[i];
    s += "  stage " + std::to_string(i) + "  " + stages[i].who + "  " + r.arch + " x " + std::to_string(r.threads);
    s += "  layer " + fixed(r.layer_us * 1e-3, 2) + " ms  free ";
    s += r.mem_available ? format_bytes(r.mem_available) : std::string("?");
    s += "  -> layers [" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
    if (i + 1 == stages.size()) s += " + output (" + fixed(head_ms(r), 2) + " ms)";
    s += "  ~" + fixed(p.ms[i], 2) + " ms/token  memory " + format_bytes(p.weights[i]) + " weights + " +
         format_bytes(p.kv[i]) + " KV\n";
    lo = hi;
  }
  s += "  --cuts ";
  for (std::size_t i = 0; i < p.cuts.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(p.cuts[i]);
  }
  return s + "\n";
}

}  // namespace pp::node
