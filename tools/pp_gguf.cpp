// pp_gguf: inspect GGUF files (`info`: metadata, tensors, per-type totals, what each stage of a split maps).
//
// Errors print one line on stderr and exit 2 (a bad command line, or a file it names that cannot be read,
// parsed or written). Unlike the parser, this tool knows Llama's tensor
// names: it needs them to say which tensors a pipeline stage would map.
#include <pp/core/error.hpp>
#include <pp/core/printable.hpp>
#include <pp/io/gguf.hpp>
#include <pp/io/llama_loader.hpp>
#include <pp/io/mmap.hpp>
#include <pp/model.hpp>
#include <pp/model/kv_cache.hpp>

#include "common/build_info.hpp"
#include "common/cli.hpp"
#include "common/synth.hpp"

#include <CLI/CLI.hpp>

#include <cinttypes>
#include <cstdio>
#include <exception>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr uint64_t kArrayPreview = 5;       // array elements shown per metadata array
constexpr std::size_t kStringPreview = 96;  // bytes of a string shown before eliding

double mib(uint64_t bytes) { return double(bytes) / (1024.0 * 1024.0); }

// A string made printable on one line, quoted: control and non-ASCII bytes escaped, long ones elided.
std::string quoted(std::string_view s, std::size_t max_bytes = kStringPreview) {
  return "\"" + pp::printable(s, max_bytes) + "\"";
}

std::string fmt_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Element i of a scalar array, formatted.
std::string array_elem(const pp::gguf::Value& a, uint64_t i) {
  using pp::gguf::File;
  using VT = pp::gguf::ValueType;
  switch (a.elem) {
    case VT::U8: return std::to_string(File::array_at<uint8_t>(a, i));
    case VT::I8: return std::to_string(File::array_at<int8_t>(a, i));
    case VT::U16: return std::to_string(File::array_at<uint16_t>(a, i));
    case VT::I16: return std::to_string(File::array_at<int16_t>(a, i));
    case VT::U32: return std::to_string(File::array_at<uint32_t>(a, i));
    case VT::I32: return std::to_string(File::array_at<int32_t>(a, i));
    case VT::U64: return std::to_string(File::array_at<uint64_t>(a, i));
    case VT::I64: return std::to_string(File::array_at<int64_t>(a, i));
    case VT::F32: return fmt_double(File::array_at<float>(a, i));
    case VT::F64: return fmt_double(File::array_at<double>(a, i));
    case VT::BOOL: return File::array_at<uint8_t>(a, i) ? "true" : "false";
    case VT::STRING: return quoted(a.strings[i], 32);
    case VT::ARRAY: break;
  }
  return "?";
}

std::string format_value(const pp::gguf::Value& v) {
  using VT = pp::gguf::ValueType;
  switch (v.type) {
    case VT::U8: case VT::U16: case VT::U32: case VT::U64: return std::to_string(v.u);
    case VT::I8: case VT::I16: case VT::I32: case VT::I64: return std::to_string(v.i);
    case VT::F32: case VT::F64: return fmt_double(v.f);
    case VT::BOOL: return v.u ? "true" : "false";
    case VT::STRING: return quoted(v.str);
    case VT::ARRAY: {
      std::string out = "[" + std::string(pp::gguf::value_type_name(v.elem)) + " x " + std::to_string(v.count) + "]";
      const uint64_t shown = std::min(v.count, kArrayPreview);
      for (uint64_t i = 0; i < shown; ++i) out += (i ? ", " : " ") + array_elem(v, i);
      if (v.count > shown) out += ", ...";
      return out;
    }
  }
  return "?";
}

std::string format_shape(const pp::gguf::TensorInfo& t) {
  std::string out = "[";
  for (uint32_t d = 0; d < t.n_dims; ++d) out += (d ? ", " : "") + std::to_string(t.ne[d]);
  return out + "]";
}

// Block index of a `blk.L.*` tensor, or -1 for any other name.
int64_t block_of(std::string_view name) {
  constexpr std::string_view prefix = "blk.";
  if (name.substr(0, prefix.size()) != prefix) return -1;
  name.remove_prefix(prefix.size());
  const std::size_t dot = name.find('.');
  if (dot == 0 || dot == std::string_view::npos || dot > 9) return -1;
  int64_t l = 0;
  for (char c : name.substr(0, dot)) {
    if (c < '0' || c > '9') return -1;
    l = l * 10 + (c - '0');
  }
  return l;
}

bool is_tensor(std::string_view name, std::string_view base) {
  return name.substr(0, base.size()) == base && name.size() > base.size() && name[base.size()] == '.';
}

// The model's block count: `<general.architecture>.block_count`, `llama.block_count` without an arch.
uint64_t block_count(const pp::gguf::File& f) {
  const std::string arch = f.has("general.architecture") ? std::string(f.get_string("general.architecture")) : "llama";
  const std::string key = arch + ".block_count";
  if (!f.has(key)) throw pp::GgufError("metadata '" + key + "': missing (needed for --stages)");
  return f.get_uint(key);
}

struct StagePlan {
  uint64_t begin = 0, end = 0;  // block range [begin, end)
  std::vector<const pp::gguf::TensorInfo*> tensors;
  uint64_t bytes = 0;
};

// Stage i of n over `total` blocks: k = total / n, [i*k, (i+1)*k), the last stage ends at total.
// Each maps its blocks and rope_freqs; the first also token_embd; the last output_norm and output
// (token_embd when the output is tied, i.e. there is no output.weight).
std::vector<StagePlan> plan_stages(const pp::gguf::File& f, uint64_t n, uint64_t total) {
  if (n < 2 || total < n)
    throw pp::Error("cannot split " + std::to_string(total) + " blocks into " + std::to_string(n) +
                    " stages (need 2 <= stages <= blocks)");
  bool has_output = false;
  for (const auto& t : f.tensors) has_output |= is_tensor(t.name, "output");
  const uint64_t k = total / n;
  std::vector<StagePlan> plans(n);
  for (uint64_t i = 0; i < n; ++i) {
    StagePlan& p = plans[i];
    p.begin = i * k;
    p.end = i + 1 == n ? total : (i + 1) * k;
    const bool first = i == 0, last = i + 1 == n;
    for (const auto& t : f.tensors) {
      const int64_t l = block_of(t.name);
      const bool mapped = (l >= 0 && uint64_t(l) >= p.begin && uint64_t(l) < p.end) ||
                          is_tensor(t.name, "rope_freqs") || (first && is_tensor(t.name, "token_embd")) ||
                          (last && (is_tensor(t.name, "output_norm") || is_tensor(t.name, "output") ||
                                    (!has_output && is_tensor(t.name, "token_embd"))));
      if (!mapped) continue;
      p.tensors.push_back(&t);
      p.bytes += t.n_bytes;
    }
  }
  return plans;
}

struct InfoOptions {
  std::string path;
  uint64_t stages = 0;    // 0: no split summary
  uint64_t ctx = 0;       // KV capacity per session for the memory estimate; 0: min(4096, trained context)
  uint64_t sessions = 1;  // sessions each stage holds at once (pp_node --parallel)
};

// The KV cache a stage holds per block: sessions x KvCache::bytes_per_layer(ctx, kv_dim), from the
// model's hyperparameters; nullopt (with the reason) when the file does not describe a Llama model.
struct KvEstimate {
  uint64_t per_block = 0, ctx = 0, sessions = 0;
  std::string unknown;  // why there is no estimate
};
KvEstimate kv_estimate(const pp::gguf::File& f, const InfoOptions& opt) {
  KvEstimate e;
  try {
    const pp::Config c = pp::llama::read_config(f);
    e.ctx = opt.ctx ? opt.ctx : std::min<uint64_t>(pp::Model::kDefaultCtxCap, c.ctx_len);
    e.sessions = opt.sessions;
    e.per_block = opt.sessions * pp::KvCache::bytes_per_layer(e.ctx, c.kv_dim());
  } catch (const pp::Error& err) {
    e.unknown = err.what();
  }
  return e;
}

void print_stages(const std::vector<StagePlan>& plans, uint64_t total, const KvEstimate& kv) {
  const uint64_t n = plans.size();
  std::printf("\nsplit into %" PRIu64 " stages over %" PRIu64 " blocks:\n", n, total);
  for (uint64_t i = 0; i < n; ++i) {
    const StagePlan& p = plans[i];
    const char* role = i == 0 ? "first" : i + 1 == n ? "last" : "middle";
    std::printf("  stage %" PRIu64 " (%s): blocks [%" PRIu64 ", %" PRIu64 "), %zu tensors, %" PRIu64
                " bytes (%.2f MiB)\n",
                i, role, p.begin, p.end, p.tensors.size(), p.bytes, mib(p.bytes));
    std::string others;
    for (const auto* t : p.tensors)
      if (block_of(t->name) < 0) others.append(" ").append(pp::printable(t->name));
    std::printf("    outside blocks:%s\n", others.empty() ? " (none)" : others.c_str());
    if (!kv.unknown.empty()) {
      std::printf("    memory: weights %s; KV unknown (%s)\n", pp::format_bytes(p.bytes).c_str(),
                  pp::printable(kv.unknown).c_str());
      continue;
    }
    const uint64_t kv_bytes = (p.end - p.begin) * kv.per_block;
    std::printf("    memory: weights %s + KV %s (%" PRIu64 " session(s) x ctx %" PRIu64 ") = %s\n",
                pp::format_bytes(p.bytes).c_str(), pp::format_bytes(kv_bytes).c_str(), kv.sessions, kv.ctx,
                pp::format_bytes(p.bytes + kv_bytes).c_str());
  }
}

int run_info(const InfoOptions& opt) {
  const pp::MappedFile file(opt.path);
  const pp::gguf::File f = pp::gguf::parse(file.bytes());
  // Plan the split before printing anything, so an error leaves stdout empty.
  const uint64_t total = opt.stages ? block_count(f) : 0;
  const auto plans = opt.stages ? plan_stages(f, opt.stages, total) : std::vector<StagePlan>{};

  std::printf("file: %s (%zu bytes, %s)\n", opt.path.c_str(), file.size(), pp::format_bytes(file.size()).c_str());
  std::printf("version: %u\nalignment: %u\ndata offset: %" PRIu64 "\n", f.version, f.alignment, f.data_offset);

  std::printf("\nmetadata (%zu):\n", f.kv.size());
  for (const auto& [key, v] : f.kv)
    std::printf("  %-40s %-6s %s\n", pp::printable(key).c_str(), pp::gguf::value_type_name(v.type), format_value(v).c_str());

  std::printf("\ntensors (%zu):\n", f.tensors.size());
  std::printf("  %-40s %-8s %-24s %12s %12s\n", "name", "type", "shape", "bytes", "offset");
  struct Total {
    uint64_t count = 0, elements = 0, bytes = 0;
  };
  std::map<std::string, Total> per_type;
  Total all;
  for (const auto& t : f.tensors) {
    const char* type = pp::gguf::type_name(t.type);
    std::printf("  %-40s %-8s %-24s %12" PRIu64 " %12" PRIu64 "\n", pp::printable(t.name).c_str(), type,
                format_shape(t).c_str(), t.n_bytes, t.offset);
    for (Total* tot : {&per_type[type], &all}) {
      tot->count += 1;
      tot->elements += t.n_elements;
      tot->bytes += t.n_bytes;
    }
  }

  std::printf("\ntotals per type:\n");
  const auto print_total = [](const std::string& label, const Total& tot) {
    std::printf("  %-8s %6" PRIu64 " tensors %14" PRIu64 " elements %14" PRIu64 " bytes (%.2f MiB)\n",
                label.c_str(), tot.count, tot.elements, tot.bytes, mib(tot.bytes));
  };
  for (const auto& [type, tot] : per_type) print_total(type, tot);
  print_total("total", all);

  if (!plans.empty()) print_stages(plans, total, kv_estimate(f, opt));
  return 0;
}

struct SynthOptions {
  std::string out, preset = "tiny", dtype = "bf16", vocab_from;
  uint64_t seed = 1;
  std::size_t layers = 0, embd = 0, heads = 0, kv_heads = 0, ff = 0, vocab = 0, ctx = 0;
};


// Writes a synthetic Llama-3.2-layout model (tools/common/synth.hpp) and prints what it wrote.
int run_synth(const SynthOptions& o) {
  pp::synth::Spec s = o.preset == "llama3.2-1b" ? pp::synth::llama32_1b() : pp::synth::Spec{};
  if (o.preset != "tiny" && o.preset != "llama3.2-1b")
    throw pp::Error("--preset '" + o.preset + "' is not one of tiny, llama3.2-1b");
  pp::synth::set_file_type(s, o.dtype);
  s.seed = o.seed;
  s.vocab_from = o.vocab_from;
  if (o.layers) s.n_layer = o.layers;
  if (o.embd) s.n_embd = o.embd;
  if (o.heads) s.n_head = o.heads;
  if (o.kv_heads) s.n_head_kv = o.kv_heads;
  if (o.ff) s.n_ff = o.ff;
  if (o.vocab) s.n_vocab = o.vocab;
  if (o.ctx) s.ctx = o.ctx;
  if (s.vocab_from.empty() && s.n_vocab < 272)
    throw pp::Error("--vocab " + std::to_string(s.n_vocab) + " is too small for the byte-level tokenizer (>= 272)");
  const uint64_t bytes = pp::synth::write(s, o.out);
  std::printf("wrote %s: %zu blocks, hidden %zu, %zu/%zu heads, ff %zu, %s, %s\n", o.out.c_str(), s.n_layer,
              s.n_embd, s.n_head, s.n_head_kv, s.n_ff, o.dtype.c_str(), pp::format_bytes(bytes).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Inspect GGUF files"};
  app.set_version_flag("--version", [] { return pp::tools::version_line("pp_gguf"); });
  app.footer(pp::tools::kExitFooter);
  app.require_subcommand(1);

  InfoOptions info;
  CLI::App* info_cmd = app.add_subcommand("info", "Print metadata, tensors, per-type totals and a stage split");
  CLI::Option* file_pos = info_cmd->add_option("file", info.path, "GGUF file");
  CLI::Option* file_opt = info_cmd->add_option("-m,--model", info.path, "GGUF file (instead of the positional FILE)");
  file_pos->excludes(file_opt);
  info_cmd->add_option("--stages", info.stages, "Also show what each stage of an N-way split maps and the memory it needs (N >= 2)")
      ->check(CLI::Range(uint64_t(2), uint64_t(1) << 20));
  info_cmd->add_option("--ctx", info.ctx, "with --stages: KV capacity per session (default min(4096, trained context))")
      ->check(CLI::Range(uint64_t(1), uint64_t(pp::llama::kMaxCtx)));
  info_cmd->add_option("--sessions", info.sessions, "with --stages: sessions each stage holds (pp_node --parallel)")
      ->check(CLI::Range(uint64_t(1), uint64_t(4096)));

  SynthOptions synth;
  CLI::App* synth_cmd = app.add_subcommand("synth", "Write a synthetic Llama-3.2-layout model with random weights");
  synth_cmd->add_option("out", synth.out, "output GGUF path")->required();
  synth_cmd->add_option("--preset", synth.preset, "tiny (golden-tiny's shapes) or llama3.2-1b (exact 1B shapes)");
  synth_cmd->add_option("--dtype", synth.dtype, "weight type: f32, f16, bf16, q8_0, q6_k, q4_0, q4_1, q5_0, q5_1, q4_k_m, q5_k_m (llama-quantize's mixes)");
  synth_cmd->add_option("--seed", synth.seed, "weight seed");
  synth_cmd->add_option("--vocab-from", synth.vocab_from, "copy the tokenizer (and vocabulary size) from this GGUF");
  synth_cmd->add_option("--layers", synth.layers, "override: decoder blocks");
  synth_cmd->add_option("--embd", synth.embd, "override: hidden size");
  synth_cmd->add_option("--heads", synth.heads, "override: query heads");
  synth_cmd->add_option("--kv-heads", synth.kv_heads, "override: key/value heads");
  synth_cmd->add_option("--ff", synth.ff, "override: feed-forward width");
  synth_cmd->add_option("--vocab", synth.vocab, "override: vocabulary size (byte-level tokenizer)");
  synth_cmd->add_option("--ctx", synth.ctx, "override: context length");

  // CLI11 reports an unknown subcommand as a missing one; name the word the user typed.
  if (argc > 1 && argv[1][0] != '-' && std::string_view(argv[1]) != "info" && std::string_view(argv[1]) != "synth") {
    std::fprintf(stderr, "pp_gguf: error: unknown subcommand '%s' (info or synth) (see --help)\n",
                 argv[1]);
    return pp::tools::kExitUsage;
  }
  if (const auto code = pp::tools::parse_command_line(app, argc, argv, "pp_gguf")) return *code;
  if (*info_cmd && info.path.empty()) {
    std::fprintf(stderr, "pp_gguf: error: info needs a GGUF file (pp_gguf info FILE) (see --help)\n");
    return pp::tools::kExitUsage;
  }

  try {
    if (*info_cmd) return run_info(info);
    if (*synth_cmd) return run_synth(synth);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "pp_gguf: %s\n", e.what());
    return pp::tools::kExitUsage;  // a file it names cannot be read, parsed or written
  }
  return pp::tools::kExitUsage;
}
