#!/usr/bin/env bash
# A Llama-3.1-8B-shaped model split across processes (issue 19 item 5): tokens of the 2- and 4-stage
# pipelines against one process, each stage's memory against its share of the weights, and decode
# tokens/s of one process next to llama.cpp's on the same file.
#   bash bench/split_large.sh [MODEL.gguf] [LLAMA_BIN]
# MODEL defaults to models/synth-llama3.1-8b-q4_k_m.gguf, generated if missing (32 blocks, hidden 4096,
# 32/8 heads, FFN 14336, Q4_K_M: 4.3 GiB, ~2 min). LLAMA_BIN: a llama.cpp bin folder with llama-bench
# (../shared/tools/llama.cpp/build.sh builds one); without it the llama.cpp column is left out.
# All processes run on this machine over loopback; a stage's memory is its VmRSS after generating and
# its VmHWM (peak), from /proc.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/synth-llama3.1-8b-q4_k_m.gguf}
llama_bin=${2:-}
bin=build-native/tools
tokens=${TOKENS:-16}
threads=${THREADS:-2}
ids=128000,791,6864,315,9822,374,12366,13  # 8 prompt ids
ninja -C build-native tools/pp_gguf tools/pp_generate tools/pp_node >/dev/null
if [ ! -f "$model" ]; then
  mkdir -p "$(dirname "$model")"
  "$bin/pp_gguf" synth "$model" --preset llama3.2-1b --layers 32 --embd 4096 --heads 32 --kv-heads 8 --ff 14336 \
    --dtype q4_k_m --ctx 8192
fi
layers=$("$bin/pp_gguf" info "$model" | awk '/block_count/ {n = $NF} END {print n}')
echo "== $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== model: $model ($layers blocks, $(du -h "$model" | cut -f1)); $tokens tokens after 8 prompt ids, greedy"

kib() { awk -v k="$1" 'BEGIN { printf "%.0f MiB", k / 1024 }'; }
mem_of() { awk '/^VmRSS/ {r = $2} /^VmHWM/ {h = $2} END {print r, h}' "/proc/$1/status"; }

# One process: the reference ids and its decode rate.
ref=$("$bin/pp_generate" -m "$model" --prompt-ids "$ids" -n "$tokens" --ids --ignore-eos -t "$threads" --ctx 512 \
  2>/tmp/pp_split_ref.log)
echo "one process: $(grep -Eo 'load [0-9.]+ s|decode [0-9]+ tokens [0-9.]+ tok/s' /tmp/pp_split_ref.log | paste -sd, -)"
echo "  ids: $ref"

for n in 2 4; do
  cuts=$(awk -v L="$layers" -v n="$n" 'BEGIN { for (i = 1; i < n; i++) printf "%s%d", (i > 1 ? "," : ""), int(L * i / n) }')
  workers=(); hosts=()
  for ((i = 1; i < n; i++)); do
    port=$((53400 + RANDOM % 500 + 10 * i))
    "$bin/pp_node" --worker --model "$model" --host 127.0.0.1 --port "$port" --threads "$threads" --max-ctx 512 \
      >"/tmp/pp_split_w$i.log" 2>&1 &
    workers+=($!); hosts+=("127.0.0.1:$port")
  done
  trap 'kill ${workers[*]} 2>/dev/null || true' EXIT
  for i in "${!hosts[@]}"; do
    for _ in $(seq 600); do
      grep -q listening "/tmp/pp_split_w$((i + 1)).log" 2>/dev/null && break
      sleep 0.1
    done
  done
  chain=$(IFS=,; echo "${hosts[*]}")
  # --verify none: the coordinator then holds only its own stage (--verify all would map the whole
  # model to check every token); the ids are compared with the one-process run here instead.
  "$bin/pp_node" --coordinator "$chain" --model "$model" --cuts "$cuts" --prompt-ids "$ids" --tokens "$tokens" \
    --ignore-eos --threads "$threads" --ctx 512 --verify none >/tmp/pp_split_c.log 2>&1 &
  coord=$!
  peak_c=0
  while kill -0 $coord 2>/dev/null; do
    read -r _ h < <(mem_of $coord 2>/dev/null || echo "0 0") || true
    [ "${h:-0}" -gt "$peak_c" ] && peak_c=$h
    sleep 0.2
  done
  wait $coord || { echo "coordinator failed:"; tail -5 /tmp/pp_split_c.log; exit 1; }
  got=$(sed -n 's/^ *tokens: //p' /tmp/pp_split_c.log | tr ' ' ',' | tail -1)
  want=$(echo "$ref" | tr -s ' \n' ',' | sed 's/,$//')
  verdict=$([ "$got" = "$want" ] && echo "IDENTICAL to one process" || echo "DIFFERENT: $got")
  echo "$n stages (cuts $cuts): $verdict; $(grep -E '^ *decode:' /tmp/pp_split_c.log | sed 's/^ *//')"
  echo "  stage 0 (coordinator): peak $(kib "$peak_c") (sampled every 0.2 s)"
  shares=$("$bin/pp_gguf" info "$model" --stages "$n" --ctx 512 | awk '/^ *stage [0-9]+/ {s = $2} /memory: weights/ {print s, $3, $4}')
  for i in "${!workers[@]}"; do
    read -r rss hwm < <(mem_of "${workers[$i]}")
    share=$(echo "$shares" | awk -v s=$((i + 1)) '$1 == s {print $2, $3}')
    echo "  stage $((i + 1)) (worker): RSS $(kib "$rss"), peak $(kib "$hwm"); weights $share"
  done
  kill "${workers[@]}" 2>/dev/null || true
  wait "${workers[@]}" 2>/dev/null || true
done

if [ -n "$llama_bin" ]; then
  echo "llama.cpp (llama-bench -mmp 0 -p 0 -n $tokens -t $threads):"
  "$llama_bin/llama-bench" -m "$model" -mmp 0 -p 0 -n "$tokens" -t "$threads" -o md 2>/dev/null | tail -3
fi
