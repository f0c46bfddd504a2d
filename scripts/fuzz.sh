#!/usr/bin/env bash
# Runs every libFuzzer target for a while (docs/HARDENING.md): scripts/fuzz.sh [seconds per target, default 300]
#   PP_FUZZ_JOBS     targets run at once (default: the number of cores)
#   PP_FUZZ_TARGETS  which targets (default: all four)
#   scripts/fuzz.sh --seeds   regenerates tests/fuzz/corpus/ and tests/fuzz/gguf.dict instead
# Builds build-fuzz with clang if needed. Each target keeps its corpus in build-fuzz/fuzz-corpus/<target>
# (grown from the committed seeds, kept across runs); a crash, leak or timeout leaves its input in
# build-fuzz/fuzz-artifacts/<date>/. Ends with a table: executions, coverage (cov: edges, ft: features), crashes.
set -uo pipefail
cd "$(dirname "$0")/.."
build=build-fuzz
if [ ! -f "$build/build.ninja" ]; then
  CXX=clang++ meson setup "$build" -Dfuzz=true -Dbench=false >/dev/null || { echo "meson setup $build failed"; exit 1; }
fi

if [ "${1:-}" = "--seeds" ]; then
  ninja -C "$build" tests/fuzz/make_seeds || exit 1
  exec "$build/tests/fuzz/make_seeds" tests/fuzz tests/data
fi

seconds=${1:-300}
jobs=${PP_FUZZ_JOBS:-$(nproc)}
targets=(${PP_FUZZ_TARGETS:-fuzz_gguf fuzz_tokenizer fuzz_frame fuzz_worker_request fuzz_mux fuzz_http})
ninja -C "$build" fuzz || { echo "build $build failed"; exit 1; }
declare -A max_len=([fuzz_gguf]=131072 [fuzz_tokenizer]=4096 [fuzz_frame]=16384 [fuzz_worker_request]=8192 [fuzz_mux]=16384 [fuzz_http]=16384)
declare -A dict=([fuzz_gguf]=gguf [fuzz_tokenizer]=tokenizer [fuzz_frame]=frame [fuzz_worker_request]=worker_request [fuzz_mux]=frame [fuzz_http]=http)
logs=$build/fuzz-logs; artifacts=$build/fuzz-artifacts/$(date +%Y%m%d-%H%M%S)
mkdir -p "$logs" "$artifacts"
export PP_TEST_DATA=$PWD/tests/data PP_SHARED_FIXTURES=${PP_SHARED_FIXTURES:-$PWD/../shared/fixtures}

run() {
  local t=$1 corpus=$build/fuzz-corpus/$1
  mkdir -p "$corpus"
  "$build/tests/fuzz/$t" -max_total_time="$seconds" -max_len="${max_len[$t]}" -timeout=10 -rss_limit_mb=2048 \
    -error_exitcode=1 -print_final_stats=1 -dict="tests/fuzz/${dict[$t]}.dict" -artifact_prefix="$artifacts/$t-" \
    "$corpus" "tests/fuzz/corpus/$t" >"$logs/$t.log" 2>&1
  echo $? >"$logs/$t.rc"
}

echo "fuzzing ${targets[*]} for ${seconds}s each, $jobs at a time (logs in $logs/)"
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  run "$t" &
done
wait

rc=0
printf '%-20s %8s %12s %9s %7s %7s %7s %8s\n' target seconds execs exec/s cov ft corpus crashes
for t in "${targets[@]}"; do
  log=$logs/$t.log
  execs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last"); ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$last")
  crashes=$(ls "$artifacts" 2>/dev/null | grep -c "^$t-" || true)
  [ "$(cat "$logs/$t.rc")" = 0 ] || { rc=1; [ "$crashes" -gt 0 ] || crashes="rc=$(cat "$logs/$t.rc")"; }
  printf '%-20s %8s %12s %9s %7s %7s %7s %8s\n' "$t" "$seconds" "${execs:-?}" "$(( ${execs:-0} / seconds ))" \
    "${cov:-?}" "${ft:-?}" "${corp:-?}" "$crashes"
done
exit $rc
