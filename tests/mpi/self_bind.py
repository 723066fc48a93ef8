"""Run under plain `mpirun -np 2` (no numa-launch): each rank binds itself.

Prints one line per rank: "rank R cpus C node N threads T how H"."""
import logging
import os

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

from numa_runtime.distributed import init_distributed  # noqa: E402
from numa_runtime.numa import bind_this_rank  # noqa: E402

comm = init_distributed()
again = bind_this_rank(comm.rank, comm.local_rank, comm.local_size)  # cached: same answer
cpus = sorted(os.sched_getaffinity(0))
assert list(again.cpus) == cpus, (again, cpus)
for r in range(comm.world_size):
    comm.barrier()
    if r == comm.rank:
        print("rank %d cpus %s node %d threads %d how %s omp %s" % (
            comm.rank, ",".join(map(str, cpus)), again.node, again.num_threads, again.how,
            os.environ.get("OMP_NUM_THREADS")), flush=True)
