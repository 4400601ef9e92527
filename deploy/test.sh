#!/usr/bin/env bash
# The test command: installs the Debian dependencies, builds, and runs every CTest suite (unit, mpi, e2e, gpu;
# GPU tests skip themselves without a GPU). Extra arguments go to ctest, e.g. -L unit.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CAPSERVE_BUILD_DIR:-$root/build}"
bash "$root/deploy/install_deps.sh"
bash "$root/deploy/build.sh"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" "$@"
