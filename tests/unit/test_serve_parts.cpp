// Pieces of pp_node --serve in-process: stop strings, chat templates, the cut planner, BATCH frames, request validation.
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "node/chat_template.hpp"
#include "node/cut_plan.hpp"
#include "node/openai_api.hpp"
#include "node/stop_strings.hpp"
#include "pp/net/mux_frame.hpp"

namespace {

using pp::node::StopMatcher;

std::string run(StopMatcher m, const std::vector<std::string>& pieces) {
  std::string out;
  for (const auto& p : pieces) out += m.feed(p);
  return out + m.flush();
}

TEST(StopStrings, CutBeforeTheFirstStopAcrossPieces) {
  EXPECT_EQ(run(StopMatcher(std::vector<std::string>{"END"}), {"abc", "E", "N", "D", "more"}), "abc");
  EXPECT_EQ(run(StopMatcher(std::vector<std::string>{"END"}), {"abc", "E", "N", "x"}), "abcENx");  // a false start is released
  EXPECT_EQ(run(StopMatcher(std::vector<std::string>{"\n\n", "##"}), {"one\n", "two#", "#three"}), "one\ntwo");
  EXPECT_EQ(run(StopMatcher(std::vector<std::string>{}), {"a", "b"}), "ab");
  EXPECT_EQ(run(StopMatcher(std::vector<std::string>{""}), {"a", "b"}), "ab");  // an empty stop string is no stop string
  StopMatcher m(std::vector<std::string>{"xyz"});
  EXPECT_EQ(m.feed("12x"), "12");  // "x" may begin the stop string: held back
  EXPECT_EQ(m.feed("y"), "");
  EXPECT_EQ(m.feed("z!"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.feed("more"), "");
}

TEST(ChatTemplate, DetectsTheLlama3FamiliesAndRefusesOthers) {
  std::string why;
  const std::string fixture =
      "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
      "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}";
  auto t = pp::node::detect_chat_template(fixture, true, why);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->format, pp::node::ChatFormat::llama3);
  t = pp::node::detect_chat_template(fixture + "Cutting Knowledge Date strftime_now", true, why);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->format, pp::node::ChatFormat::llama3_dated);
  EXPECT_TRUE(t->today);
  EXPECT_FALSE(pp::node::detect_chat_template(std::string("{% for m in messages %}<|im_start|>{% endfor %}"), true, why));
  EXPECT_NE(why.find("not a Llama-3 template"), std::string::npos);
  EXPECT_TRUE(pp::node::detect_chat_template(std::nullopt, true, why));  // no template, Llama-3 vocabulary
  EXPECT_FALSE(pp::node::detect_chat_template(std::nullopt, false, why));
  EXPECT_NE(why.find("no chat template"), std::string::npos);
}

TEST(ChatTemplate, RendersAsTheJinjaDoes) {
  const std::vector<pp::node::ChatMessage> msgs = {{"system", " Be brief. "}, {"user", "Hi!\n"}, {"assistant", "Hello."},
                                                   {"user", "Bye"}};
  const pp::node::ChatTemplate l3{pp::node::ChatFormat::llama3, false, ""};
  EXPECT_EQ(pp::node::render_chat(l3, msgs, "<|begin_of_text|>"),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  const pp::node::ChatTemplate l31{pp::node::ChatFormat::llama3_dated, false, ""};
  EXPECT_EQ(pp::node::render_chat(l31, std::vector<pp::node::ChatMessage>{{"user", "Hi"}}, "<|begin_of_text|>"),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  const pp::node::ChatTemplate today{pp::node::ChatFormat::llama3_dated, true, ""};
  EXPECT_NE(pp::node::render_chat(today, msgs, "", "01 Jan 2030").find("Today Date: 01 Jan 2030\n\nBe brief.<|eot_id|>"),
            std::string::npos);
}

pp::node::StageProbe probe(const char* who, double layer_ms, uint64_t mem_gib) {
  pp::net::ProbeReport r;
  r.layer_us = layer_ms * 1000;
  r.layer_bytes = 120u << 20;
  r.head_bytes = 500u << 20;
  r.kv_bytes_per_layer = 16u << 20;
  r.mem_available = mem_gib << 30;
  r.threads = 4;
  r.arch = "avx2";
  return {who, r};
}

TEST(CutPlan, InProportionToSpeedWithTheOutputOnTheLastStage) {
  // Equal machines: the last stage also runs the output projection (~4 layers' worth), so takes fewer.
  auto p = pp::node::plan_cuts({probe("a", 10, 64), probe("b", 10, 64)}, 16, 8);
  EXPECT_EQ(p.cuts, std::vector<int>{10});
  EXPECT_FALSE(p.over_memory);
  // A worker twice as fast takes about twice the layers.
  p = pp::node::plan_cuts({probe("a", 20, 64), probe("b", 10, 64), probe("c", 10, 64)}, 16, 8);
  EXPECT_EQ(p.layers[0] + p.layers[1] + p.layers[2], 16);
  EXPECT_LT(p.layers[0], p.layers[1]);
  // Memory caps a fast stage: 90% of 1 GiB holds 3 layers of 120 MiB weights + 8 x 16 MiB caches.
  p = pp::node::plan_cuts({probe("a", 1, 1), probe("b", 10, 64)}, 16, 8);
  EXPECT_EQ(p.layers[0], 3);
  EXPECT_THROW(pp::node::plan_cuts({probe("a", 1, 1), probe("b", 1, 1), probe("c", 1, 1)}, 2, 1), pp::Error);
  const std::string text = pp::node::plan_text({probe("coordinator", 10, 64), probe("h:1", 10, 64)},
                                               pp::node::plan_cuts({probe("a", 10, 64), probe("b", 10, 64)}, 16, 8));
  EXPECT_NE(text.find("--cuts 10"), std::string::npos) << text;
}

TEST(BatchFrame, TableRoundTripsAndEveryCheckRefuses) {
  using namespace pp::net;
  const std::vector<BatchEntry> entries = {{0x0102030405060708ull, 5, 1, 0}, {42, 1ull << 39, 3, 0}};
  const std::vector<uint8_t> table = encode_batch_table(entries);
  ASSERT_EQ(table.size(), 4 + 2 * kBatchEntryBytes);
  EXPECT_EQ(table[3], 2);
  for (std::size_t i = 0; i < 2; ++i) {
    const BatchEntry e = decode_batch_entry(std::span<const uint8_t, kBatchEntryBytes>(table.data() + 4 + i * 24, 24));
    EXPECT_EQ(e.session, entries[i].session);
    EXPECT_EQ(e.pos, entries[i].pos);
    EXPECT_EQ(e.rows, entries[i].rows);
  }
  const ModelGeometry g{64, 1000, 256};
  ModelHeader h;
  h.type = kTypeBatch;
  h.session = 7;
  h.layer_lo = 2, h.layer_hi = 4;
  h.rows = 4;
  h.payload_bytes = uint32_t(batch_payload_bytes(2, 4, 64));
  EXPECT_NO_THROW(check_batch_header(h, g, 2, 4, 7));
  EXPECT_NO_THROW(check_batch_count(h, 2, 64));
  EXPECT_NO_THROW(check_batch_entries(h, entries));
  auto refuses = [&](ModelHeader m, const char* what) {
    try {
      check_batch_header(m, g, 2, 4, 7);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const pp::FrameError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  ModelHeader m = h;
  m.session = 8;
  refuses(m, "session 8");
  m = h, m.layer_hi = 5;
  refuses(m, "range assigned");
  m = h, m.rows = 0;
  refuses(m, "rows 0 outside");
  m = h, m.rows = 257;
  refuses(m, "rows 257 outside");
  m = h, m.flags = 1;
  refuses(m, "flags");
  m = h, m.dtype = 1;
  refuses(m, "dtype");
  m = h, m.payload_bytes = 10;
  refuses(m, "payload_bytes 10");
  EXPECT_THROW(check_batch_count(h, 0, 64), pp::FrameError);
  EXPECT_THROW(check_batch_count(h, 5, 64), pp::FrameError);  // more entries than rows
  EXPECT_THROW(check_batch_count(h, 1, 64), pp::FrameError);  // payload size disagrees
  EXPECT_THROW(check_batch_entries(h, std::vector<BatchEntry>{{1, 0, 2, 0}, {1, 0, 2, 0}}), pp::FrameError);  // twice
  EXPECT_THROW(check_batch_entries(h, std::vector<BatchEntry>{{1, 0, 1, 0}, {2, 0, 2, 0}}), pp::FrameError);  // 3 != 4
  EXPECT_THROW(check_batch_entries(h, std::vector<BatchEntry>{{1, 0, 4, 1}}), pp::FrameError);  // flags
}

TEST(BatchFrame, SamplingTextRoundTripsExactly) {
  pp::SamplingParams s;
  s.temperature = 0.1 + 0.2, s.top_k = 40, s.top_p = 0.95, s.min_p = 0.05, s.seed = UINT64_MAX;
  const pp::SamplingParams d = pp::net::decode_sampling(pp::net::encode_sampling(s));
  EXPECT_EQ(*d.temperature, *s.temperature);
  EXPECT_EQ(*d.top_k, 40);
  EXPECT_EQ(*d.top_p, *s.top_p);
  EXPECT_EQ(*d.min_p, *s.min_p);
  EXPECT_EQ(d.seed, UINT64_MAX);
  EXPECT_TRUE(pp::net::decode_sampling("seed=3\n").greedy());
  EXPECT_THROW(pp::net::decode_sampling("temperature=-1\n"), pp::net::HandshakeError);
}

TEST(OpenAiRequest, DefaultsAndRefusalsWithoutATokenizer) {
  pp::node::ApiContext c;
  c.tok_error = "none";
  c.ctx = 64;
  c.n_vocab = 1000;
  c.chat_why = "no template";
  auto r = pp::node::parse_request(R"({"prompt": [1, 2, 3], "temperature": 0})", false, c);
  EXPECT_EQ(r.prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r.gen.max_tokens, 16u);  // OpenAI's completions default
  EXPECT_TRUE(r.gen.sampling.greedy());
  r = pp::node::parse_request(R"({"prompt": [[5]], "seed": 9, "top_k": 0, "top_p": 1})", false, c);
  EXPECT_EQ(*r.gen.sampling.temperature, 1.0);  // OpenAI's default temperature
  EXPECT_FALSE(r.gen.sampling.top_k);           // 0: off
  EXPECT_FALSE(r.gen.sampling.top_p);           // 1: off
  EXPECT_EQ(r.gen.sampling.seed, 9u);
  auto status = [&](const char* body, bool chat = false) {
    try {
      pp::node::parse_request(body, chat, c);
      return 200;
    } catch (const pp::node::ApiError& e) {
      EXPECT_FALSE(e.message.empty());
      return e.status;
    }
  };
  EXPECT_EQ(status(R"({"prompt": "text"})"), 400);  // no tokenizer: ids only
  EXPECT_EQ(status(R"({"messages": [{"role": "user", "content": "x"}]})", true), 400);
  EXPECT_EQ(status(R"({"prompt": [1], "max_tokens": 64})"), 400);  // 1 + 64 > ctx 64
  EXPECT_EQ(status(R"({"prompt": [1], "max_tokens": 63})"), 200);
  EXPECT_EQ(status(R"({"prompt": [1], "frequency_penalty": 0.5})"), 400);
  EXPECT_EQ(status(R"({"prompt": [1], "frequency_penalty": 0})"), 200);
  EXPECT_EQ(status(R"({"prompt": [1], "response_format": {"type": "json_object"}})"), 400);
  EXPECT_EQ(status(R"({"prompt": [1], "stop": ["a","b","c","d","e"]})"), 400);
  EXPECT_EQ(status(R"({"prompt": [], "max_tokens": 1})"), 400);
}

}  // namespace
