// STATUS of one worker on a connection of its own: its sessions, loaded stages and counters, as key -> value.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "pp/core/error.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/model_link.hpp"
#include "pp/net/socket.hpp"

namespace pp::node {

using StatusMap = std::map<std::string, std::string>;

// Runs on a fresh connection before anything else (a worker started with a pre-shared key).
using Authenticate = std::function<void(net::Channel&)>;

// Throws NetError / FrameError / Error naming the worker.
inline StatusMap query_status(const net::Peer& peer, net::Millis timeout, const Authenticate& auth = {}) {
  const std::string who = "worker " + peer.str();
  net::Channel ch(net::connect_tcp(peer, timeout, who), peer, "worker", net::Timeouts{timeout, timeout});
  if (auth) auth(ch);
  net::ModelHeader h;
  h.type = net::kTypeStatus;
  net::send_model_text(ch, h, "");
  const std::optional<net::FrameHeader> fh = ch.read_header();
  if (!fh) throw NetError(NetError::Kind::closed, who + ": closed the connection before answering STATUS");
  if (fh->version != net::kVersionModel) throw FrameError(who + ": answered STATUS with version " + std::to_string(fh->version));
  const net::ModelHeader m = net::read_extension(ch, *fh);
  const std::string text = net::read_text(ch, m.payload_bytes, "STATUS");
  if (m.type == net::kTypeErr) throw Error(who + " refused STATUS: " + text);
  if (m.type != net::kTypeStatus) throw FrameError(who + " answered STATUS with " + net::model_type_name(m.type));
  StatusMap out;
  std::string_view rest = text;
  while (!rest.empty()) {
    const std::size_t nl = rest.find('\n');
    const std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view{} : rest.substr(nl + 1);
    const std::size_t eq = line.find('=');
    if (eq != std::string_view::npos) out[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  return out;
}

}  // namespace pp::node
