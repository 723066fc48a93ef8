"""Run under mpirun: engines made and closed one after another in one job (serve_workers on the
workers). Prints per rank, after engines 1 and N: the shared-memory mappings, open files, and
whether every closed Engine was freed."""
import gc
import json
import os
import sys
import weakref

from numa_runtime import Engine, SamplingParams

model, n = sys.argv[1], int(sys.argv[2])
dp = int(sys.argv[3]) if len(sys.argv) > 3 else None  # data-parallel replicas


def shm_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/dev/shm" in line or "mpich" in line)


seen, refs = {}, []
for i in range(n):
    e = Engine(model, dtype="float32", kv_cache_memory=1 << 20, max_model_len=512, num_threads=1,
               data_parallel=dp)
    rank = e.comm.rank
    if e.is_driver:
        e.generate([[5, 6, 7] * 120], SamplingParams(max_tokens=2, temperature=0))  # NOTE: grows the window
    else:
        e.serve_workers()
    e.close()
    refs.append(weakref.ref(e))
    del e
    gc.collect()
    if i in (1, n - 1):
        seen[i] = [shm_maps(), len(os.listdir("/proc/self/fd"))]
# NOTE: one write a rank: print() writes its parts apart and the ranks' lines interleave
os.write(1, ("RESULT " + json.dumps({"rank": rank, "seen": seen, "alive": sum(r() is not None for r in refs)})
             + "\n").encode())
