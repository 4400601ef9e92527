#!/usr/bin/env bash
# Installs every Debian package the build, the tests and the quickstart need. Idempotent: packages already present
# are skipped, and `apt-get update` runs once per call only when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git clang-format
  libopenmpi-dev openmpi-bin
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev nlohmann-json3-dev libgtest-dev libgmock-dev
  prometheus-cpp-dev libboost-dev libboost-context-dev libssl-dev libcli11-dev libpcre2-dev libutf8proc-dev zlib1g-dev libopenblas-openmp-dev
  python3 python3-numpy python3-grpcio python3-jinja2
  python3-venv  # tests/e2e/openai_python.sh: the official openai client in an ignored venv
  prometheus  # promtool lints /metrics; the server scrapes capserve in the e2e test of the Grafana dashboard
  curl  # tests/e2e: curl as a real client (100-continue); the READMEs' examples
  iproute2  # ip netns, veth, bridge and tc: the multi-host e2e test builds its test hosts with them
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
echo "install_deps: installing ${missing[*]}"
"${sudo_cmd[@]}" apt-get update -q
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
