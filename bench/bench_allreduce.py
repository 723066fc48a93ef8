"""Shared-memory allreduce vs comm.Allreduce, f32 and bf16, 2 KB .. 8 MB.

    MPI4PY_RC_THREAD_LEVEL=funneled mpirun -np 2 python bench/bench_allreduce.py [--iters N]

Rank 0 prints a markdown table: median latency per call and algorithm bandwidth
(bytes of the buffer / time). The comm.Allreduce column is MPIComm's cross-host path; for
bf16 (MPI has no bf16 type) that is comm.Allgather + the reduce kernel, summed in rank order.
"""
import argparse
import time

import numpy as np

from numa_runtime.distributed import MPIComm, init_distributed

SIZES = [2 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20]


def timed(comm, fn, x: np.ndarray, iters: int) -> float:
    """Median seconds of one call, over `iters` calls after warm-up; max over ranks."""
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(iters):
        comm.barrier()
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return comm.comm.allreduce(float(np.median(times)), op=comm.MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    shm = init_distributed()
    if not (isinstance(shm, MPIComm) and shm.uses_shared_memory):
        raise SystemExit("bench_allreduce.py: run it under mpirun with 2 or more ranks on one host, e.g. "
                         "mpirun -np 2 python bench/bench_allreduce.py")
    mpi = MPIComm(shm.MPI, shm.comm.Dup(), shared_memory=False)
    rows = []
    for nbytes in SIZES:
        for dtype, name in ((np.float32, "f32"), (np.uint16, "bf16")):
            n = nbytes // np.dtype(dtype).itemsize
            x = (np.random.default_rng(shm.rank).standard_normal(n).astype(np.float32)
                 if dtype == np.float32 else np.full(n, 0x3F80, np.uint16))
            iters = max(5, args.iters if nbytes <= (1 << 20) else args.iters // 5)
            t_shm = timed(shm, shm.all_reduce_, x.copy(), iters)
            t_mpi = timed(mpi, mpi.all_reduce_, x.copy(), iters)
            rows.append((nbytes, name, t_shm, t_mpi))
    if shm.rank == 0:
        print("allreduce, %d ranks (median per call; GB/s = buffer bytes / time)\n"
              % shm.world_size)
        print("| size | dtype | shm us | shm GB/s | comm.Allreduce us | comm.Allreduce GB/s | speed-up |")
        print("|---:|:---|---:|---:|---:|---:|---:|")
        for nbytes, name, ts, tm in rows:
            size = "%d KB" % (nbytes >> 10) if nbytes < (1 << 20) else "%d MB" % (nbytes >> 20)
            print("| %s | %s | %.1f | %.2f | %.1f | %.2f | %.2fx |" % (
                size, name, ts * 1e6, nbytes / ts / 1e9, tm * 1e6, nbytes / tm / 1e9, tm / ts))


if __name__ == "__main__":
    main()
