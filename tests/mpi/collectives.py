"""Run under `mpirun -np N`: checks all_reduce_, all_gather and broadcast_plan of MPIComm.

Prints "collectives ok" on rank 0 when every check passes; any failure raises (and the fault
hook aborts the job with a non-zero exit)."""
import sys

import numpy as np

from numa_runtime.backend.reference import bf16_to_f32, f32_to_bf16
from numa_runtime.distributed import MPIComm, init_distributed
from numa_runtime.plan import StepPlan

SIZES = (1, 7, 4097, 1 << 20)


def per_rank(rank: int, n: int, dtype) -> np.ndarray:
    x = np.random.default_rng(1000 * rank + n).standard_normal(n).astype(np.float32)
    return f32_to_bf16(x) if dtype == np.uint16 else x


def expected_sum(world: int, n: int, dtype) -> np.ndarray:
    parts = [per_rank(r, n, dtype) for r in range(world)]
    if dtype == np.uint16:  # reference semantics: f32 accumulation in rank order, round once
        acc = np.zeros(n, np.float32)
        for p in parts:
            acc += bf16_to_f32(p)
        return f32_to_bf16(acc)
    acc = np.zeros(n, np.float32)
    for p in parts:
        acc += p
    return acc


def check_all_reduce(comm) -> None:
    for repeat in range(3):  # both slots of the double buffer, and a grow in between
        for dtype in (np.float32, np.uint16):
            for n in SIZES:
                x = per_rank(comm.rank, n, dtype)
                comm.all_reduce_(x)
                want = expected_sum(comm.world_size, n, dtype)
                if comm.uses_shared_memory or dtype == np.uint16:  # rank order: bit-exact
                    assert np.array_equal(x, want), ("all_reduce_", dtype, n)
                else:
                    np.testing.assert_allclose(bf16_to_f32(x) if dtype == np.uint16 else x,
                                               bf16_to_f32(want) if dtype == np.uint16 else want,
                                               rtol=1e-2, atol=1e-5)
    x = np.full((3, 5), comm.rank + 1, np.float32)[:, ::2]  # non-contiguous view
    comm.all_reduce_(x)
    assert np.all(x == comm.world_size * (comm.world_size + 1) / 2)


def check_all_gather(comm) -> None:
    w = comm.world_size
    for shape in ((5,), (2, 3), (4, 1, 1000)):
        x = np.full(shape, comm.rank, np.float32) + np.arange(shape[-1], dtype=np.float32)
        out = comm.all_gather(x)
        assert out.shape == shape[:-1] + (shape[-1] * w,)
        for r in range(w):
            np.testing.assert_array_equal(out[..., r * shape[-1]:(r + 1) * shape[-1]],
                                          np.full(shape, r, np.float32)
                                          + np.arange(shape[-1], dtype=np.float32))


def check_broadcast_plan(comm) -> None:
    sent = StepPlan(token_ids=np.array([5, 6, 7], np.int64), positions=np.array([0, 1, 9]),
                    slot_mapping=np.array([16, 17, 40]), query_start=np.array([0, 2, 3], np.int32),
                    context_lens=np.array([2, 10], np.int32),
                    block_tables=np.array([[1, 0, 0], [2, 3, 4]], np.int32),
                    logits_indices=np.array([1, 2]), step_id=42)
    got = comm.broadcast_plan(sent if comm.rank == 0 else None)
    for f in ("token_ids", "positions", "slot_mapping", "query_start", "context_lens",
              "block_tables", "logits_indices"):
        a, b = getattr(sent, f), getattr(got, f)
        assert a.shape == b.shape and np.array_equal(a, b), f
    assert got.step_id == 42 and got.kind == sent.kind
    assert comm.broadcast_plan(StepPlan.shutdown() if comm.rank == 0 else None).kind == 2


def main() -> None:
    comm = init_distributed()
    if "--no-shm" in sys.argv:  # the cross-host path: comm.Allreduce / Allgather
        from mpi4py import MPI
        comm = MPIComm(MPI, MPI.COMM_WORLD.Dup(), shared_memory=False)
    assert isinstance(comm, MPIComm) and comm.world_size > 1
    check_all_reduce(comm)
    check_all_gather(comm)
    check_broadcast_plan(comm)
    reports = comm.gather_object({"rank": comm.rank, "shm": comm.uses_shared_memory})
    if comm.rank == 0:
        assert [r["rank"] for r in reports] == list(range(comm.world_size))
        print("collectives ok: %d ranks, shm=%s" % (comm.world_size, reports[0]["shm"]),
              flush=True)


if __name__ == "__main__":
    main()
