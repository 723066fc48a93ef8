"""Which cached-but-unused KV block to give up when the free pool runs dry.

The BlockManager owns reference counts and the hash -> block map; a policy only orders the
*evictable* blocks (cached, refcount 0) and sees these events:

    cached(b, cont)   b was just filled and cached; `cont` says the request that filled it
                      continues a mostly cached sequence (a later conversation turn)
    uncached(b)       b is no longer cached (never computed, or its contents were wrong)
    touch(b)          cached block b was reused by a new request (a prefix-cache hit)
    add_evictable(b)  b's refcount fell to 0; it stays cached and may be evicted
    remove(b)         b is in use again (refcount 0 -> 1); it must not be evicted
    pop_victim()      choose, forget and return the next block to evict

The BlockManager releases a request's blocks last-to-first, so within one request the tail of
the hash chain (a leaf) is released, and evicted, before the blocks it depends on.
"""
from __future__ import annotations

from collections import OrderedDict


class EvictionPolicy:
    """Orders evictable block ids. `len(policy)` is the number of evictable blocks."""

    name = "base"

    def cached(self, block_id: int, continuation: bool) -> None:
        pass

    def uncached(self, block_id: int) -> None:
        pass

    def touch(self, block_id: int) -> None:
        raise NotImplementedError

    def add_evictable(self, block_id: int) -> None:
        raise NotImplementedError

    def remove(self, block_id: int) -> None:
        raise NotImplementedError

    def pop_victim(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, block_id: int) -> bool:
        raise NotImplementedError


class LRUEviction(EvictionPolicy):
    """Evict the block released longest ago (vLLM v1's free-queue order). Hits do not matter:
    only the moment a block was last released does."""

    name = "lru"

    def __init__(self, num_blocks: int):
        self._queue: OrderedDict[int, None] = OrderedDict()  # oldest release first

    def touch(self, block_id: int) -> None:
        pass

    def add_evictable(self, block_id: int) -> None:
        self._queue[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]

    def pop_victim(self) -> int:
        return self._queue.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue


class ReuseAwareEviction(EvictionPolicy):
    """Segmented LRU (2Q-like): blocks never reused are evicted before blocks that were.

    Why: on mixed traffic a stream of one-off requests releases far more blocks than the
    multi-turn conversations that actually come back. Under plain LRU every one-off pushes a
    conversation's prefix one step closer to eviction, and once the one-offs between two turns
    of a conversation outnumber the cache, LRU's hit rate falls to ~0. A one-off block is never
    hit again, so "has this block been hit since it was cached?" separates the two populations
    with no tuning and O(1) work per event. One refinement: the blocks a conversation adds in
    turn k (its answer, the next user text) have not been hit yet when one-offs push on them,
    yet they are the prefix of turn k + 1. A request whose prompt was at least half served by
    the cache is such a continuation, so the blocks it fills start out marked as hit
    (`cached(b, continuation=True)`). One-offs behind a shared system prompt stay below half.


    - probation: evictable blocks with no hit since they were cached, in release order
      (evicted first; within it, LRU, so leaves of a chain go before their parents);
    - protected: evictable blocks hit at least once, in release order.

    NOTE: protected is capped at `protected_fraction` of the pool. When it grows past the cap
    its oldest block is demoted to the newest end of probation (its hit mark cleared), so a
    finished conversation ages out instead of pinning the cache forever (the aging LFU needs).
    ARC would adapt the split; a fixed one is simpler: on bench/bench_prefix_cache.py 0.75 and
    0.9 tie and 0.5 loses a few points of hit rate.
    """

    name = "reuse"

    def __init__(self, num_blocks: int, protected_fraction: float = 0.75):
        if not 0.0 < protected_fraction < 1.0:
            raise ValueError(f"protected_fraction must be in (0, 1), got {protected_fraction!r}.")
        self._protected_cap = max(1, int(num_blocks * protected_fraction))
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        self._hit: set[int] = set()  # cached blocks hit since they were cached (in use or not)

    def cached(self, block_id: int, continuation: bool) -> None:
        if continuation:
            self._hit.add(block_id)

    def uncached(self, block_id: int) -> None:
        self._hit.discard(block_id)

    def touch(self, block_id: int) -> None:
        self._hit.add(block_id)

    def add_evictable(self, block_id: int) -> None:
        if block_id in self._hit:
            self._protected[block_id] = None
            if len(self._protected) > self._protected_cap:
                old, _ = self._protected.popitem(last=False)
                self._hit.discard(old)
                self._probation[old] = None
        else:
            self._probation[block_id] = None

    def remove(self, block_id: int) -> None:
        if block_id in self._probation:
            del self._probation[block_id]
        else:
            del self._protected[block_id]

    def pop_victim(self) -> int:
        queue = self._probation if self._probation else self._protected
        block_id = queue.popitem(last=False)[0]
        self._hit.discard(block_id)
        return block_id

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._probation or block_id in self._protected


POLICIES = {"lru": LRUEviction, "reuse": ReuseAwareEviction}


def make_eviction_policy(name: str, num_blocks: int) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"Unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}.")
    return POLICIES[name](num_blocks)
