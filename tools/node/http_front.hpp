// pp_node --serve: the HTTP/1.1 front. One event-loop thread accepts connections and reads requests; a
// bounded pool of handler threads writes the responses that take time (generations, /metrics).
//
// Why our own server instead of cpp-httplib (which served here until issue 16): httplib gives every
// connection a pool thread from accept to close and reads a request head with a 30 s timeout per read and
// no overall deadline, so 64 connections trickling a header line every 2 s held every thread and /health
// went unanswered for minutes. A bounded acceptor in front of httplib would only cap the damage: the held
// threads stay held, and /health still waits behind them. Here no thread ever waits for a client's bytes:
//
//   * The event loop (epoll, non-blocking sockets) holds up to kMaxConnections connections. A request head
//     must be complete within 10 s (HttpLimits::head_timeout) of the connection's accept, or of its first
//     byte on a kept-alive connection; trickling bytes does not extend it. A body must be complete by that
//     deadline plus its length at 32 KiB/s. An idle kept-alive connection is closed after 5 s. Past a
//     deadline the loop answers 408 (best effort) and closes.
//   * Heads are parsed strictly (RequestParser; fuzzed by tests/fuzz/fuzz_http.cpp): at most 64 KiB and 100
//     header lines; a body needs exactly one valid Content-Length (a duplicate, a non-numeric or negative
//     value: 400; more than 8 MiB: 413 at once, from the head, the body never read). Transfer-Encoding is
//     refused with 411: every client of an OpenAI API sends Content-Length, and supporting chunked bodies
//     would add a second framing (and its request-smuggling ambiguities with Content-Length) for nothing.
//   * Cheap routes (/health, /v1/models, OPTIONS, 404, 405, refusals) are answered by the loop itself, so
//     they never queue behind generations. The others go to the handler pool through a queue of at most
//     kMaxQueued requests; past that the loop answers 503 with Retry-After (a queue that grows without
//     bound only turns overload into timeouts).
//   * A handler writes its response with blocking writes bounded by a write timeout (poll), streams
//     (chunked) when it needs to, and hands a kept-alive connection back to the loop when done.
//   * Body bytes buffered across all connections are bounded (kMaxBufferedBody); a connection that would
//     pass the bound is answered 503.
//
// CORS: a response carries `Access-Control-Allow-Origin` only for the origins `--cors-origin` allows (the
// request's own origin echoed with `Vary: Origin`, or `*`); by default none, so no other site's page can
// read what this server says. One log line per request goes to stderr
// (method, path, status, duration); failed connections are summed up in at most one line per second.
// Client bytes are never printed raw (pp::printable).
#pragma once

#include <fcntl.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "pp/core/error.hpp"
#include "pp/core/printable.hpp"

namespace pp::node {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

inline const char* status_reason(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return status < 400 ? "OK" : status < 500 ? "Client Error" : "Server Error";
  }
}

struct HttpLimits {
  std::size_t max_head = 64u << 10;    // request line and headers together
  std::size_t max_headers = 100;       // header lines
  std::size_t max_target = 8u << 10;   // the request target
  std::size_t max_body = 8u << 20;     // Content-Length
  std::chrono::milliseconds head_timeout{10'000};  // the whole head, from accept (or a kept-alive request's first byte)
  std::size_t body_min_rate = 32u << 10;           // bytes/s: a body's deadline is head deadline + length / rate
  std::chrono::milliseconds idle_timeout{5'000};   // a kept-alive connection between requests
  std::chrono::milliseconds write_timeout{30'000}; // each write of a response
};

struct HttpRequest {
  std::string method;
  std::string target;   // as sent
  std::string path;     // the target without its query (absolute-form: without scheme and authority)
  int minor = 1;        // HTTP/1.minor
  HttpHeaders headers;  // names lower-cased, values trimmed
  std::string body;
  bool keep_alive = true;
  bool expect_continue = false;

  const std::string* header(std::string_view name) const {
    for (const auto& [k, v] : headers)
      if (k == name) return &v;
    return nullptr;
  }
};

// A complete response the event loop writes (cheap routes and refusals).
struct HttpResponse {
  int status = 200;
  std::string content_type;  // empty: no body
  std::string body;
  HttpHeaders headers;
  bool close = false;        // Connection: close after it
};

// Incremental, strict HTTP/1.x request parser. feed() bytes as they arrive; once done(), take() the
// request (bytes after it stay buffered: the next pipelined request). A failure is final: status() and
// error() say what to answer before closing. Never throws on any input bytes.
class RequestParser {
 public:
  enum class State { head, body, done, failed };

  explicit RequestParser(HttpLimits limits = {}) : lim_(limits) {}

  State feed(std::string_view data) {
    if (state_ == State::failed) return state_;
    if (state_ == State::done) {  // the next pipelined request, parsed after take()
      buf_.append(data);
      return state_;
    }
    if (state_ == State::body) {
      const std::size_t take = std::min(data.size(), body_left_);
      req_.body.append(data.data(), take);
      body_left_ -= take;
      buf_.append(data.data() + take, data.size() - take);
      if (body_left_ == 0) state_ = State::done;
      return state_;
    }
    buf_.append(data);
    return advance();
  }
  // Parses what is buffered (after take(), the next pipelined request).
  State advance() {
    if (state_ == State::head) parse_head();
    if (state_ == State::body && !buf_.empty()) {
      const std::size_t take = std::min(buf_.size(), body_left_);
      req_.body.append(buf_, 0, take);
      buf_.erase(0, take);
      body_left_ -= take;
      if (body_left_ == 0) state_ = State::done;
    }
    return state_;
  }

  State state() const { return state_; }
  bool started() const { return state_ != State::head || !buf_.empty(); }  // any byte of a request
  int status() const { return status_; }
  const std::string& error() const { return error_; }
  const HttpRequest& request() const { return req_; }  // valid once the head is parsed
  std::size_t content_length() const { return content_length_; }
  std::size_t body_received() const { return req_.body.size(); }

  HttpRequest take() {
    HttpRequest r = std::move(req_);
    req_ = HttpRequest{};
    state_ = State::head;
    scanned_ = 0;
    content_length_ = body_left_ = 0;
    return r;
  }

 private:
  static bool is_tchar(unsigned char c) {
    return std::isalnum(c) || std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
  }
  static std::string lower(std::string_view s) {
    std::string o(s);
    for (char& c : o) c = char(std::tolower(static_cast<unsigned char>(c)));
    return o;
  }
  static std::string_view trim_ows(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
  }
  // Does the comma-separated list `v` contain `token` (case-insensitive)?
  static bool has_token(std::string_view v, std::string_view token) {
    while (!v.empty()) {
      const std::size_t c = v.find(',');
      if (lower(trim_ows(v.substr(0, c))) == token) return true;
      if (c == std::string_view::npos) break;
      v.remove_prefix(c + 1);
    }
    return false;
  }

  State fail(int status, std::string message) {
    state_ = State::failed;
    status_ = status;
    error_ = std::move(message);
    buf_.clear();
    return state_;
  }

  void parse_head() {
    // Empty lines before a request line are ignored (RFC 9112 2.2).
    std::size_t lead = 0;
    while (lead < buf_.size() && (buf_[lead] == '\r' || buf_[lead] == '\n') && lead < 16) ++lead;
    if (lead > 0) {
      if (lead == 16) {
        fail(400, "too many empty lines before the request line");
        return;
      }
      buf_.erase(0, lead);
      scanned_ = 0;
    }
    // The head ends at the first empty line (CRLF CRLF; a bare LF is accepted as a line end).
    std::size_t end = std::string::npos, body_at = 0;
    for (std::size_t i = scanned_; i < buf_.size(); ++i) {
      if (buf_[i] != '\n') continue;
      if (i + 1 < buf_.size() && buf_[i + 1] == '\n') {
        end = i, body_at = i + 2;
        break;
      }
      if (i + 2 < buf_.size() && buf_[i + 1] == '\r' && buf_[i + 2] == '\n') {
        end = i, body_at = i + 3;
        break;
      }
    }
    if (end == std::string::npos) {
      scanned_ = buf_.size() >= 2 ? buf_.size() - 2 : 0;
      if (buf_.size() > lim_.max_head)
        fail(431, "the request head is over " + std::to_string(lim_.max_head >> 10) + " KiB");
      return;
    }
    if (body_at > lim_.max_head + 3) {
      fail(431, "the request head is over " + std::to_string(lim_.max_head >> 10) + " KiB");
      return;
    }
    const std::string head = buf_.substr(0, end);
    buf_.erase(0, body_at);
    scanned_ = 0;
    if (!parse_lines(head)) return;
    if (content_length_ == 0) {
      state_ = State::done;
    } else {
      body_left_ = content_length_;
      req_.body.reserve(std::min<std::size_t>(content_length_, 64u << 10));
      state_ = State::body;
    }
  }

  bool parse_lines(std::string_view head) {
    std::vector<std::string_view> lines;
    while (!head.empty()) {
      const std::size_t nl = head.find('\n');
      std::string_view line = head.substr(0, nl);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      lines.push_back(line);
      if (nl == std::string_view::npos) break;
      head.remove_prefix(nl + 1);
    }
    if (lines.empty()) return fail(400, "empty request"), false;
    if (!parse_request_line(lines[0])) return false;
    if (lines.size() - 1 > lim_.max_headers)
      return fail(431, "more than " + std::to_string(lim_.max_headers) + " header lines"), false;
    int n_length = 0, n_host = 0;
    bool te = false;
    std::string_view length;
    for (std::size_t i = 1; i < lines.size(); ++i) {
      const std::string_view line = lines[i];
      if (line.front() == ' ' || line.front() == '\t')
        return fail(400, "header line " + std::to_string(i) + " is folded (starts with whitespace)"), false;
      const std::size_t colon = line.find(':');
      if (colon == std::string_view::npos || colon == 0)
        return fail(400, "header line " + std::to_string(i) + " has no 'name:'"), false;
      const std::string_view name = line.substr(0, colon);
      for (char c : name)
        if (!is_tchar(static_cast<unsigned char>(c)))
          return fail(400, "header line " + std::to_string(i) + ": invalid character in the name"), false;
      const std::string_view value = trim_ows(line.substr(colon + 1));
      for (char c : value) {
        const unsigned char u = static_cast<unsigned char>(c);
        if ((u < 0x20 && u != '\t') || u == 0x7f)
          return fail(400, "header '" + printable(name, 64) + "': control byte in the value"), false;
      }
      std::string key = lower(name);
      if (key == "content-length") ++n_length, length = value;
      else if (key == "transfer-encoding") te = true;
      else if (key == "host") ++n_host;
      req_.headers.emplace_back(std::move(key), std::string(value));
    }
    if (te)
      return fail(411, "Transfer-Encoding is not supported: send the body with a Content-Length"), false;
    if (n_length > 1) return fail(400, "more than one Content-Length header"), false;
    if (req_.minor == 1 && n_host != 1)
      return fail(400, n_host == 0 ? "an HTTP/1.1 request needs a Host header" : "more than one Host header"), false;
    if (n_length == 1) {
      if (length.empty()) return fail(400, "Content-Length is empty"), false;
      for (char c : length)
        if (c < '0' || c > '9')
          return fail(400, "Content-Length '" + printable(length, 32) + "' is not a non-negative decimal number"), false;
      const std::size_t digits = length.size() - std::min(length.find_first_not_of('0'), length.size());
      uint64_t v = 0;
      if (digits <= 19) v = std::stoull(std::string(length));
      if (digits > 19 || v > lim_.max_body)
        return fail(413, "the request body (Content-Length " + printable(length, 32) + ") is larger than the limit of " +
                             std::to_string(lim_.max_body >> 20) + " MiB"), false;
      content_length_ = std::size_t(v);
    }
    if (const std::string* c = req_.header("connection")) {
      if (has_token(*c, "close")) req_.keep_alive = false;
      else if (has_token(*c, "keep-alive")) req_.keep_alive = true;
    }
    if (const std::string* e = req_.header("expect")) {
      if (lower(*e) != "100-continue") return fail(417, "the only expectation supported is 100-continue"), false;
      req_.expect_continue = true;
    }
    return true;
  }

  bool parse_request_line(std::string_view line) {
    const std::size_t sp1 = line.find(' ');
    const std::size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos)
      return fail(400, "the request line is not 'METHOD TARGET HTTP/1.x'"), false;
    const std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1),
                           version = line.substr(sp2 + 1);
    if (method.empty() || method.size() > 32) return fail(400, "invalid method"), false;
    for (char c : method)
      if (!is_tchar(static_cast<unsigned char>(c))) return fail(400, "invalid method"), false;
    if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || version[6] != '.' || !std::isdigit(version[5]) ||
        !std::isdigit(static_cast<unsigned char>(version[7])))
      return fail(400, "invalid HTTP version"), false;
    if (version[5] != '1') return fail(505, "only HTTP/1.0 and HTTP/1.1 are supported"), false;
    if (target.empty()) return fail(400, "empty request target"), false;
    if (target.size() > lim_.max_target)
      return fail(414, "the request target is over " + std::to_string(lim_.max_target >> 10) + " KiB"), false;
    for (char c : target) {
      const unsigned char u = static_cast<unsigned char>(c);
      if (u <= 0x20 || u >= 0x7f) return fail(400, "invalid byte in the request target"), false;
    }
    req_.method = std::string(method);
    req_.target = std::string(target);
    req_.minor = version[7] - '0';
    req_.keep_alive = req_.minor >= 1;
    std::string_view path = target;
    if (path.substr(0, 7) == "http://" || path.substr(0, 8) == "https://") {  // absolute-form
      const std::size_t slash = path.find('/', path.find("//") + 2);
      path = slash == std::string_view::npos ? std::string_view("/") : path.substr(slash);
    } else if (path != "*" && path.front() != '/') {
      return fail(400, "the request target must be a path"), false;
    }
    req_.path = std::string(path.substr(0, path.find_first_of("?#")));
    return true;
  }

  HttpLimits lim_;
  State state_ = State::head;
  std::string buf_;           // head bytes not yet parsed, or bytes after the request (pipelined)
  std::size_t scanned_ = 0;   // buf_ searched for the head's end up to here
  HttpRequest req_;
  std::size_t content_length_ = 0, body_left_ = 0;
  int status_ = 0;
  std::string error_;
};

// Which origins may read responses from a browser page (`--cors-origin`, repeatable): none by default.
struct CorsPolicy {
  bool any = false;                  // `*`
  std::vector<std::string> origins;  // exact `scheme://host[:port]` values

  // A well-formed origin, or "*": checked when the option is given.
  static bool valid(std::string_view o) {
    if (o == "*") return true;
    const std::size_t sep = o.find("://");
    if (sep == std::string_view::npos || sep == 0 || o.size() == sep + 3 || o.size() > 256) return false;
    if (o.substr(0, sep) != "http" && o.substr(0, sep) != "https") return false;
    return std::all_of(o.begin() + std::ptrdiff_t(sep + 3), o.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' || c == '[' || c == ']';
    });
  }
  void allow(const std::string& o) {
    if (o == "*") any = true;
    else origins.push_back(o);
  }
  // The CORS header lines for a request carrying `origin` (null: none sent), or "".
  std::string headers(const std::string* origin) const {
    if (any) return "Access-Control-Allow-Origin: *\r\n";
    if (origin && std::find(origins.begin(), origins.end(), *origin) != origins.end())
      return "Access-Control-Allow-Origin: " + *origin + "\r\nVary: Origin\r\n";
    return origins.empty() ? "" : "Vary: Origin\r\n";
  }
};

// The status line and headers of a response; `cors`: CorsPolicy::headers for its request.
inline std::string response_head(int status, int minor, std::string_view content_type, const HttpHeaders& extra,
                                 std::optional<std::size_t> length, bool chunked, bool close, std::string_view cors) {
  std::string h = "HTTP/1." + std::to_string(minor) + " " + std::to_string(status) + " " + status_reason(status) + "\r\n";
  if (!content_type.empty()) h += "Content-Type: " + std::string(content_type) + "\r\n";
  if (length) h += "Content-Length: " + std::to_string(*length) + "\r\n";
  if (chunked) h += "Transfer-Encoding: chunked\r\n";
  h += cors;
  for (const auto& [k, v] : extra) h += k + ": " + v + "\r\n";
  h += close ? "Connection: close\r\n" : (minor == 0 ? "Connection: keep-alive\r\n" : "");
  return h + "\r\n";
}

// A handler's side of one request: writes the response on the connection, each write bounded by the
// write timeout. Either send() once, or begin_stream(), write()..., end_stream().
class Responder {
 public:
  Responder(int fd, const HttpRequest& q, std::chrono::milliseconds write_timeout, std::string cors = {})
      : fd_(fd), minor_(q.minor), keep_alive_(q.keep_alive), head_only_(q.method == "HEAD"), timeout_(write_timeout),
        cors_(std::move(cors)) {}

  bool send(int status, std::string_view content_type, std::string_view body, const HttpHeaders& extra = {}) {
    status_ = status;
    started_ = true;
    std::string out = response_head(status, minor_, content_type, extra, body.size(), false, !keep_alive_, cors_);
    if (!head_only_) out += body;
    complete_ = write_all(out);
    return complete_;
  }
  bool begin_stream(int status, std::string_view content_type, const HttpHeaders& extra = {}) {
    status_ = status;
    started_ = true;
    if (minor_ == 0) keep_alive_ = false;  // HTTP/1.0: no chunks, the body ends when the connection does
    return write_all(response_head(status, minor_, content_type, extra, std::nullopt, minor_ >= 1, !keep_alive_, cors_));
  }
  bool write(std::string_view data) {
    if (data.empty() || head_only_) return !failed_;
    if (minor_ == 0) return write_all(data);
    char size[24];
    std::snprintf(size, sizeof size, "%zx\r\n", data.size());
    std::string chunk = size;
    chunk.append(data);
    chunk += "\r\n";
    return write_all(chunk);
  }
  bool end_stream() {
    complete_ = (minor_ == 0 || head_only_ || write_all("0\r\n\r\n")) && !failed_;
    return complete_;
  }

  // The client closed its side (or reset): its response would go nowhere. Bytes it sent ahead (a pipelined
  // request) do not count.
  bool peer_gone() const {
    pollfd p{fd_, POLLIN | POLLRDHUP, 0};
    if (::poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLERR | POLLHUP | POLLRDHUP)) return true;
    char c;
    const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }

  bool started() const { return started_; }
  bool complete() const { return complete_ && !failed_; }
  bool keep_alive() const { return keep_alive_; }
  int status() const { return status_; }

 private:
  bool write_all(std::string_view data) {
    if (failed_) return false;
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (!data.empty()) {
      const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n > 0) {
        data.remove_prefix(std::size_t(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        pollfd p{fd_, POLLOUT, 0};
        if (left.count() > 0 && ::poll(&p, 1, int(std::min<int64_t>(left.count(), 1000))) >= 0) continue;
        if (left.count() > 0) continue;
      }
      failed_ = true;
      return false;
    }
    return true;
  }

  int fd_;
  int minor_;
  bool keep_alive_;
  bool head_only_;
  std::chrono::milliseconds timeout_;
  std::string cors_;
  bool started_ = false, complete_ = false, failed_ = false;
  int status_ = 0;
};

// The event loop and the handler pool.
class HttpFront {
 public:
  static constexpr std::size_t kMaxConnections = 1024;
  static constexpr std::size_t kMaxQueued = 256;               // complete requests waiting for a handler
  static constexpr std::size_t kMaxBufferedBody = 128u << 20;  // body bytes buffered over all connections

  // Runs on the event loop: a response for the cheap routes, or nullopt to hand the request to the pool.
  using InlineRoute = std::function<std::optional<HttpResponse>(const HttpRequest&)>;
  // Runs on a handler thread: writes the response through the Responder.
  using Handler = std::function<void(HttpRequest&, Responder&)>;

  struct Options {
    std::string host = "127.0.0.1";
    int port = 8080;          // 0: ephemeral
    std::size_t threads = 64; // handler threads
    HttpLimits limits;
    bool log_requests = true;
    CorsPolicy cors;
  };

  explicit HttpFront(Options o) : o_(std::move(o)) {}
  HttpFront(const HttpFront&) = delete;
  HttpFront& operator=(const HttpFront&) = delete;
  ~HttpFront() {
    stop();
    join();
    for (int fd : {listen_fd_, epoll_fd_, wake_fd_})
      if (fd >= 0) ::close(fd);
  }

  // Binds the address (does not listen yet: connections before listen() are refused, not queued). Throws
  // with the reason (errno's text) when the address is taken or invalid. Returns the port.
  int bind() {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* res = nullptr;
    const std::string where = "--http-host " + o_.host + " --http-port " + std::to_string(o_.port);
    const std::string port = std::to_string(o_.port);
    if (const int rc = ::getaddrinfo(o_.host.c_str(), port.c_str(), &hints, &res); rc != 0)
      throw Error(where + ": cannot resolve the host: " + ::gai_strerror(rc));
    std::string why = "no address";
    for (addrinfo* a = res; a; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) {
        why = std::strerror(errno);
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0) {
        why = std::strerror(errno);
        ::close(fd);
        continue;
      }
      listen_fd_ = fd;
      break;
    }
    ::freeaddrinfo(res);
    if (listen_fd_ < 0) throw Error(where + ": cannot bind: " + why);
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
    port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    return port_;
  }
  int port() const { return port_; }

  // Starts accepting connections into the kernel's queue (bound first if need be). Call it before telling
  // anyone the address: a client that connects between bind() and listen() is refused. Idempotent.
  void listen() {
    if (listening_) return;
    if (listen_fd_ < 0) bind();
    if (::listen(listen_fd_, 511) != 0) throw Error("--http-port " + std::to_string(port_) + ": cannot listen: " + std::strerror(errno));
    listening_ = true;
  }

  // Listens (if listen() was not called) and serves on this thread until stop(). The handler threads
  // start here.
  void run(InlineRoute inline_route, Handler handler) {
    inline_ = std::move(inline_route);
    handler_ = std::move(handler);
    listen();
    raise_fd_limit();
    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_fd_ < 0 || wake_fd_ < 0) throw Error(std::string("http: epoll/eventfd: ") + std::strerror(errno));
    watch(listen_fd_, EPOLLIN);
    watch(wake_fd_, EPOLLIN);
    for (std::size_t i = 0; i < std::max<std::size_t>(1, o_.threads); ++i) pool_.emplace_back([this] { handler_loop(); });
    loop();
  }

  void stop() {
    if (stopping_.exchange(true)) return;
    {
      std::lock_guard lock(mu_);
      cv_.notify_all();
    }
    wake();
  }

 private:
  using Clock = std::chrono::steady_clock;

  struct Conn {
    int fd = -1;
    RequestParser parser;
    enum class Phase { idle, reading, writing, draining } phase = Phase::reading;
    Clock::time_point deadline;    // of the current phase
    Clock::time_point head_deadline;
    Clock::time_point started;     // the request's first byte (its duration in the log)
    std::string out;               // writing: the response, from out_at
    std::size_t out_at = 0;
    bool close_after = false;
    bool continue_sent = false;
    bool drain = false;            // close_after: read and drop the client's bytes a moment before closing
    std::size_t drained = 0;
    std::size_t counted_body = 0;  // bytes of this connection in buffered_body_
    std::string log_line;          // written once the response has gone
    uint32_t events = 0;
    explicit Conn(const HttpLimits& l) : parser(l) {}
  };

  struct Job {
    std::unique_ptr<Conn> conn;
    HttpRequest req;
  };

  // Failed connections, summed up in at most one log line per second.
  struct Failures {
    std::size_t head_timeout = 0, body_timeout = 0, malformed = 0, refused_full = 0, busy = 0, reset = 0,
                write_timeout = 0, closed_early = 0;
    bool any() const {
      return head_timeout + body_timeout + malformed + refused_full + busy + reset + write_timeout + closed_early > 0;
    }
  };

  static void raise_fd_limit() {
    rlimit r{};
    if (::getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max && r.rlim_cur < 4096) {
      r.rlim_cur = std::min<rlim_t>(r.rlim_max, 4096);
      ::setrlimit(RLIMIT_NOFILE, &r);
    }
  }

  void watch(int fd, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.fd = fd;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }
  void rewatch(Conn& c, uint32_t events) {
    if (c.events == events) return;
    epoll_event ev{};
    ev.events = events;
    ev.data.fd = c.fd;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.fd, &ev);
    c.events = events;
  }
  void wake() {
    if (wake_fd_ >= 0) {
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof one);
    }
  }

  void loop() {
    std::vector<epoll_event> events(256);
    auto last_sweep = Clock::now(), last_summary = Clock::now();
    bool accepting = true;
    Clock::time_point resume_accept;
    while (!stopping_.load()) {
      const int n = ::epoll_wait(epoll_fd_, events.data(), int(events.size()), 100);
      const auto now = Clock::now();
      for (int i = 0; i < n; ++i) {
        const int fd = events[std::size_t(i)].data.fd;
        if (fd == listen_fd_) {
          if (!accept_all(now)) {  // out of descriptors: pause accepting for a moment
            ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd_, nullptr);
            accepting = false;
            resume_accept = now + std::chrono::milliseconds(100);
          }
          continue;
        }
        if (fd == wake_fd_) {
          uint64_t v;
          [[maybe_unused]] ssize_t r = ::read(wake_fd_, &v, sizeof v);
          take_back(now);
          continue;
        }
        const auto it = conns_.find(fd);
        if (it == conns_.end()) continue;
        on_event(*it->second, events[std::size_t(i)].events, now);
      }
      if (!accepting && now >= resume_accept) {
        watch(listen_fd_, EPOLLIN);
        accepting = true;
      }
      if (now - last_sweep >= std::chrono::milliseconds(100)) {
        sweep(now);
        last_sweep = now;
      }
      if (now - last_summary >= std::chrono::seconds(1)) {
        summarize(std::chrono::duration<double>(now - last_summary).count());
        last_summary = now;
      }
    }
    for (auto& [fd, c] : conns_) ::close(fd);
    conns_.clear();
  }

  // Accepts every pending connection; false when out of descriptors.
  bool accept_all(Clock::time_point now) {
    for (;;) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return !(errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM);
      }
      if (conns_.size() + dispatched_.load() >= kMaxConnections) {
        ++fail_.refused_full;
        const std::string r = response_text(error_response(503, "too many connections (" + std::to_string(kMaxConnections) +
                                                                     "): try again later"), 1, false);
        [[maybe_unused]] ssize_t w = ::send(fd, r.data(), r.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        ::close(fd);
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      auto c = std::make_unique<Conn>(o_.limits);
      c->fd = fd;
      c->phase = Conn::Phase::reading;
      c->head_deadline = c->deadline = now + o_.limits.head_timeout;
      c->started = now;
      c->events = EPOLLIN | EPOLLRDHUP;
      watch(fd, c->events);
      conns_.emplace(fd, std::move(c));
    }
  }

  static HttpResponse error_response(int status, const std::string& message) {
    HttpResponse r;
    r.status = status;
    r.content_type = "application/json";
    r.body = nlohmann::json{{"error", {{"message", message}, {"type", "invalid_request_error"}, {"param", nullptr},
                                        {"code", nullptr}}}}
                 .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    r.close = true;
    if (status == 503) r.headers.emplace_back("Retry-After", "1");
    return r;
  }

  static std::string response_text(const HttpResponse& r, int minor, bool head_only, std::string_view cors = {}) {
    const bool has_body = !(r.status == 204 || r.status == 304 || r.status < 200);
    std::string s = response_head(r.status, minor, r.content_type, r.headers,
                                  has_body ? std::optional<std::size_t>(r.body.size()) : std::nullopt, false, r.close, cors);
    if (has_body && !head_only) s += r.body;
    return s;
  }

  void release_body(Conn& c) {
    buffered_body_ -= c.counted_body;
    c.counted_body = 0;
  }

  void close_conn(int fd) {
    const auto it = conns_.find(fd);
    if (it == conns_.end()) return;
    release_body(*it->second);
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
    conns_.erase(it);
  }

  void on_event(Conn& c, uint32_t ev, Clock::time_point now) {
    if (c.phase == Conn::Phase::writing) {
      if (ev & (EPOLLERR | EPOLLHUP)) {
        ++fail_.reset;
        return close_conn(c.fd);
      }
      return flush(c, now);
    }
    if (c.phase == Conn::Phase::draining) {  // discards what the client still sends, until it closes
      char sink[16 << 10];
      const ssize_t n = ::recv(c.fd, sink, sizeof sink, 0);
      if (n > 0) c.drained += std::size_t(n);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR) || c.drained > (1u << 20)) close_conn(c.fd);
      return;
    }
    if (ev & EPOLLERR) {
      if (c.parser.started()) ++fail_.reset;
      return close_conn(c.fd);
    }
    // Read what is there, at most 256 KiB per wake-up so one fast client cannot starve the others.
    char buf[64 << 10];
    for (int round = 0; round < 4; ++round) {
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        if (c.parser.started()) {
          if (n == 0) ++fail_.closed_early;
          else ++fail_.reset;
        }
        return close_conn(c.fd);
      }
      if (n < 0) break;
      if (!consume(c, std::string_view(buf, std::size_t(n)), now)) return;
      if (std::size_t(n) < sizeof buf) break;
    }
  }

  // Feeds bytes to the connection's parser and acts on its state. False when the connection left the
  // reading phase (closed, dispatched or answering).
  bool consume(Conn& c, std::string_view data, Clock::time_point now) {
    if (c.phase == Conn::Phase::idle) {  // the first byte of a kept-alive connection's next request
      c.phase = Conn::Phase::reading;
      c.started = now;
      c.head_deadline = c.deadline = now + o_.limits.head_timeout;
    }
    const std::size_t before = c.parser.body_received();
    RequestParser::State st = c.parser.feed(data);
    return after_feed(c, st, before, now);
  }

  bool after_feed(Conn& c, RequestParser::State st, std::size_t body_before, Clock::time_point now) {
    using State = RequestParser::State;
    if (st == State::failed) {
      ++fail_.malformed;
      respond_inline(c, error_response(c.parser.status(), c.parser.error()), 1, false, now, {});
      return false;
    }
    if (st == State::body || st == State::done) {
      const std::size_t grown = c.parser.body_received() - body_before;
      if (grown > 0) {
        if (buffered_body_ + grown > kMaxBufferedBody) {
          ++fail_.busy;
          respond_inline(c, error_response(503, "the server is receiving too many request bodies: try again later"),
                         c.parser.request().minor, false, now, {});
          return false;
        }
        buffered_body_ += grown;
        c.counted_body += grown;
      }
    }
    if (st == State::body) {
      if (!c.continue_sent) {  // the head just completed: the body's deadline, and 100 Continue if asked
        c.continue_sent = true;
        c.deadline = c.head_deadline + std::chrono::milliseconds(uint64_t(1000) * c.parser.content_length() /
                                                                 std::max<std::size_t>(1, o_.limits.body_min_rate));
        if (c.parser.request().expect_continue && c.parser.request().minor >= 1 && c.parser.body_received() == 0) {
          static constexpr char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";
          [[maybe_unused]] ssize_t w = ::send(c.fd, kContinue, sizeof kContinue - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
      }
      return true;
    }
    if (st != State::done) return true;
    c.continue_sent = false;
    HttpRequest q = c.parser.take();
    std::optional<HttpResponse> r;
    try {
      r = inline_(q);
    } catch (const std::exception& e) {
      r = error_response(500, printable(e.what()));
    }
    if (r) {
      release_body(c);
      if (!q.keep_alive) r->close = true;
      respond_inline(c, *r, q.minor, q.method == "HEAD", now, request_line(q), &q);
      return false;
    }
    {
      std::lock_guard lock(mu_);
      if (queue_.size() >= kMaxQueued) {
        ++fail_.busy;
        release_body(c);
        respond_inline(c, error_response(503, "the server is busy (" + std::to_string(kMaxQueued) +
                                                  " requests waiting): try again later"), q.minor, false, now, request_line(q), &q);
        return false;
      }
    }
    // To the pool: the loop forgets the connection until a handler gives it back.
    const int fd = c.fd;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    auto node = conns_.extract(fd);
    std::unique_ptr<Conn> owned = std::move(node.mapped());
    owned->events = 0;
    ++dispatched_;
    {
      std::lock_guard lock(mu_);
      queue_.push_back(Job{std::move(owned), std::move(q)});
    }
    cv_.notify_one();
    return false;
  }

  static std::string request_line(const HttpRequest& q) { return q.method + " " + printable(q.path); }

  // `q`: the request answered, when its head was parsed (its Origin decides CORS).
  void respond_inline(Conn& c, const HttpResponse& r, int minor, bool head_only, Clock::time_point now, std::string log,
                      const HttpRequest* q = nullptr) {
    c.out = response_text(r, minor, head_only, o_.cors.headers(q ? q->header("origin") : nullptr));
    c.out_at = 0;
    c.close_after = r.close || c.parser.state() == RequestParser::State::failed;
    // A refusal may come before the client has sent its body: closing with its bytes unread would reset the
    // connection and could destroy the response before the client reads it (RFC 9112 9.6, lingering close).
    c.drain = c.close_after && r.status >= 400;
    c.phase = Conn::Phase::writing;
    c.deadline = now + std::chrono::milliseconds(10'000);
    if (!log.empty() && o_.log_requests) {
      char b[64];
      std::snprintf(b, sizeof b, " %d %.1f ms", r.status, std::chrono::duration<double, std::milli>(now - c.started).count());
      c.log_line = log + b;
    }
    flush(c, now);
  }

  void flush(Conn& c, Clock::time_point now) {
    while (c.out_at < c.out.size()) {
      const ssize_t n = ::send(c.fd, c.out.data() + c.out_at, c.out.size() - c.out_at, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out_at += std::size_t(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        rewatch(c, EPOLLOUT | EPOLLRDHUP);
        return;
      }
      ++fail_.reset;
      return close_conn(c.fd);
    }
    if (!c.log_line.empty()) log("http " + c.log_line);
    c.log_line.clear();
    c.out.clear();
    c.out.shrink_to_fit();
    if (c.close_after && c.drain) {
      ::shutdown(c.fd, SHUT_WR);
      c.phase = Conn::Phase::draining;
      c.deadline = now + std::chrono::seconds(2);
      rewatch(c, EPOLLIN | EPOLLRDHUP);
      return;
    }
    if (c.close_after) return close_conn(c.fd);
    to_idle(c, now);
  }

  void to_idle(Conn& c, Clock::time_point now) {
    c.phase = Conn::Phase::idle;
    c.deadline = now + o_.limits.idle_timeout;
    rewatch(c, EPOLLIN | EPOLLRDHUP);
    if (c.parser.started()) {  // a pipelined request is already buffered
      c.phase = Conn::Phase::reading;
      c.started = now;
      c.head_deadline = c.deadline = now + o_.limits.head_timeout;
      const std::size_t before = c.parser.body_received();
      after_feed(c, c.parser.advance(), before, now);
    }
  }

  // Connections handed back by the handlers.
  void take_back(Clock::time_point now) {
    std::vector<std::unique_ptr<Conn>> back;
    {
      std::lock_guard lock(mu_);
      back.swap(returned_);
    }
    for (auto& c : back) {
      --dispatched_;
      const int fd = c->fd;
      c->events = EPOLLIN | EPOLLRDHUP;
      watch(fd, c->events);
      Conn& ref = *c;
      conns_.emplace(fd, std::move(c));
      to_idle(ref, now);
    }
  }

  void sweep(Clock::time_point now) {
    std::vector<int> expired;
    for (auto& [fd, c] : conns_)
      if (now >= c->deadline) expired.push_back(fd);
    for (int fd : expired) {
      Conn& c = *conns_.at(fd);
      if (c.phase == Conn::Phase::reading) {
        const bool in_body = c.parser.state() == RequestParser::State::body;
        ++(in_body ? fail_.body_timeout : fail_.head_timeout);
        const std::string r = response_text(
            error_response(408, in_body ? "the request body did not arrive in time (" + std::to_string(o_.limits.body_min_rate >> 10) +
                                              " KiB/s at least)"
                                        : "the request head did not arrive within " +
                                              std::to_string(o_.limits.head_timeout.count() / 1000) + " s"),
            1, false);
        [[maybe_unused]] ssize_t w = ::send(fd, r.data(), r.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      } else if (c.phase == Conn::Phase::writing) {
        ++fail_.write_timeout;
      }
      close_conn(fd);  // idle: a kept-alive connection unused for the idle timeout, closed quietly
    }
  }

  void summarize(double seconds) {
    if (!fail_.any()) return;
    std::string s;
    auto add = [&](std::size_t n, const char* what) {
      if (n) s += (s.empty() ? "" : ", ") + std::to_string(n) + " " + what;
    };
    add(fail_.head_timeout, "timed out in the request head");
    add(fail_.body_timeout, "timed out in the request body");
    add(fail_.malformed, "refused as malformed (400/411/413/414/417/431/505)");
    add(fail_.refused_full, "refused: too many connections");
    add(fail_.busy, "refused: busy (503)");
    add(fail_.reset, "reset or failed by the client");
    add(fail_.closed_early, "closed by the client mid-request");
    add(fail_.write_timeout, "timed out writing a response");
    char b[48];
    std::snprintf(b, sizeof b, "in the last %.1f s: ", seconds);
    log("warning: http connections " + std::string(b) + s + " (" + std::to_string(conns_.size() + dispatched_.load()) +
        " open)");
    fail_ = Failures{};
  }

  void log(const std::string& line) {
    if (!o_.log_requests && line.rfind("http ", 0) == 0) return;
    const std::string s = "pp_node: " + (line.rfind("warning:", 0) == 0 ? line : "info: " + line) + "\n";
    std::fwrite(s.data(), 1, s.size(), stderr);
  }

  void handler_loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_.load() || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      Conn& c = *job.conn;
      const std::string line = request_line(job.req);
      Responder res(c.fd, job.req, o_.limits.write_timeout, o_.cors.headers(job.req.header("origin")));
      if (stopping_.load()) {
        res.send(503, "application/json", error_response(503, "the server is shutting down").body);
      } else {
        try {
          handler_(job.req, res);
        } catch (const std::exception& e) {
          if (!res.started()) res.send(500, "application/json", error_response(500, printable(e.what())).body);
        }
        if (!res.started()) res.send(500, "application/json", error_response(500, "no response").body);
      }
      const std::size_t body_bytes = job.req.body.capacity();
      job.req = HttpRequest{};
      if (body_bytes >= (1u << 20)) trim_heap();  // a large body is freed: give its pages back
      if (o_.log_requests) {
        char b[64];
        std::snprintf(b, sizeof b, " %d %.1f ms", res.status(),
                      std::chrono::duration<double, std::milli>(Clock::now() - c.started).count());
        log("http " + line + b + (res.complete() ? "" : " (response not completed)"));
      }
      release_body(c);
      if (res.complete() && res.keep_alive() && !stopping_.load()) {
        {
          std::lock_guard lock(mu_);
          returned_.push_back(std::move(job.conn));
        }
        wake();
      } else {
        ::close(c.fd);
        --dispatched_;
      }
    }
  }

  // glibc keeps freed pages in its per-thread arenas; after a large body they go back to the system.
  static void trim_heap() { ::malloc_trim(0); }

  void join() {
    for (auto& t : pool_)
      if (t.joinable()) t.join();
    pool_.clear();
    std::lock_guard lock(mu_);
    for (auto& j : queue_) ::close(j.conn->fd);
    queue_.clear();
    for (auto& c : returned_) ::close(c->fd);
    returned_.clear();
  }

  Options o_;
  bool listening_ = false;
  int listen_fd_ = -1, epoll_fd_ = -1, wake_fd_ = -1;
  int port_ = 0;
  InlineRoute inline_;
  Handler handler_;
  std::unordered_map<int, std::unique_ptr<Conn>> conns_;  // the loop's connections (not those in handlers)
  std::atomic<std::size_t> dispatched_{0};
  std::atomic<std::size_t> buffered_body_{0};  // request body bytes held, read by the loop or waiting in handlers
  Failures fail_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::vector<std::unique_ptr<Conn>> returned_;
  std::vector<std::thread> pool_;
  std::atomic<bool> stopping_{false};
};

}  // namespace pp::node
