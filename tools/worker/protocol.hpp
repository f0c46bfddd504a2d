// pp_worker requests: parse one JSON line and validate it against the stage's role and geometry.
#pragma once

#include "backend.hpp"

#include <pp/core/error.hpp>
#include <pp/model/layer_range.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pp::worker {

enum class Op { tokenize, embed_and_forward, decode_step, forward_range, forward_and_sample, detokenize, generate_full };

inline constexpr Op kAllOps[] = {Op::tokenize,           Op::embed_and_forward, Op::decode_step, Op::forward_range,
                                 Op::forward_and_sample, Op::detokenize,        Op::generate_full};

inline const char* op_name(Op op) {
  switch (op) {
    case Op::tokenize: return "tokenize";
    case Op::embed_and_forward: return "embed_and_forward";
    case Op::decode_step: return "decode_step";
    case Op::forward_range: return "forward_range";
    case Op::forward_and_sample: return "forward_and_sample";
    case Op::detokenize: return "detokenize";
    case Op::generate_full: return "generate_full";
  }
  return "?";
}

inline std::optional<Op> op_from_name(std::string_view name) {
  for (Op op : kAllOps)
    if (name == op_name(op)) return op;
  return std::nullopt;
}

// generate_full runs the whole model in one process, so every role serves it.
inline bool op_served_by(Op op, StageRole role) {
  switch (op) {
    case Op::tokenize:
    case Op::embed_and_forward:
    case Op::decode_step: return role == StageRole::first;
    case Op::forward_range: return role == StageRole::middle;
    case Op::forward_and_sample:
    case Op::detokenize: return role == StageRole::last;
    case Op::generate_full: return true;
  }
  return false;
}

inline const char* op_served_by_text(Op op) {
  switch (op) {
    case Op::tokenize:
    case Op::embed_and_forward:
    case Op::decode_step: return "the first stage (stage 0)";
    case Op::forward_range: return "middle stages (0 < stage < num_stages - 1)";
    case Op::forward_and_sample:
    case Op::detokenize: return "the last stage (stage num_stages - 1)";
    case Op::generate_full: return "every stage";
  }
  return "?";
}

// A request the worker refuses. request_id is the echo: the request's integer id, or null when the
// line has none (not JSON, not an object, missing or non-integer request_id).
class BadRequest : public RequestError {
 public:
  BadRequest(nlohmann::json request_id, const std::string& what, std::string op = "")
      : RequestError(what), request_id_(std::move(request_id)), op_(std::move(op)) {}
  const nlohmann::json& request_id() const { return request_id_; }
  const std::string& op() const { return op_; }  // empty until the op is known

 private:
  nlohmann::json request_id_;
  std::string op_;
};

// What validation checks against.
struct RequestLimits {
  int stage = 0;
  int num_stages = 2;
  int hidden_dim = 0;
  int vocab_size = 0;
  int64_t ctx = 0;                 // bounds seq_len and the tokens of embed_and_forward / generate_full
  bool check_token_range = false;  // ids must be < vocab_size (real mode)
};

// Positions are absolute; a bound keeps position + seq_len far from overflow in every consumer.
inline constexpr int64_t kMaxPosition = std::numeric_limits<int32_t>::max();
inline constexpr int64_t kMaxTokenId = std::numeric_limits<int32_t>::max();
// Lines at least this long try the raw hidden_b64 fast path (see find_raw_string_value).
inline constexpr size_t kRawFieldMinLine = 64 * 1024;

// One validated request. Only the fields of `op` are meaningful.
struct Request {
  Op op = Op::tokenize;
  nlohmann::json request_id;  // an integer

  std::string prompt;  // tokenize, generate_full
  bool has_prompt = false;
  std::optional<bool> add_bos;
  bool parse_special = true;
  std::vector<int32_t> tokens;  // embed_and_forward (non-empty), decode_step ([token_id]), detokenize, generate_full
  int64_t position = 0;
  int64_t seq_len = 0;          // rows of hidden_b64 (forward_range, forward_and_sample)
  std::string_view hidden_b64;  // into the request line (raw fast path) or into hidden_storage
  std::string hidden_storage;
  bool hidden_raw = false;  // hidden_b64 was cut out of the line without the JSON parser seeing it
  SamplingParams sampling;
  bool return_logits = false;
  bool keep_special = false;
  int32_t max_tokens = 0;
};

namespace detail {

inline const char* json_type(const nlohmann::json& v) {
  if (v.is_boolean()) return "boolean";
  if (v.is_number_integer()) return "integer";
  if (v.is_number_float()) return "number";
  return v.type_name();
}

// "boolean true", "string \"abc\"" (long values cut).
inline std::string describe(const nlohmann::json& v) {
  if (v.is_null()) return "null";
  std::string text = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  constexpr size_t kMax = 40;
  if (text.size() > kMax) text = text.substr(0, kMax) + "...";
  return std::string(json_type(v)) + " " + text;
}

// nlohmann's messages start with "[json.exception.parse_error.101] "; the class tag is noise here.
inline std::string strip_json_tag(const std::string& what) {
  if (!what.empty() && what[0] == '[') {
    const size_t close = what.find("] ");
    if (close != std::string::npos) return what.substr(close + 2);
  }
  return what;
}

inline bool is_json_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// From the opening quote at `i`: the index past the closing quote, or npos.
inline size_t skip_string(std::string_view s, size_t i) {
  for (++i; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
    } else if (s[i] == '"') {
      return i + 1;
    }
  }
  return std::string_view::npos;
}

// From the first character of a value: the index past it, or npos. Only structure is tracked; the
// JSON parser validates whatever this skips.
inline size_t skip_value(std::string_view s, size_t i) {
  if (i >= s.size()) return std::string_view::npos;
  if (s[i] == '"') return skip_string(s, i);
  if (s[i] == '{' || s[i] == '[') {
    int depth = 0;
    while (i < s.size()) {
      const char c = s[i];
      if (c == '"') {
        i = skip_string(s, i);
        if (i == std::string_view::npos) return i;
        continue;
      }
      if (c == '{' || c == '[') ++depth;
      if (c == '}' || c == ']') {
        if (--depth == 0) return i + 1;
      }
      ++i;
    }
    return std::string_view::npos;
  }
  while (i < s.size() && s[i] != ',' && s[i] != '}' && s[i] != ']' && !is_json_ws(s[i])) ++i;
  return i;
}

}  // namespace detail

// The contents [begin, end) of the string value of top-level `key`, when the line is an object
// whose structure this scanner follows, the key occurs once (unescaped) and the value holds no
// backslash. A 22 MB hidden_b64 then never goes through the JSON lexer (~150 MB/s): the rest of the
// line, with the value emptied, is parsed as usual, and base64 decoding checks the characters.
struct RawSpan {
  size_t begin = 0;
  size_t end = 0;
};

inline std::optional<RawSpan> find_raw_string_value(std::string_view s, std::string_view key) {
  using detail::is_json_ws;
  size_t i = 0;
  auto ws = [&] {
    while (i < s.size() && is_json_ws(s[i])) ++i;
  };
  ws();
  if (i >= s.size() || s[i] != '{') return std::nullopt;
  ++i;
  std::optional<RawSpan> found;
  while (true) {
    ws();
    if (i >= s.size() || s[i] != '"') return std::nullopt;
    const size_t key_end = detail::skip_string(s, i);
    if (key_end == std::string_view::npos) return std::nullopt;
    const std::string_view k = s.substr(i + 1, key_end - i - 2);
    if (k.find('\\') != std::string_view::npos) return std::nullopt;
    i = key_end;
    ws();
    if (i >= s.size() || s[i] != ':') return std::nullopt;
    ++i;
    ws();
    if (k == key) {
      if (found || i >= s.size() || s[i] != '"') return std::nullopt;
      const void* close = std::memchr(s.data() + i + 1, '"', s.size() - i - 1);
      if (!close) return std::nullopt;
      const size_t end = size_t(static_cast<const char*>(close) - s.data());
      if (std::memchr(s.data() + i + 1, '\\', end - i - 1)) return std::nullopt;
      found = RawSpan{i + 1, end};
      i = end + 1;
    } else {
      i = detail::skip_value(s, i);
      if (i == std::string_view::npos) return std::nullopt;
    }
    ws();
    if (i >= s.size()) return std::nullopt;
    if (s[i] == ',') {
      ++i;
      continue;
    }
    if (s[i] == '}') break;
    return std::nullopt;
  }
  ++i;
  ws();
  if (i != s.size()) return std::nullopt;  // trailing bytes: let the parser name them
  return found;
}

// Field readers: each throws BadRequest("<op>: field '<name>' ...") naming the value and the limit.
class FieldReader {
 public:
  FieldReader(const nlohmann::json& doc, const nlohmann::json& request_id, Op op)
      : doc_(doc), id_(request_id), op_(op) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw BadRequest(id_, std::string(op_name(op_)) + ": " + what, op_name(op_));
  }

  // Absent or null: nullptr (null counts as absent only for optional fields).
  const nlohmann::json* find(const char* name) const {
    const auto it = doc_.find(name);
    if (it == doc_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  const nlohmann::json& require(const char* name, const char* what) const {
    const auto it = doc_.find(name);
    if (it == doc_.end()) fail(std::string("missing field '") + name + "' (" + what + ")");
    return *it;
  }

  int64_t integer(const nlohmann::json& v, const std::string& name, int64_t lo, int64_t hi,
                  const std::string& hi_reason = "") const {
    if (!v.is_number_integer()) fail("field '" + name + "' must be an integer, got " + detail::describe(v));
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi))
      fail("field '" + name + "' is " + v.dump() + ", must be <= " + std::to_string(hi) + reason(hi_reason));
    const int64_t x = v.get<int64_t>();
    if (x < lo) fail("field '" + name + "' is " + std::to_string(x) + ", must be >= " + std::to_string(lo));
    if (x > hi)
      fail("field '" + name + "' is " + std::to_string(x) + ", must be <= " + std::to_string(hi) + reason(hi_reason));
    return x;
  }

  int64_t required_int(const char* name, int64_t lo, int64_t hi, const std::string& hi_reason = "") const {
    return integer(require(name, "an integer"), name, lo, hi, hi_reason);
  }

  int64_t optional_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) const {
    const nlohmann::json* v = find(name);
    return v ? integer(*v, name, lo, hi) : fallback;
  }

  std::optional<bool> optional_bool(const char* name) const {
    const nlohmann::json* v = find(name);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) fail(std::string("field '") + name + "' must be a boolean, got " + detail::describe(*v));
    return v->get<bool>();
  }

  std::string string(const nlohmann::json& v, const char* name) const {
    if (!v.is_string()) fail(std::string("field '") + name + "' must be a string, got " + detail::describe(v));
    return v.get<std::string>();
  }

  // A number (integer or float, never a boolean), finite.
  std::optional<double> optional_number(const char* name) const {
    const nlohmann::json* v = find(name);
    if (!v) return std::nullopt;
    if (!v->is_number()) fail(std::string("field '") + name + "' must be a number, got " + detail::describe(*v));
    const double x = v->get<double>();
    if (!std::isfinite(x)) fail(std::string("field '") + name + "' must be finite");
    return x;
  }

  // A list of ids, each in [0, max_id]; `max_reason` names where max_id comes from.
  std::vector<int32_t> token_list(const nlohmann::json& v, const char* name, int64_t max_id,
                                  const std::string& max_reason) const {
    if (!v.is_array()) fail(std::string("field '") + name + "' must be a list of integers, got " + detail::describe(v));
    std::vector<int32_t> ids;
    ids.reserve(v.size());
    for (size_t k = 0; k < v.size(); ++k)
      ids.push_back(int32_t(integer(v[k], std::string(name) + "[" + std::to_string(k) + "]", 0, max_id, max_reason)));
    return ids;
  }

 private:
  static std::string reason(const std::string& r) { return r.empty() ? "" : " (" + r + ")"; }

  const nlohmann::json& doc_;
  const nlohmann::json& id_;
  Op op_;
};

// Parses one request line and validates it against `limits`. Throws BadRequest.
inline Request parse_request(std::string_view line, const RequestLimits& limits) {
  const nlohmann::json null_id;
  std::optional<RawSpan> raw;
  std::string cut;  // the line without the raw hidden_b64 contents
  if (line.size() >= kRawFieldMinLine) {
    raw = find_raw_string_value(line, "hidden_b64");
    if (raw) {
      cut.reserve(line.size() - (raw->end - raw->begin));
      cut.append(line.substr(0, raw->begin)).append(line.substr(raw->end));
    }
  }
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(raw ? std::string_view(cut) : line);
  } catch (const nlohmann::json::exception& e) {
    throw BadRequest(null_id, "request is not JSON: " + detail::strip_json_tag(e.what()));
  }
  if (!doc.is_object())
    throw BadRequest(null_id, std::string("request is not a JSON object, got ") + detail::describe(doc));

  Request req;
  const auto rid = doc.find("request_id");
  if (rid == doc.end()) throw BadRequest(null_id, "missing field 'request_id' (an integer)");
  if (!rid->is_number_integer())
    throw BadRequest(null_id, "field 'request_id' must be an integer, got " + detail::describe(*rid));
  req.request_id = *rid;

  const auto op_it = doc.find("op");
  if (op_it == doc.end()) throw BadRequest(req.request_id, "missing field 'op' (a string)");
  if (!op_it->is_string())
    throw BadRequest(req.request_id, "field 'op' must be a string, got " + detail::describe(*op_it));
  const std::string& op_text = op_it->get_ref<const std::string&>();
  const std::optional<Op> op = op_from_name(op_text);
  if (!op) {
    std::string known;
    for (Op o : kAllOps) known += std::string(known.empty() ? "" : ", ") + op_name(o);
    throw BadRequest(req.request_id, "unknown op " + nlohmann::json(op_text).dump(-1, ' ', false,
                                                                                   nlohmann::json::error_handler_t::replace) +
                                         " (ops: " + known + ")");
  }
  req.op = *op;
  const StageRole role = stage_role(limits.stage, limits.num_stages);
  if (!op_served_by(req.op, role))
    throw BadRequest(req.request_id, std::string("op '") + op_name(req.op) + "' is not served by stage " +
                                         std::to_string(limits.stage) + " (role " + role_name(role) + ", " +
                                         std::to_string(limits.num_stages) + " stages); it runs on " +
                                         op_served_by_text(req.op),
                     op_name(req.op));

  const FieldReader f(doc, req.request_id, req.op);
  const std::string ctx_reason = "ctx, the KV capacity";
  const int64_t max_id = limits.check_token_range ? limits.vocab_size - 1 : kMaxTokenId;
  const std::string id_reason = limits.check_token_range ? "vocab_size " + std::to_string(limits.vocab_size) + " - 1"
                                                         : "int32 token ids";
  auto check_last_position = [&](int64_t n) {
    if (req.position + n - 1 > kMaxPosition)
      f.fail("rows at positions " + std::to_string(req.position) + ".." + std::to_string(req.position + n - 1) +
             " exceed the largest position " + std::to_string(kMaxPosition));
  };
  auto read_hidden = [&] {
    const nlohmann::json& v = f.require("hidden_b64", "a base64 string");
    if (!v.is_string()) f.fail("field 'hidden_b64' must be a string, got " + detail::describe(v));
    if (raw) {
      req.hidden_raw = true;
      req.hidden_b64 = line.substr(raw->begin, raw->end - raw->begin);
    } else {
      req.hidden_storage = v.get<std::string>();
      req.hidden_b64 = req.hidden_storage;
    }
    req.seq_len = f.required_int("seq_len", 1, limits.ctx, ctx_reason);
  };

  switch (req.op) {
    case Op::tokenize:
      req.prompt = f.string(f.require("prompt", "a string"), "prompt");
      req.has_prompt = true;
      req.add_bos = f.optional_bool("add_bos");
      req.parse_special = f.optional_bool("parse_special").value_or(true);
      break;
    case Op::embed_and_forward:
      req.tokens = f.token_list(f.require("tokens", "a non-empty list of token ids"), "tokens", max_id, id_reason);
      if (req.tokens.empty()) f.fail("field 'tokens' is empty, must hold at least 1 token id");
      if (int64_t(req.tokens.size()) > limits.ctx)
        f.fail("field 'tokens' holds " + std::to_string(req.tokens.size()) + " ids, must be <= " +
               std::to_string(limits.ctx) + " (" + ctx_reason + ")");
      req.position = f.optional_int("position", 0, 0, kMaxPosition);
      check_last_position(int64_t(req.tokens.size()));
      break;
    case Op::decode_step:
      req.tokens = {int32_t(f.required_int("token_id", 0, max_id, id_reason))};
      req.position = f.required_int("position", 0, kMaxPosition);
      break;
    case Op::forward_range:
      req.position = f.required_int("position", 0, kMaxPosition);
      read_hidden();
      check_last_position(req.seq_len);
      break;
    case Op::forward_and_sample: {
      req.position = f.required_int("position", 0, kMaxPosition);
      read_hidden();
      check_last_position(req.seq_len);
      SamplingParams& s = req.sampling;
      s.temperature = f.optional_number("temperature");
      if (s.temperature && !(*s.temperature > 0))
        f.fail("field 'temperature' is " + nlohmann::json(*s.temperature).dump() + ", must be > 0");
      if (const nlohmann::json* k = f.find("top_k"))
        s.top_k = f.integer(*k, "top_k", 1, std::numeric_limits<int64_t>::max());
      s.top_p = f.optional_number("top_p");
      if (s.top_p && !(*s.top_p > 0 && *s.top_p <= 1))
        f.fail("field 'top_p' is " + nlohmann::json(*s.top_p).dump() + ", must be in (0, 1]");
      s.min_p = f.optional_number("min_p");
      if (s.min_p && !(*s.min_p >= 0 && *s.min_p < 1))
        f.fail("field 'min_p' is " + nlohmann::json(*s.min_p).dump() + ", must be in [0, 1)");
      if (const nlohmann::json* seed = f.find("seed")) {
        if (!seed->is_number_integer())
          f.fail("field 'seed' must be an unsigned 64-bit integer, got " + detail::describe(*seed));
        if (seed->is_number_unsigned()) {
          s.seed = seed->get<uint64_t>();
        } else {
          const int64_t x = seed->get<int64_t>();
          if (x < 0) f.fail("field 'seed' is " + std::to_string(x) + ", must be >= 0");
          s.seed = uint64_t(x);
        }
      }
      req.return_logits = f.optional_bool("return_logits").value_or(false);
      break;
    }
    case Op::detokenize:
      req.tokens = f.token_list(f.require("tokens", "a list of token ids"), "tokens", max_id, id_reason);
      req.keep_special = f.optional_bool("keep_special").value_or(false);
      break;
    case Op::generate_full: {
      const nlohmann::json* prompt = f.find("prompt");
      const nlohmann::json* tokens = f.find("tokens");
      if (prompt && tokens) f.fail("give 'prompt' or 'tokens', not both");
      if (!prompt && !tokens) f.fail("missing field 'prompt' (a string) or 'tokens' (a list of token ids)");
      if (prompt) {
        req.prompt = f.string(*prompt, "prompt");
        req.has_prompt = true;
      } else {
        req.tokens = f.token_list(*tokens, "tokens", max_id, id_reason);
        if (req.tokens.empty()) f.fail("field 'tokens' is empty, must hold at least 1 token id");
        if (int64_t(req.tokens.size()) > limits.ctx)
          f.fail("field 'tokens' holds " + std::to_string(req.tokens.size()) + " ids, must be <= " +
                 std::to_string(limits.ctx) + " (" + ctx_reason + ")");
      }
      req.max_tokens = int32_t(f.required_int("max_tokens", 1, std::numeric_limits<int32_t>::max()));
      break;
    }
  }
  return req;
}

// When hidden_b64 took the raw path and then failed to decode, the line may not even be JSON (a
// control character inside the value): report that as the JSON parser would have.
inline void recheck_raw_line(std::string_view line) {
  if (!nlohmann::json::accept(line)) {
    try {
      const nlohmann::json unused = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw BadRequest(nlohmann::json(), "request is not JSON: " + detail::strip_json_tag(e.what()));
    }
  }
}

}  // namespace pp::worker
