// libFuzzer target: request lines -> pp_worker's Server::handle, stub and real mode -> one well-formed reply each.
//
// The input is split into lines as pp_worker's LineReader does; every non-blank line goes through
// Server::handle (the function the serving loop calls: parse, validate, dispatch, encode) of four
// stub workers (first with a bf16 wire, middle f16, last bf16, last of two f16) and three real ones
// on golden-tiny-f32.gguf (first of two, middle of three, last of two; ctx 64, one thread). Each reply
// must be one JSON object line whose request_id echoes the request's, carrying either a result or
// an error that is not an escaped exception ("internal error", "out of memory"). Also checked:
// the hidden_b64 fast-path scanner agrees with the JSON parser, a successful hidden_b64 request
// padded past 64 KB (the raw path) gets the same reply, and base64 decoding is canonical.
#include "fuzz_common.hpp"

#include "worker/backend.hpp"
#include "worker/base64.hpp"
#include "worker/events.hpp"
#include "worker/line_io.hpp"
#include "worker/protocol.hpp"
#include "worker/real_backend.hpp"
#include "worker/server.hpp"
#include "worker/startup.hpp"
#include "worker/stub_backend.hpp"

#include <pp/core/error.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fcntl.h>

namespace {

namespace worker = pp::worker;
using pp::fuzz::fail;
using pp::WireDType;

struct Stage {
  std::unique_ptr<worker::Backend> backend;
  std::unique_ptr<worker::Server> server;
  int hidden_dim = 0;
  bool real = false;
};

struct World {
  worker::LineWriter sink{::open("/dev/null", O_WRONLY | O_CLOEXEC)};  // events only; handle() writes nothing
  worker::Events events{sink};
  worker::ServeStats stats;
  std::vector<Stage> stages;

  void add(const worker::WorkerConfig& cfg, std::unique_ptr<worker::Backend> backend) {
    Stage st;
    st.hidden_dim = backend->geometry().hidden_dim;
    st.real = !cfg.stub;
    st.backend = std::move(backend);
    st.server = std::make_unique<worker::Server>(*st.backend, cfg, sink, events, stats);
    stages.push_back(std::move(st));
  }

  World() {
    struct Shape {
      int stage, num_stages;
      WireDType dtype;
    };
    for (const Shape& s : {Shape{0, 3, WireDType::BF16}, Shape{1, 3, WireDType::F16},
                           Shape{2, 3, WireDType::BF16}, Shape{1, 2, WireDType::F16}}) {
      worker::WorkerConfig cfg;
      cfg.stage = s.stage, cfg.num_stages = s.num_stages, cfg.stub = true, cfg.wire_dtype = s.dtype;
      cfg.ctx = 256;  // small: a line can ask for ctx rows
      add(cfg, std::make_unique<worker::StubBackend>(cfg.stage, cfg.num_stages, *cfg.ctx, 0));
    }
    const std::string model = (pp::fuzz::test_data() / "golden-tiny" / "golden-tiny-f32.gguf").string();
    for (const Shape& s : {Shape{0, 2, WireDType::BF16}, Shape{1, 3, WireDType::F16},
                           Shape{1, 2, WireDType::BF16}}) {
      worker::WorkerConfig cfg;
      cfg.stage = s.stage, cfg.num_stages = s.num_stages, cfg.wire_dtype = s.dtype;
      cfg.ctx = 64, cfg.threads = 1;
      add(cfg, std::make_unique<worker::RealBackend>(cfg, model));
    }
  }
};

// Real mode runs a generate_full of max_tokens forward passes: keep those requests short.
// (max_tokens itself is bounded only by INT32_MAX: see docs/HARDENING.md, "Findings".)
bool too_slow_for_real_mode(std::string_view line) {
  const nlohmann::json doc = nlohmann::json::parse(line, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) return false;
  const auto op = doc.find("op");
  if (op == doc.end() || *op != "generate_full") return false;
  const auto max = doc.find("max_tokens");
  return max != doc.end() && max->is_number_integer() && max->get<int64_t>() > 16;
}

World& world() {
  static World w;
  return w;
}

void check_reply(std::string_view line, const std::string& reply, const worker::ordered_json& info, int hidden_dim) {
  if (reply.empty() || reply.back() != '\n' || reply.find('\n') != reply.size() - 1)
    fail("reply is not exactly one line", reply);
  nlohmann::json r;
  try {
    r = nlohmann::json::parse(std::string_view(reply).substr(0, reply.size() - 1));
  } catch (const nlohmann::json::exception&) {
    fail("reply is not JSON", reply);
  }
  if (!r.is_object() || !r.contains("request_id")) fail("reply is not an object with a request_id", reply);
  const nlohmann::json& id = r["request_id"];
  if (!id.is_null() && !id.is_number_integer()) fail("reply's request_id is neither null nor an integer", reply);
  const bool ok = info.value("ok", false);
  if (ok == r.contains("error")) fail("reply's error field disagrees with the outcome", reply);
  if (!ok) {
    if (!r["error"].is_string()) fail("reply's error is not a string", reply);
    const std::string& e = r["error"].get_ref<const std::string&>();
    if (e.rfind("internal error", 0) == 0 || e.rfind("out of memory", 0) == 0)
      fail("an unexpected exception escaped the request handling", std::string(line.substr(0, 2000)) + "\n" + reply);
  }
  // The request_id echo: when the line is an object with an integer request_id, the reply carries it.
  nlohmann::json req = nlohmann::json::parse(line, nullptr, false);
  if (!req.is_discarded() && req.is_object() && req.contains("request_id") && req["request_id"].is_number_integer() &&
      id != req["request_id"])
    fail("reply's request_id differs from the request's", reply);
  if (ok && r.contains("hidden_b64")) {
    const int64_t seq_len = r.value("seq_len", int64_t(-1));
    if (seq_len < 1 || !r["hidden_b64"].is_string() ||
        r["hidden_b64"].get_ref<const std::string&>().size() !=
            worker::base64::encoded_size(size_t(seq_len) * size_t(hidden_dim) * worker::kWireBytesPerValue))
      fail("hidden reply's size disagrees with its seq_len", reply);
  }
}

// The raw hidden_b64 scanner must agree with the JSON parser whenever both accept the line.
void check_raw_scanner(std::string_view line) {
  const std::optional<worker::RawSpan> raw = worker::find_raw_string_value(line, "hidden_b64");
  if (!raw) return;
  if (raw->begin > raw->end || raw->end > line.size()) fail("raw span outside the line");
  const nlohmann::json doc = nlohmann::json::parse(line, nullptr, false);
  if (doc.is_discarded()) return;  // the parser names the error; the raw path rechecks the line
  if (!doc.is_object()) fail("raw scanner found a field in a line that is not an object", line);
  const auto it = doc.find("hidden_b64");
  if (it == doc.end() || !it->is_string()) fail("raw scanner found a hidden_b64 the parser does not see", line);
  if (it->get_ref<const std::string&>() != line.substr(raw->begin, raw->end - raw->begin))
    fail("raw scanner's hidden_b64 differs from the parser's", line);
}

// Canonical base64: whatever decodes re-encodes to the same text.
void check_base64(std::string_view s) {
  std::string bytes;
  try {
    bytes = worker::base64::decode(s);
  } catch (const worker::base64::Base64Error&) {
    return;
  }
  if (worker::base64::encode(bytes) != s) fail("base64 decode accepted a non-canonical encoding", s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  World& w = world();
  std::string_view input(reinterpret_cast<const char*>(data), size);
  check_base64(input);
  while (!input.empty()) {
    const std::size_t nl = input.find('\n');
    const std::string_view line = input.substr(0, nl);
    input = nl == std::string_view::npos ? std::string_view{} : input.substr(nl + 1);
    bool blank = true;
    for (char c : line) blank = blank && worker::is_ascii_space(c);
    if (blank) continue;
    check_raw_scanner(line);
    const bool skip_real = too_slow_for_real_mode(line);
    for (Stage& st : w.stages) {
      if (st.real && skip_real) continue;
      worker::OpTiming t;
      worker::ordered_json info = {{"op", nullptr}};
      const std::string reply = st.server->handle(line, t, info);
      check_reply(line, reply, info, st.hidden_dim);
      // The same request padded past kRawFieldMinLine takes the raw hidden_b64 path (stub stages are
      // stateless, so the answer must not change).
      if (!st.real && info.value("ok", false) && line.find("hidden_b64") != std::string_view::npos &&
          line.size() < worker::kRawFieldMinLine) {
        std::string padded(line);
        padded.resize(worker::kRawFieldMinLine, ' ');
        worker::ordered_json info2 = {{"op", nullptr}};
        if (st.server->handle(padded, t, info2) != reply) fail("the raw hidden_b64 path answers differently", line);
      }
    }
  }
  return 0;
}
