// pp_worker start-up configuration: STAGE/NUM_STAGES and the optional environment, validated strictly.
#pragma once

#include "wire.hpp"
#include "../common/exit_status.hpp"

#include <pp/core/error.hpp>
#include <pp/core/hex.hpp>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

namespace pp::worker {

// A start-up setting that is missing or malformed: one line on stderr, exit status 2.
class StartupError : public Error {
 public:
  using Error::Error;
};

inline constexpr int kExitStartup = tools::kExitUsage;  // the protocol's status for a bad start
inline constexpr int64_t kDefaultStubCtx = 4096;
inline constexpr int64_t kMaxCtx = int64_t(1) << 24;  // keeps the line limit and buffers far from overflow
inline constexpr int64_t kDefaultHeartbeatSecs = 30;
inline constexpr int64_t kMaxThreads = 1024;

// Options from the command line (the environment supplies the rest).
struct CliOptions {
  bool stub = false;
  std::optional<std::string> model;
  std::optional<std::string> ctx;
  std::optional<std::string> threads;
};

struct WorkerConfig {
  int stage = 0;
  int num_stages = 0;
  bool stub = false;
  std::optional<std::string> model;  // --model, else $MODEL (real mode)
  std::optional<int64_t> ctx;        // --ctx, else PP_CTX; absent: the backend's default
  int64_t threads = 0;               // --threads, else PP_THREADS: compute threads of real mode; 0 = every core
  WireDType wire_dtype = WireDType::BF16;
  bool events_on_stdout = false;
  int64_t heartbeat_secs = kDefaultHeartbeatSecs;
  int64_t stub_delay_ms = 0;  // test hook: every stub op sleeps this long
};

// getenv by default; tests pass their own.
using EnvLookup = std::function<const char*(const char*)>;

inline bool is_ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }

// An ASCII decimal integer with an optional '-', surrounded by optional ASCII whitespace. No '+',
// no other digits (U+0660 is not a digit here), at most 18 digits. nullopt otherwise.
inline std::optional<int64_t> parse_ascii_decimal(std::string_view s) {
  while (!s.empty() && is_ascii_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_ascii_space(s.back())) s.remove_suffix(1);
  bool negative = false;
  if (!s.empty() && s.front() == '-') {
    negative = true;
    s.remove_prefix(1);
  }
  if (s.empty() || s.size() > 18) return std::nullopt;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return negative ? -v : v;
}

// The value as it appeared, quoted, with control bytes escaped so the message stays one line.
inline std::string quote_value(std::string_view s) {
  std::string q = "'";
  for (char c : s) {
    const auto u = uint8_t(c);
    if (u < 0x20 || u == 0x7f) {
      q += "\\x";
      append_hex(q, u);
    } else {
      q += c;
    }
  }
  return q + "'";
}

namespace detail {

inline std::optional<std::string_view> env_value(const EnvLookup& env, const char* name) {
  const char* v = env(name);
  if (!v) return std::nullopt;
  return std::string_view(v);
}

// Optional settings: unset or empty means "default".
inline std::optional<std::string_view> optional_env(const EnvLookup& env, const char* name) {
  auto v = env_value(env, name);
  if (v && v->empty()) return std::nullopt;
  return v;
}

inline int64_t bounded_int(std::string_view raw, const std::string& name, int64_t lo, int64_t hi) {
  const std::optional<int64_t> v = parse_ascii_decimal(raw);
  if (!v) throw StartupError(name + "=" + quote_value(raw) + " is not an ASCII decimal integer");
  if (*v < lo || *v > hi)
    throw StartupError(name + "=" + quote_value(raw) + " is outside [" + std::to_string(lo) + ", " +
                       std::to_string(hi) + "]");
  return *v;
}

inline bool flag(std::string_view raw, const char* name) {
  std::string_view s = raw;
  while (!s.empty() && is_ascii_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_ascii_space(s.back())) s.remove_suffix(1);
  if (s == "1" || s == "true") return true;
  if (s == "0" || s == "false") return false;
  throw StartupError(std::string(name) + "=" + quote_value(raw) + " is not a flag (1, 0, true or false)");
}

}  // namespace detail

// STAGE and NUM_STAGES exactly as the protocol says: both required, ASCII decimal,
// NUM_STAGES >= 2, 0 <= STAGE < NUM_STAGES. Throws StartupError naming the variable and value.
inline std::pair<int, int> read_stage_env(const EnvLookup& env) {
  constexpr int64_t kMaxStages = 1 << 16;
  const auto stage_raw = detail::env_value(env, "STAGE");
  if (!stage_raw) throw StartupError("STAGE is not set (required: this stage's index, 0 <= STAGE < NUM_STAGES)");
  const auto n_raw = detail::env_value(env, "NUM_STAGES");
  if (!n_raw) throw StartupError("NUM_STAGES is not set (required: the number of pipeline stages, >= 2)");
  const std::optional<int64_t> stage = parse_ascii_decimal(*stage_raw);
  if (!stage) throw StartupError("STAGE=" + quote_value(*stage_raw) + " is not an ASCII decimal integer");
  const std::optional<int64_t> n = parse_ascii_decimal(*n_raw);
  if (!n) throw StartupError("NUM_STAGES=" + quote_value(*n_raw) + " is not an ASCII decimal integer");
  if (*n < 2) throw StartupError("NUM_STAGES=" + quote_value(*n_raw) + " is below 2 (a pipeline has >= 2 stages)");
  if (*n > kMaxStages)
    throw StartupError("NUM_STAGES=" + quote_value(*n_raw) + " is above " + std::to_string(kMaxStages));
  if (*stage < 0) throw StartupError("STAGE=" + quote_value(*stage_raw) + " is negative (must be >= 0)");
  if (*stage >= *n)
    throw StartupError("STAGE=" + quote_value(*stage_raw) + " is out of range: must be < NUM_STAGES (" +
                       std::to_string(*n) + ")");
  return {int(*stage), int(*n)};
}

inline WorkerConfig read_config(const CliOptions& cli, const EnvLookup& env = [](const char* n) {
  return std::getenv(n);
}) {
  WorkerConfig c;
  std::tie(c.stage, c.num_stages) = read_stage_env(env);

  c.stub = cli.stub;
  if (auto v = detail::optional_env(env, "PP_WORKER_STUB")) c.stub = c.stub || detail::flag(*v, "PP_WORKER_STUB");

  if (cli.model) {
    if (cli.model->empty()) throw StartupError("--model is empty");
    c.model = cli.model;
  } else if (auto v = detail::optional_env(env, "MODEL")) {
    c.model = std::string(*v);
  }

  if (cli.ctx) {
    c.ctx = detail::bounded_int(*cli.ctx, "--ctx", 1, kMaxCtx);
  } else if (auto v = detail::optional_env(env, "PP_CTX")) {
    c.ctx = detail::bounded_int(*v, "PP_CTX", 1, kMaxCtx);
  }

  if (cli.threads) {
    c.threads = detail::bounded_int(*cli.threads, "--threads", 0, kMaxThreads);
  } else if (auto v = detail::optional_env(env, "PP_THREADS")) {
    c.threads = detail::bounded_int(*v, "PP_THREADS", 0, kMaxThreads);
  }

  if (auto v = detail::optional_env(env, "PP_WIRE_DTYPE")) {
    if (*v == "bf16" || *v == "bfloat16") {
      c.wire_dtype = WireDType::BF16;
    } else if (*v == "f16" || *v == "float16") {
      c.wire_dtype = WireDType::F16;
    } else {
      throw StartupError("PP_WIRE_DTYPE=" + quote_value(*v) + " is not bf16 or f16");
    }
  }
  if (auto v = detail::optional_env(env, "PP_WORKER_EVENTS")) c.events_on_stdout = detail::flag(*v, "PP_WORKER_EVENTS");
  if (auto v = detail::optional_env(env, "PP_HEARTBEAT_SECS"))
    c.heartbeat_secs = detail::bounded_int(*v, "PP_HEARTBEAT_SECS", 0, 86400);
  if (auto v = detail::optional_env(env, "PP_WORKER_STUB_DELAY_MS"))
    c.stub_delay_ms = detail::bounded_int(*v, "PP_WORKER_STUB_DELAY_MS", 0, 3600 * 1000);
  return c;
}

// The longest request line accepted: the largest legal request is a forward_range or
// forward_and_sample of ctx rows, ctx * hidden_dim * 2 bytes as base64, plus slack for the other
// fields and for long prompts.
inline constexpr size_t kLineSlack = size_t(1) << 20;

inline size_t max_line_bytes(int64_t ctx, int hidden_dim) {
  return base64::encoded_size(size_t(ctx) * size_t(hidden_dim) * kWireBytesPerValue) + kLineSlack;
}

}  // namespace pp::worker
