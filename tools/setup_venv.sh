#!/usr/bin/env bash
# Creates (or completes) an ignored venv under tools/ with exactly the pinned packages of a requirements file
# (PyPI) and prints its bin directory. Idempotent: a complete venv is left as it is.
# Usage: bash tools/setup_venv.sh .venv-NAME path/to/requirements.txt
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/tools/$1"
lock="$root/$2"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --require-virtualenv -r "$lock" >&2; then
  echo "setup_venv: pip could not install $lock into $venv (is PyPI reachable?)" >&2
  exit 1
fi
echo "$venv/bin"
