// What a model worker bound to a non-loopback address exposes, said once at start-up, before the
// "listening" banner, in one write (a reader that has seen the banner sees the whole warning).
#pragma once

#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>

#include "pp/net/model_worker.hpp"
#include "pp/net/socket.hpp"

namespace pp::node {

inline void warn_if_model_worker_exposed(std::ostream& err, const std::string& host, uint16_t port,
                                         const net::ModelWorker& w, std::size_t max_connections) {
  if (net::is_loopback_host(host)) return;
  const net::ModelIdentity& id = w.identity();
  const uint64_t kv_mib = (w.kv_bytes_per_layer() * id.n_layer) >> 20;
  const std::string where = host + ":" + std::to_string(port);
  std::ostringstream text;
  if (w.requires_key()) {
    text << "pp_node: worker bound to " << where << " (not loopback): every connection must prove it holds the "
         << "pre-shared key before anything else. Frames are authenticated when a connection opens but not "
         << "encrypted: anyone on the path can read activations and tokens; use a private network or a tunnel."
         << "\n";
  } else {
    text << "pp_node: warning: worker bound to " << where << " (not loopback) without a pre-shared key: any host "
         << "that can reach this port may hold up to " << max_connections << " connections and "
         << w.max_sessions() << " sessions (--max-sessions), each running layers of '" << id.file
         << "' with a KV cache of up to " << kv_mib << " MiB (--max-ctx " << w.max_ctx() << "), read its STATUS "
         << "(model file and fingerprint), and make this worker connect to any host:port as its next hop. "
         << "Set --psk-file FILE or PP_NODE_PSK on every end, bind --host 127.0.0.1, or firewall the port unless "
         << "that is intended.\n";
  }
  err << text.str() << std::flush;
}

}  // namespace pp::node
