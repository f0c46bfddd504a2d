// pp_worker's pieces in-process: base64, the wire dtypes, request parsing and start-up settings.
#include "worker/base64.hpp"
#include "worker/line_io.hpp"
#include "worker/protocol.hpp"
#include "worker/startup.hpp"
#include "worker/stub_backend.hpp"
#include "worker/wire.hpp"

#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace pp::worker;
using pp::WireDType;

// A plain bit-by-bit encoder, the oracle for the table-driven one.
std::string reference_b64(const std::string& in) {
  std::string out;
  size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    const uint32_t v = uint32_t(uint8_t(in[i])) << 16 | uint32_t(uint8_t(in[i + 1])) << 8 | uint8_t(in[i + 2]);
    for (int k = 3; k >= 0; --k) out += base64::kAlphabet[(v >> (6 * k)) & 63];
  }
  if (in.size() - i == 1) {
    const uint32_t v = uint32_t(uint8_t(in[i])) << 16;
    out += base64::kAlphabet[v >> 18];
    out += base64::kAlphabet[(v >> 12) & 63];
    out += "==";
  } else if (in.size() - i == 2) {
    const uint32_t v = uint32_t(uint8_t(in[i])) << 16 | uint32_t(uint8_t(in[i + 1])) << 8;
    out += base64::kAlphabet[v >> 18];
    out += base64::kAlphabet[(v >> 12) & 63];
    out += base64::kAlphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

size_t error_offset(const std::string& b64) {
  try {
    base64::decode(b64);
  } catch (const base64::Base64Error& e) {
    return e.offset();
  }
  return std::string::npos;
}

// Lines from a pipe: an input that ends at once (no byte ever read: the buffer is still unallocated), a last
// line without '\n', an over-long line reported with its length, then end of input.
TEST(LineReader, EmptyInputEndsAtOnceAndLinesSplitAsSpecified) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  ::close(p[1]);
  {
    pp::worker::LineReader empty(p[0], 16, -1);
    EXPECT_EQ(empty.next().kind, pp::worker::LineReader::Kind::eof);
  }
  ::close(p[0]);
  ASSERT_EQ(::pipe(p), 0);
  const std::string input = "one\n\n" + std::string(40, 'x') + "\nlast";
  ASSERT_EQ(::write(p[1], input.data(), input.size()), ssize_t(input.size()));
  ::close(p[1]);
  pp::worker::LineReader r(p[0], 16, -1);
  using Kind = pp::worker::LineReader::Kind;
  auto n = r.next();
  EXPECT_EQ(n.kind, Kind::line);
  EXPECT_EQ(n.line, "one");
  n = r.next();
  EXPECT_EQ(n.kind, Kind::line);
  EXPECT_EQ(n.line, "");
  n = r.next();
  EXPECT_EQ(n.kind, Kind::too_long);
  EXPECT_EQ(n.length, 40u);
  n = r.next();
  EXPECT_EQ(n.kind, Kind::line);
  EXPECT_EQ(n.line, "last");
  EXPECT_EQ(r.next().kind, Kind::eof);
  ::close(p[0]);
}

TEST(Base64, RoundTripsEveryLengthAgainstTheOracle) {
  std::mt19937 rng(7);
  for (size_t n = 0; n < 300; ++n) {
    std::string in(n, '\0');
    for (char& c : in) c = char(rng());
    const std::string enc = base64::encode(in);
    ASSERT_EQ(enc, reference_b64(in)) << n;
    ASSERT_EQ(base64::decode(enc), in) << n;
  }
}

TEST(Base64, Rfc4648Vectors) {
  const std::map<std::string, std::string> v = {{"", ""},         {"f", "Zg=="},         {"fo", "Zm8="},
                                                {"foo", "Zm9v"}, {"foob", "Zm9vYg=="}, {"fooba", "Zm9vYmE="},
                                                {"foobar", "Zm9vYmFy"}};
  for (const auto& [plain, enc] : v) {
    EXPECT_EQ(base64::encode(plain), enc);
    EXPECT_EQ(base64::decode(enc), plain);
  }
}

TEST(Base64, RejectsLengthNotMultipleOfFour) {
  EXPECT_THROW(base64::decode("Zm9"), base64::Base64Error);
  EXPECT_THROW(base64::decode("Zm9vY"), base64::Base64Error);
}

TEST(Base64, RejectsBadCharacterWithItsOffset) {
  std::string s = base64::encode(std::string(300, 'a'));
  for (size_t at : {size_t(0), size_t(5), size_t(63), size_t(64), size_t(200), s.size() - 1}) {
    std::string bad = s;
    bad[at] = '!';
    EXPECT_EQ(error_offset(bad), at) << at;
  }
  EXPECT_EQ(error_offset("Zm9v Zm9vZm9"), 4u);
  EXPECT_THROW(base64::decode("Zm9v\nZm9"), base64::Base64Error);
  EXPECT_THROW(base64::decode("Zm9-"), base64::Base64Error);  // URL-safe alphabet is not standard
}

TEST(Base64, RejectsMisplacedPadding) {
  EXPECT_EQ(error_offset("Zg==Zm9v"), 2u);
  EXPECT_THROW(base64::decode("Z==="), base64::Base64Error);
  EXPECT_THROW(base64::decode("===="), base64::Base64Error);
  EXPECT_THROW(base64::decode("Zm=v"), base64::Base64Error);
}

TEST(Base64, RejectsNonZeroBitsUnderPadding) {
  EXPECT_NO_THROW(base64::decode("Zg=="));
  EXPECT_THROW(base64::decode("Zh=="), base64::Base64Error);
  EXPECT_NO_THROW(base64::decode("Zm8="));
  EXPECT_THROW(base64::decode("Zm9="), base64::Base64Error);
}

// Not a pass/fail gate (the machine is shared): prints throughput for the record.
TEST(Base64, Throughput) {
  std::string in(size_t(16) << 20, '\0');
  std::mt19937 rng(1);
  for (char& c : in) c = char(rng());
  std::string enc;
  std::string out(in.size(), '\0');
  double enc_s = 1e9, dec_s = 1e9;
  for (int r = 0; r < 5; ++r) {
    enc.clear();
    const auto t0 = std::chrono::steady_clock::now();
    base64::append(enc, in.data(), in.size());
    const auto t1 = std::chrono::steady_clock::now();
    base64::decode(enc, reinterpret_cast<uint8_t*>(out.data()));
    const auto t2 = std::chrono::steady_clock::now();
    enc_s = std::min(enc_s, std::chrono::duration<double>(t1 - t0).count());
    dec_s = std::min(dec_s, std::chrono::duration<double>(t2 - t1).count());
  }
  ASSERT_EQ(out, in);
  std::printf("base64 encode %.2f GB/s of input, decode %.2f GB/s of base64\n", double(in.size()) / enc_s / 1e9,
              double(enc.size()) / dec_s / 1e9);
}

TEST(Wire, Bf16RoundsToNearestEvenAndKeepsNaN) {
  std::vector<uint16_t> scratch;
  const float values[] = {1.0f, std::bit_cast<float>(0x3f808000u), std::bit_cast<float>(0x3f818000u),
                          std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()};
  std::string b64;
  append_hidden_b64(b64, values, 5, WireDType::BF16, scratch);
  const std::string raw = base64::decode(b64);
  ASSERT_EQ(raw.size(), 10u);
  auto at = [&](int i) { return uint16_t(uint8_t(raw[2 * i]) | uint8_t(raw[2 * i + 1]) << 8); };
  EXPECT_EQ(at(0), 0x3f80);
  EXPECT_EQ(at(1), 0x3f80);  // tie -> even
  EXPECT_EQ(at(2), 0x3f82);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(pp::bf16_to_f32(at(3))));
  EXPECT_EQ(at(4), 0xff80);
}

// Beyond the half range a value is sent as an infinity (the spec); a worker receiving one refuses it.
TEST(Wire, F16OverflowBecomesInfinityAndIsRefusedOnDecode) {
  std::vector<uint16_t> scratch;
  std::vector<float> rows;
  const float values[] = {-1.5f, 70000.0f};
  std::string b64;
  append_hidden_b64(b64, values, 2, WireDType::F16, scratch);
  EXPECT_EQ(scratch[1], 0x7c00);
  try {
    decode_hidden_b64(b64, 1, 2, WireDType::F16, scratch, rows, 9);
    FAIL() << "an infinity was accepted";
  } catch (const pp::RequestError& e) {
    EXPECT_STREQ(e.what(), "field 'hidden_b64': row 0 (position 9), column 1 is +inf (f16 0x7c00): hidden states "
                           "must be finite");
  }
}

// Issue 16, finding 8: a NaN or infinity in a hidden state sampled token 0 and poisoned later positions.
TEST(Wire, NonFiniteValuesAreRefusedNamingRowPositionAndColumn) {
  std::vector<uint16_t> scratch;
  std::vector<float> rows;
  for (const WireDType dt : {WireDType::BF16, WireDType::F16}) {
    for (const float bad : {std::nanf(""), -INFINITY}) {
      std::vector<float> v(3 * 4, 0.25f);
      v[2 * 4 + 3] = bad;
      std::string b64;
      append_hidden_b64(b64, v.data(), v.size(), dt, scratch);
      try {
        decode_hidden_b64(b64, 3, 4, dt, scratch, rows, 100);
        FAIL() << "accepted";
      } catch (const pp::RequestError& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("row 2 (position 102), column 3 is " + std::string(std::isnan(bad) ? "NaN" : "-inf")),
                  std::string::npos) << what;
      }
    }
    // Finite extremes pass: the largest finite value, the smallest subnormal, negative zero.
    const float ok[] = {dt == WireDType::F16 ? 65504.0f : 3.0e38f, -0.0f, dt == WireDType::F16 ? 6e-8f : 1e-40f};
    std::string b64;
    append_hidden_b64(b64, ok, 3, dt, scratch);
    decode_hidden_b64(b64, 1, 3, dt, scratch, rows, 0);
    EXPECT_TRUE(std::isfinite(rows[0]) && std::isfinite(rows[2]));
  }
}

TEST(Wire, LengthMismatchBothWaysNamesTheNumbers) {
  std::vector<uint16_t> scratch;
  std::vector<float> rows;
  for (size_t bytes : {size_t(30), size_t(34)}) {
    try {
      decode_hidden_b64(base64::encode(std::string(bytes, 'a')), 1, 16, WireDType::BF16, scratch, rows);
      FAIL() << bytes;
    } catch (const pp::RequestError& e) {
      EXPECT_NE(std::string(e.what()).find("decodes to " + std::to_string(bytes) + " bytes, expected 32"),
                std::string::npos)
          << e.what();
    }
  }
}

RequestLimits limits(int stage, int n) {
  RequestLimits l;
  l.stage = stage;
  l.num_stages = n;
  l.hidden_dim = 16;
  l.vocab_size = 32;
  l.ctx = 4096;
  return l;
}

std::string error_of(const std::string& line, const RequestLimits& l, nlohmann::json* id = nullptr) {
  try {
    parse_request(line, l);
  } catch (const BadRequest& e) {
    if (id) *id = e.request_id();
    return e.what();
  }
  return "";
}

TEST(Protocol, ParsesEachOp) {
  const Request t = parse_request(R"({"op":"tokenize","request_id":7,"prompt":"a b","add_bos":false})", limits(0, 2));
  EXPECT_EQ(t.op, Op::tokenize);
  EXPECT_EQ(t.request_id, 7);
  EXPECT_EQ(t.add_bos, std::optional<bool>(false));
  EXPECT_TRUE(t.parse_special);
  const Request e = parse_request(R"({"op":"embed_and_forward","request_id":1,"tokens":[3,4]})", limits(0, 2));
  EXPECT_EQ(e.tokens, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(e.position, 0);
  const Request s = parse_request(
      R"({"op":"forward_and_sample","request_id":2,"position":5,"seq_len":1,"hidden_b64":"AA==","top_k":40,)"
      R"("top_p":0.9,"min_p":0,"temperature":0.7,"seed":18446744073709551615,"return_logits":true})",
      limits(1, 2));
  EXPECT_EQ(s.sampling.top_k, 40);
  EXPECT_EQ(s.sampling.seed, std::numeric_limits<uint64_t>::max());
  const Request seed_only = parse_request(
      R"({"op":"forward_and_sample","request_id":2,"position":5,"seq_len":1,"hidden_b64":"AA==","seed":3})",
      limits(1, 2));
  EXPECT_TRUE(seed_only.sampling.greedy());  // the library's rule: a seed alone does not turn sampling on
  EXPECT_TRUE(s.return_logits);
  EXPECT_FALSE(s.sampling.greedy());
  EXPECT_EQ(s.hidden_b64, "AA==");
}

TEST(Protocol, NullOptionalFieldIsAbsent) {
  const Request t = parse_request(R"({"op":"tokenize","request_id":7,"prompt":"a","add_bos":null})", limits(0, 2));
  EXPECT_FALSE(t.add_bos.has_value());
}

TEST(Protocol, ErrorsBeforeTheIdIsKnownEchoNull) {
  nlohmann::json id = 5;
  EXPECT_NE(error_of("{", limits(0, 2), &id).find("not JSON"), std::string::npos);
  EXPECT_TRUE(id.is_null());
  id = 5;
  EXPECT_NE(error_of(R"({"op":"tokenize","request_id":1.5})", limits(0, 2), &id).find("request_id"),
            std::string::npos);
  EXPECT_TRUE(id.is_null());
  id = 5;
  EXPECT_NE(error_of(R"({"op":"tokenize"})", limits(0, 2), &id).find("missing field 'request_id'"), std::string::npos);
  EXPECT_TRUE(id.is_null());
}

TEST(Protocol, RoleErrorNamesOpAndStage) {
  nlohmann::json id;
  const std::string e = error_of(R"({"op":"detokenize","request_id":3,"tokens":[]})", limits(1, 3), &id);
  EXPECT_NE(e.find("'detokenize'"), std::string::npos) << e;
  EXPECT_NE(e.find("stage 1"), std::string::npos) << e;
  EXPECT_EQ(id, 3);
}

TEST(Protocol, BoundsNameTheLimit) {
  EXPECT_NE(error_of(R"({"op":"forward_range","request_id":3,"position":0,"seq_len":4097,"hidden_b64":""})",
                     limits(1, 3))
                .find("must be <= 4096 (ctx"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"op":"decode_step","request_id":3,"position":2147483648,"token_id":1})", limits(0, 3))
                .find("must be <= 2147483647"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"op":"forward_and_sample","request_id":3,"position":0,"seq_len":1,"hidden_b64":"",)"
                     R"("top_p":0})",
                     limits(2, 3))
                .find("(0, 1]"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"op":"forward_and_sample","request_id":3,"position":0,"seq_len":1,"hidden_b64":"",)"
                     R"("seed":-1})",
                     limits(2, 3))
                .find("must be >= 0"),
            std::string::npos);
}

TEST(Protocol, TokenRangeIsCheckedOnlyWhenAsked) {
  RequestLimits l = limits(0, 2);
  EXPECT_EQ(error_of(R"({"op":"embed_and_forward","request_id":1,"tokens":[99]})", l), "");
  l.check_token_range = true;
  EXPECT_NE(error_of(R"({"op":"embed_and_forward","request_id":1,"tokens":[99]})", l).find("vocab_size 32"),
            std::string::npos);
}

std::string big_forward_line(const std::string& b64, const std::string& before = "", const std::string& after = "") {
  return R"({"op":"forward_range",)" + before + R"("request_id":9,"position":3,"seq_len":1,"hidden_b64":")" + b64 +
         "\"" + after + "}";
}

TEST(Protocol, RawFastPathFindsTheValue) {
  const std::string b64(kRawFieldMinLine, 'A');
  const std::string line = big_forward_line(b64, R"("x":{"a":["}\"",1]},)", R"(,"y":"\"hidden_b64\":")");
  const auto span = find_raw_string_value(line, "hidden_b64");
  ASSERT_TRUE(span.has_value());
  EXPECT_EQ(line.substr(span->begin, span->end - span->begin), b64);
  const Request r = parse_request(line, limits(1, 3));
  EXPECT_TRUE(r.hidden_raw);
  EXPECT_EQ(r.hidden_b64, b64);
  EXPECT_EQ(r.position, 3);
}

TEST(Protocol, RawFastPathFallsBackOnDuplicatesAndEscapes) {
  const std::string b64(kRawFieldMinLine, 'A');
  EXPECT_FALSE(find_raw_string_value(big_forward_line(b64, R"("hidden_b64":"x",)"), "hidden_b64"));
  EXPECT_FALSE(find_raw_string_value(big_forward_line(b64 + "\\/"), "hidden_b64"));
  EXPECT_FALSE(find_raw_string_value(big_forward_line(b64) + "x", "hidden_b64"));
  // The fallback still parses (the JSON parser keeps the last duplicate).
  const Request r = parse_request(big_forward_line(b64, R"("hidden_b64":"x",)"), limits(1, 3));
  EXPECT_FALSE(r.hidden_raw);
  EXPECT_EQ(r.hidden_b64.size(), b64.size());
}

TEST(Protocol, RawFastPathStillRejectsBrokenJson) {
  const std::string b64(kRawFieldMinLine, 'A');
  EXPECT_NE(error_of(big_forward_line(b64).substr(1), limits(1, 3)).find("not JSON"), std::string::npos);
  EXPECT_NE(error_of(big_forward_line(b64, R"("z":tru,)"), limits(1, 3)).find("not JSON"), std::string::npos);
  // A control character inside the value: JSON-invalid, found when decoding fails.
  std::string bad = big_forward_line(b64);
  bad[bad.find("AAAA") + 10] = '\x01';
  const Request r = parse_request(bad, limits(1, 3));
  ASSERT_TRUE(r.hidden_raw);
  EXPECT_THROW(recheck_raw_line(bad), BadRequest);
}

TEST(Startup, AsciiDecimal) {
  EXPECT_EQ(parse_ascii_decimal("3"), 3);
  EXPECT_EQ(parse_ascii_decimal(" \t7\n"), 7);
  EXPECT_EQ(parse_ascii_decimal("-1"), -1);
  EXPECT_EQ(parse_ascii_decimal("007"), 7);
  for (const char* bad : {"", " ", "+1", "1 2", "1.0", "0x1", "\xd9\xa0", "1\xd9\xa0", "-", "12345678901234567890",
                          "\xc2\xa0" "1"})
    EXPECT_FALSE(parse_ascii_decimal(bad).has_value()) << bad;
}

std::string startup_error(std::map<std::string, std::string> env) {
  try {
    read_config(CliOptions{}, [&](const char* n) -> const char* {
      const auto it = env.find(n);
      return it == env.end() ? nullptr : it->second.c_str();
    });
  } catch (const StartupError& e) {
    return e.what();
  }
  return "";
}

TEST(Startup, StageRules) {
  EXPECT_EQ(startup_error({{"STAGE", "1"}, {"NUM_STAGES", "2"}}), "");
  EXPECT_EQ(startup_error({{"STAGE", " 0 "}, {"NUM_STAGES", "\t2\n"}}), "");
  EXPECT_NE(startup_error({{"NUM_STAGES", "2"}}).find("STAGE is not set"), std::string::npos);
  EXPECT_NE(startup_error({{"STAGE", "0"}}).find("NUM_STAGES is not set"), std::string::npos);
  EXPECT_NE(startup_error({{"STAGE", "2"}, {"NUM_STAGES", "2"}}).find("STAGE='2'"), std::string::npos);
  EXPECT_NE(startup_error({{"STAGE", "-1"}, {"NUM_STAGES", "2"}}).find("STAGE='-1'"), std::string::npos);
  EXPECT_NE(startup_error({{"STAGE", "+1"}, {"NUM_STAGES", "2"}}).find("STAGE='+1'"), std::string::npos);
  EXPECT_NE(startup_error({{"STAGE", ""}, {"NUM_STAGES", "2"}}).find("STAGE=''"), std::string::npos);
  EXPECT_NE(startup_error({{"STAGE", "0"}, {"NUM_STAGES", "1"}}).find("NUM_STAGES='1'"), std::string::npos);
  EXPECT_NE(startup_error({{"STAGE", "0"}, {"NUM_STAGES", "0"}}).find("NUM_STAGES='0'"), std::string::npos);
}

TEST(Startup, OptionalSettings) {
  std::map<std::string, std::string> env = {{"STAGE", "0"}, {"NUM_STAGES", "2"}, {"PP_WIRE_DTYPE", "f32"}};
  EXPECT_NE(startup_error(env).find("PP_WIRE_DTYPE='f32'"), std::string::npos);
  env["PP_WIRE_DTYPE"] = "f16";
  env["PP_CTX"] = "0";
  EXPECT_NE(startup_error(env).find("PP_CTX='0'"), std::string::npos);
  env["PP_CTX"] = "128";
  env["PP_WORKER_STUB"] = "yes";
  EXPECT_NE(startup_error(env).find("PP_WORKER_STUB='yes'"), std::string::npos);
  env["PP_WORKER_STUB"] = "1";
  EXPECT_EQ(startup_error(env), "");
}

TEST(Startup, ThreadsSetting) {
  std::map<std::string, std::string> env = {{"STAGE", "0"}, {"NUM_STAGES", "2"}};
  const auto threads = [&] {
    return read_config(CliOptions{}, [&](const char* n) -> const char* {
             const auto it = env.find(n);
             return it == env.end() ? nullptr : it->second.c_str();
           })
        .threads;
  };
  EXPECT_EQ(threads(), 0);  // every core
  env["PP_THREADS"] = " 3 ";
  EXPECT_EQ(threads(), 3);
  env["PP_THREADS"] = "";
  EXPECT_EQ(threads(), 0);
  for (const char* bad : {"-1", "1025", "two", "+2"}) {
    env["PP_THREADS"] = bad;
    EXPECT_NE(startup_error(env).find(std::string("PP_THREADS='") + bad + "'"), std::string::npos) << bad;
  }
}

TEST(Startup, LineLimitCoversTheLargestRequest) {
  EXPECT_EQ(max_line_bytes(4096, 16), base64::encoded_size(4096 * 16 * 2) + kLineSlack);
  EXPECT_GT(max_line_bytes(4096, 2048), size_t(22) * 1000 * 1000);  // 4096-token prefill of the 1B model
}

TEST(Stub, ValuesAreExactInBothWireDTypesAndNeverZero) {
  StubBackend stub(0, 2, 4096, 0);
  std::vector<float> rows;
  const int32_t toks[] = {0, 1, 2, 3, 1000000};
  stub.embed_and_forward(toks, 0, rows);
  for (float v : rows) {
    EXPECT_NE(v, 0.0f);
    EXPECT_GE(v, -1.0f);
    EXPECT_LT(v, 1.0f);
    EXPECT_EQ(pp::bf16_to_f32(pp::f32_to_bf16(v)), v);
    EXPECT_EQ(pp::f16_to_f32(pp::f32_to_f16(v)), v);
  }
}

}  // namespace
