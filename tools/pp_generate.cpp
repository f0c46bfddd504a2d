// pp_generate: the single-process generator — prompt ids in, greedy (or seeded sampled) tokens out.
//
// With --cuts it runs the model as chained stages with the residual rounded to --wire at each cut: the
// exact single-process reference for a distributed pipeline. --logits-out writes the golden JSON format
// of ../shared/fixtures (prompt logits, greedy ids, per-step logits) for comparison with references.
#include <pp/generation.hpp>
#include <pp/io/ollama.hpp>
#include <pp/local_pipeline.hpp>
#include <pp/text/sampler.hpp>
#include <pp/text/tokenizer.hpp>

#include <CLI/CLI.hpp>
#include "common/build_info.hpp"
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::size_t used = 0;
    long v = -1;
    try {
      v = std::stol(item, &used);
    } catch (...) {
    }
    if (used != item.size() || v < 0 || v > INT32_MAX)
      throw pp::Error("--prompt-ids: '" + item + "' is not a non-negative token id");
    out.push_back(int32_t(v));
  }
  if (out.empty()) throw pp::Error("--prompt-ids: no ids given");
  return out;
}

nlohmann::json rows_json(const std::vector<float>& v, std::size_t n, std::size_t V) {
  nlohmann::json a = nlohmann::json::array();
  for (std::size_t i = 0; i < n; ++i) a.push_back(std::vector<float>(v.begin() + i * V, v.begin() + (i + 1) * V));
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pp_generate: run a Llama GGUF in one process (optionally as chained stages)"};
  app.set_version_flag("--version", [] { return pp::tools::version_line("pp_generate"); });
  std::string model, ids_arg, prompt_text, logits_out, wire = "f32";
  bool stop_at_eog = false, no_bos = false;
  std::vector<int> cuts;
  int n_tokens = 16;
  unsigned threads = 0;
  std::size_t ctx = 0;
  pp::SamplingParams sp;
  double temperature = 0, top_p = 0, min_p = -1;
  int64_t top_k = 0;
  app.add_option("-m,--model", model, "GGUF file or Ollama tag (e.g. llama3.2:1b, from OLLAMA_MODELS or ~/.ollama/models)")
      ->required()
      ->type_name("PATH|TAG");
  auto* ids_opt = app.add_option("--prompt-ids", ids_arg, "prompt token ids, comma-separated (e.g. 496,198,303)");
  auto* text_opt = app.add_option("-p,--prompt", prompt_text, "prompt text (tokenized with the model's tokenizer)");
  ids_opt->excludes(text_opt);
  app.add_flag("--no-bos", no_bos, "with --prompt: do not add BOS even if the model asks for it");
  app.add_flag("--stop-at-eog", stop_at_eog, "stop at an end-of-generation token (eos/eot/eom)");
  app.add_option("-n,--tokens", n_tokens, "tokens to generate")->check(CLI::Range(0, 1 << 20));
  app.add_option("--cuts", cuts, "simulate a split: block indices where stages begin (e.g. --cuts 8 or 4,8,12)")
      ->delimiter(',');
  app.add_option("--wire", wire, "residual dtype at each cut: f32, bf16 (pp_worker's wire) or f16")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  app.add_option("-t,--threads", threads, "compute threads (0 = all cores)");
  bool exact_float = false;
  app.add_flag("--exact-float", exact_float, pp::tools::kExactFloatHelp);
  app.add_option("--ctx", ctx, "KV capacity in positions (0 = min(4096, model context))");
  app.add_option("--temperature", temperature, "sample with this temperature (> 0) instead of argmax");
  app.add_option("--top-k", top_k, "keep the k most likely tokens (>= 1)");
  app.add_option("--top-p", top_p, "keep the smallest set with probability >= p, (0, 1]");
  app.add_option("--min-p", min_p, "drop tokens below min_p x the top probability, [0, 1)");
  app.add_option("--seed", sp.seed, "sampling seed (the draw depends only on seed and position)");
  app.add_option("--logits-out", logits_out, "write prompt and per-step logits as golden JSON");
  CLI11_PARSE(app, argc, argv);
  pp::tools::set_exact_float(exact_float);

  try {
    if (app.count("--temperature")) sp.temperature = temperature;
    if (app.count("--top-k")) sp.top_k = top_k;
    if (app.count("--top-p")) sp.top_p = top_p;
    if (app.count("--min-p")) sp.min_p = min_p;
    sp.validate();
    if (ids_arg.empty() && prompt_text.empty()) throw pp::Error("give a prompt: --prompt TEXT or --prompt-ids IDS");
    const auto t_load = std::chrono::steady_clock::now();
    const pp::ResolvedModel resolved = pp::resolve_model(model);
    if (resolved.how == "ollama") std::fprintf(stderr, "model: %s -> %s\n", model.c_str(), resolved.path.c_str());
    pp::LocalPipeline pipe(resolved.path, cuts, pp::parse_wire_dtype(wire), {.ctx = ctx, .threads = threads});
    // The tokenizer is optional for id prompts (a model without one still runs).
    const pp::Tokenizer* tok = pipe.model().tokenizer();
    if (!tok && !prompt_text.empty()) throw pp::Error(pipe.model().tokenizer_error());
    const std::vector<int32_t> prompt =
        prompt_text.empty() ? parse_ids(ids_arg) : tok->encode(prompt_text, tok->add_bos() && !no_bos);
    if (prompt.empty()) throw pp::Error("the prompt has no tokens");
    const pp::Config& c = pipe.config();
    const std::size_t V = c.n_vocab, n = prompt.size();
    if (n + std::size_t(n_tokens) > pipe.stage(0).ctx())
      throw pp::Error("prompt (" + std::to_string(n) + ") + tokens (" + std::to_string(n_tokens) +
                      ") exceed the KV capacity " + std::to_string(pipe.stage(0).ctx()) + " (use --ctx)");
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

    const bool all_rows = !logits_out.empty();
    std::vector<float> prompt_logits, step_logits;
    std::optional<pp::StreamDecoder> text;
    if (tok && !all_rows) text.emplace(*tok);
    pp::Generation gen(pipe, {.sampling = sp, .max_tokens = std::size_t(std::max(0, n_tokens)),
                              .stop_at_eog = stop_at_eog ? tok : nullptr});

    const auto t0 = std::chrono::steady_clock::now();
    gen.prefill(prompt, all_rows ? &prompt_logits : nullptr);
    const auto t1 = std::chrono::steady_clock::now();
    while (const std::optional<int32_t> t = gen.step()) {
      if (all_rows) step_logits.insert(step_logits.end(), gen.logits().begin(), gen.logits().end());
      if (text) {
        std::fputs(text->feed(*t).c_str(), stdout);
        std::fflush(stdout);
      }
    }
    const std::vector<int32_t>& out = gen.tokens();
    if (text) std::printf("%s\n", text->flush().c_str());
    const auto t2 = std::chrono::steady_clock::now();

    std::cout << "tokens:";
    for (int32_t t : out) std::cout << ' ' << t;
    std::cout << '\n';
    const double pre = std::chrono::duration<double>(t1 - t0).count();
    const double dec = std::chrono::duration<double>(t2 - t1).count();
    const int decoded = std::max(0, int(out.size()) - 1);
    std::fprintf(stderr, "load %.2f s | prefill %zu tokens %.1f tok/s | decode %d tokens %.2f tok/s | %zu stage(s), wire %s, %u threads\n",
                 load_s, n, double(n) / pre, decoded, decoded > 0 ? double(decoded) / dec : 0.0, pipe.n_stages(),
                 wire.c_str(), pipe.stage(0).threads());

    if (all_rows) {
      nlohmann::json j;
      j["model"] = model;
      j["producer"] = "pp_generate";
      j["n_vocab"] = V;
      j["cuts"] = cuts;
      j["wire"] = wire;
      j["prompt_tokens"] = prompt;
      j["logits"] = rows_json(prompt_logits, n, V);
      j["greedy"] = out;
      j["greedy_logits"] = rows_json(step_logits, out.size(), V);
      std::ofstream f(logits_out);
      f << j.dump() << '\n';
      if (!f) throw pp::Error("cannot write '" + logits_out + "'");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pp_generate: %s\n", e.what());
    return 2;
  }
  return 0;
}
