#!/usr/bin/env bash
# The first-GPU bundle checked here without a GPU (tools/gpu/README.md): unpacked into a minimal Debian root, where
# none of the project's packages (Open MPI, gRPC, OpenBLAS, ...) is installed, it must resolve every library but
# the GPU machine's own (cudart, cuBLAS, NCCL, the driver) and serve a chat with `capserve --device cpu` on 2
# ranks under the Open MPI launcher it carries. Not in CI: it downloads the root from the Debian registry.
#
#   bash tools/gpu/check_minimal_root.sh [--root DIR] [--archive FILE]
#
# --root DIR      the minimal root (default build-gpu/minimal-root): made with debootstrap (bookworm, minbase,
#                 from deb.debian.org; debootstrap is installed with apt-get when absent) unless DIR already
#                 holds one made here, which is reused (~210 MB; under a minute to make with a fast mirror); a
#                 folder that is not empty and was not made here is refused, never wiped
# --archive FILE  the bundle (default build-gpu/capserve-gpu-kit.tar.xz, what bundle.sh writes)
#
# Needs root (debootstrap, chroot, mounts). The bundle is unpacked afresh at /opt/capserve-gpu-kit in the root,
# with the default model (deploy/models/capserve-moe-tiny) copied in where run.sh looks for packed data. Inside the
# root (chroot with a clean environment; /proc, /dev/shm and /sys mounted for Open MPI and hwloc, unmounted on
# exit):
# 1. `ldd` over every program of bin/, every library of lib/ and every Open MPI and PMIx component: the only
#    libraries allowed "not found" are libcudart, libcublas, libcublasLt, libnccl and libcuda;
# 2. `bin/mpirun -np 2 --oversubscribe capserve --device cpu` in the environment run.sh gives the bundle (the
#    bundle's own kit_env.sh) must print its start line; one chat goes from outside the root (the network is
#    shared) to 127.0.0.1 over HTTP; SIGTERM to rank 0 drains and the job must exit 0; and its log must hold no
#    sign of a relocation that missed something (a help file read at this machine's path, a component that does
#    not load), which would not stop the job but would hide the next error on the GPU machine.
# A summary is printed last: archive size, root size, ldd verdict, the chat's answer.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
rootfs="$repo/build-gpu/minimal-root"
archive="$repo/build-gpu/capserve-gpu-kit.tar.xz"
while (($# > 0)); do
  case "$1" in
    --root) rootfs="$2"; shift 2 ;;
    --archive) archive="$2"; shift 2 ;;
    *) echo "check_minimal_root.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
die() { echo "check_minimal_root.sh: $*" >&2; exit 1; }
[[ "$(id -u)" == 0 ]] || die "needs root (debootstrap, chroot, mount)"
[[ -r "$archive" ]] || die "no bundle at $archive (bash tools/gpu/bundle.sh writes it)"
archive="$(cd "$(dirname "$archive")" && pwd)/$(basename "$archive")"
mkdir -p "$rootfs"
rootfs="$(cd "$rootfs" && pwd)"
kit_in_root=/opt/capserve-gpu-kit
kit="$rootfs$kit_in_root"
# The root is ours once debootstrap finished there. A folder without this mark that is not empty is left alone
# (never wiped: it may be someone else's, or hold an earlier run's mounts of /proc and /sys).
made_mark="$rootfs/.capserve-minimal-root"

# ---- 1. The minimal root.
if [[ ! -e "$made_mark" ]]; then
  if ! command -v debootstrap >/dev/null; then
    apt-get install -y debootstrap || { apt-get update && apt-get install -y debootstrap; }
  fi
  [[ -z "$(ls -A "$rootfs")" ]] ||
    die "$rootfs is not empty and was not made here (an interrupted debootstrap?): remove it, or name another --root"
  echo "== debootstrap bookworm (minbase) into $rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian
  touch "$made_mark"
else
  echo "== reusing the minimal root $rootfs"
fi

# ---- 2. The bundle and the default model, unpacked afresh.
rm -rf "$kit"
base_size="$(du -shx "$rootfs" | cut -f1)"
mkdir -p "$rootfs/opt"
tar -xJf "$archive" -C "$rootfs/opt"
mkdir -p "$kit/model"
cp -r "$repo/deploy/models/capserve-moe-tiny" "$kit/model/"
env_script="$kit/kit_env.sh"
if [[ ! -e "$env_script" ]]; then
  # A bundle made before kit_env.sh existed: the checkout's copy stands in (and the summary says so).
  cp "$repo/tools/gpu/kit_env.sh" "$env_script"
  env_note=" (kit_env.sh from the checkout: the bundle has none)"
fi

# ---- Mounts for the chroot, and everything this script started, undone on any exit.
work="$(mktemp -d "${TMPDIR:-/tmp}/capserve-minroot.XXXXXX")"
job=""
mounted=()
cleanup() {
  if [[ -n "$job" ]] && kill -0 "$job" 2>/dev/null; then
    kill -KILL -- "-$job" 2>/dev/null || true
    wait "$job" 2>/dev/null || true
  fi
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[i]}" || umount -l "${mounted[i]}" || true; done
}
trap cleanup EXIT
mount_in() { # mount_in TYPE TARGET
  mountpoint -q "$rootfs$2" && return 0
  mkdir -p "$rootfs$2"
  mount -t "$1" "$1" "$rootfs$2"
  mounted+=("$rootfs$2")
}
mount_in proc /proc
mount_in tmpfs /dev/shm
mount_in sysfs /sys # hwloc reads the CPU topology there, as on any real machine
# in_root SCRIPT: bash in the root with a clean environment (nothing of this machine's leaks in), in the bundle
# folder, with the bundle's environment set, except that a component Open MPI or PMIx cannot load is reported
# (run.sh keeps those quiet) so that the job's log shows it.
in_root() {
  chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 /bin/bash -c \
    "set -euo pipefail; cd $kit_in_root; source ./kit_env.sh; kit_relocate \$PWD; kit_mpi_env
     export OMPI_MCA_mca_base_component_show_load_errors=1 PMIX_MCA_mca_base_component_show_load_errors=1; $1"
}

# ---- 3. ldd inside the root: only the GPU machine's libraries may be missing.
echo "== ldd over bin/, lib/ and the Open MPI components inside the root"
# shellcheck disable=SC2016 # expanded inside the root
in_root 'for f in bin/* lib/*.so* openmpi/lib/openmpi3/*.so openmpi/pmix/lib/pmix/*.so; do
           head -c4 "$f" | grep -q ELF || continue
           ldd "$f" | sed "s|^|$f: |"
         done' >"$work/ldd.txt"
# Lines read "FILE: <tab>libname.so.N => not found".
allowed_re=':\s+(libcudart|libcublas|libcublasLt|libnccl|libcuda)\.so'
missing="$(grep 'not found' "$work/ldd.txt" | awk '{print $2}' | sort -u)"
checked="$(cut -d: -f1 "$work/ldd.txt" | sort -u | wc -l)"
if grep 'not found' "$work/ldd.txt" | grep -vE "$allowed_re"; then
  die "libraries not found inside the minimal root (above) besides the GPU machine's"
fi
ldd_verdict="$checked files; not found only: $(paste -sd' ' <<<"$missing")"
echo "ldd: $ldd_verdict"

# ---- 4. capserve --device cpu on 2 ranks under the carried mpirun; one chat from outside; SIGTERM drains.
echo "== capserve --device cpu on 2 ranks inside the root"
log="$work/capserve.log"
pid_file_in_root=/tmp/capserve-rank0.pid
rm -f "$rootfs$pid_file_in_root"
set -m # the job in its own process group, which the cleanup can end whole
in_root "export CAPSERVE_RANK0_PID_FILE=$pid_file_in_root
         exec bin/mpirun -np 2 --oversubscribe --bind-to none -x CAPSERVE_RANK0_PID_FILE \
           bin/capserve --device cpu --model model/capserve-moe-tiny --threads 1 \
           --port 0 --http-port 0 --metrics-port 0" >"$log" 2>&1 &
job=$!
set +m
port=""
deadline=$((SECONDS + 600)) # generous: both cores may be busy with other work
while [[ -z "$port" ]]; do
  kill -0 "$job" 2>/dev/null || { cat "$log"; die "the job ended before its start line"; }
  ((SECONDS < deadline)) || { cat "$log"; die "no start line within 600 s"; }
  port="$(sed -nE 's/^capserve: serving .*HTTP API on port ([0-9]+).*/\1/p' "$log" | head -1)"
  [[ -n "$port" ]] || sleep 0.2
done
grep -m1 '^capserve: serving' "$log"
answer="$(/usr/bin/python3 - "$port" <<'EOF'
import json, sys, urllib.request
body = {"model": "capserve-moe-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16,
        "temperature": 0}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=300) as r:
    print(json.dumps(json.loads(r.read())["choices"][0]["message"]["content"]))
EOF
)" || { cat "$log"; die "the chat failed"; }
echo "chat answer: $answer"
[[ -s "$rootfs$pid_file_in_root" ]] || die "rank 0 wrote no pid to $pid_file_in_root" # before its start line
kill -TERM "$(cat "$rootfs$pid_file_in_root")"
rc=0
wait "$job" || rc=$?
job=""
echo "== the job's log"
cat "$log"
((rc == 0)) || die "the job exited $rc after SIGTERM to rank 0 (expected 0)"
# What a relocation that missed something prints, though the job may still run: a help file read at this build
# machine's path, a component that does not load, a compression library PMIx did not find.
relocation_re="couldn't open the help file|component_repository_open|unable to open|unable to find a usable"
if grep -E "$relocation_re" "$log"; then
  die "the relocated Open MPI / PMIx missed something (above)"
fi

# ---- 5. Summary.
echo
echo "== minimal-root check passed"
echo "archive:   $archive ($(du -h "$archive" | cut -f1), $(stat -c %s "$archive") bytes)"
echo "root:      $rootfs ($(du -shx "$rootfs" | cut -f1); $base_size before the bundle and model)${env_note:-}"
echo "ldd:       $ldd_verdict"
echo "served:    2 ranks, capserve --device cpu under the bundle's mpirun, exit 0 after SIGTERM"
echo "answer:    $answer"
