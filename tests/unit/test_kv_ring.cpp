// KV ring semantics: sliding-window equivalence, rewind rules, refusals that leave the cache unchanged.
#include <pp/stage.hpp>

#include "../common/fixtures.hpp"
#include "../common/reference_model.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace {

std::string tiny() { return (pp::test::data_dir() / "golden-tiny" / "golden-tiny-f32.gguf").string(); }

std::vector<int32_t> tokens(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(rng() % 496);
  return t;
}

// Logits [V] after feeding toks[i] at position pos (one row).
std::vector<float> step(const pp::Stage& st, pp::Sequence& seq, int32_t tok, int64_t pos) {
  const std::size_t E = st.config().n_embd, V = st.config().n_vocab;
  std::vector<float> row(E), out(V);
  st.embed({&tok, 1}, row.data());
  st.forward(seq, pos, row.data(), 1);
  st.head(seq, row.data(), 1, out.data());
  return out;
}

double max_diff(const std::vector<float>& a, const double* b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(double(a[i]) - b[i]));
  return d;
}

TEST(KvRing, TokenByTokenDecodeEqualsSlidingWindowBatch) {
  const std::size_t cap = 8, n = 29;
  pp::test::ReferenceModel ref(tiny());
  const auto toks = tokens(n, 7);
  const std::vector<double> want = ref.forward(toks, cap);
  const std::size_t V = ref.config().n_vocab;

  auto st = pp::Stage::open_full(tiny(), {.ctx = cap, .threads = 2});
  pp::Sequence seq = st->new_sequence();
  double worst = 0;
  for (std::size_t i = 0; i < n; ++i) worst = std::max(worst, max_diff(step(*st, seq, toks[i], int64_t(i)), &want[i * V]));
  EXPECT_LE(worst, 1e-4);
  EXPECT_EQ(seq.n_past(), int64_t(n));
  EXPECT_EQ(seq.kv.oldest(), int64_t(n - cap));

  // A batch shorter than the capacity after wrapping (chunked rows reading the ring and themselves).
  pp::Sequence seq2 = st->new_sequence();
  const std::size_t E = st->config().n_embd;
  std::vector<float> rows(cap * E), logits(cap * V);
  std::size_t pos = 0;
  worst = 0;
  while (pos < n) {
    const std::size_t m = std::min<std::size_t>(5, n - pos);
    st->embed({toks.data() + pos, m}, rows.data());
    st->forward(seq2, int64_t(pos), rows.data(), m);
    st->head(seq2, rows.data(), m, logits.data());
    for (std::size_t i = 0; i < m; ++i)
      worst = std::max(worst, max_diff(std::vector<float>(&logits[i * V], &logits[(i + 1) * V]), &want[(pos + i) * V]));
    pos += m;
  }
  EXPECT_LE(worst, 1e-4);
}

TEST(KvRing, FullContextMatchesReference) {
  pp::test::ReferenceModel ref(tiny());
  const auto toks = tokens(20, 3);
  const std::vector<double> want = ref.forward(toks, 1 << 20);
  auto st = pp::Stage::open_full(tiny(), {.threads = 1});
  pp::Sequence seq = st->new_sequence();
  const std::size_t E = st->config().n_embd, V = st->config().n_vocab;
  std::vector<float> rows(toks.size() * E), logits(toks.size() * V);
  st->embed(toks, rows.data());
  st->forward(seq, 0, rows.data(), toks.size());
  st->head(seq, rows.data(), toks.size(), logits.data());
  EXPECT_LE(max_diff(logits, want.data()), 1e-4);
}

TEST(KvRing, RewindWithinRingRecomputesFromKeptPrefix) {
  auto st = pp::Stage::open_full(tiny(), {.ctx = 64, .threads = 2});
  const auto a = tokens(12, 1), b = tokens(4, 2);
  pp::Sequence s1 = st->new_sequence();
  for (std::size_t i = 0; i < a.size(); ++i) step(*st, s1, a[i], int64_t(i));
  // Rewind to 6 and feed b: must equal a fresh run of a[0..6) + b.
  std::vector<float> got, want;
  for (std::size_t i = 0; i < b.size(); ++i) got = step(*st, s1, b[i], int64_t(6 + i));
  pp::Sequence s2 = st->new_sequence();
  for (std::size_t i = 0; i < 6; ++i) step(*st, s2, a[i], int64_t(i));
  for (std::size_t i = 0; i < b.size(); ++i) want = step(*st, s2, b[i], int64_t(6 + i));
  EXPECT_EQ(got, want);
  EXPECT_EQ(s1.n_past(), 10);
}

TEST(KvRing, RewindAfterWrapNeedingOverwrittenPositionsIsRefusedAndCacheUnchanged) {
  const std::size_t cap = 8;
  auto st = pp::Stage::open_full(tiny(), {.ctx = cap, .threads = 1});
  const auto a = tokens(12, 5);
  pp::Sequence s = st->new_sequence();
  for (std::size_t i = 0; i < a.size(); ++i) step(*st, s, a[i], int64_t(i));
  ASSERT_EQ(s.kv.oldest(), 4);
  // Position 10's window starts at 3, which the ring has overwritten.
  try {
    step(*st, s, a[10], 10);
    FAIL() << "rewind into overwritten positions was accepted";
  } catch (const pp::RequestError& e) {
    EXPECT_NE(std::string(e.what()).find("overwritten"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s.n_past(), 12);
  // Position 11 (redo the last token) needs [4, 10]: allowed, and equals the original step.
  pp::Sequence fresh = st->new_sequence();
  std::vector<float> want;
  for (std::size_t i = 0; i < a.size(); ++i) want = step(*st, fresh, a[i], int64_t(i));
  EXPECT_EQ(step(*st, s, a[11], 11), want);
  // Position 0 always starts over.
  EXPECT_NO_THROW(step(*st, s, a[0], 0));
  EXPECT_EQ(s.n_past(), 1);
}

TEST(KvRing, GapOversizeAndEmptyRequestsAreRefused) {
  auto st = pp::Stage::open_full(tiny(), {.ctx = 8, .threads = 1});
  pp::Sequence s = st->new_sequence();
  step(*st, s, 1, 0);
  EXPECT_THROW(step(*st, s, 1, 2), pp::RequestError);  // gap: position 1 never computed
  std::vector<float> rows(9 * st->config().n_embd);
  EXPECT_THROW(st->forward(s, 1, rows.data(), 9), pp::RequestError);  // more rows than the ring holds
  EXPECT_THROW(st->forward(s, 1, rows.data(), 0), pp::RequestError);
  EXPECT_EQ(s.n_past(), 1);
  EXPECT_NO_THROW(step(*st, s, 1, 1));
}

}  // namespace
