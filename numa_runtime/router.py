"""Data-parallel routing on rank 0: N replicas' schedulers behind the one the engine steps.

Each replica has its own Scheduler and BlockManager (its own KV pool on its own ranks). A new
request goes to the replica that already caches the longest prefix of it (a conversation's
next turn finds its earlier turns there) when that replica has room and the prefix outweighs
its extra load (PREFIX_TOKENS_PER_SEQUENCE), else to the least loaded replica. `schedule()`
returns one output holding every replica's plan; the engine samples all of them together, in
replica order. Plain Python over integers: no model, no MPI.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request, RequestStatus
from .scheduler import Scheduler, SchedulerOutput


PREFIX_TOKENS_PER_SEQUENCE = 128  # route: cached tokens that outweigh one more sequence on a replica


@dataclass
class ReplicaOutputs:
    """One step of every replica. `plan` is the list of plans (replica r's at index r);
    `sampling` concatenates the replicas' sampling lists in replica order (the logits rows)."""

    outputs: list[SchedulerOutput]
    plan: list = field(init=False)
    scheduled: list[Request] = field(init=False)
    sampling: list[Request] = field(init=False)
    preempted: list[Request] = field(init=False)

    def __post_init__(self):
        self.plan = [o.plan for o in self.outputs]
        self.scheduled = [r for o in self.outputs for r in o.scheduled]
        self.sampling = [r for o in self.outputs for r in o.sampling]
        self.preempted = [r for o in self.outputs for r in o.preempted]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class ReplicaRouter:
    """The Scheduler interface the engine uses, over one Scheduler per replica."""

    def __init__(self, replicas: list[Scheduler]):
        self.replicas = replicas
        self.where: dict[str, int] = {}  # request id -> replica, while unfinished
        self.routed = [0] * len(replicas)
        self.routed_by_prefix = 0

    # ---- routing -------------------------------------------------------------------------
    def load(self, r: int) -> int:
        """Sequences on replica r (running + waiting)."""
        s = self.replicas[r]
        return s.num_running + s.num_waiting

    def has_room(self, r: int, req: Request, hits: list, num_cached: int) -> bool:
        """Replica r can take req now: a free sequence slot and free blocks for its uncached part
        beside its prefix hits (`hits`, `num_cached` tokens; evictable hits it pins are no longer
        free: counting them let a next turn wait on a full replica while another was idle)."""
        s = self.replicas[r]
        bm = s.block_manager
        return (self.load(r) < s.config.max_num_seqs
                and bm.can_allocate(req, req.num_tokens - num_cached, hits, bm.reserved_blocks))

    def tokens(self, r: int) -> int:
        """Tokens of the unfinished requests on replica r (what their KV will hold)."""
        return sum(q.num_tokens for q in self.replicas[r].requests.values())

    def route(self, req: Request) -> int:
        """The replica for a new request: the longest cached prefix where there is room, else
        the least loaded: fewest sequences, then fewest tokens (long prompts used to pile up on
        the lowest index), then the lowest index; a replica whose blocks a waiting embedding
        reserved (it admits nothing new until the embedding runs) comes last."""
        loads = [self.load(r) for r in range(len(self.replicas))]
        held = [self.replicas[r].block_manager.reserved_blocks > 0 for r in range(len(loads))]
        least = min(range(len(loads)), key=lambda r: (held[r], loads[r], self.tokens(r), r))
        found = [s.block_manager.get_computed_blocks(req) for s in self.replicas]
        cached = [len(hits) for hits, _ in found]
        best = max(range(len(cached)), key=lambda r: (cached[r], -loads[r]))
        # NOTE: a cached prefix is worth PREFIX_TOKENS_PER_SEQUENCE tokens of prefill for each
        # sequence the replica runs beyond the least loaded one: a conversation's earlier turns
        # keep it where they are, a shared system prompt of a block or two does not pile every
        # chat onto one replica while the others idle (SGLang's cache-aware routing balances too)
        saved = (cached[best] - cached[least]) * self.replicas[best].block_manager.block_size
        gap = loads[best] - loads[least]
        if (cached[best] > cached[least] and saved >= PREFIX_TOKENS_PER_SEQUENCE * gap
                and self.has_room(best, req, *found[best])):
            self.routed_by_prefix += 1
            return best
        return least

    # ---- the Scheduler interface ---------------------------------------------------------
    @property
    def requests(self):
        """Every replica's unfinished requests by id (a Scheduler's `requests`)."""
        from collections import ChainMap
        return ChainMap(*(s.requests for s in self.replicas))

    def add_request(self, req: Request) -> None:
        if req.request_id in self.where:  # NOTE: each replica knows only its own ids
            raise ValueError(f"Request id {req.request_id!r} is already in use; give each request a unique id.")
        r = self.route(req)
        self.replicas[r].add_request(req)  # raises ValueError if it can never fit
        self.where[req.request_id] = r
        self.routed[r] += 1

    def abort_request(self, request_id: str) -> bool:
        r = self.where.pop(request_id, None)
        return r is not None and self.replicas[r].abort_request(request_id)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        r = self.where.pop(req.request_id, None)
        if r is not None:
            self.replicas[r].finish_request(req, status)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.replicas)

    def schedule(self) -> ReplicaOutputs:
        return ReplicaOutputs([s.schedule() for s in self.replicas])

    def drop_uncomputed(self) -> None:
        for s in self.replicas:
            s.drop_uncomputed()

    def update(self, out: ReplicaOutputs, sampled_token_ids) -> None:
        start = 0
        for s, o in zip(self.replicas, out.outputs):
            s.update(o, sampled_token_ids[start:start + len(o.sampling)])
            start += len(o.sampling)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.replicas)

    @property
    def memory_bound(self) -> bool:
        return any(s.memory_bound for s in self.replicas)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.replicas)

    @property
    def block_manager(self) -> "PooledBlocks":
        return PooledBlocks([s.block_manager for s in self.replicas])

    def stats(self) -> dict:
        per = [s.stats() for s in self.replicas]
        total = {k: sum(p[k] for p in per) for k in per[0] if k not in ("kv_usage", "prefix_cache_hit_rate")}
        pool = self.block_manager
        total.update(kv_usage=pool.usage, prefix_cache_hit_rate=pool.hit_rate,
                     routed=list(self.routed), routed_by_prefix=self.routed_by_prefix, replicas=per)
        return total


class PooledBlocks:
    """Read-only totals over the replicas' block managers (for metrics and logs)."""

    def __init__(self, managers: list):
        self.managers = managers

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_tokens(self) -> int:
        return sum(m.hit_tokens for m in self.managers)

    @property
    def query_tokens(self) -> int:
        return sum(m.query_tokens for m in self.managers)

    @property
    def lookups_total(self) -> int:
        return sum(m.lookups_total for m in self.managers)

    @property
    def hits_total(self) -> int:
        return sum(m.hits_total for m in self.managers)

    @property
    def hit_rate(self) -> float:
        q = self.query_tokens
        return self.hit_tokens / q if q else 0.0
