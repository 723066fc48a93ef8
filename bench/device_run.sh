#!/usr/bin/env bash
# How the 16-core Xeon numbers in the closing note were produced (the session's device
# machine: no internet, so the oneDNN / MPICH / mpi4py wheels travel in .whl/).
#   bash bench/device_run.sh OUTDIR [PART]   PART: setup | scaling | engine | all
set -uo pipefail
OUT=${1:-/tmp/device_out}; PART=${2:-all}
mkdir -p "$OUT"
export MPI4PY_RC_THREAD_LEVEL=funneled PYTHONUNBUFFERED=1
if ! python3 -c "import numa_runtime._kernels.gemm" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade .whl/*.whl 2>&1 | tail -2
  python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
export PATH="$(python3 -c 'import os,sys;print(os.path.dirname(sys.executable))'):$PATH"
(lscpu; ls /sys/devices/system/node; nproc) > "$OUT/machine.txt" 2>&1
case "$PART" in
  setup) python3 bench/limits.py | tee "$OUT/limits.json";;
  scaling) python3 bench/numa_scaling.py --shape llama3.2-1b --ranks 1 2 4 8 --out "$OUT/scaling_llama1b";;
  engine) python3 bench/bench_engine.py --concurrency 1 16 --out "$OUT/engine_qwen05b" &&
          python3 bench/numa_scaling.py --ranks 1 2 --out "$OUT/scaling_qwen05b";;
esac
