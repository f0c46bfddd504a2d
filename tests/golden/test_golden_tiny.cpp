// Golden: logits of golden-tiny (F32/F16/BF16) against the float64 reference, prompt and teacher-forced decode.
#include <pp/kernels/gemm.hpp>
#include <pp/kernels/gemm_f16.hpp>
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
  // The exact path (f32 activations) must match float64 within kTol; GoldenTinyFast covers the fast one.
  auto st = pp::Stage::open_full(model_path(dt), {.threads = 2, .fast_float = false});
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

// The fast paths of float weights against the same float64 reference, over the prompt (bulk) and the
// teacher-forced decode that reads its KV cache: at most 1.25x llama.cpp's own distance (kvf32 file,
// activations rounded to bf16 / f16) over the same positions and ids. BF16: activations rounded to bf16,
// the bf16 dot (kernels/gemm.hpp's tiles for the prompt, kernels/matmul.hpp's dot tiles for decode);
// F16: the prompt on kernels/gemm_f16.hpp's int16 tiles, decode exact.
class GoldenTinyFast : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(GoldenTinyFast, PromptWithinLlamaCppsDistanceOfExact) {
  const auto& [dt, prompt] = GetParam();
  if (dt == "bf16" && !pp::kernels::gemm::kHaveFastBf16)
    GTEST_SKIP() << "no bf16 dot in this build (AVX512-BF16, AArch64 BF16): no fast path";
  if (dt == "f16" && !pp::kernels::gemm_f16::kAvailable)
    GTEST_SKIP() << "no int16 tiles in this build (AVX512-VNNI, or AVX2 without AVX-512): no fast path for F16";
  const auto dir = pp::test::data_dir() / "golden-tiny";
  const json ref = pp::test::load_json(dir / ("golden-tiny-" + dt + "." + prompt + ".exact.json"));
  const json llama = pp::test::load_json(dir / ("golden-tiny-" + dt + "." + prompt + ".kvf32.json"));
  auto st = pp::Stage::open_full(model_path(dt), {.threads = 2, .fast_float = true});
  ASSERT_TRUE(st->fast_float());
  const std::size_t V = st->config().n_vocab, E = st->config().n_embd;
  const std::vector<int32_t> toks = ref["prompt_tokens"].get<std::vector<int32_t>>();
  ASSERT_GE(toks.size(), pp::kernels::kBulkRows);
  pp::Sequence seq = st->new_sequence();
  std::vector<float> rows(toks.size() * E), logits(toks.size() * V);
  st->embed(toks, rows.data());
  st->forward(seq, 0, rows.data(), toks.size());
  st->head(seq, rows.data(), toks.size(), logits.data());

  // Distances over the ids the reference lists for a position (all of them where it has full logits).
  auto distance = [&](const json& ours_full, const std::vector<float>* ours, std::size_t pos, const json& exact_full,
                      const json& exact_top, const json& other_top) {
    double d = 0;
    auto ours_at = [&](int id) {
      if (ours) return double((*ours)[pos * V + std::size_t(id)]);
      if (!ours_full.is_null()) return ours_full[std::size_t(id)].get<double>();
      for (const auto& e : other_top)
        if (e[0].get<int>() == id) return e[1].get<double>();
      return std::nan("");
    };
    if (!exact_full.is_null()) {
      for (std::size_t v = 0; v < exact_full.size(); ++v)
        d = std::max(d, std::abs(ours_at(int(v)) - exact_full[v].get<double>()));
    } else {
      for (const auto& e : exact_top) {
        const double o = ours_at(e[0].get<int>());
        if (!std::isnan(o)) d = std::max(d, std::abs(o - e[1].get<double>()));
      }
    }
    return d;
  };
  double ours_max = 0, llama_max = 0;
  for (std::size_t i = 0; i < toks.size(); ++i) {
    const json exact_full = ref.contains("logits") ? ref["logits"][i] : json();
    ours_max = std::max(ours_max, distance(json(), &logits, i, exact_full, ref["logits_top"][i], json()));
    llama_max = std::max(llama_max, distance(llama.contains("logits") ? llama["logits"][i] : json(), nullptr, 0,
                                             exact_full, ref["logits_top"][i], llama["logits_top"][i]));
  }
  // Teacher-forced decode on the fast prompt's cache, on the fast path too.
  const std::vector<int32_t> greedy = ref["greedy"].get<std::vector<int32_t>>();
  std::vector<float> row(E), step(V);
  std::copy(&logits[(toks.size() - 1) * V], &logits[toks.size() * V], step.begin());
  for (std::size_t i = 0; i < greedy.size(); ++i) {
    if (i > 0) {
      const int32_t t = greedy[i - 1];
      st->embed({&t, 1}, row.data());
      st->forward(seq, int64_t(toks.size() + i - 1), row.data(), 1);
      st->head(seq, row.data(), 1, step.data());
    }
    const json exact_full = ref.contains("greedy_logits") ? ref["greedy_logits"][i] : json();
    ours_max = std::max(ours_max, distance(json(), &step, 0, exact_full, ref["greedy_logits_top"][i], json()));
    llama_max = std::max(llama_max, distance(llama.contains("greedy_logits") ? llama["greedy_logits"][i] : json(),
                                             nullptr, 0, exact_full, ref["greedy_logits_top"][i],
                                             llama["greedy_logits_top"][i]));
  }
  std::printf("[golden fast] %s %s: max |diff| from exact %.3g (llama.cpp kvf32: %.3g, ratio %.2f)\n", dt.c_str(),
              prompt.c_str(), ours_max, llama_max, ours_max / llama_max);
  EXPECT_GT(ours_max, 1e-6) << "the fast path gave exact results: was it taken?";
  EXPECT_LE(ours_max, 1.25 * llama_max);
}

INSTANTIATE_TEST_SUITE_P(BulkPrompts, GoldenTinyFast,
                         ::testing::Combine(::testing::Values("bf16", "f16"), ::testing::Values("p40", "p300")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

}  // namespace
