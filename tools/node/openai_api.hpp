// The OpenAI-compatible request and response bodies of pp_node --serve: parsing, validation, JSON and SSE chunks.
//
// Requests are validated before anything runs; every refusal is an ApiError with an HTTP status and an
// OpenAI-style body ({"error": {"message", "type", "param", "code"}}). Fields pp does not know are
// ignored; fields it knows but cannot honour are refused when they ask for something (n > 1, logprobs,
// echo, penalties other than 0, a logit bias, tools, a JSON response format), and accepted at their
// neutral value, which common clients send by default.
//
// A body is checked against JsonLimits (nesting depth, number length, value count) by a scan of its bytes
// before any DOM is built, then parsed once. Every failure a client can cause is an ApiError with a 4xx:
// the JSON library's own exceptions (a parse error, a number out of range, a value of the wrong type) are
// turned into 400s that say what was wrong.
#pragma once

#include <cctype>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "node/chat_template.hpp"
#include "pp/net/coordinator/scheduler.hpp"
#include "pp/text/tokenizer.hpp"

namespace pp::node {

using json = nlohmann::json;

struct ApiError {
  int status = 400;
  std::string message;
  std::string param;                          // the offending field, when there is one
  std::string type = "invalid_request_error";
  std::string code;
};

inline json error_body(const ApiError& e) {
  return json{{"error",
               {{"message", e.message},
                {"type", e.type},
                {"param", e.param.empty() ? json(nullptr) : json(e.param)},
                {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

// What the server knows when it parses a request.
struct ApiContext {
  const Tokenizer* tok = nullptr;        // null: the model has no usable tokenizer (token-id prompts only)
  std::string tok_error;
  std::optional<ChatTemplate> chat;      // null: chat is refused with chat_why
  std::string chat_why;
  uint32_t ctx = 0;
  std::size_t n_vocab = 0;
};

struct ApiRequest {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;   // stream_options.include_usage: a last chunk with the usage
  bool return_tokens = false;   // pp extension: each choice (and chunk) also carries "tokens": [ids]
  bool parse_special = false;   // pp extension (completions): special-token texts in the prompt become their ids
  std::vector<int32_t> prompt;
  net::GenParams gen;
};

// What a request body may hold, checked on its bytes before it is parsed (a DOM of an 8 MiB body of
// nested arrays or small numbers would take hundreds of MB).
struct JsonLimits {
  std::size_t max_depth = 64;          // nested arrays and objects
  std::size_t max_number_chars = 64;   // one number literal
  std::size_t max_values = 1u << 18;   // values and keys in all (a token-id prompt of 256 Ki tokens fits)
};

namespace api_detail {

inline ApiError bad(std::string param, std::string message, std::string code = {}) {
  ApiError e;
  e.param = std::move(param);
  e.message = std::move(message);
  e.code = std::move(code);
  return e;
}

inline std::optional<double> number(const json& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) throw bad(key, std::string("'") + key + "' must be a number, got " + it->dump());
  const double v = it->get<double>();
  if (!std::isfinite(v)) throw bad(key, std::string("'") + key + "' must be finite");
  return v;
}

inline std::optional<int64_t> integer(const json& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (it->is_number_unsigned()) {
    if (it->get<uint64_t>() > uint64_t(INT64_MAX)) throw bad(key, std::string("'") + key + "' is too large");
    return int64_t(it->get<uint64_t>());
  }
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_number_float() && std::floor(it->get<double>()) == it->get<double>() && std::abs(it->get<double>()) < 9e15)
    return int64_t(it->get<double>());
  throw bad(key, std::string("'") + key + "' must be an integer, got " + it->dump());
}

inline std::optional<bool> boolean(const json& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) throw bad(key, std::string("'") + key + "' must be true or false, got " + it->dump());
  return it->get<bool>();
}

// A field accepted only at its neutral value (what clients send when they do not use the feature).
inline void refuse_unless_neutral(const json& body, const char* key, const char* what) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return;
  const bool neutral = (it->is_boolean() && !it->get<bool>()) || (it->is_number() && it->get<double>() == 0.0) ||
                       (it->is_object() && it->empty()) || (it->is_array() && it->empty()) ||
                       (it->is_string() && it->get<std::string>().empty());
  if (!neutral) throw bad(key, std::string(what) + " is not supported by this server ('" + key + "': " +
                                   it->dump().substr(0, 80) + ")", "unsupported_parameter");
}

inline std::vector<int32_t> token_ids(const json& a, const ApiContext& c, const char* param) {
  std::vector<int32_t> out;
  for (const json& t : a) {
    if (!t.is_number_integer()) throw bad(param, "a token-id prompt must contain integers only");
    const int64_t v = t.get<int64_t>();
    if (v < 0 || uint64_t(v) >= c.n_vocab)
      throw bad(param, "token id " + std::to_string(v) + " is outside the vocabulary [0, " + std::to_string(c.n_vocab) + ")");
    out.push_back(int32_t(v));
  }
  return out;
}

// {"type": "text", ...}: an object whose "type" is the string "text" (anything else, of any type, is not).
inline bool has_text_type(const json& v) {
  if (!v.is_object()) return false;
  const auto t = v.find("type");
  return t != v.end() && t->is_string() && t->get_ref<const std::string&>() == "text";
}

inline const Tokenizer& need_tokenizer(const ApiContext& c, const char* param) {
  if (!c.tok) throw bad(param, "the model has no usable tokenizer (" + c.tok_error + "): send the prompt as token ids");
  return *c.tok;
}

// The completions prompt: a string, token ids, or a one-element array of either. A string's special-token
// texts ("<|eot_id|>") are plain text unless parse_special.
inline std::vector<int32_t> completion_prompt(const json& body, const ApiContext& c, bool parse_special) {
  const auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) throw bad("prompt", "'prompt' is required");
  json p = *it;
  if (p.is_array() && !p.empty() && (p[0].is_string() || p[0].is_array())) {
    if (p.size() > 1)
      throw bad("prompt", "several prompts in one request are not supported: send one request per prompt",
                "unsupported_parameter");
    p = json(p[0]);
  }
  if (p.is_string()) {
    const Tokenizer& tok = need_tokenizer(c, "prompt");
    return tok.encode(p.get<std::string>(), tok.add_bos(), parse_special);
  }
  if (p.is_array()) return token_ids(p, c, "prompt");
  throw bad("prompt", "'prompt' must be a string or an array of token ids");
}

inline std::string message_content(const json& m, std::size_t i) {
  const std::string where = "messages[" + std::to_string(i) + "].content";
  const auto it = m.find("content");
  if (it == m.end() || it->is_null()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    std::string out;
    for (const json& part : *it) {
      if (!has_text_type(part) || !part.contains("text") || !part["text"].is_string())
        throw bad(where, where + ": only text parts ({\"type\": \"text\", \"text\": ...}) are supported",
                  "unsupported_parameter");
      if (!out.empty()) out += "\n";
      out += part["text"].get<std::string>();
    }
    return out;
  }
  throw bad(where, where + " must be a string or an array of text parts");
}

inline std::vector<int32_t> chat_prompt(const json& body, const ApiContext& c) {
  const auto it = body.find("messages");
  if (it == body.end() || !it->is_array() || it->empty())
    throw bad("messages", "'messages' must be a non-empty array of {\"role\", \"content\"} objects");
  if (!c.chat) throw bad("messages", "chat is not available for this model: " + c.chat_why, "unsupported_model");
  const Tokenizer& tok = need_tokenizer(c, "messages");
  std::vector<ChatMessage> msgs;
  for (std::size_t i = 0; i < it->size(); ++i) {
    const json& m = (*it)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw bad(where, where + " must be an object with a string 'role'");
    std::string role = m["role"].get<std::string>();
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant")
      throw bad(where + ".role", where + ".role '" + role + "' is not supported (system, user, assistant)",
                "unsupported_parameter");
    if (m.contains("tool_calls") && !m["tool_calls"].is_null() && !m["tool_calls"].empty())
      throw bad(where + ".tool_calls", "tool calls are not supported", "unsupported_parameter");
    msgs.push_back(ChatMessage{role, message_content(m, i)});
  }
  const std::string bos = bos_text(tok);
  return encode_chat(tok, render_chat_pieces(*c.chat, msgs, bos));
}

// The JSON library's message without its "[json.exception.type.N] " prefix.
inline std::string json_what(const json::exception& e) {
  std::string w = e.what();
  if (w.rfind("[json.exception.", 0) == 0)
    if (const std::size_t sp = w.find("] "); sp != std::string::npos) w.erase(0, sp + 2);
  return w;
}

}  // namespace api_detail

// Refuses (400, naming the limit) a body past `lim`, from its bytes: nesting, number literals, values.
// Strings are skipped with their escapes; anything that is not JSON is left for the parser to refuse.
inline void check_json_limits(std::string_view text, const JsonLimits& lim = {}) {
  using api_detail::bad;
  std::size_t depth = 0, values = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '"') {
      ++values;
      for (++i; i < text.size() && text[i] != '"'; ++i)
        if (text[i] == '\\') ++i;
    } else if (ch == '[' || ch == '{') {
      ++values;
      if (++depth > lim.max_depth)
        throw bad("", "the request body nests arrays and objects deeper than the limit of " +
                          std::to_string(lim.max_depth) + " levels", "json_too_deep");
    } else if (ch == ']' || ch == '}') {
      if (depth > 0) --depth;
    } else if (ch == '-' || (ch >= '0' && ch <= '9')) {
      const std::size_t start = i;
      while (i + 1 < text.size() && (std::isdigit(static_cast<unsigned char>(text[i + 1])) || text[i + 1] == '.' ||
                                     text[i + 1] == 'e' || text[i + 1] == 'E' || text[i + 1] == '+' || text[i + 1] == '-'))
        ++i;
      ++values;
      if (i - start + 1 > lim.max_number_chars)
        throw bad("", "a number in the request body is " + std::to_string(i - start + 1) + " characters long; the limit is " +
                          std::to_string(lim.max_number_chars), "json_number_too_long");
    } else if (ch == 't' || ch == 'f' || ch == 'n') {
      ++values;
      while (i + 1 < text.size() && std::isalpha(static_cast<unsigned char>(text[i + 1]))) ++i;
    } else {
      continue;
    }
    if (values > lim.max_values)
      throw bad("", "the request body has more JSON values than the limit of " + std::to_string(lim.max_values),
                "json_too_large");
  }
}

inline ApiRequest parse_request_json(const json& body, bool chat, const ApiContext& c);

// Parses and validates one /v1/completions (chat = false) or /v1/chat/completions body.
inline ApiRequest parse_request(std::string_view text, bool chat, const ApiContext& c) {
  using namespace api_detail;
  if (text.find_first_not_of(" \t\r\n") == std::string_view::npos)
    throw bad("", "the request body is empty: send a JSON object", "invalid_json");
  check_json_limits(text);
  json body;
  try {
    body = json::parse(text);
  } catch (const json::out_of_range& e) {
    throw bad("", "a number in the request body is out of range: " + json_what(e), "invalid_json");
  } catch (const json::exception& e) {
    throw bad("", "invalid JSON in the request body: " + json_what(e), "invalid_json");
  }
  try {
    return parse_request_json(body, chat, c);
  } catch (const json::exception& e) {  // a check above missed a type: still the client's error
    throw bad("", "a field of the request has the wrong type or value: " + json_what(e));
  }
}

inline ApiRequest parse_request_json(const json& body, bool chat, const ApiContext& c) {
  using namespace api_detail;
  if (!body.is_object()) throw bad("", "the request body must be a JSON object");
  if (const auto it = body.find("model"); it != body.end() && !it->is_null() && !it->is_string())
    throw bad("model", "'model' must be a string");

  ApiRequest r;
  r.chat = chat;
  r.stream = boolean(body, "stream").value_or(false);
  if (const auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) throw bad("stream_options", "'stream_options' must be an object");
    r.include_usage = boolean(*it, "include_usage").value_or(false);
  }
  r.return_tokens = boolean(body, "return_tokens").value_or(false);
  r.parse_special = boolean(body, "parse_special").value_or(false);
  r.gen.ignore_eos = boolean(body, "ignore_eos").value_or(false);

  if (const auto n = integer(body, "n")) {
    if (*n < 1) throw bad("n", "'n' must be >= 1, got " + std::to_string(*n));
    if (*n > 1) throw bad("n", "n > 1 is not supported (one choice per request): send several requests", "unsupported_parameter");
  }
  if (const auto n = integer(body, "best_of"); n && *n != 1)
    throw bad("best_of", "best_of other than 1 is not supported", "unsupported_parameter");
  refuse_unless_neutral(body, "logprobs", "logprobs");
  refuse_unless_neutral(body, "top_logprobs", "top_logprobs");
  refuse_unless_neutral(body, "echo", "echo");
  refuse_unless_neutral(body, "suffix", "suffix");
  refuse_unless_neutral(body, "presence_penalty", "a presence penalty");
  refuse_unless_neutral(body, "frequency_penalty", "a frequency penalty");
  refuse_unless_neutral(body, "logit_bias", "logit_bias");
  refuse_unless_neutral(body, "tools", "tool calling");
  refuse_unless_neutral(body, "functions", "function calling");
  if (const auto it = body.find("response_format"); it != body.end() && !it->is_null()) {
    if (!has_text_type(*it))
      throw bad("response_format", "only response_format {\"type\": \"text\"} is supported", "unsupported_parameter");
  }

  SamplingParams& sp = r.gen.sampling;
  const std::optional<double> temperature = number(body, "temperature");
  if (temperature && !(*temperature >= 0.0 && *temperature <= 2.0))
    throw bad("temperature", "'temperature' must be in [0, 2], got " + json(*temperature).dump());
  const std::optional<double> top_p = number(body, "top_p");
  if (top_p && !(*top_p > 0.0 && *top_p <= 1.0)) throw bad("top_p", "'top_p' must be in (0, 1], got " + json(*top_p).dump());
  const std::optional<int64_t> top_k = integer(body, "top_k");
  if (top_k && *top_k < -1) throw bad("top_k", "'top_k' must be >= 1 (0 or -1: off), got " + std::to_string(*top_k));
  const std::optional<double> min_p = number(body, "min_p");
  if (min_p && !(*min_p >= 0.0 && *min_p < 1.0)) throw bad("min_p", "'min_p' must be in [0, 1), got " + json(*min_p).dump());
  // OpenAI's defaults: temperature 1, top_p 1; temperature 0 is argmax.
  if (temperature.value_or(1.0) > 0.0) {
    sp.temperature = temperature.value_or(1.0);
    if (top_p && *top_p < 1.0) sp.top_p = top_p;
    if (top_k && *top_k > 0) sp.top_k = top_k;
    if (min_p && *min_p > 0.0) sp.min_p = min_p;
  }
  if (const auto it = body.find("seed"); it != body.end() && !it->is_null()) {
    if (it->is_number_unsigned()) sp.seed = it->get<uint64_t>();
    else if (it->is_number_integer()) sp.seed = uint64_t(it->get<int64_t>());
    else throw bad("seed", "'seed' must be an integer, got " + it->dump());
  } else {
    sp.seed = std::random_device{}() | (uint64_t(std::random_device{}()) << 32);  // OpenAI: unseeded draws differ
  }

  if (const auto it = body.find("stop"); it != body.end() && !it->is_null()) {
    if (it->is_string()) {
      r.gen.stop.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      if (it->size() > 4) throw bad("stop", "'stop' takes at most 4 strings, got " + std::to_string(it->size()));
      for (const json& s : *it) {
        if (!s.is_string()) throw bad("stop", "'stop' must be a string or an array of strings");
        r.gen.stop.push_back(s.get<std::string>());
      }
    } else {
      throw bad("stop", "'stop' must be a string or an array of strings");
    }
  }

  r.prompt = chat ? chat_prompt(body, c) : completion_prompt(body, c, r.parse_special);
  const std::size_t n = r.prompt.size();
  if (n == 0) throw bad(chat ? "messages" : "prompt", "the prompt is empty");
  if (n >= c.ctx)
    throw bad(chat ? "messages" : "prompt",
              "the prompt has " + std::to_string(n) + " tokens; this server's context holds " + std::to_string(c.ctx) +
                  " (prompt and completion together; --ctx)", "context_length_exceeded");
  std::optional<int64_t> max_tokens = integer(body, "max_tokens");
  if (const auto mct = integer(body, "max_completion_tokens")) max_tokens = mct;
  const char* mt = body.contains("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  if (max_tokens) {
    if (*max_tokens < 1) throw bad(mt, std::string("'") + mt + "' must be >= 1, got " + std::to_string(*max_tokens));
    if (uint64_t(*max_tokens) + n > c.ctx)
      throw bad(mt, "the prompt (" + std::to_string(n) + " tokens) and " + mt + " (" + std::to_string(*max_tokens) +
                        ") exceed this server's context of " + std::to_string(c.ctx) + " tokens (--ctx)",
                "context_length_exceeded");
    r.gen.max_tokens = uint32_t(*max_tokens);
  } else {
    // OpenAI's defaults: 16 for completions, the rest of the context for chat.
    r.gen.max_tokens = uint32_t(chat ? c.ctx - n : std::min<std::size_t>(16, c.ctx - n));
  }
  return r;
}

// ---- responses ----

struct ResponseMeta {
  std::string id;       // "cmpl-..." or "chatcmpl-..."
  int64_t created = 0;  // unix seconds
  std::string model;
};

inline json usage_json(std::size_t prompt, std::size_t completion) {
  return json{{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

inline json finish_json(net::Finish f) {
  if (f == net::Finish::stop) return "stop";
  if (f == net::Finish::length) return "length";
  return nullptr;
}

// The whole (non-streamed) response.
inline json full_response(const ApiRequest& r, const ResponseMeta& m, const std::string& text,
                          const std::vector<int32_t>& tokens, net::Finish f, std::size_t prompt, std::size_t completion) {
  json choice = {{"index", 0}, {"finish_reason", finish_json(f)}, {"logprobs", nullptr}};
  if (r.chat) choice["message"] = {{"role", "assistant"}, {"content", text}};
  else choice["text"] = text;
  if (r.return_tokens) choice["tokens"] = tokens;
  return json{{"id", m.id},
              {"object", r.chat ? "chat.completion" : "text_completion"},
              {"created", m.created},
              {"model", m.model},
              {"choices", json::array({choice})},
              {"usage", usage_json(prompt, completion)}};
}

// One streamed chunk. `first` (chat): the delta carries the role.
inline json chunk(const ApiRequest& r, const ResponseMeta& m, const std::string& text,
                  const std::vector<int32_t>& tokens, std::optional<net::Finish> f, bool first = false) {
  json choice = {{"index", 0}, {"finish_reason", f ? finish_json(*f) : json(nullptr)}, {"logprobs", nullptr}};
  if (r.chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!f) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  if (r.return_tokens && !f) choice["tokens"] = tokens;
  return json{{"id", m.id},
              {"object", r.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", m.created},
              {"model", m.model},
              {"choices", json::array({choice})}};
}

// The usage chunk that stream_options.include_usage asks for: no choices.
inline json usage_chunk(const ApiRequest& r, const ResponseMeta& m, std::size_t prompt, std::size_t completion) {
  return json{{"id", m.id},
              {"object", r.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", m.created},
              {"model", m.model},
              {"choices", json::array()},
              {"usage", usage_json(prompt, completion)}};
}

inline std::string sse(const json& j) { return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n"; }

}  // namespace pp::node
