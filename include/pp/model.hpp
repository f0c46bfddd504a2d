// A Llama GGUF file opened once: the mapping, the parsed header, the hyperparameters, the tokenizer.
//
//   auto model = pp::Model::open("model.gguf");            // maps the file, reads its header only
//   pp::Stage first(model, {0, 8}), second(model, {8, 16}); // stages share it, touching their own tensors
//   if (const pp::Tokenizer* tok = model->tokenizer()) tok->encode("Hello", true);
//
// Everything above it (stages, the worker, the node's coordinator and serving engine) takes a Model
// instead of a path, so a file is mapped and parsed once per process whatever number of stages it feeds.
// Immutable once open, so one Model is shared across threads; the tokenizer is built on first use.
#pragma once

#include <pp/core/error.hpp>
#include <pp/io/gguf.hpp>
#include <pp/io/llama_loader.hpp>
#include <pp/io/mmap.hpp>
#include <pp/model/config.hpp>
#include <pp/text/tokenizer.hpp>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace pp {

class Model {
 public:
  // Maps `path` and reads its header and hyperparameters; throws pp::Error naming what is wrong.
  static std::shared_ptr<const Model> open(const std::string& path) {
    return std::shared_ptr<const Model>(new Model(path));
  }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // The KV capacity a stage gets when none is asked for: the trained context, at most 4096 positions.
  static constexpr std::size_t kDefaultCtxCap = 4096;

  const std::string& path() const { return file_.path(); }
  const MappedFile& file() const { return file_; }
  const gguf::File& gguf() const { return gguf_; }
  const Config& config() const { return cfg_; }
  std::size_t default_ctx() const { return std::min(kDefaultCtxCap, cfg_.ctx_len); }
  // Empty when a KV capacity of `ctx` positions is within the trained context; otherwise the warning a tool
  // prints (positions past the trained context run, but the model never saw them: its output degrades).
  std::string ctx_warning(std::size_t ctx) const {
    if (ctx <= cfg_.ctx_len) return {};
    return "KV capacity " + std::to_string(ctx) + " is above the model's trained context of " +
           std::to_string(cfg_.ctx_len) + " positions: past position " + std::to_string(cfg_.ctx_len) +
           " the output degrades";
  }

  // The file's tokenizer, built on the first call (its views point into the mapping); null when the file
  // has none or it is refused, and then tokenizer_error() says why.
  const Tokenizer* tokenizer() const {
    load_tokenizer();
    return tok_ ? &*tok_ : nullptr;
  }
  const std::string& tokenizer_error() const {
    load_tokenizer();
    return tok_error_;
  }

 private:
  explicit Model(const std::string& path)
      : file_(path), gguf_(gguf::parse(file_.bytes())), cfg_(llama::read_config(gguf_)) {}

  void load_tokenizer() const {
    std::call_once(tok_once_, [this] {
      try {
        tok_.emplace(Tokenizer::from_gguf(gguf_));
      } catch (const Error& e) {
        tok_error_ = e.what();
      }
    });
  }

  MappedFile file_;
  gguf::File gguf_;
  Config cfg_;
  mutable std::once_flag tok_once_;
  mutable std::optional<Tokenizer> tok_;
  mutable std::string tok_error_;
};

}  // namespace pp
