"""Communicators: the collectives the model runner uses, for one process or MPI ranks.

Every method is collective (all ranks call it, in the same order, with the same shapes)
except `abort`. Within one host, `MPIComm` reduces through an MPI-3 shared-memory window
with a Cython kernel; across hosts it falls back to `comm.Allreduce`.
mpi4py is imported only when the process was started by mpirun.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Protocol

import numpy as np

from . import env
from .plan import StepPlan

log = logging.getLogger(__name__)

SMALL_BYTES = 64 * 1024          # at or below: every rank sums all slots (one flag barrier)
IDLE_SPIN_S = 0.02               # a worker polls without sleeping this long for the next plan
IDLE_SLEEP_S = (50e-6, 2e-3)     # then sleeps between polls, doubling from the first to the second
ABORT_FLUSH_S = 0.5              # abort(): time for mpiexec to forward the reason before MPI_Abort
_FLAG_BYTES = 4096               # head of each rank's segment: its flag (64-bit counter)
_MAX_SHM_RANKS = 256             # the C kernel's limit


class Communicator(Protocol):
    rank: int
    world_size: int
    local_rank: int
    local_size: int

    @property
    def is_driver(self) -> bool: ...
    def all_reduce_(self, x: np.ndarray) -> np.ndarray: ...
    def all_gather(self, x: np.ndarray) -> np.ndarray: ...
    def broadcast_plan(self, plan: StepPlan | None) -> StepPlan: ...
    def barrier(self) -> None: ...
    def gather_object(self, obj: Any, timed: bool = False) -> list | None: ...
    def all_gather_object(self, obj: Any) -> list: ...
    def abort(self, msg: str, code: int = 1) -> None: ...


class SingleProcessComm:
    """World of one: every collective is the identity."""
    rank, world_size, local_rank, local_size = 0, 1, 0, 1
    is_driver = True

    def all_reduce_(self, x: np.ndarray) -> np.ndarray:
        return x

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        return x

    def broadcast_plan(self, plan: StepPlan | None) -> StepPlan:
        if plan is None:
            raise ValueError("broadcast_plan(None) on a single process: there is no sender.")
        return plan

    def barrier(self) -> None:
        pass

    def gather_object(self, obj: Any, timed: bool = False) -> list:
        return [obj]

    def all_gather_object(self, obj: Any) -> list:
        return [obj]

    def abort(self, msg: str, code: int = 1) -> None:
        sys.stderr.write("rank 0: %s\n" % msg)
        sys.stderr.flush()
        raise SystemExit(code)


def _unlink_shm_names() -> None:
    """Unlink the names of MPICH's shared-memory files this process maps (/dev/shm/mpich_*),
    once every rank of the host has mapped them: the memory stays while mapped, and goes with
    the last process however the job ends (an MPI_Abort, a killed rank left a 2 MiB file in
    /dev/shm for every such end; MPICH's own unlink at a clean end finds none, which it allows)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/dev/shm/mpich" in line}
    except OSError:
        return
    for path in paths:
        if path.startswith("/dev/shm/mpich"):
            try:
                os.unlink(path)
            except OSError:
                pass


class _ShmArena:
    """One MPI shared window on the host: per rank a flag line and two data slots.

    Segment of rank j: [flag | slot A | slot B]; call k uses slot k % 2. Double buffering is
    what makes one flag per rank enough: a rank writing slot A for call k+2 has passed the
    barrier of call k+1, so every peer has finished reading slot A of call k.
    """

    def __init__(self, MPI, node_comm, nbytes: int):
        self.MPI, self.comm = MPI, node_comm
        self.rank, self.size = node_comm.Get_rank(), node_comm.Get_size()
        self.win = None
        self._allocate(max(nbytes, 1 << 20))
        if self.rank == 0:
            _unlink_shm_names()
        self.comm.Barrier()

    def _allocate(self, cap: int) -> None:
        MPI = self.MPI
        cap = (cap + 4095) // 4096 * 4096
        # NOTE: noncontig lets each rank's segment start on its own pages, so the memset
        # below (first touch by the owner) places it on the owner's node.
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        self.win = MPI.Win.Allocate_shared(_FLAG_BYTES + 2 * cap, 1, info, comm=self.comm)
        info.Free()
        self.cap = cap
        self.segs = []  # uint8 views of every rank's segment
        for j in range(self.size):
            buf, _ = self.win.Shared_query(j)
            self.segs.append(np.frombuffer(buf, dtype=np.uint8))
        self.segs[self.rank][:] = 0
        base = [s.ctypes.data for s in self.segs]
        self.flag_addrs = np.array(base, dtype=np.uint64)
        self.slot_addrs = [np.array([b + _FLAG_BYTES + k * cap for b in base], dtype=np.uint64)
                           for k in (0, 1)]
        self.phase = 0   # last flag value published
        self.calls = 0   # selects the slot
        self.comm.Barrier()

    def ensure(self, nbytes: int) -> None:
        """Grow (collectively: every rank sees the same nbytes) to hold nbytes per slot."""
        if nbytes <= self.cap:
            return
        self.comm.Barrier()  # nobody still reads the old window
        self.win.Free()
        self._allocate(max(nbytes, 2 * self.cap))

    def next_slot(self) -> int:
        k = self.calls % 2
        self.calls += 1
        return k

    def slot_view(self, j: int, k: int, nbytes: int) -> np.ndarray:
        start = _FLAG_BYTES + k * self.cap
        return self.segs[j][start:start + nbytes]

    def close(self) -> None:
        """Collective: frees the window and the host communicator (each Engine of a server of
        several models makes one: MPICH runs out of communicators after about 2000 loads)."""
        if self.win is not None:
            self.win.Free()
            self.win = None
            self.comm.Free()


class MPIComm:
    """Ranks of an MPI job (tensor parallel: every rank holds one shard)."""

    def __init__(self, MPI, comm=None, shm_bytes: int = 1 << 20, shared_memory: bool = True,
                 world_ranks: list[int] | None = None):
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        # NOTE: a replica group's ranks by their MPI (world) ranks, which messages name
        self.world_ranks = list(world_ranks) if world_ranks is not None else list(range(self.world_size))
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        self.timeout = env.collective_timeout()
        self._shm = None
        if (shared_memory and self.local_size == self.world_size
                and 1 < self.world_size <= _MAX_SHM_RANKS):
            self._k = self._reduce_kernel()
            self._shm = _ShmArena(MPI, node, shm_bytes)
        else:
            node.Free()

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def uses_shared_memory(self) -> bool:
        return self._shm is not None

    def all_reduce_(self, x: np.ndarray) -> np.ndarray:
        """x = sum of x over ranks, in place. x: f32, or bf16 bits (uint16) summed in f32 and
        rounded once. Bit-identical on every rank."""
        if x.dtype not in (np.float32, np.uint16):
            raise TypeError("all_reduce_ takes float32 or bf16 (uint16) arrays, got %s" % x.dtype)
        if not x.flags.c_contiguous:
            tmp = np.ascontiguousarray(x)
            x[...] = self.all_reduce_(tmp)
            return x
        if self.world_size == 1 or x.size == 0:
            return x
        if self._shm is None:
            return self._mpi_allreduce_(x)
        shm = self._shm
        shm.ensure(x.nbytes)
        small = x.nbytes <= SMALL_BYTES
        rc = self._k.shm_allreduce(x, shm.slot_addrs[shm.next_slot()], shm.flag_addrs,
                                   shm.rank, shm.phase + 1, small, self.timeout)
        shm.phase += 1 if small else 2
        if rc != 0:
            self._peer_timeout("all_reduce_", -1 - rc)
        return x

    def _mpi_allreduce_(self, x: np.ndarray) -> np.ndarray:
        if x.dtype == np.float32:
            self.comm.Allreduce(self.MPI.IN_PLACE, x, op=self.MPI.SUM)
            return x
        # NOTE: MPI has no bf16 type: gather every rank's bits and sum them here in rank
        # order (f32 accumulation, rounded once), the same bits the shared-memory path gives.
        parts = np.empty((self.world_size, x.size), dtype=np.uint16)
        self.comm.Allgather(x.reshape(-1), parts)
        self._reduce_kernel().reduce_sum(x.reshape(-1), list(parts))
        return x

    def _reduce_kernel(self):
        from ._kernels import reduce as _reduce
        return _reduce

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        """x: [..., n_local] -> [..., n_local * world_size], rank r's part at r*n_local."""
        x = np.ascontiguousarray(x)
        w, n = self.world_size, x.shape[-1]
        out = np.empty(x.shape[:-1] + (n * w,), dtype=x.dtype)
        if w == 1:
            out[...] = x
            return out
        if self._shm is None:
            parts = np.empty((w,) + x.shape, dtype=x.dtype)
            self.comm.Allgather(x, parts)
        else:
            shm = self._shm
            shm.ensure(x.nbytes)
            k = shm.next_slot()
            np.copyto(shm.slot_view(shm.rank, k, x.nbytes), x.reshape(-1).view(np.uint8))
            shm.phase += 1
            rc = self._k.flag_barrier(shm.flag_addrs, shm.rank, shm.phase, self.timeout)
            if rc != 0:
                self._peer_timeout("all_gather", -1 - rc)
            parts = [shm.slot_view(j, k, x.nbytes).view(x.dtype).reshape(x.shape)
                     for j in range(w)]
        for j in range(w):
            out[..., j * n:(j + 1) * n] = parts[j]
        return out

    def broadcast_plan(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0 passes the plan, the others None; every rank returns rank 0's plan.

        A worker waits for the plan's size in a non-blocking broadcast that it polls, briefly
        without pause (back-to-back steps lose nothing), then sleeping (an idle worker uses
        almost no cpu and wakes within IDLE_SLEEP_S[1])."""
        if self.rank == 0:
            if plan is None:
                raise ValueError("broadcast_plan: rank 0 must pass the plan it sends.")
            buf = plan.to_buffer()
            size = np.array([buf.size], dtype=np.int64)
            self._wait(self.comm.Ibcast(size, root=0), "broadcast_plan")
        else:
            size = np.empty(1, dtype=np.int64)
            wait_idle(self.comm.Ibcast(size, root=0).Test)  # NOTE: idle: no deadline
        if self.rank != 0:
            buf = np.empty(int(size[0]), dtype=np.int64)
        self._wait(self.comm.Ibcast(buf, root=0), "broadcast_plan")
        return plan if self.rank == 0 else StepPlan.from_buffer(buf)

    def _wait(self, req, op: str) -> None:
        """req.Wait(), but a peer that does not take part within the collective timeout (a
        stopped or hung process; a dead one ends the job through mpiexec) stops the job."""
        if not wait_done(req.Test, self.timeout):
            self.abort("%s: a rank did not take part within %g s (NUMA_RUNTIME_COLLECTIVE_TIMEOUT); it is "
                       "stuck or dead, stopping the job." % (op, self.timeout))

    def barrier(self) -> None:
        self.comm.Barrier()

    def gather_object(self, obj: Any, timed: bool = False) -> list | None:
        """Small picklable reports (stats, timings) to rank 0; None on other ranks. `timed`: a
        rank that does not take part within the collective timeout stops the job (between
        steps, where every rank is due at once; not at load, where one may read longer). Ranks
        may differ in `timed` (each times its own wait: a barrier, then the gather)."""
        req = self.comm.Ibarrier()
        if timed:
            self._wait(req, "gather_object")
        else:
            req.Wait()
        return self.comm.gather(obj, root=0)

    def all_gather_object(self, obj: Any) -> list:
        """Small picklable reports, every rank's to every rank (rank order)."""
        return self.comm.allgather(obj)

    def abort(self, msg: str, code: int = 1) -> None:
        """Print why ("rank R: msg"; nothing when msg is empty) and stop every rank of the
        job now (never returns)."""
        abort_job(self.comm, self.world_ranks[self.rank], msg, code)

    def _peer_timeout(self, op: str, late: int) -> None:
        self.abort("%s: rank %d did not join within %g s (NUMA_RUNTIME_COLLECTIVE_TIMEOUT); "
                   "it is stuck or dead, stopping the job." % (op, self.world_ranks[late], self.timeout))

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None


def abort_job(comm, world_rank: int, msg: str, code: int = 1) -> None:
    """Print why ("rank R: msg"; nothing when msg is empty) and stop every rank of the job
    through `comm` (an mpi4py communicator) now (never returns)."""
    if msg:
        sys.stderr.write("rank %d: %s\n" % (world_rank, msg))
    sys.stderr.flush()
    if msg:
        # NOTE: mpiexec forwards a rank's output from a pipe; MPI_Abort kills every process at
        # once, and on a busy host the last lines (the reason) were lost now and then
        time.sleep(ABORT_FLUSH_S)
    comm.Abort(code)


def wait_done(done, timeout: float) -> bool:
    """Poll `done()` (an MPI request's Test) without pause, as MPI's own Wait spins, for at most
    `timeout` seconds; whether it completed (False: a peer is stuck or dead)."""
    deadline = time.perf_counter() + timeout
    while not done():
        if time.perf_counter() > deadline:
            return done()
    return True


def wait_idle(done) -> None:
    """Wait for something that may take long (a worker waiting for work; `done()` polls it, e.g.
    an MPI request's Test): poll without pause for IDLE_SPIN_S, then sleep between polls with a
    doubling pause up to IDLE_SLEEP_S[1].
    NOTE: MPI's blocking waits spin at 100% of a core for as long as they wait."""
    start = time.perf_counter()
    pause = IDLE_SLEEP_S[0]
    while not done():
        if time.perf_counter() - start > IDLE_SPIN_S:
            time.sleep(pause)
            pause = min(2 * pause, IDLE_SLEEP_S[1])


# ----------------------------------------------------------------------------- set-up
def init_distributed(bind: bool = True) -> Communicator:
    """SingleProcessComm unless started by mpirun with more than one rank, else MPIComm.

    With `bind`, a rank that numa-launch did not bind binds itself to a NUMA node before MPI
    allocates anything (numa.bind_this_rank). Installs the fault hook: an uncaught exception
    on any rank stops the whole job.
    """
    world = env.mpi_world()
    if world is None or world[1] <= 1:
        return SingleProcessComm()
    from . import numa
    local = env.mpi_local()
    if bind and local is not None:
        numa.bind_this_rank(world[0], *local)
    import mpi4py
    mpi4py.rc.thread_level = env.mpi_thread_level()
    from mpi4py import MPI
    comm = MPIComm(MPI)
    if bind and local is None:
        numa.bind_this_rank(comm.rank, comm.local_rank, comm.local_size)
    install_fault_hook(comm)
    return comm


def install_fault_hook(comm: Communicator) -> None:
    """Uncaught exception (main or any thread): print the traceback and
    "rank R failed: <cause>", then abort the job so no rank waits forever on the dead one."""
    def hook(exc_type, exc, tb):
        cause = ("interrupted" if issubclass(exc_type, KeyboardInterrupt)
                 else "%s: %s" % (exc_type.__name__, exc))
        # NOTE: one write, then a pause: mpirun drops output still in flight when the job
        # is aborted, and peers failing at the same moment are killed mid-message.
        sys.stderr.write("".join(traceback.format_exception(exc_type, exc, tb))
                         + "rank %d failed: %s\n" % (comm.rank, cause))
        sys.stderr.flush()
        time.sleep(0.5)
        comm.abort("", 1)

    sys.excepthook = hook
    threading.excepthook = lambda a: hook(a.exc_type, a.exc_value, a.exc_traceback)
