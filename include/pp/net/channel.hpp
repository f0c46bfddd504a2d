// One PCPL connection: reads headers and bounded payloads, sends frames, every operation under a timeout.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pp/net/frame.hpp"
#include "pp/net/socket.hpp"

namespace pp::net {

struct Timeouts {
  Millis io{10000};          // connect, each wait for progress, and a frame's header once it has started
  Millis idle{kNoTimeout};   // wait for the first byte of the next frame
};

// A frame's bytes must keep at least this pace on top of `io`: a payload of n bytes must arrive within
// io + n / kMinFrameBytesPerSecond of its start, so a peer trickling a byte now and then cannot hold a
// connection (and its thread) past that, however it paces them.
inline constexpr std::size_t kMinFrameBytesPerSecond = 64 * 1024;

// How long a frame part of n bytes may take once started: io plus n at the minimum pace.
inline Millis frame_part_budget(Millis io, std::size_t n) {
  if (io == kNoTimeout) return kNoTimeout;
  return io + Millis{static_cast<int64_t>(n * 1000 / kMinFrameBytesPerSecond)};
}

class Channel {
 public:
  // `who` names the far end in every error: "<role> <host>:<port>".
  Channel(Fd fd, const Peer& peer, std::string_view role, Timeouts timeouts)
      : fd_(std::move(fd)), peer_(peer), who_(std::string(role) + " " + peer.str()),
        timeouts_(timeouts) {}

  const Fd& fd() const { return fd_; }
  const Peer& peer() const { return peer_; }
  const std::string& who() const { return who_; }
  const Timeouts& timeouts() const { return timeouts_; }

  // The next frame's header; nullopt when the peer closed cleanly between frames. Once its first
  // byte is in, the rest must follow within timeouts().io (whatever the pace).
  // Throws NetError (timeout, reset, closed mid-header) or FrameError (bad magic).
  std::optional<FrameHeader> read_header() {
    std::array<uint8_t, kFrameHeaderBytes> head;
    const Deadline::Budget whole = part_budget(head.size());  // from the header's first byte
    if (!read_exact_or_eof(fd_, head, timeouts_.idle, timeouts_.io, who_, "frame header", deadline_, &whole)) {
      return std::nullopt;
    }
    return decode_header(head);
  }

  // Reads an n-byte payload into out (resized to n), within frame_part_budget(io, n). Memory grows as
  // bytes arrive, in chunks, so a peer that announces a large payload and sends nothing costs at most
  // one chunk.
  void read_payload(std::vector<uint8_t>& out, uint32_t n) {
    constexpr std::size_t kChunk = std::size_t{1} << 20;
    const Deadline by = part_deadline(n);
    out.clear();
    while (out.size() < n) {
      const std::size_t have = out.size();
      const std::size_t take = std::min<std::size_t>(kChunk, n - have);
      out.resize(have + take);
      read_exact(fd_, std::span<uint8_t>(out).subspan(have, take), timeouts_.io, who_, "frame payload", by);
    }
  }

  // Reads exactly buf.size() bytes into memory the caller sized after checking the header, within
  // frame_part_budget(io, size).
  void read_into(std::span<uint8_t> buf, std::string_view what) {
    read_exact(fd_, buf, timeouts_.io, who_, what, part_deadline(buf.size()));
  }

  // Reads and drops an n-byte payload without holding it, within frame_part_budget(io, n).
  void discard_payload(uint32_t n) {
    std::array<uint8_t, 16384> sink;
    const Deadline by = part_deadline(n);
    uint32_t left = n;
    while (left > 0) {
      const uint32_t take = std::min<uint32_t>(left, sink.size());
      read_exact(fd_, std::span<uint8_t>(sink).first(take), timeouts_.io, who_, "frame payload", by);
      left -= take;
    }
  }

  // Every read from now on must be done by `by` (e.g. authentication within a fixed budget), until
  // clear_deadline().
  void set_deadline(Deadline by) { deadline_ = std::move(by); }
  void clear_deadline() { deadline_ = Deadline{}; }

  // The far end has proved itself (authenticated, or sent a well-formed first frame where no key is
  // required): tells the server that accepted this connection, which may otherwise close it to make
  // room for newer unproven ones. Idempotent.
  void mark_trusted() {
    if (on_trusted_) std::exchange(on_trusted_, nullptr)();
  }
  void on_trusted(std::function<void()> f) { on_trusted_ = std::move(f); }

  // Sends header + payload; header.payload_bytes is set from the payload.
  void send(FrameHeader header, std::span<const uint8_t> payload) {
    if (payload.size() > UINT32_MAX) {
      throw FrameError("to " + who_ + ": payload_bytes " + std::to_string(payload.size()) + " > limit " +
                       std::to_string(UINT32_MAX) + " (u32 field)");
    }
    header.payload_bytes = static_cast<uint32_t>(payload.size());
    const auto head = encode_header(header);
    write_all(fd_, head, timeouts_.io, who_, "frame header", !payload.empty());
    write_all(fd_, payload, timeouts_.io, who_, "frame payload");
  }

  // Sends an already-encoded header (any version) and its payload, in one segment where possible.
  void send_encoded(std::span<const uint8_t> head, std::span<const uint8_t> payload) {
    write_all(fd_, head, timeouts_.io, who_, "frame header", !payload.empty());
    write_all(fd_, payload, timeouts_.io, who_, "frame payload");
  }

  void set_timeouts(Timeouts t) { timeouts_ = t; }
  void set_who(std::string who) { who_ = std::move(who); }

  // Answers the frame `about` with an ERR of the same seq and layer range, in `version`.
  void send_err(const FrameHeader& about, std::string_view message, uint8_t version = kVersionPlaceholder) {
    FrameHeader h = about;
    h.version = version;
    h.type = kTypeErr;
    h.reserved = 0;
    const std::string_view text = message.substr(0, kMaxErrMessageBytes);
    send(h, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  }

 private:
  Deadline::Budget part_budget(std::size_t n) const {
    static_assert(kMinFrameBytesPerSecond == 64 * 1024, "the text below names the pace");
    return {frame_part_budget(timeouts_.io, n),
            "a frame part must arrive within {} (--timeout plus 1 s per 64 KiB of it) whatever its pace"};
  }
  Deadline part_deadline(std::size_t n) const {
    const Deadline::Budget b = part_budget(n);
    return Deadline::in(b.within, b.why).min(deadline_);
  }

  Fd fd_;
  Peer peer_;
  std::string who_;
  Timeouts timeouts_;
  Deadline deadline_;
  std::function<void()> on_trusted_;
};

}  // namespace pp::net
