// pp::Sampler against the sampler before issue 18 (tests/common/reference_sampler.hpp): the same token for
// every (logits, params, seed, pos), over logit shapes, every sampler chain and edge values of each field.
#include <pp/text/sampler.hpp>

#include "../common/reference_sampler.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr int kScale = 10;  // ASan: a tenth of the draws
#else
constexpr int kScale = 1;
#endif
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
