// pp_node --serve: the OpenAI-compatible HTTP server (cpp-httplib) in front of the serving engine.
//
//   POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events, ending "data: [DONE]")
//   GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text)
//
// Each request runs on one of the server's threads and reads its own GenStream, so a client that reads
// slowly only slows its own response; a client that goes away cancels its generation (its sessions are
// closed on every stage). A streamed response notices at its next write (a ": keep-alive" comment every 2 s
// when idle); a non-streamed one that has not finished within a second commits a 200 and writes a space
// (leading JSON whitespace) every second until its body, so an error after that second is reported in the
// body of the 200. Errors are OpenAI-style JSON with their status code.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <functional>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "node/openai_api.hpp"
#include "node/serve_engine.hpp"
#include "node/worker_status.hpp"
#include "pp/net/socket.hpp"

namespace pp::node {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8080;              // 0: an ephemeral port (printed)
  std::size_t threads = 64;     // connections served at once (a streamed response holds one)
  std::string model_id;         // what /v1/models lists and responses name
  net::Millis status_timeout{1000};  // /metrics: how long each worker's STATUS may take
  Authenticate authenticate;          // for those STATUS connections, when the workers require a key
};

class HttpServer {
 public:
  HttpServer(ServeEngine& engine, ApiContext api, HttpOptions o) : engine_(engine), api_(std::move(api)), o_(std::move(o)) {
    const std::size_t n = o_.threads;
    svr_.new_task_queue = [n] { return new httplib::ThreadPool(n); };
    svr_.set_tcp_nodelay(true);  // each streamed token leaves at once
    svr_.set_payload_max_length(8u << 20);
    svr_.set_keep_alive_timeout(5);
    svr_.set_read_timeout(30);
    svr_.set_write_timeout(30);
    routes();
  }

  // Binds; returns the port (the ephemeral one when o.port is 0). Throws when the address is taken.
  int bind() {
    const int port = o_.port == 0 ? svr_.bind_to_any_port(o_.host) : (svr_.bind_to_port(o_.host, o_.port) ? o_.port : -1);
    if (port <= 0) throw Error("--http-host " + o_.host + " --http-port " + std::to_string(o_.port) + ": cannot bind");
    return port;
  }
  // Serves until stop().
  void run() { svr_.listen_after_bind(); }
  void stop() { svr_.stop(); }

 private:
  static std::string dump(const json& body) { return body.dump(-1, ' ', false, json::error_handler_t::replace); }

  static void send_json(httplib::Response& res, int status, const json& body) {
    res.status = status;
    res.set_content(dump(body), "application/json");
  }

  static void send_error(httplib::Response& res, const ApiError& e) { send_json(res, e.status, error_body(e)); }

  static ApiError server_error(int status, std::string message, std::string type = "server_error") {
    ApiError e;
    e.status = status;
    e.message = std::move(message);
    e.type = std::move(type);
    return e;
  }

  std::string new_id(const char* prefix) {
    static constexpr char kAlnum[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::lock_guard lock(id_mu_);
    std::string s = prefix;
    for (int i = 0; i < 24; ++i) s += kAlnum[rng_() % (sizeof kAlnum - 1)];
    return s;
  }

  void routes() {
    using httplib::Request;
    using httplib::Response;
    svr_.Post("/v1/completions", [this](const Request& q, Response& r) { generate(q, r, false); });
    svr_.Post("/v1/chat/completions", [this](const Request& q, Response& r) { generate(q, r, true); });
    svr_.Get("/v1/models", [this](const Request&, Response& r) { send_json(r, 200, {{"object", "list"}, {"data", {model_json()}}}); });
    svr_.Get(R"(/v1/models/(.+))", [this](const Request& q, Response& r) {
      if (q.matches[1] == o_.model_id) return send_json(r, 200, model_json());
      ApiError e = server_error(404, "the model '" + std::string(q.matches[1]) + "' does not exist; this server serves '" +
                                         o_.model_id + "'", "invalid_request_error");
      e.code = "model_not_found";
      send_error(r, e);
    });
    svr_.Get("/health", [this](const Request&, Response& r) { health(r); });
    svr_.Get("/metrics", [this](const Request&, Response& r) { r.set_content(metrics_text(), "text/plain; version=0.0.4"); });

    // The other methods on known paths: 405 with Allow.
    const std::vector<std::pair<std::string, std::string>> allowed = {
        {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}, {"/v1/models", "GET"},
        {R"(/v1/models/(.+))", "GET"}, {"/health", "GET"}, {"/metrics", "GET"}};
    for (const auto& [path, allow] : allowed) {
      auto h = [allow](const Request& q, Response& r) {
        r.set_header("Allow", allow);
        send_error(r, server_error(405, "method " + q.method + " is not allowed on " + q.path + " (allowed: " + allow + ")",
                                   "invalid_request_error"));
      };
      if (allow != "POST") svr_.Post(path, h);
      if (allow != "GET") svr_.Get(path, h);
      svr_.Put(path, h);
      svr_.Delete(path, h);
      svr_.Patch(path, h);
    }
    svr_.set_error_handler([](const Request& q, Response& r) {
      if (!r.body.empty()) return;
      if (r.status == 404)
        send_error(r, server_error(404, "no such endpoint: " + q.method + " " + q.path +
                                            " (POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics)",
                                   "invalid_request_error"));
      else if (r.status == 413)
        send_error(r, server_error(413, "the request body is larger than 8 MiB", "invalid_request_error"));
      else
        send_error(r, server_error(r.status, "HTTP " + std::to_string(r.status), "invalid_request_error"));
    });
    svr_.set_exception_handler([](const Request&, Response& r, std::exception_ptr ep) {
      std::string what = "internal error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      send_error(r, server_error(500, what));
    });
  }

  json model_json() const {
    return {{"id", o_.model_id}, {"object", "model"}, {"created", started_}, {"owned_by", "pp"},
            {"context_length", api_.ctx}};
  }

  void health(httplib::Response& r) {
    const EngineMetrics m = engine_.metrics();
    if (m.link_up) return send_json(r, 200, {{"status", "ok"}, {"stages", engine_.n_stages()}, {"sessions", m.sessions_active}});
    send_json(r, 503, {{"status", "unavailable"}, {"error", m.link_error.empty() ? "the pipeline is not connected" : m.link_error}});
  }

  static constexpr std::chrono::seconds kKeepAlive{1};  // a non-streamed request's wait, then its space interval

  // Takes `out`'s output into `pieces` for up to `wait`; true once the generation has ended and all of it is taken.
  static bool collect(GenStream& out, std::vector<GenStream::Piece>& pieces, std::chrono::milliseconds wait) {
    const auto until = std::chrono::steady_clock::now() + wait;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (!out.next(pieces, std::max(left, std::chrono::milliseconds(0)))) return true;
      if (left <= std::chrono::milliseconds(0)) return false;
    }
  }

  // A finished non-streamed generation's status and body: the whole completion, or the error.
  static std::pair<int, json> whole_response(const ApiRequest& r, const ResponseMeta& meta, const GenStream& out,
                                             const std::vector<GenStream::Piece>& pieces) {
    if (out.finish() == Finish::error) return {503, error_body(server_error(503, out.error()))};
    std::string text;
    std::vector<int32_t> tokens;
    for (const auto& p : pieces) {
      text += p.text;
      tokens.insert(tokens.end(), p.tokens.begin(), p.tokens.end());
    }
    return {200, full_response(r, meta, text, tokens, out.finish(), out.prompt_tokens(), out.completion_tokens())};
  }

  // A non-streamed request. Done within a second: the reply with its status. Else a 200 is committed and a
  // space (JSON allows leading whitespace) is written every second until the body; a client that went away
  // is noticed (a failed write, or the connection seen closed) and its generation cancelled. An error from
  // then on is the body of the 200.
  static void generate_whole(ApiRequest r, const ResponseMeta& meta, std::shared_ptr<GenStream> out,
                             httplib::Response& res) {
    auto pieces = std::make_shared<std::vector<GenStream::Piece>>();
    if (collect(*out, *pieces, kKeepAlive)) {
      const auto [status, body] = whole_response(r, meta, *out, *pieces);
      return send_json(res, status, body);
    }
    // "; charset=utf-8": httplib compresses a plain "application/json" for clients that accept gzip, and
    // the compressor would hold the spaces back instead of writing them.
    res.set_chunked_content_provider(
        "application/json; charset=utf-8",
        [r = std::move(r), meta, out, pieces](std::size_t, httplib::DataSink& sink) {
          // Up to a second for the end, looking every 100 ms for a closed connection (is_writable peeks at
          // the socket without writing); then a space.
          const auto until = std::chrono::steady_clock::now() + kKeepAlive;
          while (std::chrono::steady_clock::now() < until) {
            if (collect(*out, *pieces, std::chrono::milliseconds(100))) {
              const std::string body = dump(whole_response(r, meta, *out, *pieces).second);
              if (!sink.write(body.data(), body.size())) return false;
              sink.done();
              return true;
            }
            if (!sink.is_writable()) return false;  // the client went away
          }
          return sink.write(" ", 1);
        },
        [out](bool success) {
          if (!success || !out->done()) out->cancel();  // the client went away
        });
  }

  void generate(const httplib::Request& q, httplib::Response& res, bool chat) {
    ApiRequest r;
    try {
      r = parse_request(q.body, chat, api_);
    } catch (const ApiError& e) {
      return send_error(res, e);
    } catch (const Error& e) {  // the tokenizer refused the text
      return send_error(res, server_error(400, e.what(), "invalid_request_error"));
    }
    const ResponseMeta meta{new_id(chat ? "chatcmpl-" : "cmpl-"), int64_t(std::time(nullptr)), o_.model_id};
    std::shared_ptr<GenStream> out = engine_.submit(r.prompt, r.gen);
    if (!r.stream) return generate_whole(std::move(r), meta, std::move(out), res);
    struct StreamState {
      ApiRequest r;
      ResponseMeta meta;
      std::shared_ptr<GenStream> out;
      bool started = false;
      std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
      std::vector<GenStream::Piece> pieces;
    };
    auto st = std::make_shared<StreamState>();
    st->r = std::move(r);
    st->meta = meta;
    st->out = out;
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [st](std::size_t, httplib::DataSink& sink) {
          auto write = [&](const std::string& s) {
            st->last_write = std::chrono::steady_clock::now();
            return sink.write(s.data(), s.size());
          };
          if (!st->started) {
            st->started = true;
            if (st->r.chat && !write(sse(chunk(st->r, st->meta, "", {}, std::nullopt, true)))) return false;
          }
          st->pieces.clear();
          const bool more = st->out->next(st->pieces, std::chrono::milliseconds(250));
          for (const auto& p : st->pieces)
            if (!p.text.empty() || (st->r.return_tokens && !p.tokens.empty()))
              if (!write(sse(chunk(st->r, st->meta, p.text, p.tokens, std::nullopt)))) return false;
          if (more) {
            // A comment now and then: a client that went away is noticed while nothing else is written.
            if (std::chrono::steady_clock::now() - st->last_write > std::chrono::seconds(2) && !write(": keep-alive\n\n"))
              return false;
            return true;
          }
          const Finish f = st->out->finish();
          if (f == Finish::error) {
            write(sse(error_body(server_error(503, st->out->error()))));
          } else {
            if (!write(sse(chunk(st->r, st->meta, "", {}, f)))) return false;
            if (st->r.include_usage &&
                !write(sse(usage_chunk(st->r, st->meta, st->out->prompt_tokens(), st->out->completion_tokens()))))
              return false;
          }
          write("data: [DONE]\n\n");
          sink.done();
          return true;
        },
        [st](bool success) {
          if (!success || !st->out->done()) st->out->cancel();  // the client went away mid-stream
        });
  }

  // Prometheus text: the coordinator's counters, and each worker's from its STATUS (queried now).
  std::string metrics_text() {
    const EngineMetrics m = engine_.metrics();
    const auto& hops = engine_.hops();
    std::vector<std::future<std::optional<StatusMap>>> asks;
    for (const net::Hop& h : hops)
      asks.push_back(std::async(std::launch::async, [this, peer = h.peer]() -> std::optional<StatusMap> {
        try {
          return query_status(peer, o_.status_timeout, o_.authenticate);
        } catch (const std::exception&) {
          return std::nullopt;
        }
      }));
    std::vector<std::optional<StatusMap>> status;
    for (auto& a : asks) status.push_back(a.get());

    std::string s;
    auto family = [&](const char* name, const char* type, const char* help) {
      s += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
    };
    auto sample = [&](const std::string& name, const std::string& labels, double v) {
      char b[64];
      std::snprintf(b, sizeof b, "%.9g", v);
      s += name + (labels.empty() ? "" : "{" + labels + "}") + " " + b + "\n";
    };
    auto stage_labels = [&](std::size_t i) {
      const LayerRange r = i == 0 ? engine_.stage().range() : hops[i - 1].range;
      return "stage=\"" + std::to_string(i) + "\",layers=\"" + std::to_string(r.lo) + "-" + std::to_string(r.hi) +
             "\",instance=\"" + (i == 0 ? std::string("coordinator") : hops[i - 1].peer.str()) + "\"";
    };
    auto worker_value = [&](std::size_t i, const char* key) -> std::optional<double> {
      if (!status[i]) return std::nullopt;
      const auto it = status[i]->find(key);
      if (it == status[i]->end()) return std::nullopt;
      try {
        return std::stod(it->second);
      } catch (const std::exception&) {
        return std::nullopt;
      }
    };

    family("pp_tokens_generated_total", "counter", "Tokens generated for all requests.");
    sample("pp_tokens_generated_total", "", double(m.tokens_generated));
    family("pp_prompt_tokens_total", "counter", "Prompt tokens of the requests admitted.");
    sample("pp_prompt_tokens_total", "", double(m.prompt_tokens));
    family("pp_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.");
    sample("pp_tokens_per_second", "", m.tokens_per_second);
    family("pp_requests_total", "counter", "Generations ended, by outcome.");
    sample("pp_requests_total", "outcome=\"ok\"", double(m.requests_ok));
    sample("pp_requests_total", "outcome=\"error\"", double(m.requests_error));
    sample("pp_requests_total", "outcome=\"cancelled\"", double(m.requests_cancelled));
    family("pp_sessions_active", "gauge", "Generations running (a session on every stage).");
    sample("pp_sessions_active", "", double(m.sessions_active));
    family("pp_queue_depth", "gauge", "Requests waiting for a free slot (--parallel).");
    sample("pp_queue_depth", "", double(m.queue_depth));
    family("pp_sessions_ready", "gauge", "Sessions waiting for the next batch.");
    sample("pp_sessions_ready", "", double(m.sessions_ready));
    family("pp_batches_in_flight", "gauge", "Batches sent down the chain and not yet answered.");
    sample("pp_batches_in_flight", "", double(m.batches_in_flight));
    family("pp_batches_total", "counter", "Batches (one pass over every stage's weights) sent.");
    sample("pp_batches_total", "", double(m.batches));
    family("pp_batch_rows_total", "counter", "Rows in all batches sent (prompt and generated tokens).");
    sample("pp_batch_rows_total", "", double(m.batch_rows));
    family("pp_batch_round_trip_seconds_total", "counter", "Time from a batch's stage-0 compute to its reply, summed.");
    sample("pp_batch_round_trip_seconds_total", "", m.batch_round_trip_s);
    family("pp_time_to_first_token_seconds", "summary", "Time from a request's arrival to its first token.");
    sample("pp_time_to_first_token_seconds_sum", "", m.ttft_sum_s);
    sample("pp_time_to_first_token_seconds_count", "", double(m.ttft_count));
    family("pp_pipeline_up", "gauge", "1 when the coordinator's connection to the chain is up.");
    sample("pp_pipeline_up", "", m.link_up ? 1 : 0);

    family("pp_stage_up", "gauge", "1 when the stage answered STATUS just now (stage 0: the coordinator).");
    sample("pp_stage_up", stage_labels(0), 1);
    for (std::size_t i = 0; i < hops.size(); ++i) sample("pp_stage_up", stage_labels(i + 1), status[i] ? 1 : 0);
    family("pp_stage_sessions_active", "gauge", "Sessions open on the stage (multiplexed sessions on workers).");
    sample("pp_stage_sessions_active", stage_labels(0), double(m.sessions_active));
    for (std::size_t i = 0; i < hops.size(); ++i)
      if (auto v = worker_value(i, "mux_sessions_active")) sample("pp_stage_sessions_active", stage_labels(i + 1), *v);
    family("pp_stage_compute_seconds_total", "counter", "Time the stage spent computing batches.");
    sample("pp_stage_compute_seconds_total", stage_labels(0), m.stage0_compute_s);
    for (std::size_t i = 0; i < hops.size(); ++i)
      if (auto v = worker_value(i, "compute_seconds")) sample("pp_stage_compute_seconds_total", stage_labels(i + 1), *v);
    family("pp_stage_transfer_seconds_total", "counter",
           "Time the stage spent sending frames and reading payloads (not waiting for them).");
    sample("pp_stage_transfer_seconds_total", stage_labels(0), m.stage0_transfer_s);
    for (std::size_t i = 0; i < hops.size(); ++i)
      if (auto v = worker_value(i, "transfer_seconds")) sample("pp_stage_transfer_seconds_total", stage_labels(i + 1), *v);
    family("pp_stage_batches_total", "counter", "Batches the stage computed.");
    sample("pp_stage_batches_total", stage_labels(0), double(m.batches));
    for (std::size_t i = 0; i < hops.size(); ++i)
      if (auto v = worker_value(i, "batches")) sample("pp_stage_batches_total", stage_labels(i + 1), *v);
    family("pp_wire_bytes_total", "counter", "Frame bytes the stage sent and received (headers included).");
    sample("pp_wire_bytes_total", stage_labels(0) + ",direction=\"sent\"", double(m.bytes_sent));
    sample("pp_wire_bytes_total", stage_labels(0) + ",direction=\"received\"", double(m.bytes_received));
    for (std::size_t i = 0; i < hops.size(); ++i) {
      if (auto v = worker_value(i, "bytes_sent")) sample("pp_wire_bytes_total", stage_labels(i + 1) + ",direction=\"sent\"", *v);
      if (auto v = worker_value(i, "bytes_received"))
        sample("pp_wire_bytes_total", stage_labels(i + 1) + ",direction=\"received\"", *v);
    }
    return s;
  }

  ServeEngine& engine_;
  ApiContext api_;
  HttpOptions o_;
  httplib::Server svr_;
  std::mutex id_mu_;
  std::mt19937_64 rng_{std::random_device{}()};
  int64_t started_ = int64_t(std::time(nullptr));
};

}  // namespace pp::node
