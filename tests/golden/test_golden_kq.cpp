// Golden: the quantized golden-kq models. Exact path vs the float64 references (prompt and teacher-forced
// decode); fast path within 1.25x llama.cpp's own distance from exact (tests/data/golden-kq/README.txt).
#include <pp/stage.hpp>
#include <pp/text/sampler.hpp>

#include "../common/fixtures.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

namespace {

using nlohmann::json;
constexpr double kTol = 1e-3;
constexpr double kFastBound = 1.25;  // times llama.cpp's distance from exact

const std::vector<std::string> kModels = {"q8_0", "q6_k", "q4_k_m", "q4_0", "q4_1", "q5_0", "q5_1", "q5_k_m", "q5_k_s"};

std::filesystem::path kq(const std::string& file) { return pp::test::data_dir() / "golden-kq" / file; }
std::string model_path(const std::string& t) { return kq("golden-kq-" + t + ".gguf").string(); }
json reference(const std::string& t, const std::string& prompt, const std::string& kind) {
  return pp::test::load_json(kq("golden-kq-" + t + "." + prompt + "." + kind + ".json"));
}

// Logits of the prompt (every position) and of each teacher-forced step feeding the reference's greedy
// tokens: step 0 is the last prompt position, step i follows greedy[i - 1].
struct Logits {
  std::vector<std::vector<float>> prompt, steps;
};

Logits run(const std::string& t, const json& ref, bool fast) {
  auto st = pp::Stage::open_full(model_path(t), {.threads = 2, .fast_quant = fast});
  const std::size_t V = st->config().n_vocab, E = st->config().n_embd;
  pp::Sequence seq = st->new_sequence();
  const auto toks = ref["prompt_tokens"].get<std::vector<int32_t>>();
  const auto greedy = ref["greedy"].get<std::vector<int32_t>>();
  const std::size_t n = toks.size();
  std::vector<float> rows(n * E), logits(n * V), row(E);
  st->embed(toks, rows.data());
  st->forward(seq, 0, rows.data(), n);
  st->head(seq, rows.data(), n, logits.data());
  Logits out;
  for (std::size_t i = 0; i < n; ++i) out.prompt.emplace_back(&logits[i * V], &logits[(i + 1) * V]);
  out.steps.push_back(out.prompt.back());
  for (std::size_t i = 1; i < greedy.size(); ++i) {
    std::vector<float> step(V);
    st->embed({&greedy[i - 1], 1}, row.data());
    st->forward(seq, int64_t(n + i - 1), row.data(), 1);
    st->head(seq, row.data(), 1, step.data());
    out.steps.push_back(std::move(step));
  }
  return out;
}

// Max and mean |a - b| over rows [0, n).
struct Dist {
  double max = 0, mean = 0;
};
template <class A, class B>
Dist distance(const A& a, const B& b, std::size_t n) {
  Dist d;
  std::size_t count = 0;
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t v = 0; v < b[i].size(); ++v) {
      const double e = std::abs(double(a[i][v]) - b[i][v].template get<double>());
      d.max = std::max(d.max, e), d.mean += e, ++count;
    }
  d.mean /= double(count);
  return d;
}

class GoldenKqExact : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(GoldenKqExact, PromptAndTeacherForcedDecodeMatchExact) {
  const auto& [t, prompt] = GetParam();
  const json ref = reference(t, prompt, "exact");
  const Logits ours = run(t, ref, /*fast=*/false);
  const auto greedy = ref["greedy"].get<std::vector<int32_t>>();

  const Dist p = distance(ours.prompt, ref["logits"], ours.prompt.size());
  const Dist d = distance(ours.steps, ref["greedy_logits"], ours.steps.size());
  EXPECT_LE(p.max, kTol) << "prompt logits";
  EXPECT_LE(d.max, kTol) << "teacher-forced decode logits";
  int agree = 0;
  for (std::size_t i = 0; i < greedy.size(); ++i) {
    const bool same = pp::argmax(ours.steps[i]) == greedy[i];
    agree += same;
    // The one exact greedy step with a top-2 margin under 2e-3 (5.5e-4): either pick is correct.
    if (t == "q5_k_m" && prompt == "p1" && i == 10) continue;
    EXPECT_TRUE(same) << "greedy step " << i;
  }
  std::printf("[golden-kq exact] %-6s %-3s: prompt max |diff| %.2e, decode max |diff| %.2e, argmax %d/%zu\n",
              t.c_str(), prompt.c_str(), p.max, d.max, agree, greedy.size());
}

INSTANTIATE_TEST_SUITE_P(AllFiles, GoldenKqExact,
                         ::testing::Combine(::testing::ValuesIn(kModels), ::testing::Values("p1", "p7", "p40")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// Steps where llama.cpp's teacher forcing saw the same tokens as exact's: its greedy prefix plus one.
std::size_t shared_steps(const json& a, const json& b) {
  const auto ga = a["greedy"].get<std::vector<int32_t>>(), gb = b["greedy"].get<std::vector<int32_t>>();
  std::size_t k = 0;
  while (k < ga.size() && k < gb.size() && ga[k] == gb[k]) ++k;
  return std::min(k + 1, ga.size());
}

class GoldenKqFast : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenKqFast, WithinLlamaCppDistanceFromExact) {
  const std::string t = GetParam();
  const json exact = reference(t, "p40", "exact"), llama = reference(t, "p40", "kvf32");
  const Logits ours = run(t, exact, /*fast=*/true);

  const std::size_t n = ours.prompt.size();
  std::vector<std::vector<float>> llama_prompt;
  for (const auto& r : llama["logits"]) llama_prompt.push_back(r.get<std::vector<float>>());
  const Dist ref = distance(llama_prompt, exact["logits"], n);
  const Dist got = distance(ours.prompt, exact["logits"], n);

  std::vector<std::vector<float>> llama_steps;
  for (const auto& r : llama["greedy_logits"]) llama_steps.push_back(r.get<std::vector<float>>());
  const std::size_t k = shared_steps(exact, llama);
  const Dist ref_d = distance(llama_steps, exact["greedy_logits"], k);
  const Dist got_d = distance(ours.steps, exact["greedy_logits"], ours.steps.size());

  std::printf("[golden-kq fast] %-6s p40 prompt: ours max %.3f mean %.4f | llama.cpp max %.3f mean %.4f"
              " | decode (16 steps) ours max %.3f mean %.4f | llama.cpp (%zu shared steps) max %.3f mean %.4f\n",
              t.c_str(), got.max, got.mean, ref.max, ref.mean, got_d.max, got_d.mean, k, ref_d.max, ref_d.mean);
  EXPECT_LE(got.max, kFastBound * ref.max) << "prompt max |diff| vs exact";
  EXPECT_LE(got.mean, kFastBound * ref.mean) << "prompt mean |diff| vs exact";
  // Decode logits sit further from exact than prompt logits (llama.cpp's too), but its teacher-forced steps
  // are comparable only while its greedy tokens equal exact's (1 to 16 steps): the yardstick for decode
  // is the larger of llama.cpp's prompt and shared-step distances.
  EXPECT_LE(got_d.max, kFastBound * std::max(ref.max, ref_d.max)) << "decode max |diff| vs exact";
  EXPECT_LE(got_d.mean, kFastBound * std::max(ref.mean, ref_d.mean)) << "decode mean |diff| vs exact";
}

INSTANTIATE_TEST_SUITE_P(AllFiles, GoldenKqFast, ::testing::ValuesIn(kModels));

}  // namespace
