#!/usr/bin/env bash
# The official `openai` Python client for the e2e tests, in an ignored venv that is created once and reused
# (tools/.venv-e2e; Debian's python3 with its system packages, so grpcio and numpy stay Debian's). Prints the
# venv's site-packages directory; exits non-zero when the client cannot be installed (e.g. PyPI unreachable).
set -euo pipefail
OPENAI_VERSION=3.51.0
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$root/tools/.venv-e2e"
py="$venv/bin/python"
if ! "$py" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
  /usr/bin/python3 -m venv --system-site-packages "$venv" >&2
  "$py" -m pip install -q --disable-pip-version-check --timeout 20 --retries 1 "openai==$OPENAI_VERSION" >&2
fi
"$py" -c "import openai, sysconfig; print(sysconfig.get_paths()['purelib'])"
