// libFuzzer target: the multiplexed session loop of a live model worker (issue 16).
//
// One ModelWorker on golden-tiny-f32 (the last stage, layers [1, 4), ctx 64) serves one connection per
// input over a socketpair: a fixed HELLO with mux=1 (so the bytes that follow reach MuxConnection, not
// the handshake), then the input as the rest of the upstream's byte stream (OPEN / BATCH / CLOSE /
// STATUS frames, seeds in corpus/fuzz_mux/), then end of stream. A second thread reads every reply.
//
// Invariants: ModelWorker::serve returns or throws pp::Error (anything else is a finding); every reply
// is a well-formed version-2 frame of a type the worker may send (WELCOME first, then OPEN / BRES /
// STATUS / ERR); the k-th BRES answers the input's k-th BATCH (a refused BATCH ends the connection) and
// is exactly the size its entries' flags fix, each token inside the vocabulary and each digest the
// SHA-256 of the logits beside it; the worker has no session left once the connection ends.
#include "fuzz_common.hpp"

#include <pp/core/error.hpp>
#include <pp/net/channel.hpp>
#include <pp/net/frame.hpp>
#include <pp/net/handshake.hpp>
#include <pp/net/model_frame.hpp>
#include <pp/net/model_worker.hpp>
#include <pp/net/mux_frame.hpp>
#include <pp/net/socket.hpp>

#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace net = pp::net;
using pp::fuzz::fail;

constexpr uint64_t kConnection = 0x0123456789abcdefull;  // the HELLO's session: the connection's id

net::ModelWorker& worker() {
  static net::ModelWorker* w = [] {
    net::ModelWorkerOptions o;
    o.path = (pp::fuzz::test_data() / "golden-tiny" / "golden-tiny-f32.gguf").string();
    o.threads = 1;
    o.max_ctx = 64;
    o.prefetch = false;
    return new net::ModelWorker(std::move(o), nullptr);
  }();
  return *w;
}

std::vector<uint8_t> hello_frame() {
  const net::ModelIdentity& id = worker().identity();
  net::Hello h;
  h.model = id;
  h.ctx = 64;
  h.from = 1;
  h.stage = 1;
  h.mux = true;
  h.chain.push_back(net::Hop{pp::LayerRange{1, int(id.n_layer)}, net::Peer{"127.0.0.1", 1}});
  const std::string text = net::encode_hello(h);
  net::ModelHeader m;
  m.type = net::kTypeHello;
  m.session = kConnection;
  m.payload_bytes = uint32_t(text.size());
  const auto head = net::encode_model_header(m);
  std::vector<uint8_t> out(head.begin(), head.end());
  out.insert(out.end(), text.begin(), text.end());
  return out;
}

// The entry tables of the input's BATCH frames, in order, up to the first frame that does not parse
// (where the worker stops too).
std::vector<std::vector<net::BatchEntry>> batches_in(std::span<const uint8_t> input) {
  std::vector<std::vector<net::BatchEntry>> out;
  std::size_t off = 0;
  while (input.size() - off >= net::kModelHeaderBytes) {
    const std::span<const uint8_t> at = input.subspan(off);
    net::ModelHeader m;
    try {
      const net::FrameHeader h = net::decode_header(at);
      if (h.version != net::kVersionModel) break;
      m = net::decode_model_header(h, at.subspan(net::kFrameHeaderBytes));
    } catch (const pp::FrameError&) {
      break;
    }
    if (at.size() - net::kModelHeaderBytes < m.payload_bytes) break;
    const std::span<const uint8_t> p = at.subspan(net::kModelHeaderBytes, m.payload_bytes);
    if (m.type == net::kTypeBatch && p.size() >= 4) {
      const uint64_t n = net::detail::get_be32(p.data());
      if (4 + n * net::kBatchEntryBytes > p.size()) break;
      std::vector<net::BatchEntry>& es = out.emplace_back();
      for (uint64_t i = 0; i < n; ++i)
        es.push_back(net::decode_batch_entry(p.subspan(4 + i * net::kBatchEntryBytes).first<net::kBatchEntryBytes>()));
    }
    off += net::kModelHeaderBytes + m.payload_bytes;
  }
  return out;
}

// Reads replies until end of stream and checks each one. Runs beside serve().
void check_replies(int fd, uint32_t n_vocab, std::span<const uint8_t> input) {
  const std::vector<std::vector<net::BatchEntry>> batches = batches_in(input);
  std::size_t answered = 0;
  static const bool verbose = std::getenv("PP_FUZZ_VERBOSE") != nullptr;
  std::vector<uint8_t> buf;
  std::array<uint8_t, 65536> chunk;
  for (;;) {
    const ssize_t r = ::recv(fd, chunk.data(), chunk.size(), 0);
    if (r > 0) {
      buf.insert(buf.end(), chunk.begin(), chunk.begin() + r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    break;
  }
  std::size_t off = 0;
  bool first = true;
  while (off < buf.size()) {
    if (buf.size() - off < net::kFrameHeaderBytes) fail("a reply ends inside its header");
    const std::span<const uint8_t> at(buf.data() + off, buf.size() - off);
    net::ModelHeader m;
    try {
      const net::FrameHeader h = net::decode_header(at);
      if (h.version == net::kVersionPlaceholder) {
        // A frame in another version is refused in the version-1 layout, which every reader parses; it
        // is the worker's last word.
        if (h.type != net::kTypeErr) fail("a version-1 reply that is not an ERR");
        if (off + net::kFrameHeaderBytes + h.payload_bytes != buf.size()) fail("replies after a version-1 ERR");
        return;
      }
      if (h.version != net::kVersionModel) fail("a reply is neither version 2 nor a version-1 ERR");
      if (buf.size() - off < net::kModelHeaderBytes) fail("a reply ends inside its header");
      m = net::decode_model_header(h, at.subspan(net::kFrameHeaderBytes));
    } catch (const pp::FrameError& e) {
      fail("a reply does not decode", e.what());
    }
    if (buf.size() - off - net::kModelHeaderBytes < m.payload_bytes) fail("a reply ends inside its payload");
    const bool known = m.type == net::kTypeErr || (first ? m.type == net::kTypeWelcome
                                                         : (m.type == net::kTypeOpen || m.type == net::kTypeBatchRes ||
                                                            m.type == net::kTypeStatus));
    if (!known) fail("unexpected reply type", net::model_type_name(m.type));
    if (verbose)  // PP_FUZZ_VERBOSE=1: what a seed gets back
      std::fprintf(stderr, "reply %s seq %u session %llu, %u bytes%s%.*s\n", net::model_type_name(m.type).c_str(), m.seq,
                   (unsigned long long)m.session, m.payload_bytes, m.type == net::kTypeErr ? ": " : "",
                   m.type == net::kTypeErr ? int(m.payload_bytes) : 0,
                   reinterpret_cast<const char*>(at.data() + net::kModelHeaderBytes));
    if (m.type == net::kTypeBatchRes) {
      const std::span<const uint8_t> p = at.subspan(net::kModelHeaderBytes, m.payload_bytes);
      if (answered >= batches.size()) fail("a BRES answers no BATCH of the input");
      const std::vector<net::BatchEntry>& entries = batches[answered++];
      if (m.rows != entries.size()) fail("a BRES's rows is not its BATCH's entry count");
      std::vector<net::EntryResult> res;
      try {
        res = net::decode_batch_res(p, entries, n_vocab);
      } catch (const pp::FrameError& e) {
        fail("a BRES is not the size its BATCH's entry flags fix", e.what());
      }
      for (const net::EntryResult& r : res) {
        if (r.token < 0 || uint32_t(r.token) >= n_vocab) fail("a BRES token is outside the vocabulary");
        if (r.digest && !r.logits.empty() && *r.digest != net::logits_digest(r.logits))
          fail("a BRES digest is not the SHA-256 of the logits beside it");
      }
    }
    first = false;
    off += net::kModelHeaderBytes + m.payload_bytes;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  net::ModelWorker& w = worker();
  static const std::vector<uint8_t> hello = hello_frame();
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 0;
  net::Fd up(sv[0]);  // the worker's end
  net::Fd peer(sv[1]);
  net::detail::set_nonblocking(up.get());
  std::vector<uint8_t> stream = hello;
  stream.insert(stream.end(), data, data + size);
  std::thread writer([&] {
    std::size_t sent = 0;
    while (sent < stream.size()) {
      const ssize_t r = ::send(peer.get(), stream.data() + sent, stream.size() - sent, MSG_NOSIGNAL);
      if (r > 0) sent += std::size_t(r);
      else if (!(r < 0 && errno == EINTR)) break;  // the worker closed: the rest is not read
    }
    ::shutdown(peer.get(), SHUT_WR);
  });
  std::thread reader([&] { check_replies(peer.get(), w.identity().n_vocab, std::span(data, size)); });
  {
    net::Channel ch(std::move(up), net::Peer{"fuzz", 0}, "upstream", net::Timeouts{net::Millis{2000}, net::Millis{2000}});
    try {
      w.serve(ch);
    } catch (const pp::Error&) {
      // a refusal: answered with ERR, the connection ends
    }
  }  // closes the worker's end: the reader sees end of stream
  writer.join();
  reader.join();
  const std::string st = w.status_text();
  if (!st.starts_with("connections_active=0\n") || st.find("\nsessions_active=0\n") == std::string::npos)
    fail("a session outlived its connection", st);
  return 0;
}
