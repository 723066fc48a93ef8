"""Run under `mpirun -np 2`: make and close the communicator of an Engine 2100 times (a server of
several models makes one per model load); MPICH allows about 2040 live communicators, so a leak
fails here. Prints "comm cycles ok" on rank 0."""
import sys

from mpi4py import MPI

from numa_runtime.distributed import MPIComm

n = int(sys.argv[1]) if len(sys.argv) > 1 else 2100
for i in range(n):
    comm = MPIComm(MPI)
    assert comm._shm is not None  # the shared-memory path, which made the host communicator live
    comm.close()
if MPI.COMM_WORLD.Get_rank() == 0:
    print("comm cycles ok", flush=True)
