#!/bin/sh
# Open MPI's launch agent for the multi-host e2e tests (mpirun --mca plm_rsh_agent, standing in for ssh):
# `netns_agent.sh HOST COMMAND...` runs COMMAND in network namespace HOST (tests/e2e/netns_hosts.py) and in a
# UTS namespace of its own whose host name is HOST, so that every test host reports its own name.
set -eu
host="$1"
shift
# shellcheck disable=SC2016  # $0 and $1 belong to the inner shell
exec ip netns exec "$host" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$host" "$*"
