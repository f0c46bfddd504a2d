#!/usr/bin/env bash
# meson install into a temporary root, then build tests/install/downstream.cpp against the installed
# headers through pkg-config (as a user's project would) and run it on golden-tiny.
set -euo pipefail
build=$1; src=$2; model=$3
root=$(mktemp -d); trap 'rm -rf "$root"' EXIT
DESTDIR=$root meson install -C "$build" --no-rebuild --quiet >/dev/null
pc=$(find "$root" -name pp.pc | head -1)
[ -n "$pc" ] || { echo "pp.pc was not installed"; exit 1; }
prefix=$(sed -n 's/^prefix=//p' "$pc")
[ -f "$root$prefix/include/pp/stage.hpp" ] || { echo "pp/stage.hpp was not installed"; exit 1; }
pc_flags() { PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --define-variable=prefix="$root$prefix" --cflags --libs "$1"; }
flags=$(pc_flags pp)
# The engine needs no libcrypto; only the network layer (pp-net.pc, pp/net/) does.
case "$flags" in *crypto*) echo "pkg-config pp mentions libcrypto: $flags"; exit 1 ;; esac
net_flags=$(pc_flags pp-net)
case "$net_flags" in *-lcrypto*) ;; *) echo "pkg-config pp-net does not link libcrypto: $net_flags"; exit 1 ;; esac
# Only the installed tree: no -I into the source checkout.
c++ -O1 -march=x86-64-v2 "$src" -o "$root/downstream" $flags
out=$("$root/downstream" "$model")
[ "$out" = "280" ] || { echo "downstream printed '$out', expected 280"; exit 1; }
echo "downstream build against installed headers OK ($flags)"
