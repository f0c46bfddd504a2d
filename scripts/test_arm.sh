#!/usr/bin/env bash
# AArch64 under emulation (issue 20): cross-compiles pp for aarch64 on an x86-64 Debian 12 host and runs
# its unit and golden suites under qemu user emulation, each kernel path on a CPU model that has (or
# lacks) what it needs:
#   build-arm       -march=armv8.2-a+dotprod (sdot integer dots)  suites unit + golden        qemu -cpu cortex-a76
#   build-arm-neon  -march=armv8-a (plain NEON, no sdot)          kernels, quant, golden_*    qemu -cpu cortex-a53
#   build-arm-bf16  -march=armv8.6-a (sdot + bfdot: the BF16       kernels, split, golden_tiny qemu -cpu max
#                   fast path, simd::Bf16Dot)
# Installs what it needs (root or sudo): the cross compiler, qemu-user-static, and the :arm64 multiarch
# packages of the libraries the tests link (Debian's header-only Arch: all ones serve both machines).
# Ends with each test's time and one "N passed, N failed" line; exits non-zero on any failure.
# Cost, measured on 2 shared vCPUs: compiling build-arm-neon's 4 programs took 4.6 CPU-min (all 54
# targets of a full cross build: 25.5); under qemu build-arm-neon's tests take ~1.5 min, build-arm's unit
# and golden tests ~2.5 min plus unit/sampler, whose draws are cut 20-fold here (PP_TEST_DRAW_DIVISOR):
# at full count they ran 47 min emulated (~1 min natively).
#   PP_ARM_JOBS=N        parallel compile jobs (default: nproc)
#   PP_ARM_ONLY=dotprod  only the dotprod build (PP_ARM_ONLY=neon: only the plain one; =bf16: only armv8.6-a)
#   PP_ARM_SKIP=a,b      tests not to run (scripts/test.sh: golden_tiny_no_amx, which repeats golden_tiny here)
#   PP_ARM_DRAW_DIVISOR  unit/sampler's draws divided by this (default 20)
#   PP_ARM_NODE=1        also build build-arm/tools/pp_node, for the mixed pipeline test
#                        (tests/contract/test_mixed_arch.cpp; scripts/test.sh runs it)
set -uo pipefail
cd "$(dirname "$0")/.."
t_start=$(date +%s)
jobs=${PP_ARM_JOBS:-$(nproc)}
only=${PP_ARM_ONLY:-}

# ---- Packages ----
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
host_pkgs=(meson ninja-build pkg-config python3 g++-aarch64-linux-gnu qemu-user-static
           libcli11-dev nlohmann-json3-dev libeigen3-dev)
arm_pkgs=(libxsimd-dev:arm64 libpcre2-dev:arm64 libssl-dev:arm64 libgtest-dev:arm64 libgmock-dev:arm64
          libcpp-httplib-dev:arm64)
missing=()
for p in "${host_pkgs[@]}" "${arm_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  dpkg --print-foreign-architectures | grep -qx arm64 || $SUDO dpkg --add-architecture arm64
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >/dev/null ||
    { echo "test_arm.sh: could not install ${missing[*]}"; echo "0 passed, 1 failed"; exit 1; }
fi
t_deps=$(date +%s)

# ---- Builds: only the programs of the tests run (the unit and golden suites need no tool) ----
cross=cross/aarch64-linux-gnu.ini
# dir:cpu (-march):qemu cpu:what to run (suites, or test names), comma-separated
configs=()
[ -z "$only" ] || [ "$only" = dotprod ] && configs+=("build-arm:armv8.2-a+dotprod:cortex-a76:unit,golden")
[ -z "$only" ] || [ "$only" = neon ] && configs+=("build-arm-neon:armv8-a:cortex-a53:${PP_ARM_NEON_TESTS:-kernels,quant,golden_tiny,golden_kq}")
[ -z "$only" ] || [ "$only" = bf16 ] && configs+=("build-arm-bf16:armv8.6-a:max:${PP_ARM_BF16_TESTS:-kernels,split,golden_tiny}")

selected() {  # dir, comma-separated suites or test names -> "name program" per selected test
  meson introspect --tests "$1" | python3 -c '
import json, sys
want = set(sys.argv[1].split(","))
skip = set(filter(None, sys.argv[2].split(",")))
for t in json.load(sys.stdin):
    if t["name"] in skip:
        continue
    if t["name"] in want or want & {s.split(":")[-1] for s in t["suite"]}:
        print(t["name"], t["cmd"][0])' "$2" "${PP_ARM_SKIP:-}"
}
for cfg in "${configs[@]}"; do
  IFS=: read -r dir cpu qcpu what <<<"$cfg"
  if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" --cross-file "$cross" -Dcpu="$cpu" -Dbench=false >/dev/null ||
      { echo "meson setup $dir failed"; echo "0 passed, 1 failed"; exit 1; }
  fi
  targets=$(selected "$dir" "$what" | awk -v d="$(cd "$dir" && pwd)/" '{sub(d, "", $2); print $2}' | sort -u)
  [ "${PP_ARM_NODE:-0}" = 1 ] && [ "$dir" = build-arm ] && targets="$targets tools/pp_node"
  [ "$dir" = build-arm-bf16 ] && targets="$targets tools/pp_generate"  # the CPU check below
  ninja -C "$dir" -j "$jobs" $targets || { echo "build $dir failed"; echo "0 passed, 1 failed"; exit 1; }
done
t_build=$(date +%s)

# ---- Suites under qemu (meson runs each test through the cross file's exe_wrapper, qemu-aarch64-static;
# QEMU_CPU picks the emulated CPU). Timeouts are hang guards: emulation is ~10-50x slower than native. ----
echo "== host: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== $(qemu-aarch64-static --version | head -1)"
total_ok=0; total_fail=0; rc=0
for cfg in "${configs[@]}"; do
  IFS=: read -r dir cpu qcpu what <<<"$cfg"
  names=($(selected "$dir" "$what" | awk '{print $1}'))
  echo "== $dir (-march=$cpu) on qemu -cpu $qcpu: ${names[*]}"
  log=$(mktemp)
  t0=$(date +%s)
  QEMU_CPU=$qcpu PP_TEST_DRAW_DIVISOR=${PP_ARM_DRAW_DIVISOR:-20} meson test -C "$dir" --no-rebuild --num-processes "$jobs" --print-errorlogs --timeout-multiplier 4 \
      "${names[@]}" 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  ok=$(awk '/^Ok:/ {print $2}' "$log" | tail -1); fail=$(awk '/^Fail:/ {print $2}' "$log" | tail -1)
  to=$(awk '/^Timeout:/ {print $2}' "$log" | tail -1)
  [ -n "$ok" ] || fail=1  # meson did not get to its summary
  total_ok=$((total_ok + ${ok:-0})); total_fail=$((total_fail + ${fail:-0} + ${to:-0}))
  echo "== $dir: $(( $(date +%s) - t0 )) s under qemu -cpu $qcpu"
  rm -f "$log"
done

# ---- A build for a better CPU on a lesser one (tools/common/build_info.hpp, cpu::missing_for_build): the
# armv8.6-a pp_generate on qemu -cpu cortex-a76 (sdot, no bf16) must exit 2 naming bfdot, not die of
# SIGILL; on -cpu max it must run and name its kernels. ----
if [ -x build-arm-bf16/tools/pp_generate ]; then
  out=$(QEMU_CPU=cortex-a76 qemu-aarch64-static build-arm-bf16/tools/pp_generate --version 2>&1); st=$?
  if [ $st -eq 2 ] && [[ "$out" == *bfdot*"which this CPU lacks"* ]]; then
    echo "== cpu check: armv8.6-a build on cortex-a76 exits 2: $out"; total_ok=$((total_ok + 1))
  else
    echo "== cpu check FAILED: armv8.6-a build on cortex-a76 exited $st: $out"; total_fail=$((total_fail + 1)); rc=1
  fi
  out=$(QEMU_CPU=max qemu-aarch64-static build-arm-bf16/tools/pp_generate --version 2>&1); st=$?
  if [ $st -eq 0 ] && [[ "$out" == *"kernels neon64+dotprod+bf16"* ]]; then
    echo "== cpu check: armv8.6-a build on max runs: $out"; total_ok=$((total_ok + 1))
  else
    echo "== cpu check FAILED: armv8.6-a build on max exited $st: $out"; total_fail=$((total_fail + 1)); rc=1
  fi
fi

echo "== test times (s):"
for cfg in "${configs[@]}"; do
  IFS=: read -r dir _ qcpu _ <<<"$cfg"
  [ -f "$dir/meson-logs/testlog.json" ] || continue
  python3 - "$dir" "$qcpu" <<'PY'
import json, sys
d, q = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(d + "/meson-logs/testlog.json") if l.strip()]
for r in sorted(rows, key=lambda r: -r.get("duration", 0)):
    print(f"  {d:15s} {q:11s} {r['name']:22s} {r.get('duration', 0):7.1f}  {r.get('result', '')}")
PY
done
t_end=$(date +%s)
echo "== time: packages $((t_deps - t_start)) s, builds $((t_build - t_deps)) s, suites $((t_end - t_build)) s, total $((t_end - t_start)) s"
echo "${total_ok} passed, ${total_fail} failed"
exit $rc
