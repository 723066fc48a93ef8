"""Run under `mpirun -np 2`: rank 1's KV pool (its kv_cache_memory, as a smaller host's default
share would be) cannot hold one request of the asked max_model_len. Every rank must fail at
load, none wait for ever. Each rank writes one line (LOADED, or ERROR and why) to OUT_DIR/rank<r>.txt
(two ranks' lines on one stdout can interleave).

usage: mpirun -np 2 python tests/mpi/asked_len.py MODEL_DIR RANK_1_KV_BYTES OUT_DIR"""
import os
import sys

from numa_runtime import Engine

rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
try:
    Engine(sys.argv[1], dtype="float32", max_model_len=256, num_threads=1,
           kv_cache_memory=(1 << 22) if rank == 0 else int(sys.argv[2]))
    line = f"LOADED rank {rank}"
except Exception as e:  # noqa: BLE001 - written for the test to read
    line = f"ERROR rank {rank} {type(e).__name__}: {e}"
with open(os.path.join(sys.argv[3], f"rank{rank}.txt"), "w") as f:
    f.write(line)
