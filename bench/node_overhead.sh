#!/usr/bin/env bash
# Per-token cost of pp_node's 2-stage loopback pipeline against the single-process generator (issue 5).
#
#   bench/node_overhead.sh BUILD_DIR MODEL.gguf [RUNS] [DECODE_TOKENS] [PROMPT_TOKENS] [THREADS]
#
# Runs pp_generate and a coordinator + one worker (cut at n_layer / 2) on loopback alternately, RUNS
# times each, same prompt ids, same tokens, same threads per process, and prints the median decode
# ms/token of each, the difference, and pp_node's bytes on the wire per token. A Llama-3.2-1B-shaped
# model: `pp_gguf synth --preset llama3.2-1b --dtype bf16 --ctx 4096 l1b.gguf`.
set -euo pipefail
build=${1:?build dir}
model=${2:?model gguf}
runs=${3:-5}
n=${4:-33}
prompt_n=${5:-8}
threads=${6:-2}
gen="$build/tools/pp_generate"
node="$build/tools/pp_node"
ids=$(seq -s, 1 "$prompt_n")
tmp=$(mktemp -d)
worker_pid=""
cleanup() { [ -n "$worker_pid" ] && kill "$worker_pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

"$node" --worker --model "$model" --host 127.0.0.1 --port 0 --threads "$threads" >"$tmp/w.out" 2>"$tmp/w.err" &
worker_pid=$!
for _ in $(seq 100); do grep -q "Ctrl-C to stop" "$tmp/w.out" 2>/dev/null && break; sleep 0.1; done
port=$(grep -o 'listening on 127.0.0.1:[0-9]*' "$tmp/w.out" | cut -d: -f2)

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
single=() pipe=() pre_single=() pre_pipe=()
for r in $(seq "$runs"); do
  # pp_generate: "prefill P tokens X tok/s | decode D tokens Y tok/s"
  line=$("$gen" -m "$model" --prompt-ids "$ids" -n "$n" -t "$threads" --ignore-eos 2>&1 >/dev/null | grep 'decode')
  single+=("$(echo "$line" | sed -E 's/.*decode [0-9]+ tokens ([0-9.]+) tok\/s.*/\1/' | awk '{print 1000/$1}')")
  pre_single+=("$(echo "$line" | sed -E 's/.*prefill [0-9]+ tokens ([0-9.]+) tok\/s.*/\1/')")
  out=$("$node" --coordinator "127.0.0.1:$port" --model "$model" --prompt-ids "$ids" --tokens "$n" --ignore-eos \
        --threads "$threads" --verify none)
  pipe+=("$(echo "$out" | sed -nE 's/.*decode: [0-9]+ tokens in [0-9.]+ ms = [0-9.]+ tokens\/s \(([0-9.]+) ms\/token\).*/\1/p')")
  pre_pipe+=("$(echo "$out" | sed -nE 's/.*prefill: [0-9]+ tokens in [0-9.]+ ms = ([0-9.]+) tokens\/s.*/\1/p')")
  wire=$(echo "$out" | grep '  wire:')
  rtt=$(echo "$out" | grep 'round-trip us:')
  echo "run $r: single ${single[-1]} ms/token, pipeline ${pipe[-1]} ms/token" >&2
done
s=$(printf '%s\n' "${single[@]}" | median)
p=$(printf '%s\n' "${pipe[@]}" | median)
echo "model $(basename "$model"), $threads threads per process, prompt $prompt_n, $((n - 1)) decode tokens, $runs runs (medians)"
echo "  single process (pp_generate): $s ms/token decode, prefill $(printf '%s\n' "${pre_single[@]}" | median) tokens/s"
echo "  2-stage loopback (pp_node):   $p ms/token decode, prefill $(printf '%s\n' "${pre_pipe[@]}" | median) tokens/s"
awk -v s="$s" -v p="$p" 'BEGIN {printf "  overhead: %+.3f ms/token (%+.2f%% of decode)\n", p - s, (p - s) / s * 100}'
echo "  last pipeline run:$rtt"
echo "  last pipeline run:$wire"
