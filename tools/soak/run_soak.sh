#!/usr/bin/env bash
# Soak test of CapServe (issue 6, acceptance point 6): >= 200 concurrent streams for >= 5 minutes, no request
# lost (each gets exactly one terminal status), no crash, resident memory flat after warm-up.
#
# Builds nothing. Starts `capserve` on 2 ranks with the embedded default model exactly as the e2e tests and
# the quickstart do (deploy/launch.sh, --port 0 --metrics-port 0, the start line, health SERVING), finds the
# ranks' pids (rank 0 through the CAPSERVE_RANK0_PID_FILE that launch.sh gives it), drives it with
# `capserve-loadgen` in a closed loop of --concurrency ChatStream streams (request sizes from the Azure
# conversation trace, prompts from the domain corpus) with --soak-report sampling every rank's VmRSS, then
# SIGTERMs the server (graceful drain) and requires exit status 0. Writes OUT/NAME.json (the loadgen report)
# and OUT/NAME.md (a short table).
#
#   flock /tmp/capserve-heavy.lock tools/soak/run_soak.sh [--build-dir build] [--concurrency 220]
#       [--duration-s 330] [--warmup-s 60] [--tolerance-pct 5] [--interval-s 5] [--out-dir tools/results]
#       [--name soak] [--model DIR] [--trace CSV] [--corpus DIR] [--server-arg ARG]...
#       [--server-env VAR=VALUE]... [-- LOADGEN ARGS...]
#
# --server-arg adds a capserve flag (e.g. --server-arg --max-running --server-arg 32); --server-env sets a
# variable in the ranks' environment (mpirun -x, e.g. MALLOC_ARENA_MAX=2); arguments after -- go to
# capserve-loadgen (e.g. -- --max-tokens 32).
#
# Exit status: 0 when every check passed; 1 when a request was lost, a status was not OK, the stream contract
# broke, a rank exited, memory grew past the tolerance after warm-up or the server did not drain to exit 0;
# 2 on a usage or set-up error.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
data="$(cd "$root/.." && pwd)/shared/data"
build="build"
concurrency=220
duration_s=330
warmup_s=60
tolerance_pct=5
interval_s=5
out_dir="$root/tools/results"
name="soak"
model="$root/deploy/models/capserve-moe-tiny"
trace="$data/traces/azure_llm_2023_conv.csv"
corpus="$data/corpus"
server_args=()
server_env=()
loadgen_extra=()

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }
die() { echo "run_soak: error: $*" >&2; exit 2; }
need_value() { (($# >= 2)) || die "$1 needs a value"; }

while (($# > 0)); do
  case "$1" in
    --build-dir) need_value "$@"; build="$2"; shift 2 ;;
    --concurrency) need_value "$@"; concurrency="$2"; shift 2 ;;
    --duration-s) need_value "$@"; duration_s="$2"; shift 2 ;;
    --warmup-s) need_value "$@"; warmup_s="$2"; shift 2 ;;
    --tolerance-pct) need_value "$@"; tolerance_pct="$2"; shift 2 ;;
    --interval-s) need_value "$@"; interval_s="$2"; shift 2 ;;
    --out-dir) need_value "$@"; out_dir="$2"; shift 2 ;;
    --name) need_value "$@"; name="$2"; shift 2 ;;
    --model) need_value "$@"; model="$2"; shift 2 ;;
    --trace) need_value "$@"; trace="$2"; shift 2 ;;
    --corpus) need_value "$@"; corpus="$2"; shift 2 ;;
    --server-arg) need_value "$@"; server_args+=("$2"); shift 2 ;;
    --server-env) need_value "$@"; [[ "$2" == *=* ]] || die "--server-env wants VAR=VALUE, got '$2'"
      server_env+=("$2"); shift 2 ;;
    --) shift; loadgen_extra=("$@"); break ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ "$concurrency" =~ ^[0-9]+$ && "$concurrency" -gt 0 ]] || die "--concurrency must be a positive integer"
for v in "$duration_s" "$warmup_s" "$tolerance_pct" "$interval_s"; do
  [[ "$v" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "not a non-negative number: '$v'"
done
[[ "$build" = /* ]] || build="$root/$build"
[[ "$out_dir" = /* ]] || out_dir="$PWD/$out_dir"
capserve="$build/server/capserve"
loadgen="$build/tools/capserve-loadgen"
py=/usr/bin/python3
[[ -x "$capserve" ]] || die "no $capserve: build it first (e.g. ninja -C $build capserve capserve-loadgen)"
[[ -x "$loadgen" ]] || die "no $loadgen: build it first (e.g. ninja -C $build capserve capserve-loadgen)"
[[ -f "$model/config.json" ]] || die "no model at $model"
[[ -f "$trace" ]] || die "no trace $trace (see ../shared/data/README.md)"
[[ -d "$corpus" ]] || die "no corpus directory $corpus"
[[ -x "$py" ]] || die "$py is needed (Debian python3)"
mkdir -p "$out_dir"

work="$(mktemp -d /tmp/capserve-soak.XXXXXX)"
launcher=""
loadgen_pid=""
ranks_all=""
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n "$loadgen_pid" ]] && kill -0 "$loadgen_pid" 2>/dev/null; then
    kill -KILL "$loadgen_pid" 2>/dev/null || true
  fi
  if [[ -n "$launcher" ]] && kill -0 "$launcher" 2>/dev/null; then
    echo "run_soak: stopping the server (launcher $launcher)" >&2
    kill -TERM "$launcher" 2>/dev/null || true  # rank 0 drains, then every rank stops
    for _ in $(seq 100); do kill -0 "$launcher" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$launcher" 2>/dev/null || kill -KILL "$launcher" 2>/dev/null || true
  fi
  # Open MPI gives each rank a process group of its own: make sure none outlives the run.
  for r in $ranks_all; do
    case "$(cat "/proc/$r/comm" 2>/dev/null)" in
      capserve | mpirun | prted | orted) kill -KILL "$r" 2>/dev/null || true ;;
    esac
  done
  if ((rc != 0)) && [[ -f "$work/server.log" ]]; then
    echo "run_soak: last lines of the server log:" >&2
    tail -n 20 "$work/server.log" >&2
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'echo "run_soak: interrupted" >&2; exit 130' INT TERM

descendants() {
  local c
  for c in $(pgrep -P "$1" || true); do echo "$c"; descendants "$c"; done
}
# The value of VAR in process PID's environment.
env_of() { tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null | sed -n "s/^$2=//p" | head -n1; }

echo "run_soak: starting deploy/launch.sh 2 $capserve --model $model --port 0 --metrics-port 0 --threads 1 ${server_args[*]}"
((${#server_env[@]} == 0)) || echo "run_soak: server environment: ${server_env[*]}"
mpirun_args="${CAPSERVE_MPIRUN_ARGS:-}"
for kv in "${server_env[@]}"; do mpirun_args+=" -x $kv"; done
started_at=$(date +%s)
CAPSERVE_MPIRUN_ARGS="$mpirun_args" setsid bash "$root/deploy/launch.sh" 2 "$capserve" --model "$model" \
  --port 0 --metrics-port 0 --threads 1 "${server_args[@]}" >"$work/server.log" 2>&1 &
launcher=$!

start_line=""
for _ in $(seq 1800); do
  start_line="$(grep -m1 -E '^capserve: serving .* on .*:[0-9]+, metrics on port [0-9]+' "$work/server.log" || true)"
  [[ -n "$start_line" ]] && break
  kill -0 "$launcher" 2>/dev/null || { echo "run_soak: capserve exited before serving" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$start_line" ]] || { echo "run_soak: capserve did not start within 180 s" >&2; exit 1; }
port="$(sed -E 's/.* on [^ ]*:([0-9]+), metrics.*/\1/' <<<"$start_line")"
metrics_port="$(sed -E 's/.*metrics on port ([0-9]+),.*/\1/' <<<"$start_line")"
echo "run_soak: $start_line (after $(($(date +%s) - started_at)) s)"

# The ranks: capserve processes under the launcher, by OMPI_COMM_WORLD_RANK; rank 0 confirmed by the pid file
# that deploy/launch.sh handed it in CAPSERVE_RANK0_PID_FILE.
ranks_all="$(descendants "$launcher" | tr '\n' ' ')"
declare -A rank_pid=()
for p in $ranks_all; do
  [[ "$(cat "/proc/$p/comm" 2>/dev/null)" == capserve ]] || continue
  r="$(env_of "$p" OMPI_COMM_WORLD_RANK)"
  [[ -n "$r" ]] && rank_pid[$r]=$p
done
[[ -n "${rank_pid[0]:-}" && -n "${rank_pid[1]:-}" ]] ||
  { echo "run_soak: cannot find both ranks among the launcher's descendants ($ranks_all)" >&2; exit 1; }
pid_file="$(env_of "${rank_pid[0]}" CAPSERVE_RANK0_PID_FILE)"
if [[ -z "$pid_file" || "$(tr -d '[:space:]' 2>/dev/null <"$pid_file")" != "${rank_pid[0]}" ]]; then
  echo "run_soak: rank 0 (pid ${rank_pid[0]}) does not match its CAPSERVE_RANK0_PID_FILE '$pid_file'" >&2
  exit 1
fi
echo "run_soak: rank 0 pid ${rank_pid[0]}, rank 1 pid ${rank_pid[1]} (launcher $launcher)"

# Health: grpc.health.v1.Health/Check with the empty request must answer SERVING (field 1 = 1).
"$py" - "127.0.0.1:$port" <<'PY' || { echo "run_soak: the server is not healthy" >&2; exit 1; }
import sys, grpc
ch = grpc.insecure_channel(sys.argv[1])
grpc.channel_ready_future(ch).result(timeout=30)
check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                       response_deserializer=lambda b: b)
answer = check(b"", timeout=10)
if answer != b"\x08\x01":
    sys.exit(f"run_soak: health answered {answer!r}, not SERVING")
print("run_soak: health SERVING")
PY

json="$out_dir/$name.json"
md="$out_dir/$name.md"
loadgen_cmd=("$loadgen" --target "127.0.0.1:$port" --metrics-url "http://127.0.0.1:$metrics_port/metrics"
  --concurrency "$concurrency" --duration-s "$duration_s" --trace "$trace" --corpus "$corpus"
  --tokenizer "$model" --soak-report --server-pids "${rank_pid[0]},${rank_pid[1]}"
  --soak-interval-s "$interval_s" --soak-warmup-s "$warmup_s" --rss-tolerance-pct "$tolerance_pct"
  --drain-timeout-s 300 --progress-s 30 --json "$json" --fail-on-error "${loadgen_extra[@]}")
echo "run_soak: ${loadgen_cmd[*]}"
load_started=$(date +%s)
"${loadgen_cmd[@]}" &
loadgen_pid=$!
loadgen_status=0
wait "$loadgen_pid" || loadgen_status=$?
loadgen_pid=""
echo "run_soak: capserve-loadgen exited with status $loadgen_status after $(($(date +%s) - load_started)) s"
[[ -s "$json" ]] || { echo "run_soak: capserve-loadgen wrote no report $json" >&2; exit 1; }

# No crash: both ranks still alive after the load; then SIGTERM drains and the job must exit 0.
alive=1
for r in 0 1; do
  kill -0 "${rank_pid[$r]}" 2>/dev/null || { echo "run_soak: rank $r (pid ${rank_pid[$r]}) is gone" >&2; alive=0; }
done
echo "run_soak: SIGTERM to the launcher (graceful drain)"
term_at=$(date +%s.%N)
kill -TERM "$launcher"
server_status=0
wait "$launcher" || server_status=$?
while kill -0 "$launcher" 2>/dev/null; do sleep 0.1; wait "$launcher" || server_status=$?; done
drain_s="$("$py" -c "import sys,time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$term_at")"
launcher=""
ranks_all=""  # gone with the launcher (mpirun waits for its ranks); their pids may be reused from now on
echo "run_soak: server exited with status $server_status ${drain_s} s after SIGTERM"
grep -E 'draining|drained' "$work/server.log" | sed 's/^/run_soak: [capserve] /' || true

verdict_status=0
"$py" "$root/tools/soak/soak_report.py" --json "$json" --md "$md" --loadgen-status "$loadgen_status" \
  --server-status "$server_status" --ranks-alive "$alive" --drain-s "$drain_s" \
  --command "$(printf '%q ' "$0" --build-dir "${build#"$root"/}" --concurrency "$concurrency" --duration-s "$duration_s")" ||
  verdict_status=$?
echo "run_soak: wrote $json and $md"
exit "$verdict_status"
