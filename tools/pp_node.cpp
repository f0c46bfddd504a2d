// pp_node: one forward pass split at layer boundaries across machines over TCP (a real model, or the placeholder transform).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <csignal>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/build_info.hpp"
#include "common/cli.hpp"
#include "node/placeholder_run.hpp"
#include "node/process.hpp"
#include "node/prompt_run.hpp"
#include "node/psk.hpp"
#include "node/serve.hpp"
#include "node/worker_run.hpp"
#include "pp/core/error.hpp"
#include "pp/io/ollama.hpp"
#include "pp/model.hpp"
#include "pp/net/model_worker.hpp"
#include "pp/net/placeholder.hpp"
#include "pp/net/socket.hpp"

namespace {

using pp::net::Millis;
using pp::node::kExitFailure;
using pp::node::kExitMismatch;
using pp::node::kExitOk;
using pp::node::kExitUsage;
using pp::node::Geometry;
using pp::node::install_stop_handlers;
using pp::node::UsageError;
using pp::node::g_stop_requested;

constexpr uint16_t kDefaultPort = 52100;

Millis seconds_to_millis(double s) {
  if (s <= 0) return pp::net::kNoTimeout;
  const double ms = s * 1000.0;
  return ms < 1 ? Millis{1} : Millis{static_cast<int64_t>(ms + 0.5)};
}

// "H1[:P1],H2[:P2],..." in chain order; a host without a port takes --port.
std::vector<pp::net::Peer> parse_workers(const std::string& list, uint16_t default_port) {
  std::vector<pp::net::Peer> out;
  std::size_t start = 0;
  while (start <= list.size()) {
    const std::size_t comma = std::min(list.find(',', start), list.size());
    const std::string item = list.substr(start, comma - start);
    const std::size_t colon = item.rfind(':');
    pp::net::Peer p{item, default_port};
    if (colon != std::string::npos) {
      p.host = item.substr(0, colon);
      const std::string port = item.substr(colon + 1);
      std::size_t used = 0;
      long v = -1;
      try {
        v = std::stol(port, &used);
      } catch (const std::exception&) {
      }
      if (used != port.size() || v < 1 || v > 65535)
        throw UsageError{"--coordinator: '" + item + "': port '" + port + "' is not in [1, 65535]"};
      p.port = static_cast<uint16_t>(v);
    }
    if (p.host.empty()) throw UsageError{"--coordinator: empty host in '" + list + "'"};
    out.push_back(p);
    start = comma + 1;
  }
  return out;
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
  // real model
  std::string model;
  bool cut_given = false;
  std::vector<int> cuts;
  std::optional<std::string> prompt;
  std::string prompt_ids;
  std::string verify = "probe";
  pp::tools::SamplingFlags sampling;
  bool ignore_eos = false;
  bool mapped = false;
  unsigned threads = 0;
  int64_t ctx = 0;
  int64_t max_ctx = 0;
  std::string logits_out;
  std::string dump_digests;
  double load_timeout_s = 120.0;
  // hardening
  std::string psk_file;
  int64_t max_sessions = static_cast<int64_t>(pp::net::kDefaultMaxSessions);
  double resume_s = 0;
  // serving (docs/SERVING.md)
  bool serve = false, chat = false;
  std::string http_host = "127.0.0.1";
  int64_t http_port = 8080;
  std::vector<std::string> cors_origins;
  std::string log_level = "info";
  int64_t parallel = 8;
  int64_t micro_batches = 0;
  std::string system_prompt;
  std::string cuts_arg;  // "C1,C2,..." or "auto"
  bool cuts_auto = false;
  bool tokens_given = false;
};

// --cuts: "auto" or integers.
std::vector<int> parse_cuts(const std::string& s) {
  if (s.empty()) return {};
  try {
    return pp::tools::parse_int_list(s, "--cuts", INT32_MIN + 1L, INT32_MAX, "an integer (give C1,C2,... or auto)");
  } catch (const pp::RequestError& e) {
    throw UsageError{e.what()};
  }
}

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

// --serve (HTTP) or --chat (terminal) on the chain: docs/SERVING.md.
int run_serving(const Cli& c, const pp::node::ModelRunOptions& run, const pp::ResolvedModel& model) {
  if (c.serve && c.chat) throw UsageError{"give --serve or --chat, not both"};
  if (c.cut_given && c.cuts_auto) throw UsageError{"give --cut C or --cuts auto, not both"};
  require_range("--http-port", c.http_port, 0, 65535);
  require_range("--parallel", c.parallel, 1, static_cast<int64_t>(pp::net::kMaxMuxSessions));
  pp::node::ServeOptions so;
  so.chat = c.chat;
  so.http_host = c.http_host;
  so.http_port = static_cast<int>(c.http_port);
  for (const std::string& o : c.cors_origins) {
    if (!pp::node::CorsPolicy::valid(o))
      throw UsageError{"--cors-origin '" + pp::printable(o, 80) + "' is not an origin: give scheme://host[:port] (http or "
                       "https, no path), or * for any"};
    so.cors.allow(o);
  }
  so.log_requests = c.log_level == "info";
  so.parallel = static_cast<std::size_t>(c.parallel);
  require_range("--micro-batches", c.micro_batches, 0, 64);
  so.micro_batches = static_cast<std::size_t>(c.micro_batches);
  so.cuts_auto = c.cuts_auto;
  const std::size_t slash = model.path.find_last_of('/');
  so.model_id = model.how == "ollama" ? c.model : slash == std::string::npos ? model.path : model.path.substr(slash + 1);
  so.chat_options.system = c.system_prompt;
  so.chat_options.max_tokens = c.tokens_given ? run.tokens : 512;
  so.chat_options.sampling = run.sampling;
  so.chat_options.ignore_eos = run.ignore_eos;
  if (run.psk) so.authenticate = [psk = run.psk](pp::net::Channel& ch) { pp::net::authenticate_with_worker(ch, *psk); };
  install_stop_handlers();
  return pp::node::run_serve(run, so, &g_stop_requested, &pp::node::g_terminate_requested);
}

// Real-model mode: --hidden and --layers come from the model, the cuts are checked against it.
int run_model(const Cli& c, const pp::net::ServerOptions& options, Millis timeout) {
  require_range("--tokens", c.tokens, 1, UINT32_MAX);
  require_range("--ctx", c.ctx, 0, pp::llama::kMaxCtx);
  require_range("--max-ctx", c.max_ctx, 0, pp::llama::kMaxCtx);
  if (!(c.load_timeout_s > 0)) throw UsageError{"--load-timeout must be > 0 seconds"};
  if (c.cut_given && !c.cuts.empty()) throw UsageError{"give --cut C or --cuts C1,C2,..., not both"};
  require_range("--max-sessions", c.max_sessions, 1, 65536);
  if (!(c.resume_s >= 0 && c.resume_s <= 86400)) throw UsageError{"--resume must be in [0, 86400] seconds"};
  std::shared_ptr<const pp::net::PresharedKey> psk;
  try {
    psk = pp::node::load_psk(c.psk_file);  // read once; the bytes are never printed
  } catch (const pp::Error& e) {
    throw UsageError{e.what()};
  }
  const pp::ResolvedModel model = pp::resolve_model(c.model);
  if (model.how == "ollama") std::cout << "model: " << c.model << " -> " << model.path << std::endl;
  if (const int64_t asked = c.worker ? c.max_ctx : c.ctx; asked > 0) {  // header only: no weight is read
    if (const std::string w = pp::Model::open(model.path)->ctx_warning(std::size_t(asked)); !w.empty())
      std::cerr << "pp_node: warning: " << (c.worker ? "--max-ctx: " : "--ctx: ") << w << std::endl;
  }

  pp::net::ModelWorkerOptions wopt;
  wopt.path = model.path;
  if (model.how == "ollama") wopt.name = c.model;
  wopt.threads = c.threads;
  wopt.residency = c.mapped ? pp::Residency::Mapped : pp::Residency::Anonymous;
  wopt.max_ctx = static_cast<uint32_t>(c.max_ctx);
  wopt.link = pp::net::Timeouts{timeout, timeout};
  wopt.load_wait = seconds_to_millis(c.load_timeout_s);
  wopt.max_sessions = static_cast<std::size_t>(c.max_sessions);
  wopt.psk = psk;
  if (c.worker) return pp::node::run_model_worker(c.host, static_cast<uint16_t>(c.port), wopt, options);

  pp::node::ModelRunOptions run;
  run.path = model.path;
  run.name = wopt.name;
  run.cuts = c.cut_given ? std::vector<int>{static_cast<int>(std::clamp<int64_t>(c.cut, INT32_MIN, INT32_MAX))} : c.cuts;
  run.prompt = c.prompt;
  if (!c.prompt_ids.empty()) {
    try {
      run.prompt_ids = pp::tools::parse_prompt_ids(c.prompt_ids);
    } catch (const pp::RequestError& e) {
      throw UsageError{e.what()};
    }
  }
  if (c.prompt && !run.prompt_ids.empty()) throw UsageError{"give --prompt or --prompt-ids, not both"};
  run.tokens = static_cast<uint32_t>(c.tokens);
  if (c.no_verify && c.verify != "probe") throw UsageError{"give --no-verify or --verify, not both"};
  run.verify = c.no_verify || c.verify == "none" ? pp::node::Verify::none
               : c.verify == "all"               ? pp::node::Verify::all
                                                 : pp::node::Verify::probe;
  pp::tools::SamplingFlags sampling = c.sampling;
  try {
    run.sampling = sampling.params();
  } catch (const pp::RequestError& e) {
    throw UsageError{e.what()};
  }
  if (const std::string note = sampling.seed_note(); !note.empty()) std::cerr << "pp_node: " << note << std::endl;
  run.ignore_eos = c.ignore_eos;
  run.threads = c.threads;
  run.residency = wopt.residency;
  run.ctx = static_cast<uint32_t>(c.ctx);
  run.logits_out = c.logits_out;
  run.dump_digests = c.dump_digests;
  run.timeouts = pp::net::Timeouts{timeout, timeout};
  run.load_wait = wopt.load_wait;
  run.psk = psk;
  run.resume = c.resume_s > 0 ? seconds_to_millis(c.resume_s) : Millis{0};
  if (c.selftest) {
    const std::size_t n_workers = c.cuts.empty() ? 1 : c.cuts.size();
    return pp::node::run_model_selftest(std::move(run), n_workers, wopt, options);
  }
  if (!c.coordinator.empty()) run.workers = parse_workers(c.coordinator, static_cast<uint16_t>(c.port));
  if (c.serve || c.chat) return run_serving(c, run, model);
  if (c.cuts_auto) throw UsageError{"--cuts auto needs --serve or --chat"};
  install_stop_handlers();  // Ctrl-C ends the generation after the current token, with its report
  run.stop = &g_stop_requested;
  return pp::node::run_model_coordinator(run);
}

int run(const Cli& c) {
  // --serve / --chat with --model and no --coordinator: the whole model in this process.
  const bool one_process = (c.serve || c.chat) && c.coordinator.empty() && !c.selftest && !c.worker;
  if (one_process && c.model.empty()) throw UsageError{"--serve and --chat need --model (a GGUF file or an Ollama tag)"};
  const int modes = int{c.selftest} + int{c.worker} + int{!c.coordinator.empty()} + int{one_process};
  if (modes != 1)
    throw UsageError{"exactly one of --selftest, --worker, --coordinator HOST (or --serve / --chat with --model alone) "
                     "is required"};
  if ((c.serve || c.chat) && (c.selftest || c.worker))
    throw UsageError{std::string(c.serve ? "--serve" : "--chat") + " runs a coordinator: give --coordinator HOST,... "
                     "(or only --model for one process), not --" + (c.selftest ? "selftest" : "worker")};
  require_range("--max-payload", c.max_payload, 4, UINT32_MAX);
  require_range("--max-layer-range", c.max_layer_range, 1, UINT32_MAX);
  require_range("--max-connections", c.max_connections, 1, 65536);
  if (!(c.timeout_s > 0)) throw UsageError{"--timeout must be > 0 seconds"};
  if (!(c.idle_timeout_s >= 0)) throw UsageError{"--idle-timeout must be >= 0 seconds (0 = never)"};
  if (!c.model.empty()) {
    require_range("--port", c.port, c.worker ? 0 : 1, 65535);
    const Millis timeout = seconds_to_millis(c.timeout_s);
    pp::net::ServerOptions options;
    options.max_connections = static_cast<std::size_t>(c.max_connections);
    options.timeouts = pp::net::Timeouts{timeout, seconds_to_millis(c.idle_timeout_s)};
    options.peer_role = "peer";
    options.refuse = pp::net::ModelWorker::refuse;  // busy, said in version 2
    return run_model(c, options, timeout);
  }
  if (!c.cuts.empty()) throw UsageError{"--cuts needs --model (the placeholder has two stages: use --cut)"};
  if (!c.psk_file.empty())
    throw UsageError{"--psk-file needs --model: the placeholder protocol (version 1) has no authentication"};
  if (const char* env = std::getenv(pp::node::kPskEnv); env && *env)
    std::cerr << "pp_node: warning: " << pp::node::kPskEnv
              << " is ignored without --model: the placeholder protocol (version 1) has no authentication" << std::endl;
  const Geometry g = validated_geometry(c);
  require_range("--port", c.port, c.worker ? 0 : 1, 65535);

  const pp::net::FrameLimits limits{static_cast<uint32_t>(c.max_payload),
                                    static_cast<uint32_t>(c.max_layer_range)};
  const Millis timeout = seconds_to_millis(c.timeout_s);
  pp::net::ServerOptions options;
  options.max_connections = static_cast<std::size_t>(c.max_connections);
  options.timeouts = pp::net::Timeouts{timeout, seconds_to_millis(c.idle_timeout_s)};
  options.peer_role = "peer";

  if (c.selftest) return pp::node::run_placeholder_selftest(g, limits, options, timeout);
  if (c.worker) return pp::node::run_placeholder_worker(c.host, static_cast<uint16_t>(c.port), limits, options);
  return pp::node::run_placeholder_coordinator(pp::net::Peer{c.coordinator, static_cast<uint16_t>(c.port)}, g, !c.no_verify, timeout);
}

}  // namespace

int main(int argc, char** argv) {
  if (!pp::tools::cpu_runs_this_build("pp_node")) return pp::tools::kExitUsage;
  std::signal(SIGPIPE, SIG_IGN);  // sockets use MSG_NOSIGNAL; this covers a closed stdout pipe too
  CLI::App app{"pp_node: a forward pass split at layer boundaries across machines over TCP.\n"
               "With --model it runs the real model (workers get their layer range in the handshake);\n"
               "without it, the placeholder transform, which proves the transport."};
  app.footer(std::string(pp::tools::kExitFooter) +
             " The run fails (1) when byte-identity does not hold.\n"
             "Environment: PP_THREADS (--threads), PP_CTX (--ctx), PP_NODE_PSK (--psk-file), PP_EXACT_FLOAT=1 "
             "(--exact-float), PP_NO_AMX=1 (no AMX tiles); Ollama tags are looked up in $OLLAMA_MODELS or "
             "~/.ollama/models.\n"
             "SIGINT/SIGTERM: a --prompt run ends after the token in flight and reports the tokens generated.");
  app.set_version_flag("--version", [] { return pp::tools::version_line("pp_node"); });
  Cli c;
  app.add_flag("--selftest", c.selftest,
               "run every stage in one process on loopback (correctness gate; with --model one worker per cut, "
               "every token verified)");
  app.add_flag("--worker", c.worker,
               "serve a later stage to several connections: layers [cut, layers), or with --model the range "
               "each session's handshake assigns");
  app.add_option("--coordinator", c.coordinator,
                 "run stage A (layers [0, cut)) against the worker at HOST; with --model a chain "
                 "H1[:P1],H2[:P2],... in order")
      ->type_name("HOST");
  app.add_option("--port", c.port, "worker port (worker: 0 binds an ephemeral port, printed)")
      ->capture_default_str();
  app.add_option("--host", c.host, "worker bind address")->capture_default_str();
  app.add_option("--hidden", c.hidden, "placeholder: residual width in uint32 words (activation = hidden*4 bytes)")
      ->capture_default_str();
  app.add_option("--layers", c.layers, "placeholder: total layers (with --model: the model's)")->capture_default_str();
  auto* cut_opt = app.add_option("--cut", c.cut, "stage boundary layer, 0 < cut < layers")->capture_default_str();
  pp::tools::add_tokens_flag(app, c.tokens, "tokens to generate (placeholder: to stream)", UINT32_MAX)->capture_default_str();
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
  // Real model.
  pp::tools::add_model_flag(app, c.model, "GGUF file or Ollama tag: run the real model");
  app.add_option("--cuts", c.cuts_arg,
                 "with --model: stage boundaries C1,C2,... (one per worker; default even), or auto (--serve, "
                 "--chat: time every stage and split in proportion)");
  app.add_option("-p,--prompt", c.prompt, "with --model: prompt text (default 'The capital of France is')");
  app.add_option("--prompt-ids", c.prompt_ids, "with --model: prompt token ids, comma-separated");
  app.add_option("--verify", c.verify,
                 "with --model: probe (first 4 tokens against this process), all (every token), none")
      ->check(CLI::IsMember({"probe", "all", "none"}))
      ->capture_default_str();
  c.sampling.add_to(app);
  app.add_flag("--ignore-eos", c.ignore_eos, "keep generating past end-of-generation tokens");
  pp::tools::add_threads_flag(app, c.threads, "compute threads per stage (0 = all cores)")->capture_default_str();
  bool exact_float = false;
  app.add_flag("--exact-float", exact_float, pp::tools::kExactFloatHelp);
  app.add_flag("--mapped", c.mapped,
               "use the weights from the file mapping (shared page cache) instead of copying them into "
               "anonymous huge-page memory (the default: faster decode)");
  app.add_option("--ctx", c.ctx, "coordinator: KV capacity of every stage (0 = min(4096, model context))")
      ->envname("PP_CTX")
      ->capture_default_str();
  app.add_option("--max-ctx", c.max_ctx, "worker: largest KV capacity a session may ask for (0 = min(4096, model))")
      ->capture_default_str();
  app.add_option("--logits-out", c.logits_out,
                 "coordinator: write every sampled position's logits, raw little-endian f32 [tokens, n_vocab]");
  app.add_option("--dump-digests", c.dump_digests,
                 "coordinator: write 'position token sha256-of-logits' per generated token");
  app.add_option("--load-timeout", c.load_timeout_s, "seconds a handshake may wait for workers to load their layers")
      ->capture_default_str();
  // Hardening (docs/HARDENING.md).
  app.add_option("--psk-file", c.psk_file,
                 "with --model: a pre-shared key (16 to 4096 bytes; default: $PP_NODE_PSK) every connection must "
                 "prove it holds before anything else, both ways; give every end the same one")
      ->type_name("FILE");
  app.add_option("--max-sessions", c.max_sessions, "worker: sessions kept at once; a HELLO beyond is refused")
      ->capture_default_str();
  app.add_option("--resume", c.resume_s,
                 "coordinator: when the chain fails mid-generation, keep re-establishing it for up to this many "
                 "seconds and replay the session into it (0 = stop with the error)")
      ->capture_default_str();
  // Serving.
  app.add_flag("--serve", c.serve,
               "coordinator: serve the OpenAI API over HTTP (POST /v1/completions, /v1/chat/completions; "
               "GET /v1/models, /health, /metrics)");
  app.add_flag("--chat", c.chat, "coordinator: an interactive chat in this terminal (the model's chat template)");
  app.add_option("--http-host", c.http_host, "--serve: bind address (not loopback: anyone who reaches it may use it)")
      ->capture_default_str();
  app.add_option("--http-port", c.http_port, "--serve: port (0: an ephemeral one, printed)")->capture_default_str();
  app.add_option("--cors-origin", c.cors_origins,
                 "--serve: a browser origin (scheme://host[:port]) whose pages may read the API's responses; repeat "
                 "for more, * for any (default: none, only same-origin pages such as the built-in one)")
      ->type_name("ORIGIN");
  app.add_option("--log-level", c.log_level, "--serve: info (a line per request, the default) or warn (warnings only)")
      ->check(CLI::IsMember({"warn", "info"}))
      ->capture_default_str();
  app.add_option("--parallel", c.parallel,
                 "--serve: generations decoding at once (each a session on every worker; keep it below the "
                 "workers' --max-sessions); more wait in a queue")
      ->capture_default_str();
  app.add_option("--micro-batches", c.micro_batches,
                 "--serve/--chat: micro-batches the running generations are split into, each in flight at once "
                 "(at most one per stage; 0: measured while they run, 1 or one per stage, whichever serves more tokens)")
      ->capture_default_str();
  app.add_option("--system", c.system_prompt, "--chat: a system message");
  auto* tokens_opt = app.get_option("--tokens");
  if (const auto code = pp::tools::parse_command_line(app, argc, argv, "pp_node")) return *code;
  c.cut_given = cut_opt->count() > 0;
  c.tokens_given = tokens_opt->count() > 0;
  pp::tools::set_exact_float(exact_float);

  const char* role = c.selftest ? "selftest" : c.worker ? "worker" : "coordinator";
  try {
    c.cuts_auto = c.cuts_arg == "auto";
    if (!c.cuts_auto) c.cuts = parse_cuts(c.cuts_arg);
    return run(c);
  } catch (const UsageError& e) {
    std::cerr << "pp_node: error: " << e.message << " (see --help)" << std::endl;
    return kExitUsage;
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "pp_node " << role << ": " << e.what() << std::endl;
    // A model or prompt this process cannot use cannot start (2); what fails later is a peer or the link.
    return pp::tools::is_input_error(e) ? kExitUsage : kExitFailure;
  }
}
