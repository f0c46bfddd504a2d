// pp_worker's serving loop: one request line in, one reply line out, in order, until EOF or a signal.
#pragma once

#include "backend.hpp"
#include "events.hpp"
#include "line_io.hpp"
#include "protocol.hpp"
#include "signals.hpp"
#include "startup.hpp"
#include "wire.hpp"

#include <pp/core/error.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <charconv>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pp::worker {

// Where an op's time went, for the `op` event.
struct OpTiming {
  double parse_ms = 0;    // JSON parse and field validation
  double decode_ms = 0;   // base64 -> wire dtype -> f32
  double compute_ms = 0;  // the backend
  double encode_ms = 0;   // f32 -> wire dtype -> base64 and the reply line
};

class Server {
 public:
  Server(Backend& backend, const WorkerConfig& cfg, LineWriter& out, Events& events, ServeStats& stats)
      : backend_(backend), geo_(backend.geometry()), dtype_(cfg.wire_dtype), out_(out), events_(events),
        stats_(stats) {
    limits_.stage = cfg.stage;
    limits_.num_stages = cfg.num_stages;
    limits_.hidden_dim = geo_.hidden_dim;
    limits_.vocab_size = geo_.vocab_size;
    limits_.ctx = geo_.ctx;
    limits_.check_token_range = geo_.check_token_range;
    max_line_ = max_line_bytes(geo_.ctx, geo_.hidden_dim);
  }

  size_t max_line() const { return max_line_; }

  // Serves until end of input (after answering every line read) or a stop signal (after the
  // request in flight). Returns the exit status, 0. Throws OutputError when stdout is gone.
  int run(int in_fd, int wake_fd) {
    LineReader reader(in_fd, max_line_, wake_fd);
    const char* reason = "eof";
    while (true) {
      if (stop_requested()) {
        reason = "signal";
        break;
      }
      const LineReader::Next next = reader.next();
      if (next.kind == LineReader::Kind::interrupted) {
        reason = "signal";
        break;
      }
      if (next.kind == LineReader::Kind::eof) break;
      if (next.kind == LineReader::Kind::too_long) {
        stats_.requests++;
        stats_.errors++;
        out_.write(error_line(nlohmann::json(), too_long_message(next.length)));
        events_.emit("op", {{"op", nullptr}, {"ok", false}, {"error", "line too long"}, {"bytes_in", next.length}});
        continue;
      }
      if (is_blank(next.line)) continue;
      serve_line(next.line);
    }
    ordered_json bye = {{"reason", reason}, {"requests", stats_.requests.load()}, {"errors", stats_.errors.load()}};
    if (stop_signal()) bye["signal"] = stop_signal();
    events_.emit("exiting", bye);
    return 0;
  }

  // One request line -> its reply line ("\n"-terminated). Bad requests become error lines.
  std::string handle(std::string_view line, OpTiming& t, ordered_json& info) {
    nlohmann::json id;  // null until the request's id is known
    std::string error;
    const auto t0 = Clock::now();
    try {
      Request req = parse_request(line, limits_);
      id = req.request_id;
      info["op"] = op_name(req.op);
      t.parse_ms = ms_since(t0);
      try {
        std::string reply = dispatch(req, t, info);
        info["ok"] = true;
        return reply;
      } catch (const RequestError& e) {
        // A raw hidden_b64 that failed to decode may mean the line was never JSON.
        if (req.hidden_raw) recheck_raw_line(line);
        throw RequestError(std::string(op_name(req.op)) + ": " + e.what());
      }
    } catch (const BadRequest& e) {
      id = e.request_id();
      if (!e.op().empty()) info["op"] = e.op();
      error = e.what();
    } catch (const Error& e) {
      error = e.what();
    } catch (const std::bad_alloc&) {
      error = "out of memory while serving the request";
    } catch (const std::exception& e) {
      error = std::string("internal error: ") + e.what();
    }
    info["ok"] = false;
    info["error"] = error;
    return error_line(id, error);
  }

 private:
  using Clock = std::chrono::steady_clock;

  static double ms_since(Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  }

  static bool is_blank(std::string_view s) {
    for (char c : s)
      if (!is_ascii_space(c)) return false;
    return true;
  }

  void serve_line(std::string_view line) {
    stats_.busy = true;
    stats_.requests++;
    const auto t0 = Clock::now();
    OpTiming t;
    ordered_json info = {{"op", nullptr}};
    const std::string reply = handle(line, t, info);
    const bool ok = info.value("ok", false);
    const auto tw = Clock::now();
    out_.write(reply);
    const double write_ms = ms_since(tw);
    stats_.busy = false;
    if (!ok) stats_.errors++;
    info["bytes_in"] = line.size();
    info["bytes_out"] = reply.size();
    info["parse_ms"] = t.parse_ms;
    info["decode_ms"] = t.decode_ms;
    info["compute_ms"] = t.compute_ms;
    info["encode_ms"] = t.encode_ms;
    info["write_ms"] = write_ms;
    info["total_ms"] = ms_since(t0);
    events_.emit("op", info);
  }

  std::string too_long_message(size_t length) const {
    return "request line of " + std::to_string(length) + " bytes exceeds the limit of " + std::to_string(max_line_) +
           " bytes (base64 of ctx " + std::to_string(geo_.ctx) + " x hidden_dim " + std::to_string(geo_.hidden_dim) +
           " x 2 bytes, plus " + std::to_string(kLineSlack) + " bytes for the other fields); it was discarded";
  }

  static std::string error_line(const nlohmann::json& id, const std::string& what) {
    nlohmann::ordered_json r = {{"request_id", id}, {"error", what}};
    return r.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  }

  static std::string head(const nlohmann::json& id) { return "{\"request_id\":" + id.dump(); }

  static void append_int(std::string& s, int64_t v) {
    char buf[24];
    const auto r = std::to_chars(buf, buf + sizeof buf, v);
    s.append(buf, r.ptr);
  }

  static void append_tokens(std::string& s, const char* key, std::span<const int32_t> ids) {
    s += ",\"";
    s += key;
    s += "\":[";
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) s += ',';
      append_int(s, ids[i]);
    }
    s += ']';
  }

  std::string hidden_reply(const nlohmann::json& id, int64_t n_rows, OpTiming& t) {
    const auto t0 = Clock::now();
    const size_t n_values = size_t(n_rows) * size_t(geo_.hidden_dim);
    if (rows_.size() != n_values)
      throw Error("backend returned " + std::to_string(rows_.size()) + " values, expected " + std::to_string(n_values));
    std::string r = head(id);
    r.reserve(r.size() + base64::encoded_size(n_values * kWireBytesPerValue) + 64);
    r += ",\"hidden_b64\":\"";
    append_hidden_b64(r, rows_.data(), n_values, dtype_, wire_scratch_);
    r += "\",\"seq_len\":";
    append_int(r, n_rows);
    r += "}\n";
    t.encode_ms = ms_since(t0);
    return r;
  }

  void decode_rows(const Request& req, OpTiming& t) {
    const auto t0 = Clock::now();
    decode_hidden_b64(req.hidden_b64, req.seq_len, geo_.hidden_dim, dtype_, wire_scratch_, rows_, req.position);
    t.decode_ms = ms_since(t0);
  }

  std::string dispatch(const Request& req, OpTiming& t, ordered_json& info) {
    switch (req.op) {
      case Op::tokenize: {
        const auto t0 = Clock::now();
        const std::vector<int32_t> ids = backend_.tokenize(req.prompt, req.add_bos, req.parse_special);
        t.compute_ms = ms_since(t0);
        std::string r = head(req.request_id);
        append_tokens(r, "tokens", ids);
        r += "}\n";
        return r;
      }
      case Op::embed_and_forward:
      case Op::decode_step: {
        const int64_t n = int64_t(req.tokens.size());
        info["seq_len"] = n;
        info["position"] = req.position;
        const auto t0 = Clock::now();
        backend_.embed_and_forward(req.tokens, req.position, rows_);
        t.compute_ms = ms_since(t0);
        return hidden_reply(req.request_id, n, t);
      }
      case Op::forward_range: {
        info["seq_len"] = req.seq_len;
        info["position"] = req.position;
        decode_rows(req, t);
        const auto t0 = Clock::now();
        backend_.forward_range(rows_, int(req.seq_len), req.position);
        t.compute_ms = ms_since(t0);
        return hidden_reply(req.request_id, req.seq_len, t);
      }
      case Op::forward_and_sample: {
        info["seq_len"] = req.seq_len;
        info["position"] = req.position;
        decode_rows(req, t);
        const auto t0 = Clock::now();
        const int32_t token = backend_.forward_and_sample(rows_, int(req.seq_len), req.position, req.sampling,
                                                          req.return_logits ? &logits_ : nullptr);
        t.compute_ms = ms_since(t0);
        if (token < 0 || token >= geo_.vocab_size)
          throw Error("backend sampled token " + std::to_string(token) + " outside [0, " +
                      std::to_string(geo_.vocab_size) + ")");
        const auto t1 = Clock::now();
        std::string r = head(req.request_id);
        r += ",\"token_id\":";
        append_int(r, token);
        if (req.return_logits) {
          if (logits_.size() != size_t(geo_.vocab_size))
            throw Error("backend returned " + std::to_string(logits_.size()) + " logits, expected vocab_size " +
                        std::to_string(geo_.vocab_size));
          r += ",\"logits_b64\":\"";
          append_f32_b64(r, logits_.data(), logits_.size());
          r += '"';
        }
        r += "}\n";
        t.encode_ms = ms_since(t1);
        return r;
      }
      case Op::detokenize: {
        const auto t0 = Clock::now();
        const std::string text = backend_.detokenize(req.tokens, req.keep_special);
        t.compute_ms = ms_since(t0);
        nlohmann::ordered_json r = {{"request_id", req.request_id}, {"text", text}};
        return r.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
      }
      case Op::generate_full: {
        const auto t0 = Clock::now();
        const std::vector<int32_t> prompt =
            req.has_prompt ? backend_.tokenize(req.prompt, std::nullopt, true) : req.tokens;
        const std::vector<int32_t> out = backend_.generate_full(prompt, req.max_tokens);
        t.compute_ms = ms_since(t0);
        info["prompt_tokens"] = prompt.size();
        info["max_tokens"] = req.max_tokens;
        std::string r = head(req.request_id);
        append_tokens(r, "tokens", out);
        r += "}\n";
        return r;
      }
    }
    throw Error("unhandled op");
  }

  Backend& backend_;
  Geometry geo_;
  WireDType dtype_;
  LineWriter& out_;
  Events& events_;
  ServeStats& stats_;
  RequestLimits limits_;
  size_t max_line_ = 0;
  std::vector<float> rows_;  // [seq_len, hidden_dim], reused across requests
  std::vector<float> logits_;
  std::vector<uint16_t> wire_scratch_;
};

}  // namespace pp::worker
