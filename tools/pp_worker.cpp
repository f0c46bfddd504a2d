// pp_worker: one pipeline stage served as JSON lines over stdin/stdout (docs/PROTOCOL-WORKER.md).
#include "common/build_info.hpp"
#include "common/cli.hpp"
#include "worker/backend.hpp"
#include "worker/events.hpp"
#include "worker/line_io.hpp"
#include "worker/real_backend.hpp"
#include "worker/server.hpp"
#include "worker/signals.hpp"
#include "worker/startup.hpp"
#include "worker/stub_backend.hpp"

#include <pp/core/error.hpp>
#include <pp/io/ollama.hpp>
#include <pp/model/layer_range.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include <unistd.h>

namespace {

using namespace pp::worker;

constexpr int kExitFatal = pp::tools::kExitFailed;

void say(const std::string& line) {
  const std::string text = "pp_worker: " + line + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
}

// The last word when something escapes every handler (including other threads): an event on
// stderr, whatever PP_WORKER_EVENTS says, since stdout may be mid-line.
[[noreturn]] void on_terminate() {
  std::string what = "terminate called";
  if (const std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = ex.what();
    } catch (...) {
      what = "unknown exception";
    }
  }
  const ordered_json ev = {{"event", "uncaught_exception"}, {"ts", unix_time_s()}, {"what", what}, {"fatal", true}};
  const std::string line = ev.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  [[maybe_unused]] const ssize_t ignored = ::write(2, line.data(), line.size());
  std::_Exit(kExitFatal);
}

std::unique_ptr<Backend> open_backend(const WorkerConfig& cfg, Events& events) {
  if (cfg.stub) return std::make_unique<StubBackend>(cfg.stage, cfg.num_stages, cfg.ctx.value_or(kDefaultStubCtx),
                                                     cfg.stub_delay_ms);
  if (!cfg.model)
    throw StartupError("no model: pass --model or set MODEL (a GGUF path or an Ollama tag), or run with --stub");
  const pp::ResolvedModel model = pp::resolve_model(*cfg.model);
  events.emit("model_resolved",
              {{"model", *cfg.model}, {"path", model.path}, {"how", model.how}, {"manifest", model.manifest},
               {"bytes", model.size}});
  return open_real_backend(cfg, model);
}

ordered_json ready_line(const WorkerConfig& cfg, const Geometry& g, size_t max_line) {
  return {{"status", "ready"},
          {"pid", ::getpid()},
          {"stage", cfg.stage},
          {"num_stages", cfg.num_stages},
          {"role", pp::role_name(pp::stage_role(cfg.stage, cfg.num_stages))},
          {"mode", cfg.stub ? "stub" : "real"},
          {"wire_dtype", wire_dtype_name(cfg.wire_dtype)},
          {"hidden_dim", g.hidden_dim},
          {"vocab_size", g.vocab_size},
          {"total_blocks", g.total_blocks},
          {"layer_range", {g.layer_range.lo, g.layer_range.hi}},
          {"eos_token_ids", g.eos_token_ids},
          {"ctx", g.ctx},
          {"max_line_bytes", max_line}};
}

int serve_with(const WorkerConfig& cfg, LineWriter& out, Events& events) {
  const int wake_fd = install_stop_signals();
  events.emit("starting", {{"pid", ::getpid()},
                           {"stage", cfg.stage},
                           {"num_stages", cfg.num_stages},
                           {"mode", cfg.stub ? "stub" : "real"},
                           {"wire_dtype", wire_dtype_name(cfg.wire_dtype)},
                           {"version", PP_VERSION}});

  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<Backend> backend;
  try {
    backend = open_backend(cfg, events);
  } catch (const pp::Error& e) {  // StartupError, ModelResolveError, GgufError, ModelError
    say(e.what());
    return kExitStartup;
  }
  const Geometry geo = backend->geometry();
  ordered_json loaded = backend->load_report();
  loaded["wall_ms"] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  loaded["resident_mb"] = resident_mb();
  loaded["layer_range"] = {geo.layer_range.lo, geo.layer_range.hi};
  events.emit("model_loaded", loaded);
  if (const auto w = loaded.find("ctx_warning"); w != loaded.end()) events.emit("warning", {{"what", *w}});

  ServeStats stats;
  Server server(*backend, cfg, out, events, stats);
  out.write(ready_line(cfg, geo, server.max_line()).dump() + "\n");
  const Heartbeat heartbeat(events, stats, cfg.heartbeat_secs);
  return server.run(STDIN_FILENO, wake_fd);
}

// Runs the worker; anything that escapes is reported as a fatal `uncaught_exception` event on the
// configured event stream (and as a plain line on stderr when that stream is stdout).
int serve(const WorkerConfig& cfg) {
  LineWriter out(STDOUT_FILENO);
  LineWriter err(STDERR_FILENO);
  Events events(cfg.events_on_stdout ? out : err);
  try {
    return serve_with(cfg, out, events);
  } catch (const OutputError& e) {  // the orchestrator closed our stdout: nobody is left to answer
    Events(err).emit("output_closed", {{"what", e.what()}});
    return kExitFatal;
  } catch (const std::exception& e) {
    events.emit("uncaught_exception", {{"what", e.what()}, {"fatal", true}});
    if (cfg.events_on_stdout) say(std::string("fatal: ") + e.what());
    return kExitFatal;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::set_terminate(on_terminate);
  if (!pp::tools::cpu_runs_this_build("pp_worker")) return pp::tools::kExitUsage;
  CliOptions cli;
  CLI::App app{"pp_worker: one Llama-3.2 pipeline stage over stdin/stdout JSON lines.\n"
               "Environment: STAGE, NUM_STAGES (required), MODEL (--model), PP_CTX (--ctx), PP_THREADS (--threads),\n"
               "PP_WORKER_STUB (--stub), PP_WIRE_DTYPE, PP_WORKER_EVENTS, PP_HEARTBEAT_SECS, PP_EXACT_FLOAT,\n"
               "PP_NO_AMX (see docs/PROTOCOL-WORKER.md). A flag wins over its variable."};
  app.footer(std::string(pp::tools::kExitFooter) + " pp_worker exits 2 for a bad variable or a model it cannot load, "
             "1 when its output closes or an internal error ends it.");
  std::string model, ctx, threads;
  app.set_version_flag("--version", [] { return pp::tools::version_line("pp_worker"); });
  app.add_flag("--stub", cli.stub, "stub mode: no model, deterministic stand-ins (also PP_WORKER_STUB=1)");
  CLI::Option* model_opt = app.add_option("-m,--model", model, "GGUF path or Ollama tag (default: $MODEL)")->type_name("PATH|TAG");
  CLI::Option* threads_opt =
      app.add_option("-t,--threads", threads, "compute threads (default: $PP_THREADS or 0 = every core)")->type_name("N");
  CLI::Option* ctx_opt =
      app.add_option("--ctx", ctx, "KV capacity in positions (default: $PP_CTX or min(4096, model))")->type_name("N");
  if (const auto code = pp::tools::parse_command_line(app, argc, argv, "pp_worker")) return *code;
  if (model_opt->count()) cli.model = model;
  if (ctx_opt->count()) cli.ctx = ctx;
  if (threads_opt->count()) cli.threads = threads;

  WorkerConfig cfg;
  try {
    cfg = read_config(cli);
  } catch (const StartupError& e) {
    say(e.what());
    return kExitStartup;
  }

  try {
    return serve(cfg);
  } catch (const std::exception& e) {
    const ordered_json ev = {{"event", "uncaught_exception"}, {"ts", unix_time_s()}, {"what", e.what()}, {"fatal", true}};
    const std::string line = ev.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    [[maybe_unused]] const ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
    return kExitFatal;
  }
}
