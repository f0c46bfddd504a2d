// Real mode: a Backend over pp::Stage (this stage's blocks of a mapped GGUF), the model's tokenizer and pp::Sampler.
#pragma once

#include "backend.hpp"
#include "startup.hpp"

#include <pp/core/error.hpp>
#include <pp/io/llama_loader.hpp>
#include <pp/io/ollama.hpp>
#include <pp/generation.hpp>
#include <pp/stage.hpp>
#include <pp/text/sampler.hpp>
#include <pp/text/tokenizer.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace pp::worker {

// Names of the tensors stage `st` reads, as Stage::init selects them: its blocks, rope_freqs, token_embd
// on the first stage, output_norm and output (or the tied token_embd) on the last. The worker faults
// them in itself so that the load report can tell parsing from paging; RealBackend checks that their
// bytes add up to Stage::bytes_used(), so a drift from Stage::init shows in the report.
inline std::vector<std::string> stage_tensor_names(const Stage& st) {
  const gguf::File& g = st.gguf();
  std::vector<std::string> names;
  if (g.tensor("rope_freqs.weight")) names.push_back("rope_freqs.weight");
  for (int l = st.range().lo; l < st.range().hi; ++l)
    for (std::string& n : llama::block_tensor_names(l)) names.push_back(std::move(n));
  if (st.is_first()) names.push_back("token_embd.weight");
  if (st.is_last()) {
    names.push_back("output_norm.weight");
    const std::string out = llama::output_tensor_name(g);
    if (!(st.is_first() && out == "token_embd.weight")) names.push_back(out);
  }
  return names;
}

class RealBackend final : public Backend {
 public:
  // Maps stage cfg.stage of cfg.num_stages of the GGUF at `path`. Throws pp::Error (exit 2) when
  // the model cannot be loaded or split that way.
  RealBackend(const WorkerConfig& cfg, const std::string& path) {
    using Clock = std::chrono::steady_clock;
    const auto ms = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    StageOptions opt;
    opt.ctx = std::size_t(cfg.ctx.value_or(0));  // 0: min(4096, the model's context length)
    opt.threads = unsigned(cfg.threads);         // 0: every core
    opt.prefetch = false;                        // done below, timed on its own
    opt_ = opt;

    const auto t0 = Clock::now();
    model_ = Model::open(path);
    stage_ = Stage::open_stage(model_, cfg.stage, cfg.num_stages, opt);
    const auto t1 = Clock::now();
    std::size_t prefetched = 0;
    // Anonymous residency (the default) copied the tensors during the open: their file pages are gone
    // from this process and must not be read back in.
    if (opt.residency == Residency::Anonymous) prefetched = stage_->bytes_used();
    else
      for (const std::string& n : stage_tensor_names(*stage_)) {
        const std::span<const uint8_t> d = stage_->gguf().tensor(n)->data;
        stage_->file().prefetch(d);
        volatile uint8_t sink = 0;  // the reads fault the pages in now rather than on the first request
        for (std::size_t i = 0; i < d.size(); i += 4096) sink = sink + d[i];
        prefetched += d.size();
      }
    const auto t2 = Clock::now();
    tok_ = model_->tokenizer();  // without one the stage still runs; tokenize/detokenize answer the error
    const auto t3 = Clock::now();
    seq_ = std::make_unique<Sequence>(stage_->new_sequence());
    const auto t4 = Clock::now();

    const Config& c = stage_->config();
    geo_.hidden_dim = int(c.n_embd);
    geo_.vocab_size = int(c.n_vocab);
    geo_.total_blocks = int(c.n_layer);
    geo_.layer_range = stage_->range();
    if (tok_) geo_.eos_token_ids = tok_->eog_ids();
    geo_.ctx = int64_t(stage_->ctx());
    geo_.check_token_range = true;
    logits_.resize(c.n_vocab);

    report_ = {{"mode", "real"},
               {"path", path},
               {"load_ms", ms(t0, t4)},
               {"map_parse_ms", ms(t0, t1)},
               {"prefetch_ms", ms(t1, t2)},
               {"tokenizer_ms", ms(t2, t3)},
               {"kv_alloc_ms", ms(t3, t4)},
               {"bytes_mapped", stage_->bytes_used()},
               {"bytes_prefetched", prefetched},
               {"residency", opt.residency == Residency::Mapped ? "mapped" : "anonymous"},
               {"file_bytes", stage_->file().size()},
               {"kv_bytes", seq_->kv.bytes()},
               {"blocks", stage_->range().size()},
               {"threads", stage_->threads()},
               {"ctx", stage_->ctx()},
               {"tokenizer", tok_ != nullptr}};
    if (!tok_) report_["tokenizer_error"] = model_->tokenizer_error();
    if (std::string w = model_->ctx_warning(stage_->ctx()); !w.empty()) report_["ctx_warning"] = std::move(w);
  }

  Geometry geometry() const override { return geo_; }
  nlohmann::ordered_json load_report() const override { return report_; }

  std::vector<int32_t> tokenize(const std::string& prompt, std::optional<bool> add_bos, bool parse_special) override {
    const Tokenizer& t = tokenizer();
    return t.encode(prompt, add_bos.value_or(t.add_bos()), parse_special);
  }

  void embed_and_forward(std::span<const int32_t> tokens, int64_t pos, std::vector<float>& out_rows) override {
    out_rows.resize(tokens.size() * stage_->config().n_embd);
    stage_->embed(tokens, out_rows.data());
    stage_->forward(*seq_, pos, out_rows.data(), tokens.size());
  }

  void forward_range(std::span<float> rows, int n, int64_t pos) override {
    stage_->forward(*seq_, pos, rows.data(), std::size_t(n));
  }

  // The sampled token will occupy position pos + n (one past the last row), the position the
  // sampler's draw is keyed on, as in pp_generate.
  int32_t forward_and_sample(std::span<float> rows, int n, int64_t pos, const SamplingParams& sampling,
                             std::vector<float>* logits_out) override {
    const std::size_t d = stage_->config().n_embd;
    stage_->forward(*seq_, pos, rows.data(), std::size_t(n));
    stage_->head(*seq_, rows.data() + (std::size_t(n) - 1) * d, 1, logits_.data());
    const int32_t token = sampler_.sample(logits_, sampling, pos + n);
    if (logits_out) *logits_out = logits_;
    return token;
  }

  std::string detokenize(std::span<const int32_t> tokens, bool keep_special) override {
    return tokenizer().decode(tokens, keep_special);
  }

  // Greedy over every block in this process, with no wire rounding: the reference a pipeline is
  // checked against. The full-model stage shares this stage's Model (one mapping) and is opened on
  // first use; it keeps its own sequence, so the pipeline's cache is untouched.
  std::vector<int32_t> generate_full(std::span<const int32_t> prompt, int max_tokens) override {
    if (!full_) {
      try {
        StageOptions opt = opt_;
        opt.prefetch = true;
        full_ = std::make_unique<LocalPipeline>(model_, std::vector<int>{}, WireDType::F32, opt);
      } catch (const std::bad_alloc&) {
        throw RequestError("out of memory opening the whole model with ctx " +
                           std::to_string(stage_->ctx()));
      }
    }
    GenerationOptions opt;  // greedy, no early stop
    opt.max_tokens = std::size_t(std::max(0, max_tokens));
    Generation gen(*full_, opt);
    gen.prefill(prompt);
    return gen.run_to_end();
  }

 private:
  const Tokenizer& tokenizer() const {
    if (!tok_) throw RequestError("the model has no usable tokenizer: " + model_->tokenizer_error());
    return *tok_;
  }

  std::shared_ptr<const Model> model_;
  StageOptions opt_;
  std::unique_ptr<Stage> stage_;     // owns the mapping the tokenizer's views point into
  const Tokenizer* tok_ = nullptr;  // model_'s, if it has one
  std::unique_ptr<Sequence> seq_;    // the protocol's one sequence: this stage's KV cache
  std::unique_ptr<LocalPipeline> full_;  // generate_full's whole model (sharing model_), opened on first use
  Sampler sampler_;
  std::vector<float> logits_;        // [vocab_size] the last row's logits
  Geometry geo_;
  nlohmann::ordered_json report_;
};

// Opens real mode for the resolved model. Load failures (unreadable or malformed GGUF, a model
// with fewer blocks than stages, a KV cache that does not fit) are StartupErrors: exit 2.
inline std::unique_ptr<Backend> open_real_backend(const WorkerConfig& cfg, const ResolvedModel& model) {
  try {
    return std::make_unique<RealBackend>(cfg, model.path);
  } catch (const std::bad_alloc&) {
    throw StartupError("cannot load '" + model.path + "': out of memory (KV cache for ctx " +
                       (cfg.ctx ? std::to_string(*cfg.ctx) : std::string("default")) + "; lower PP_CTX)");
  } catch (const StartupError&) {
    throw;
  } catch (const Error& e) {
    throw StartupError("cannot load '" + model.path + "': " + e.what());
  }
}

}  // namespace pp::worker
