// pp_bench: per-token latency and throughput at Llama-3.2-1B shapes, with the machine's bandwidth ceiling.
//
//   build-native/bench/pp_bench --benchmark_filter=Decode   (models are generated under ./models)
// Every report starts with the bandwidth probe of the same run; decode reports the fraction of it used.
#include <pp/kernels/matmul.hpp>
#include <pp/stage.hpp>
#include <pp/text/sampler.hpp>

#include "bench_common.hpp"
#include "../tests/common/node_process.hpp"

#include <benchmark/benchmark.h>

#include <filesystem>
#include <map>
#include <random>
#include <regex>
#include <vector>

namespace {

// The kernels this run measures, at the top of the report ("pp_kernels: avx512bw (dispatch target avx2)").
// What the int8 prompt tiles run on ("int8 VNNI tiles"), for labels; SSE4.2 builds have none.
#if PP_HAVE_Q8_TILES
constexpr const char* kQ8TilesName = pp::kernels::gemm_q8::kName;
#else
constexpr const char* kQ8TilesName = "int8 dot kernels";
#endif

[[maybe_unused]] const bool kKernelsContext = [] {
  std::string k = pp::simd::kernel_target();
#if defined(PP_DISPATCH_TARGET)
  k += std::string(" (dispatch target ") + PP_DISPATCH_TARGET + ", PP_KERNELS chooses)";
#endif
  benchmark::AddCustomContext("pp_kernels", k);
  return true;
}();

double g_bw[3] = {0, 0, 0};  // probe GB/s by thread count (1, 2)

double probe(unsigned threads) {
  if (g_bw[threads] == 0) g_bw[threads] = pp::bench::bandwidth_gbs(threads);
  return g_bw[threads];
}

void BM_Bandwidth(benchmark::State& st) {
  const unsigned threads = unsigned(st.range(0));
  for (auto _ : st) st.counters["GB/s"] = probe(threads);
}
BENCHMARK(BM_Bandwidth)->Arg(1)->Arg(2)->Iterations(1)->Unit(benchmark::kMillisecond);

// Matvec (1 token) and matmul at each 1B shape: rows x cols = out x in.
void BM_Matvec(benchmark::State& st) {
  const auto type = pp::DType(st.range(0));
  const std::size_t rows = std::size_t(st.range(1)), cols = std::size_t(st.range(2));
  const unsigned threads = unsigned(st.range(3));
  const std::size_t bytes = pp::row_bytes(type, cols) * rows;
  pp::AnonymousRegion w(bytes);
  std::mt19937 rng(1);
  for (std::size_t i = 0; i < bytes / 2; ++i) reinterpret_cast<uint16_t*>(w.data())[i] = uint16_t(0x3c00 ^ (rng() & 0x03ff));
  pp::MatView mv{type, w.data(), rows, cols, pp::row_bytes(type, cols)};
  std::vector<float> x(cols, 0.5f), y(rows);
  pp::ThreadPool pool(threads);
  for (auto _ : st) {
    pp::kernels::matmul(pool, mv, x.data(), 1, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  st.counters["GB/s"] = benchmark::Counter(double(bytes), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(rows * cols), benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(std::string(pp::dtype_name(type)) + " " + std::to_string(rows) + "x" + std::to_string(cols));
}
void matvec_args(benchmark::internal::Benchmark* b) {
  const std::vector<std::pair<int, int>> shapes = {{2048, 2048}, {512, 2048}, {8192, 2048}, {2048, 8192}, {128256, 2048}};
  for (int t : {int(pp::DType::BF16), int(pp::DType::F16)})
    for (auto [r, c] : shapes)
      for (int th : {1, 2}) b->Args({t, r, c, th});
}
BENCHMARK(BM_Matvec)->Apply(matvec_args)->Unit(benchmark::kMicrosecond)->UseRealTime();

// A decode step's matvec against weights 64-byte aligned (offset 0: the stage's anonymous copy) or 32 bytes
// off (a GGUF file's tensors are 32-byte aligned, so a mapped stage reads about half of them that way),
// BF16 on the fast path where it exists (the bf16 dot), else exact; one thread, activations aligned.
// Weights larger than any L3 (1 GiB in several matrices, each step reading the next), as decode reads them.
void BM_MatvecOffset(benchmark::State& st) {
  const std::size_t offset = std::size_t(st.range(0)), rows = std::size_t(st.range(1)), cols = 2048;
  const std::size_t bytes = pp::row_bytes(pp::DType::BF16, cols) * rows, mats = std::max<std::size_t>(1, (1u << 30) / bytes);
  pp::AnonymousRegion w(mats * bytes + 64);
  std::mt19937 rng(1);
  for (std::size_t i = 0; i < (mats * bytes + 64) / 2; ++i)
    reinterpret_cast<uint16_t*>(w.data())[i] = uint16_t(0x3f80 ^ (rng() & 0x007f));
  pp::Buffer<float> x(cols);
  std::fill(x.data(), x.data() + cols, 0.5f);
  std::vector<float> y(rows);
  std::vector<uint8_t> xq(pp::kernels::xq_row_bytes(cols));
  pp::ThreadPool pool(1);
  std::size_t m = 0;
  for (auto _ : st) {
    pp::MatView mv{pp::DType::BF16, w.data() + offset + m * bytes, rows, cols, pp::row_bytes(pp::DType::BF16, cols)};
    pp::kernels::matmul(pool, mv, x.data(), 1, y.data(), {false, xq, pp::kernels::gemm::kHaveFastBf16});
    benchmark::DoNotOptimize(y.data());
    m = (m + 1) % mats;
  }
  st.counters["GB/s"] = benchmark::Counter(double(bytes), benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(std::string("BF16 ") + (pp::kernels::gemm::kHaveFastBf16 ? "bf16 dot " : "exact ") + std::to_string(rows) +
              "x2048, weights " + std::to_string(offset) + " bytes past 64-byte alignment");
}
BENCHMARK(BM_MatvecOffset)->ArgsProduct({{0, 32}, {8192, 128256}})->Unit(benchmark::kMicrosecond)->UseRealTime();

// The quantized fast path's decode step: one token (or a 4-token tile) against a matrix of valid blocks
// (random codes, scales near 1) streamed from memory; the activation quantization is in the time.
void BM_MatvecQuant(benchmark::State& st) {
  const auto type = pp::DType(st.range(0));
  const std::size_t rows = std::size_t(st.range(1)), cols = std::size_t(st.range(2)), m = std::size_t(st.range(3));
  const std::size_t bytes = pp::row_bytes(type, cols) * rows;
  pp::AnonymousRegion w(bytes);
  std::mt19937 rng(1);
  for (std::size_t i = 0; i < bytes / 2; ++i) reinterpret_cast<uint16_t*>(w.data())[i] = uint16_t(0x3c00 ^ (rng() & 0x03ff));
  pp::MatView mv{type, w.data(), rows, cols, pp::row_bytes(type, cols)};
  std::vector<float> x(m * cols), y(m * rows);
  for (auto& v : x) v = float(int(rng() % 2001) - 1000) / 1000.f;
  std::vector<uint8_t> xq(m * pp::kernels::xq_row_bytes(cols));
  pp::ThreadPool pool(1);
  for (auto _ : st) {
    pp::kernels::matmul(pool, mv, x.data(), m, y.data(), {true, xq});
    benchmark::DoNotOptimize(y.data());
  }
  st.counters["GB/s"] = benchmark::Counter(double(bytes), benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(std::string(pp::dtype_name(type)) + " fast " + std::to_string(rows) + "x" + std::to_string(cols) +
              ", " + std::to_string(m) + " token(s), 1 thread");
}
BENCHMARK(BM_MatvecQuant)
    ->ArgsProduct({{int(pp::DType::Q4_K), int(pp::DType::Q6_K), int(pp::DType::Q8_0)}, {8192}, {2048}, {1, 4}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// A decode step of m sequences batched together (m rows, not bulk: the dot kernels) against weights
// streamed from memory: four copies of the matrix, used in turn, so that none is in cache. The last
// argument: 1 = BF16 weights on the fast path (activations rounded to bf16, the bf16 dot).
void BM_MatmulFew(benchmark::State& st) {
  const auto type = pp::DType(st.range(0));
  const std::size_t rows = std::size_t(st.range(1)), cols = std::size_t(st.range(2)), m = std::size_t(st.range(3));
  const bool fast = st.range(4) != 0;
  if (fast && (type != pp::DType::BF16 || !pp::kernels::gemm::kHaveFastBf16)) {
    st.SkipWithError("no fast path for this type on this build");
    return;
  }
  constexpr int kCopies = 4;
  const std::size_t bytes = pp::row_bytes(type, cols) * rows;
  pp::AnonymousRegion w(bytes * kCopies);
  std::mt19937 rng(1);
  for (std::size_t i = 0; i < bytes * kCopies / 2; ++i)
    reinterpret_cast<uint16_t*>(w.data())[i] = uint16_t(0x3c00 ^ (rng() & 0x03ff));
  pp::AnonymousRegion xr(m * cols * sizeof(float));  // page-aligned, as a stage's activations are
  float* x = reinterpret_cast<float*>(xr.data());
  std::fill(x, x + m * cols, 0.5f);
  std::vector<float> y(m * rows);
  pp::ThreadPool pool(1);
  int c = 0;
  for (auto _ : st) {
    pp::MatView mv{type, w.data() + bytes * std::size_t(c), rows, cols, pp::row_bytes(type, cols)};
    c = (c + 1) % kCopies;
    pp::kernels::matmul(pool, mv, x, m, y.data(), {false, {}, fast});
    benchmark::DoNotOptimize(y.data());
  }
  st.counters["GB/s"] = benchmark::Counter(double(bytes), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["tok/s"] = benchmark::Counter(double(m), benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(std::string(pp::dtype_name(type)) + " " + std::to_string(rows) + "x" + std::to_string(cols) + ", " +
              std::to_string(m) + " rows" + (fast ? ", fast (bf16 dot)" : ", exact"));
}
BENCHMARK(BM_MatmulFew)
    ->ArgsProduct({{int(pp::DType::BF16)}, {8192}, {2048}, {1, 2, 4, 8}, {0, 1}})
    ->ArgsProduct({{int(pp::DType::F16)}, {8192}, {2048}, {1, 2, 4}, {0}})
    ->Args({int(pp::DType::BF16), 2048, 8192, 4, 0})
    ->ArgsProduct({{int(pp::DType::BF16)}, {2048}, {8192}, {1, 2, 4}, {1}})
    ->Args({int(pp::DType::BF16), 128256, 2048, 1, 1})  // the output head of a decode step: 21% of its bytes
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// A prompt's matmul (128 tokens) at the 1B shapes, one thread, by kernel: 0 = the 1-row dot kernels of
// a decode step applied to every token; 1 = the exact tile kernel a bulk request takes here (AMX tiles
// or the vector register tiles of gemm.hpp); 2 = the fast path (BF16: bf16 activations and the bf16
// dot, where the CPU has one; F16: gemm_f16.hpp's int16 tiles, where compiled in), activation rounding
// or quantization included. Q8_0 weights take the quantized fast
// path (activations quantized to int8 blocks in each call): 0 = its dot kernels, 1 = gemm_q8.hpp's tiles.
void BM_MatmulBulk(benchmark::State& st) {
  const auto type = pp::DType(st.range(0));
  const std::size_t rows = std::size_t(st.range(1)), cols = std::size_t(st.range(2)), m = 128;
  const int kernel = int(st.range(3));
  const bool q8 = type == pp::DType::Q8_0;
  const bool fast_f16 = kernel == 2 && type == pp::DType::F16 && pp::kernels::gemm_f16::kAvailable;
  if ((kernel == 2 && !fast_f16 && (type != pp::DType::BF16 || !pp::kernels::gemm::kHaveFastBf16)) ||
      (q8 && kernel == 1 && !pp::kernels::gemm_q8::kAvailable)) {
    st.SkipWithError("no fast path for this type on this build");
    return;
  }
  const std::size_t bytes = pp::row_bytes(type, cols) * rows;
  pp::AnonymousRegion w(bytes);
  std::mt19937 rng(1);
  for (std::size_t i = 0; i < bytes / 2; ++i) reinterpret_cast<uint16_t*>(w.data())[i] = uint16_t(0x3c00 ^ (rng() & 0x03ff));
  pp::MatView mv{type, w.data(), rows, cols, pp::row_bytes(type, cols)};
  std::vector<float> x(m * cols, 0.5f), y(m * rows);
  std::vector<uint8_t> xq(m * pp::kernels::xq_row_bytes(cols));
  pp::ThreadPool pool(1);
  for (auto _ : st) {
    if (q8) pp::kernels::matmul(pool, mv, x.data(), m, y.data(), {true, xq}, /*bulk=*/kernel == 1);
    else if (kernel == 0) pp::kernels::matmul_rows<pp::simd::Best>(mv, x.data(), m, y.data(), 0, rows);
    else pp::kernels::matmul(pool, mv, x.data(), m, y.data(), {false, xq, kernel == 2}, /*bulk=*/true);
    benchmark::DoNotOptimize(y.data());
  }
  st.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * double(rows * cols * m), benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(std::string(pp::dtype_name(type)) + " " + std::to_string(rows) + "x" + std::to_string(cols) + " " +
              (q8            ? (kernel == 0 ? "fast: int8 dot kernels" : std::string("fast: ") + kQ8TilesName)
               : kernel == 0 ? "dot kernels"
               : fast_f16    ? std::string("fast: ") + pp::kernels::gemm_f16::kName
               : kernel == 2 ? "fast: bf16 dot tiles"
               : pp::kernels::amx::applies(mv) ? "AMX tiles" : "vector tiles"));
}
BENCHMARK(BM_MatmulBulk)
    ->ArgsProduct({{int(pp::DType::BF16), int(pp::DType::F16), int(pp::DType::F32)}, {2048}, {2048, 8192}, {0, 1, 2}})
    ->ArgsProduct({{int(pp::DType::Q8_0)}, {2048}, {2048, 8192}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// One core's arithmetic peak, the ceiling BM_MatmulBulk's GFLOP/s are read against: 0 = f32 FMA of the
// best compiled-in SIMD target (simd::fma), 1 = the bf16 dot (vdpbf16ps / bfdot, two products a lane) where
// compiled in. 24 independent accumulator chains hide the instructions' latency; nothing is loaded.
void BM_Peak(benchmark::State& st) {
  constexpr int kChains = 24, kSteps = 1 << 16;
  using B = pp::simd::fbatch<pp::simd::Best>;
  double flops_per_step = 0;
  if (st.range(0) == 0) {
    B acc[kChains], a(1.0001f), b(0.9999f);
    for (auto& c : acc) c = B(0.f);
    for (auto _ : st) {
      for (int i = 0; i < kSteps; ++i)
#pragma GCC unroll 24
        for (auto& c : acc) c = pp::simd::fma(a, b, c);
      for (auto& c : acc) benchmark::DoNotOptimize(c);
    }
    flops_per_step = 2.0 * B::size * kChains;
  } else {
#if PP_HAVE_BF16_DOT
    using D = pp::simd::Bf16Dot;
    D::Acc acc[kChains];
    for (auto& c : acc) c = D::zero();
    const D::Vec v = D::broadcast_pair(0x3f803f80u);  // (1, 1)
    for (auto _ : st) {
      for (int i = 0; i < kSteps; ++i)
#pragma GCC unroll 24
        for (auto& c : acc) c = D::dot(c, v, v);
      for (auto& c : acc) benchmark::DoNotOptimize(c);
    }
    flops_per_step = 4.0 * D::kLanes * kChains;
#else
    st.SkipWithError("no bf16 dot in this build");
    return;
#endif
  }
  st.counters["GFLOP/s"] = benchmark::Counter(flops_per_step * kSteps, benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(st.range(0) == 0 ? std::string(pp::simd::Best::name()) + " f32 fma" : "vdpbf16ps");
}
BENCHMARK(BM_Peak)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();

// Model weight types by benchmark argument.
const char* dtype_arg(int64_t i) {
  static const char* names[] = {"bf16", "f16", "q8_0", "q4_k_m"};
  return names[i];
}

struct Loaded {
  std::unique_ptr<pp::Stage> stage;
};
// One stage per (model, threads, residency), kept across benchmarks of the same run.
pp::Stage& stage_for(const std::string& dtype, unsigned threads, pp::Residency res = pp::Residency::Anonymous) {
  static std::map<std::tuple<std::string, unsigned, int>, std::unique_ptr<pp::Stage>> cache;
  auto key = std::make_tuple(dtype, threads, int(res));
  auto& s = cache[key];
  if (!s) {
    cache.clear();  // one resident 1B model at a time
    auto& slot = cache[key];
    pp::StageOptions opt{.ctx = 1024, .threads = threads, .residency = res};
    if (const char* r = std::getenv("PP_BENCH_MAX_ROWS")) opt.max_rows = std::size_t(std::atoi(r));
    slot = pp::Stage::open_full(pp::bench::model_1b(dtype), opt);
    return *slot;
  }
  return *s;
}

// A sequence on a stage fed a prompt, then its own greedy tokens one decode step at a time (positions
// wrap back to the prompt's end at the stage's context length).
struct GreedyDecode {
  GreedyDecode(pp::Stage& stage, std::vector<int32_t> prompt)
      : s(stage), seq(stage.new_sequence()), n_prompt(int64_t(prompt.size())),
        rows(prompt.size() * stage.config().n_embd), logits(stage.config().n_vocab) {
    s.embed(prompt, rows.data());
    s.forward(seq, 0, rows.data(), prompt.size());
    s.head(seq, rows.data() + (prompt.size() - 1) * s.config().n_embd, 1, logits.data());
    tok = pp::argmax(logits);
    pos = n_prompt;
  }
  void step() {
    s.embed({&tok, 1}, rows.data());
    s.forward(seq, pos, rows.data(), 1);
    s.head(seq, rows.data(), 1, logits.data());
    tok = pp::argmax(logits);
    if (++pos >= int64_t(s.ctx())) pos = n_prompt;
  }
  pp::Stage& s;
  pp::Sequence seq;
  int64_t n_prompt, pos = 0;
  std::vector<float> rows, logits;
  int32_t tok = 0;
};

// Which numeric path a decode step takes (float weights: the f32 dot, or the bf16 dot of the fast path).
std::string decode_path(const pp::Stage& s, const std::string& dt) {
  if (dt == "bf16") return s.fast_float() ? " fast (bf16 dot)" : " exact";
  return dt == "f16" || dt == "f32" ? " exact" : " fast (int8)";  // F16's fast path is for prompts
}

// Decode: one token per iteration at growing positions after an 8-token prompt. The host's bandwidth
// drifts from one second to the next (a shared VM), so a triad pass runs between tokens, untimed:
// `fraction` is the decode's GB/s over the mean of those passes, both averaged over the same stretch.
// probe_GB/s is the best-of-5 ceiling measured at the start, for reference (a stricter yardstick).
void BM_Decode(benchmark::State& st) {
  const std::string dt = dtype_arg(st.range(0));
  const unsigned threads = unsigned(st.range(1));
  const auto res = pp::Residency(st.range(2));
  const double bw = probe(threads);
  pp::Stage& s = stage_for(dt, threads, res);
  GreedyDecode dec(s, {128000, 791, 4062, 14198, 39935, 35308, 927, 279});
  pp::bench::Triad triad(threads);
  double triad_inv_sum = 0;  // sum of 1 / GB/s: the passes' mean bandwidth is passes / this
  int passes = 0;
  for (auto _ : st) {
    dec.step();
    st.PauseTiming();
    triad_inv_sum += 1.0 / triad.pass();
    ++passes;
    st.ResumeTiming();
  }
  const double bytes = double(s.bytes_used());
  st.counters["tok/s"] = benchmark::Counter(1, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["GB/s"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["probe_GB/s"] = bw;
  const double during = passes / triad_inv_sum;
  st.counters["triad_GB/s"] = during;
  // GB/s over the triad: the rate counter is finalised later, so compute it from the timing here.
  st.counters["fraction"] = benchmark::Counter(bytes / 1e9 / during, benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(dt + decode_path(s, dt) + (res == pp::Residency::Anonymous ? ", resident" : ", mmap") + ", weights " +
              std::to_string(s.bytes_used() >> 20) + " MiB");
}
BENCHMARK(BM_Decode)
    ->ArgsProduct({{0, 1, 2, 3}, {1, 2}, {int(pp::Residency::Anonymous)}})
    ->Args({0, 2, int(pp::Residency::Mapped)})
    ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);

// n sequences decoding together: one batched step reads each weight once for all of them.
void BM_DecodeMulti(benchmark::State& st) {
  const std::string dt = dtype_arg(st.range(0));
  const std::size_t n_seq = std::size_t(st.range(1));
  const unsigned threads = unsigned(st.range(2));
  pp::Stage& s = stage_for(dt, threads);
  const std::size_t E = s.config().n_embd, V = s.config().n_vocab;
  std::vector<pp::Sequence> seqs;
  for (std::size_t q = 0; q < n_seq; ++q) seqs.push_back(s.new_sequence());
  std::vector<float> rows(n_seq * E), logits(n_seq * V);
  std::vector<int32_t> toks(n_seq);
  std::vector<pp::Stage::BatchEntry> batch(n_seq);
  int64_t pos = 0;
  for (auto _ : st) {
    for (std::size_t q = 0; q < n_seq; ++q) {
      toks[q] = int32_t((q * 7919 + std::size_t(pos) * 31) % 128000);
      batch[q] = {&seqs[q], pos, 1};
    }
    s.embed(toks, rows.data());
    s.forward_batch(batch, rows.data());
    s.head(seqs[0], rows.data(), n_seq, logits.data());
    if (++pos >= int64_t(s.ctx())) pos = 0;
  }
  st.counters["tok/s"] = benchmark::Counter(double(n_seq), benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(dt + decode_path(s, dt) + ", " + std::to_string(n_seq) + " sequences");
}
// One thread, up to 16 sequences: a pinned pipeline stage's step (docs/SERVING.md: two stages on their own
// cores serve at most what one core does for B sequences over what it does for B / 2, T(B) / T(B / 2)).
BENCHMARK(BM_DecodeMulti)
    ->ArgsProduct({{0}, {1, 2, 4, 8}, {2}})
    ->ArgsProduct({{0}, {1, 4, 8, 16}, {1}})
    ->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);

// A decode step of 8 sequences with a prompt's piece of n rows fed beside it (the serving scheduler's
// paced prefill): in the same batch (mode 0: the weights streamed once for both paths,
// kernels::matmul_groups), or as two steps (mode 1: the piece alone after the decode rows, each streaming
// the weights). ms per step; what the streams' inter-token gap grows by while a prompt is fed.
void BM_DecodeWithPrompt(benchmark::State& st) {
  const std::string dt = dtype_arg(st.range(0));
  const std::size_t piece = std::size_t(st.range(1));
  const bool separate = st.range(2) != 0;
  const unsigned threads = unsigned(st.range(3));
  constexpr std::size_t kSeqs = 8;
  pp::Stage& s = stage_for(dt, threads);
  const std::size_t E = s.config().n_embd;
  std::vector<pp::Sequence> seqs;
  for (std::size_t q = 0; q <= kSeqs; ++q) seqs.push_back(s.new_sequence());
  std::vector<float> rows((kSeqs + piece) * E);
  std::vector<int32_t> toks(kSeqs + piece);
  std::vector<pp::Stage::BatchEntry> batch;
  int64_t pos = 0;
  for (auto _ : st) {
    batch.clear();
    for (std::size_t q = 0; q < kSeqs; ++q) batch.push_back({&seqs[q], pos, 1});
    for (std::size_t i = 0; i < kSeqs + piece; ++i) toks[i] = int32_t((i * 7919 + std::size_t(pos) * 31) % 128000);
    s.embed(toks, rows.data());
    if (piece > 0 && !separate) batch.push_back({&seqs[kSeqs], 0, piece});
    s.forward_batch(batch, rows.data());
    if (piece > 0 && separate) {
      const pp::Stage::BatchEntry alone{&seqs[kSeqs], 0, piece};
      s.forward_batch({&alone, 1}, rows.data() + kSeqs * E);
    }
    if (++pos >= int64_t(s.ctx())) pos = 0;
  }
  st.SetLabel(dt + decode_path(s, dt) + ", 8 sequences + a " + std::to_string(piece) + "-row prompt piece" +
              (piece == 0 ? "" : separate ? ", as two steps" : ", in one step"));
}
BENCHMARK(BM_DecodeWithPrompt)
    ->ArgsProduct({{0}, {0}, {0}, {1, 2}})
    ->ArgsProduct({{0}, {16, 32}, {0, 1}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(2.0);

// Prefill of n tokens from position 0.
void BM_Prefill(benchmark::State& st) {
  const std::string dt = dtype_arg(st.range(0));
  const std::size_t n = std::size_t(st.range(1));
  const unsigned threads = unsigned(st.range(2));
  pp::Stage& s = stage_for(dt, threads);
  pp::Sequence seq = s.new_sequence();
  std::vector<float> rows(n * s.config().n_embd), logits(s.config().n_vocab);
  std::vector<int32_t> toks(n);
  for (std::size_t i = 0; i < n; ++i) toks[i] = int32_t((i * 7919) % 128000);
  auto prompt = [&] {
    s.embed(toks, rows.data());
    s.forward(seq, 0, rows.data(), n);
    s.head(seq, rows.data() + (n - 1) * s.config().n_embd, 1, logits.data());
  };
  // One untimed pass first, as llama-bench runs a warm-up prompt before its timed ones: the first pass
  // also faults in the sequence's KV pages and the threads' scratch (without it, the first of three
  // repetitions of BM_Prefill/0/128/1 read ~8% low).
  prompt();
  for (auto _ : st) prompt();
  st.counters["tok/s"] = benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate);
  // Which numeric path the prompt took (float weights: AMX / vector tiles exact, the bf16 dot or the int16 tiles).
  const bool quant = dt != "bf16" && dt != "f16";
  st.SetLabel(dt + (dt == "q8_0" && pp::kernels::gemm_q8::kAvailable ? std::string(" fast (") + kQ8TilesName + ")"
                    : quant                          ? " fast (int8)"
                    : dt == "bf16" && s.fast_float() ? " fast (bf16 dot)"
                    : dt == "f16" && s.fast_float() && pp::kernels::gemm_f16::kAvailable
                        ? std::string(" fast (") + pp::kernels::gemm_f16::kName + ")"
                    : pp::kernels::amx::available()  ? " exact (AMX)"
                                                     : " exact (vector tiles)"));
}
BENCHMARK(BM_Prefill)->ArgsProduct({{0, 1, 2, 3}, {128, 512}, {1, 2}})->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);

// One decoder block (a stage owning block 0 only): a decode step's latency and its share of the weights.
void BM_DecodeLayer(benchmark::State& st) {
  const std::string dt = dtype_arg(st.range(0));
  const unsigned threads = unsigned(st.range(1));
  auto s = pp::Stage::open_stage(pp::bench::model_1b(dt), 0, 16,
                                 {.ctx = 1024, .threads = threads, .residency = pp::Residency::Anonymous});
  pp::Sequence seq = s->new_sequence();
  std::vector<float> row(s->config().n_embd, 0.01f);
  int64_t pos = 0;
  for (auto _ : st) {
    s->forward(seq, pos, row.data(), 1);
    for (float& v : row) v = 0.01f;
    if (++pos >= int64_t(s->ctx())) pos = 0;
  }
  const pp::MappedFile file(pp::bench::model_1b(dt));
  double layer_bytes = 0;  // block 0's tensors
  for (const auto& t : pp::gguf::parse(file.bytes()).tensors)
    if (t.name.starts_with("blk.0.")) layer_bytes += double(t.n_bytes);
  st.counters["GB/s"] = benchmark::Counter(layer_bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  st.SetLabel(dt + ", block 0 of 16");
}
BENCHMARK(BM_DecodeLayer)->ArgsProduct({{0, 2}, {1, 2}})->Unit(benchmark::kMicrosecond)->UseRealTime()->MinTime(1.0);

// Sampling one token from 128256 logits, per sampler chain (pp::Sampler::sample), us per token.
// Logits: a fixed-seed Gaussian N(0, 2^2) over the vocabulary (the bulk of a real LM's head output) with
// eight high outliers at 15, 14, ..., 8 (the few plausible next tokens): at temperature 1 the outliers hold
// ~85% of the mass and the rest is spread thinly over tens of thousands of tokens, so untruncated draws
// sometimes land deep in the tail. The position advances every iteration, so each draw has its own u.
const pp::SamplingParams& sample_chain(int64_t i) {
  using O = std::optional<double>;
  using K = std::optional<int64_t>;
  static const pp::SamplingParams chains[] = {
      {O{}, K{}, O{}, O{}, 0},       // greedy
      {1.0, K{}, O{}, O{}, 0},       // temperature 1 only
      {0.8, 40, O{}, O{}, 0},        // temperature 0.8, top_k 40
      {O{}, K{}, 0.9, O{}, 0},       // top_p 0.9
      {O{}, K{}, O{}, 0.05, 0},      // min_p 0.05
      {0.7, 40, 0.95, 0.05, 0},      // temperature 0.7, top_k 40, top_p 0.95, min_p 0.05
  };
  return chains[i];
}
const char* sample_chain_name(int64_t i) {
  static const char* names[] = {"greedy", "temp 1", "temp 0.8 top_k 40", "top_p 0.9", "min_p 0.05",
                                "temp 0.7 top_k 40 top_p 0.95 min_p 0.05"};
  return names[i];
}

void BM_Sample(benchmark::State& st) {
  constexpr std::size_t V = 128256;
  std::vector<float> logits(V);
  std::mt19937 rng(7);
  std::normal_distribution<float> gauss(0.0f, 2.0f);
  for (float& l : logits) l = gauss(rng);
  for (int j = 0; j < 8; ++j) logits[(std::size_t(j) * 15731 + 977) % V] = float(15 - j);
  pp::SamplingParams sp = sample_chain(st.range(0));
  sp.seed = 42;
  pp::Sampler sampler;
  int64_t pos = 0;
  for (auto _ : st) benchmark::DoNotOptimize(sampler.sample(logits, sp, pos++));
  st.SetLabel(sample_chain_name(st.range(0)));
}
BENCHMARK(BM_Sample)->DenseRange(0, 5)->Unit(benchmark::kMicrosecond)->MinTime(1.0);

// Opening a whole 1B stage: weights copied into anonymous memory vs used from the mapping (pages
// pre-faulted). Wall time of the open and the process's RSS growth (VmRSS). Reads the file from the page
// cache (an earlier benchmark or run has read it), so this is the cost of a warm start.
void BM_Load(benchmark::State& st) {
  const std::string dt = dtype_arg(st.range(0));
  const auto res = pp::Residency(st.range(1));
  const std::string path = pp::bench::model_1b(dt);
  double rss_mb = 0;
  for (auto _ : st) {
    const double before = pp::bench::rss_mb();
    auto s = pp::Stage::open_full(path, {.ctx = 1024, .threads = 2, .residency = res});
    rss_mb = pp::bench::rss_mb() - before;
    benchmark::DoNotOptimize(s.get());
  }
  st.counters["RSS_MB"] = rss_mb;
  st.SetLabel(dt + (res == pp::Residency::Anonymous ? " resident (anonymous copy)" : " mmap (pre-faulted)"));
}
BENCHMARK(BM_Load)
    ->ArgsProduct({{0}, {int(pp::Residency::Mapped), int(pp::Residency::Anonymous)}})
    ->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);

// The 2-stage pipeline: pp_node's coordinator (blocks 0-7, embedding, head) and one worker (blocks
// 8-15) as two processes on loopback, against decode in this process with the same threads. Each
// iteration runs the coordinator once (8 prompt tokens, `n` generated) and takes its reported decode
// ms/token; the single-process figure decodes the same tokens here. The binary is found next to this
// one in the build tree (../tools/pp_node) or at $PP_NODE_BIN; processes run through the tests' helpers.
std::string node_binary() {
  if (const char* b = std::getenv("PP_NODE_BIN")) return b;
  std::error_code ec;
  return (std::filesystem::read_symlink("/proc/self/exe", ec).parent_path().parent_path() / "tools" / "pp_node").string();
}

void BM_Pipeline2(benchmark::State& st) {
  using pp::test::Millis;
  const std::string dt = dtype_arg(st.range(0));
  const unsigned threads = unsigned(st.range(1));
  const int n = 33;  // tokens generated per run: 32 decode steps after the prompt's
  const std::string node = node_binary(), model = pp::bench::model_1b(dt), th = std::to_string(threads);
  if (!std::filesystem::exists(node)) return st.SkipWithError(("pp_node not found at " + node).c_str());
  pp::test::Process worker({node, "--worker", "--model", model, "--host", "127.0.0.1", "--port", "0", "--threads", th});
  std::smatch port;
  const bool up = worker.started() && worker.wait_output("(Ctrl-C to stop)", Millis{120000});
  const std::string banner = worker.out();
  if (!up || !std::regex_search(banner, port, std::regex("listening on 127\\.0\\.0\\.1:(\\d+)")))
    return st.SkipWithError(("the pp_node worker did not start: " + worker.err()).c_str());

  // Single process, same threads: the 8-token prompt, then n - 1 decode steps, timed per step.
  double single_ms = 0;
  {
    GreedyDecode dec(stage_for(dt, threads), {1, 2, 3, 4, 5, 6, 7, 8});
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 1; i < n; ++i) dec.step();
    single_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / (n - 1);
  }
  double sum_ms = 0;
  int runs = 0;
  for (auto _ : st) {
    const auto r = pp::test::run_process({node, "--coordinator", "127.0.0.1:" + port[1].str(), "--model", model,
                                          "--prompt-ids", "1,2,3,4,5,6,7,8", "--tokens", std::to_string(n),
                                          "--ignore-eos", "--threads", th, "--verify", "none"},
                                         Millis{600000});
    std::smatch ms;  // "decode: N tokens in T ms = R tokens/s (M ms/token)"
    if (r.code != 0 || !std::regex_search(r.out, ms, std::regex("tokens/s \\(([0-9.]+) ms/token\\)")))
      return st.SkipWithError(("the pp_node coordinator failed: " + r.err).c_str());
    st.SetIterationTime(std::stod(ms[1]) / 1e3);
    sum_ms += std::stod(ms[1]);
    ++runs;
  }
  const double pipe_ms = sum_ms / runs;
  st.counters["pipeline_ms/token"] = pipe_ms;
  st.counters["single_ms/token"] = single_ms;
  st.counters["overhead_ms/token"] = pipe_ms - single_ms;
  st.SetLabel(dt + ", 2 processes on loopback vs 1, decode");
}
BENCHMARK(BM_Pipeline2)->ArgsProduct({{0}, {2}})->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace

BENCHMARK_MAIN();
