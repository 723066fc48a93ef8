"""Run under `mpirun -np N`: rank 1 raises while the others wait in a collective
(`--all`: every rank raises at once).

The fault hook must abort the job: mpirun exits non-zero, stderr says "rank 1 failed: ..."."""
import sys

import numpy as np

from numa_runtime.distributed import init_distributed

comm = init_distributed()
comm.all_reduce_(np.ones(16, np.float32))
if comm.rank == 1 or "--all" in sys.argv:
    raise RuntimeError("injected failure")
comm.all_reduce_(np.ones(1 << 20, np.float32))  # rank 0 would wait here forever
print("unreachable: rank 0 finished", flush=True)
