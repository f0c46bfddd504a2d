// pp_generate: the single-process generator — a prompt in, greedy (or sampled) text or token ids out.
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
#include "common/cli.hpp"
#include "common/terminal_text.hpp"
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>

#include <unistd.h>

namespace {

nlohmann::json rows_json(const std::vector<float>& v, std::size_t n, std::size_t V) {
  nlohmann::json a = nlohmann::json::array();
  for (std::size_t i = 0; i < n; ++i) a.push_back(std::vector<float>(v.begin() + i * V, v.begin() + (i + 1) * V));
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  using pp::tools::kExitFailed;
  using pp::tools::kExitUsage;
  if (!pp::tools::cpu_runs_this_build("pp_generate")) return kExitUsage;
  CLI::App app{"pp_generate: run a Llama GGUF in one process (optionally as chained stages).\n"
               "The generated text alone goes to stdout (the token ids with --ids); everything else to stderr."};
  app.footer(std::string(pp::tools::kExitFooter) + "\nEnvironment: PP_THREADS (--threads), PP_CTX (--ctx), PP_EXACT_FLOAT=1 "
             "(--exact-float), PP_NO_AMX=1 (no AMX tiles); Ollama tags are looked up in $OLLAMA_MODELS or ~/.ollama/models.");
  app.set_version_flag("--version", [] { return pp::tools::version_line("pp_generate"); });
  std::string model, ids_arg, prompt_text, logits_out, wire = "f32";
  bool ignore_eos = false, no_bos = false, print_ids = false;
  std::vector<int> cuts;
  int64_t n_tokens = 16;
  unsigned threads = 0;
  std::size_t ctx = 0;
  pp::tools::SamplingFlags sampling;
  pp::tools::add_model_flag(app, model, "GGUF file or Ollama tag (e.g. llama3.2:1b, from OLLAMA_MODELS or ~/.ollama/models)");
  auto* ids_opt = app.add_option("--prompt-ids", ids_arg, "prompt token ids, comma-separated (e.g. 496,198,303)");
  auto* text_opt = app.add_option("-p,--prompt", prompt_text, "prompt text (tokenized with the model's tokenizer)");
  ids_opt->excludes(text_opt);
  app.add_flag("--no-bos", no_bos, "with --prompt: do not add BOS even if the model asks for it");
  app.add_flag("--ignore-eos", ignore_eos, "keep generating past end-of-generation tokens (eos/eot/eom stop by default)");
  pp::tools::add_tokens_flag(app, n_tokens, "tokens to generate")->capture_default_str();
  app.add_flag("--ids", print_ids, "print the generated token ids on stdout instead of the text");
  app.add_option("--cuts", cuts, "simulate a split: block indices where stages begin (e.g. --cuts 8 or 4,8,12)")
      ->delimiter(',');
  app.add_option("--wire", wire, "residual dtype at each cut: f32, bf16 (pp_worker's wire) or f16")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  pp::tools::add_threads_flag(app, threads, "compute threads (0 = all cores)");
  bool exact_float = false;
  app.add_flag("--exact-float", exact_float, pp::tools::kExactFloatHelp);
  app.add_option("--ctx", ctx, "KV capacity in positions (0 = min(4096, model context))")->envname("PP_CTX");
  sampling.add_to(app);
  app.add_option("--logits-out", logits_out, "write prompt and per-step logits as golden JSON");
  if (const auto code = pp::tools::parse_command_line(app, argc, argv, "pp_generate")) return *code;
  if (model.empty()) {  // checked after parsing, so an unknown flag is reported as such first
    std::fprintf(stderr, "pp_generate: error: give a model: -m PATH|TAG (see --help)\n");
    return kExitUsage;
  }
  pp::tools::set_exact_float(exact_float);

  const auto fail = [](const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "pp_generate: %s\n", e.what());
    return pp::tools::is_input_error(e) ? kExitUsage : kExitFailed;
  };
  try {
    const pp::SamplingParams sp = sampling.params();
    if (ids_arg.empty() && prompt_text.empty()) throw pp::RequestError("give a prompt: --prompt TEXT or --prompt-ids IDS");
    const auto t_load = std::chrono::steady_clock::now();
    const pp::ResolvedModel resolved = pp::resolve_model(model);
    if (resolved.how == "ollama") std::fprintf(stderr, "model: %s -> %s\n", model.c_str(), resolved.path.c_str());
    pp::LocalPipeline pipe(resolved.path, cuts, pp::parse_wire_dtype(wire), {.ctx = ctx, .threads = threads});
    if (const std::string w = pipe.model().ctx_warning(pipe.stage(0).ctx()); !w.empty())
      std::fprintf(stderr, "pp_generate: warning: %s\n", w.c_str());
    if (const std::string note = sampling.seed_note(); !note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
    // The tokenizer is optional for id prompts (a model without one still runs, printing ids).
    const pp::Tokenizer* tok = pipe.model().tokenizer();
    if (!tok && !prompt_text.empty()) throw pp::TokenizerError(pipe.model().tokenizer_error());
    const std::vector<int32_t> prompt =
        prompt_text.empty() ? pp::tools::parse_prompt_ids(ids_arg) : tok->encode(prompt_text, tok->add_bos() && !no_bos);
    if (prompt.empty()) throw pp::RequestError("the prompt has no tokens");
    const pp::Config& c = pipe.config();
    const std::size_t V = c.n_vocab, n = prompt.size();
    if (n + std::size_t(n_tokens) > pipe.stage(0).ctx())
      throw pp::RequestError("prompt (" + std::to_string(n) + ") + tokens (" + std::to_string(n_tokens) +
                             ") exceed the KV capacity " + std::to_string(pipe.stage(0).ctx()) + " (use --ctx)");
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

    const bool all_rows = !logits_out.empty();
    std::vector<float> prompt_logits, step_logits;
    std::optional<pp::StreamDecoder> text;
    if (tok && !print_ids) text.emplace(*tok);
    // On a terminal the model's text cannot move the cursor or start an escape sequence (shown, not obeyed).
    const bool on_terminal = ::isatty(STDOUT_FILENO) == 1;
    const auto put = [on_terminal](const std::string& piece) {
      std::fputs(on_terminal ? pp::tools::visible_controls(piece).c_str() : piece.c_str(), stdout);
    };
    pp::Generation gen(pipe, {.sampling = sp, .max_tokens = std::size_t(n_tokens),
                              .stop_at_eog = ignore_eos ? nullptr : tok});

    const auto t0 = std::chrono::steady_clock::now();
    gen.prefill(prompt, all_rows ? &prompt_logits : nullptr);
    const auto t1 = std::chrono::steady_clock::now();
    while (const std::optional<int32_t> t = gen.step()) {
      if (all_rows) step_logits.insert(step_logits.end(), gen.logits().begin(), gen.logits().end());
      if (text) {
        if (gen.reason() != pp::StopReason::eog) put(text->feed(*t));  // the end marker is not text
      } else {
        std::printf("%s%d", gen.tokens().size() > 1 ? " " : "", *t);
      }
      std::fflush(stdout);
    }
    const std::vector<int32_t>& out = gen.tokens();
    if (text) put(text->flush());
    std::fputc('\n', stdout);
    std::fflush(stdout);
    const auto t2 = std::chrono::steady_clock::now();

    const double pre = std::chrono::duration<double>(t1 - t0).count();
    const double dec = std::chrono::duration<double>(t2 - t1).count();
    const int decoded = std::max(0, int(out.size()) - 1);
    std::fprintf(stderr, "load %.2f s | prefill %zu tokens %.1f tok/s | decode %d tokens %.2f tok/s | %zu stage(s), wire %s, %u threads%s\n",
                 load_s, n, double(n) / pre, decoded, decoded > 0 ? double(decoded) / dec : 0.0, pipe.n_stages(),
                 wire.c_str(), pipe.stage(0).threads(),
                 gen.reason() == pp::StopReason::eog ? " | stopped at end-of-generation" : "");

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
    return fail(e);
  }
  return 0;
}
