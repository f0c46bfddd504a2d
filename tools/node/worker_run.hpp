// pp_node --worker --model and --selftest --model: the version-2 worker serving connections, and every stage in one process.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "node/exposure.hpp"
#include "node/process.hpp"
#include "node/prompt_run.hpp"
#include "pp/net/model_worker.hpp"
#include "pp/net/server.hpp"
#include "pp/net/socket.hpp"

namespace pp::node {

// ---- real model (version 2) ----

// What a model worker serves: one ModelWorker shared by every connection.
inline pp::net::Server::Handler model_handler(pp::net::ModelWorker& worker) {
  return [&worker](pp::net::Channel& ch) { worker.serve(ch); };
}

inline int run_model_worker(const std::string& host, uint16_t port, pp::net::ModelWorkerOptions wopt,
                     const pp::net::ServerOptions& options) {
  pp::net::ModelWorker worker(std::move(wopt), worker_log);
  const pp::net::ModelIdentity& id = worker.identity();
  pp::net::Listener listener = pp::net::listen_tcp(host, port);
  const uint16_t bound = listener.local.port;
  pp::node::warn_if_model_worker_exposed(std::cerr, host, bound, worker, options.max_connections);
  std::cout << "pipe worker (model '" << id.file << "', " << id.n_layer << " layers, hidden " << id.n_embd
            << ", fingerprint " << id.fingerprint.substr(0, 16) << "; layer range assigned per session)" << std::endl;
  std::cout << "pipe worker (stage B) listening on " << host << ":" << bound << "  (Ctrl-C to stop)" << std::endl;
  install_stop_handlers();
  pp::net::Server server(std::move(listener), options, model_handler(worker), worker_log);
  server.serve(&g_stop_requested);
  std::cout << "\nworker stopped" << std::endl;
  return kExitOk;
}

// Every stage in this process: one in-process worker per cut, each on its own loopback port, and the
// coordinator verifying every token against the unsplit model.
inline int run_model_selftest(pp::node::ModelRunOptions run, std::size_t n_workers, const pp::net::ModelWorkerOptions& wopt,
                       const pp::net::ServerOptions& options) {
  struct Node {
    std::unique_ptr<pp::net::ModelWorker> worker;
    std::unique_ptr<pp::net::Server> server;
    std::thread thread;
  };
  std::vector<Node> nodes(n_workers);
  struct StopAll {
    std::vector<Node>& nodes;
    ~StopAll() {
      for (auto& n : nodes)
        if (n.server) n.server->stop();
      for (auto& n : nodes)
        if (n.thread.joinable()) n.thread.join();
    }
  } stop_all{nodes};
  for (auto& n : nodes) {
    n.worker = std::make_unique<pp::net::ModelWorker>(wopt, worker_log);
    pp::net::Listener listener = pp::net::listen_tcp("127.0.0.1", 0);
    run.workers.push_back(listener.local);
    n.server = std::make_unique<pp::net::Server>(std::move(listener), options, model_handler(*n.worker), worker_log);
    n.thread = std::thread([s = n.server.get()] { s->serve(); });
  }
  run.verify = pp::node::Verify::all;
  std::cout << "pipe self-test: " << n_workers + 1 << " stages in one process over loopback, every token verified\n"
            << std::endl;
  return pp::node::run_model_coordinator(run);
}

}  // namespace pp::node
