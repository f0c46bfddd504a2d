#!/usr/bin/env bash
# The test command: installs dependencies, builds the dispatch configuration (-Dcpu=dispatch: the tools,
# pp_bench and the golden tests carry one copy of the kernels per x86-64 target and pick the best at
# start-up; the other tests are compiled for this CPU) and a portable one (x86-64-v2: SSE4.2 kernels) that is
# also sanitized (ASan + UBSan, clang), runs every suite on both (the golden suites once per kernel target
# this CPU runs), then each libFuzzer target for 10 s (docs/HARDENING.md), then the aarch64 suites under qemu
# (scripts/test_arm.sh) and a mixed x86/aarch64 pipeline; ends with one "N passed, N failed" line. CI runs it
# on 2 cores within its 45 minutes: every piece here was sized for that.
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

# dir:compiler:cpu:more meson options. The sanitized build is clang at -O1: gcc's UBSan instrumentation
# tripled its compile time (pp_node.cpp: 177 s with gcc, 74 s with clang, 2 shared vCPUs), and its suites run
# no slower overall than at -O3 (ASan's checks dominate). pp_bench is built in neither (its four dispatch
# copies would cost CI ~2.5 min): build it with -Dbench=true (docs/PERFORMANCE.md).
for cfg in "build-dispatch:g++:dispatch:-Dbench=false" \
           "build-asan:clang++:x86-64-v2:-Dbench=false -Db_sanitize=address,undefined -Db_lundef=false -Doptimization=1"; do
  IFS=: read -r dir cxx cpu opts <<<"$cfg"
  if [ ! -f "$dir/build.ninja" ]; then
    CXX=$cxx meson setup "$dir" -Dcpu="$cpu" $opts >/dev/null || { echo "meson setup $dir failed"; exit 1; }
  fi
  ninja -C "$dir" || { echo "build $dir failed"; echo "0 passed, 1 failed"; exit 1; }
done
fuzz=false
if command -v clang++ >/dev/null; then  # libFuzzer needs clang; only the fuzz targets are built
  fuzz=true
  [ -f build-fuzz/build.ninja ] || CXX=clang++ meson setup build-fuzz -Dfuzz=true -Dbench=false >/dev/null \
    || { echo "meson setup build-fuzz failed"; exit 1; }
  ninja -C build-fuzz fuzz || { echo "build build-fuzz failed"; echo "0 passed, 1 failed"; exit 1; }
fi

# Where this run happened, so that a failure report says on what host (issue 14): the CPU, the load, the
# kernels each build's tools run (pp_node --version) and whether they are sanitized.
echo "== host: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for dir in build-dispatch build-asan; do
  echo "== $dir: $("$dir/tools/pp_node" --version 2>&1 | head -1)"
done
[ -n "${PP_NO_AMX:-}" ] && echo "== PP_NO_AMX=$PP_NO_AMX"
[ -n "${PP_TEST_TIME_SCALE:-}" ] && echo "== PP_TEST_TIME_SCALE=$PP_TEST_TIME_SCALE"
t_start=$(date +%s)

# meson's per-suite timeouts are hang guards, not speed limits: doubled natively, x6 under the sanitizers
# (ASan node_serve ran 366 s of its 300 x 3 s with a second busy core on a 2-vCPU Zen 5).
run_suites build-dispatch --timeout-multiplier 2
# Any AddressSanitizer / UndefinedBehaviorSanitizer report or leak fails its test (the tools the contract
# and fault tests spawn are sanitized too). Sanitized code runs ~2-3x slower (x10 by tests' baseline). Not the soak:
# its flat-RSS check would only see ASan's quarantine grow.
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  run_suites build-asan --no-rebuild --no-suite soak --timeout-multiplier 6
if $fuzz; then
  PP_FUZZ_SECONDS=10 run_suites build-fuzz --no-rebuild --suite fuzz
else
  echo "clang++ not found: fuzz suite not run"
fi

# AArch64 under emulation (scripts/test_arm.sh): the unit and golden suites cross-built with sdot
# (qemu -cpu cortex-a76), the kernel, quantized and golden-kq tests without it (cortex-a53), the kernel,
# split and golden-tiny tests with bfdot (armv8.6-a on qemu -cpu max: the BF16 fast path), then a mixed
# pipeline: this machine's coordinator with an aarch64 worker under qemu. PP_TEST_ARM=0 leaves it out.
if [ "${PP_TEST_ARM:-1}" = 1 ]; then
  t_arm=$(date +%s)
  log=$(mktemp)
  PP_ARM_NODE=1 PP_ARM_NEON_TESTS=kernels,quant,golden_kq PP_ARM_SKIP=golden_tiny_no_amx PP_ARM_DRAW_DIVISOR=50 \
    bash scripts/test_arm.sh 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  if [[ "$(tail -1 "$log")" =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]]; then
    total_ok=$((total_ok + BASH_REMATCH[1])); total_fail=$((total_fail + BASH_REMATCH[2]))
  else
    echo "scripts/test_arm.sh did not end with its summary line"; total_fail=$((total_fail + 1)); rc=1
  fi
  rm -f "$log"
  if [ -x build-arm/tools/pp_node ]; then
    PP_ARM_NODE_BIN=$PWD/build-arm/tools/pp_node run_suites build-dispatch --no-rebuild --logbase testlog-mixed mixed_arch
  else
    echo "build-arm/tools/pp_node missing: the mixed pipeline test did not run"; total_fail=$((total_fail + 1)); rc=1
  fi
  echo "== aarch64 under emulation: $(( $(date +%s) - t_arm )) s"
fi

# Each suite's time (from meson's test logs), slowest first, then the one summary line.
echo "== suite times (s), $(( $(date +%s) - t_start )) s in all:"
for dir in build-dispatch build-asan build-fuzz; do
  [ -f "$dir/meson-logs/testlog.json" ] || continue
  python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
rows = [json.loads(l) for l in open(d + "/meson-logs/testlog.json") if l.strip()]
for r in sorted(rows, key=lambda r: -r.get("duration", 0)):
    print(f"  {d:12s} {r['name']:28s} {r.get('duration', 0):7.1f}  {r.get('result', '')}")
PY
done
echo "${total_ok} passed, ${total_fail} failed"
exit $rc
