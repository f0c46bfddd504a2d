// Split invariance: stages chained in one process give the unsplit logits bit for bit (f32 residual).
#include <pp/kernels/gemm_f16.hpp>
#include <pp/local_pipeline.hpp>
#include <pp/stage.hpp>
#include <pp/text/sampler.hpp>

#include "../common/fixtures.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

namespace {

std::string tiny(const std::string& dt = "f32") {
  return (pp::test::data_dir() / "golden-tiny" / ("golden-tiny-" + dt + ".gguf")).string();
}

// Every way to cut n_layer blocks into n_stages non-empty contiguous ranges.
std::vector<std::vector<int>> all_cuts(int n_layer, int n_stages) {
  std::vector<std::vector<int>> out;
  std::vector<int> cur;
  std::function<void(int)> rec = [&](int lo) {
    if (int(cur.size()) == n_stages - 1) {
      out.push_back(cur);
      return;
    }
    for (int c = lo + 1; c < n_layer; ++c) {
      cur.push_back(c);
      rec(c);
      cur.pop_back();
    }
  };
  rec(0);
  return out;
}

// Logits of a prompt followed by `decode` greedy steps: [(1 + decode), V] of the last rows.
std::vector<float> run(pp::LocalPipeline& p, const std::vector<int32_t>& prompt, int decode) {
  const std::size_t V = p.config().n_vocab;
  std::vector<float> out((1 + decode) * V);
  p.run(prompt, 0, out.data());
  for (int i = 0; i < decode; ++i) {
    const int32_t t = pp::argmax({&out[i * V], V});
    p.run({&t, 1}, int64_t(prompt.size() + i), &out[(i + 1) * V]);
  }
  return out;
}

const std::vector<int32_t> kPrompt = {496, 198, 303, 365, 321, 74, 280, 81, 405, 281, 78, 87, 220, 73, 313, 79};

TEST(SplitInvariance, EveryCutOfGoldenTinyIsBitIdenticalWithF32Residual) {
  for (const std::string dt : {"f32", "bf16"}) {
    pp::LocalPipeline whole(tiny(dt), {}, pp::WireDType::F32, {.threads = 2});
    const std::vector<float> want = run(whole, kPrompt, 6);
    int checked = 0;
    for (int n = 2; n <= 4; ++n)
      for (const auto& cuts : all_cuts(4, n)) {
        pp::LocalPipeline split(tiny(dt), cuts, pp::WireDType::F32, {.threads = 2});
        const std::vector<float> got = run(split, kPrompt, 6);
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)))
            << dt << " cuts of size " << cuts.size();
        ++checked;
      }
    EXPECT_EQ(checked, 3 + 3 + 1);  // C(3,1) + C(3,2) + C(3,3)
  }
}

TEST(SplitInvariance, ThreadCountDoesNotChangeLogits) {
  pp::LocalPipeline one(tiny(), {}, pp::WireDType::F32, {.threads = 1});
  pp::LocalPipeline two(tiny(), {2}, pp::WireDType::F32, {.threads = 2});
  pp::LocalPipeline three(tiny(), {1, 3}, pp::WireDType::F32, {.threads = 3});
  const auto a = run(one, kPrompt, 4), b = run(two, kPrompt, 4), c = run(three, kPrompt, 4);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
  EXPECT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * 4));
}

// Logits at every position of `prompt` fed in requests of `step` rows (the stage's chunking at max_rows).
std::vector<float> logits_in_steps(const std::string& path, const std::vector<int32_t>& prompt, std::size_t step,
                                   std::size_t max_rows, bool fast_float = false) {
  auto st = pp::Stage::open_full(path, {.max_rows = max_rows, .fast_float = fast_float});
  const std::size_t E = st->config().n_embd, V = st->config().n_vocab;
  pp::Sequence seq = st->new_sequence();
  std::vector<float> out(prompt.size() * V), rows;
  for (std::size_t i = 0; i < prompt.size(); i += step) {
    const std::size_t n = std::min(step, prompt.size() - i);
    rows.resize(n * E);
    st->embed({&prompt[i], n}, rows.data());
    st->forward(seq, int64_t(i), rows.data(), n);
    for (std::size_t r = 0; r < n; ++r) st->head(seq, rows.data() + r * E, 1, &out[(i + r) * V]);
  }
  return out;
}

TEST(SplitInvariance, PrefillEqualsTokenByToken) {
  // Each row's arithmetic does not depend on how many rows of a request travel together: requests
  // shorter than kBulkRows (decode steps, short prompts) all take the vector path...
  for (const char* dt : {"f32", "bf16", "f16"}) {
    const std::vector<int32_t> p15(kPrompt.begin(), kPrompt.begin() + pp::kernels::kBulkRows - 1);
    const auto one = logits_in_steps(tiny(dt), p15, 1, 5);
    EXPECT_EQ(one, logits_in_steps(tiny(dt), p15, p15.size(), 5)) << dt;
    EXPECT_EQ(one, logits_in_steps(tiny(dt), p15, 4, 3)) << dt;
  }
  // ...and bulk requests (prompts of kBulkRows or more) agree with each other however the stage
  // chunks them. Bulk rows of float weights run on tile kernels (AMX, or the vector register tiles of
  // gemm.hpp): the same to within f32 rounding as the dot kernels of a decode step.
  std::vector<int32_t> p40;
  for (int i = 0; i < 40; ++i) p40.push_back((kPrompt[std::size_t(i) % kPrompt.size()] + 7 * i) % 500);
  for (const bool fast : {false, true}) {
    if (fast && !pp::kernels::kHaveFastFloat) continue;
    for (const char* dt : {"f32", "bf16", "f16"}) {
      SCOPED_TRACE(std::string(dt) + (fast ? " fast_float" : " exact"));
      const auto bulk = logits_in_steps(tiny(dt), p40, 40, 128, fast);
      EXPECT_EQ(bulk, logits_in_steps(tiny(dt), p40, 40, 7, fast));
      EXPECT_EQ(bulk, logits_in_steps(tiny(dt), p40, 20, 20, fast));
      const auto one = logits_in_steps(tiny(dt), p40, 1, 128, fast);
      const pp::DType t = std::string(dt) == "f32" ? pp::DType::F32 : std::string(dt) == "f16" ? pp::DType::F16
                                                                                                : pp::DType::BF16;
      if (!pp::kernels::bulk_on_tiles(t)) {
        EXPECT_EQ(bulk, one);
        continue;
      }
      double worst = 0;
      for (std::size_t i = 0; i < one.size(); ++i) worst = std::max(worst, double(std::abs(bulk[i] - one[i])));
      // bf16 activations / int16 codes in the prompt, f32 in decode
      const bool bf16_dot = fast && t == pp::DType::BF16 && pp::kernels::gemm::kHaveFastBf16;
      const bool f16_tiles = fast && t == pp::DType::F16 && pp::kernels::gemm_f16::kAvailable;
      const bool rounded = bf16_dot || f16_tiles;
      std::printf("[split] %s%s: bulk (%s) vs token by token: max |diff| %.3g\n", dt, fast ? " fast_float" : "",
                  bf16_dot    ? "bf16 dot"
                  : f16_tiles ? "int16 tiles"
                  : pp::kernels::amx::available() && t != pp::DType::F32 ? "AMX" : "vector tiles",
                  worst);
      if (!rounded) {
        EXPECT_LT(worst, 1e-4);
      }  // the rounded path's distance is bounded by the golden tests
    }
  }
}

TEST(SplitInvariance, Bf16WireRoundsAtEachCutOnly) {
  // A bf16 wire changes the result (so the rounding is really applied) but stays close to f32.
  pp::LocalPipeline f32(tiny(), {2}, pp::WireDType::F32, {.threads = 2});
  pp::LocalPipeline b16(tiny(), {2}, pp::WireDType::BF16, {.threads = 2});
  pp::LocalPipeline whole(tiny(), {}, pp::WireDType::BF16, {.threads = 2});  // no cut: nothing rounded
  const auto a = run(f32, kPrompt, 2), b = run(b16, kPrompt, 2), w = run(whole, kPrompt, 2);
  EXPECT_NE(0, std::memcmp(a.data(), b.data(), a.size() * 4));
  EXPECT_EQ(0, std::memcmp(a.data(), w.data(), a.size() * 4));
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, double(std::abs(a[i] - b[i])));
  EXPECT_LT(d, 0.5);
}

// What a coordinator announces before its stage has loaded is what the stage then reports.
TEST(Stage, KernelProfileIsKnownBeforeTheStageLoads) {
  const std::string q8 = (pp::test::data_dir() / "golden-kq" / "golden-kq-q8_0.gguf").string();
  for (const std::string& path : {tiny("f32"), tiny("bf16"), tiny("f16"), q8}) {
    const auto model = pp::Model::open(path);
    for (const bool fast : {false, true}) {
      pp::StageOptions so;
      so.fast_float = fast;
      const pp::Stage st(model, pp::LayerRange{0, 1}, so);
      EXPECT_EQ(pp::Stage::kernel_profile_for(*model, so), st.kernel_profile()) << path << (fast ? " fast" : "");
      // F16 prompts on the int16 tiles say so; the exact path and the other files do not.
      EXPECT_EQ(st.kernel_profile().find("+f16tiles") != std::string::npos,
                fast && path == tiny("f16") && pp::kernels::gemm_f16::kAvailable)
          << path << (fast ? " fast" : "");
    }
  }
}

// An ended sequence's KV cache goes to the stage's pool and the next sequence takes it: what was in it
// never shows (a reused cache gives the bits of a fresh one, the ring wrapped or not).
TEST(Stage, ReusedKvCacheGivesTheBitsOfAFreshOne) {
  auto st = pp::Stage::open_full(tiny("bf16"), {.ctx = 24, .threads = 1});
  const std::size_t E = st->config().n_embd, V = st->config().n_vocab;
  auto run = [&](pp::Sequence& seq, int salt, int n) {
    std::vector<int32_t> toks;
    for (int i = 0; i < n; ++i) toks.push_back(int32_t((i * 31 + salt * 7) % 500));
    std::vector<float> rows(std::size_t(n) * E), logits(V);
    st->embed(toks, rows.data());
    st->forward(seq, 0, rows.data(), std::size_t(n));
    st->head(seq, rows.data() + std::size_t(n - 1) * E, 1, logits.data());
    for (int i = 0; i < 20; ++i) {  // decode steps: the 24-slot ring wraps
      std::vector<float> r(E);
      st->embed(std::vector<int32_t>{int32_t((i * 13 + salt) % 500)}, r.data());
      st->forward(seq, seq.n_past(), r.data(), 1);
      st->head(seq, r.data(), 1, logits.data());
    }
    return logits;
  };
  std::vector<float> fresh;
  {
    pp::Sequence a = st->new_sequence();
    fresh = run(a, 1, 9);
  }
  EXPECT_EQ(st->pooled_caches(), 1u);
  {
    pp::Sequence other = st->new_sequence();
    EXPECT_EQ(st->pooled_caches(), 0u) << "the new sequence takes the pooled cache";
    run(other, 5, 17);  // fills it with another sequence's keys and values
  }
  pp::Sequence b = st->new_sequence(), c = st->new_sequence();
  EXPECT_EQ(st->pooled_caches(), 0u);
  EXPECT_EQ(run(b, 1, 9), fresh) << "a reused cache";
  EXPECT_EQ(run(c, 1, 9), fresh) << "a new cache";
  pp::Sequence moved = std::move(b);
  b = std::move(c);  // c's cache now in b; moved-from c holds nothing
  EXPECT_EQ(st->pooled_caches(), 0u);
  moved = std::move(b);  // the cache moved held ends: pooled
  EXPECT_EQ(st->pooled_caches(), 1u);
}

TEST(Stage, RolesAreEnforced) {
  pp::Stage mid(tiny(), {1, 3});
  std::vector<float> buf(64 * 512);
  const int32_t t = 1;
  EXPECT_THROW(mid.embed({&t, 1}, buf.data()), pp::RequestError);
  pp::Sequence s = mid.new_sequence();
  EXPECT_THROW(mid.head(s, buf.data(), 1, buf.data()), pp::RequestError);
  pp::Stage first(tiny(), {0, 2});
  const int32_t bad = 512;
  EXPECT_THROW(first.embed({&bad, 1}, buf.data()), pp::RequestError);
  EXPECT_THROW(pp::Stage(tiny(), {3, 5}), pp::Error);
}

TEST(Stage, LayerRangeAsSpecified) {
  EXPECT_EQ(pp::compute_layer_range(0, 2, 16), (pp::LayerRange{0, 8}));
  EXPECT_EQ(pp::compute_layer_range(1, 2, 15), (pp::LayerRange{7, 15}));
  EXPECT_EQ(pp::compute_layer_range(2, 3, 16), (pp::LayerRange{10, 16}));
  EXPECT_THROW(pp::compute_layer_range(0, 1, 16), pp::Error);
  EXPECT_THROW(pp::compute_layer_range(2, 2, 16), pp::Error);
  EXPECT_THROW(pp::compute_layer_range(-1, 2, 16), pp::Error);
  EXPECT_THROW(pp::compute_layer_range(0, 5, 4), pp::Error);
}

TEST(Stage, MapsOnlyItsShare) {
  pp::Stage a(tiny(), {0, 2}), b(tiny(), {2, 4});
  auto whole = pp::Stage::open_full(tiny());
  // Tied output: token_embd is read by the first stage (embedding) and the last (output).
  EXPECT_LT(a.bytes_used(), whole->bytes_used());
  EXPECT_LT(b.bytes_used(), whole->bytes_used());
  EXPECT_GT(a.bytes_used() + b.bytes_used(), whole->bytes_used());
}

}  // namespace

namespace {
TEST(Stage, AnonymousResidencyGivesTheSameLogitsAsMapped) {
  for (const std::vector<int>& cuts : {std::vector<int>{}, std::vector<int>{2}}) {
    pp::LocalPipeline mapped(tiny("bf16"), cuts, pp::WireDType::F32, {.residency = pp::Residency::Mapped});
    pp::LocalPipeline anon(tiny("bf16"), cuts, pp::WireDType::F32, {.residency = pp::Residency::Anonymous});
    const auto a = run(mapped, kPrompt, 3), b = run(anon, kPrompt, 3);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
  }
}
}  // namespace

namespace {
// Sequences stepped together give each sequence exactly the logits it gets alone.
TEST(Stage, BatchedSequencesEqualSequencesRunAlone) {
  auto st = pp::Stage::open_full(tiny("bf16"), {.ctx = 24, .threads = 2, .max_rows = 7});
  const std::size_t E = st->config().n_embd, V = st->config().n_vocab;
  const int n_seq = 5;
  std::vector<std::vector<int32_t>> toks(n_seq);
  for (int q = 0; q < n_seq; ++q)
    for (int i = 0; i < 40; ++i) toks[q].push_back(int32_t((q * 131 + i * 17) % 496));
  std::vector<pp::Sequence> alone, together;
  for (int q = 0; q < n_seq; ++q) alone.push_back(st->new_sequence()), together.push_back(st->new_sequence());
  // Prompts of different lengths, then decode steps; the ring (24) wraps during the run.
  std::vector<int64_t> pos(n_seq, 0);
  for (int step = 0; step < 12; ++step) {
    std::vector<pp::Stage::BatchEntry> batch;
    std::vector<float> rows, want;
    for (int q = 0; q < n_seq; ++q) {
      const std::size_t n = step == 0 ? std::size_t(1 + q * 2) : 1 + std::size_t(step % 2) * (q % 2);
      std::vector<float> r(n * E);
      st->embed({toks[q].data() + pos[q], n}, r.data());
      batch.push_back({&together[q], pos[q], n});
      rows.insert(rows.end(), r.begin(), r.end());
      st->forward(alone[q], pos[q], r.data(), n);
      want.insert(want.end(), r.begin(), r.end());
      pos[q] += int64_t(n);
    }
    st->forward_batch(batch, rows.data());
    ASSERT_EQ(0, std::memcmp(rows.data(), want.data(), rows.size() * 4)) << "step " << step;
  }
  std::vector<float> l(V);
  for (int q = 0; q < n_seq; ++q) EXPECT_EQ(together[q].n_past(), alone[q].n_past());
  // A batch with one invalid entry changes nothing.
  std::vector<float> rows(2 * E);
  std::vector<pp::Stage::BatchEntry> bad = {{&together[0], pos[0], 1}, {&together[1], pos[1] + 5, 1}};
  EXPECT_THROW(st->forward_batch(bad, rows.data()), pp::RequestError);
  EXPECT_EQ(together[0].n_past(), pos[0]);
  std::vector<pp::Stage::BatchEntry> twice = {{&together[0], pos[0], 1}, {&together[0], pos[0], 1}};
  EXPECT_THROW(st->forward_batch(twice, rows.data()), pp::RequestError);
}
}  // namespace

namespace {
// The head's logits of a row do not depend on how many rows one call asks for (a prompt's last row, all
// of them as pp_generate --logits-out does, one per sequence of a decoding batch): bit for bit, on
// both numeric paths.
TEST(SplitInvariance, HeadRowsDoNotDependOnHowManyAreAsked) {
  for (const bool fast : {false, true})
  for (const char* dt : {"f32", "bf16", "f16"}) {
    auto st = pp::Stage::open_full(tiny(dt), {.threads = 2, .fast_float = fast});
    const std::size_t E = st->config().n_embd, V = st->config().n_vocab, n = 24;
    std::vector<int32_t> toks;
    for (std::size_t i = 0; i < n; ++i) toks.push_back(int32_t((kPrompt[i % kPrompt.size()] + 11 * i) % 500));
    pp::Sequence seq = st->new_sequence();
    std::vector<float> rows(n * E), all(n * V), one(V);
    st->embed(toks, rows.data());
    st->forward(seq, 0, rows.data(), n);
    st->head(seq, rows.data(), n, all.data());
    for (std::size_t i : {std::size_t(0), n / 2, n - 1}) {
      st->head(seq, rows.data() + i * E, 1, one.data());
      EXPECT_EQ(0, std::memcmp(one.data(), &all[i * V], V * 4)) << dt << (fast ? " fast" : " exact") << " row " << i;
    }
  }
}
}  // namespace
