// One generation in one process: a prompt, then a token at a time, sampled by the (seed, position)
// rule, until a stop condition.
//
//   auto model = pp::Model::open("model.gguf");
//   pp::LocalPipeline pipe(model, {8});                      // {} : the whole model in one stage
//   pp::Generation gen(pipe, {.sampling = sp, .max_tokens = 64, .stop_at_eog = model->tokenizer()});
//   gen.prefill(prompt);
//   while (auto t = gen.step()) use(*t);
//
// The token at absolute position p is drawn with sample_uniform(seed, p), so a generation gives the same
// tokens whether it runs here, across processes, or in a batch with others; this loop is the reference
// the distributed paths are checked against (pp_generate, the worker's generate_full, the tests).
#pragma once

#include <pp/core/error.hpp>
#include <pp/local_pipeline.hpp>
#include <pp/text/sampler.hpp>
#include <pp/text/tokenizer.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace pp {

// Why a generation ended.
enum class StopReason { none, length, eog };

struct GenerationOptions {
  SamplingParams sampling;          // greedy unless a sampling field is set
  std::size_t max_tokens = 16;      // tokens to generate at most
  // When set, a token this tokenizer calls end-of-generation ends the generation; it is still returned.
  const Tokenizer* stop_at_eog = nullptr;
};

// Over a LocalPipeline: no cuts for the whole model in one stage, or cuts with the wire's rounding.
class Generation {
 public:
  Generation(LocalPipeline& runner, GenerationOptions opt) : r_(runner), opt_(opt), logits_(runner.config().n_vocab) {
    opt_.sampling.validate();
  }

  // Runs the prompt from position 0. prompt_logits, when given, receives the logits of every prompt row
  // ([n, n_vocab]); otherwise only the last row's are computed.
  void prefill(std::span<const int32_t> prompt, std::vector<float>* prompt_logits = nullptr) {
    if (prompt.empty()) throw RequestError("the prompt has no tokens");
    if (prefilled_) throw RequestError("a generation is prefilled once");
    const std::size_t V = logits_.size(), n = prompt.size();
    if (prompt_logits) {
      prompt_logits->resize(n * V);
      r_.run(prompt, 0, prompt_logits->data(), n);
      std::copy(prompt_logits->end() - std::ptrdiff_t(V), prompt_logits->end(), logits_.begin());
    } else {
      r_.run(prompt, 0, logits_.data(), 1);
    }
    next_pos_ = int64_t(n);
    prefilled_ = true;
    if (opt_.max_tokens == 0) reason_ = StopReason::length;
  }

  // The next token (the one at position next_pos()), or nothing once the generation has ended. The
  // first call samples the prompt's last logits; each later one first runs the previous token.
  std::optional<int32_t> step() {
    if (!prefilled_) throw RequestError("step before prefill");
    if (reason_ != StopReason::none) return std::nullopt;
    if (!tokens_.empty()) r_.run({&tokens_.back(), 1}, next_pos_ - 1, logits_.data(), 1);
    const int32_t t = sampler_.sample(logits_, opt_.sampling, next_pos_);
    tokens_.push_back(t);
    ++next_pos_;
    if (opt_.stop_at_eog && opt_.stop_at_eog->is_eog(t)) reason_ = StopReason::eog;
    else if (tokens_.size() >= opt_.max_tokens) reason_ = StopReason::length;
    return t;
  }

  // Runs step() to the end; the generated tokens.
  const std::vector<int32_t>& run_to_end() {
    while (step()) {
    }
    return tokens_;
  }

  const std::vector<int32_t>& tokens() const { return tokens_; }
  // The logits the last token was sampled from.
  std::span<const float> logits() const { return logits_; }
  int64_t next_pos() const { return next_pos_; }
  StopReason reason() const { return reason_; }
  bool done() const { return reason_ != StopReason::none; }

 private:
  LocalPipeline& r_;
  GenerationOptions opt_;
  Sampler sampler_;
  std::vector<float> logits_;
  std::vector<int32_t> tokens_;
  int64_t next_pos_ = 0;
  bool prefilled_ = false;
  StopReason reason_ = StopReason::none;
};

}  // namespace pp
