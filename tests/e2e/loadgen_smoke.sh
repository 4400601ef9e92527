#!/usr/bin/env bash
# e2e smoke test of the C++ load generator against the real server: `capserve` on 2 ranks (deploy/launch.sh),
# ~10 s of the Azure code trace (time-scaled, corpus prompts in semantic bursts) over ChatStream, then a few
# Generate requests. Passes when every request got exactly one terminal status (LOST 0), every status was OK,
# and the server's /metrics figures were read. Environment (set by tests/e2e/CMakeLists.txt): CAPSERVE_BIN,
# CAPSERVE_LAUNCH, CAPSERVE_MODEL, CAPSERVE_LOADGEN. Exit 77: skipped.
set -euo pipefail
: "${CAPSERVE_BIN:?run through ctest -L e2e}" "${CAPSERVE_LAUNCH:?}" "${CAPSERVE_MODEL:?}"
if [[ -z "${CAPSERVE_LOADGEN:-}" ]]; then
  echo "loadgen_smoke: capserve-loadgen is not part of this build; skipped"
  exit 77
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
data="$root/../shared/data"
if [[ ! -f "$data/traces/azure_llm_2023_code.csv" || ! -d "$data/corpus" ]]; then
  echo "loadgen_smoke: no trace or corpus under $data; skipped"
  exit 77
fi

work="$(mktemp -d)"
server_pid=""
ranks=""
cleanup() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null || true  # rank 0 drains, then every rank stops
    for _ in $(seq 150); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$server_pid" 2>/dev/null || true
  fi
  # Open MPI gives each rank a process group of its own: make sure none outlives the test.
  for r in $ranks; do
    case "$(cat "/proc/$r/comm" 2>/dev/null)" in capserve | mpirun) kill -KILL "$r" 2>/dev/null || true ;; esac
  done
  rm -rf "$work"
}
trap cleanup EXIT

bash "$CAPSERVE_LAUNCH" 2 "$CAPSERVE_BIN" --model "$CAPSERVE_MODEL" --port 0 --metrics-port 0 --threads 1 \
  >"$work/server.log" 2>&1 &
server_pid=$!
start_line=""
for _ in $(seq 1800); do
  start_line="$(grep -m1 -E '^capserve: serving .* on .*:[0-9]+, metrics on port [0-9]+' "$work/server.log" || true)"
  [[ -n "$start_line" ]] && break
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "loadgen_smoke: capserve exited before serving:"
    cat "$work/server.log"
    exit 1
  fi
  sleep 0.1
done
if [[ -z "$start_line" ]]; then
  echo "loadgen_smoke: capserve did not start within 180 s:"
  cat "$work/server.log"
  exit 1
fi
port="$(sed -E 's/.* on [^ ]*:([0-9]+), metrics.*/\1/' <<<"$start_line")"
metrics_port="$(sed -E 's/.*metrics on port ([0-9]+),.*/\1/' <<<"$start_line")"
descendants() {
  local c
  for c in $(pgrep -P "$1" || true); do echo "$c"; descendants "$c"; done
}
ranks="$(descendants "$server_pid")"  # mpirun and the ranks
echo "loadgen_smoke: $start_line (launcher $server_pid, descendants: $(echo $ranks))"

common=(--target "127.0.0.1:$port" --metrics-url "http://127.0.0.1:$metrics_port/metrics"
        --tokenizer "$CAPSERVE_MODEL" --max-prompt-tokens 64 --max-tokens 16 --drain-timeout-s 120 --progress-s 5
        --fail-on-error)
status=0
# ~10 s of the bursty code trace at half its speed (25 requests), prompts in bursts of 4 of one domain.
"$CAPSERVE_LOADGEN" "${common[@]}" --trace "$data/traces/azure_llm_2023_code.csv" --trace-start-s 600 \
  --duration-s 10 --time-scale 2 --prompt-mix bursts --burst-length 4 --corpus "$data/corpus" \
  --json "$work/chat.json" || status=$?
# Generate (token ids in and out), Poisson arrivals; run from another directory with the default corpus (found
# through the source tree, not the working directory).
(cd "$work" && "$CAPSERVE_LOADGEN" "${common[@]}" --mode generate --rate 2 --duration-s 5 --max-requests 6 \
  --prompt-mix mixed --json "$work/generate.json") || status=$?
if ((status != 0)); then
  echo "loadgen_smoke: capserve-loadgen failed (exit $status); server log:"
  tail -n 40 "$work/server.log"
  exit 1
fi
for report in chat generate; do
  python3 - "$work/$report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
c = r["client"]
assert c["sent"] > 0 and c["lost"] == 0 and c["ok"] == c["sent"] and c["protocol_errors"] == 0, c
assert c["ttft_s"]["count"] > 0 and c["completion_tokens"]["count"] == c["ok"], c
s = r.get("server")
assert s is not None and s["moe_steps"] and s["moe_steps"] > 0, r.get("server_error", s)
print(f"loadgen_smoke: {sys.argv[1]}: {c['sent']} requests, all OK, none lost; "
      f"p99 TTFT {c['ttft_s']['p99'] * 1e3:.0f} ms, {c['output_tokens_per_s']:.1f} tokens/s")
PY
done
