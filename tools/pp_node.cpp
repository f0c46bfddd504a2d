// pp_node: one forward pass split at a layer boundary across machines over TCP (placeholder mode proves the transport).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "pp/core/error.hpp"
#include "pp/core/sha256.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/frame.hpp"
#include "pp/net/latency.hpp"
#include "pp/net/placeholder.hpp"
#include "pp/net/placeholder_worker.hpp"
#include "pp/net/server.hpp"
#include "pp/net/socket.hpp"

namespace {

using pp::net::Millis;

constexpr int kExitOk = 0;
constexpr int kExitMismatch = 1;  // byte-identity failed (the prototype's status)
constexpr int kExitUsage = 2;
constexpr int kExitFailure = 3;   // a peer died, stalled, refused or sent garbage; or a local error

constexpr uint16_t kDefaultPort = 52100;

// Placeholder run geometry, validated: 0 < cut < layers, hidden * 4 fits a frame.
struct Geometry {
  uint32_t hidden = 2880;  // words per activation
  uint32_t layers = 24;
  uint32_t cut = 12;
  uint32_t tokens = 64;
  uint32_t nbytes() const { return hidden * 4; }
};

// Set by SIGINT/SIGTERM; the worker's accept loop polls it.
std::atomic<bool> g_stop_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free);
extern "C" void on_stop_signal(int) { g_stop_requested.store(true); }

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: poll() returns EINTR and the loop sees the flag at once
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

std::string ms1(double ms) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f", ms);
  return buf;
}

std::string short_digest(const std::vector<uint8_t>& bytes) {
  const pp::Sha256Digest d = pp::sha256(bytes);
  return pp::to_hex(d).substr(0, 12);
}

Millis seconds_to_millis(double s) {
  if (s <= 0) return pp::net::kNoTimeout;
  const double ms = s * 1000.0;
  return ms < 1 ? Millis{1} : Millis{static_cast<int64_t>(ms + 0.5)};
}

// ---- worker (stage B) ----

void print_listening(const std::string& host, uint16_t port) {
  std::cout << "pipe worker (stage B) listening on " << host << ":" << port << "  (Ctrl-C to stop)"
            << std::endl;
}

// A worker reachable from other hosts runs whatever frames anyone sends it: say so.
void warn_if_exposed(const std::string& host, uint16_t port, const pp::net::FrameLimits& limits,
                     std::size_t max_connections) {
  if (pp::net::is_loopback_host(host)) return;
  std::cerr << "pp_node: warning: worker bound to " << host << ":" << port
            << " (not loopback): any host that can reach this port may open up to "
            << max_connections << " connections and have this machine run up to "
            << limits.max_layer_range << " placeholder layers on payloads of up to "
            << limits.max_payload << " bytes per frame, without authentication. "
            << "Bind --host 127.0.0.1 or firewall the port unless that is intended." << std::endl;
}

// What each connection of a placeholder worker runs (the seam a model stage replaces).
pp::net::Server::Handler placeholder_handler(const pp::net::FrameLimits& limits) {
  return [limits](pp::net::Channel& ch) { pp::net::serve_placeholder(ch, limits); };
}

void worker_log(const std::string& line) { std::cerr << "pp_node worker: " << line << std::endl; }

int run_worker(const std::string& host, uint16_t port, const pp::net::FrameLimits& limits,
               const pp::net::ServerOptions& options) {
  pp::net::Listener listener = pp::net::listen_tcp(host, port);
  const uint16_t bound = listener.local.port;
  print_listening(host, bound);
  warn_if_exposed(host, bound, limits, options.max_connections);
  install_stop_handlers();
  pp::net::Server server(std::move(listener), options, placeholder_handler(limits), worker_log);
  server.serve(&g_stop_requested);
  std::cout << "\nworker stopped" << std::endl;
  return kExitOk;
}

// ---- coordinator (stage A) ----

// Reads the worker's reply to FWD `seq` into `reply`; throws naming the worker on anything else.
void read_reply(pp::net::Channel& ch, const Geometry& g, uint32_t seq, std::vector<uint8_t>& reply) {
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

int run_coordinator(const pp::net::Peer& worker, const Geometry& g, bool verify, Millis timeout) {
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

int run_selftest(const Geometry& g, const pp::net::FrameLimits& limits, pp::net::ServerOptions options,
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
  return run_coordinator(pp::net::Peer{host, port}, g, true, timeout);
}

// ---- command line ----

struct Cli {
  bool selftest = false;
  bool worker = false;
  std::string coordinator;
  std::string host = "0.0.0.0";
  int64_t port = kDefaultPort;
  int64_t hidden = 2880;
  int64_t layers = 24;
  int64_t cut = 12;
  int64_t tokens = 64;
  bool no_verify = false;
  int64_t max_payload = pp::net::kDefaultMaxPayload;
  int64_t max_layer_range = pp::net::kDefaultMaxLayerRange;
  int64_t max_connections = static_cast<int64_t>(pp::net::kDefaultMaxConnections);
  double timeout_s = 10.0;
  double idle_timeout_s = 300.0;
};

struct UsageError {
  std::string message;
};

void require_range(const char* name, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    throw UsageError{std::string(name) + " " + std::to_string(value) + " outside [" + std::to_string(lo) +
                     ", " + std::to_string(hi) + "]"};
  }
}

// The cut is checked in every mode, as the prototype does; the rest only where it is used (a worker
// takes its geometry from each frame).
Geometry validated_geometry(const Cli& c) {
  require_range("--layers", c.layers, 2, UINT32_MAX);
  if (!(0 < c.cut && c.cut < c.layers)) {
    throw UsageError{"--cut must be between 1 and layers-1 (got --cut " + std::to_string(c.cut) +
                     " with --layers " + std::to_string(c.layers) + ")"};
  }
  if (c.worker) return Geometry{};
  require_range("--hidden", c.hidden, 1, c.max_payload / 4);  // the activation must fit a frame
  require_range("--tokens", c.tokens, 1, UINT32_MAX);
  if (c.layers - c.cut > c.max_layer_range) {
    throw UsageError{"stage B range [" + std::to_string(c.cut) + ", " + std::to_string(c.layers) + ") spans " +
                     std::to_string(c.layers - c.cut) + " layers > --max-layer-range " +
                     std::to_string(c.max_layer_range)};
  }
  return Geometry{static_cast<uint32_t>(c.hidden), static_cast<uint32_t>(c.layers),
                  static_cast<uint32_t>(c.cut), static_cast<uint32_t>(c.tokens)};
}

int run(const Cli& c) {
  const int modes = int{c.selftest} + int{c.worker} + int{!c.coordinator.empty()};
  if (modes != 1) throw UsageError{"exactly one of --selftest, --worker, --coordinator HOST is required"};
  require_range("--max-payload", c.max_payload, 4, UINT32_MAX);
  require_range("--max-layer-range", c.max_layer_range, 1, UINT32_MAX);
  require_range("--max-connections", c.max_connections, 1, 65536);
  if (!(c.timeout_s > 0)) throw UsageError{"--timeout must be > 0 seconds"};
  if (!(c.idle_timeout_s >= 0)) throw UsageError{"--idle-timeout must be >= 0 seconds (0 = never)"};
  const Geometry g = validated_geometry(c);
  require_range("--port", c.port, c.worker ? 0 : 1, 65535);

  const pp::net::FrameLimits limits{static_cast<uint32_t>(c.max_payload),
                                    static_cast<uint32_t>(c.max_layer_range)};
  const Millis timeout = seconds_to_millis(c.timeout_s);
  pp::net::ServerOptions options;
  options.max_connections = static_cast<std::size_t>(c.max_connections);
  options.timeouts = pp::net::Timeouts{timeout, seconds_to_millis(c.idle_timeout_s)};
  options.peer_role = "peer";

  if (c.selftest) return run_selftest(g, limits, options, timeout);
  if (c.worker) return run_worker(c.host, static_cast<uint16_t>(c.port), limits, options);
  return run_coordinator(pp::net::Peer{c.coordinator, static_cast<uint16_t>(c.port)}, g, !c.no_verify, timeout);
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // sockets use MSG_NOSIGNAL; this covers a closed stdout pipe too
  CLI::App app{"pp_node: a forward pass split at a layer boundary across machines over TCP.\n"
               "Without --model it runs the placeholder transform, which proves the transport."};
  app.footer("Exit status: 0 ok, 1 byte-identity mismatch, 2 usage error, 3 peer or transport failure.");
  Cli c;
  app.add_flag("--selftest", c.selftest, "run both stages in one process on loopback (correctness gate)");
  app.add_flag("--worker", c.worker, "run stage B (layers [cut, layers)), serving several connections");
  app.add_option("--coordinator", c.coordinator, "run stage A (layers [0, cut)) against the worker at HOST")
      ->type_name("HOST");
  app.add_option("--port", c.port, "worker port (worker: 0 binds an ephemeral port, printed)")
      ->capture_default_str();
  app.add_option("--host", c.host, "worker bind address")->capture_default_str();
  app.add_option("--hidden", c.hidden, "residual width in uint32 words (activation = hidden*4 bytes)")
      ->capture_default_str();
  app.add_option("--layers", c.layers, "total layers")->capture_default_str();
  app.add_option("--cut", c.cut, "stage boundary layer, 0 < cut < layers")->capture_default_str();
  app.add_option("--tokens", c.tokens, "tokens to stream")->capture_default_str();
  app.add_flag("--no-verify", c.no_verify, "coordinator does not compute ground truth");
  app.add_option("--max-payload", c.max_payload, "largest frame payload accepted, bytes")->capture_default_str();
  app.add_option("--max-layer-range", c.max_layer_range, "longest layer range a FWD may ask for")
      ->capture_default_str();
  app.add_option("--max-connections", c.max_connections, "worker: connections served at once; more are refused")
      ->capture_default_str();
  app.add_option("--timeout", c.timeout_s,
                 "seconds: connect, waiting for a reply, and any stall inside a frame")
      ->capture_default_str();
  app.add_option("--idle-timeout", c.idle_timeout_s,
                 "worker: seconds a connection may sit between frames (0 = never)")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }

  const char* role = c.selftest ? "selftest" : c.worker ? "worker" : "coordinator";
  try {
    return run(c);
  } catch (const UsageError& e) {
    std::cerr << "pp_node: error: " << e.message << "\nRun with --help for more information." << std::endl;
    return kExitUsage;
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "pp_node " << role << ": " << e.what() << std::endl;
    return kExitFailure;
  }
}
