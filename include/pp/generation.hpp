// One generation in one process: a prompt, then a token at a time, sampled by the (seed, position)
// rule, until a stop condition.
//
//   auto model = pp::Model::open("model.gguf");
//   pp::LocalPipeline pipe(model, {8});                      // or pp::FullModel whole(model)
//   pp::Generation gen(pipe, {.sampling = sp, .max_tokens = 64, .stop_at_eog = model->tokenizer()});
//   gen.prefill(prompt);
//   while (auto t = gen.step()) use(*t);
//
// The token at absolute position p is drawn with sample_uniform(seed, p), so a generation gives the same
// tokens whether it runs here, across processes, or in a batch with others; this loop is the reference
// the distributed paths are checked against (pp_generate, the worker's generate_full, the tests).
#pragma once

#include <pp/core/buffer.hpp>
#include <pp/core/error.hpp>
#include <pp/local_pipeline.hpp>
#include <pp/stage.hpp>
#include <pp/text/sampler.hpp>
#include <pp/text/tokenizer.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace pp {

// Every block of a model in one stage, with its own sequence: what a Generation runs when there are no
// cuts. LocalPipeline offers the same run() with cuts and wire rounding.
class FullModel {
 public:
  explicit FullModel(std::shared_ptr<const Model> model, StageOptions opt = {})
      : stage_(Stage::open_full(std::move(model), opt)), seq_(stage_->new_sequence()) {}

  const Config& config() const { return stage_->config(); }
  const Stage& stage() const { return *stage_; }
  std::size_t ctx() const { return stage_->ctx(); }

  // Runs tokens at positions pos..; logits[n_out, n_vocab] of the last n_out rows (as LocalPipeline::run).
  void run(std::span<const int32_t> tokens, int64_t pos, float* logits, std::size_t n_out = 1) {
    const std::size_t n = tokens.size(), d = config().n_embd;
    if (n_out > n) n_out = n;
    if (rows_.size() < n * d) rows_ = Buffer<float>(n * d);
    stage_->embed(tokens, rows_.data());
    stage_->forward(seq_, pos, rows_.data(), n);
    stage_->head(seq_, rows_.data() + (n - n_out) * d, n_out, logits);
  }

 private:
  std::unique_ptr<Stage> stage_;
  Sequence seq_;
  Buffer<float> rows_;
};

// Why a generation ended.
enum class StopReason { none, length, eog };

struct GenerationOptions {
  SamplingParams sampling;          // greedy unless a sampling field is set
  std::size_t max_tokens = 16;      // tokens to generate at most
  // When set, a token this tokenizer calls end-of-generation ends the generation; it is still returned.
  const Tokenizer* stop_at_eog = nullptr;
};

// R: FullModel, LocalPipeline, or anything with config() and run(tokens, pos, logits, n_out).
template <class R>
class Generation {
 public:
  Generation(R& runner, GenerationOptions opt) : r_(runner), opt_(opt), logits_(runner.config().n_vocab) {
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
  R& r_;
  GenerationOptions opt_;
  Sampler sampler_;
  std::vector<float> logits_;
  std::vector<int32_t> tokens_;
  int64_t next_pos_ = 0;
  bool prefilled_ = false;
  StopReason reason_ = StopReason::none;
};

}  // namespace pp
