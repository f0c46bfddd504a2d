#!/usr/bin/env bash
# The main job: build pp, make the default model if none is given, and run a pipeline across processes.
#   bash scripts/demo.sh [MODEL.gguf | ollama-tag] ["prompt text"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
[ -f build-native/build.ninja ] || meson setup build-native -Dcpu=native >/dev/null
ninja -C build-native tools/pp_gguf tools/pp_generate tools/pp_node tools/pp_worker >/dev/null

model=${1:-}
prompt=${2:-"The capital of France is"}
if [ -z "$model" ]; then
  model=models/pp-demo-bf16.gguf
  if [ ! -f "$model" ]; then
    mkdir -p models
    vocab=../shared/fixtures/llama3-vocab-only.gguf
    args=(--layers 8 --embd 512 --heads 8 --kv-heads 2 --ff 1536 --dtype bf16)
    # The real Llama-3 vocabulary when it is at hand, so text prompts tokenize as Llama-3 does.
    [ -f "$vocab" ] && args+=(--vocab-from "$vocab") || args+=(--vocab 4096)
    build-native/tools/pp_gguf synth "$model" "${args[@]}"
  fi
fi
echo "== model: $model"
build-native/tools/pp_gguf info "$model" --stages 2 | tail -4
exec bash scripts/pipeline.sh "$model" "$prompt"
