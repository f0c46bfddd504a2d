// A pipeline stage: a range of decoder blocks of a Model, embed / forward / head, per-sequence state.
//
//   auto model = pp::Model::open("model.gguf");          // mapped and parsed once, shared by stages
//   pp::Stage st(model, pp::LayerRange{0, 8});            // or Stage::open_stage(model, i, n)
//   pp::Sequence seq = st.new_sequence();
//   st.embed(tokens, rows);                               // first stage: [n, n_embd]
//   st.forward(seq, pos, rows, n);                        // this stage's blocks, in place
//   st.head(seq, rows + (n - 1) * n_embd, 1, logits);     // last stage: [1, n_vocab]
//
// Weights are immutable views over the mapping, shared by every Sequence; a Sequence owns its KV cache
// and scratch. Only the stage's own tensors are touched, so resident memory follows its share.
#pragma once

#include <pp/core/buffer.hpp>
#include <pp/core/error.hpp>
#include <pp/core/thread_pool.hpp>
#include <pp/io/gguf.hpp>
#include <pp/io/llama_loader.hpp>
#include <pp/core/anonymous_region.hpp>
#include <pp/kernels/matmul.hpp>
#include <pp/kernels/ops.hpp>
#include <pp/model/block.hpp>
#include <pp/model/config.hpp>
#include <pp/model/kv_cache.hpp>
#include <pp/model/layer_range.hpp>
#include <pp/model/rope.hpp>
#include <pp/model/scratch.hpp>
#include <pp/model.hpp>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace pp {

// Where a stage's weights live while it runs.
enum class Residency {
  Mapped,     // views into the file mapping, pages faulted in at load (prefetch) or on first use
  Anonymous,  // copied at load into anonymous memory advised for huge pages; the mapping is then unused
};

struct StageOptions {
  std::size_t ctx = 0;        // KV capacity in positions; 0 = min(4096, the model's context length)
  unsigned threads = 0;       // compute threads; 0 = hardware concurrency
  // Rows per internal chunk of a long request. Each weight is read once per chunk, and the AMX kernel
  // needs a few hundred rows to keep its tiles busy (prefill 512 runs ~1.3x faster than with 128);
  // the scratch for it (~100 KiB per row at 1B shapes) is backed only as far as requests use it.
  std::size_t max_rows = 512;
  bool prefetch = true;       // fault in the stage's tensors at load instead of on first use
  // Quantized weights: int8 activations and integer dots, llama.cpp's numerics (its distance from exact
  // math on tests/data/golden-kq, 1.3-3.5x faster), or false for the exact path (weights dequantized to
  // f32 inside the dot, within 1e-3 of float64). Float weights ignore it.
  bool fast_quant = true;
  // BF16 weights: activations rounded to bf16 and the CPU's bf16 dot (AVX512-BF16, AArch64 BF16), in prompts and
  // decode steps alike, llama.cpp's numerics. F16 weights: prompts on int16 tiles (AVX512-VNNI or AVX2,
  // kernels/gemm_f16.hpp: closer to exact than llama.cpp's f16 activations), decode steps exact. False:
  // the exact path (f32 activations, within 1e-3 of float64). Unset: kernels::fast_float_default(), fast
  // where this build has a fast path and the CPU no AMX. Other weight types ignore it.
  std::optional<bool> fast_float = std::nullopt;
  // Anonymous by default: decode streams the weights ~1.4x faster from anonymous huge pages than from
  // the file mapping here (docs/PERFORMANCE.md). Mapped shares the page cache between processes.
  Residency residency = Residency::Anonymous;
};

// KV caches of one stage's ended sequences, kept for its next ones. A fresh cache is backed on first
// write, a zeroed page at a time, and a sequence's first rows write into every layer's keys (thousands
// of pages), on the thread that steps every other session too. A reused cache is backed already. The
// pool holds at most as many caches as were in use at once.
class KvPool {
 public:
  std::optional<KvCache> take() {
    std::lock_guard lock(mu_);
    if (free_.empty()) return std::nullopt;
    KvCache kv = std::move(free_.back());
    free_.pop_back();
    return kv;
  }
  void give(KvCache&& kv) {
    kv.reset();
    std::lock_guard lock(mu_);
    free_.push_back(std::move(kv));
  }
  std::size_t size() const {
    std::lock_guard lock(mu_);
    return free_.size();
  }

 private:
  mutable std::mutex mu_;
  std::vector<KvCache> free_;
};

// Per-sequence state of one stage: its KV cache (activations are the stage's, see Stage::scratch_).
class Sequence {
 public:
  Sequence(const Config& c, std::size_t n_blocks, std::size_t ctx, std::shared_ptr<KvPool> pool = nullptr)
      : kv(n_blocks, ctx, c.n_head_kv, c.head_dim), pool_(std::move(pool)) {}
  Sequence(KvCache reused, std::shared_ptr<KvPool> pool) : kv(std::move(reused)), pool_(std::move(pool)) {}
  Sequence(Sequence&&) noexcept = default;
  Sequence& operator=(Sequence&& o) noexcept {
    if (this != &o) {
      release();
      kv = std::move(o.kv);
      pool_ = std::move(o.pool_);
    }
    return *this;
  }
  ~Sequence() { release(); }
  int64_t n_past() const { return kv.n_past(); }
  KvCache kv;

 private:
  void release() {
    if (pool_ && kv.bytes() > 0) pool_->give(std::move(kv));
    pool_.reset();
  }
  std::shared_ptr<KvPool> pool_;  // where the cache goes when the sequence ends
};

class Stage {
 public:
  static constexpr std::size_t kMaxSegments = 64;  // sequences per chunk of a batched step

  // Blocks `range` of an open model: no file is opened or parsed here, only the range's tensors read.
  Stage(std::shared_ptr<const Model> model, LayerRange range, StageOptions opt = {})
      : model_(std::move(model)), gguf_(model_->gguf()), cfg_(model_->config()) {
    init(range, opt);
  }
  // Opens the file for this stage alone (Model::open, then the above).
  Stage(const std::string& path, LayerRange range, StageOptions opt = {}) : Stage(Model::open(path), range, opt) {}

  // Stage `stage` of `n` through compute_layer_range over the model's blocks.
  static std::unique_ptr<Stage> open_stage(std::shared_ptr<const Model> model, int stage, int n, StageOptions opt = {}) {
    const LayerRange r = compute_layer_range(stage, n, int(model->config().n_layer));
    return std::make_unique<Stage>(std::move(model), r, opt);
  }
  static std::unique_ptr<Stage> open_stage(const std::string& path, int stage, int n, StageOptions opt = {}) {
    return open_stage(Model::open(path), stage, n, opt);
  }
  // The whole model in one stage.
  static std::unique_ptr<Stage> open_full(std::shared_ptr<const Model> model, StageOptions opt = {}) {
    const LayerRange r{0, int(model->config().n_layer)};
    return std::make_unique<Stage>(std::move(model), r, opt);
  }
  static std::unique_ptr<Stage> open_full(const std::string& path, StageOptions opt = {}) {
    return open_full(Model::open(path), opt);
  }
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;
  // A mapped stage gives its tensors' pages back: the Model (and its mapping) may outlive it, as in a
  // worker that re-splits between sessions.
  ~Stage() {
    for (std::span<const uint8_t> d : mapped_) model_->file().release(d);
  }

  const Config& config() const { return cfg_; }
  LayerRange range() const { return range_; }
  bool is_first() const { return range_.lo == 0; }
  bool is_last() const { return range_.hi == int(cfg_.n_layer); }
  std::size_t ctx() const { return ctx_; }
  unsigned threads() const { return pool_->size(); }
  // Whether float weights take their fast path here (StageOptions::fast_float).
  bool fast_float() const { return fast_float_; }
  // The kernels this stage computes with, as the handshake reports them: the SIMD target, plus
  // "+bf16dot" when BF16 weights take the fast path and the model multiplies by BF16 matrices (results
  // then differ from an exact end's), "+f16tiles" the same for F16 matrices on gemm_f16's int16 tiles,
  // "+q8tiles" when Q8_0 prompts run on the int8 tiles (fast_quant, AVX512-VNNI or AVX2:
  // the same bits on both; they sum blocks in another order than a build without them). It follows the file, not this stage's
  // range, so every stage of one model with the same settings reports the same profile.
  const std::string& kernel_profile() const { return kernel_profile_; }
  // The same, before any stage of `model` is built with `opt` (a coordinator's handshake may go out
  // while its stage is still loading).
  static std::string kernel_profile_for(const Model& model, const StageOptions& opt) {
    const bool fast_float = fast_float_for(opt);
    bool bf16_blocks = false, f16_blocks = false, q8_blocks = false;
    const bool has_output = model.gguf().tensor("output.weight") != nullptr;
    for (const gguf::TensorInfo& t : model.gguf().tensors) {
      // The head's matrix is output.weight, or the embedding table when the two are tied.
      const bool head = t.name == "output.weight" || (!has_output && t.name == "token_embd.weight");
      const bool multiplied = head || t.name.starts_with("blk.");
      bf16_blocks = bf16_blocks || (multiplied && t.type == gguf::TensorType::BF16);
      f16_blocks = f16_blocks || (multiplied && t.type == gguf::TensorType::F16);
      if (!t.name.starts_with("blk.")) continue;
      q8_blocks = q8_blocks || t.type == gguf::TensorType::Q8_0;
    }
    return std::string(simd::Best::name()) + (fast_float && bf16_blocks && kernels::gemm::kHaveFastBf16 ? "+bf16dot" : "") +
           (fast_float && f16_blocks && kernels::gemm_f16::kAvailable ? "+f16tiles" : "") +
           (q8_blocks && kernels::bulk_on_tiles(DType::Q8_0, opt.fast_quant) ? "+q8tiles" : "");
  }
  // Whether float weights take their fast path with `opt` on this CPU.
  static bool fast_float_for(const StageOptions& opt) {
    return opt.fast_float.value_or(kernels::fast_float_default()) && kernels::kHaveFastFloat;
  }
  const std::shared_ptr<const Model>& model() const { return model_; }
  const gguf::File& gguf() const { return gguf_; }
  const MappedFile& file() const { return model_->file(); }
  // Bytes of the tensors this stage reads (its share of the file).
  std::size_t bytes_used() const { return bytes_used_; }

  Sequence new_sequence() const {
    if (std::optional<KvCache> kv = kv_pool_->take()) return Sequence(std::move(*kv), kv_pool_);
    return Sequence(cfg_, blocks_.size(), ctx_, kv_pool_);
  }
  // KV caches of ended sequences waiting for the next ones (see KvPool).
  std::size_t pooled_caches() const { return kv_pool_->size(); }

  // out[n, n_embd] = embedding rows of `tokens` (first stage). Throws RequestError on an id out of range.
  void embed(std::span<const int32_t> tokens, float* out) const {
    require(is_first(), "embed");
    for (int32_t t : tokens)
      if (t < 0 || std::size_t(t) >= cfg_.n_vocab)
        throw RequestError("token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                           std::to_string(cfg_.n_vocab) + ")");
    for (std::size_t i = 0; i < tokens.size(); ++i) kernels::row_to_f32(embd_, std::size_t(tokens[i]), out + i * cfg_.n_embd);
  }

  // rows[n, n_embd] at positions pos..pos+n-1 through this stage's blocks, in place. Validates the request
  // against the sequence's cache first (see KvCache) and leaves it unchanged when refused.
  // A request of kernels::kBulkRows rows or more (a prompt) may run on AMX tiles, which round in another
  // order than the vector path shorter requests take: a row's result depends on its own request's size
  // (never on threads, chunking at max_rows or other sequences), so runs that feed the same requests
  // agree bit for bit.
  void forward(Sequence& seq, int64_t pos, float* rows, std::size_t n) const {
    const BatchEntry e{&seq, pos, n};
    forward_batch({&e, 1}, rows);
  }

  // One entry of a multi-sequence step: n rows of `seq` at positions pos..pos+n-1.
  struct BatchEntry {
    Sequence* seq;
    int64_t pos;
    std::size_t n;
  };

  // Several sequences through this stage together: rows holds every entry's rows, concatenated
  // ([sum n, n_embd], in place). Each weight is read once per chunk of up to max_rows rows for all of
  // them, and each row's result is the same as if its sequence ran alone. Every entry is validated
  // before anything changes; the sequences must be distinct. Calls from several threads take turns.
  void forward_batch(std::span<const BatchEntry> batch, float* rows) const {
    if (batch.empty()) return;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      batch[i].seq->kv.validate(batch[i].pos, batch[i].n);
      for (std::size_t j = 0; j < i; ++j)
        if (batch[j].seq == batch[i].seq) throw RequestError("a sequence appears twice in one batch");
    }
    const std::size_t hp = cfg_.head_dim / 2;
    std::lock_guard lock(run_mu_);
    Scratch& s = scratch_;
    Segment segs[kMaxSegments];
    std::size_t entry = 0, done = 0;  // next row to run: row `done` of batch[entry]
    float* x = rows;
    while (entry < batch.size()) {
      // Fill one chunk of up to max_rows rows with (parts of) consecutive entries.
      std::size_t m = 0, n_segs = 0;
      while (entry < batch.size() && m < max_rows_ && n_segs < kMaxSegments) {
        const BatchEntry& b = batch[entry];
        const std::size_t take = std::min(b.n - done, max_rows_ - m);
        const int64_t p = b.pos + int64_t(done);
        segs[n_segs] = Segment{&b.seq->kv, p, m, take, b.n >= kernels::kBulkRows};
        for (std::size_t i = 0; i < take; ++i) {
          rope_.table(p + int64_t(i), s.cos.data() + (m + i) * hp, s.sin.data() + (m + i) * hp);
          s.row_seg[m + i] = uint32_t(n_segs);
        }
        ++n_segs, m += take, done += take;
        if (done == b.n) ++entry, done = 0;
      }
      const std::span<const Segment> chunk(segs, n_segs);
      for (std::size_t l = 0; l < blocks_.size(); ++l) block_forward(cfg_, blocks_[l], chunk, l, m, x, s, *pool_, fast_quant_, fast_float_);
      for (const Segment& g : chunk) g.kv->commit(g.pos, g.n);
      x += m * cfg_.n_embd;
    }
  }

  // logits[n, n_vocab] of rows[n, n_embd]: final norm and output projection (last stage).
  void head(Sequence& seq, const float* rows, std::size_t n, float* logits) const {
    require(is_last(), "head");
    (void)seq;  // the head reads no cache: any sequence's rows
    std::lock_guard lock(run_mu_);
    Scratch& s = scratch_;
    for (std::size_t c0 = 0; c0 < n; c0 += max_rows_) {
      const std::size_t m = std::min(max_rows_, n - c0);
      for (std::size_t i = 0; i < m; ++i)
        kernels::rmsnorm(rows + (c0 + i) * cfg_.n_embd, out_norm_, cfg_.rms_eps, cfg_.n_embd,
                         s.xn.data() + i * cfg_.n_embd);
      // Never bulk: a row's logits must not depend on how many rows a caller asks for at once (a
      // prompt's last row, all of them for --logits-out, one row per sequence of a decoding batch).
      kernels::matmul(*pool_, output_, s.xn.data(), m, logits + c0 * cfg_.n_vocab, {fast_quant_, s.xq.span(), fast_float_},
                      /*bulk=*/false);
    }
  }

 private:
  void require(bool ok, const char* op) const {
    if (!ok)
      throw RequestError(std::string(op) + " is not available on a stage owning blocks [" +
                         std::to_string(range_.lo) + ", " + std::to_string(range_.hi) + ") of " +
                         std::to_string(cfg_.n_layer));
  }

  void init(LayerRange range, const StageOptions& opt) {
    if (range.lo < 0 || range.hi > int(cfg_.n_layer) || range.lo > range.hi ||
        (range.lo == range.hi && range.lo != 0 && range.hi != int(cfg_.n_layer)))
      throw Error("layer range [" + std::to_string(range.lo) + ", " + std::to_string(range.hi) +
                  ") is not within the model's " + std::to_string(cfg_.n_layer) + " blocks");
    range_ = range;
    ctx_ = opt.ctx ? opt.ctx : model_->default_ctx();
    if (ctx_ > llama::kMaxCtx) throw Error("ctx " + std::to_string(ctx_) + " exceeds " + std::to_string(llama::kMaxCtx));
    max_rows_ = std::max<std::size_t>(1, std::min(opt.max_rows, ctx_));
    fast_quant_ = opt.fast_quant;
    fast_float_ = fast_float_for(opt);
    kernel_profile_ = kernel_profile_for(*model_, opt);
    pool_ = std::make_unique<ThreadPool>(opt.threads);
    scratch_ = Scratch(cfg_, max_rows_, ctx_, pool_->size());
    rope_ = Rope(cfg_.head_dim, cfg_.rope_base, llama::rope_freq_factors(gguf_, cfg_));

    std::vector<std::string> used;
    if (gguf_.tensor("rope_freqs.weight")) used.push_back("rope_freqs.weight");
    for (int l = range_.lo; l < range_.hi; ++l) {
      blocks_.push_back(llama::block_tensors(gguf_, cfg_, l));
      for (auto& n : llama::block_tensor_names(l)) used.push_back(n);
    }
    if (is_first()) {
      embd_ = llama::matrix(gguf_, "token_embd.weight", cfg_.n_embd, cfg_.n_vocab);
      used.push_back("token_embd.weight");
    }
    if (is_last()) {
      out_norm_ = llama::norm_vector(gguf_, "output_norm.weight", cfg_.n_embd);
      output_ = llama::output_matrix(gguf_, cfg_);
      used.push_back("output_norm.weight");
      if (!is_first() || std::string(llama::output_tensor_name(gguf_)) != "token_embd.weight")
        used.push_back(llama::output_tensor_name(gguf_));
    }
    for (const auto& n : used) bytes_used_ += gguf_.tensor(n)->n_bytes;
    if (opt.residency == Residency::Anonymous) {
      make_resident(used);
    } else {
      for (const auto& n : used) mapped_.push_back(gguf_.tensor(n)->data);
      if (opt.prefetch)
        for (std::span<const uint8_t> d : mapped_) touch(d);
    }
  }

  // Copies the stage's tensors into one anonymous, huge-page-advised region and repoints every view.
  void make_resident(const std::vector<std::string>& used) {
    std::size_t total = 0;
    for (const auto& n : used) total += (gguf_.tensor(n)->n_bytes + kAlign - 1) / kAlign * kAlign;
    resident_ = AnonymousRegion(total);
    std::vector<std::pair<const uint8_t*, const uint8_t*>> moved;  // old data -> copy
    std::size_t off = 0;
    // In pieces, each piece's file pages released once copied: the copy is what counts now, not the
    // file's pages as well, and a large tensor (an embedding: 0.2-1 GB) never counts twice either. The
    // next piece is asked for (read-ahead) while one is copied: one large read instead of a page fault
    // per read-ahead window, which a busy or slow disk turns into minutes for a few GB.
    constexpr std::size_t kPiece = std::size_t(16) << 20;
    auto piece = [&](std::span<const uint8_t> d, std::size_t o) { return d.subspan(o, std::min(kPiece, d.size() - o)); };
    if (!used.empty()) model_->file().prefetch(piece(gguf_.tensor(used[0])->data, 0));
    for (std::size_t i = 0; i < used.size(); ++i) {
      const gguf::TensorInfo* t = gguf_.tensor(used[i]);
      uint8_t* dst = resident_.data() + off;
      for (std::size_t o = 0; o < t->n_bytes; o += kPiece) {
        const std::size_t n = std::min(kPiece, t->n_bytes - o);
        if (o + n < t->n_bytes) model_->file().prefetch(piece(t->data, o + n));
        else if (i + 1 < used.size()) model_->file().prefetch(piece(gguf_.tensor(used[i + 1])->data, 0));
        std::memcpy(dst + o, t->data.data() + o, n);
        model_->file().release(t->data.subspan(o, n));
      }
      model_->file().release(t->data);  // the pages the pieces' edges cut
      moved.emplace_back(t->data.data(), dst);
      off += (t->n_bytes + kAlign - 1) / kAlign * kAlign;
    }
    auto repoint = [&](const uint8_t* p) {
      for (const auto& [from, to] : moved)
        if (from == p) return to;
      return p;  // not a stage tensor (cannot happen for views built in init)
    };
    auto fix = [&](MatView& m) { m.data = repoint(m.data); };
    auto fixf = [&](const float*& f) { f = reinterpret_cast<const float*>(repoint(reinterpret_cast<const uint8_t*>(f))); };
    for (auto& b : blocks_) {
      fixf(b.attn_norm), fixf(b.ffn_norm);
      fix(b.wq), fix(b.wk), fix(b.wv), fix(b.wo), fix(b.w_gate), fix(b.w_up), fix(b.w_down);
    }
    if (embd_.data) fix(embd_);
    if (output_.data) fix(output_);
    if (out_norm_) fixf(out_norm_);
  }

  // Faults the pages of a tensor in now, so the first token does not pay for it.
  void touch(std::span<const uint8_t> d) {
    model_->file().prefetch(d);
    volatile uint8_t sink = 0;
    for (std::size_t i = 0; i < d.size(); i += 4096) sink = sink + d[i];
    (void)sink;
  }

  std::shared_ptr<const Model> model_;
  const gguf::File& gguf_;  // model_'s
  Config cfg_;
  LayerRange range_;
  std::size_t ctx_ = 0, max_rows_ = 32, bytes_used_ = 0;
  bool fast_quant_ = false;
  bool fast_float_ = false;
  std::string kernel_profile_;  // see kernel_profile()
  std::shared_ptr<KvPool> kv_pool_ = std::make_shared<KvPool>();
  std::unique_ptr<ThreadPool> pool_;
  // The activations of one chunk, sized by max_rows, ctx and the pool, backed as requests use them: the
  // executor's, not a sequence's, so a session holds only its KV cache. run_mu_ gives them (and the
  // pool) to one forward / head call at a time.
  mutable std::mutex run_mu_;
  mutable Scratch scratch_;
  Rope rope_;
  AnonymousRegion resident_;  // the weights' copy under Residency::Anonymous
  std::vector<std::span<const uint8_t>> mapped_;  // the tensors read from the mapping (Residency::Mapped)
  std::vector<BlockWeights> blocks_;
  MatView embd_{}, output_{};
  const float* out_norm_ = nullptr;
};

}  // namespace pp
