// One command-line style for every tool (docs/CLI.md): the same flags for the same things, the same
// environment fallbacks, the same exit statuses, sizes in KiB/MiB/GiB.
//
//   -m, --model PATH|TAG   -p, --prompt TEXT   -n, --tokens N   -t, --threads N ($PP_THREADS)
//   --ctx N ($PP_CTX)      --seed S            --temperature T (0 = greedy)   --top-k / --top-p / --min-p
//   --ignore-eos           --version           --help
#pragma once

#include <pp/core/error.hpp>
#include <pp/core/printable.hpp>
#include <pp/io/ollama.hpp>
#include <pp/text/sampler.hpp>

#include <CLI/CLI.hpp>

#include "common/exit_status.hpp"

#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace pp::tools {

// True for an error in what the command line names (a model that is missing, not GGUF or not runnable, a
// prompt or request the model refuses): exit 2, "cannot start", rather than a failure of the run.
inline bool is_input_error(const std::exception& e) {
  return dynamic_cast<const ModelResolveError*>(&e) || dynamic_cast<const GgufError*>(&e) ||
         dynamic_cast<const ModelError*>(&e) || dynamic_cast<const TokenizerError*>(&e) ||
         dynamic_cast<const RequestError*>(&e);
}

// Parses argv. Returns the exit status when the tool should stop now: 0 after --help / --version, 2 after a
// bad command line (the error on stderr, prefixed by the tool's name, with a pointer to --help).
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv, const char* tool) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: error: %s (see --help)\n", tool, e.what());
    return kExitUsage;
  }
}

// "A,B,C" -> integers in [lo, hi]; throws pp::RequestError naming `flag` and the item that is not one
// (`what` describes a valid item).
inline std::vector<int32_t> parse_int_list(const std::string& s, const std::string& flag, long lo, long hi,
                                           const std::string& what) {
  std::vector<int32_t> out;
  std::size_t start = 0;
  while (start <= s.size()) {
    const std::size_t comma = std::min(s.find(',', start), s.size());
    const std::string item = s.substr(start, comma - start);
    std::size_t used = 0;
    long v = lo - 1;
    try {
      v = std::stol(item, &used);
    } catch (const std::exception&) {
    }
    if (item.empty() || used != item.size() || v < lo || v > hi)
      throw RequestError(flag + ": '" + item + "' is not " + what);
    out.push_back(int32_t(v));
    start = comma + 1;
  }
  return out;
}

// --prompt-ids: "496,198,303" -> ids.
inline std::vector<int32_t> parse_prompt_ids(const std::string& s) {
  return parse_int_list(s, "--prompt-ids", 0, INT32_MAX, "a non-negative token id");
}

// ---- the shared flags ----

inline CLI::Option* add_model_flag(CLI::App& app, std::string& model, const std::string& help) {
  return app.add_option("-m,--model", model, help)->type_name("PATH|TAG");
}
inline CLI::Option* add_threads_flag(CLI::App& app, unsigned& threads, const std::string& help) {
  return app.add_option("-t,--threads", threads, help)->envname("PP_THREADS")->check(CLI::Range(0u, 4096u));
}
inline CLI::Option* add_tokens_flag(CLI::App& app, int64_t& tokens, const std::string& help,
                                    int64_t max = int64_t(1) << 20) {
  return app.add_option("-n,--tokens", tokens, help)->check(CLI::Range(int64_t(0), max));
}

// --temperature / --top-k / --top-p / --min-p / --seed, as every tool reads them. Without any of them the
// tools decode greedily (argmax); --temperature 0 is greedy too, whatever else is given (as in the API).
// Sampling without --seed draws a random seed, reported by seed_note() so the run can be repeated.
struct SamplingFlags {
  std::optional<double> temperature, top_p, min_p;
  std::optional<int64_t> top_k;
  std::optional<uint64_t> seed;
  bool seed_drawn = false;

  void add_to(CLI::App& app) {
    app.add_option("--temperature", temperature, "sample at this temperature (> 0); 0 = greedy (argmax, the default)");
    app.add_option("--top-k", top_k, "sample from the k most likely tokens (>= 1)");
    app.add_option("--top-p", top_p, "sample from the smallest set with probability >= p, (0, 1]");
    app.add_option("--min-p", min_p, "drop tokens below min_p x the top probability, [0, 1)");
    app.add_option("--seed", seed, "sampling seed: the same seed gives the same tokens (default: random, printed)");
  }

  // The parameters these flags ask for; throws pp::RequestError when a value is out of range.
  SamplingParams params() {
    if (temperature && *temperature < 0)
      throw RequestError("--temperature must be >= 0 (0 = greedy), got " + std::to_string(*temperature));
    SamplingParams sp;
    if (!(temperature && *temperature == 0.0)) {
      sp.temperature = temperature;
      sp.top_k = top_k;
      sp.top_p = top_p;
      sp.min_p = min_p;
    } else {  // greedy: the other fields are still checked, so a typo is not silently ignored
      SamplingParams check{.temperature = 1.0, .top_k = top_k, .top_p = top_p, .min_p = min_p};
      check.validate();
    }
    sp.validate();
    if (seed) {
      sp.seed = *seed;
    } else if (!sp.greedy()) {
      std::random_device rd;
      sp.seed = (uint64_t(rd()) << 32) | rd();
      seed_drawn = true;
    }
    seed = sp.seed;
    return sp;
  }
  // "seed 1234 (drawn; --seed 1234 repeats this run)" when params() drew one, else empty.
  std::string seed_note() const {
    if (!seed_drawn) return {};
    return "sampling seed " + std::to_string(*seed) + " (drawn at random; --seed " + std::to_string(*seed) +
           " repeats this run)";
  }
};

}  // namespace pp::tools
