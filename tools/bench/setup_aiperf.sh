#!/usr/bin/env bash
# Creates (or completes) the ignored venv tools/.venv-bench with NVIDIA's aiperf benchmark client at the exact
# versions of tools/bench/requirements-aiperf.txt (PyPI; about 120 wheels, no torch) and prints its bin directory.
# Idempotent: a complete venv is left as it is.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$root/tools/.venv-bench"
lock="$root/tools/bench/requirements-aiperf.txt"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --require-virtualenv -r "$lock" >&2; then
  echo "setup_aiperf: pip could not install $lock into $venv (is PyPI reachable?)" >&2
  exit 1
fi
echo "$venv/bin"
