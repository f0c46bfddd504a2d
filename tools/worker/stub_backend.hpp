// Stub stage: no model, deterministic hash stand-ins with the real shapes (hidden 16, vocab 32).
#pragma once

#include "backend.hpp"

#include <pp/core/error.hpp>
#include <pp/model/layer_range.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <time.h>

namespace pp::worker {

// The hashes, so that anyone can reproduce them (docs/PROTOCOL-WORKER.md): orchestrators may rely
// on shapes, determinism and position sensitivity only, never on these values.
namespace stub_hash {

inline constexpr uint64_t kEmbed = 0x656d626564000001ull;    // embed_and_forward / decode_step rows
inline constexpr uint64_t kForward = 0x666f727761726402ull;  // forward_range rows
inline constexpr uint64_t kSample = 0x73616d706c650003ull;   // forward_and_sample logits
inline constexpr uint64_t kToken = 0x746f6b656e000004ull;    // tokenize words

// SplitMix64's finaliser.
constexpr uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
constexpr uint64_t combine(uint64_t h, uint64_t v) { return mix(h ^ mix(v)); }

// (2k + 1) / 256 for the top byte k as int8: in [-255/256, 255/256], never zero, and exact in bf16
// and f16 (8 significant bits), so the wire carries it without rounding.
inline float unit_value(uint64_t h) { return float(2 * int(int8_t(uint8_t(h >> 56))) + 1) / 256.0f; }

// row [hidden] from a row seed: value j = unit_value(combine(seed, j)).
inline void fill_row(uint64_t seed, float* row, int hidden) {
  for (int j = 0; j < hidden; ++j) row[j] = unit_value(combine(seed, uint64_t(j)));
}

}  // namespace stub_hash

class StubBackend final : public Backend {
 public:
  static constexpr int kHidden = 16;
  static constexpr int kVocab = 32;
  static constexpr int kMinBlocks = 16;

  // delay_ms: a test hook (PP_WORKER_STUB_DELAY_MS) that makes every op take at least that long.
  StubBackend(int stage, int num_stages, int64_t ctx, int64_t delay_ms) : stage_(stage), delay_ms_(delay_ms) {
    geo_.hidden_dim = kHidden;
    geo_.vocab_size = kVocab;
    geo_.total_blocks = std::max(kMinBlocks, num_stages);
    geo_.layer_range = compute_layer_range(stage, num_stages, geo_.total_blocks);
    geo_.ctx = ctx;
    geo_.check_token_range = false;
  }

  Geometry geometry() const override { return geo_; }

  nlohmann::ordered_json load_report() const override {
    return {{"mode", "stub"}, {"load_ms", 0.0}, {"bytes_mapped", 0}, {"blocks", geo_.layer_range.size()}};
  }

  // One id per run of ASCII whitespace-separated bytes; add_bos and parse_special are ignored.
  std::vector<int32_t> tokenize(const std::string& prompt, std::optional<bool>, bool) override {
    delay();
    std::vector<int32_t> ids;
    size_t i = 0;
    while (i < prompt.size()) {
      while (i < prompt.size() && is_space(prompt[i])) ++i;
      if (i == prompt.size()) break;
      uint64_t h = stub_hash::kToken;
      for (; i < prompt.size() && !is_space(prompt[i]); ++i) h = stub_hash::combine(h, uint8_t(prompt[i]));
      ids.push_back(int32_t(h % kVocab));
    }
    return ids;
  }

  // Row i from (token i, absolute position pos + i).
  void embed_and_forward(std::span<const int32_t> tokens, int64_t pos, std::vector<float>& out) override {
    delay();
    out.resize(tokens.size() * kHidden);
    for (size_t i = 0; i < tokens.size(); ++i) {
      const uint64_t seed = stub_hash::combine(stub_hash::combine(stub_hash::kEmbed, uint64_t(tokens[i])),
                                               uint64_t(pos) + i);
      stub_hash::fill_row(seed, out.data() + i * kHidden, kHidden);
    }
  }

  // Row i from (the input row's f32 bits, absolute position pos + i, stage).
  void forward_range(std::span<float> rows, int n, int64_t pos) override {
    delay();
    for (int i = 0; i < n; ++i) {
      float* row = rows.data() + size_t(i) * kHidden;
      uint64_t h = stub_hash::combine(stub_hash::kForward, uint64_t(stage_));
      for (int j = 0; j < kHidden; ++j) h = stub_hash::combine(h, std::bit_cast<uint32_t>(row[j]));
      stub_hash::fill_row(stub_hash::combine(h, uint64_t(pos) + uint64_t(i)), row, kHidden);
    }
  }

  // Logits from (all input rows, pos); the token is their argmax (lowest index wins ties).
  // Sampling fields are validated by the worker and otherwise ignored.
  int32_t forward_and_sample(std::span<float> rows, int n, int64_t pos, const SamplingParams&,
                             std::vector<float>* logits_out) override {
    delay();
    uint64_t h = stub_hash::kSample;
    for (size_t k = 0; k < size_t(n) * kHidden; ++k) h = stub_hash::combine(h, std::bit_cast<uint32_t>(rows[k]));
    h = stub_hash::combine(h, uint64_t(pos));
    float logits[kVocab];
    for (int v = 0; v < kVocab; ++v) logits[v] = stub_hash::unit_value(stub_hash::combine(h, uint64_t(v)));
    const int32_t token = int32_t(std::max_element(logits, logits + kVocab) - logits);
    if (logits_out) logits_out->assign(logits, logits + kVocab);
    return token;
  }

  // The decimal ids joined by single spaces; keep_special is ignored.
  std::string detokenize(std::span<const int32_t> tokens, bool) override {
    delay();
    std::string text;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i) text += ' ';
      text += std::to_string(tokens[i]);
    }
    return text;
  }

  std::vector<int32_t> generate_full(std::span<const int32_t>, int) override {
    throw RequestError("generate_full needs real mode: this worker runs in stub mode (no model)");
  }

 private:
  static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }

  // Sleeps the whole delay even when a signal arrives: the in-flight op must still finish.
  void delay() const {
    if (delay_ms_ <= 0) return;
    timespec left{time_t(delay_ms_ / 1000), long(delay_ms_ % 1000) * 1000000L};
    while (::nanosleep(&left, &left) != 0 && errno == EINTR) {
    }
  }

  Geometry geo_;
  int stage_;
  int64_t delay_ms_;
};

}  // namespace pp::worker
