#!/usr/bin/env bash
# Install the test dependencies and run the whole test suite (multi-rank tests use real mpirun).
set -euo pipefail
cd "$(dirname "$0")/.."
# the environment scripts/install.sh made (.venv), or PYTHON's
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
$PY -m pip install -q -r requirements-test.txt
export MPI4PY_RC_THREAD_LEVEL=funneled
# mpirun (mpich wheel) lives beside the interpreter; make sure tests find it.
export PATH="$($PY -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
# -rs: every skipped test's reason is printed in the summary
# arguments (test files, -k ...) replace the default of the whole tests/ folder
exec $PY -m pytest -q -rs -p no:cacheprovider "${@:-tests}"
