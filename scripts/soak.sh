#!/usr/bin/env bash
# Soak: a pp_node pipeline (coordinator + 2 workers) on golden-tiny generating continuously for a while, with
# many sessions that connect, generate and end (some killed mid-run), every connection authenticated with a
# pre-shared key. Samples each worker's RSS (VmRSS) and open descriptors (/proc/<pid>/fd) after a warm-up
# and at the end, with no session open and the same stage loaded; fails if RSS grew by more than a bound or
# descriptors grew at all.
#
#   scripts/soak.sh                 short mode (20 s, what CI runs: meson test --suite soak)
#   scripts/soak.sh --long          600 s
#   scripts/soak.sh --seconds N     any duration
# Environment: PP_NODE_BIN (default build-native/tools/pp_node), PP_SOAK_MODEL (default golden-tiny f32),
# PP_SOAK_RSS_KB (allowed RSS growth per worker after warm-up, default 3072), PP_SOAK_PARALLEL (sessions at
# once, default 3).
set -uo pipefail
cd "$(dirname "$0")/.."

seconds=20
while [ $# -gt 0 ]; do
  case "$1" in
    --long) seconds=600 ;;
    --seconds) seconds=$2; shift ;;
    *) echo "usage: $0 [--long | --seconds N]" >&2; exit 2 ;;
  esac
  shift
done
node=${PP_NODE_BIN:-build-native/tools/pp_node}
model=${PP_SOAK_MODEL:-tests/data/golden-tiny/golden-tiny-f32.gguf}
rss_bound_kb=${PP_SOAK_RSS_KB:-3072}
parallel=${PP_SOAK_PARALLEL:-3}
[ -x "$node" ] || { echo "soak: pp_node not found at '$node' (set PP_NODE_BIN)"; exit 2; }
[ -f "$model" ] || { echo "soak: model '$model' not found"; exit 2; }

dir=$(mktemp -d /tmp/pp_soak.XXXXXX)
worker_pids=()
coord_pids=()
cleanup() {
  for p in "${coord_pids[@]}" "${worker_pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$dir/key"
chmod 600 "$dir/key"

# ---- workers
ports=()
for i in 0 1; do
  "$node" --worker --model "$model" --host 127.0.0.1 --port 0 --threads 1 --psk-file "$dir/key" \
    >"$dir/w$i.out" 2>"$dir/w$i.err" &
  worker_pids+=($!)
done
for i in 0 1; do
  for _ in $(seq 100); do grep -q "listening on" "$dir/w$i.out" && break; sleep 0.1; done
  port=$(sed -n 's/.*listening on 127\.0\.0\.1:\([0-9]*\) .*/\1/p' "$dir/w$i.out")
  [ -n "$port" ] || { echo "soak: worker $i did not start"; cat "$dir/w$i.err"; exit 1; }
  ports+=("$port")
done
chain="127.0.0.1:${ports[0]},127.0.0.1:${ports[1]}"

rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
fds() { ls "/proc/$1/fd" | wc -l; }

# ---- sessions: each a coordinator process that connects, authenticates, generates and ends
tokens=0; sessions=0; killed=0; failed=0; n=0
# A session's shape varies with its number: cuts (so stages load and are evicted), ctx, length, sampling,
# verification; every 7th is killed mid-generation (an abrupt end of every hop's session).
start_session() {
  local k=$1
  local cuts ctx ntok
  cuts=$([ $((k % 2)) -eq 0 ] && echo 1,2 || echo 2,3)
  ctx=$([ $((k % 3)) -eq 0 ] && echo 256 || echo 512)
  ntok=$((16 + (k * 37) % 200))
  [ $((k % 7)) -eq 3 ] && ntok=1000000  # killed below, mid-generation
  local args=(--coordinator "$chain" --model "$model" --psk-file "$dir/key" --cuts "$cuts" --ctx "$ctx"
              --prompt-ids "$((k % 50 + 1)),7,$((k % 13 + 2))" --tokens "$ntok" --ignore-eos --threads 1)
  if [ $((k % 4)) -eq 1 ]; then args+=(--temperature 0.8 --top-k 40 --seed "$k"); fi
  if [ $((k % 5)) -eq 0 ]; then args+=(--verify all); else args+=(--verify none); fi
  "$node" "${args[@]}" >"$dir/c$k.out" 2>"$dir/c$k.err" &
  local pid=$!
  coord_pids+=("$pid")
  if [ $((k % 7)) -eq 3 ]; then (sleep "0.$((k % 4 + 1))"; kill -9 "$pid" 2>/dev/null) & fi
}
# Waits for every running session and counts what they did.
drain() {
  local p k
  for p in "${coord_pids[@]}"; do wait "$p" 2>/dev/null; done
  coord_pids=()
  for f in "$dir"/c*.out; do
    [ -e "$f" ] || continue
    k=${f##*/c}; k=${k%.out}
    local got
    got=$(sed -n 's/^\([0-9]*\) tokens  round-trip.*/\1/p' "$f")
    if [ -n "$got" ] && grep -q "^byte-identity:" "$f" && ! grep -q "FAIL" "$f"; then
      tokens=$((tokens + got)); sessions=$((sessions + 1))
    elif [ $((k % 7)) -eq 3 ]; then
      killed=$((killed + 1))
    else
      failed=$((failed + 1)); echo "soak: session $k failed:"; cat "$f" "$dir/c$k.err" | tail -5
    fi
    rm -f "$f" "$dir/c$k.err"
  done
}
# Runs sessions, `parallel` at a time, until `until` (epoch seconds).
run_until() {
  local until=$1
  while [ "$(date +%s)" -lt "$until" ]; do
    for _ in $(seq "$parallel"); do start_session "$n"; n=$((n + 1)); done
    drain
  done
}
# Before a sample: one session whose stage key (ctx 128) no other session uses, so each worker loads it
# and evicts every other stage: both samples then see the same stages loaded, whatever ran before.
quiesce() {
  "$node" --coordinator "$chain" --model "$model" --psk-file "$dir/key" --cuts 1,3 --ctx 128 --prompt-ids 1,2 \
    --tokens 8 --threads 1 --verify none >/dev/null 2>"$dir/quiesce.err" || { echo "soak: quiesce session failed"; cat "$dir/quiesce.err"; }
}
# Descriptors settle once every session thread has ended: wait until two samples agree.
settle() {
  local p=$1 a b
  for _ in $(seq 50); do a=$(fds "$p"); sleep 0.1; b=$(fds "$p"); [ "$a" = "$b" ] && break; done
}

rss_first=(); fd_first=()
for p in "${worker_pids[@]}"; do rss_first+=("$(rss_kb "$p")"); fd_first+=("$(fds "$p")"); done
t0=$(date +%s)
warm=$((seconds / 5 < 4 ? 4 : seconds / 5))
run_until $((t0 + warm))
quiesce
for p in "${worker_pids[@]}"; do settle "$p"; done
rss0=(); fd0=()
for p in "${worker_pids[@]}"; do rss0+=("$(rss_kb "$p")"); fd0+=("$(fds "$p")"); done
tok_warm=$tokens; ses_warm=$sessions

run_until $((t0 + seconds))
quiesce
for p in "${worker_pids[@]}"; do settle "$p"; done
rss1=(); fd1=()
for p in "${worker_pids[@]}"; do rss1+=("$(rss_kb "$p")"); fd1+=("$(fds "$p")"); done
elapsed=$(( $(date +%s) - t0 ))

echo "soak: ${elapsed} s (warm-up ${warm} s), ${parallel} sessions at a time, coordinator + 2 workers on $(basename "$model")"
echo "soak: sessions: $sessions completed ($((sessions - ses_warm)) after warm-up), $killed killed mid-run, $failed failed"
echo "soak: tokens generated: $tokens ($((tokens - tok_warm)) after warm-up, $(( tokens / (elapsed > 0 ? elapsed : 1) )) tokens/s)"
rc=0
for i in 0 1; do
  grow=$(( rss1[i] - rss0[i] ))
  echo "soak: worker $i (pid ${worker_pids[$i]}): before any session RSS ${rss_first[$i]} kB, fds ${fd_first[$i]};" \
       "after warm-up -> end: RSS ${rss0[$i]} kB -> ${rss1[$i]} kB (${grow} kB, bound ${rss_bound_kb}), fds ${fd0[$i]} -> ${fd1[$i]}"
  if [ "$grow" -gt "$rss_bound_kb" ]; then echo "soak: FAIL: worker $i RSS grew by ${grow} kB > ${rss_bound_kb} kB"; rc=1; fi
  if [ "${fd1[$i]}" -gt "${fd0[$i]}" ]; then echo "soak: FAIL: worker $i holds ${fd1[$i]} descriptors, ${fd0[$i]} after warm-up"; rc=1; fi
  if ! kill -0 "${worker_pids[$i]}" 2>/dev/null; then echo "soak: FAIL: worker $i died"; cat "$dir/w$i.err" | tail -5; rc=1; fi
done
[ "$failed" -eq 0 ] || { echo "soak: FAIL: $failed session(s) failed"; rc=1; }
[ "$sessions" -gt 0 ] || { echo "soak: FAIL: no session completed"; rc=1; }
[ $rc -eq 0 ] && echo "soak: PASSED" || echo "soak: FAILED"
exit $rc
