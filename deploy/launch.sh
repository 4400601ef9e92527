#!/usr/bin/env bash
# Runs a CapServe program on N ranks of this node under Open MPI: deploy/launch.sh N PROGRAM [ARGS...].
# Adds what a single machine or container needs: root permission, oversubscription when N exceeds the cores,
# no core binding (each rank runs its own OpenMP threads), shared-memory transport only. Extra mpirun arguments
# can be passed in CAPSERVE_MPIRUN_ARGS.
#
# SIGTERM/SIGINT sent to this script go to rank 0 (capserve writes its pid to $CAPSERVE_RANK0_PID_FILE at start),
# which drains and then stops every rank, exit code 0. mpirun itself treats SIGTERM/SIGINT as "abort the job" (it
# kills all ranks after about a second, too soon for running requests to finish), so it starts with both signals
# blocked: a signal to the whole process group (Ctrl-C in a terminal) or to every process of the service
# (systemd's default KillMode=control-group) reaches mpirun too and does nothing there. Only when no rank 0 pid is
# known yet (MPI still starting, or a program other than capserve) does this script end the job (SIGKILL to
# mpirun, whose ranks then exit). mpirun runs quiet (-q): a rank's own error stays the last line, not followed by
# mpirun's "process returned a non-zero exit code" banner; the exit status still tells.
set -euo pipefail
if (($# < 2)); then
  echo "usage: deploy/launch.sh N PROGRAM [ARGS...]" >&2
  exit 2
fi
np="$1"
shift
args=(-np "$np" --bind-to none -q)
if [[ "$(id -u)" == 0 ]]; then args+=(--allow-run-as-root); fi
if ((np > $(nproc))); then args+=(--oversubscribe); fi
export OMPI_MCA_btl="${OMPI_MCA_btl:-self,vader}"
# Containers usually forbid the ptrace-based single-copy path between processes.
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"
pid_file="$(mktemp)"
export CAPSERVE_RANK0_PID_FILE="$pid_file"
# perl-base is part of every Debian system; bash cannot block signals for a child.
# shellcheck disable=SC2086
perl -MPOSIX -e 'sigprocmask(SIG_BLOCK, POSIX::SigSet->new(SIGTERM, SIGINT)) or die; exec @ARGV or die "$!\n"' \
  mpirun "${args[@]}" -x CAPSERVE_RANK0_PID_FILE ${CAPSERVE_MPIRUN_ARGS:-} "$@" &
job=$!
forward() {
  if [[ -s "$pid_file" ]]; then kill -TERM "$(cat "$pid_file")" 2>/dev/null || true; else kill -KILL "$job" 2>/dev/null || true; fi
}
trap forward TERM INT
status=0
while true; do
  wait "$job" && status=0 || status=$?
  # wait returns early (status > 128) when a trapped signal arrives; keep waiting while the job lives.
  kill -0 "$job" 2>/dev/null || break
done
rm -f "$pid_file"
exit "$status"
