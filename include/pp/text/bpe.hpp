// Byte-pair merging by rank over token ids: the merge table and the merge loop of byte-level BPE.
//
// A word starts as one symbol per byte (the byte's token id) and repeatedly merges the adjacent
// pair with the lowest merge rank, the leftmost one among equal ranks, until no adjacent pair
// has a rule. This is llama.cpp's llm_tokenizer_bpe_session order (a priority queue on
// (rank, left position) with stale entries skipped). Short words use a linear scan of the pair
// ranks, long ones a heap; both give the same result (tested against each other).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace pp::bpe {

// Marks a symbol that is not a token (a byte whose byte token is missing from the vocabulary);
// such a symbol never merges.
inline constexpr int32_t kNoToken = -1;
inline constexpr int32_t kNoRank = std::numeric_limits<int32_t>::max();

struct Rule {
  int32_t rank = kNoRank;  // index of the rule in the merges list; lower merges first
  int32_t result = kNoToken;  // token id of the concatenation
};

// Merge rules keyed by (left id, right id): open addressing, power-of-two capacity, built once.
class MergeTable {
 public:
  MergeTable() = default;

  void reserve(std::size_t n) {
    std::size_t cap = 16;
    while (cap < n * 2) cap *= 2;  // load factor <= 0.5
    if (cap > slots_.size()) rehash(cap);
  }

  // Adds a rule unless the pair already has one (the first, lowest-rank rule wins, as in
  // llama.cpp's bpe_ranks.emplace). Returns whether it was added.
  bool add(int32_t left, int32_t right, Rule rule) {
    if ((size_ + 1) * 2 > slots_.size()) rehash(std::max<std::size_t>(16, slots_.size() * 2));
    const uint64_t k = key(left, right);
    for (std::size_t i = slot(k);; i = (i + 1) & mask_) {
      if (slots_[i].key == kEmpty) {
        slots_[i] = {k, rule};
        ++size_;
        return true;
      }
      if (slots_[i].key == k) return false;
    }
  }

  // The rule for (left, right), or a Rule with rank kNoRank.
  Rule find(int32_t left, int32_t right) const noexcept {
    if (left < 0 || right < 0 || slots_.empty()) return {};
    const uint64_t k = key(left, right);
    for (std::size_t i = slot(k);; i = (i + 1) & mask_) {
      if (slots_[i].key == k) return slots_[i].rule;
      if (slots_[i].key == kEmpty) return {};
    }
  }

  std::size_t size() const noexcept { return size_; }

 private:
  struct Slot {
    uint64_t key = kEmpty;
    Rule rule;
  };
  static constexpr uint64_t kEmpty = ~uint64_t(0);  // ids are >= 0, so no real key has all bits set

  static uint64_t key(int32_t left, int32_t right) noexcept {
    return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
  }
  std::size_t slot(uint64_t k) const noexcept {
    return std::size_t((k * 0x9E3779B97F4A7C15ull) >> shift_);  // Fibonacci hashing
  }
  void rehash(std::size_t cap) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
    shift_ = 64 - std::countr_zero(cap);
    for (const Slot& s : old) {
      if (s.key == kEmpty) continue;
      std::size_t i = slot(s.key);
      while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
  std::size_t mask_ = 0;
  int shift_ = 64;
};

// Words up to this many symbols use the linear scan (cheaper than a heap for short words).
inline constexpr std::size_t kScanMaxSymbols = 64;

// Reusable buffers for the merge loops (one per encode call; not shared between threads).
struct Scratch {
  std::vector<int32_t> ranks;  // [n_symbols - 1] rank of each adjacent pair (scan)
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // neighbours in the live list, -1 at the ends
  };
  struct Candidate {
    int32_t rank, left, right;  // positions of the pair's symbols
    int32_t left_id, right_id;  // their ids when queued; a mismatch later marks it stale
  };
  std::vector<Symbol> symbols;   // [n_symbols] (heap)
  std::vector<Candidate> heap;   // min-heap on (rank, left) (heap)
};

// Merges `syms` in place with a linear scan per merge: O(n^2) compares, O(n) table lookups.
inline void merge_scan(std::vector<int32_t>& syms, const MergeTable& table, Scratch& scratch) {
  if (syms.size() < 2) return;
  std::vector<int32_t>& ranks = scratch.ranks;
  ranks.resize(syms.size() - 1);
  for (std::size_t i = 0; i + 1 < syms.size(); ++i) ranks[i] = table.find(syms[i], syms[i + 1]).rank;
  while (!ranks.empty()) {
    const auto best = std::min_element(ranks.begin(), ranks.end());  // first (leftmost) minimum
    if (*best == kNoRank) break;
    const std::size_t i = std::size_t(best - ranks.begin());
    syms[i] = table.find(syms[i], syms[i + 1]).result;
    syms.erase(syms.begin() + std::ptrdiff_t(i) + 1);
    ranks.erase(ranks.begin() + std::ptrdiff_t(i));
    if (i > 0) ranks[i - 1] = table.find(syms[i - 1], syms[i]).rank;
    if (i < ranks.size()) ranks[i] = table.find(syms[i], syms[i + 1]).rank;
  }
}

// Merges `syms` in place with a priority queue: O(n log n) for long words.
inline void merge_heap(std::vector<int32_t>& syms, const MergeTable& table, Scratch& scratch) {
  const auto n = int32_t(syms.size());
  if (n < 2) return;
  auto& sym = scratch.symbols;
  auto& heap = scratch.heap;
  sym.resize(std::size_t(n));
  heap.clear();
  for (int32_t i = 0; i < n; ++i) sym[std::size_t(i)] = {syms[std::size_t(i)], i - 1, i + 1 < n ? i + 1 : -1};
  // std heap functions build a max-heap: "later" means larger rank, then further right.
  const auto later = [](const Scratch::Candidate& a, const Scratch::Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.left > b.left;
  };
  const auto push = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const int32_t l = sym[std::size_t(left)].id, r = sym[std::size_t(right)].id;
    const Rule rule = table.find(l, r);
    if (rule.rank == kNoRank) return;
    heap.push_back({rule.rank, left, right, l, r});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i, i + 1);
  constexpr int32_t kDead = std::numeric_limits<int32_t>::min();
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Scratch::Candidate c = heap.back();
    heap.pop_back();
    auto& left = sym[std::size_t(c.left)];
    auto& right = sym[std::size_t(c.right)];
    if (left.id != c.left_id || right.id != c.right_id || left.next != c.right) continue;  // stale
    left.id = table.find(c.left_id, c.right_id).result;
    left.next = right.next;
    if (right.next >= 0) sym[std::size_t(right.next)].prev = c.left;
    right.id = kDead;
    push(left.prev, c.left);
    push(c.left, left.next);
  }
  std::size_t out = 0;
  for (int32_t i = 0; i >= 0; i = sym[std::size_t(i)].next) syms[out++] = sym[std::size_t(i)].id;
  syms.resize(out);
}

// Merges `syms` (token ids, kNoToken for bytes without a token) in place.
inline void merge(std::vector<int32_t>& syms, const MergeTable& table, Scratch& scratch) {
  if (syms.size() <= kScanMaxSymbols)
    merge_scan(syms, table, scratch);
  else
    merge_heap(syms, table, scratch);
}

}  // namespace pp::bpe
