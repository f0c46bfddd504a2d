// The version-1 worker session: answers each FWD on one connection with the placeholder transform.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pp/core/error.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/frame.hpp"
#include "pp/net/placeholder.hpp"

namespace pp::net {

// Serves frames until the peer closes (returns) or the connection must end (throws; the server
// logs it). Protocol behaviour, docs/PROTOCOL-TCP.md:
//   bad magic               -> connection closed
//   version != 1            -> ERR, connection closed
//   type != FWD             -> payload discarded, ERR "expected T_FWD", connection kept
//   FWD outside the limits  -> ERR naming field, value and limit, sent before any payload is
//                              read or allocated; connection closed (the stream is not resynced)
//   FWD                     -> RES with the same seq and range, payload = run_layers(payload, lo, hi)
inline void serve_placeholder(Channel& ch, const FrameLimits& limits) {
  std::vector<uint8_t> payload;  // [payload_bytes], reused across frames
  while (const auto h = ch.read_header()) {
    try {
      require_version(*h, kVersionPlaceholder);
    } catch (const FrameError& e) {
      ch.send_err(*h, std::string(e.what()) + "; this worker runs the placeholder (no --model)");
      throw;
    }
    ch.mark_trusted();  // no key here: a well-formed version-1 header is all a peer can prove
    if (h->type != kTypeFwd) {
      if (h->payload_bytes > limits.max_payload) {
        const FrameError e(frame_type_name(h->type) + " seq " + std::to_string(h->seq) +
                           ": payload_bytes " + std::to_string(h->payload_bytes) + " > limit " +
                           std::to_string(limits.max_payload) + " (--max-payload)");
        ch.send_err(*h, e.what());
        throw e;
      }
      ch.discard_payload(h->payload_bytes);
      ch.send_err(*h, "expected T_FWD");
      continue;
    }
    try {
      check_fwd_v1(*h, limits);
    } catch (const FrameError& e) {
      ch.send_err(*h, e.what());
      throw;
    }
    ch.read_payload(payload, h->payload_bytes);
    run_layers(payload, h->layer_lo, h->layer_hi);
    FrameHeader res = *h;
    res.type = kTypeRes;
    res.reserved = 0;
    ch.send(res, payload);
  }
}

}  // namespace pp::net
