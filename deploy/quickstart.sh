#!/usr/bin/env bash
# The main job, end to end on a fresh Debian machine: installs the dependencies, builds, and continues text prompts
# with the embedded default model (deploy/models/capserve-moe-tiny) on two expert-parallel ranks under mpirun,
# first exactly, then with capacity-aware scheduling, printing what the scheduler dropped and rerouted per layer.
# (The gRPC server quickstart replaces this once the server lands.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CAPSERVE_BUILD_DIR:-$root/build}"
bash "$root/deploy/install_deps.sh"
bash "$root/deploy/build.sh"
model="$root/deploy/models/capserve-moe-tiny"
generate=("$build/runtime/capserve-generate" --model "$model" --threads 1 --max-new-tokens 32
  --prompt "The theory of general relativity" --prompt "def parse_args(argv):" --prompt "Once upon a time")
echo "== 2 ranks, exact (gamma = inf)"
bash "$root/deploy/launch.sh" 2 "${generate[@]}"
stats="$(mktemp -d)/moe_stats.json"
echo "== 2 ranks, --capacity-factor 1.25 --capacity-policy expanded --capacity-granularity device"
bash "$root/deploy/launch.sh" 2 "${generate[@]}" --capacity-factor 1.25 --capacity-policy expanded \
  --capacity-granularity device --moe-stats "$stats"
echo "== per-layer MoE statistics ($stats)"
/usr/bin/python3 - "$stats" <<'PY'
import json, sys
stats = json.load(open(sys.argv[1]))
print(stats["config"])
print(f"{'layer':>5} {'assignments':>11} {'dropped':>7} {'rerouted':>8}  rank load before -> after (max/mean per step)")
for l in stats["layers"]:
    print(f"{l['layer']:>5} {l['assignments']:>11} {l['dropped']:>7} {l['rerouted']:>8}  "
          f"{l['mean_step_routed_rank_max_over_mean']:.3f} -> {l['mean_step_rank_max_over_mean']:.3f}")
PY
