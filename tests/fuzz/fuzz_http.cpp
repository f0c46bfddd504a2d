// libFuzzer target: arbitrary bytes as a raw HTTP/1.x request stream -> pp_node --serve's request parser
// (tools/node/http_front.hpp), route dispatch and the OpenAI request validation (tools/node/openai_api.hpp),
// without a live model: the tokenizer and chat template are golden-tiny's (tests/data).
//
// Input layout: byte 0 picks how the stream is cut into reads (whole, halves, 1..7-byte pieces); the rest
// is the stream. Every complete request is routed; the cheap routes build their response, the generation
// routes validate their body. Invariants:
//   the parser never throws, and a refusal is one of 400/411/413/414/417/431/505 with a message;
//   a complete request's body has exactly its Content-Length bytes;
//   a cheap route's response is never a 5xx;
//   validation fails only with an ApiError of status 4xx or a pp::Error (the tokenizer's): anything else
//   escaping (a JSON library exception, std::exception) is a crash, i.e. a 5xx the client caused.
#include "fuzz_common.hpp"

#include <pp/core/error.hpp>
#include <pp/io/gguf.hpp>
#include <pp/io/mmap.hpp>
#include <pp/text/tokenizer.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "node/http_front.hpp"
#include "node/http_server.hpp"
#include "node/openai_api.hpp"

namespace {

using pp::fuzz::fail;
using namespace pp::node;

struct Api {
  std::optional<pp::Tokenizer> tok;
  ApiContext ctx;
  Api() {
    const pp::MappedFile file((pp::fuzz::test_data() / "golden-tiny" / "golden-tiny-f32.gguf").string());
    tok = pp::Tokenizer::from_gguf(pp::gguf::parse(file.bytes()));
    ctx.tok = &*tok;
    ctx.ctx = 256;
    ctx.n_vocab = std::size_t(tok->vocab_size());
    const bool headers = tok->encode("<|start_header_id|><|end_header_id|><|eot_id|>", false, true).size() == 3;
    ctx.chat = detect_chat_template(std::nullopt, headers, ctx.chat_why);
  }
};

const Api& api() {
  static const Api a;
  return a;
}

void handle(const HttpRequest& q, std::size_t content_length) {
  if (q.body.size() != content_length) fail("a complete request's body is not its Content-Length");
  const RouteMatch m = match_route(q.method, q.path);
  if (const auto r = simple_response(q, m)) {
    if (r->status >= 500) fail("a cheap route answered 5xx", q.path);
    return;
  }
  if (m.route != Route::completions && m.route != Route::chat) return;
  try {
    const ApiRequest r = parse_request(q.body, m.route == Route::chat, api().ctx);
    if (r.prompt.empty() || r.prompt.size() >= api().ctx.ctx) fail("an accepted prompt is empty or past the context");
    for (int32_t id : r.prompt)
      if (id < 0 || std::size_t(id) >= api().ctx.n_vocab) fail("an accepted prompt has an id outside the vocabulary");
  } catch (const ApiError& e) {
    if (e.status < 400 || e.status >= 500 || e.message.empty()) fail("validation refused with a non-4xx status", e.message);
  } catch (const pp::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const unsigned mode = data[0] % 9;
  const std::string_view stream(reinterpret_cast<const char*>(data + 1), size - 1);
  RequestParser p;
  std::size_t at = 0;
  while (at < stream.size() || at == 0) {
    const std::size_t piece = mode == 0 ? stream.size() : mode == 1 ? (stream.size() + 1) / 2 : mode - 1;
    const std::string_view chunk = stream.substr(at, piece);
    at += std::max<std::size_t>(chunk.size(), 1);
    RequestParser::State st = p.feed(chunk);
    while (st == RequestParser::State::done) {
      const std::size_t length = p.content_length();
      const HttpRequest q = p.take();
      handle(q, length);
      st = p.advance();
    }
    if (st == RequestParser::State::failed) {
      const int s = p.status();
      if (!(s == 400 || s == 411 || s == 413 || s == 414 || s == 417 || s == 431 || s == 505) || p.error().empty())
        fail("the parser refused with an unexpected status", std::to_string(s));
      break;
    }
  }
  return 0;
}
