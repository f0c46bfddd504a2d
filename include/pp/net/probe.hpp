// PROBE: how fast one machine runs a decoder layer and how much memory it has, for `--cuts auto`.
//
// The coordinator sends PROBE (empty payload) on a fresh connection; the worker maps one decoder layer
// of its model, times it on one row (a decode step) and answers PROBE with key=value lines. The
// coordinator measures itself the same way and splits the layers in proportion (tools/node/cut_plan.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pp/core/buffer.hpp"
#include "pp/core/error.hpp"
#include "pp/io/llama_loader.hpp"
#include "pp/kernels/simd.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/model_link.hpp"
#include "pp/net/mux_frame.hpp"
#include "pp/stage.hpp"

namespace pp::net {

struct ProbeReport {
  double layer_us = 0;         // median wall time of one decoder layer on one row
  uint64_t layer_bytes = 0;    // weight bytes of one decoder layer
  uint64_t head_bytes = 0;     // weight bytes of the final norm and output projection
  uint64_t embd_bytes = 0;     // weight bytes of the token embedding table (held by the first stage)
  uint64_t kv_bytes_per_layer = 0;  // KV cache of one session for one layer at max_ctx
  uint64_t mem_available = 0;  // bytes (/proc/meminfo MemAvailable); 0 when unknown
  unsigned threads = 0;
  std::string arch;
  uint32_t max_ctx = 0;
};

inline uint64_t mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kb = 0;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

// Maps one middle layer of `path` (only its tensors are touched), runs it on one row at positions
// 0..7 and takes the median of the last six runs (the first two warm caches and the pool).
inline ProbeReport measure_probe(const std::string& path, unsigned threads, uint32_t max_ctx) {
  using clock = std::chrono::steady_clock;
  const std::shared_ptr<const Model> model = Model::open(path);
  const gguf::File& g = model->gguf();
  const Config& c = model->config();
  const int mid = int(c.n_layer) / 2;
  StageOptions so;
  so.ctx = 64;
  so.threads = threads;
  const Stage st(model, LayerRange{mid, mid + 1}, so);
  Sequence seq = st.new_sequence();
  Buffer<float> row(c.n_embd);  // [1, n_embd]
  std::vector<double> us;
  for (int pos = 0; pos < 48; ++pos) {  // ~0.2 s on a 1B layer: one short burst varies by 20%
    for (std::size_t i = 0; i < c.n_embd; ++i) row[i] = 0.01f * float((i * 7 + std::size_t(pos)) % 13) - 0.06f;
    const auto t0 = clock::now();
    st.forward(seq, pos, row.data(), 1);
    if (pos >= 4) us.push_back(std::chrono::duration<double, std::micro>(clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  ProbeReport r;
  r.layer_us = us[us.size() / 4];  // the lower quartile: what the layer costs when nothing else runs
  for (const auto& n : llama::block_tensor_names(mid)) r.layer_bytes += g.tensor(n)->n_bytes;
  r.head_bytes = g.tensor("output_norm.weight")->n_bytes + g.tensor(llama::output_tensor_name(g))->n_bytes;
  r.embd_bytes = g.tensor("token_embd.weight")->n_bytes;
  r.kv_bytes_per_layer = KvCache::bytes_per_layer(max_ctx, c.kv_dim());
  r.mem_available = mem_available_bytes();
  r.threads = st.threads();
  r.arch = simd::Best::name();
  r.max_ctx = max_ctx;
  return r;
}

inline std::string encode_probe(const ProbeReport& r) {
  return "layer_us=" + detail::double_text(r.layer_us) + "\nlayer_bytes=" + std::to_string(r.layer_bytes) +
         "\nhead_bytes=" + std::to_string(r.head_bytes) + "\nembd_bytes=" + std::to_string(r.embd_bytes) + "\nkv_bytes_per_layer=" + std::to_string(r.kv_bytes_per_layer) +
         "\nmem_available=" + std::to_string(r.mem_available) + "\nthreads=" + std::to_string(r.threads) +
         "\narch=" + detail::clean(r.arch) + "\nmax_ctx=" + std::to_string(r.max_ctx) + "\n";
}

inline ProbeReport decode_probe(std::string_view text) {
  ProbeReport r;
  bool have_us = false;
  for (const auto& [k, v] : detail::parse_lines(text, "PROBE")) {
    if (k == "layer_us") r.layer_us = detail::parse_double(k, v), have_us = true;
    else if (k == "layer_bytes") r.layer_bytes = detail::parse_uint<uint64_t>(k, v, UINT64_MAX);
    else if (k == "head_bytes") r.head_bytes = detail::parse_uint<uint64_t>(k, v, UINT64_MAX);
    else if (k == "embd_bytes") r.embd_bytes = detail::parse_uint<uint64_t>(k, v, UINT64_MAX);
    else if (k == "kv_bytes_per_layer") r.kv_bytes_per_layer = detail::parse_uint<uint64_t>(k, v, UINT64_MAX);
    else if (k == "mem_available") r.mem_available = detail::parse_uint<uint64_t>(k, v, UINT64_MAX);
    else if (k == "threads") r.threads = detail::parse_uint<unsigned>(k, v, 65535);
    else if (k == "arch") r.arch = std::string(v.substr(0, 64));
    else if (k == "max_ctx") r.max_ctx = detail::parse_uint<uint32_t>(k, v, UINT32_MAX);
  }
  if (!have_us || !(r.layer_us > 0) || r.layer_us > 1e9)
    throw HandshakeError("PROBE reply without a positive layer_us");
  return r;
}

// The worker's side: measures and answers on `up` (the reply echoes the request's header).
inline void answer_probe(Channel& up, const ModelHeader& m, const std::string& path, unsigned threads,
                         uint32_t max_ctx) {
  if (m.payload_bytes > kMaxTextPayload)
    throw FrameError("PROBE: payload_bytes " + std::to_string(m.payload_bytes) + " > limit " +
                     std::to_string(kMaxTextPayload));
  up.discard_payload(m.payload_bytes);
  ModelHeader r = m;
  r.type = kTypeProbe;
  send_model_text(up, r, encode_probe(measure_probe(path, threads, max_ctx)));
}

// The coordinator's side: one PROBE on a fresh connection to `peer`. Throws naming the peer; a worker
// that does not know PROBE (an older pp_node) answers ERR, which comes back as an Error too.
// `auth` runs first when the worker requires a key.
inline ProbeReport probe_worker(const Peer& peer, Timeouts t, Millis wait,
                                const std::function<void(Channel&)>& auth = {}) {
  const std::string who = "worker " + peer.str();
  Channel ch(connect_tcp(peer, t.io, who), peer, "worker", Timeouts{t.io, wait});
  if (auth) auth(ch);
  ModelHeader h;
  h.type = kTypeProbe;
  send_model_text(ch, h, "");
  const std::optional<FrameHeader> fh = ch.read_header();
  if (!fh) throw NetError(NetError::Kind::closed, who + ": closed the connection before answering PROBE");
  if (fh->version != kVersionModel) {
    const std::string text = fh->type == kTypeErr ? read_text(ch, fh->payload_bytes, "ERR") : "";
    throw Error(who + ": answered PROBE with version " + std::to_string(fh->version) + " " + text);
  }
  const ModelHeader m = read_extension(ch, *fh);
  const std::string text = read_text(ch, m.payload_bytes, model_type_name(m.type));
  if (m.type == kTypeErr) throw Error(who + " refused PROBE: " + text);
  if (m.type != kTypeProbe) throw FrameError(who + " answered PROBE with " + model_type_name(m.type));
  try {
    return decode_probe(text);
  } catch (const HandshakeError& e) {
    throw Error(who + ": malformed PROBE reply: " + e.what());
  }
}

}  // namespace pp::net
