// PCPL version-2 multiplexed frames: many sessions on one connection, several sessions' rows in one BATCH.
//
// A connection whose HELLO carries `mux=1` (and whose WELCOME answers `mux=1`) carries sessions that
// are opened and closed by frames instead of by the connection: OPEN (with the session's sampling
// parameters), CLOSE, and BATCH, which runs one step of several sessions through a stage in one pass
// over its weights (Stage::forward_batch) and is answered by BRES, one token per entry (with the
// logits' digest and the logits themselves for the entries whose flags ask). Layout and
// rules: docs/PROTOCOL-TCP.md "Multiplexed sessions".
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pp/core/error.hpp"
#include "pp/net/channel.hpp"
#include "pp/net/handshake.hpp"
#include "pp/net/model_frame.hpp"
#include "pp/net/sha256.hpp"
#include "pp/net/socket.hpp"
#include "pp/text/sampler.hpp"

namespace pp::net {


// BATCH payload: u32 n_entries, n_entries x 24-byte entries, then f32 [rows, n_embd] (all big-endian
// but the rows, which are little-endian f32 like every residual on the wire).
//   entry: 0 session u64 | 8 pos u64 | 16 rows u32 | 20 flags u8 | 21 reserved (3 bytes, 0)
inline constexpr std::size_t kBatchEntryBytes = 24;
inline constexpr uint32_t kMaxBatchEntries = 256;     // entries in one BATCH
inline constexpr std::size_t kMaxMuxSessions = 256;   // sessions open at once on one connection
inline constexpr uint64_t kKeepaliveSession = 0;      // CLOSE of session 0: a keepalive, ignored

// Entry flags: what the last stage returns with the entry's token.
inline constexpr uint8_t kEntryDigest = 1;  // SHA-256 of the entry's f32 logits (32 bytes)
inline constexpr uint8_t kEntryLogits = 2;  // the f32 logits themselves ([n_vocab] little-endian)
inline constexpr uint8_t kKnownEntryFlags = kEntryDigest | kEntryLogits;
// Entries of one BATCH that may ask for logits: a BRES stays within a few vocabularies of f32.
inline constexpr uint32_t kMaxLogitsEntries = 4;

struct BatchEntry {
  uint64_t session = 0;
  uint64_t pos = 0;   // absolute position of the entry's first row
  uint32_t rows = 0;  // rows of this session in the batch, consecutive in the payload
  uint8_t flags = 0;  // kEntryDigest | kEntryLogits
};

// u32 n, then the entries: the part of a BATCH payload before the rows.
inline std::vector<uint8_t> encode_batch_table(std::span<const BatchEntry> entries) {
  std::vector<uint8_t> out(4 + entries.size() * kBatchEntryBytes, 0);
  detail::put_be32(out.data(), static_cast<uint32_t>(entries.size()));
  uint8_t* p = out.data() + 4;
  for (const BatchEntry& e : entries) {
    detail::put_be32(p + 0, static_cast<uint32_t>(e.session >> 32));
    detail::put_be32(p + 4, static_cast<uint32_t>(e.session));
    detail::put_be32(p + 8, static_cast<uint32_t>(e.pos >> 32));
    detail::put_be32(p + 12, static_cast<uint32_t>(e.pos));
    detail::put_be32(p + 16, e.rows);
    p[20] = e.flags;
    p += kBatchEntryBytes;
  }
  return out;
}

inline BatchEntry decode_batch_entry(std::span<const uint8_t, kBatchEntryBytes> p) {
  BatchEntry e;
  e.session = (uint64_t{detail::get_be32(&p[0])} << 32) | detail::get_be32(&p[4]);
  e.pos = (uint64_t{detail::get_be32(&p[8])} << 32) | detail::get_be32(&p[12]);
  e.rows = detail::get_be32(&p[16]);
  e.flags = p[20];
  return e;
}

// Bytes of a BATCH payload with n entries and `rows` rows in all.
inline uint64_t batch_payload_bytes(uint64_t n_entries, uint64_t rows, uint32_t n_embd) {
  return 4 + n_entries * kBatchEntryBytes + rows_payload_bytes(rows, n_embd);
}

// Checks of a BATCH header before any payload byte is read: the connection's session, the receiver's
// range, f32, no flags, 1 <= rows <= ctx (the total; one frame never carries more rows than a KV cache
// holds), and room for at least the entry count.
inline void check_batch_header(const ModelHeader& m, const ModelGeometry& g, uint32_t lo, uint32_t hi,
                               uint64_t connection) {
  const std::string where = "BATCH seq " + std::to_string(m.seq) + ": ";
  if (m.session != connection)
    throw FrameError(where + "session " + std::to_string(m.session) + " != this connection's session " +
                     std::to_string(connection));
  if (m.layer_lo != lo || m.layer_hi != hi)
    throw FrameError(where + "layers [" + std::to_string(m.layer_lo) + ", " + std::to_string(m.layer_hi) +
                     ") != the range assigned in the handshake [" + std::to_string(lo) + ", " + std::to_string(hi) + ")");
  if (m.dtype != kDTypeF32) throw FrameError(where + "dtype " + std::to_string(m.dtype) + " is not f32 (0)");
  if (m.flags != 0) throw FrameError(where + "flags " + std::to_string(m.flags) + " != 0 (BATCH flags are per entry)");
  if (m.rows == 0 || m.rows > g.ctx)
    throw FrameError(where + "rows " + std::to_string(m.rows) + " outside [1, " + std::to_string(g.ctx) +
                     "] (the KV capacity)");
  if (m.payload_bytes < batch_payload_bytes(1, m.rows, g.n_embd))
    throw FrameError(where + "payload_bytes " + std::to_string(m.payload_bytes) + " < " +
                     std::to_string(batch_payload_bytes(1, m.rows, g.n_embd)) + " (one entry and " +
                     std::to_string(m.rows) + " rows)");
}

// Checks the entry count read from the payload's first 4 bytes against the header.
inline void check_batch_count(const ModelHeader& m, uint32_t n_entries, uint32_t n_embd) {
  const std::string where = "BATCH seq " + std::to_string(m.seq) + ": ";
  if (n_entries == 0 || n_entries > kMaxBatchEntries || n_entries > m.rows)
    throw FrameError(where + "n_entries " + std::to_string(n_entries) + " outside [1, min(rows " +
                     std::to_string(m.rows) + ", " + std::to_string(kMaxBatchEntries) + ")]");
  const uint64_t want = batch_payload_bytes(n_entries, m.rows, n_embd);
  if (m.payload_bytes != want)
    throw FrameError(where + "payload_bytes " + std::to_string(m.payload_bytes) + " != 4 + " +
                     std::to_string(n_entries) + " entries x 24 + rows " + std::to_string(m.rows) + " x hidden " +
                     std::to_string(n_embd) + " x 4 = " + std::to_string(want));
}

// Checks the decoded entries: rows add up to the header's, sessions distinct, positions bounded, known
// flags only, at most kMaxLogitsEntries asking for logits.
// Whether each session is open is the receiver's check.
inline void check_batch_entries(const ModelHeader& m, std::span<const BatchEntry> entries) {
  const std::string where = "BATCH seq " + std::to_string(m.seq) + ": ";
  uint64_t rows = 0;
  uint32_t logits_entries = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const BatchEntry& e = entries[i];
    const std::string which = where + "entry " + std::to_string(i) + " (session " + std::to_string(e.session) + "): ";
    if (e.rows == 0) throw FrameError(which + "rows 0");
    if (e.pos > (uint64_t{1} << 40)) throw FrameError(which + "pos " + std::to_string(e.pos) + " > limit 2^40");
    if (e.flags & ~kKnownEntryFlags)
      throw FrameError(which + "flags " + std::to_string(e.flags) + " has unknown bits " +
                       std::to_string(e.flags & ~kKnownEntryFlags) + " (known: 1 digest, 2 logits)");
    if ((e.flags & kEntryLogits) && ++logits_entries > kMaxLogitsEntries)
      throw FrameError(which + "asks for logits, and at most " + std::to_string(kMaxLogitsEntries) +
                       " entries of one BATCH may (a BRES must stay bounded)");
    for (std::size_t j = 0; j < i; ++j)
      if (entries[j].session == e.session) throw FrameError(which + "the session appears twice");
    rows += e.rows;
  }
  if (rows != m.rows)
    throw FrameError(where + "the entries' rows add up to " + std::to_string(rows) + ", the header says " +
                     std::to_string(m.rows));
}

// Sends header, entry table and rows as one frame (MSG_MORE keeps them in as few segments as possible).
// Returns the bytes written.
inline uint64_t send_batch(Channel& ch, ModelHeader h, std::span<const uint8_t> table, std::span<const uint8_t> rows) {
  h.type = kTypeBatch;
  h.payload_bytes = static_cast<uint32_t>(table.size() + rows.size());
  const auto head = encode_model_header(h);
  write_all(ch.fd(), head, ch.timeouts().io, ch.who(), "BATCH header", true);
  write_all(ch.fd(), table, ch.timeouts().io, ch.who(), "BATCH entries", true);
  write_all(ch.fd(), rows, ch.timeouts().io, ch.who(), "BATCH rows");
  return head.size() + table.size() + rows.size();
}

// BRES payload, per entry in entry order: its i32 token (little-endian), then the 32-byte digest if
// it asked kEntryDigest, then its [n_vocab] little-endian f32 logits if it asked kEntryLogits. With no
// flags, 4 bytes per entry.
inline uint64_t batch_res_bytes(std::span<const BatchEntry> entries, uint32_t n_vocab) {
  uint64_t n = 0;
  for (const BatchEntry& e : entries)
    n += 4 + ((e.flags & kEntryDigest) ? 32 : 0) + ((e.flags & kEntryLogits) ? uint64_t{n_vocab} * 4 : 0);
  return n;
}

// The most any BRES may carry: every entry with a digest, kMaxLogitsEntries with logits. An upstream
// end that does not keep each BATCH's entries bounds its read by this.
inline uint64_t max_batch_res_bytes(uint32_t n_vocab) {
  return uint64_t{kMaxBatchEntries} * (4 + 32) + uint64_t{kMaxLogitsEntries} * n_vocab * 4;
}

struct EntryResult {
  int32_t token = 0;
  std::optional<Sha256Digest> digest;  // when the entry asked kEntryDigest
  std::vector<float> logits;           // [n_vocab] when it asked kEntryLogits
};

// tokens: [n_entries]; logits: [n_entries, n_vocab], each entry's sampled position.
inline std::vector<uint8_t> encode_batch_res(std::span<const BatchEntry> entries, std::span<const int32_t> tokens,
                                             std::span<const float> logits, uint32_t n_vocab) {
  if (tokens.size() != entries.size() || logits.size() != entries.size() * std::size_t{n_vocab})
    throw Error("encode_batch_res: " + std::to_string(entries.size()) + " entries, " + std::to_string(tokens.size()) +
                " tokens, " + std::to_string(logits.size()) + " logits (want n_entries x n_vocab " +
                std::to_string(n_vocab) + ")");
  std::vector<uint8_t> out(batch_res_bytes(entries, n_vocab));
  std::size_t off = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::span<const float> row = logits.subspan(i * n_vocab, n_vocab);
    std::memcpy(out.data() + off, &tokens[i], 4);
    off += 4;
    if (entries[i].flags & kEntryDigest) {
      const Sha256Digest d = logits_digest(row);
      std::memcpy(out.data() + off, d.data(), d.size());
      off += d.size();
    }
    if (entries[i].flags & kEntryLogits) {
      std::memcpy(out.data() + off, row.data(), row.size_bytes());
      off += row.size_bytes();
    }
  }
  return out;
}

// `entries`: the table of the BATCH this BRES answers. Throws FrameError when the size is not the one
// their flags fix.
inline std::vector<EntryResult> decode_batch_res(std::span<const uint8_t> payload, std::span<const BatchEntry> entries,
                                                 uint32_t n_vocab) {
  const uint64_t want = batch_res_bytes(entries, n_vocab);
  if (payload.size() != want)
    throw FrameError("BRES: " + std::to_string(payload.size()) + " bytes for " + std::to_string(entries.size()) +
                     " entries, expected " + std::to_string(want) + " (token, digest and logits as their flags ask)");
  std::vector<EntryResult> out(entries.size());
  std::size_t off = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    EntryResult& r = out[i];
    std::memcpy(&r.token, payload.data() + off, 4);
    off += 4;
    if (entries[i].flags & kEntryDigest) {
      Sha256Digest d;
      std::memcpy(d.data(), payload.data() + off, d.size());
      r.digest = d;
      off += d.size();
    }
    if (entries[i].flags & kEntryLogits) {
      r.logits.resize(n_vocab);
      std::memcpy(r.logits.data(), payload.data() + off, std::size_t{n_vocab} * 4);
      off += std::size_t{n_vocab} * 4;
    }
  }
  return out;
}

// OPEN payload: the session's sampling parameters as key=value lines, the HELLO's keys and encoding.
inline std::string encode_sampling(const SamplingParams& s) {
  std::string out;
  auto line = [&](std::string_view k, const std::string& v) { out.append(k).append("=").append(v).append("\n"); };
  if (s.temperature) line("temperature", detail::double_text(*s.temperature));
  if (s.top_k) line("top_k", std::to_string(*s.top_k));
  if (s.top_p) line("top_p", detail::double_text(*s.top_p));
  if (s.min_p) line("min_p", detail::double_text(*s.min_p));
  line("seed", std::to_string(s.seed));
  return out;
}

// Unknown keys are ignored; a malformed or out-of-range value is a HandshakeError.
inline SamplingParams decode_sampling(std::string_view text) {
  SamplingParams s;
  for (const auto& [k, v] : detail::parse_lines(text, "OPEN")) {
    if (k == "temperature") s.temperature = detail::parse_double(k, v);
    else if (k == "top_k") s.top_k = detail::parse_uint<int64_t>(k, v, INT64_MAX);
    else if (k == "top_p") s.top_p = detail::parse_double(k, v);
    else if (k == "min_p") s.min_p = detail::parse_double(k, v);
    else if (k == "seed") s.seed = detail::parse_uint<uint64_t>(k, v, UINT64_MAX);
  }
  try {
    s.validate();
  } catch (const RequestError& e) {
    throw HandshakeError(std::string("OPEN sampling: ") + e.what());
  }
  return s;
}

}  // namespace pp::net
