// libFuzzer target: arbitrary bytes -> Tokenizer::encode / decode / StreamDecoder, with round-trip checks.
//
// Vocabularies, built once: golden-tiny's (tests/data) and, when present, the real Llama-3 one
// ($PP_SHARED_FIXTURES/llama3-vocab-only.gguf). Input layout: byte 0 picks the vocabulary and the
// flags, the rest is the text; the same bytes, read as little-endian int32, are the ids to decode.
// Invariants (tests/unit/test_tokenizer.cpp states them too):
//   every id encode returns is in the vocabulary;
//   decode(encode(s, parse_special off)) == sanitize(s);
//   decode(encode(s, BOS, parse_special on) minus BOS, keep_special) == sanitize(s);
//   StreamDecoder's concatenated output == decode of the same ids;
//   decode of an id outside [0, n_vocab) throws TokenizerError, never anything else.
#include "fuzz_common.hpp"

#include <pp/core/error.hpp>
#include <pp/io/gguf.hpp>
#include <pp/io/mmap.hpp>
#include <pp/text/tokenizer.hpp>
#include <pp/text/utf8.hpp>

#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

using pp::fuzz::fail;

std::vector<pp::Tokenizer> load_vocabularies() {
  std::vector<pp::Tokenizer> v;
  std::vector<std::filesystem::path> paths = {pp::fuzz::test_data() / "golden-tiny" / "golden-tiny-f32.gguf"};
  if (const auto shared = pp::fuzz::shared_fixtures(); !shared.empty() && std::filesystem::exists(shared / "llama3-vocab-only.gguf"))
    paths.push_back(shared / "llama3-vocab-only.gguf");
  for (const auto& p : paths) {
    // The tokenizer views the file's strings only while building; it owns its tables afterwards.
    const pp::MappedFile file(p.string());
    const pp::gguf::File g = pp::gguf::parse(file.bytes());
    v.push_back(pp::Tokenizer::from_gguf(g));
    std::fprintf(stderr, "fuzz_tokenizer: vocabulary %s (%d tokens)\n", p.c_str(), v.back().vocab_size());
  }
  return v;
}

const std::vector<pp::Tokenizer>& vocabularies() {
  static const std::vector<pp::Tokenizer> v = load_vocabularies();
  return v;
}

std::string stream_decode(const pp::Tokenizer& tok, std::span<const int32_t> ids, bool keep_special) {
  pp::StreamDecoder d(tok, keep_special);
  std::string out;
  for (int32_t id : ids) out += d.feed(id);
  out += d.flush();
  return out;
}

void check_ids(const pp::Tokenizer& tok, std::span<const int32_t> ids, std::string_view text) {
  for (int32_t id : ids)
    if (id < 0 || id >= tok.vocab_size()) fail("encode returned an id outside the vocabulary", text);
}

void round_trips(const pp::Tokenizer& tok, std::string_view text) {
  const std::string repaired = pp::utf8::sanitize(text);
  const std::vector<int32_t> plain = tok.encode(text, false, false);
  check_ids(tok, plain, text);
  if (tok.decode(plain) != repaired) fail("decode(encode(s, no specials)) != sanitize(s)", text);
  if (stream_decode(tok, plain, false) != repaired) fail("stream decode of encode(s) != sanitize(s)", text);
  if (tok.bos() == pp::kNoTokenId) return;
  const std::vector<int32_t> special = tok.encode(text, true, true);
  check_ids(tok, special, text);
  if (special.empty() || special.front() != tok.bos()) fail("encode with add_bos does not start with BOS", text);
  const std::span<const int32_t> body = std::span(special).subspan(1);
  if (tok.decode(body, true) != repaired) fail("decode(encode(s, specials), keep_special) != sanitize(s)", text);
  if (stream_decode(tok, special, true) != tok.decode(special, true))
    fail("stream decode != decode (keep_special)", text);
}

// Arbitrary ids: in range (folded into the vocabulary) they decode; out of range they are refused.
void decode_ids(const pp::Tokenizer& tok, std::span<const uint8_t> bytes, bool keep_special) {
  std::vector<int32_t> raw(bytes.size() / 4);
  if (!raw.empty()) std::memcpy(raw.data(), bytes.data(), raw.size() * 4);
  std::vector<int32_t> folded(raw.size());
  const int64_t n = tok.vocab_size();
  for (std::size_t i = 0; i < raw.size(); ++i) folded[i] = int32_t(((int64_t(raw[i]) % n) + n) % n);
  const std::string text = tok.decode(folded, keep_special);
  if (!pp::utf8::is_valid(text)) fail("decode returned invalid UTF-8");
  if (stream_decode(tok, folded, keep_special) != text) fail("stream decode != decode (arbitrary ids)");

  bool out_of_range = false;
  for (int32_t id : raw) out_of_range = out_of_range || id < 0 || id >= tok.vocab_size();
  try {
    (void)tok.decode(raw, keep_special);
    if (out_of_range) fail("decode accepted an id outside the vocabulary");
  } catch (const pp::TokenizerError&) {
    if (!out_of_range) fail("decode refused ids inside the vocabulary");
  }
  pp::StreamDecoder d(tok, keep_special);
  for (int32_t id : raw) {
    try {
      (void)d.feed(id);
      if (id < 0 || id >= tok.vocab_size()) fail("StreamDecoder accepted an id outside the vocabulary");
    } catch (const pp::TokenizerError&) {
      if (id >= 0 && id < tok.vocab_size()) fail("StreamDecoder refused an id inside the vocabulary");
    }
  }
  (void)d.flush();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)vocabularies();  // load before the first input, so a missing fixture fails at start-up
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const auto& vocabs = vocabularies();
  const uint8_t control = data[0];
  const pp::Tokenizer& tok = vocabs[(control & 1) % vocabs.size()];
  const bool keep_special = control & 2;
  const std::span<const uint8_t> rest(data + 1, size - 1);
  const std::string_view text(reinterpret_cast<const char*>(rest.data()), rest.size());
  round_trips(tok, text);
  decode_ids(tok, rest, keep_special);
  return 0;
}
