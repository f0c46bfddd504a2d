#!/usr/bin/env bash
# The test command: installs dependencies, builds the fast (native) and portable (x86-64-v2) targets,
# runs every suite on the fast build and the unit + golden suites on the portable one, and ends with
# one "N passed, N failed" line.
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

for cfg in "build-native:native" "build-portable:x86-64-v2"; do
  dir=${cfg%%:*}; cpu=${cfg##*:}
  if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" -Dcpu="$cpu" -Dbench=$([ "$cpu" = native ] && echo true || echo false) >/dev/null || { echo "meson setup $dir failed"; exit 1; }
  fi
  ninja -C "$dir" || { echo "build $dir failed"; echo "0 passed, 1 failed"; exit 1; }
done

run_suites build-native
run_suites build-portable --suite unit --suite golden

echo "${total_ok} passed, ${total_fail} failed"
exit $rc
