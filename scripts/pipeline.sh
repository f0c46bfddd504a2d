#!/usr/bin/env bash
# Runs MODEL as a 2-stage pipeline of separate processes on loopback: a pp_node worker holding the far
# half of the blocks and a coordinator holding the near half (tokenizer, embedding). The coordinator
# streams the text and verifies every token against the single-process run (--verify all).
set -euo pipefail
model=$1; prompt=$2
bin=build-native/tools
port=$((52100 + RANDOM % 1000))
layers=$("$bin/pp_gguf" info "$model" | awk '/block_count/ {n = $NF} END {print n}')
"$bin/pp_node" --worker --model "$model" --host 127.0.0.1 --port "$port" &
worker=$!
trap 'kill $worker 2>/dev/null || true' EXIT
for _ in $(seq 100); do  # wait (up to 10 s) until the worker listens
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  kill -0 $worker 2>/dev/null || { echo "worker exited"; exit 1; }
  sleep 0.1
done
"$bin/pp_node" --coordinator "127.0.0.1:$port" --model "$model" --cut $((layers / 2)) \
  --prompt "$prompt" --tokens 32 --verify all
