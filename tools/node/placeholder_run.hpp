// pp_node's placeholder mode (PCPL version 1, the prototype's protocol): the worker, the coordinator and the self-test.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "node/process.hpp"
#include "pp/core/error.hpp"
#include "pp/core/hex.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/frame.hpp"
#include "pp/net/latency.hpp"
#include "pp/net/placeholder.hpp"
#include "pp/net/placeholder_worker.hpp"
#include "pp/net/server.hpp"
#include "pp/net/sha256.hpp"
#include "pp/net/socket.hpp"

namespace pp::node {

using net::Millis;

// Placeholder run geometry, validated: 0 < cut < layers, hidden * 4 fits a frame.
// Placeholder run geometry, validated: 0 < cut < layers, hidden * 4 fits a frame.
struct Geometry {
  uint32_t hidden = 2880;  // words per activation
  uint32_t layers = 24;
  uint32_t cut = 12;
  uint32_t tokens = 64;
  uint32_t nbytes() const { return hidden * 4; }
};

std::string ms1(double ms) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f", ms);
  return buf;
}

inline std::string short_digest(const std::vector<uint8_t>& bytes) {
  const pp::Sha256Digest d = pp::sha256(bytes);
  return pp::to_hex(d).substr(0, 12);
}

// ---- worker (stage B) ----

inline void print_listening(const std::string& host, uint16_t port) {
  std::cout << "pipe worker (stage B) listening on " << host << ":" << port << "  (Ctrl-C to stop)"
            << std::endl;
}

// A worker reachable from other hosts runs whatever frames anyone sends it: say so.
inline void warn_if_exposed(const std::string& host, uint16_t port, const pp::net::FrameLimits& limits,
                     std::size_t max_connections) {
  if (pp::net::is_loopback_host(host)) return;
  std::ostringstream text;  // one write, before the "listening" banner
  text << "pp_node: warning: worker bound to " << host << ":" << port
       << " (not loopback): any host that can reach this port may open up to "
       << max_connections << " connections and have this machine run up to "
       << limits.max_layer_range << " placeholder layers on payloads of up to "
       << limits.max_payload << " bytes per frame, without authentication. "
       << "Bind --host 127.0.0.1 or firewall the port unless that is intended.\n";
  std::cerr << text.str() << std::flush;
}

// What each connection of a placeholder worker runs (the seam a model stage replaces).
inline pp::net::Server::Handler placeholder_handler(const pp::net::FrameLimits& limits) {
  return [limits](pp::net::Channel& ch) { pp::net::serve_placeholder(ch, limits); };
}


inline int run_placeholder_worker(const std::string& host, uint16_t port, const pp::net::FrameLimits& limits,
               const pp::net::ServerOptions& options) {
  pp::net::Listener listener = pp::net::listen_tcp(host, port);
  const uint16_t bound = listener.local.port;
  warn_if_exposed(host, bound, limits, options.max_connections);
  print_listening(host, bound);
  install_stop_handlers();
  pp::net::Server server(std::move(listener), options, placeholder_handler(limits), worker_log);
  server.serve(&g_stop_requested);
  std::cout << "\nworker stopped" << std::endl;
  return kExitOk;
}

// ---- coordinator (stage A) ----

// Reads the worker's reply to FWD `seq` into `reply`; throws naming the worker on anything else.
inline void read_reply(pp::net::Channel& ch, const Geometry& g, uint32_t seq, std::vector<uint8_t>& reply) {
  const auto h = ch.read_header();
  if (!h) {
    throw pp::NetError(pp::NetError::Kind::closed,
                       ch.who() + ": closed the connection before answering FWD seq " + std::to_string(seq));
  }
  pp::net::require_version(*h, pp::net::kVersionPlaceholder);
  if (h->type == pp::net::kTypeErr) {
    if (h->payload_bytes > pp::net::kMaxErrMessageBytes) {
      throw pp::FrameError("ERR from " + ch.who() + ": payload_bytes " + std::to_string(h->payload_bytes) +
                           " > limit " + std::to_string(pp::net::kMaxErrMessageBytes));
    }
    std::vector<uint8_t> text;
    ch.read_payload(text, h->payload_bytes);
    throw pp::Error(ch.who() + ": answered FWD seq " + std::to_string(seq) + " with ERR: " +
                    std::string(text.begin(), text.end()));
  }
  if (h->type != pp::net::kTypeRes || h->seq != seq) {
    throw pp::FrameError("unexpected reply from " + ch.who() + ": type=" + std::to_string(h->type) +
                         " seq=" + std::to_string(h->seq) + " (expected RES seq " + std::to_string(seq) + ")");
  }
  if (h->layer_lo != g.cut || h->layer_hi != g.layers) {
    throw pp::FrameError("RES seq " + std::to_string(seq) + " from " + ch.who() + ": layers [" +
                         std::to_string(h->layer_lo) + ", " + std::to_string(h->layer_hi) +
                         ") != requested [" + std::to_string(g.cut) + ", " + std::to_string(g.layers) + ")");
  }
  // The geometry fixes the reply's size: check it before reading (and allocating) anything.
  if (h->payload_bytes != g.nbytes()) {
    throw pp::FrameError("RES seq " + std::to_string(seq) + " from " + ch.who() + ": payload_bytes " +
                         std::to_string(h->payload_bytes) + " != " + std::to_string(g.nbytes()) +
                         " (hidden " + std::to_string(g.hidden) + " x 4)");
  }
  ch.read_payload(reply, h->payload_bytes);
}

inline int run_placeholder_coordinator(const pp::net::Peer& worker, const Geometry& g, bool verify, Millis timeout) {
  const std::string who = "worker " + worker.str();
  // Waiting for a reply is bounded by the same timeout as any other I/O.
  auto ch = std::make_unique<pp::net::Channel>(pp::net::connect_tcp(worker, timeout, who), worker, "worker",
                                               pp::net::Timeouts{timeout, timeout});
  const uint32_t nbytes = g.nbytes();
  std::cout << "pipe coordinator (stage A) -> " << worker.str() << "\n";
  std::cout << "  hidden=" << g.hidden << " (" << nbytes << " B)  layers=" << g.layers << "  cut@" << g.cut
            << "  stageA=[0," << g.cut << ")  stageB=[" << g.cut << "," << g.layers << ")" << std::endl;

  using clock = std::chrono::steady_clock;
  std::vector<double> lat_ms;
  lat_ms.reserve(std::min<uint32_t>(g.tokens, 1u << 20));
  std::vector<uint8_t> reply;
  uint32_t mismatches = 0;
  const auto start = clock::now();
  for (uint32_t seq = 0; seq < g.tokens; ++seq) {
    std::vector<uint8_t> mid = pp::net::make_input(seq, nbytes);  // [hidden] u32
    pp::net::run_layers(mid, 0, g.cut);
    const auto t0 = clock::now();
    pp::net::FrameHeader fwd;
    fwd.type = pp::net::kTypeFwd;
    fwd.seq = seq;
    fwd.layer_lo = g.cut;
    fwd.layer_hi = g.layers;
    ch->send(fwd, mid);
    read_reply(*ch, g, seq, reply);
    lat_ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
    if (verify) {
      // Ground truth run_layers(make_input(seq), 0, layers), continued from stage A's own
      // [0, cut): the transform composes exactly, so this is the same bytes at less cost.
      std::vector<uint8_t>& ground = mid;
      pp::net::run_layers(ground, g.cut, g.layers);
      if (reply != ground) {
        ++mismatches;
        if (mismatches <= 3) {
          std::cout << "  MISMATCH seq=" << seq << ": dist=" << short_digest(reply)
                    << " ground=" << short_digest(ground) << "\n";
        }
      }
    }
  }
  const double wall_s = std::chrono::duration<double>(clock::now() - start).count();
  ch.reset();  // close before reporting

  // Extra lines first, so the prototype's two report lines stay last for scripts.
  const uint64_t wire = 2 * (uint64_t{pp::net::kFrameHeaderBytes} + nbytes);
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.1f", wall_s > 0 ? g.tokens / wall_s : 0.0);
  std::cout << "  throughput: " << rate << " tokens/s (" << g.tokens << " tokens in " << ms1(wall_s * 1e3)
            << " ms, stage A compute" << (verify ? " and verification" : "") << " included)\n";
  // The prototype's line has 0.1 ms resolution; on loopback that reads 0.0, so also in microseconds.
  auto us = [](double ms) { return ms1(ms * 1e3); };
  std::cout << "  round-trip us: min " << us(*std::min_element(lat_ms.begin(), lat_ms.end())) << "  p50 "
            << us(pp::net::percentile(lat_ms, 50)) << "  p99 " << us(pp::net::percentile(lat_ms, 99)) << "  max "
            << us(*std::max_element(lat_ms.begin(), lat_ms.end())) << "\n";
  std::cout << "  wire: " << wire << " bytes/token (FWD " << pp::net::kFrameHeaderBytes << "+" << nbytes
            << " out, RES " << pp::net::kFrameHeaderBytes << "+" << nbytes << " back)\n";

  std::cout << "\n"
            << g.tokens << " tokens  round-trip ms: min " << ms1(*std::min_element(lat_ms.begin(), lat_ms.end()))
            << "  p50 " << ms1(pp::net::percentile(lat_ms, 50)) << "  p99 "
            << ms1(pp::net::percentile(lat_ms, 99)) << "  max " << ms1(*std::max_element(lat_ms.begin(), lat_ms.end()))
            << "\n";
  if (!verify) {
    std::cout << "byte-identity: skipped (--no-verify); worker holds the far layers" << std::endl;
    return kExitOk;
  }
  if (mismatches == 0) {
    std::cout << "byte-identity: " << g.tokens << "/" << g.tokens << " IDENTICAL  == pipeline split PASSED =="
              << std::endl;
    return kExitOk;
  }
  std::cout << "byte-identity: " << (g.tokens - mismatches) << "/" << g.tokens << " identical  FAIL ("
            << mismatches << ")" << std::endl;
  return kExitMismatch;
}

// ---- selftest: the worker on a thread, bound to an ephemeral loopback port ----

inline int run_placeholder_selftest(const Geometry& g, const pp::net::FrameLimits& limits, pp::net::ServerOptions options,
                 Millis timeout) {
  const std::string host = "127.0.0.1";
  pp::net::Listener listener = pp::net::listen_tcp(host, 0);
  const uint16_t port = listener.local.port;
  print_listening(host, port);
  pp::net::Server server(std::move(listener), std::move(options), placeholder_handler(limits), worker_log);
  std::thread worker([&server] { server.serve(); });
  struct StopOnExit {
    pp::net::Server& server;
    std::thread& thread;
    ~StopOnExit() {
      server.stop();
      thread.join();
    }
  } stop_on_exit{server, worker};
  std::cout << "pipe self-test: stage B on a local thread, splitting the forward\n" << std::endl;
  return run_placeholder_coordinator(pp::net::Peer{host, port}, g, true, timeout);
}

}  // namespace pp::node
