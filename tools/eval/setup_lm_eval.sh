#!/usr/bin/env bash
# Creates (or completes) the ignored venv tools/.venv-lmeval with EleutherAI's lm-evaluation-harness and what its
# API models need (lm-eval[api], transformers for the model's tokenizer, no torch) at the exact versions of
# tools/eval/requirements-lm-eval.txt (PyPI), and prints its bin directory. Idempotent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$root/tools/.venv-lmeval"
lock="$root/tools/eval/requirements-lm-eval.txt"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --require-virtualenv -r "$lock" >&2; then
  echo "setup_lm_eval: pip could not install $lock into $venv (is PyPI reachable?)" >&2
  exit 1
fi
echo "$venv/bin"
