// pp::Sampler against the sampler before issue 18 (tests/common/reference_sampler.hpp): the same token for
// every (logits, params, seed, pos), over logit shapes, every sampler chain and edge values of each field.
#include <pp/text/sampler.hpp>

#include "../common/reference_sampler.hpp"
#include "../common/timing.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

// Draws are divided by this: 10 under ASan (gcc's or clang's), times $PP_TEST_DRAW_DIVISOR
// (scripts/test_arm.sh sets 20 under qemu, where a draw at the Llama-3 vocabulary takes ~50x its native time).
constexpr int kSanitizerScale = pp::test::kSanitized ? 10 : 1;
const int kScale = [] {
  const char* d = std::getenv("PP_TEST_DRAW_DIVISOR");
  const int v = d ? std::atoi(d) : 1;
  return kSanitizerScale * std::clamp(v, 1, 100);
}();
constexpr std::size_t kLlama3Vocab = 128256;

using Logits = std::vector<float>;

struct Chain {
  std::string name;
  pp::SamplingParams params;
  bool edge = false;  // an edge value: fewer draws at the Llama-3 vocabulary
};
pp::SamplingParams make(std::optional<double> t, std::optional<int64_t> k, std::optional<double> p,
                        std::optional<double> m) {
  pp::SamplingParams s;
  s.temperature = t, s.top_k = k, s.top_p = p, s.min_p = m;
  return s;
}
std::vector<Chain> chains(std::size_t V) {
  const std::optional<double> no;
  const std::optional<int64_t> nk;
  return {
      {"greedy", make(no, nk, no, no)},
      {"temp 1", make(1.0, nk, no, no)},
      {"temp 0.8 top_k 40", make(0.8, 40, no, no)},
      {"top_p 0.9", make(no, nk, 0.9, no)},
      {"min_p 0.05", make(no, nk, no, 0.05)},
      {"temp 0.7 top_k 40 top_p 0.95 min_p 0.05", make(0.7, 40, 0.95, 0.05)},
      {"top_k 1", make(no, 1, no, no), true},
      {"top_k V", make(no, int64_t(V), no, no), true},
      {"top_k V-1 temp 1.3", make(1.3, std::max<int64_t>(1, int64_t(V) - 1), no, no), true},
      {"top_p 1e-9", make(no, nk, 1e-9, no), true},
      {"top_p 1", make(no, nk, 1.0, no), true},
      {"top_p 0.5 temp 2", make(2.0, nk, 0.5, no), true},
      {"min_p 0.99", make(no, nk, no, 0.99), true},
      {"min_p 1e-6 temp 1.5", make(1.5, nk, no, 1e-6), true},
      {"top_p 0.99 min_p 0.001", make(no, nk, 0.99, 0.001), true},
      {"temp 1e-3", make(1e-3, nk, no, no), true},
      {"temp 100", make(100.0, nk, no, no), true},
      {"temp 100 top_p 0.9", make(100.0, nk, 0.9, no), true},
      {"temp 0.3", make(0.3, nk, no, no), true},
  };
}

// Logit shapes of V entries, each from its own fixed seed.
struct Shape {
  std::string name;
  std::function<Logits(std::size_t, std::mt19937&)> make;
};
std::vector<Shape> shapes() {
  auto gauss = [](std::size_t V, std::mt19937& rng, float sigma) {
    std::normal_distribution<float> g(0.f, sigma);
    Logits l(V);
    for (float& x : l) x = g(rng);
    return l;
  };
  return {
      // A real LM's head: the bulk N(0, 2^2) and a few plausible tokens far above it (as BM_Sample).
      {"gaussian+outliers", [=](std::size_t V, std::mt19937& rng) {
         Logits l = gauss(V, rng, 2.f);
         for (std::size_t j = 0; j < std::min<std::size_t>(8, V); ++j) l[(j * 15731 + 977) % V] = float(15 - int(j));
         return l;
       }},
      {"gaussian", [=](std::size_t V, std::mt19937& rng) { return gauss(V, rng, 1.f); }},
      // One token far ahead: most draws are the max, the rest the thin tail.
      {"peaked", [=](std::size_t V, std::mt19937& rng) {
         Logits l = gauss(V, rng, 3.f);
         l[V / 3] = 40.f;
         return l;
       }},
      {"flat", [](std::size_t V, std::mt19937&) { return Logits(V, 0.5f); }},
      // Coarsely quantized: many ties, broken by id; -0 and +0 both present.
      {"ties", [=](std::size_t V, std::mt19937& rng) {
         Logits l = gauss(V, rng, 2.f);
         for (float& x : l) x = std::round(x * 2.f) / 2.f;
         for (std::size_t i = 0; i < V; i += 7) l[i] = (i / 7) % 2 ? -0.f : 0.f;
         return l;
       }},
      {"nans", [=](std::size_t V, std::mt19937& rng) {
         Logits l = gauss(V, rng, 2.f);
         for (std::size_t i = 0; i < V; i += 3) l[i] = NAN;
         if (V > 2) l[V - 2] = NAN;
         return l;
       }},
      {"-inf", [=](std::size_t V, std::mt19937& rng) {
         Logits l = gauss(V, rng, 2.f);
         for (std::size_t i = 0; i < V; i += 2) l[i] = -INFINITY;
         return l;
       }},
      // Wide: a spread of 80 between the max and the bulk, most weights below 2^-64 of the top.
      {"wide", [=](std::size_t V, std::mt19937& rng) {
         Logits l = gauss(V, rng, 12.f);
         return l;
       }},
  };
}

// Every chain on every shape: the fast sampler's token equals the reference's for `draws` (seed, pos) pairs.
// The first few draws go through the reference's own sample() and check its prepared form agrees.
void compare(std::size_t V, int draws, int edge_draws, uint32_t seed, int& checked) {
  for (const auto& shape : shapes()) {
    std::mt19937 rng(seed);
    const Logits l = shape.make(V, rng);
    for (const auto& chain : chains(V)) {
      pp::Sampler fast;
      pp::test::ReferenceSampler ref;
      ref.prepare(l, chain.params);
      std::mt19937_64 draw_rng(seed * 7919 + V);
      for (int d = 0; d < (chain.edge ? edge_draws : draws); ++d) {
        pp::SamplingParams sp = chain.params;
        sp.seed = draw_rng();
        const int64_t pos = int64_t(draw_rng() % 1000000);
        const int32_t want = ref.draw(sp.seed, pos);
        if (d < 3) {
          ASSERT_EQ(ref.sample(l, sp, pos), want) << shape.name << " / " << chain.name;
        }
        ASSERT_EQ(fast.sample(l, sp, pos), want)
            << shape.name << " / " << chain.name << ", V " << V << ", seed " << sp.seed << ", pos " << pos;
        ++checked;
      }
    }
  }
}

TEST(Sampler, SameTokensAsReferenceTinyVocab) {
  int n = 0;
  for (std::size_t V = 1; V <= 8; ++V)
    for (uint32_t seed = 1; seed <= 4; ++seed) compare(V, 200 / kScale, 200 / kScale, seed, n);
  RecordProperty("draws", n);
}

TEST(Sampler, SameTokensAsReferenceSmallVocab) {
  int n = 0;
  compare(1000, 1000 / kScale, 1000 / kScale, 11, n);
  RecordProperty("draws", n);
}

TEST(Sampler, SameTokensAsReferenceLlama3Vocab) {
  int n = 0;
  compare(kLlama3Vocab, 500 / kScale, 40 / kScale, 5, n);  // ~0.5 ms a draw: the small vocabularies take the volume
  RecordProperty("draws", n);
}

// Logits that are all NaN, all -inf, or hold +inf: the definition's answers (the fast path steps aside).
TEST(Sampler, DegenerateLogits) {
  const std::vector<Logits> cases = {
      Logits(16, NAN), Logits(16, -INFINITY), {1.f, INFINITY, 2.f, INFINITY}, {NAN, -INFINITY, 3.f, NAN}, {NAN}};
  for (const auto& l : cases)
    for (const auto& chain : chains(l.size())) {
      pp::Sampler fast;
      pp::test::ReferenceSampler ref;
      for (int64_t pos = 0; pos < 200; ++pos) {
        pp::SamplingParams sp = chain.params;
        sp.seed = uint64_t(pos) * 31;
        ASSERT_EQ(fast.sample(l, sp, pos), ref.sample(l, sp, pos)) << chain.name << ", pos " << pos;
      }
    }
}

// The vectorised exponentials of the fast path stay inside the error bounds its margins are derived from
// (pp::detail::kExpUlps, kExpUlpsD), on this build's architecture (FMA or not): a dense sample of [0, 64].
TEST(Sampler, ExpErrorBounds) {
  using namespace pp::detail;
  constexpr std::size_t W = kSW;
  alignas(64) float xf[W], wf[W];
  alignas(64) double xd[W / 2], wd[W / 2];
  double worst_f = 0, worst_d = 0;
  const int steps = 2000000 / kScale;
  for (int i = 0; i < steps; i += int(W)) {
    for (std::size_t k = 0; k < W; ++k) xf[k] = float(i + int(k)) * (64.f / float(steps)) * (1.f + 1e-7f * float(k));
    exp_neg<SA>(SF::load_aligned(xf)).store_aligned(wf);
    for (std::size_t k = 0; k < W; ++k) {
      const double e = std::exp(-double(xf[k]));
      if (xf[k] <= kMaxX) worst_f = std::max(worst_f, std::fabs(double(wf[k]) - e) / e);
    }
    for (std::size_t k = 0; k < W / 2; ++k) xd[k] = double(i + int(k)) * (64.0 / steps) * (1 + 1e-9 * double(k));
    exp_neg_d<SA>(SD::load_aligned(xd)).store_aligned(wd);
    for (std::size_t k = 0; k < W / 2; ++k) {
      const long double e = std::exp(-static_cast<long double>(xd[k]));
      worst_d = std::max(worst_d, double(std::fabs(static_cast<long double>(wd[k]) - e) / e));
    }
  }
  EXPECT_LE(worst_f, kExpUlps / 2 * 0x1p-24);  // half the bound the margins use
  EXPECT_LE(worst_d, kExpUlpsD / 2 * 0x1p-53);
  // Outside the domain: 0.
  const float odd[4] = {65.f, INFINITY, NAN, 1e30f};
  for (const float x : odd) EXPECT_EQ(exp_neg<SA>(SF(x)).get(0), 0.f) << x;
  EXPECT_EQ(exp_neg<SA>(SF(0.f)).get(0), 1.f);
  EXPECT_EQ(exp_neg_d<SA>(SD(0.0)).get(0), 1.0);
}

// Logits placed on the fast path's boundaries: distances from the max at its level-1 thresholds and the
// head's edge (ln 4096), ulps either side, -0 / +0, -inf mixed in, narrow ranges (the thresholds then
// split the range), all equal but one, and parameters at their edges (top_k past the vocabulary, top_p 1,
// min_p 0, tiny and huge temperatures): the reference's token every time.
TEST(Sampler, AdversarialBoundaries) {
  std::vector<std::pair<std::string, Logits>> cases;
  for (const std::size_t V : {64u, 65u, 1000u, 4099u}) {
    std::mt19937 rng{uint32_t(V)};
    Logits l(V);
    const float dist[] = {0.f, 1.f, 2.f, 4.f, 6.f, 8.f, 8.317766f, 10.f, 12.f, 16.f, 45.f, 64.f, 70.f};
    for (std::size_t i = 0; i < V; ++i) {
      float d = dist[rng() % std::size(dist)];
      const int ulps = int(rng() % 5) - 2;
      for (int k = 0; k < std::abs(ulps); ++k) d = std::nextafter(d, ulps > 0 ? INFINITY : -INFINITY);
      l[i] = 3.f - d;
    }
    for (std::size_t i = 0; i < V; i += 11) l[i] = -INFINITY;
    l[V / 2] = 3.f;
    cases.push_back({"thresholds V " + std::to_string(V), l});
    Logits z(V, -0.f);
    for (std::size_t i = 0; i < V; i += 2) z[i] = 0.f;
    z[V - 1] = -INFINITY;
    cases.push_back({"zeros V " + std::to_string(V), z});
    Logits narrow(V);
    for (std::size_t i = 0; i < V; ++i) narrow[i] = 1.f + float(i % 17) * 1e-6f;
    cases.push_back({"narrow V " + std::to_string(V), narrow});
    Logits one(V, 2.f);
    one[V / 3] = 2.5f;
    cases.push_back({"all equal but one V " + std::to_string(V), one});
  }
  const std::optional<double> no;
  const std::optional<int64_t> nk;
  std::vector<Chain> cs = chains(4099);
  cs.push_back({"top_k 1e9", make(no, int64_t(1e9), no, no)});
  cs.push_back({"top_p 1 min_p 0", make(no, nk, 1.0, 0.0)});
  cs.push_back({"temp 1e-30", make(1e-30, nk, no, no)});
  cs.push_back({"temp 1e30", make(1e30, nk, no, no)});
  cs.push_back({"temp 1e-30 top_p 0.9", make(1e-30, nk, 0.9, no)});
  cs.push_back({"temp 20 top_p 0.999", make(20.0, nk, 0.999, no)});
  cs.push_back({"min_p 0.5 top_p 0.3", make(no, nk, 0.3, 0.5)});
  for (const auto& [name, l] : cases)
    for (const auto& chain : cs) {
      pp::Sampler fast;
      pp::test::ReferenceSampler ref;
      for (int64_t pos = 0; pos < 300 / kScale; ++pos) {
        pp::SamplingParams sp = chain.params;
        sp.seed = uint64_t(pos) * 0x9e3779b97f4a7c15ull + 7;
        ASSERT_EQ(fast.sample(l, sp, pos), ref.sample(l, sp, pos)) << name << " / " << chain.name << ", pos " << pos;
      }
    }
}

// pp::argmax (vectorised; the reference sampler uses it too) against the scalar definition: the first
// index of the largest non-NaN logit, 0 when all are NaN; NaNs, ties, -0 / +0 and +-inf in every lane.
TEST(Sampler, ArgmaxMatchesScalar) {
  auto scalar = [](const Logits& l) {
    int32_t best = -1;
    for (std::size_t i = 0; i < l.size(); ++i)
      if (!std::isnan(l[i]) && (best < 0 || l[i] > l[std::size_t(best)])) best = int32_t(i);
    return best < 0 ? 0 : best;
  };
  std::mt19937 rng(3);
  for (std::size_t V : {1u, 2u, 15u, 16u, 17u, 31u, 33u, 100u, 1000u}) {
    for (int trial = 0; trial < 200; ++trial) {
      Logits l(V);
      const float pool[] = {NAN, -INFINITY, INFINITY, 0.f, -0.f, 1.f, 1.f, 2.f, -3.f};
      for (float& x : l) x = pool[rng() % std::size(pool)];
      if (trial % 3 == 0)
        for (float& x : l) x = x == INFINITY ? 5.f : x;
      if (trial % 7 == 0) l.assign(V, NAN);
      ASSERT_EQ(pp::argmax(l), scalar(l)) << "V " << V << ", trial " << trial;
    }
  }
}

TEST(Sampler, NeverNaN) {
  Logits l(64, NAN);
  l[5] = 1.f, l[9] = 1.f;
  pp::Sampler s;
  for (int64_t pos = 0; pos < 500; ++pos) {
    const int32_t t = s.sample(l, make(50.0, std::nullopt, std::nullopt, std::nullopt), pos);
    ASSERT_TRUE(t == 5 || t == 9);
  }
  EXPECT_EQ(pp::argmax(l), 5);
}

}  // namespace
