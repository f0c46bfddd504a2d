// pp_node --serve / --chat: bring-up (cut planning, stages loading with a progress line, the chain), then the HTTP server or the terminal chat.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "node/chat_cli.hpp"
#include "node/chat_template.hpp"
#include "node/cut_plan.hpp"
#include "node/http_server.hpp"
#include "node/line_edit.hpp"
#include "node/prompt_run.hpp"
#include "node/openai_api.hpp"
#include "pp/net/coordinator/scheduler.hpp"
#include "pp/net/model_worker.hpp"
#include "node/worker_status.hpp"
#include "pp/core/printable.hpp"
#include "pp/net/probe.hpp"

namespace pp::node {

struct ServeOptions {
  bool chat = false;                  // the terminal chat instead of HTTP
  CorsPolicy cors;                    // --cors-origin: who may read responses from a browser page
  bool log_requests = true;           // --log-level info: one line per request
  std::string http_host = "127.0.0.1";
  int http_port = 8080;
  std::size_t parallel = 16;
  std::size_t micro_batches = 0;      // --micro-batches: 0 = measured (1 or one per stage, the faster)
  bool cuts_auto = false;
  std::string model_id;               // what the API calls the model
  ChatOptions chat_options;
  Authenticate authenticate;          // on every connection to a worker, when the chain requires a key
};

namespace serve_detail {

inline std::string seconds(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f s", s);
  return b;
}

// Every stage's speed (the coordinator measures itself), then the split.
inline std::vector<int> auto_cuts(const ModelRunOptions& run, int n_layer, uint32_t max_ctx, std::size_t sessions,
                                  const Authenticate& auth) {
  // Stage i's probe: the coordinator measures itself, a worker answers PROBE.
  auto probe = [&](std::size_t i) {
    if (i == 0) return net::measure_probe(run.path, run.threads, max_ctx);
    try {
      return net::probe_worker(run.workers[i - 1], run.timeouts, run.load_wait, auth);
    } catch (const std::exception& e) {
      throw Error(std::string("--cuts auto: ") + e.what() + " (an older worker cannot be probed: give --cuts)");
    }
  };
  std::cout << "probing stages for --cuts auto ..." << std::endl;
  std::vector<StageProbe> stages;
  std::vector<std::vector<double>> us(kProbeRounds);
  for (std::size_t i = 0; i <= run.workers.size(); ++i) {
    stages.push_back(StageProbe{i == 0 ? "coordinator" : run.workers[i - 1].str(), probe(i)});
    us[0].push_back(stages.back().report.layer_us);
  }
  for (std::size_t round = 1; round < kProbeRounds; ++round)
    for (std::size_t i = 0; i < stages.size(); ++i) us[round].push_back(probe(i).layer_us);
  const std::vector<double> layer_us = combine_probe_rounds(us);
  for (std::size_t i = 0; i < stages.size(); ++i) stages[i].report.layer_us = layer_us[i];
  const CutPlan plan = plan_cuts(stages, n_layer, sessions);
  std::cout << plan_text(stages, plan) << std::flush;
  return plan.cuts;
}

// While the workers load their layers: one line, redrawn, saying which stages are ready.
class LoadProgress {
 public:
  LoadProgress(const net::Coordinator& e, std::ostream& out, Authenticate auth)
      : e_(e), out_(out), auth_(std::move(auth)), tty_(::isatty(STDOUT_FILENO) == 1) {
    thread_ = std::thread([this] { run(); });
  }
  void stage0_done() { stage0_.store(true); }
  ~LoadProgress() {
    done_.store(true);
    thread_.join();
  }

 private:
  void run() {
    const auto t0 = std::chrono::steady_clock::now();
    std::string last;
    while (!done_.load()) {
      std::string line = "loading: stage 0 " + range(e_.stage_range()) + (stage0_.load() ? " ready" : " loading");
      for (std::size_t i = 0; i < e_.hops().size(); ++i) {
        const net::Hop& h = e_.hops()[i];
        std::string state = "?";
        try {
          const StatusMap st = query_status(h.peer, net::Millis{500}, auth_);
          const auto it = st.find("stages_loaded");
          const std::string want = std::to_string(h.range.lo) + "-" + std::to_string(h.range.hi) + "@" + std::to_string(e_.ctx());
          state = it != st.end() && ("," + it->second + ",").find("," + want + ",") != std::string::npos ? "ready" : "loading";
        } catch (const std::exception&) {
        }
        line += " | stage " + std::to_string(i + 1) + " " + range(h.range) + " " + state;
      }
      const std::string elapsed = seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (tty_) {
        out_ << "\r" << line << "  " << elapsed << "   " << std::flush;
      } else if (line != last) {
        out_ << line << "  " << elapsed << std::endl;
      }
      last = line;
      for (int i = 0; i < 5 && !done_.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (tty_) out_ << "\r" << std::string(last.size() + 16, ' ') << "\r" << std::flush;
  }
  static std::string range(LayerRange r) { return "[" + std::to_string(r.lo) + ", " + std::to_string(r.hi) + ")"; }

  const net::Coordinator& e_;
  std::ostream& out_;
  Authenticate auth_;
  bool tty_;
  std::atomic<bool> done_{false}, stage0_{false};
  std::thread thread_;
};

inline void print_stages(const net::Coordinator& e) {
  const net::NumericProfile mine = net::local_profile(e.stage());
  std::cout << "pipeline: model '" << e.identity().file << "' (" << e.config().n_layer << " layers, hidden "
            << e.config().n_embd << ", vocab " << e.config().n_vocab << "), ctx " << e.ctx() << ", " << e.n_stages()
            << " stages\n";
  std::cout << "  stage 0  layers " << detail::range_text(e.stage().range()) << "  coordinator  " << mine.arch << " x "
            << mine.threads << " threads\n";
  for (const net::StageReport& r : e.welcome().stages)
    std::cout << "  stage " << r.stage << "  layers " << detail::range_text(r.range) << "  " << r.where << "  "
              << r.profile.arch << " x " << r.profile.threads << " threads  weights " << format_bytes(r.bytes_used) << "\n";
}

}  // namespace serve_detail

// Brings the pipeline up and serves until *stop (HTTP) or the end of the chat (which takes *stop back for
// "stop this reply" and ends at *terminate). Returns the exit status.
inline int run_serve(const ModelRunOptions& run, const ServeOptions& so, std::atomic<bool>* stop,
                     const std::atomic<bool>* terminate = nullptr) {
  if (run.workers.empty() && so.cuts_auto) throw UsageError{"--cuts auto needs workers (--coordinator HOST,...)"};
  if (so.parallel < 1 || so.parallel > net::kMaxMuxSessions)
    throw UsageError{"--parallel " + std::to_string(so.parallel) + " outside [1, " + std::to_string(net::kMaxMuxSessions) + "]"};
  // The HTTP address is bound first, so a taken port is reported (with the reason) before the pipeline
  // loads; it listens once the pipeline is up (until then connections are refused, not left waiting).
  std::unique_ptr<HttpFront> front;
  if (!so.chat) {
    HttpFront::Options fo;
    fo.host = so.http_host;
    fo.port = so.http_port;
    fo.threads = std::max<std::size_t>(64, 2 * so.parallel + 8);
    fo.cors = so.cors;
    fo.log_requests = so.log_requests;
    front = std::make_unique<HttpFront>(fo);
    front->bind();
  }
  const std::shared_ptr<const Model> model = Model::open(run.path);
  const int n_layer = int(model->config().n_layer);
  const uint32_t model_ctx = uint32_t(model->default_ctx());
  net::CoordinatorConfig cfg;
  cfg.model = model;
  cfg.name = run.name;
  cfg.workers = run.workers;
  cfg.ctx = run.ctx;
  cfg.cuts = so.cuts_auto ? serve_detail::auto_cuts(run, n_layer, run.ctx ? run.ctx : model_ctx, so.parallel,
                                                    so.authenticate)
                          : detail::validated_cuts(run.cuts, run.workers.size(), n_layer);
  cfg.threads = run.threads;
  cfg.residency = run.residency;
  cfg.timeouts = run.timeouts;
  cfg.load_wait = run.load_wait;
  cfg.parallel = so.parallel;
  cfg.micro_batches = so.micro_batches;
  cfg.authenticate = so.authenticate;
  cfg.resume = run.resume;
  cfg.log = [](const std::string& line) { std::cerr << "pp_node coordinator: " << line << std::endl; };
  net::Coordinator engine(cfg);

  // The workers load their layers (the handshake) while this process loads its own.
  {
    std::exception_ptr failed;
    serve_detail::LoadProgress progress(engine, std::cout, so.authenticate);
    std::thread handshake([&] {
      try {
        engine.connect();
      } catch (...) {
        failed = std::current_exception();
      }
    });
    try {
      engine.load_stage();
    } catch (...) {
      handshake.join();
      throw;
    }
    progress.stage0_done();
    handshake.join();
    if (failed) std::rethrow_exception(failed);
  }
  serve_detail::print_stages(engine);

  ApiContext api;
  api.tok = engine.tokenizer();
  api.tok_error = engine.model().tokenizer_error();
  api.ctx = engine.ctx();
  api.n_vocab = engine.config().n_vocab;
  {
    std::optional<std::string_view> tmpl;
    if (const gguf::Value* v = engine.model().gguf().find("tokenizer.chat_template"); v && v->type == gguf::ValueType::STRING)
      tmpl = v->str;
    bool headers = false;
    if (api.tok) {
      const auto enc = api.tok->encode("<|start_header_id|><|end_header_id|><|eot_id|>", false, true);
      headers = enc.size() == 3;
    }
    if (!api.tok) api.chat_why = "the model has no usable tokenizer (" + api.tok_error + ")";
    else api.chat = detect_chat_template(tmpl, headers, api.chat_why);
  }
  std::cout << "chat template: " << (api.chat ? api.chat->description : "none: " + api.chat_why) << std::endl;
  engine.start();

  if (so.chat) {
    if (!api.chat) throw Error("--chat: " + api.chat_why);
    const std::unique_ptr<LineInput> in = chat_line_input("pp_node", std::cout, stop);
    ChatOptions co = so.chat_options;
    co.dim_stats = ::isatty(STDERR_FILENO) == 1;
    return run_chat(engine, *api.chat, co, *in, std::cout, std::cerr, stop, terminate);
  }

  HttpOptions ho;
  ho.host = so.http_host;
  ho.port = so.http_port;
  ho.threads = std::max<std::size_t>(64, 2 * so.parallel + 8);
  ho.model_id = so.model_id;
  ho.authenticate = so.authenticate;
  HttpServer http(engine, api, ho, *front);
  front->listen();  // before the line below: a client that reads it may connect at once
  const int port = front->port();
  std::cout << "serving '" << so.model_id << "' on http://" << so.http_host << ":" << port
            << "  (POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics, /v1/status, / (chat page); --parallel "
            << so.parallel << ")" << std::endl;
  if (!net::is_loopback_host(so.http_host))
    std::cerr << "pp_node: warning: the HTTP API is bound to " << so.http_host << ":" << port
              << " (not loopback): anyone who can reach it may run generations on this pipeline and read /metrics, "
                 "without authentication. Bind --http-host 127.0.0.1 or put an authenticating proxy in front unless "
                 "that is intended." << std::endl;
  std::atomic<bool> ended{false};
  std::thread watcher([&] {
    while (!ended.load() && !(stop && stop->load())) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    engine.shutdown();  // requests waiting for tokens end now, so the server's threads can finish
    http.stop();
  });
  http.run();  // returns once stop() was called (a signal), or when the listening socket fails
  ended.store(true);
  watcher.join();
  std::cout << "\nserver stopped" << std::endl;
  return kExitOk;
}

}  // namespace pp::node
