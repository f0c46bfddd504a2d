#!/usr/bin/env bash
# The test command: installs dependencies, builds the fast (native) and portable (x86-64-v2) targets
# and a sanitized one (ASan + UBSan, gcc), runs every suite on the fast build and the unit + golden
# suites on the portable and sanitized ones (building only what those run), then (when clang is
# installed) each libFuzzer target for 20 s (docs/HARDENING.md); ends with one "N passed, N failed" line.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh || exit 1
jobs=$(nproc)

total_ok=0; total_fail=0; rc=0
run_suites() {  # build-dir, meson test args...
  local dir=$1; shift
  local log; log=$(mktemp)
  meson test -C "$dir" --num-processes "$jobs" --print-errorlogs "$@" 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  local ok fail
  ok=$(awk '/^Ok:/ {print $2}' "$log" | tail -1); fail=$(awk '/^Fail:/ {print $2}' "$log" | tail -1)
  local to; to=$(awk '/^Timeout:/ {print $2}' "$log" | tail -1)
  total_ok=$((total_ok + ${ok:-0})); total_fail=$((total_fail + ${fail:-0} + ${to:-0}))
  rm -f "$log"
}

# The executables of the given suites (ninja targets), so a build can compile just what it runs.
suite_targets() {  # build-dir suite...
  meson introspect "$1" --tests | python3 -c '
import json, os, sys
d, suites = os.path.abspath(sys.argv[1]), {"pp:" + s for s in sys.argv[2:]}
seen = set()
for t in json.load(sys.stdin):
    exe = os.path.relpath(t["cmd"][0], d)
    if suites & set(t["suite"]) and not exe.startswith("..") and exe not in seen:
        seen.add(exe)
        print(exe)
' "$@"
}

# dir:cpu:suites built and run (all = everything):more meson options
for cfg in "build-native:native:all:-Dbench=true" "build-portable:x86-64-v2:unit golden:-Dbench=false" \
           "build-asan:native:unit golden:-Dbench=false -Db_sanitize=address,undefined -Db_lundef=false"; do
  IFS=: read -r dir cpu suites opts <<<"$cfg"
  if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" -Dcpu="$cpu" $opts >/dev/null || { echo "meson setup $dir failed"; exit 1; }
  fi
  if [ "$suites" = all ]; then
    ninja -C "$dir" || { echo "build $dir failed"; echo "0 passed, 1 failed"; exit 1; }
  else
    # shellcheck disable=SC2046,SC2086
    ninja -C "$dir" $(suite_targets "$dir" $suites) || { echo "build $dir failed"; echo "0 passed, 1 failed"; exit 1; }
  fi
done
fuzz=false
if command -v clang++ >/dev/null; then  # libFuzzer needs clang; only the fuzz targets are built
  fuzz=true
  [ -f build-fuzz/build.ninja ] || CXX=clang++ meson setup build-fuzz -Dfuzz=true -Dbench=false >/dev/null \
    || { echo "meson setup build-fuzz failed"; exit 1; }
  ninja -C build-fuzz fuzz || { echo "build build-fuzz failed"; echo "0 passed, 1 failed"; exit 1; }
fi

run_suites build-native
run_suites build-portable --no-rebuild --suite unit --suite golden
# Any AddressSanitizer / UndefinedBehaviorSanitizer report or leak fails its test (the tools the contract
# tests spawn are sanitized too). Sanitized code runs ~2-3x slower: timeouts x3.
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  run_suites build-asan --no-rebuild --suite unit --suite golden --timeout-multiplier 3
if $fuzz; then
  PP_FUZZ_SECONDS=20 run_suites build-fuzz --no-rebuild --suite fuzz
else
  echo "clang++ not found: fuzz suite not run"
fi

echo "${total_ok} passed, ${total_fail} failed"
exit $rc
