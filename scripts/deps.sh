#!/usr/bin/env bash
# Installs the Debian packages pp builds and tests with (root or sudo).
set -euo pipefail
pkgs=(meson ninja-build g++ pkg-config python3 libxsimd-dev libeigen3-dev googletest libgtest-dev libgmock-dev
      libbenchmark-dev nlohmann-json3-dev libcli11-dev libpcre2-dev libssl-dev
      libcpp-httplib-dev  # pp_node --serve's HTTP server (pkg-config cpp-httplib)
      libedit-dev  # pp_node --chat's line editing and history on a terminal (optional: plain lines without it)
      clang libclang-rt-14-dev  # clang + its runtimes: the sanitized build, the libFuzzer targets (docs/HARDENING.md)
      qemu-user-static)  # older x86-64 CPUs emulated for the dispatch test (tests/contract/test_dispatch.cpp), aarch64
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Optional: headless Chromium for the web page's browser test (tests/contract/test_node_serve.cpp, which
# skips without it). About 150 MB, ~3 min to install on a fresh Debian 12; a failed install only warns.
# PP_NO_BROWSER=1 leaves it out.
browser=(chromium chromium-driver)
missing=()
[ "${PP_NO_BROWSER:-0}" = 1 ] || for p in "${browser[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"; } ||
    echo "deps.sh: warning: could not install ${missing[*]}; the browser test will be skipped" >&2
fi
