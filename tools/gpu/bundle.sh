#!/usr/bin/env bash
# The first-GPU bundle (tools/gpu/README.md): a Release build for the device (sm_90a machine code plus PTX, no
# -march=native) with this machine's CUDA toolkit, packed with every non-system library its programs need and
# Open MPI's launcher, daemon, components and help files, into one compressed archive that a bare GPU machine
# unpacks and runs with run.sh. cudart, cuBLAS and NCCL are not packed: the GPU machine's toolkit and PyTorch's
# NCCL wheel provide them (run.sh finds them).
#
#   bash tools/gpu/bundle.sh [--out FILE] [--with-data] [--repack DIR]
#
# --out FILE    the archive (default: build-gpu/capserve-gpu-kit.tar.xz)
# --with-data   also pack the test fixtures' models and the default model (about 38 MB more); without it run.sh
#               reads them from the repository checkout the bundle is unpacked in (tools/gpu/README.md).
# --repack DIR  nothing is built: the programs and the plugin are taken from DIR as they are (a build tree, or the
#               capserve-gpu-kit folder of an earlier stage), only DIR is read. For a change to the packing alone
#               (libraries, Open MPI, scripts), minutes instead of a ~20 min build.
# CAPSERVE_GPU_BUILD_DIR names the build folder (default build-gpu).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${CAPSERVE_GPU_BUILD_DIR:-$root/build-gpu}"
archive="$build/capserve-gpu-kit.tar.xz"
with_data=0
repack=""
while (($# > 0)); do
  case "$1" in
    --out) archive="$2"; shift 2 ;;
    --with-data) with_data=1; shift ;;
    --repack) repack="$(cd "$2" && pwd)"; shift 2 ;;
    *) echo "bundle.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

programs=(capserve capserve-generate capserve-bench-kernels test_cuda_kernels test_cuda_backend test_cuda_model
          test_host_staged_gpu test_nccl_communicator)
if [[ -z "$repack" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCAPSERVE_NATIVE=OFF \
    "-DCMAKE_CUDA_ARCHITECTURES=90a-real;90-virtual" \
    -DCMAKE_CUDA_FLAGS=-lineinfo >/dev/null
  cmake --build "$build" -j "$(nproc)" --target "${programs[@]}" capserve_cuda_devices
fi
programs_from="${repack:-$build}"

stage="$build/gpu-kit-stage/capserve-gpu-kit"
rm -rf "$build/gpu-kit-stage"
mkdir -p "$stage"/{bin,lib,tools} "$stage/openmpi"/{lib/openmpi3,share,etc,pmix/lib/pmix,pmix/share}
for p in "${programs[@]}" libcapserve_cuda_devices.so; do
  f="$(find "$programs_from" -type f -name "$p" -perm -u+x -not -path "$build/gpu-kit-stage/*" | head -1)"
  [[ -n "$f" ]] || { echo "bundle.sh: no $p in $programs_from" >&2; exit 1; }
  if [[ "$p" == *.so ]]; then cp "$f" "$stage/lib/"; else cp "$f" "$stage/bin/"; fi
done

# Open MPI: the launcher and daemon, the components a node-local run loads (not the network ones: UCX, OFI, PSM,
# verbs, whose libraries a GPU machine without those networks lacks), the help files, and PMIx's.
ompi_pkglib="$(ompi_info --path pkglibdir --parsable | sed 's/.*://')"
ompi_pkgdata="$(ompi_info --path pkgdatadir --parsable | sed 's/.*://')"
cp "$(readlink -f "$(command -v orterun)")" "$stage/bin/orterun"
cp "$(command -v orted)" "$stage/bin/orted"
ln -sf orterun "$stage/bin/mpirun"
for c in "$ompi_pkglib"/*.so; do
  ldd "$c" | grep -qE 'libucp|libfabric|libpsm|libibverbs' || cp "$c" "$stage/openmpi/lib/openmpi3/"
done
cp -r "$ompi_pkgdata" "$stage/openmpi/share/openmpi"
# PMIx's own install folder (Debian: .../pmix2/lib beside lib/pmix, its components, and share/pmix, its help
# files), from libpmix's real path: ldd may name it by the /lib symlink of a merged /usr, which has neither.
pmix_lib="$(dirname "$(readlink -f "$(ldd "$ompi_pkglib/mca_pmix_ext3x.so" | awk '/libpmix/ {print $3}')")")"
[[ -d "$pmix_lib/pmix" ]] || { echo "bundle.sh: no PMIx components beside $pmix_lib" >&2; exit 1; }
[[ -d "$pmix_lib/../share/pmix" ]] || { echo "bundle.sh: no PMIx help files in $pmix_lib/../share" >&2; exit 1; }
cp "$pmix_lib"/pmix/*.so "$stage/openmpi/pmix/lib/pmix/"
cp -r "$pmix_lib/../share/pmix" "$stage/openmpi/pmix/share/"

# Every library these resolve, except the C runtime and compiler runtime (every Linux has them, newer) and the
# CUDA/NCCL ones (the GPU machine's).
system_re='/(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so'
gpu_re='/(libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvidia-[a-z-]*)\.so'
mapfile -t elves < <(find "$stage" -type f \( -perm -u+x -o -name '*.so' \) -exec sh -c 'head -c4 "$1" | grep -q ELF' _ {} \; -print)
ldd "${elves[@]}" 2>/dev/null | awk '/=> \// {print $3}' | sort -u | grep -vE "$system_re" | grep -vE "$gpu_re" |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
strip --strip-unneeded "$stage"/bin/* "$stage"/lib/*.so* 2>/dev/null || true

cp "$root"/tools/gpu/{run.sh,kit_env.sh} "$stage/"
cp "$root"/tools/gpu/{chat_check.py,make_synthetic_checkpoint.py,torch_peer.py,report.py,ncu_summary.py} "$stage/tools/"
if ((with_data)); then
  mkdir -p "$stage/fixtures" "$stage/model"
  cp -r "$root/tests/fixtures/models" "$stage/fixtures/"
  cp -r "$root/deploy/models/capserve-moe-tiny" "$stage/model/"
fi
{
  commit="$(git -C "$root" rev-parse --short=12 HEAD)$(git -C "$root" diff --quiet HEAD || echo +dirty)"
  if [[ -n "$repack" ]]; then
    echo "packed by commit $commit, $(date -u +%Y-%m-%dT%H:%MZ), programs from $repack$(
      [[ -r "$repack/MANIFEST" ]] && echo " ($(head -1 "$repack/MANIFEST"))")"
  else
    echo "commit $commit, built $(date -u +%Y-%m-%dT%H:%MZ)"
  fi
  echo "nvcc $(nvcc --version | grep -o 'release [0-9.]*'), sm_90a + compute_90 PTX, Release, CAPSERVE_NATIVE=OFF"
  echo "data: $( ((with_data)) && echo packed || echo "from the repository checkout around the bundle")"
} >"$stage/MANIFEST"

# No path of this machine may decide anything there: report compiled-in build paths (each has an override that
# run.sh sets: CAPSERVE_CUDA_PLUGIN, CAPSERVE_FIXTURES_DIR).
grep -l "$root" "$stage"/bin/* "$stage"/lib/* 2>/dev/null | sed "s|$stage/||; s|^|compiled-in build path (overridden by run.sh): |" || true

tar -C "$build/gpu-kit-stage" -cf - capserve-gpu-kit | xz -T0 -9 >"$archive"
echo "bundle.sh: $archive ($(du -h "$archive" | cut -f1); $(du -sh "$stage" | cut -f1) unpacked)"
