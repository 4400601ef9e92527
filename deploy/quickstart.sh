#!/usr/bin/env bash
# The main job, end to end on a fresh Debian machine: installs the dependencies, builds, and generates 16 tokens
# with a committed Mixtral checkpoint (tests/fixtures/models/mixtral_sharded), printing the token ids.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CAPSERVE_BUILD_DIR:-$root/build}"
bash "$root/deploy/install_deps.sh"
bash "$root/deploy/build.sh"
model="$root/tests/fixtures/models/mixtral_sharded"
echo "capserve-generate --model $model --input-ids '384 353 219 207 297' --max-new-tokens 16"
"$build/runtime/capserve-generate" --model "$model" --input-ids "384 353 219 207 297" --max-new-tokens 16 --threads 2
