#!/usr/bin/env bash
# Runs a CapServe program on N ranks of this node under Open MPI: deploy/launch.sh N PROGRAM [ARGS...].
# Adds what a single machine or container needs: root permission, oversubscription when N exceeds the cores,
# no core binding (each rank runs its own OpenMP threads), shared-memory transport only. Extra mpirun arguments
# can be passed in CAPSERVE_MPIRUN_ARGS.
set -euo pipefail
if (($# < 2)); then
  echo "usage: deploy/launch.sh N PROGRAM [ARGS...]" >&2
  exit 2
fi
np="$1"
shift
args=(-np "$np" --bind-to none)
if [[ "$(id -u)" == 0 ]]; then args+=(--allow-run-as-root); fi
if ((np > $(nproc))); then args+=(--oversubscribe); fi
export OMPI_MCA_btl="${OMPI_MCA_btl:-self,vader}"
# Containers usually forbid the ptrace-based single-copy path between processes.
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"
# shellcheck disable=SC2086
exec mpirun "${args[@]}" ${CAPSERVE_MPIRUN_ARGS:-} "$@"
