#!/usr/bin/env bash
# Runs a CapServe program on N ranks under Open MPI:
#   deploy/launch.sh [HOST OPTIONS] N PROGRAM [ARGS...]
# On this node (no host option) it adds what a single machine or container needs: root permission,
# oversubscription when N exceeds the cores, no core binding (each rank runs its own OpenMP threads),
# shared-memory transport only. With a host option the job spans hosts:
#   --hostfile FILE        Open MPI hostfile ("node1 slots=8" per line)
#   --hosts H[:S],...      the same inline (S slots on host H, default 1)
#   --slurm                the hosts of the Slurm allocation this runs in (deploy/capserve.sbatch)
#   --iface IF             network interface or CIDR the ranks use between hosts (eth0, 10.0.0.0/24): Open MPI's
#                          btl_tcp_if_include and oob_tcp_if_include, or UCX_NET_DEVICES with UCX (a name there)
#   --transport tcp|ucx|auto  auto (default): UCX where ucx_info reports an RDMA transport (InfiniBand, RoCE),
#                          else TCP, unless OMPI_MCA_pml / OMPI_MCA_btl say otherwise; tcp: the ob1 pml over the
#                          self, vader (ranks of one host) and tcp btls
#   --agent CMD            what starts Open MPI's daemon on another host instead of ssh (plm_rsh_agent)
# Ranks fill each host's slots in order; every rank picks the GPU of its local rank on its host, so give each host
# as many slots as it has GPUs. Extra mpirun arguments can be passed in CAPSERVE_MPIRUN_ARGS.
#
# SIGTERM/SIGINT/SIGHUP sent to this script reach rank 0, which drains and then stops every rank, exit code 0: on
# one node capserve writes its pid to $CAPSERVE_RANK0_PID_FILE at start and gets SIGTERM; across hosts (rank 0 may
# run elsewhere) mpirun gets SIGUSR1, which it forwards to every rank, and rank 0 acts on it. mpirun itself treats
# SIGTERM/SIGINT/SIGHUP as "abort the job" (it kills all ranks after about a second, too soon for running requests
# to finish), so it starts with the three blocked: a signal to the whole process group (Ctrl-C in a terminal, the
# terminal closing) or to every process of the service (systemd's default KillMode=control-group) reaches mpirun
# too and does nothing there. SIGUSR2 is ignored here (mpirun forwards it; capserve logs and ignores it). A script
# that starts this one as a background job (`deploy/launch.sh ... &`) hands it SIGINT ignored, which bash can
# neither trap nor reset: this script first re-executes itself with SIGINT, SIGTERM and SIGHUP at their defaults,
# so that Ctrl-C and `kill -INT -PGID` drain in either launch mode. Only when no rank 0 pid is known yet (MPI
# still starting, or a program other than capserve) on one node, or at a second signal across hosts, does this
# script end the job (SIGKILL to mpirun, whose ranks then exit).
# mpirun runs quiet (-q): a rank's own error stays the last line, not followed by mpirun's "process returned a
# non-zero exit code" banner; the exit status still tells.
set -euo pipefail
if [[ -z "${CAPSERVE_LAUNCH_SIGNALS_RESET:-}" ]]; then
  # perl-base is part of every Debian system; bash cannot reset a signal ignored when it started.
  CAPSERVE_LAUNCH_SIGNALS_RESET=1 exec perl -e '$SIG{$_} = "DEFAULT" for qw(INT TERM HUP); exec @ARGV or die "$!\n"' \
    bash "${BASH_SOURCE[0]}" "$@"
fi
unset CAPSERVE_LAUNCH_SIGNALS_RESET
usage() {
  echo "usage: deploy/launch.sh [--hostfile FILE | --hosts H[:SLOTS],... | --slurm] [--iface IF]" \
    "[--transport tcp|ucx|auto] [--agent CMD] N PROGRAM [ARGS...]" >&2
  exit 2
}
hosts_args=()
multi_host=0
iface=""
transport=auto
while (($# > 0)) && [[ "$1" == --* ]]; do
  (($# >= 2)) || usage
  case "$1" in
    --hostfile)
      [[ -r "$2" ]] || { echo "deploy/launch.sh: --hostfile $2: no such readable file" >&2; exit 2; }
      hosts_args+=(--hostfile "$2") multi_host=1
      shift 2
      ;;
    --hosts) hosts_args+=(--host "$2") multi_host=1; shift 2 ;;
    --slurm) multi_host=1; shift ;;
    --iface) iface="$2"; shift 2 ;;
    --transport)
      [[ "$2" =~ ^(tcp|ucx|auto)$ ]] || { echo "deploy/launch.sh: --transport $2: tcp, ucx or auto" >&2; exit 2; }
      transport="$2"
      shift 2
      ;;
    --agent) hosts_args+=(--mca plm_rsh_agent "$2"); shift 2 ;;
    *) usage ;;
  esac
done
(($# >= 2)) || usage
[[ "$1" =~ ^[1-9][0-9]*$ ]] || { echo "deploy/launch.sh: N must be a positive rank count, not '$1'" >&2; exit 2; }
np="$1"
shift
args=(-np "$np" --bind-to none -q "${hosts_args[@]}")
if [[ "$(id -u)" == 0 ]]; then
  # Open MPI refuses root unless told twice; the environment pair also reaches the daemons on other hosts.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  if ((multi_host)); then
    echo "deploy/launch.sh: running as root (Open MPI allowed to); an unprivileged user is safer" >&2
  fi
fi
pid_file="$(mktemp)"
if ((multi_host)); then
  # An explicit --transport or --iface overrides the OMPI_MCA_* / UCX_* variables of the environment; auto keeps them.
  if [[ "$transport" == auto ]]; then
    if command -v ucx_info >/dev/null && ucx_info -d 2>/dev/null | grep -Eq 'Transport: (rc|rc_mlx5|dc_mlx5|ud|ud_mlx5)'; then
      export OMPI_MCA_pml="${OMPI_MCA_pml:-ucx}"
    else
      export OMPI_MCA_pml="${OMPI_MCA_pml:-ob1}" OMPI_MCA_btl="${OMPI_MCA_btl:-self,vader,tcp}"
    fi
  elif [[ "$transport" == ucx ]]; then
    export OMPI_MCA_pml=ucx
  else
    export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp
  fi
  # A host that dies or a link that stops carrying traffic leaves mpirun's connection to that host's daemon
  # silent: probe it every second after 2 s of silence and count the daemon lost after 3 missed probes (the
  # kernel's default is 2 hours), so that mpirun ends the job, and the daemon its ranks, within ~5 s.
  export OMPI_MCA_oob_tcp_keepalive_time="${OMPI_MCA_oob_tcp_keepalive_time:-2}"
  export OMPI_MCA_oob_tcp_keepalive_intvl="${OMPI_MCA_oob_tcp_keepalive_intvl:-1}"
  export OMPI_MCA_oob_tcp_keepalive_probes="${OMPI_MCA_oob_tcp_keepalive_probes:-3}"
  if [[ -n "$iface" ]]; then
    # Open MPI's own wire-up (the daemons and the job's start) goes over the same network as the ranks.
    export OMPI_MCA_oob_tcp_if_include="$iface"
    if [[ "$OMPI_MCA_pml" == ucx ]]; then
      export UCX_NET_DEVICES="$iface"
      args+=(-x UCX_NET_DEVICES)
    else
      export OMPI_MCA_btl_tcp_if_include="$iface"
    fi
  fi
else
  if ((np > $(nproc))); then args+=(--oversubscribe); fi
  export OMPI_MCA_btl="${OMPI_MCA_btl:-self,vader}"
  export CAPSERVE_RANK0_PID_FILE="$pid_file"
  args+=(-x CAPSERVE_RANK0_PID_FILE)
fi
# Containers usually forbid the ptrace-based single-copy path between processes.
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"
# perl-base is part of every Debian system; bash cannot block signals for a child.
# shellcheck disable=SC2086
perl -MPOSIX -e 'sigprocmask(SIG_BLOCK, POSIX::SigSet->new(SIGTERM, SIGINT, SIGHUP)) or die; exec @ARGV or die "$!\n"' \
  mpirun "${args[@]}" ${CAPSERVE_MPIRUN_ARGS:-} "$@" &
job=$!
stops=0
# shellcheck disable=SC2317  # called from the trap below
forward() {
  stops=$((stops + 1))
  if ((multi_host)); then
    if ((stops == 1)); then kill -USR1 "$job" 2>/dev/null || true; else kill -KILL "$job" 2>/dev/null || true; fi
  elif [[ -s "$pid_file" ]]; then
    kill -TERM "$(cat "$pid_file")" 2>/dev/null || true
  else
    kill -KILL "$job" 2>/dev/null || true
  fi
}
trap forward TERM INT HUP
# A handler, not SIG_IGN: mpirun must not inherit SIGUSR2 ignored (it forwards the signal to the ranks).
trap ':' USR2
status=0
while true; do
  wait "$job" && status=0 || status=$?
  # wait returns early (status > 128) when a trapped signal arrives; keep waiting while the job lives.
  kill -0 "$job" 2>/dev/null || break
done
rm -f "$pid_file"
exit "$status"
