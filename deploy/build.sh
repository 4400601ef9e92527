#!/usr/bin/env bash
# Configures and builds CapServe into ./build (or $CAPSERVE_BUILD_DIR). Extra arguments go to cmake, e.g.
# -DCAPSERVE_SANITIZE=ON.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CAPSERVE_BUILD_DIR:-$root/build}"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}" "$@"
cmake --build "$build" -j "$(nproc)"
