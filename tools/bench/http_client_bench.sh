#!/usr/bin/env bash
# A standard benchmark client, NVIDIA aiperf (pinned in tools/bench/requirements-aiperf.txt, venv
# tools/.venv-bench), against CapServe's OpenAI-compatible HTTP API, unmodified:
#   tools/bench/http_client_bench.sh [--requests N] [--concurrency C] [--isl T] [--osl T] [--out DIR]
#   tools/bench/http_client_bench.sh --mooncake TRACE.jsonl [--length-scale F] [--trace-start-s S] [--duration-s D]
#                                    [--time-scale X] [--out DIR]
# capserve starts on 2 ranks with the default model (tools/with_capserve.py, --http-port 0); aiperf sends N
# streaming chat completions (synthetic prompts of T tokens made with the model's own tokenizer, T output tokens,
# C at a time, no warmup); then the requests the server counted in /metrics (capserve_requests_total, and
# capserve_request_errors_total for refused ones) must equal aiperf's completed request count and aiperf must
# report no errors; the script fails otherwise. aiperf's report (profile_export_aiperf.{json,csv}), the server's
# counts and the exact command go to --out (default tools/results/http_client_bench_aiperf/). Needs the build's
# server/capserve (build/, or CAPSERVE_BUILD_DIR) and PyPI for the first run.
# --mooncake: instead, the slice of a Mooncake trace that capserve-loadgen replays (tools/README.md, "Mooncake
# traces"; default lengths x1/32, trace seconds [900, 960) at real speed) goes through aiperf's mooncake_trace
# dataset type: capserve-loadgen --write-trace writes the scaled, capped slice (aiperf cannot scale or cap), and
# aiperf replays it on its timestamps (--fixed-schedule) as streaming /v1/completions with --isl-block-size set to
# the scaled block; the check counts the trace's lines (default --out: http_client_bench_aiperf_mooncake/).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
requests=100 concurrency=8 isl=64 osl=32
mooncake="" length_scale=0.03125 trace_start_s=900 duration_s=60 time_scale=1
out=""
while (($# > 0)); do
  case "$1" in
    --requests) requests="$2" ;;
    --concurrency) concurrency="$2" ;;
    --isl) isl="$2" ;;
    --osl) osl="$2" ;;
    --mooncake) mooncake="$(realpath "$2")" ;;
    --length-scale) length_scale="$2" ;;
    --trace-start-s) trace_start_s="$2" ;;
    --duration-s) duration_s="$2" ;;
    --time-scale) time_scale="$2" ;;
    --out) out="$2" ;;
    *) echo "usage: $0 [--requests N] [--concurrency C] [--isl T] [--osl T] [--out DIR]" >&2
       echo "       $0 --mooncake TRACE.jsonl [--length-scale F] [--trace-start-s S] [--duration-s D] [--time-scale X] [--out DIR]" >&2
       exit 2 ;;
  esac
  shift 2
done
[[ -n "$out" ]] || out="$root/tools/results/http_client_bench_aiperf${mooncake:+_mooncake}"
build="${CAPSERVE_BUILD_DIR:-$root/build}"
bin="$(bash "$root/tools/setup_venv.sh" .venv-bench tools/bench/requirements-aiperf.txt)"
model="$root/deploy/models/capserve-moe-tiny"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

# The aiperf command line, as run (the URL and model name come from the server just started).
server_args=""
if [[ -n "$mooncake" ]]; then
  # aiperf starts each hash block with the tokenizer's BOS (here <|endoftext|>) and sends the prompt as text with
  # that spelling in it: as plain text it is 7 tokens, and a 16-token block arrives as 22. The server reads it as
  # the control token it is, so that the blocks keep their size. aiperf opens a connection per request in flight,
  # and a replay (unlike --concurrency) can hold more than the 64 one address may by default.
  server_args="--allow-special-tokens-in-content --max-connections-per-peer 255"
  # The slice as capserve-loadgen sends it, capped to the default model's 1024-token context.
  "$build/tools/capserve-loadgen" --trace "$mooncake" --length-scale "$length_scale" --trace-start-s "$trace_start_s" \
    --duration-s "$duration_s" --time-scale "$time_scale" --max-context 1024 --max-prompt-tokens 1024 \
    --max-tokens 1024 --write-trace "$work/trace.jsonl" | tee "$work/write_trace.log"
  block="$(sed -n 's/.*block size \([0-9]*\) tokens.*/\1/p' "$work/write_trace.log")"
  requests="$(wc -l <"$work/trace.jsonl")"
  # aiperf 0.13 builds hash_ids prompts in worker processes that force HF_HUB_OFFLINE and then accept only a
  # tokenizer in the hub cache, not a directory: the model's tokenizer files go into a private cache under a
  # hub-style name, and the whole client runs offline (the hub is not reachable from here anyway).
  snapshot="$work/hf/hub/models--capserve--capserve-moe-tiny/snapshots/local"
  mkdir -p "$snapshot" "$work/hf/hub/models--capserve--capserve-moe-tiny/refs"
  cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/config.json "$snapshot/"
  printf local >"$work/hf/hub/models--capserve--capserve-moe-tiny/refs/main"  # no newline: the hub reads it verbatim
  cat >"$work/client.sh" <<CLIENT
HF_HOME="$work/hf" HF_HUB_OFFLINE=1 \\
exec "$bin/aiperf" profile --model "\$CAPSERVE_MODEL_ID" --url "http://127.0.0.1:\$CAPSERVE_HTTP_PORT" \\
  --endpoint-type completions --streaming --tokenizer capserve/capserve-moe-tiny \\
  --input-file "$work/trace.jsonl" --custom-dataset-type mooncake_trace --fixed-schedule --isl-block-size $block \\
  --extra-inputs ignore_eos:true --random-seed 0 --ui simple --artifact-dir "$work/aiperf"
CLIENT
else
  cat >"$work/client.sh" <<CLIENT
exec "$bin/aiperf" profile --model "\$CAPSERVE_MODEL_ID" --url "http://127.0.0.1:\$CAPSERVE_HTTP_PORT" \\
  --endpoint-type chat --streaming --tokenizer "$model" \\
  --request-count $requests --concurrency $concurrency \\
  --isl $isl --isl-stddev 0 --osl $osl --osl-stddev 0 --extra-inputs ignore_eos:true \\
  --random-seed 0 --ui simple --artifact-dir "$work/aiperf"
CLIENT
fi
python3 "$root/tools/with_capserve.py" --build "$build" --model "$model" --server-args="$server_args" \
  --counts "$work/server_counts.json" -- bash "$work/client.sh" 2>&1 | tee "$work/run.log"
report="$(find "$work/aiperf" -name profile_export_aiperf.json | head -1)"
[[ -n "$report" ]] || { echo "http_client_bench: aiperf wrote no profile_export_aiperf.json" >&2; exit 1; }
cp "$report" "${report%.json}.csv" "$work/server_counts.json" "$out/"
{
  if [[ -n "$mooncake" ]]; then
    echo "# tools/bench/http_client_bench.sh --mooncake $(basename "$mooncake") --length-scale $length_scale" \
      "--trace-start-s $trace_start_s --duration-s $duration_s --time-scale $time_scale"
    echo "# wrote TRACE.jsonl: $(sed "s#$work/trace.jsonl#TRACE.jsonl#" "$work/write_trace.log")"
    cp "$work/trace.jsonl" "$out/trace.jsonl"
  else
    echo "# tools/bench/http_client_bench.sh --requests $requests --concurrency $concurrency --isl $isl --osl $osl"
  fi
  echo "# ran this aiperf command against capserve on 2 ranks started by tools/with_capserve.py:"
  sed -e "s#$root/##g" -e "s#$work/aiperf#ARTIFACT_DIR#" -e "s#$work/trace.jsonl#TRACE.jsonl#" -e "s#$work/hf#HF_CACHE#" "$work/client.sh"
} >"$out/command.sh"
python3 - "$out" "$requests" "${mooncake:+$out/trace.jsonl}" <<'CHECK'
import json, sys
out, wanted, trace = sys.argv[1], int(sys.argv[2]), sys.argv[3]
report = json.load(open(f"{out}/profile_export_aiperf.json"))
server = json.load(open(f"{out}/server_counts.json"))
sent = int(report["request_count"]["avg"])
completed = int(report["completed_request_count"]["avg"])
counted = server["finished_total"] + sum(server["refused"].values())
errors = report["error_summary"]
summary = {"aiperf_request_count": sent, "aiperf_completed_request_count": completed, "aiperf_errors": errors,
           "server_requests_total": server["finished_total"], "server_refused": server["refused"],
           "requests_per_s": report["request_throughput"]["avg"],
           "output_tokens_per_s": report["output_token_throughput"]["avg"],
           # The prompt tokens aiperf made and the server counted: equal when its text prompts round-trip.
           "aiperf_total_isl": report.get("total_isl", {}).get("avg"),
           "server_prompt_tokens": report.get("total_usage_prompt_tokens", {}).get("avg")}
if trace:
    with open(trace) as f:
        summary["trace_input_tokens"] = sum(json.loads(line)["input_length"] for line in f)
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print("http_client_bench: aiperf sent", sent, "and completed", completed, "requests; the server counted", counted)
if sent != wanted or completed != sent or errors or counted != sent:
    sys.exit("http_client_bench: FAILED: the counts differ or aiperf saw errors")
print("http_client_bench: OK")
CHECK
