// pp::Generation: the one prompt-then-tokens loop (pp_generate, the worker's generate_full and the
// references of the contract tests run it), against a loop written out by hand over a Stage.
#include <pp/generation.hpp>

#include "../common/fixtures.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace {

std::string tiny(const std::string& dt = "f32") {
  return (pp::test::data_dir() / "golden-tiny" / ("golden-tiny-" + dt + ".gguf")).string();
}

const std::vector<int32_t> kPrompt = {1, 17, 33, 60, 5};

// The oracle: embed / forward / head by hand, the token at position p drawn by Sampler at p.
std::vector<int32_t> by_hand(const std::string& path, std::size_t n, const pp::SamplingParams& sp,
                             std::vector<float>* step_logits = nullptr) {
  auto st = pp::Stage::open_full(path, {.threads = 1});
  pp::Sequence seq = st->new_sequence();
  const std::size_t E = st->config().n_embd, V = st->config().n_vocab;
  std::vector<float> rows(kPrompt.size() * E), logits(V);
  pp::Sampler sampler;
  std::vector<int32_t> out;
  std::vector<int32_t> feed = kPrompt;
  int64_t pos = 0;
  for (std::size_t i = 0; i < n; ++i) {
    st->embed(feed, rows.data());
    st->forward(seq, pos, rows.data(), feed.size());
    st->head(seq, rows.data() + (feed.size() - 1) * E, 1, logits.data());
    pos += int64_t(feed.size());
    if (step_logits) step_logits->insert(step_logits->end(), logits.begin(), logits.end());
    out.push_back(sampler.sample(logits, sp, pos));
    feed = {out.back()};
  }
  return out;
}

TEST(Generation, GreedyMatchesTheLoopByHandOnTheWholeModel) {
  std::vector<float> expect_logits;
  const auto expect = by_hand(tiny(), 12, {}, &expect_logits);
  pp::LocalPipeline whole(pp::Model::open(tiny()), {}, pp::WireDType::F32, {.threads = 1});
  pp::Generation gen(whole, {.sampling = {}, .max_tokens = 12});
  gen.prefill(kPrompt);
  std::vector<float> got_logits;
  while (gen.step()) got_logits.insert(got_logits.end(), gen.logits().begin(), gen.logits().end());
  EXPECT_EQ(gen.tokens(), expect);
  EXPECT_EQ(got_logits, expect_logits);  // bit for bit: the same kernels on the same requests
  EXPECT_EQ(gen.reason(), pp::StopReason::length);
  EXPECT_EQ(gen.next_pos(), int64_t(kPrompt.size() + 12));
}

TEST(Generation, SampledTokensFollowTheSeedAndPositionRuleAcrossRunners) {
  pp::SamplingParams sp;
  sp.temperature = 1.5;
  sp.top_k = 40;
  sp.seed = 1234;
  const auto expect = by_hand(tiny(), 10, sp);
  auto model = pp::Model::open(tiny());
  pp::LocalPipeline pipe(model, {1, 3}, pp::WireDType::F32, {.threads = 2});  // f32 wire: the unsplit result
  pp::Generation split(pipe, {.sampling = sp, .max_tokens = 10});
  split.prefill(kPrompt);
  EXPECT_EQ(split.run_to_end(), expect);
  // Another seed draws other tokens (the test would pass for a sampler ignoring its seed otherwise).
  sp.seed = 99;
  EXPECT_NE(by_hand(tiny(), 10, sp), expect);
}

TEST(Generation, PromptLogitsCoverEveryRowAndTheLastIsTheFirstDraw) {
  pp::LocalPipeline whole(pp::Model::open(tiny()), {}, pp::WireDType::F32, {.threads = 1});
  pp::Generation gen(whole, {.sampling = {}, .max_tokens = 1});
  std::vector<float> rows;
  gen.prefill(kPrompt, &rows);
  const std::size_t V = whole.config().n_vocab;
  ASSERT_EQ(rows.size(), kPrompt.size() * V);
  const auto t = gen.step();
  ASSERT_TRUE(t);
  EXPECT_EQ(*t, pp::argmax({rows.data() + (kPrompt.size() - 1) * V, V}));
  EXPECT_FALSE(gen.step());  // max_tokens reached
}

TEST(Generation, MisuseIsARequestErrorNotACrash) {
  pp::LocalPipeline whole(pp::Model::open(tiny()), {}, pp::WireDType::F32, {.threads = 1});
  pp::Generation gen(whole, {.sampling = {}, .max_tokens = 0});
  EXPECT_THROW(gen.step(), pp::RequestError);  // before prefill
  EXPECT_THROW(gen.prefill({}), pp::RequestError);
  gen.prefill(kPrompt);
  EXPECT_THROW(gen.prefill(kPrompt), pp::RequestError);
  EXPECT_FALSE(gen.step());  // zero tokens asked for
  EXPECT_TRUE(gen.tokens().empty());
  pp::SamplingParams bad;
  bad.temperature = -1;
  EXPECT_THROW(pp::Generation(whole, {.sampling = bad}), pp::RequestError);
}

TEST(Model, OneOpenSharedByStagesAndItsTokenizerBuiltOnce) {
  auto model = pp::Model::open(tiny());
  pp::Stage a(model, {0, 2}), b(model, {2, int(model->config().n_layer)});
  EXPECT_EQ(a.model().get(), model.get());
  EXPECT_EQ(&a.gguf(), &b.gguf());  // one parsed header, not one per stage
  EXPECT_EQ(model->default_ctx(), std::min<std::size_t>(4096, model->config().ctx_len));
  EXPECT_EQ(model->tokenizer(), model->tokenizer());
  EXPECT_EQ(model->tokenizer() == nullptr, !model->tokenizer_error().empty()) << model->tokenizer_error();
  EXPECT_THROW(pp::Model::open(tiny() + ".missing"), pp::Error);
}

}  // namespace
