// The compute behind one pp_worker stage: the interface the protocol layer drives (stub or real).
#pragma once

#include <pp/model/layer_range.hpp>
#include <pp/text/sampler.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace pp::worker {

// What the ready line announces and what request validation checks against.
struct Geometry {
  int hidden_dim = 0;
  int vocab_size = 0;
  int total_blocks = 0;
  LayerRange layer_range;              // this stage's blocks, [lo, hi)
  std::vector<int32_t> eos_token_ids;  // end-of-generation ids (empty in stub mode)
  int64_t ctx = 0;                     // KV capacity in positions; also bounds seq_len and tokens
  bool check_token_range = false;      // real mode rejects ids >= vocab_size; stub accepts any id
};

// Sampling fields of forward_and_sample, validated by the worker (temperature > 0 and finite,
// top_k >= 1, top_p in (0, 1], min_p in [0, 1), seed uint64). The library's sampler defines them and
// the draw, so the worker, the generator and the node pick the same token for the same (seed, pos).
using SamplingParams = pp::SamplingParams;

// One stage. Hidden rows are f32 [n, hidden_dim] row-major; the wire's bf16/f16 is not this
// interface's concern. Methods throw pp::Error (RequestError for a bad request, which must leave
// the stage's state as it was); the worker answers with an error line and keeps serving.
// Role checks happen before these are called: a method is only called on a stage whose role serves
// its op (tokenize/embed on First, forward_range on Middle, sample/detokenize on Last), except that
// generate_full (any stage) first calls tokenize(prompt, nullopt, true) when given a prompt.
class Backend {
 public:
  virtual ~Backend() = default;

  virtual Geometry geometry() const = 0;
  // Extra fields of the `model_loaded` event (load-time breakdown, bytes mapped, resident MB, ...).
  virtual nlohmann::ordered_json load_report() const = 0;

  // add_bos absent: what the model's metadata says.
  virtual std::vector<int32_t> tokenize(const std::string& prompt, std::optional<bool> add_bos,
                                        bool parse_special) = 0;
  // tokens [n] at absolute positions pos..pos+n-1 -> out_rows [n, hidden_dim] (resized by the callee).
  virtual void embed_and_forward(std::span<const int32_t> tokens, int64_t pos, std::vector<float>& out_rows) = 0;
  // rows [n, hidden_dim], transformed in place by this stage's blocks.
  virtual void forward_range(std::span<float> rows, int n, int64_t pos) = 0;
  // rows [n, hidden_dim] -> blocks, final norm, output head; samples the last row. With
  // logits_out non-null it receives that row's logits [vocab_size].
  virtual int32_t forward_and_sample(std::span<float> rows, int n, int64_t pos, const SamplingParams& sampling,
                                     std::vector<float>* logits_out) = 0;
  virtual std::string detokenize(std::span<const int32_t> tokens, bool keep_special) = 0;
  // Greedy generation over the whole model in this process; max_tokens ids, no stop at EOS.
  virtual std::vector<int32_t> generate_full(std::span<const int32_t> prompt, int max_tokens) = 0;
};

}  // namespace pp::worker
