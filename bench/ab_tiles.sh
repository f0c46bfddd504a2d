#!/usr/bin/env bash
# The prompt tile kernels of the working tree against those of a base commit, in one process
# (bench/ab_tiles.cpp): the way to measure a kernel change of a few percent on a host whose speed moves
# more than that between runs. Compiles the harness once per -march value given and runs it.
#
#   bench/ab_tiles.sh [BASE] [ROUNDS] [MARCH...]     (defaults: HEAD, 8, native)
#   bench/ab_tiles.sh HEAD 12 native haswell         # an edit to gemm.hpp on AVX-512 and on AVX2
set -euo pipefail
base=${1:-HEAD}
rounds=${2:-8}
shift $(($# < 2 ? $# : 2))
marches=("$@")
[ ${#marches[@]} -gt 0 ] || marches=(native)
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/pp/kernels"

# The base's headers, their namespaces renamed (gemm -> gemm_base, gemm_q8 -> gemm_q8_base).
extract() {  # file, sed program, output
  git -C "$root" show "$base:include/pp/kernels/$1" | sed -e "$2" >"$tmp/pp/kernels/$3"
  grep -q 'namespace pp::kernels::gemm[a-z0-9_]*_base {' "$tmp/pp/kernels/$3" ||
    { echo "ab_tiles: could not rename the namespace of $1 at $base" >&2; exit 2; }
}
extract gemm.hpp 's/^namespace pp::kernels::gemm {/namespace pp::kernels::gemm_base {/' gemm_base.hpp
extract gemm_q8.hpp 's/^namespace pp::kernels::gemm_q8 {/namespace pp::kernels::gemm_q8_base {/; s/\bgemm::/gemm_base::/g; s|<pp/kernels/gemm.hpp>|<pp/kernels/gemm_base.hpp>|' gemm_q8_base.hpp

cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name:[[:space:]]*//p' | head -1 || true)
echo "base $(git -C "$root" rev-parse --short "$base") vs the working tree; ${cpu:-unknown CPU}; load $(cut -d' ' -f1-3 /proc/loadavg)"
for march in "${marches[@]}"; do
  echo "== -march=$march"
  g++ -std=c++20 -O3 -march="$march" -ffp-contract=off -I"$root/include" -I"$tmp" -o "$tmp/ab_tiles" \
    "$root/bench/ab_tiles.cpp" -lpthread
  "$tmp/ab_tiles" "$rounds"
done
