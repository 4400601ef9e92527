#!/usr/bin/env bash
# The main job, end to end on a fresh Debian machine: installs the dependencies, builds, starts `capserve` on two
# expert-parallel ranks under mpirun with the embedded default model (deploy/models/capserve-moe-tiny) and
# capacity-aware scheduling, streams one chat completion from a gRPC client, asks one over the OpenAI-compatible
# HTTP API, shows the metrics, and shuts the server down cleanly (SIGTERM drains: running requests finish, exit
# code 0). It builds only what it runs (the server and the Python gRPC stubs); deploy/test.sh builds the rest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${CAPSERVE_BUILD_DIR:-$root/build}"
bash "$root/deploy/install_deps.sh"
bash "$root/deploy/build.sh" --target capserve --target capserve_proto_python

log="$(mktemp)"
echo "== starting: deploy/launch.sh 2 capserve --model deploy/models/capserve-moe-tiny --capacity-factor 1.5 --capacity-policy reroute"
setsid bash "$root/deploy/launch.sh" 2 "$build/server/capserve" --model "$root/deploy/models/capserve-moe-tiny" \
  --port 0 --http-port 0 --metrics-port 0 --threads 1 --capacity-factor 1.5 --capacity-policy reroute \
  --batch-selector greedy >"$log" 2>&1 &
server=$!
trap 'kill -TERM "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  grep -q "capserve: serving" "$log" && break
  if ! kill -0 "$server" 2>/dev/null; then cat "$log"; exit 1; fi
  sleep 0.5
done
cat "$log"
port="$(sed -n 's/.* on [^ ]*:\([0-9]*\), metrics.*/\1/p' "$log")"
metrics_port="$(sed -n 's/.*metrics on port \([0-9]*\),.*/\1/p' "$log")"
http_port="$(sed -n 's/.*HTTP API on port \([0-9]*\).*/\1/p' "$log")"

echo "== a streamed chat completion (tools/capserve_chat.py, gRPC ChatStream)"
/usr/bin/python3 "$root/tools/capserve_chat.py" --addr "localhost:$port" --stubs "$build/proto/python" \
  --max-tokens 48 "Write a short story about a robot."
echo "== a chat completion over HTTP (POST http://localhost:$http_port/v1/chat/completions, OpenAI's format)"
/usr/bin/python3 - "http://localhost:$http_port/v1/chat/completions" <<'PY'
import json, sys, urllib.request
body = {"model": "capserve-moe-tiny", "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 32, "temperature": 0}
request = urllib.request.Request(sys.argv[1], json.dumps(body).encode(), {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=120))
print(reply["choices"][0]["message"]["content"])
print("usage:", reply["usage"], "moe:", reply["moe"])
PY
echo "== metrics (http://localhost:$metrics_port/metrics, a selection)"
/usr/bin/python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' \
  "http://localhost:$metrics_port/metrics" |
  grep -E '^capserve_(requests_total|generation_tokens_total|moe_(dropped|rerouted)_assignments_total|moe_rank_imbalance)' |
  head -20 || true
echo "== shutting down (SIGTERM: drain, then exit)"
kill -TERM "$server"
status=0
wait "$server" || status=$?
trap - EXIT
echo "capserve exited with status $status"
exit "$status"
