// Stages chained in one process, with the residual rounded to a wire dtype at each cut.
//
// This is the single-process reference for distributed runs: with the same cuts and wire dtype, a
// pipeline of processes or machines must produce exactly these logits.
#pragma once

#include <pp/core/buffer.hpp>
#include <pp/core/wire_dtype.hpp>
#include <pp/stage.hpp>

#include <memory>
#include <span>
#include <string>
#include <vector>

namespace pp {

class LocalPipeline {
 public:
  // cuts: block indices where one stage ends and the next begins (strictly increasing, inside (0, n_layer)).
  LocalPipeline(const std::string& path, const std::vector<int>& cuts, WireDType wire = WireDType::F32,
                StageOptions opt = {})
      : LocalPipeline(Model::open(path), cuts, wire, opt) {}
  LocalPipeline(std::shared_ptr<const Model> model, const std::vector<int>& cuts, WireDType wire = WireDType::F32,
                StageOptions opt = {})
      : wire_(wire) {
    const int n_layer = int(model->config().n_layer);
    int lo = 0;
    for (std::size_t i = 0; i <= cuts.size(); ++i) {
      const int hi = i < cuts.size() ? cuts[i] : n_layer;
      if (hi <= lo || hi > n_layer)
        throw RequestError("cuts must be strictly increasing within (0, " + std::to_string(n_layer) + ")");
      stages_.push_back(std::make_unique<Stage>(model, LayerRange{lo, hi}, opt));
      seqs_.push_back(stages_.back()->new_sequence());
      lo = hi;
    }
    const Config& c = config();
    rows_ = Buffer<float>(c.n_embd * stages_.front()->ctx());
  }

  const Config& config() const { return stages_.front()->config(); }
  const Model& model() const { return *stages_.front()->model(); }
  const Stage& stage(std::size_t i) const { return *stages_[i]; }
  std::size_t n_stages() const { return stages_.size(); }

  // Runs tokens at positions pos.. through every stage; logits[n_out, n_vocab] of the last n_out rows.
  void run(std::span<const int32_t> tokens, int64_t pos, float* logits, std::size_t n_out = 1) {
    const Config& c = config();
    const std::size_t n = tokens.size();
    if (n > stages_.front()->ctx())
      throw RequestError("seq_len " + std::to_string(n) + " exceeds the KV capacity " +
                         std::to_string(stages_.front()->ctx()));
    if (n_out > n) n_out = n;
    float* x = rows_.data();
    stages_.front()->embed(tokens, x);
    for (std::size_t s = 0; s < stages_.size(); ++s) {
      if (s > 0) round_to_wire({x, n * c.n_embd}, wire_);
      stages_[s]->forward(seqs_[s], pos, x, n);
    }
    stages_.back()->head(seqs_.back(), x + (n - n_out) * c.n_embd, n_out, logits);
  }

 private:
  WireDType wire_;
  std::vector<std::unique_ptr<Stage>> stages_;
  std::vector<Sequence> seqs_;
  Buffer<float> rows_;  // [ctx, n_embd] the residual between stages
};

}  // namespace pp
