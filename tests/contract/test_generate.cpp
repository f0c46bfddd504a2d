// pp_generate as users run it: its simulated split equals hand-chained stages bit for bit (bf16 and f32 wires).
#include <pp/local_pipeline.hpp>
#include <pp/stage.hpp>
#include <pp/text/sampler.hpp>

#include "../common/fixtures.hpp"
#include "../common/node_process.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace {

std::string tiny() { return (pp::test::data_dir() / "golden-tiny" / "golden-tiny-bf16.gguf").string(); }
const std::vector<int32_t> kPrompt = {496, 198, 303, 365, 321, 74, 280};

// pp_generate's exit status on `args` (output discarded); a run killed after 60 s (scaled) is also a failure.
int run_generate(std::vector<std::string> args) {
  args.insert(args.begin(), pp::test::tool_path("pp_generate"));
  return pp::test::run_checked(args, std::chrono::seconds(60)).code;
}

// Stages [0,c1), [c1,c2), ... chained by hand, the residual rounded to bf16 at each cut.
std::vector<float> hand_chain(const std::vector<int>& cuts, int n_steps, std::vector<int32_t>& greedy) {
  std::vector<std::unique_ptr<pp::Stage>> st;
  std::vector<pp::Sequence> seq;
  int lo = 0;
  for (std::size_t i = 0; i <= cuts.size(); ++i) {
    const int hi = i < cuts.size() ? cuts[i] : 4;
    st.push_back(std::make_unique<pp::Stage>(tiny(), pp::LayerRange{lo, hi}));
    seq.push_back(st.back()->new_sequence());
    lo = hi;
  }
  const std::size_t E = st[0]->config().n_embd, V = st[0]->config().n_vocab;
  std::vector<float> logits;
  std::vector<int32_t> in = kPrompt;
  int64_t pos = 0;
  for (int s = 0; s < n_steps; ++s) {
    std::vector<float> x(in.size() * E), l(V);
    st[0]->embed(in, x.data());
    for (std::size_t k = 0; k < st.size(); ++k) {
      if (k > 0)
        for (float& v : x) v = pp::bf16_to_f32(pp::f32_to_bf16(v));
      st[k]->forward(seq[k], pos, x.data(), in.size());
    }
    st.back()->head(seq.back(), x.data() + (in.size() - 1) * E, 1, l.data());
    logits.insert(logits.end(), l.begin(), l.end());
    greedy.push_back(pp::argmax(l));
    pos += int64_t(in.size());
    in = {greedy.back()};
  }
  return logits;
}

TEST(Generate, Bf16SimulatedSplitEqualsHandChainedStages) {
  const auto out = std::filesystem::temp_directory_path() / ("pp_gen_" + std::to_string(getpid()) + ".json");
  for (const std::vector<int>& cuts : {std::vector<int>{2}, std::vector<int>{1, 3}, std::vector<int>{1, 2, 3}}) {
    std::string cs;
    for (int c : cuts) {
      if (!cs.empty()) cs += ',';
      cs += std::to_string(c);
    }
    ASSERT_EQ(0, run_generate({"-m", tiny(), "--prompt-ids", "496,198,303,365,321,74,280", "-n", "6", "--ignore-eos", "--wire", "bf16",
                               "--cuts", cs, "--logits-out", out.string()}));
    const auto j = pp::test::load_json(out);
    std::vector<int32_t> greedy;
    const std::vector<float> want = hand_chain(cuts, 6, greedy);
    EXPECT_EQ(j["greedy"].get<std::vector<int32_t>>(), greedy);
    std::vector<float> got;
    got.insert(got.end(), j["logits"].back().begin(), j["logits"].back().end());  // last prompt row
    for (std::size_t i = 0; i + 1 < j["greedy_logits"].size(); ++i)
      for (const auto& v : j["greedy_logits"][i + 1]) got.push_back(v.get<float>());
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * 4)) << "cuts " << cs;
  }
  std::filesystem::remove(out);
}

TEST(Generate, UnsplitGreedyMatchesGoldenAndBadArgumentsAreRefused) {
  const auto out = std::filesystem::temp_directory_path() / ("pp_gen2_" + std::to_string(getpid()) + ".json");
  ASSERT_EQ(0, run_generate({"-m", tiny(), "--prompt-ids", "496,198,303,365,321,74,280", "-n", "16", "--ignore-eos", "--logits-out",
                            out.string()}));
  const auto ref = pp::test::load_json(pp::test::data_dir() / "golden-tiny" / "golden-tiny-bf16.p7.exact.json");
  EXPECT_EQ(pp::test::load_json(out)["greedy"], ref["greedy"]);
  std::filesystem::remove(out);
  // Each cannot start: exit 2.
  EXPECT_EQ(2, run_generate({"-m", tiny(), "--prompt-ids", "1,x"}));
  EXPECT_EQ(2, run_generate({"-m", tiny(), "--prompt-ids", "99999"}));   // outside the vocabulary
  EXPECT_EQ(2, run_generate({"-m", "/nonexistent.gguf", "--prompt-ids", "1"}));
  EXPECT_EQ(2, run_generate({"-m", tiny(), "--prompt-ids", "1", "--cuts", "4"}));  // cut at the last block
  EXPECT_EQ(2, run_generate({"-m", tiny(), "--prompt-ids", "1", "--temperature", "-1"}));
  EXPECT_EQ(2, run_generate({"-m", tiny(), "--prompt-ids", "1", "--temperature", "0", "--top-p", "2"}));
}

}  // namespace
