#!/usr/bin/env bash
# Install the test dependencies and run the whole test suite (multi-rank tests use real mpirun).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q -r requirements-test.txt
export MPI4PY_RC_THREAD_LEVEL=funneled
exec $PY -m pytest -q -p no:cacheprovider tests "$@"
