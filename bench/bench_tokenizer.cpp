// Tokenizer benchmarks: encode throughput (MB/s) on mixed text and latency of a ~20-token prompt.
//
// Uses the real Llama-3 vocabulary from $PP_SHARED_FIXTURES/llama3-vocab-only.gguf (never
// committed); without it every benchmark here is skipped with a message.
#include <pp/io/gguf.hpp>
#include <pp/io/mmap.hpp>
#include <pp/text/tokenizer.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace {

// The Llama-3 tokenizer, loaded once from $PP_SHARED_FIXTURES, else ../shared/fixtures seen from
// the repository root or a build directory; nullptr when the fixture is not there.
const pp::Tokenizer* llama3() {
  static const std::unique_ptr<pp::Tokenizer> tok = []() -> std::unique_ptr<pp::Tokenizer> {
    std::vector<std::filesystem::path> dirs;
    if (const char* env = std::getenv("PP_SHARED_FIXTURES")) dirs.emplace_back(env);
    dirs.emplace_back("../shared/fixtures");
    dirs.emplace_back("../../shared/fixtures");
    for (const auto& dir : dirs) {
      const std::filesystem::path path = dir / "llama3-vocab-only.gguf";
      if (!std::filesystem::exists(path)) continue;
      const pp::MappedFile file(path.string());
      return std::make_unique<pp::Tokenizer>(pp::Tokenizer::from_gguf(pp::gguf::parse(file.bytes())));
    }
    return nullptr;
  }();
  return tok.get();
}

constexpr std::string_view kNoVocab =
    "no Llama-3 vocabulary: set PP_SHARED_FIXTURES to the directory holding llama3-vocab-only.gguf";

// Deterministic mixed text of about `bytes` bytes: English prose, code, numbers, CJK, emoji.
std::string mixed_text(std::size_t bytes) {
  static constexpr std::string_view kWords[] = {
      "the", "model", "tokenizer", "returns", "a", "sequence", "of", "ids", "for", "every", "prompt",
      "while", "generation", "continues", "until", "an", "end", "token", "appears", "in", "output",
      "quickly", "Llama", "network", "pipeline", "stage", "worker", "cache", "attention", "layer"};
  static constexpr std::string_view kCode[] = {
      "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n",
      "def forward(self, x):\n    return self.norm(x) @ self.weight.T\n",
      "if (err != nullptr && *err) { return -1; }\n",
      "{\"id\": 42, \"tokens\": [128000, 9906, 1917], \"ok\": true}\n"};
  static constexpr std::string_view kOther[] = {
      "你好，世界！今天天气很好。", "日本語のテキストです。", "한국어 텍스트입니다. ", "Привет, мир! ",
      "🙂🚀 ", "👍🏽 ", "Straße café naïve ", "\t\t", "\r\n", "   "};
  std::string out;
  out.reserve(bytes + 128);
  uint64_t state = 0x2545F4914F6CDD1Dull;
  const auto next = [&](uint64_t n) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (state >> 33) % n;
  };
  while (out.size() < bytes) {
    switch (next(10)) {
      case 0: case 1: case 2: case 3: case 4: {  // a sentence
        const std::size_t n = 5 + next(12);
        for (std::size_t i = 0; i < n; ++i) {
          std::string_view w = kWords[next(std::size(kWords))];
          if (i == 0) {
            out += char(w[0] - ('a' <= w[0] && w[0] <= 'z' ? 32 : 0));
            w.remove_prefix(1);
          }
          out += w;
          out += i + 1 < n ? (next(8) == 0 ? ", " : " ") : ". ";
        }
        break;
      }
      case 5: case 6:
        out += kCode[next(std::size(kCode))];
        break;
      case 7:
        out += std::to_string(next(1000000)) + "." + std::to_string(next(100)) + " ";
        break;
      default:
        out += kOther[next(std::size(kOther))];
        break;
    }
  }
  return out;
}

void BM_TokenizerEncodeMixed(benchmark::State& state) {
  const pp::Tokenizer* tok = llama3();
  if (!tok) {
    state.SkipWithError(std::string(kNoVocab).c_str());
    return;
  }
  const std::string text = mixed_text(std::size_t(state.range(0)));
  std::size_t n_tokens = 0;
  for (auto _ : state) {
    const std::vector<int32_t> ids = tok->encode(text, false, true);
    n_tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
  state.counters["tokens"] = double(n_tokens);
  state.counters["tokens/s"] = benchmark::Counter(double(n_tokens) * double(state.iterations()),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_TokenizerEncodeMixed)->Arg(300 * 1024)->Unit(benchmark::kMillisecond);

// A chat-formatted prompt of about 20 tokens, the per-request cost of a short user turn.
constexpr std::string_view kPrompt =
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France? Answer in one word.<|eot_id|>";

void BM_TokenizerEncodePrompt(benchmark::State& state) {
  const pp::Tokenizer* tok = llama3();
  if (!tok) {
    state.SkipWithError(std::string(kNoVocab).c_str());
    return;
  }
  std::size_t n_tokens = 0;
  for (auto _ : state) {
    const std::vector<int32_t> ids = tok->encode(kPrompt, true, true);
    n_tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.counters["tokens"] = double(n_tokens);
}
BENCHMARK(BM_TokenizerEncodePrompt)->Unit(benchmark::kMicrosecond);

void BM_TokenizerDecodeMixed(benchmark::State& state) {
  const pp::Tokenizer* tok = llama3();
  if (!tok) {
    state.SkipWithError(std::string(kNoVocab).c_str());
    return;
  }
  const std::string text = mixed_text(std::size_t(state.range(0)));
  const std::vector<int32_t> ids = tok->encode(text, false, true);
  for (auto _ : state) {
    const std::string out = tok->decode(ids);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
}
BENCHMARK(BM_TokenizerDecodeMixed)->Arg(300 * 1024)->Unit(benchmark::kMillisecond);

}  // namespace
