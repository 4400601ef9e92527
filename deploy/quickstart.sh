#!/usr/bin/env bash
# The main job, end to end on a fresh Debian machine: installs the dependencies, builds, and continues a text prompt
# with the embedded default model (deploy/models/capserve-moe-tiny), then with a committed Mixtral checkpoint from
# token ids. (The gRPC server quickstart replaces this once the server lands.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CAPSERVE_BUILD_DIR:-$root/build}"
bash "$root/deploy/install_deps.sh"
bash "$root/deploy/build.sh"
model="$root/deploy/models/capserve-moe-tiny"
prompt="The theory of general relativity"
echo "== capserve-generate --model $model --prompt '$prompt' --max-new-tokens 48"
"$build/runtime/capserve-generate" --model "$model" --prompt "$prompt" --max-new-tokens 48 --threads 2
fixture="$root/tests/fixtures/models/mixtral_sharded"
echo "== capserve-generate --model $fixture --input-ids '384 353 219 207 297' --max-new-tokens 16"
"$build/runtime/capserve-generate" --model "$fixture" --input-ids "384 353 219 207 297" --max-new-tokens 16 --threads 2
