#!/usr/bin/env bash
# Configures and builds CapServe into ./build (or $CAPSERVE_BUILD_DIR): every target, or only those named with
# --target NAME (repeatable; deploy/quickstart.sh builds just the server). Other arguments go to cmake, e.g.
# -DCAPSERVE_SANITIZE=ON.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CAPSERVE_BUILD_DIR:-$root/build}"
targets=()
cmake_args=()
while (($# > 0)); do
  if [[ "$1" == --target ]] && (($# >= 2)); then
    targets+=(--target "$2")
    shift 2
  else
    cmake_args+=("$1")
    shift
  fi
done
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}" ${cmake_args[@]+"${cmake_args[@]}"}
cmake --build "$build" -j "$(nproc)" ${targets[@]+"${targets[@]}"}
