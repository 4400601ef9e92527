#!/usr/bin/env bash
# The first-GPU runner (tools/gpu/README.md): one command on a bare GPU machine, run from the unpacked bundle
# (tools/gpu/bundle.sh). Every step runs under its own time limit, a failing step does not stop the others,
# everything goes to one folder, and a summary table is printed last.
#
#   bash run.sh [--out DIR] [--dry-run [--build DIR]] [--budget-s N]
#
# --out DIR   where the summary, the benchmark rows and gpu-run.tgz go (default: $OUT when set, else ./gpu-run):
#             a handful of files, since a device machine returns few; gpu-run.tgz packs every log and gtest XML
#             (written in a temporary folder) and is refreshed after each step, so a run cut short still
#             brings its logs back.
# --dry-run   the same steps on this machine over the CUDA emulation, from a build tree (--build, default the
#             repository's build/): the emulated test programs, capserve-cuda-emu, the benchmark at toy shapes;
#             compute-sanitizer, ncu and nvidia-smi are named and skipped where absent. Tests the script itself.
# --budget-s  the whole run's time (default 480; 1800 for a dry run): a step that would start with too little left
#             is skipped.
# --only RE   only the steps whose names this extended regular expression matches (a rerun of what failed).
# Exits 0 when every step that ran passed (skipped ones do not count), 1 otherwise.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tools/gpu/kit_env.sh
source "$here/kit_env.sh" # the bundle's environment, shared with check_minimal_root.sh
out="${OUT:-$PWD/gpu-run}"
dry_run=0
build=""
budget=""
only=""
while (($# > 0)); do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --build) build="$2"; shift 2 ;;
    --budget-s) budget="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    *) echo "run.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
# The emulation runs kernels thousands of times slower, on a machine that may be busy (CI): a dry run's steps get
# four times their limits.
slow=$((dry_run ? 4 : 1))
budget="${budget:-$((dry_run ? 1800 : 480))}"
failures=0
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/capserve-gpu-run.XXXXXX")"
summary="$out/summary.md"
started=$SECONDS
# The Python with numpy (and, on a GPU machine, PyTorch): CAPSERVE_PYTHON, else Debian's for a dry run, else python3.
pyexe="${CAPSERVE_PYTHON:-$( ((dry_run)) && [[ -x /usr/bin/python3 ]] && echo /usr/bin/python3 || command -v python3)}"
python_ld_path="${LD_LIBRARY_PATH:-}"
# Python (PyTorch, the scripts) runs with the machine's own libraries, never the bundle's older ones; the scripts
# start capserve with the bundle's (chat_check.py --ld-library-path).
py() { LD_LIBRARY_PATH="$python_ld_path" "$pyexe" "$@"; }

# ---- Where the programs are: the bundle's bin/, or a build tree's emulated twins.
if ((dry_run)); then
  repo="$(cd "$here/../.." && pwd)"
  build="${build:-$repo/build}"
  build="$(cd "$build" && pwd)"
  tools="$repo/tools/gpu"
  model_dir="$repo/deploy/models/capserve-moe-tiny"
  export CAPSERVE_FIXTURES_DIR="$repo/tests/fixtures"
  declare -A bin=(
    [capserve]="$build/tests/cuda_emu/capserve-cuda-emu"
    [bench]="$build/tests/cuda_emu/capserve-bench-kernels-emu"
    [test_cuda_kernels]="$build/tests/cuda_emu/test_cuda_kernels_emu"
    [test_cuda_backend]="$build/tests/cuda_emu/test_cuda_backend_emu"
    [test_cuda_model]="$build/tests/cuda_emu/test_cuda_model_emu"
    [test_host_staged_gpu]="$build/tests/cuda_emu/test_host_staged_gpu_emu"
  )
  bench_shapes=tiny
  # The emulation runs the start-up step that sizes a GPU's step buffers slowly: a smaller step bound.
  serve_flags=(--max-batched-tokens 256)
  chat_flags=(--start-timeout 480 --chat-timeout 480)
  synthetic_args=(--hidden 128 --intermediate 64 --layers 2 --experts 8 --top-k 2 --heads 4)
  export CAPSERVE_CUDA_EMU_DEVICES=1
else
  tools="$here/tools"
  # The data: packed in the bundle (bundle.sh --with-data), else the repository checkout it is unpacked in.
  data_root="$here"
  [[ -d "$here/fixtures" ]] || data_root="$(cd "$here/.." && pwd)"
  model_dir="$data_root/model/capserve-moe-tiny"
  [[ -d "$model_dir" ]] || model_dir="$data_root/deploy/models/capserve-moe-tiny"
  declare -A bin=(
    [capserve]="$here/bin/capserve"
    [bench]="$here/bin/capserve-bench-kernels"
    [test_cuda_kernels]="$here/bin/test_cuda_kernels"
    [test_cuda_backend]="$here/bin/test_cuda_backend"
    [test_cuda_model]="$here/bin/test_cuda_model"
    [test_host_staged_gpu]="$here/bin/test_host_staged_gpu"
    [test_nccl_communicator]="$here/bin/test_nccl_communicator"
  )
  bench_shapes=real
  serve_flags=()
  chat_flags=()
  synthetic_args=()
  # The bundle's libraries first; cudart/cuBLAS from the toolkit, NCCL from PyTorch's wheel (or the system).
  cuda_lib=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [[ -e "$d/libcublas.so.13" ]] && { cuda_lib="$d"; break; }
  done
  nccl_lib="$(py -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"
  [[ -e "$nccl_lib/libnccl.so.2" ]] || nccl_lib="$(dirname "$(find / -xdev -name libnccl.so.2 2>/dev/null | head -1)")"
  export LD_LIBRARY_PATH="$cuda_lib:$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  kit_relocate "$here" # the bundle's libraries before those, Open MPI and PMIx relocated into it
  export PATH="$here/bin:$PATH"
  export CAPSERVE_CUDA_PLUGIN="$here/lib/libcapserve_cuda_devices.so"
  export CAPSERVE_FIXTURES_DIR="$data_root/fixtures"
  [[ -d "$CAPSERVE_FIXTURES_DIR" ]] || CAPSERVE_FIXTURES_DIR="$data_root/tests/fixtures"
fi
kit_mpi_env

# ---- Steps: step NAME TIMEOUT_S COMMAND... ; the log is $work/NAME.log, the row goes into the summary.
cd "$work" || exit 1
rows=()
# run_limited SECONDS COMMAND...: the command (a function too) in its own process group, which is ended (TERM,
# then KILL) when it runs past the limit; returns its status, or 124 when it was ended.
run_limited() {
  local limit="$1" ticks=0
  shift
  set -m
  ("$@") &
  local pid=$!
  set +m
  while kill -0 "$pid" 2>/dev/null; do
    if ((ticks >= limit * 10)); then
      kill -TERM -- "-$pid" 2>/dev/null
      sleep 5
      kill -KILL -- "-$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      return 124
    fi
    sleep 0.1
    ticks=$((ticks + 1))
  done
  wait "$pid"
}
pack() { tar czf "$out/gpu-run.tgz" -C "$work" . 2>/dev/null || true; }
note() { rows+=("| $1 | $2 | $3 | $4 |"); }
step() {
  local name="$1" limit=$(($2 * slow))
  shift 2
  [[ -n "$only" && ! "$name" =~ $only ]] && return 0
  local left=$((budget - (SECONDS - started)))
  if ((left < 15)); then
    note "$name" "skipped" "-" "the run's budget is spent"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "== $name (at most ${limit}s): $*" | tee "$work/$name.log"
  local t0=$SECONDS
  run_limited "$limit" "$@" >>"$work/$name.log" 2>&1
  local rc=$?
  local detail
  detail="$(step_detail "$name" "$rc")"
  local status=passed
  ((rc == 124)) && status="TIMED OUT"
  ((rc != 0 && rc != 124)) && status="FAILED (exit $rc)"
  ((rc != 0)) && failures=$((failures + 1))
  note "$name" "$status" "$((SECONDS - t0))" "$detail"
  tail -n 3 "$work/$name.log"
  write_summary
  pack
}
# What a step's log says in one line: gtest totals, sanitizer error counts, chat verdicts.
step_detail() {
  local log="$work/$1.log"
  local tests
  tests="$(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran\.|^\[  SKIPPED \] [0-9]' "$log" | grep -v '^\[  FAILED  \] [A-Z]' | tr '\n' ' ')"
  local sanit
  sanit="$(grep -hoE 'ERROR SUMMARY: [0-9]+ errors?|RACECHECK SUMMARY: [0-9]+ hazards displayed \([0-9]+ errors, [0-9]+ warnings\)' "$log" |
    sort | uniq -c | awk '{$1=$1};1' | tr '\n' ';')"
  local verdict
  verdict="$(grep -ho 'greedy texts .*' "$log" | tr '\n' ';')"
  local bench
  bench="$(grep -c '^| ' "$out/kernels.md" 2>/dev/null)"
  [[ "$1" == kernel_benchmark ]] && bench="$((bench - 2)) rows in kernels.md " || bench=""
  local failed
  failed="$(grep -E '^\[  FAILED  \] [A-Z]' "$log" | sed 's/\[  FAILED  \] //; s/ (.*//' | sort -u | head -8 | tr '\n' ' ')"
  echo "${tests}${sanit}${verdict}${bench}${failed:+failed: $failed}" | cut -c1-400
}
write_summary() {
  {
    echo "# GPU run summary"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), $( ((dry_run)) && echo "dry run on the CUDA emulation" || echo "bundle $(cat "$here/MANIFEST" 2>/dev/null | head -1)")"
    echo
    echo "Device: $device_line"
    echo
    echo "| step | status | seconds | detail |"
    echo "|---|---|---:|---|"
    printf '%s\n' "${rows[@]}"
    [[ -s "$out/kernels.md" ]] && { echo; cat "$out/kernels.md"; }
    [[ -s "$out/ncu_attention.md" ]] && { echo; echo "Nsight Compute, Speed of Light of the attention kernels:"; echo; cat "$out/ncu_attention.md"; }
  } >"$summary"
}
have() { command -v "$1" >/dev/null 2>&1; }
device_line="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
device_line="${device_line:-no nvidia-smi (the CUDA emulation)}"
gtest() { # gtest NAME [gtest args]: a test program run directly, XML kept
  local name="$1"
  shift
  "${bin[$name]}" --gtest_output="xml:$work/$name.xml" "$@"
}
sanitize() { # sanitize TOOL PROGRAM FILTER
  local tool="$1" program="$2" filter="$3"
  if ((dry_run)) || ! have compute-sanitizer; then
    echo "compute-sanitizer absent (dry run): the same program and filter without it"
    "${bin[$program]}" --gtest_filter="$filter"
  else
    compute-sanitizer --tool "$tool" --print-limit 50 --error-exitcode 1 "${bin[$program]}" --gtest_filter="$filter"
  fi
}

# ---- 1. The environment: the device, the driver, the libraries each program resolves.
environment() {
  echo "uname: $(uname -a)"
  echo "python3: $pyexe"
  if have nvidia-smi; then nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv; fi
  have nvcc && nvcc --version | tail -2
  py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), torch.cuda.get_device_name(0))' 2>&1 | tail -1
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  local missing=0
  for f in "${bin[@]}" ${CAPSERVE_CUDA_PLUGIN:+"$CAPSERVE_CUDA_PLUGIN"}; do
    [[ -e "$f" ]] || { echo "MISSING program $f"; missing=1; continue; }
    local absent
    absent="$(ldd "$f" | grep 'not found' || true)"
    [[ -n "$absent" ]] && { echo "$f:"; echo "$absent"; missing=1; }
  done
  ((missing == 0)) && echo "ldd: every program and the plugin resolve every library"
  return $missing
}
step environment 30 environment

# ---- 2. The GPU tests, run directly (one process each; the communicator tests as Open MPI singletons).
step test_cuda_backend 90 gtest test_cuda_backend
step test_cuda_kernels 90 gtest test_cuda_kernels
step test_cuda_model 150 gtest test_cuda_model
step test_host_staged_gpu 60 gtest test_host_staged_gpu
[[ -n "${bin[test_nccl_communicator]:-}" ]] && step test_nccl_communicator 60 gtest test_nccl_communicator

# ---- 3. capserve --device cuda on one rank serving chats over HTTP: greedy text against the CPU backend's, with
# the embedded model and a larger synthetic bf16 checkpoint.
step served_chat_default_model 120 py "$tools/chat_check.py" --ld-library-path "${LD_LIBRARY_PATH:-}" --capserve "${bin[capserve]}" \
  --model "$model_dir" --devices cpu,cuda --json "$work/chat_default_model.json" --log-prefix served_default ${chat_flags[@]+"${chat_flags[@]}"} \
  -- ${serve_flags[@]+"${serve_flags[@]}"}
synthetic() {
  py "$tools/make_synthetic_checkpoint.py" --out "$work/synthetic" --tokenizer-from "$model_dir" \
    ${synthetic_args[@]+"${synthetic_args[@]}"} || return 1
  py "$tools/chat_check.py" --ld-library-path "${LD_LIBRARY_PATH:-}" --capserve "${bin[capserve]}" --model "$work/synthetic" --devices cpu,cuda \
    --json "$work/chat_synthetic.json" --log-prefix served_synthetic ${chat_flags[@]+"${chat_flags[@]}"} -- ${serve_flags[@]+"${serve_flags[@]}"}
  local rc=$?
  rm -rf "$work/synthetic"
  return $rc
}
step served_chat_synthetic 150 synthetic

# ---- 4. The kernel benchmark beside PyTorch.
bench() {
  "${bin[bench]}" --shapes "$bench_shapes" --json "$out/bench_capserve.jsonl" || return 1
  if py -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null && ((!dry_run)); then
    py "$tools/torch_peer.py" --json "$out/bench_torch.jsonl"
  else
    echo "no CUDA PyTorch here: the peer column stays empty"
  fi
  py "$tools/report.py" "$out/bench_capserve.jsonl" "$out/bench_torch.jsonl" >"$out/kernels.md"
  cat "$out/kernels.md"
}
step kernel_benchmark 150 bench

# ---- 5. One Nsight Compute Speed-of-Light pass over the attention kernels.
profile() {
  if ((dry_run)) || ! have ncu; then
    echo "ncu absent (dry run): the benchmark's attention rows without it"
    "${bin[bench]}" --shapes "$bench_shapes" --rows 'mla_decode|mla_prefill|gqa' --reps 1
  else
    # One timed repetition per row: each attention row's kernel is profiled three times (two warm-ups, one timed).
    ncu --section SpeedOfLight -k 'regex:attention_kernel' --csv --log-file "$out/ncu_attention.csv" \
      "${bin[bench]}" --shapes "$bench_shapes" --rows 'mla_decode|mla_prefill|gqa' --reps 1
    local rc=$?
    py "$tools/ncu_summary.py" "$out/ncu_attention.csv" | tee "$out/ncu_attention.md"
    return $rc
  fi
}
step ncu_attention 45 profile

# ---- 6. compute-sanitizer over the kernel and backend tests (filters sized to fit).
step memcheck 50 sanitize memcheck test_cuda_backend '*'
step memcheck_kernels 60 sanitize memcheck test_cuda_kernels '-*SampledFrequencies*:*Capacity*'
step racecheck_sampling 60 sanitize racecheck test_cuda_kernels '*SamplingFollows*:*NanLogits*'
step racecheck_capacity 75 sanitize racecheck test_cuda_kernels '*Capacity*'
step racecheck_attention_router 45 sanitize racecheck test_cuda_kernels '*Attention*:*Router*'
step synccheck 25 sanitize synccheck test_cuda_kernels '*Attention*:*SamplingFollows*:*NanLogits*:*Reduce*'
step initcheck 35 sanitize initcheck test_cuda_backend '*'

write_summary
pack
echo
cat "$summary"
echo
echo "run.sh: $((SECONDS - started)) s, $failures step(s) failed; the summary and benchmark rows are in $out, every log in $out/gpu-run.tgz"
((failures == 0))
