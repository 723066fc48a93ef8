"""BlockManager: the paged KV cache's bookkeeping (block ids, refcounts, prefix cache).

Plain Python over integers: no model, no arrays. A block holds `block_size` consecutive
tokens of one sequence; a request's blocks are `req.block_ids` (its block table).

Prefix caching: a full block is registered under a chained hash of (parent block's hash, its
token ids), so the same prefix maps to the same hash whatever request produced it (prompt or
generated tokens alike). A later request whose leading blocks hash the same reuses them
(refcount + 1) instead of recomputing. The scheduler registers the full blocks of the tokens a
step will compute when it schedules them (as vLLM v1's allocate_slots), so that a request
admitted later in the same step reuses them too: the model writes every row's KV of a layer
before any row's attention of that layer reads it. Such a block is *uncomputed* until the step
ran (commit_computed); if it never runs, uncache_uncomputed takes the blocks out again, and an
uncomputed block is never evictable nor saved to a tier. A cached block whose refcount drops to
0 keeps its contents and its hash and becomes *evictable*; an eviction policy (eviction.py)
decides which one to reuse when no never-cached block is free.

An optional lower tier (kv_cache/tier.py, e.g. disk_tier.DiskTier) sees every evicted cached
block (`offload`) and is asked on a miss (`lookup`); a hit is loaded into a pool block, which
then is an ordinary cached block.

When every layer slides a window (`sliding_window` > 0), a hit needs only the blocks holding the
window before it (as vLLM's SlidingWindowManager): the blocks before those are RELEASED in the
request's table. Hashes are chained, so a block's hash stands for its whole prefix even when
the blocks before it were evicted.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import deque
from typing import NamedTuple, Sequence

from ..recorder import ALLOC, NULL_RECORDER
from ..request import Request
from .eviction import EvictionPolicy, make_eviction_policy
from .host_tier import HostKVTier
from .tier import KVTier


RELEASED = -1  # a block-table entry whose block was released (outside every sliding window)


class HostHit(NamedTuple):
    """A prefix-cache hit in the host tier: get_computed_blocks lists it where a block id
    would be; allocate copies it back into a fresh device block."""
    block_hash: int


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Stable 128-bit chained hash of one full block (same value in every process)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"\0" * 16 if parent_hash is None else parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    """Owns `num_blocks` KV blocks. Every block is in exactly one state:

    free       refcount 0, no hash                    (self.free_block_ids)
    evictable  refcount 0, hash kept, contents valid  (in the eviction policy)
    in use     refcount >= 1                          (in some req.block_ids)
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 eviction: str | EvictionPolicy = "lru", recorder=NULL_RECORDER,
                 host_tier: HostKVTier | None = None, tier: KVTier | None = None, sliding_window: int = 0):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}.")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")
        if not isinstance(sliding_window, int) or sliding_window < 0:
            raise ValueError(f"sliding_window must be a non-negative integer, got {sliding_window!r}.")
        self.num_blocks = num_blocks
        # > 0: every layer's window (the query at position p sees keys p - window + 1 .. p)
        self.sliding_window = sliding_window
        self.recorder = recorder  # times allocate / free / get_computed_blocks (AS_PROFILE=ON)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tier = tier if enable_prefix_caching else None
        self.policy = (eviction if isinstance(eviction, EvictionPolicy)
                       else make_eviction_policy(eviction, num_blocks))
        self.host_tier = host_tier  # evicted cached blocks go there (None: they are dropped)
        self.ref_cnt = [0] * num_blocks                          # [num_blocks]
        self.block_hash: list[int | None] = [None] * num_blocks  # [num_blocks]
        self.hash_to_block: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self._num_hashed: dict[str, int] = {}  # request_id -> its leading blocks already cached
        # blocks registered ahead of their KV (the step that computes them has not run yet): block id
        # -> the request computing it; and per such request its _num_hashed before them
        self._uncomputed: dict[int, str] = {}
        self._hashed_before: dict[str, int] = {}
        # blocks the scheduler leaves free when it admits a request, per owner (reserve()): a scratch
        # forward (an embedding, prompt_logprobs) waiting for room would otherwise see every block
        # that a finished request frees taken by the next admission, for as long as requests arrive
        self._reservations: dict[str, int] = {}
        self._num_released: dict[str, int] = {}  # request_id -> its leading blocks released
        # prefix-cache counters, counted once per admission of a request (not per retry)
        self.query_tokens = self.hit_tokens = 0
        self.lookups_total = self.hits_total = 0  # the same, never taken back (Prometheus counters)
        self.query_blocks = self.hit_blocks = 0
        self.num_evictions = 0
        self.tier_hit_blocks = 0  # blocks of hits that came back from the tier

    # ---- sizes ---------------------------------------------------------------------------
    def reserve(self, owner: str, num_blocks: int) -> None:
        """Keep `num_blocks` free of new admissions for `owner`'s waiting work (0: release). The
        owners' reservations add up: each waits for its own blocks."""
        if num_blocks > 0:
            self._reservations[owner] = num_blocks
        else:
            self._reservations.pop(owner, None)

    @property
    def reserved_blocks(self) -> int:
        """Blocks that new admissions leave free (the sum of every owner's reservation)."""
        return sum(self._reservations.values())

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones plus evictable cached ones."""
        return len(self.free_block_ids) + len(self.policy)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by some request (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def miss_tokens(self) -> int:
        return self.query_tokens - self.hit_tokens

    @property
    def miss_blocks(self) -> int:
        return self.query_blocks - self.hit_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache lookup ---------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Cached blocks matching the leading full blocks of a request that holds no blocks,
        and how many tokens they cover. Never the whole sequence: the last token is always
        left to compute so that the step has its logits to sample from. With a host tier, a
        block held there counts (as a HostHit) where copying it back beats recomputing it.
        With a sliding window, the leading entries may be RELEASED (_window_hit)."""
        with self.recorder.span(ALLOC, "get_computed_blocks"):
            if not self.enable_prefix_caching or req.block_ids:
                return [], 0
            max_blocks = (req.num_tokens - 1) // self.block_size
            hashes = self._block_hashes(req, max_blocks)[:max_blocks]
            if self.sliding_window:
                blocks = self._window_hit(hashes)
                return blocks, len(blocks) * self.block_size
            blocks: list = []
            host = self.host_tier
            for i, h in enumerate(hashes):
                block_id = self.hash_to_block.get(h)
                if block_id is not None:
                    blocks.append(block_id)
                elif host is not None and host.lookup(h) is not None and host.worth_copying(i, self.block_size):
                    blocks.append(HostHit(h))
                else:
                    break
            # a disk tier continues the chain where memory (and the host tier) stopped
            if self.tier is not None and len(blocks) < len(hashes) and self.tier.lookup(hashes[len(blocks)]):
                blocks += self._load_from_tier(hashes[len(blocks):], [b for b in blocks if isinstance(b, int)])
            return blocks, len(blocks) * self.block_size

    def _window_hit(self, hashes: list[int]) -> list:
        """Every layer slides: the longest hit (its first `end` blocks) whose blocks holding the
        window before it, keys end * block_size - sliding_window + 1 .. end * block_size - 1 (what
        the request's first computed query reads; later queries read less of them), are cached in
        memory, the host tier or the disk tier. The blocks before those are RELEASED: no query of
        the request reads them. Blocks of the window that only the disk tier holds are loaded."""
        bs, host = self.block_size, self.host_tier
        # NOTE: at least one block (as vLLM): a window of 1 reads no cached key, yet a hit still
        # ends where a cached block does
        need = max(1, -(-(self.sliding_window - 1) // bs))
        for use_tier in (self.tier is not None, False):
            end = run = 0
            for i in range(len(hashes) - 1, -1, -1):  # NOTE: the last blocks first: the longest hit
                h = hashes[i]
                if (h in self.hash_to_block
                        or host is not None and host.lookup(h) is not None and host.worth_copying(i, bs)
                        or use_tier and self.tier.lookup(h)):
                    run += 1
                    if run == need:
                        end = i + need
                        break
                else:
                    run = 0
            else:
                end = run  # NOTE: the hit starts at block 0, and the window before it reaches back there
            start = max(0, end - need)
            blocks: list = [RELEASED] * start
            for i in range(start, end):
                h = hashes[i]
                block_id = self.hash_to_block.get(h)
                if block_id is not None:
                    blocks.append(block_id)
                elif host is not None and host.lookup(h) is not None and host.worth_copying(i, bs):
                    blocks.append(HostHit(h))
                else:
                    break
            if len(blocks) < end:  # the disk tier holds the rest of the window
                rest = hashes[len(blocks):end]
                held = [b for b in blocks if isinstance(b, int) and b != RELEASED]
                held += [self.hash_to_block[h] for h in rest if h in self.hash_to_block]
                blocks += self._load_from_tier(rest, held)
                if len(blocks) < end:
                    # NOTE: a load fell short (no room, or a full tier dropped the block): the
                    # blocks before it are not the window of a shorter hit; look again in memory
                    continue
            return blocks
        raise AssertionError("a lookup without the disk tier finds every block it counted")

    def _load_from_tier(self, hashes: list[int], chain: list[int]) -> list[int]:
        """Continue the chain of hits with the leading `hashes` that memory or the tier holds:
        tier blocks are loaded into pool blocks (cached, evictable). Never evicts a block of
        `chain` (the hits found so far, and any other block to keep) or of the continuation."""
        pinned = dict.fromkeys(b for b in chain if self.ref_cnt[b] == 0)
        for b in pinned:  # NOTE: out of the policy while we take blocks, so none is a victim
            self.policy.remove(b)
        found, num_loaded = [], 0
        try:
            for h in hashes:
                block_id = self.hash_to_block.get(h)
                if block_id is not None:  # NOTE: still in memory (an earlier block was evicted
                    # first): a hit, not a second copy
                    if self.ref_cnt[block_id] == 0 and block_id not in pinned:
                        self.policy.remove(block_id)
                        pinned[block_id] = None
                    found.append(block_id)
                    continue
                if not self.tier.lookup(h) or not (self.free_block_ids or len(self.policy)):
                    break
                block_id = self._take_block()
                if not self.tier.lookup(h):  # NOTE: a full tier made room for the evicted block
                    self.free_block_ids.appendleft(block_id)  # by dropping this one
                    break
                self.tier.load(h, block_id)
                self.block_hash[block_id] = h
                self.hash_to_block[h] = block_id
                self.policy.cached(block_id, False)
                pinned[block_id] = None
                found.append(block_id)
                num_loaded += 1
        finally:
            for b in pinned:
                self.policy.add_evictable(b)
        self.tier_hit_blocks += num_loaded
        return found

    # ---- allocation ----------------------------------------------------------------------
    def _num_new_blocks(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int]) -> int:
        num_computed = len(computed_blocks) * self.block_size if computed_blocks else req.num_computed_tokens
        have = len(req.block_ids) + len(computed_blocks)
        return max(0, self.num_blocks_for(num_computed + num_new_tokens) - have)

    def can_allocate(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = (),
                     reserve: int = 0) -> bool:
        """Whether `allocate(req, num_new_tokens, computed_blocks)` would succeed now and leave
        `reserve` blocks free."""
        # NOTE: an evictable block we are about to reuse as a hit stops being free; a host
        # hit needs a fresh block to be copied into; a RELEASED one takes none.
        num_host_hits = sum(1 for b in computed_blocks if isinstance(b, HostHit))
        num_evictable_hits = sum(1 for b in computed_blocks
                                 if not isinstance(b, HostHit) and b != RELEASED and self.ref_cnt[b] == 0)
        return (self._num_new_blocks(req, num_new_tokens, computed_blocks) + num_host_hits
                <= self.num_free_blocks - num_evictable_hits - reserve)

    def allocate(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> None:
        """Give `req` blocks for num_computed_tokens + num_new_tokens tokens.

        For a request that holds no blocks yet (admission), `computed_blocks` from
        get_computed_blocks are attached first and their tokens become computed: this sets
        req.num_computed_tokens and req.num_cached_tokens.
        """
        with self.recorder.span(ALLOC, "allocate"):
            if not self.can_allocate(req, num_new_tokens, computed_blocks):
                raise RuntimeError(f"KV cache over-committed by {req.request_id!r}; "
                                   "call can_allocate first.")
            num_new = self._num_new_blocks(req, num_new_tokens, computed_blocks)
            if not req.block_ids:  # admission: count the prefix-cache query once
                assert not computed_blocks or req.num_computed_tokens == 0
                num_cached = len(computed_blocks) * self.block_size
                # NOTE: as vLLM, a preempted request's re-admission (finding its own blocks again) is
                # neither a prefix-cache query nor a change of its num_cached_tokens (prompt tokens
                # the cache served when it first ran)
                if not req.prefix_counted:
                    self._count_lookup(req, num_cached, len(computed_blocks), 1)
                    req.num_cached_tokens, req.prefix_counted = num_cached, True
                self._attach_hits(req, computed_blocks)
                self._num_hashed[req.request_id] = len(computed_blocks)
                num_released = list(computed_blocks).count(RELEASED)
                if num_released:  # NOTE: release_before goes on after them
                    self._num_released[req.request_id] = num_released
                if computed_blocks:
                    req.num_computed_tokens = num_cached
            for _ in range(num_new):
                block_id = self._take_block()
                self.ref_cnt[block_id] = 1
                req.block_ids.append(block_id)

    def _count_lookup(self, req: Request, num_cached: int, num_hit_blocks: int, sign: int) -> None:
        self.query_tokens += sign * req.num_tokens
        self.hit_tokens += sign * num_cached
        if sign > 0:  # NOTE: /metrics' counters only grow (uncount takes back the rates' lookups, not these)
            self.lookups_total += req.num_tokens
            self.hits_total += num_cached
        self.query_blocks += sign * ((req.num_tokens - 1) // self.block_size if self.enable_prefix_caching else 0)
        self.hit_blocks += sign * num_hit_blocks

    def uncount(self, req: Request) -> None:
        """Take back `req`'s prefix-cache lookup (its step never ran: it is admitted anew)."""
        if req.prefix_counted:
            self._count_lookup(req, req.num_cached_tokens, req.num_cached_tokens // self.block_size, -1)
            req.num_cached_tokens, req.prefix_counted = 0, False

    def _attach_hits(self, req: Request, computed_blocks: Sequence) -> None:
        """Append the hits to req.block_ids in order; host hits are copied back into fresh blocks;
        RELEASED entries (before a sliding window) stay RELEASED."""
        slots = [self.host_tier.take(b.block_hash) if isinstance(b, HostHit) else None for b in computed_blocks]
        for b in computed_blocks:  # NOTE: pin the device hits before any eviction below
            if not isinstance(b, HostHit) and b != RELEASED:
                if self.ref_cnt[b] == 0:
                    self.policy.remove(b)
                self.ref_cnt[b] += 1
        for b, slot in zip(computed_blocks, slots):
            if b == RELEASED:
                req.block_ids.append(RELEASED)
                continue
            if isinstance(b, HostHit):
                block_id = self._take_block()
                self.ref_cnt[block_id] = 1
                self.block_hash[block_id] = b.block_hash
                self.hash_to_block[b.block_hash] = block_id
                self.policy.cached(block_id, True)
                self.host_tier.copy_back(slot, block_id)
                b = block_id
            self.policy.touch(b)
            req.block_ids.append(b)

    def _take_block(self) -> int:
        if self.free_block_ids:
            return self.free_block_ids.popleft()
        block_id = self.policy.pop_victim()
        h = self.block_hash[block_id]
        if self.host_tier is not None:
            self.host_tier.on_evict(block_id, h)
        del self.hash_to_block[h]
        self.block_hash[block_id] = None
        self.num_evictions += 1
        if self.tier is not None:
            self.tier.offload(block_id, h)
        return block_id

    def uncache(self, block_hash: int, tier: bool = True) -> None:
        """Forget a cached block (its contents are wrong: its tier copy failed a check; or the
        cache is reset): it is no longer a hit; if unused it returns to the free pool; the tier
        drops it too, unless not `tier`."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is not None:
            self._uncomputed.pop(block_id, None)
            self._unregister(block_id)
            if self.ref_cnt[block_id] == 0:
                self.policy.remove(block_id)
                self.free_block_ids.append(block_id)
        if self.tier is not None and tier:
            self.tier.drop(block_hash)

    def offload_all(self) -> None:
        """Hand every cached block to the tier (at shutdown, so that a restart finds them): the
        last cached first, so that the heads of the chains (cached before their tails, and shared
        prefixes earliest) are the tier's newest and outlive its cap. A lookup walks a chain from
        its head: tails kept without their heads were never hit (heads first, a cap below the
        pool kept only unreachable tails). Past the tier's cap only the heads are written."""
        if self.tier is None:
            return
        # NOTE: its KV is not written (a step that failed)
        blocks = [(h, b) for h, b in self.hash_to_block.items() if b not in self._uncomputed]
        cap = getattr(self.tier, "capacity_blocks", None)
        if cap is not None:
            blocks = blocks[:cap]
        for h, block_id in reversed(blocks):
            self.tier.offload(block_id, h)

    def take_blocks(self, n: int) -> list[int] | None:
        """n blocks outside any request (scratch KV for an embedding), or None if there is no
        room now. Give them back with return_blocks."""
        if n > self.num_free_blocks:
            return None
        return [self._take_block() for _ in range(n)]

    def return_blocks(self, block_ids: list[int]) -> None:
        self.free_block_ids.extend(block_ids)

    def free(self, req: Request) -> None:
        """Release all of req's blocks. Tail first, so that under an LRU-ordered policy the
        leaves of a hash chain are evicted before the blocks they extend."""
        with self.recorder.span(ALLOC, "free"):
            for block_id in reversed(req.block_ids):
                if block_id != RELEASED:
                    self._unref(block_id)
            req.block_ids = []
            self._num_hashed.pop(req.request_id, None)
            self._num_released.pop(req.request_id, None)

    def _unref(self, block_id: int) -> None:
        """Drop one reference to block_id; at 0 a cached block becomes evictable, any other free."""
        self.ref_cnt[block_id] -= 1
        assert self.ref_cnt[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_cnt[block_id] == 0:
            if block_id in self._uncomputed:  # NOTE: its KV was never written: no later hit may read it
                del self._uncomputed[block_id]
                self._unregister(block_id)
            if self.block_hash[block_id] is not None:
                self.policy.add_evictable(block_id)
            else:
                self.free_block_ids.append(block_id)

    def release_before(self, req: Request, num_tokens: int) -> None:
        """Release req's blocks that hold only tokens before `num_tokens` (tokens no later
        query can see: they left every layer's sliding window). Their slots in req.block_ids
        become RELEASED; a cached block stays in the prefix cache as evictable."""
        start = self._num_released.get(req.request_id, 0)
        end = min(max(num_tokens, 0) // self.block_size, len(req.block_ids))
        for i in range(start, end):
            block_id, req.block_ids[i] = req.block_ids[i], RELEASED
            self._unref(block_id)
        if end > start:
            self._num_released[req.request_id] = end

    # ---- caching -------------------------------------------------------------------------
    def cache_full_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """Register req's full blocks (prompt or generated tokens) of its first `num_tokens`
        tokens, by default its computed ones (call after req.num_computed_tokens advanced).
        The scheduler passes the tokens a step is to compute: blocks beyond the computed ones
        are registered ahead of their KV, *uncomputed* until commit_computed (the step ran)."""
        if not self.enable_prefix_caching:
            return
        bs, computed = self.block_size, req.num_computed_tokens
        num_full = min((computed if num_tokens is None else num_tokens) // bs, len(req.block_ids))
        start = self._num_hashed.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_full)
        continuation = 2 * req.num_cached_tokens >= req.num_prompt_tokens
        for i in range(start, num_full):
            block_id, h = req.block_ids[i], hashes[i]
            # NOTE: if another request computed (or computes in this step) the same block first,
            # keep its copy as the cached one; ours stays unhashed and returns to the free pool
            # when released.
            if self.block_hash[block_id] is None and h not in self.hash_to_block:
                self.block_hash[block_id] = h
                self.hash_to_block[h] = block_id
                self.policy.cached(block_id, continuation)
                if (i + 1) * bs > computed:
                    self._uncomputed[block_id] = req.request_id
                    self._hashed_before.setdefault(req.request_id, i)
        self._num_hashed[req.request_id] = num_full

    @property
    def num_uncomputed(self) -> int:
        """Blocks registered ahead of their KV (by the step scheduled last, until it ran)."""
        return len(self._uncomputed)

    def commit_computed(self) -> None:
        """The step scheduled last ran: the blocks registered ahead of it hold their KV now."""
        self._uncomputed.clear()
        self._hashed_before.clear()

    def uncache_uncomputed(self) -> set[int]:
        """The step scheduled last did not run: the blocks registered ahead of its KV leave the
        prefix cache (the requests computing them register them again when they do). Returns
        their ids: a request that took one as a prefix hit has to start over (the scheduler's
        drop_uncomputed). A tier keeps its own copy of such a hash (it is valid there)."""
        gone = set(self._uncomputed)
        for block_id in gone:  # NOTE: each is in use (_unref took out those it freed)
            self._unregister(block_id)
        for request_id, num in self._hashed_before.items():
            if request_id in self._num_hashed:
                self._num_hashed[request_id] = min(self._num_hashed[request_id], num)
        self.commit_computed()
        return gone

    def _unregister(self, block_id: int) -> None:
        """block_id is no longer a cached block (its refcount and its place in the pool stay)."""
        h = self.block_hash[block_id]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hash[block_id] = None
            self.policy.uncached(block_id)

    def _block_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """req.block_hashes extended to at least `num_blocks` full blocks (tokens of a full
        block never change, so the hashes survive preemption)."""
        hashes, bs = req.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            tokens = req.all_token_ids
            for i in range(len(hashes), num_blocks):
                hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes
