#!/usr/bin/env bash
# The CUDA backend's tests and benchmarks on a GPU machine, in one command, from the repo root:
#   bash bench/cuda_run.sh [OUTDIR] [bench_cuda.py args...]
# Builds the Cython kernels if needed (the sampler runs on the CPU), runs every CUDA test, then
# bench/bench_cuda.py (default: Llama-3.2-1B shape, bf16, decode at batch 1 and 16, transformers'
# generate, and the multi-turn host-tier comparison).
set -uo pipefail
OUT=${1:-/tmp/cuda_out}; shift || true
mkdir -p "$OUT"
export MPI4PY_RC_THREAD_LEVEL=funneled PYTHONUNBUFFERED=1
if ! python3 -c "import numa_runtime._kernels.gemm" 2>/dev/null; then
  python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/machine.txt" 2>&1
python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda_kernels.py tests/test_cuda_engine.py \
  tests/test_host_tier.py 2>&1 | tee "$OUT/tests.txt"
ARGS=("$@"); [ ${#ARGS[@]} -eq 0 ] && ARGS=(--shape llama3.2-1b --batch 1 16 64 --hf 1 64 --multiturn --profile)
python3 bench/bench_cuda.py "${ARGS[@]}" --out "$OUT/bench_cuda" 2>&1 | tee "$OUT/bench.txt"
