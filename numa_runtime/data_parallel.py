"""Data-parallel replicas: the ranks of the job split into groups, each a tensor-parallel model.

Replica r is ranks r*tp .. r*tp + tp - 1 (ParallelConfig); its first rank is its leader. Rank 0
(leader of replica 0) schedules and samples for every replica (router.py). Each step it sends
replica r's plan to that leader (point to point, MPI_COMM_WORLD), runs its own replica's plan,
and receives the leader's logits rows. A leader broadcasts its plan inside its group like rank
0 does, so a replica's workers run the same loop as tensor-parallel workers.

    rank 0 ──plan r──► leader of r ──broadcast──► its group ──logits rows──► rank 0
"""
from __future__ import annotations

import logging
import time

import numpy as np

from . import env
from .config import EngineConfig, ModelConfig, ParallelConfig, asked_replicas
from .distributed import MPIComm, SingleProcessComm, abort_job, wait_idle
from .plan import SHUTDOWN, StepPlan

log = logging.getLogger("numa_runtime")

_PLAN_TAG, _LOGITS_TAG, _ACK_TAG = 71, 72, 73


class ReplicaLink:
    """Point-to-point messages between rank 0 and the leaders of replicas 1..N-1.

    A leader acknowledges every plan it has run (a plan's count, after its logits rows), so rank
    0 knows each replica's progress: its waits end the job when a replica with plans queued
    completes none of them within the collective timeout (a stopped or hung leader; its group's
    own collectives cover a rank behind the leader). A wait on one plan may not be timed: the
    replica may be many queued plans behind (a prefill's chunks are sent ahead)."""

    def __init__(self, MPI, world, parallel: ParallelConfig):
        self.MPI, self.world, self.parallel = MPI, world, parallel
        self._sends: list = []
        self.timeout = env.collective_timeout()
        n = parallel.data_parallel
        self._sent, self._acked = [0] * n, [0] * n  # plans sent to / acknowledged by each replica
        self._progress = [time.monotonic()] * n     # its last acknowledgement, or its first plan since idle
        self._ack = np.empty(1, dtype=np.int64)

    # ---- rank 0 -------------------------------------------------------------------------
    def send_plan(self, replica: int, plan: StepPlan) -> None:
        """Start sending (completed by finish_sends, after rank 0's own step)."""
        self._drain(replica)
        if self._sent[replica] == self._acked[replica]:
            self._progress[replica] = time.monotonic()  # NOTE: idle until now
        self._sent[replica] += 1
        buf = plan.to_buffer()
        self._sends.append((self.world.Isend(buf, dest=self.parallel.leader_of(replica), tag=_PLAN_TAG), buf))

    def finish_sends(self) -> None:
        self.wait([req for req, _ in self._sends])
        self._sends.clear()

    def post_logits(self, replica: int, out: np.ndarray):
        """Start receiving replica's logits rows into out [rows, vocab] f32; returns the request."""
        return self.world.Irecv(out, source=self.parallel.leader_of(replica), tag=_LOGITS_TAG)

    def wait(self, requests: list) -> None:
        """Complete requests to and from the leaders; a replica with plans queued that
        acknowledges none of them within the collective timeout ends the job."""
        def done():
            nonlocal requests
            requests = [req for req in requests if not req.Test()]
            return not requests
        self._poll(done)

    def wait_acknowledged(self) -> None:
        """Until every replica has acknowledged every plan sent to it (the shutdown's too)."""
        def done():
            for r in self._behind():
                self._drain(r)
            return not self._behind()
        self._poll(done)

    def _behind(self) -> list[int]:
        return [r for r in range(1, len(self._sent)) if self._sent[r] > self._acked[r]]

    def _poll(self, done) -> None:
        """Wait until done() holds as wait_idle waits (rank 0's other threads get the interpreter
        while it sleeps), ending the job when a replica with plans queued acknowledges none within
        the collective timeout of rank 0 waiting (the time before this wait, rank 0's own step, is
        not counted: a replica may need rank 0 inside MPI to finish a message)."""
        start = time.monotonic()

        def ready() -> bool:
            if done():
                return True
            now = time.monotonic()
            for r in self._behind():
                self._drain(r)
                if self._sent[r] > self._acked[r] and now - max(self._progress[r], start) > self.timeout:
                    self._stuck(r)
            return False
        wait_idle(ready)

    def _drain(self, replica: int) -> None:
        leader = self.parallel.leader_of(replica)
        while self.world.Iprobe(source=leader, tag=_ACK_TAG):
            self.world.Recv(self._ack, source=leader, tag=_ACK_TAG)
            self._acked[replica] = int(self._ack[0])
            self._progress[replica] = time.monotonic()

    def _stuck(self, r: int) -> None:
        first, tp = self.parallel.leader_of(r), self.parallel.tensor_parallel
        ranks = f"rank {first}" if tp == 1 else f"ranks {first}-{first + tp - 1}"
        abort_job(self.world, 0, "data parallel replica %d (%s) completed none of its %d queued step(s) within %g s "
                  "(NUMA_RUNTIME_COLLECTIVE_TIMEOUT); it is stuck or dead, stopping the job."
                  % (r, ranks, self._sent[r] - self._acked[r], self.timeout))

    # ---- a leader -----------------------------------------------------------------------
    def recv_plan(self) -> StepPlan:
        """Wait (sleeping when idle) for the next plan from rank 0."""
        status = self.MPI.Status()
        wait_idle(lambda: self.world.Iprobe(source=0, tag=_PLAN_TAG, status=status))
        buf = np.empty(status.Get_count(self.MPI.INT64_T), dtype=np.int64)
        self.world.Recv(buf, source=0, tag=_PLAN_TAG)
        self._sent[0] += 1  # NOTE: on a leader, the count of plans received
        return StepPlan.from_buffer(buf)

    def send_logits(self, logits: np.ndarray) -> None:
        self.world.Send(np.ascontiguousarray(logits, dtype=np.float32), dest=0, tag=_LOGITS_TAG)

    def acknowledge(self) -> None:
        """The plan received last has run (its logits rows, if any, sent before)."""
        self._ack[0] = self._sent[0]
        self.world.Send(self._ack, dest=0, tag=_ACK_TAG)


def setup(world, engine_cfg: EngineConfig, model_cfg: ModelConfig):
    """Every rank: (ParallelConfig, the communicator of this rank's replica group, the
    ReplicaLink or None without replicas). Rank 0 logs the choice and its reason."""
    asked, asked_as = asked_replicas(engine_cfg.data_parallel)
    parallel = ParallelConfig.resolve(world.world_size, asked, model_cfg.num_heads,
                                      engine_cfg.max_num_seqs, asked_as)
    if world.rank == 0 and world.world_size > 1:
        log.info("parallel: %d replica(s) x %d tensor-parallel rank(s) (%s)", parallel.data_parallel,
                 parallel.tensor_parallel, parallel.reason)
    if parallel.data_parallel == 1:
        return parallel, world, None
    if env.profile_enabled():
        why = ("" if parallel.reason == "asked for" else
               f" (the ranks run {parallel.data_parallel} replicas because {parallel.reason}: run it on fewer ranks)")
        raise ValueError(f"Operator profiling (AS_PROFILE=ON or AS_PROFILE_TRACE) profiles one tensor-parallel "
                         f"model; run it without data parallel replicas{why}.")
    from mpi4py import MPI
    replica = parallel.replica_of(world.rank)
    group = world.comm.Split(color=replica, key=world.rank)
    first = parallel.leader_of(replica)
    tp = SingleProcessComm() if parallel.tensor_parallel == 1 else MPIComm(
        MPI, comm=group, world_ranks=range(first, first + parallel.tensor_parallel))
    # NOTE: the KV budget splits the host's memory among all its ranks, not the group's
    tp.local_size = world.local_size
    return parallel, tp, ReplicaLink(MPI, world.comm, parallel)


def close_group(tp) -> None:
    """Collective over a replica group: frees what setup() made for it (its shared-memory window,
    host communicator and the group communicator); a no-op for the world's own communicator."""
    if isinstance(tp, MPIComm):
        tp.close()
        tp.comm.Free()


def worker_loop(runner, link: ReplicaLink | None) -> None:
    """Every rank but 0: execute plans until rank 0 shuts down (a replica's leader takes them
    from rank 0, the other ranks from their leader)."""
    if link is not None and runner.comm.rank == 0:
        serve_replica(runner, link)
    else:
        runner.worker_loop()


def replica_blocks(parallel: ParallelConfig, ranks: list[dict]) -> list[int]:
    """KV blocks of each replica's pool, from the per-rank reports: the fewest any of its ranks
    holds (each rank sizes its pool from its own host's memory, cgroup or ulimit -v; a block
    index past a rank's pool would fail there mid-run). A rank with more logs what goes unused."""
    out = []
    for r in range(parallel.data_parallel):
        first = parallel.leader_of(r)
        counts = [ranks[first + j]["kv_blocks"] for j in range(parallel.tensor_parallel)]
        out.append(min(counts))
        for j, n in enumerate(counts):
            if n > out[-1]:
                log.info("rank %d holds %d KV blocks but uses %d, as many as the smallest pool of its "
                         "replica's ranks (their KV heads or memory limits differ)", first + j, n, out[-1])
    return out


def driver_runner(runner, link: ReplicaLink | None, vocab_size: int):
    """Rank 0's runner: its own replica's, or a DataParallelRunner over every replica."""
    return runner if link is None else DataParallelRunner(runner, link, vocab_size)


class DataParallelRunner:
    """Rank 0's runner under DP: executes the list of plans of a ReplicaOutputs, replica 0's
    locally, the others through their leaders; returns the logits rows in replica order."""

    def __init__(self, local, link: ReplicaLink, vocab_size: int):
        self.local, self.link, self.vocab_size = local, link, vocab_size

    # replica 0's model, communicator and KV pool (every rank's pool: engine.ranks)
    @property
    def model(self):
        return self.local.model

    @property
    def comm(self):
        return self.local.comm

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.local.bytes_per_block

    @property
    def kv_cache_bytes(self) -> int:
        return self.local.kv_cache_bytes

    def execute(self, plans: list[StepPlan]) -> np.ndarray:
        parts = [None] * len(plans)
        pending = []
        for r in range(1, len(plans)):
            if plans[r].num_tokens == 0:  # nothing to run there: no message at all
                parts[r] = np.zeros((0, self.vocab_size), np.float32)
                continue
            parts[r] = np.empty((len(plans[r].logits_indices), self.vocab_size), np.float32)
            if len(parts[r]):
                pending.append(self.link.post_logits(r, parts[r]))
            self.link.send_plan(r, plans[r])
        parts[0] = self.local.execute(plans[0])
        self.link.finish_sends()
        self.link.wait(pending)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def shutdown_workers(self) -> None:
        for r in range(1, self.link.parallel.data_parallel):
            self.link.send_plan(r, StepPlan.shutdown())
        self.link.finish_sends()
        self.local.shutdown_workers()
        self.link.wait_acknowledged()  # NOTE: every replica has left its loop: the close's gather is timed

    def release(self) -> None:
        self.local.release()


def serve_replica(runner, link: ReplicaLink) -> None:
    """The loop of the leader of replica r >= 1: run rank 0's plans on its group, send back the
    logits rows, until a shutdown plan."""
    while True:
        plan = link.recv_plan()
        if plan.kind == SHUTDOWN:
            runner.shutdown_workers()
            link.acknowledge()
            return
        logits = runner.execute(plan)
        if len(plan.logits_indices):
            link.send_logits(logits)
        link.acknowledge()
