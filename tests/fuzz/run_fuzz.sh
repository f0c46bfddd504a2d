#!/usr/bin/env bash
# One libFuzzer target for a fixed time (PP_FUZZ_SECONDS, default 20) on a scratch corpus seeded from
# the committed one, which stays untouched. A crash leaves its input in <artifacts>/ and fails (exit
# 1: libFuzzer's default 77 would read as "skipped" to meson).
#   run_fuzz.sh <target> <seed-dir> <dict> <max_len> <artifacts-dir>
set -euo pipefail
bin=$1; seeds=$2; dict=$3; max_len=$4; artifacts=$5
seconds=${PP_FUZZ_SECONDS:-20}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$artifacts"
name=$(basename "$bin")
"$bin" -max_total_time="$seconds" -max_len="$max_len" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -error_exitcode=1 -dict="$dict" -artifact_prefix="$artifacts/$name-" "$work" "$seeds"
