#!/usr/bin/env bash
# pp beside llama.cpp on the same 1B-shaped GGUF files, interleaved in one run, as ratios.
#
#   bash bench/compare_llamacpp.sh [LLAMA_BIN] [TYPES]      # e.g. "" "bf16 f16 q8_0 q4_k_m"
#
# LLAMA_BIN: the folder with llama-bench (default: built by ../shared/tools/llama.cpp/build.sh, ~5 min,
# once per machine). TYPES: weight types among bf16 f16 q8_0 q4_k_m (default: all four). For each type
# and thread count (1, 2) it runs `llama-bench -mmp 0` (prompt 128 and 512, 32 generated tokens) and then
# pp_bench's Prefill and Decode on the same file (pp_bench generates missing files under
# $PP_BENCH_MODELS, default ./models), and prints one table: tokens/s of each, pp / llama.cpp, and decode
# as a fraction of the triad bandwidth measured between pp's tokens. Also the CPU, the kernels and the
# load average, which belong next to every figure. Env: PP_BUILD (default build-native), REPS (3).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
types=${2:-"bf16 f16 q8_0 q4_k_m"}
build=${PP_BUILD:-build-native}
reps=${REPS:-3}
export PP_BENCH_MODELS=${PP_BENCH_MODELS:-$PWD/models}
if [ -z "$bin" ]; then bin=$(bash ../shared/tools/llama.cpp/build.sh); fi
[ -x "$bin/llama-bench" ] || { echo "no llama-bench in '$bin'" >&2; exit 2; }
[ -x "$build/bench/pp_bench" ] || { echo "no $build/bench/pp_bench: meson setup $build -Dbench=true && ninja -C $build" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

idx() { case $1 in bf16) echo 0 ;; f16) echo 1 ;; q8_0) echo 2 ;; q4_k_m) echo 3 ;; *) echo "unknown type $1" >&2; exit 2 ;; esac; }

echo "host: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1), $(nproc) cores; load at start $(cut -d' ' -f1-3 /proc/loadavg)"
[ -x "$build/tools/pp_node" ] || ninja -C "$build" tools/pp_node >/dev/null || exit 1  # for --version: the kernels
echo "pp: $("$build/tools/pp_node" --version)"
echo "llama.cpp: $bin"
for t in $types; do
  i=$(idx "$t")
  model="$PP_BENCH_MODELS/synth-llama3.2-1b-$t.gguf"
  if [ ! -f "$model" ]; then  # pp_bench makes it; a 1-iteration filter that only loads
    mkdir -p "$PP_BENCH_MODELS"
    "$build/tools/pp_gguf" synth --preset llama3.2-1b --dtype "$t" "$model" >/dev/null
  fi
  for th in 1 2; do
    "$bin/llama-bench" -m "$model" -t "$th" -p 128,512 -n 32 -r "$reps" -mmp 0 -o json >"$out/llama-$t-$th.json" 2>/dev/null
    "$build/bench/pp_bench" --benchmark_filter="^BM_(Bandwidth/$th|Prefill/$i/(128|512)/$th|Decode/$i/$th/1)/" \
      --benchmark_format=json >"$out/pp-$t-$th.json" 2>/dev/null
  done
done
echo "load at end $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$out" $types <<'PY'
import json, sys, os
out, types = sys.argv[1], sys.argv[2:]
def llama(t, th):
    rows = json.load(open(f"{out}/llama-{t}-{th}.json"))
    r = {}
    for e in rows:
        key = f"p{e['n_prompt']}" if e["n_prompt"] else f"n{e['n_gen']}"
        r[key] = e["avg_ts"]
    return r
def pp(t, th):
    bs = json.load(open(f"{out}/pp-{t}-{th}.json"))["benchmarks"]
    r = {}
    for b in bs:
        n = b["name"]
        if n.startswith("BM_Bandwidth"): r["triad"] = b["GB/s"]
        elif n.startswith("BM_Prefill"): r["p" + n.split("/")[2]] = b["tok/s"]
        elif n.startswith("BM_Decode"): r["dec"], r["frac"], r["triad_between"] = b["tok/s"], b["fraction"], b["triad_GB/s"]
    return r
print()
print("| weights | threads | triad GB/s | prefill 128 pp / llama = ratio | prefill 512 pp / llama = ratio | decode pp / llama = ratio | decode / triad between tokens |")
print("|---|---|---|---|---|---|---|")
for t in types:
    for th in (1, 2):
        L, P = llama(t, th), pp(t, th)
        cell = lambda a, b: f"{a:.1f} / {b:.1f} = **{a / b:.2f}**"
        print(f"| {t.upper()} | {th} | {P.get('triad', 0):.1f} | {cell(P['p128'], L['p128'])} | {cell(P['p512'], L['p512'])} "
              f"| {cell(P['dec'], L['n32'])} | {P['frac']:.2f} (of {P['triad_between']:.1f} GB/s) |")
PY
