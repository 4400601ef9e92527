#!/usr/bin/env bash
# Build the llama.cpp contender of the CPU runtime benchmark.
#
# Creates tools/.venv-llama with llama-cpp-python built from its PyPI sdist for
# this CPU (GGML_NATIVE, OpenMP, no BLAS, no CUDA), and unpacks the same sdist
# under tools/.cache/llama-sdist/, whose vendor/llama.cpp holds the
# convert_hf_to_gguf.py script and gguf-py package that bench_cpu_runtime.py
# uses to make the GGUF files. Takes about 7 minutes on 2 cores.
#
# Run: bash tools/bench/setup_llama_cpp.sh   (LLAMA_CPP_PYTHON_VERSION overrides the pin)
set -euo pipefail

version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=$root/tools/.venv-llama
sdist_dir=$root/tools/.cache/llama-sdist
sdist=$sdist_dir/llama_cpp_python-$version.tar.gz

python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
mkdir -p "$sdist_dir"
[ -f "$sdist" ] || "$venv/bin/pip" download -q "llama-cpp-python==$version" --no-binary :all: --no-deps -d "$sdist_dir"
tar xzf "$sdist" -C "$sdist_dir"

CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF -DCMAKE_BUILD_TYPE=Release" \
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$venv/bin/pip" install --no-binary llama-cpp-python "$sdist"
"$venv/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__, "ready")'
