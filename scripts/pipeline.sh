#!/usr/bin/env bash
# Runs MODEL as a 2-stage pipeline of separate processes on loopback: a pp_node worker holding the far
# half of the blocks and a coordinator holding the near half (tokenizer, embedding), then checks the
# generated tokens against the single-process generator.
set -euo pipefail
model=$1; prompt=$2
bin=build-native/tools
port=$((52100 + RANDOM % 1000))
"$bin/pp_node" --worker --model "$model" --host 127.0.0.1 --port "$port" &
worker=$!
trap 'kill $worker 2>/dev/null || true' EXIT
layers=$("$bin/pp_gguf" info "$model" | awk '/block_count/ {print $NF; exit}')
"$bin/pp_node" --coordinator "127.0.0.1:$port" --model "$model" --cut $((layers / 2)) \
  --prompt "$prompt" --tokens 32 --verify all
