// Golden: logits of golden-tiny (F32/F16/BF16) against the float64 reference, prompt and teacher-forced decode.
#include <pp/stage.hpp>
#include <pp/text/sampler.hpp>

#include "../common/fixtures.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <tuple>
#include <vector>

namespace {

using nlohmann::json;
constexpr double kTol = 1e-3;

std::string model_path(const std::string& dt) {
  return (pp::test::data_dir() / "golden-tiny" / ("golden-tiny-" + dt + ".gguf")).string();
}

// Max |ours - reference| over one position: full logits when given, else the reference's top-k ids.
double row_diff(const float* ours, const json& full, const json& top) {
  double d = 0;
  if (!full.is_null()) {
    for (std::size_t v = 0; v < full.size(); ++v) d = std::max(d, std::abs(double(ours[v]) - full[v].get<double>()));
  } else {
    for (const auto& e : top) d = std::max(d, std::abs(double(ours[e[0].get<int>()]) - e[1].get<double>()));
  }
  return d;
}

class GoldenTiny : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(GoldenTiny, PromptAndTeacherForcedDecodeMatchExact) {
  const auto& [dt, prompt] = GetParam();
  const json ref = pp::test::load_json(pp::test::data_dir() / "golden-tiny" /
                                       ("golden-tiny-" + dt + "." + prompt + ".exact.json"));
  auto st = pp::Stage::open_full(model_path(dt), {.threads = 2});
  const pp::Config& c = st->config();
  pp::Sequence seq = st->new_sequence();

  const std::vector<int32_t> toks = ref["prompt_tokens"].get<std::vector<int32_t>>();
  const std::size_t n = toks.size(), V = c.n_vocab, E = c.n_embd;
  std::vector<float> rows(n * E), logits(n * V);
  st->embed(toks, rows.data());
  st->forward(seq, 0, rows.data(), n);
  st->head(seq, rows.data(), n, logits.data());

  double prompt_max = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const json full = ref.contains("logits") ? ref["logits"][i] : json();
    prompt_max = std::max(prompt_max, row_diff(&logits[i * V], full, ref["logits_top"][i]));
  }
  EXPECT_LE(prompt_max, kTol) << "prompt logits";

  // Teacher forcing: step 0 is the last prompt row; step i feeds the reference's greedy[i-1].
  const std::vector<int32_t> greedy = ref["greedy"].get<std::vector<int32_t>>();
  const bool full_greedy = ref.contains("greedy_logits");
  std::vector<float> row(E), step(V);
  std::copy(&logits[(n - 1) * V], &logits[n * V], step.begin());
  double decode_max = 0;
  int argmax_equal = 0;
  for (std::size_t i = 0; i < greedy.size(); ++i) {
    if (i > 0) {
      const int32_t t = greedy[i - 1];
      st->embed({&t, 1}, row.data());
      st->forward(seq, int64_t(n + i - 1), row.data(), 1);
      st->head(seq, row.data(), 1, step.data());
    }
    decode_max = std::max(decode_max, row_diff(step.data(), full_greedy ? ref["greedy_logits"][i] : json(),
                                               ref["greedy_logits_top"][i]));
    argmax_equal += pp::argmax(step) == greedy[i];
  }
  EXPECT_LE(decode_max, kTol) << "teacher-forced decode logits";
  // p1/p7/p40 have wide greedy margins: every greedy token must agree.
  if (full_greedy) {
    EXPECT_EQ(argmax_equal, int(greedy.size()));
  }
  std::printf("[golden] %s %s: prompt max |diff| %.3g, decode max |diff| %.3g over %zu steps, argmax %d/%zu\n",
              dt.c_str(), prompt.c_str(), prompt_max, decode_max, greedy.size(), argmax_equal, greedy.size());
}

INSTANTIATE_TEST_SUITE_P(AllFiles, GoldenTiny,
                         ::testing::Combine(::testing::Values("f32", "f16", "bf16"),
                                            ::testing::Values("p1", "p7", "p40", "p300", "p8-decode640")),
                         [](const auto& info) {
                           std::string s = std::get<0>(info.param) + "_" + std::get<1>(info.param);
                           for (char& ch : s)
                             if (ch == '-') ch = '_';
                           return s;
                         });

}  // namespace
