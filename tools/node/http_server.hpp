// pp_node --serve: the OpenAI-compatible HTTP routes in front of the serving engine (the connections, the
// event loop and the handler threads are tools/node/http_front.hpp).
//
//   POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events, ending "data: [DONE]")
//   GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text); OPTIONS on any path (CORS)
//   GET  / (the chat page, tools/node/web_page.hpp), /v1/status (the pipeline as JSON, for that page)
//
// /, /health, /v1/models, OPTIONS and the 404/405 answers come from the event loop itself, so they never wait
// behind generations. /health answers from the engine's link and the latest STATUS probe of every worker,
// made by a background thread at most once a second while /health is being asked (so a worker that comes
// back is seen without any generation request). Generations, /metrics and /v1/status run on the handler threads.
//
// Each generation reads its own GenStream, so a client that reads slowly only slows its own response; a
// client that goes away cancels its generation (its sessions are closed on every stage). A streamed
// response notices at its next write or look at the socket (a ": keep-alive" comment every 2 s when idle);
// a non-streamed one that has not finished within a second commits a 200 and writes a space (leading JSON
// whitespace) every second until its body, so an error after that second is reported in the body of the
// 200. Errors are OpenAI-style JSON with their status code.
#pragma once

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "node/http_front.hpp"
#include "node/openai_api.hpp"
#include "node/web_page.hpp"
#include "pp/net/coordinator/scheduler.hpp"
#include "node/worker_status.hpp"
#include "pp/net/socket.hpp"

namespace pp::node {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8080;              // 0: an ephemeral port (printed)
  std::size_t threads = 64;     // handler threads: requests served at once (a streamed response holds one)
  std::string model_id;         // what /v1/models lists and responses name
  net::Millis status_timeout{1000};  // /metrics and the /health probe: how long each worker's STATUS may take
  Authenticate authenticate;          // for those STATUS connections, when the workers require a key
};

// ---- routing (no engine needed: tests/fuzz/fuzz_http.cpp runs it) ----

enum class Route { completions, chat, models, model, health, metrics, status, page, options, not_found, wrong_method };

struct RouteMatch {
  Route route = Route::not_found;
  std::string allow;     // wrong_method: the methods the path takes
  std::string model_id;  // model: the {id}
};

inline RouteMatch match_route(std::string_view method, std::string_view path) {
  struct Known {
    std::string_view path;
    const char* method;
    Route route;
  };
  static constexpr Known kKnown[] = {{"/v1/completions", "POST", Route::completions},
                                     {"/v1/chat/completions", "POST", Route::chat},
                                     {"/v1/models", "GET", Route::models},
                                     {"/health", "GET", Route::health},
                                     {"/metrics", "GET", Route::metrics},
                                     {"/v1/status", "GET", Route::status},
                                     {"/", "GET", Route::page}};
  if (method == "OPTIONS") return {Route::options, {}, {}};
  const bool get = method == "GET" || method == "HEAD";
  for (const Known& k : kKnown)
    if (path == k.path) {
      if (method == k.method || (get && std::string_view(k.method) == "GET")) return {k.route, {}, {}};
      return {Route::wrong_method, k.method == std::string_view("GET") ? "GET, HEAD" : "POST", {}};
    }
  constexpr std::string_view kModel = "/v1/models/";
  if (path.size() > kModel.size() && path.substr(0, kModel.size()) == kModel) {
    if (get) return {Route::model, {}, std::string(path.substr(kModel.size()))};
    return {Route::wrong_method, "GET, HEAD", {}};
  }
  return {};
}

inline std::string json_text(const json& body) { return body.dump(-1, ' ', false, json::error_handler_t::replace); }

inline ApiError api_error(int status, std::string message, std::string type = "invalid_request_error") {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.type = std::move(type);
  return e;
}

inline HttpResponse json_response(int status, const json& body) {
  HttpResponse r;
  r.status = status;
  r.content_type = "application/json";
  r.body = json_text(body);
  return r;
}

inline HttpResponse error_response(const ApiError& e) { return json_response(e.status, error_body(e)); }

// The answers that need no engine: CORS preflight, 404, 405. nullopt for the other routes.
inline std::optional<HttpResponse> simple_response(const HttpRequest& q, const RouteMatch& m) {
  if (m.route == Route::options) {
    HttpResponse r;
    r.status = 204;
    // The headers the page asks for, when they are plain header names; else the ones OpenAI clients send.
    std::string headers = "Authorization, Content-Type";
    if (const std::string* h = q.header("access-control-request-headers"); h && !h->empty() && h->size() < 1024 &&
        std::all_of(h->begin(), h->end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == ',' || c == ' '; }))
      headers = *h;
    r.headers = {{"Allow", "GET, HEAD, POST, OPTIONS"},
                 {"Access-Control-Allow-Methods", "GET, HEAD, POST, OPTIONS"},
                 {"Access-Control-Allow-Headers", headers},
                 {"Access-Control-Max-Age", "86400"}};
    return r;
  }
  if (m.route == Route::not_found)
    return error_response(api_error(404, "no such endpoint: " + printable(q.method, 32) + " " + printable(q.path) +
                                             " (POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics, GET /v1/status, GET /)"));
  if (m.route == Route::wrong_method) {
    HttpResponse r = error_response(api_error(405, "method " + printable(q.method, 32) + " is not allowed on " + printable(q.path) +
                                                       " (allowed: " + m.allow + ")"));
    r.headers.emplace_back("Allow", m.allow);
    return r;
  }
  return std::nullopt;
}

class HttpServer {
 public:
  // `front` is bound already (serve.hpp binds it before the pipeline loads).
  HttpServer(net::Coordinator& engine, ApiContext api, HttpOptions o, HttpFront& front)
      : engine_(engine), api_(std::move(api)), o_(std::move(o)), front_(front) {}
  ~HttpServer() {
    {
      std::lock_guard lock(probe_mu_);
      probe_stop_ = true;
    }
    probe_cv_.notify_all();
    if (prober_.joinable()) prober_.join();
  }

  // Serves until stop().
  void run() {
    prober_ = std::thread([this] { probe_loop(); });
    front_.run([this](const HttpRequest& q) { return on_loop(q); },
               [this](HttpRequest& q, Responder& r) { on_handler(q, r); });
  }
  void stop() { front_.stop(); }

 private:
  using Clock = std::chrono::steady_clock;

  std::string new_id(const char* prefix) {
    static constexpr char kAlnum[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::lock_guard lock(id_mu_);
    std::string s = prefix;
    for (int i = 0; i < 24; ++i) s += kAlnum[rng_() % (sizeof kAlnum - 1)];
    return s;
  }

  // On the event loop: everything but generations and /metrics.
  std::optional<HttpResponse> on_loop(const HttpRequest& q) {
    const RouteMatch m = match_route(q.method, q.path);
    if (auto r = simple_response(q, m)) return r;
    switch (m.route) {
      case Route::models:
        return json_response(200, {{"object", "list"}, {"data", {model_json()}}});
      case Route::model: {
        if (m.model_id == o_.model_id) return json_response(200, model_json());
        ApiError e = api_error(404, "the model '" + printable(m.model_id) + "' does not exist; this server serves '" +
                                        o_.model_id + "'");
        e.code = "model_not_found";
        return error_response(e);
      }
      case Route::health:
        return health();
      case Route::page:
        return page_response();
      default:
        return std::nullopt;
    }
  }

  // On a handler thread.
  void on_handler(HttpRequest& q, Responder& res) {
    const RouteMatch m = match_route(q.method, q.path);
    if (m.route == Route::metrics) {
      res.send(200, "text/plain; version=0.0.4", metrics_text());
      return;
    }
    if (m.route == Route::status) return send(res, json_response(200, status_json()));
    generate(q, res, m.route == Route::chat);
  }

  static void send(Responder& res, const HttpResponse& r) { res.send(r.status, r.content_type, r.body, r.headers); }

  json model_json() const {
    return {{"id", o_.model_id}, {"object", "model"}, {"created", started_}, {"owned_by", "pp"},
            {"context_length", api_.ctx}};
  }

  // ---- /health ----

  struct Probe {
    bool ok = false;
    std::string error;
    uint64_t epoch = 0;    // the engine's link when the probe started
    bool link_up = false;  // ... and whether it was up
    Clock::time_point started;
  };

  // 200 while the chain answers: the link is up and the latest probe of this link (if any) found every
  // worker answering STATUS; or the link is down but a probe made since found every worker answering (the
  // next request reconnects). Else 503 with the reason.
  HttpResponse health() {
    const net::CoordinatorMetrics m = engine_.metrics();
    std::optional<Probe> p;
    {
      std::lock_guard lock(probe_mu_);
      asked_ = Clock::now();
      p = probe_;
    }
    probe_cv_.notify_all();
    const bool fresh = p && Clock::now() - p->started < std::chrono::seconds(5) && p->epoch == m.link_epoch;
    auto up = [&](const char* how) {
      return json_response(200, {{"status", "ok"}, {"stages", engine_.n_stages()}, {"sessions", m.sessions_active},
                                 {"link", how}});
    };
    auto down = [&](const std::string& why) { return json_response(503, {{"status", "unavailable"}, {"error", why}}); };
    if (m.link_up) {
      if (fresh && !p->ok) return down(p->error);
      return up("connected");
    }
    if (fresh && p->ok && !p->link_up) return up("every worker answers; the next request reconnects the chain");
    if (fresh && !p->ok) return down(p->error);
    return down(m.link_error.empty() ? "the pipeline is not connected" : m.link_error);
  }

  // While /health is asked (within the last 30 s): a STATUS round to every worker, at most one a second.
  void probe_loop() {
    std::unique_lock lock(probe_mu_);
    for (;;) {
      probe_cv_.wait(lock, [&] { return probe_stop_ || Clock::now() - asked_ < std::chrono::seconds(30); });
      if (probe_stop_) return;
      lock.unlock();
      Probe p;
      p.started = Clock::now();
      const net::CoordinatorMetrics m = engine_.metrics();
      p.epoch = m.link_epoch;
      p.link_up = m.link_up;
      std::vector<std::future<std::string>> asks;
      for (const net::Hop& h : engine_.hops())
        asks.push_back(std::async(std::launch::async, [this, peer = h.peer]() -> std::string {
          try {
            query_status(peer, o_.status_timeout, o_.authenticate);
            return {};
          } catch (const std::exception& e) {
            return e.what();
          }
        }));
      p.ok = true;
      for (auto& a : asks)
        if (std::string why = a.get(); !why.empty() && p.ok) p.ok = false, p.error = "STATUS probe: " + why;
      lock.lock();
      probe_ = p;
      probe_cv_.wait_until(lock, p.started + std::chrono::seconds(1), [&] { return probe_stop_; });
      if (probe_stop_) return;
    }
  }

  // ---- generations ----

  static constexpr std::chrono::seconds kKeepAlive{1};  // a non-streamed request's wait, then its space interval

  // Takes `out`'s output into `pieces` for up to `wait`; true once the generation has ended and all of it is taken.
  static bool collect(net::GenStream& out, std::vector<net::GenStream::Piece>& pieces, std::chrono::milliseconds wait) {
    const auto until = std::chrono::steady_clock::now() + wait;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (!out.next(pieces, std::max(left, std::chrono::milliseconds(0)))) return true;
      if (left <= std::chrono::milliseconds(0)) return false;
    }
  }

  // A finished non-streamed generation's status and body: the whole completion, or the error.
  static std::pair<int, json> whole_response(const ApiRequest& r, const ResponseMeta& meta, const net::GenStream& out,
                                             const std::vector<net::GenStream::Piece>& pieces) {
    if (out.finish() == net::Finish::error) return {503, error_body(api_error(503, out.error(), "server_error"))};
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
  static void generate_whole(const ApiRequest& r, const ResponseMeta& meta, net::GenStream& out, Responder& res) {
    std::vector<net::GenStream::Piece> pieces;
    if (collect(out, pieces, kKeepAlive)) {
      const auto [status, body] = whole_response(r, meta, out, pieces);
      send(res, json_response(status, body));
      return;
    }
    if (!res.begin_stream(200, "application/json; charset=utf-8")) return out.cancel();
    for (;;) {
      // Up to a second for the end, looking every 100 ms for a closed connection; then a space.
      const auto until = std::chrono::steady_clock::now() + kKeepAlive;
      while (std::chrono::steady_clock::now() < until) {
        if (collect(out, pieces, std::chrono::milliseconds(100))) {
          if (!res.write(json_text(whole_response(r, meta, out, pieces).second))) return;
          res.end_stream();
          return;
        }
        if (res.peer_gone()) return out.cancel();
      }
      if (!res.write(" ")) return out.cancel();
    }
  }

  static void generate_stream(const ApiRequest& r, const ResponseMeta& meta, net::GenStream& out, Responder& res) {
    auto last_write = std::chrono::steady_clock::now();
    auto write = [&](const std::string& s) {
      last_write = std::chrono::steady_clock::now();
      return res.write(s);
    };
    if (!res.begin_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}}))
      return out.cancel();
    if (r.chat && !write(sse(chunk(r, meta, "", {}, std::nullopt, true)))) return out.cancel();
    std::vector<net::GenStream::Piece> pieces;
    for (;;) {
      pieces.clear();
      const bool more = out.next(pieces, std::chrono::milliseconds(250));
      for (const auto& p : pieces)
        if (!p.text.empty() || (r.return_tokens && !p.tokens.empty()))
          if (!write(sse(chunk(r, meta, p.text, p.tokens, std::nullopt)))) return out.cancel();
      if (!more) break;
      // A comment now and then, and a look at the socket: a client that went away is noticed while idle.
      if (std::chrono::steady_clock::now() - last_write > std::chrono::seconds(2) && !write(": keep-alive\n\n"))
        return out.cancel();
      if (pieces.empty() && res.peer_gone()) return out.cancel();
    }
    const net::Finish f = out.finish();
    if (f == net::Finish::error) {
      write(sse(error_body(api_error(503, out.error(), "server_error"))));
    } else {
      if (!write(sse(chunk(r, meta, "", {}, f)))) return;
      if (r.include_usage && !write(sse(usage_chunk(r, meta, out.prompt_tokens(), out.completion_tokens())))) return;
    }
    write("data: [DONE]\n\n");
    res.end_stream();
  }

  void generate(HttpRequest& q, Responder& res, bool chat) {
    ApiRequest r;
    try {
      r = parse_request(q.body, chat, api_);
    } catch (const ApiError& e) {
      release_body(q);
      return send(res, error_response(e));
    } catch (const Error& e) {  // the tokenizer refused the text
      release_body(q);
      return send(res, error_response(api_error(400, e.what())));
    }
    release_body(q);
    const ResponseMeta meta{new_id(chat ? "chatcmpl-" : "cmpl-"), int64_t(std::time(nullptr)), o_.model_id};
    std::shared_ptr<net::GenStream> out = engine_.submit(r.prompt, r.gen);
    if (r.stream) generate_stream(r, meta, *out, res);
    else generate_whole(r, meta, *out, res);
    if (!out->done()) out->cancel();
  }

  // The body is parsed: its memory goes back now, not after the generation (glibc keeps a large freed
  // block in the thread's arena).
  static void release_body(HttpRequest& q) {
    const bool large = q.body.capacity() >= (1u << 20);
    std::string().swap(q.body);
    if (large) ::malloc_trim(0);
  }

  // Every worker's STATUS, asked at once (nullopt: it did not answer within status_timeout).
  std::vector<std::optional<StatusMap>> worker_status() const {
    std::vector<std::future<std::optional<StatusMap>>> asks;
    for (const net::Hop& h : engine_.hops())
      asks.push_back(std::async(std::launch::async, [this, peer = h.peer]() -> std::optional<StatusMap> {
        try {
          return query_status(peer, o_.status_timeout, o_.authenticate);
        } catch (const std::exception&) {
          return std::nullopt;
        }
      }));
    std::vector<std::optional<StatusMap>> status;
    for (auto& a : asks) status.push_back(a.get());
    return status;
  }

  // A number from a worker's STATUS; nullopt when it did not answer or has no such key.
  static std::optional<double> status_number(const std::optional<StatusMap>& status, const char* key) {
    if (!status) return std::nullopt;
    const auto it = status->find(key);
    if (it == status->end()) return std::nullopt;
    try {
      return std::stod(it->second);
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }

  // /v1/status: what /metrics reports, as JSON for the page (docs/SERVING.md lists the fields). Stage 0 is
  // this process; the others are the workers, their counters from STATUS (queried now) and their kernels
  // from the chain's WELCOME.
  json status_json() const {
    const net::CoordinatorMetrics m = engine_.metrics();
    const auto& hops = engine_.hops();
    const std::vector<std::optional<StatusMap>> status = worker_status();
    const std::vector<net::StageReport> reports = engine_.stage_reports();
    auto ms_per_batch = [](std::optional<double> seconds, std::optional<double> batches) -> json {
      if (!seconds || !batches || *batches <= 0) return nullptr;
      return *seconds * 1e3 / *batches;
    };
    auto number = [](std::optional<double> v) -> json { return v ? json(*v) : json(nullptr); };

    json stages = json::array();
    const net::NumericProfile mine{engine_.stage().kernel_profile(), engine_.stage().threads()};
    const LayerRange r0 = engine_.stage().range();
    stages.push_back({{"stage", 0}, {"host", "coordinator"}, {"layers", {r0.lo, r0.hi}}, {"arch", mine.arch},
                      {"threads", mine.threads}, {"up", true}, {"sessions_active", m.sessions_active},
                      {"batches", m.batches}, {"batch_rows", m.batch_rows}, {"compute_seconds", m.stage0_compute_s},
                      {"transfer_seconds", m.stage0_transfer_s}, {"wait_seconds", m.stage0_wait_s},
                      {"compute_ms_per_batch", ms_per_batch(m.stage0_compute_s, double(m.batches))},
                      {"bytes_sent", m.bytes_sent}, {"bytes_received", m.bytes_received}});
    for (std::size_t i = 0; i < hops.size(); ++i) {
      const std::optional<StatusMap>& st = status[i];
      json s = {{"stage", i + 1}, {"host", hops[i].peer.str()}, {"layers", {hops[i].range.lo, hops[i].range.hi}},
                {"arch", nullptr}, {"threads", nullptr}, {"up", bool(st)}};
      const auto report = std::find_if(reports.begin(), reports.end(), [&](const net::StageReport& w) { return w.stage == i + 1; });
      if (report != reports.end()) s["arch"] = report->profile.arch, s["threads"] = report->profile.threads;
      else if (st && st->count("arch")) s["arch"] = st->at("arch");  // the chain is down: the worker's own SIMD
      const auto compute = status_number(st, "compute_seconds"), batches = status_number(st, "batches");
      s["sessions_active"] = number(status_number(st, "sessions_active"));
      s["batches"] = number(batches);
      s["batch_rows"] = number(status_number(st, "batch_rows"));
      s["compute_seconds"] = number(compute);
      s["transfer_seconds"] = number(status_number(st, "transfer_seconds"));
      s["compute_ms_per_batch"] = ms_per_batch(compute, batches);
      s["bytes_sent"] = number(status_number(st, "bytes_sent"));
      s["bytes_received"] = number(status_number(st, "bytes_received"));
      stages.push_back(std::move(s));
    }
    return {{"object", "pipeline.status"},
            {"model", o_.model_id},
            {"pipeline_up", m.link_up},
            {"link_error", m.link_error},
            {"tokens_per_second", m.tokens_per_second},
            {"tokens_generated", m.tokens_generated},
            {"prompt_tokens", m.prompt_tokens},
            {"requests", {{"ok", m.requests_ok}, {"error", m.requests_error}, {"cancelled", m.requests_cancelled}}},
            {"sessions_active", m.sessions_active},
            {"queue_depth", m.queue_depth},
            {"batches", m.batches},
            {"active_seconds", m.active_s},
            {"prefill_pace_rows", m.prefill_pace_rows},
            {"micro_batches", m.micro_batches},
            {"time_to_first_token_avg_s", m.ttft_count ? json(m.ttft_sum_s / double(m.ttft_count)) : json(nullptr)},
            {"stages", std::move(stages)}};
  }

  static HttpResponse page_response() {
    HttpResponse r;
    r.content_type = "text/html; charset=utf-8";
    r.body = std::string(kWebPage);
    r.headers = {{"Content-Security-Policy", std::string(kWebPageCsp)},
                 {"X-Content-Type-Options", "nosniff"},
                 {"Cache-Control", "no-store"},
                 {"Referrer-Policy", "no-referrer"}};
    return r;
  }

  // Prometheus text: the coordinator's counters, and each worker's from its STATUS (queried now).
  std::string metrics_text() {
    const net::CoordinatorMetrics m = engine_.metrics();
    const auto& hops = engine_.hops();
    const std::vector<std::optional<StatusMap>> status = worker_status();

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
    auto worker_value = [&](std::size_t i, const char* key) { return status_number(status[i], key); };

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
    family("pp_active_seconds_total", "counter", "Wall time with at least one generation in progress.");
    sample("pp_active_seconds_total", "", m.active_s);
    family("pp_prefill_pace_rows", "gauge",
           "Prompt rows a batch carries while other generations decode (about half a decoding batch's cost).");
    sample("pp_prefill_pace_rows", "", double(m.prefill_pace_rows));
    family("pp_micro_batches", "gauge",
           "Micro-batches the decoding generations are split into (--micro-batches, or measured with 0).");
    sample("pp_micro_batches", "", double(m.micro_batches));
    family("pp_micro_batch_switches_total", "counter", "Times --micro-batches 0 changed the count, measuring.");
    sample("pp_micro_batch_switches_total", "", double(m.micro_batch_switches));
    family("pp_pipeline_up", "gauge", "1 when the coordinator's connection to the chain is up.");
    sample("pp_pipeline_up", "", m.link_up ? 1 : 0);
    family("pp_resumes_total", "counter", "Chains re-established after a failure with every open session replayed (--resume).");
    sample("pp_resumes_total", "", double(m.resumes));
    family("pp_replayed_positions_total", "counter", "Positions replayed into re-established chains (--resume).");
    sample("pp_replayed_positions_total", "", double(m.replayed_positions));

    family("pp_stage_up", "gauge", "1 when the stage answered STATUS just now (stage 0: the coordinator).");
    sample("pp_stage_up", stage_labels(0), 1);
    for (std::size_t i = 0; i < hops.size(); ++i) sample("pp_stage_up", stage_labels(i + 1), status[i] ? 1 : 0);
    family("pp_stage_sessions_active", "gauge", "Sessions open on the stage (multiplexed sessions on workers).");
    sample("pp_stage_sessions_active", stage_labels(0), double(m.sessions_active));
    for (std::size_t i = 0; i < hops.size(); ++i)
      if (auto v = worker_value(i, "sessions_active")) sample("pp_stage_sessions_active", stage_labels(i + 1), *v);
    family("pp_stage_compute_seconds_total", "counter", "Time the stage spent computing batches.");
    sample("pp_stage_compute_seconds_total", stage_labels(0), m.stage0_compute_s);
    for (std::size_t i = 0; i < hops.size(); ++i)
      if (auto v = worker_value(i, "compute_seconds")) sample("pp_stage_compute_seconds_total", stage_labels(i + 1), *v);
    family("pp_stage_transfer_seconds_total", "counter",
           "Time the stage spent sending frames and reading payloads (not waiting for them).");
    sample("pp_stage_transfer_seconds_total", stage_labels(0), m.stage0_transfer_s);
    for (std::size_t i = 0; i < hops.size(); ++i)
      if (auto v = worker_value(i, "transfer_seconds")) sample("pp_stage_transfer_seconds_total", stage_labels(i + 1), *v);
    family("pp_stage_wait_seconds_total", "counter",
           "Stage 0: time it sat waiting while generations were in progress (its pipeline bubbles).");
    sample("pp_stage_wait_seconds_total", stage_labels(0), m.stage0_wait_s);
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

  net::Coordinator& engine_;
  ApiContext api_;
  HttpOptions o_;
  HttpFront& front_;
  std::mutex probe_mu_;
  std::condition_variable probe_cv_;
  std::optional<Probe> probe_;
  Clock::time_point asked_{};
  bool probe_stop_ = false;
  std::thread prober_;
  std::mutex id_mu_;
  std::mt19937_64 rng_{std::random_device{}()};
  int64_t started_ = int64_t(std::time(nullptr));
};

}  // namespace pp::node
