// `--cuts auto`: layer ranges in proportion to each stage's measured speed, within each stage's free memory.
//
// Every stage runs one decoder layer on one row (net::measure_probe; workers answer PROBE with it). A
// stage's time per token is modelled as layers x its layer time, plus, on the last stage, the output
// projection, costed as a layer scaled by its share of weight bytes (both are memory-bound reads). Layers
// are handed out one at a time to the stage whose time grows least, so the slowest stage's time is as
// small as the split allows; a stage never gets more layers than 90% of its free memory holds (weights
// plus the KV caches of `sessions` sessions), unless no stage has room left.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "pp/core/error.hpp"
#include "pp/net/probe.hpp"

namespace pp::node {

struct StageProbe {
  std::string who;         // "coordinator" or host:port
  net::ProbeReport report;
};

struct CutPlan {
  std::vector<int> cuts;     // one per worker
  std::vector<int> layers;   // per stage
  std::vector<double> ms;    // estimated per-token time per stage
  bool over_memory = false;  // some stage got more than its memory holds
};

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
  auto fits = [&](std::size_t i, int n) {
    const net::ProbeReport& r = stages[i].report;
    if (r.mem_available == 0) return true;
    const double need = double(n) * double(r.layer_bytes + r.kv_bytes_per_layer * sessions) +
                        (i + 1 == S ? double(r.head_bytes) : 0.0);
    return need <= 0.9 * double(r.mem_available);
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
    if (!fits(best, p.layers[best] + 1)) p.over_memory = true;
    ++p.layers[best];
  }
  int at = 0;
  for (std::size_t i = 0; i < S; ++i) {
    if (i > 0) p.cuts.push_back(at);
    at += p.layers[i];
    p.ms.push_back(time(i, p.layers[i]));
  }
  return p;
}

inline std::string plan_text(const std::vector<StageProbe>& stages, const CutPlan& p) {
  auto fixed = [](double v, int d) {
    char b[64];
    std::snprintf(b, sizeof b, "%.*f", d, v);
    return std::string(b);
  };
  std::string s = "cut plan (--cuts auto): one decoder layer timed on one row on every stage\n";
  int lo = 0;
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const net::ProbeReport& r = stages[i].report;
    const int hi = lo + p.layers[i];
    s += "  stage " + std::to_string(i) + "  " + stages[i].who + "  " + r.arch + " x " + std::to_string(r.threads);
    s += "  layer " + fixed(r.layer_us * 1e-3, 2) + " ms  free ";
    s += r.mem_available ? fixed(double(r.mem_available) / double(1ull << 30), 1) + " GiB" : std::string("?");
    s += "  -> layers [" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
    if (i + 1 == stages.size()) s += " + output (" + fixed(head_ms(r), 2) + " ms)";
    s += "  ~" + fixed(p.ms[i], 2) + " ms/token\n";
    lo = hi;
  }
  s += "  --cuts ";
  for (std::size_t i = 0; i < p.cuts.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(p.cuts[i]);
  }
  if (p.over_memory) s += "  (warning: a stage holds more than 90% of its free memory)";
  return s + "\n";
}

}  // namespace pp::node
