"""BlockManager and eviction policies: exact block ids, refcounts, hit counts, eviction order."""
import pytest

from numa_runtime.kv_cache import BlockManager, LRUEviction, ReuseAwareEviction, hash_block
from numa_runtime.request import Request
from numa_runtime.sampling_params import SamplingParams

BS = 4


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def admit(bm, r):
    """What the scheduler does for a waiting request: prefix hits, then the whole rest."""
    blocks, num_cached = bm.get_computed_blocks(r)
    assert bm.can_allocate(r, r.num_tokens - num_cached, blocks)
    bm.allocate(r, r.num_tokens - num_cached, blocks)
    return blocks


def compute(bm, r):
    """The model ran: everything is computed; full blocks get cached."""
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)


def run(bm, r):
    admit(bm, r)
    compute(bm, r)
    return list(r.block_ids)


def test_allocate_and_free_exact_ids():
    bm = BlockManager(8, BS)
    a, b = req("a", range(10)), req("b", range(100, 105))
    assert bm.can_allocate(a, 10)
    bm.allocate(a, 10)
    bm.allocate(b, 5)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4]
    assert bm.ref_cnt[:6] == [1, 1, 1, 1, 1, 0]
    assert bm.num_free_blocks == 3 and bm.usage == pytest.approx(5 / 8)
    assert not bm.can_allocate(req("c", range(13)), 13)  # needs 4 blocks, 3 free
    bm.free(a)
    assert a.block_ids == [] and bm.ref_cnt[:3] == [0, 0, 0]
    # nothing was computed, so nothing cached: back to the free pool, tail first
    assert list(bm.free_block_ids) == [5, 6, 7, 2, 1, 0]


def test_allocate_grows_by_whole_blocks():
    bm = BlockManager(8, BS)
    a = req("a", range(6))
    bm.allocate(a, 4)
    assert a.block_ids == [0]
    a.num_computed_tokens = 4
    bm.allocate(a, 2)
    assert a.block_ids == [0, 1]
    a.num_computed_tokens = 6
    bm.allocate(a, 1)  # position 6 still fits in block 1
    assert a.block_ids == [0, 1]


def test_over_commit_raises():
    bm = BlockManager(2, BS)
    with pytest.raises(RuntimeError, match="over-committed"):
        bm.allocate(req("a", range(9)), 9)


def test_prefix_hit_shares_blocks_and_counts():
    bm = BlockManager(8, BS)
    a = req("a", range(10))
    assert run(bm, a) == [0, 1, 2]
    assert bm.block_hash[0] is not None and bm.block_hash[1] is not None
    assert bm.block_hash[2] is None  # partial block is never cached
    b = req("b", list(range(8)) + [50, 51, 52])
    blocks, num_cached = bm.get_computed_blocks(b)
    assert (blocks, num_cached) == ([0, 1], 8)
    bm.allocate(b, 3, blocks)
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.ref_cnt[:4] == [2, 2, 1, 1]
    assert (bm.query_tokens, bm.hit_tokens) == (10 + 11, 8)
    assert (bm.query_blocks, bm.hit_blocks) == (2 + 2, 2)
    assert (bm.miss_tokens, bm.miss_blocks) == (13, 2)


def test_the_totals_metrics_export_never_go_down():
    """uncount() takes a lookup back when its step never ran (the request is admitted anew), so the
    hit rate's numbers can fall; /metrics exported them as counters, which Prometheus then reads as
    a reset. lookups_total and hits_total keep every lookup."""
    bm = BlockManager(8, BS)
    run(bm, req("a", range(10)))
    b = req("b", list(range(8)) + [50, 51, 52])
    admit(bm, b)
    totals = (bm.lookups_total, bm.hits_total)
    assert totals == (21, 8) and (bm.query_tokens, bm.hit_tokens) == totals
    bm.uncount(b)
    assert (bm.query_tokens, bm.hit_tokens) == (10, 0) and (bm.lookups_total, bm.hits_total) == totals


def test_never_the_whole_prompt():
    bm = BlockManager(8, BS)
    run(bm, req("a", range(8)))
    b = req("b", range(8))  # identical prompt: 2 full cached blocks
    assert bm.get_computed_blocks(b) == ([0], 4)
    c = req("c", range(9))
    assert bm.get_computed_blocks(c) == ([0, 1], 8)


def test_chain_hash_depends_on_parent():
    bm = BlockManager(8, BS)
    run(bm, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # second block's tokens match but its parent does not: no hit on it
    assert bm.get_computed_blocks(req("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])) == ([], 0)
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])


def test_freed_cached_block_stays_cached_then_reused():
    bm = BlockManager(4, BS)
    a = req("a", range(9))
    run(bm, a)
    bm.free(a)
    assert bm.ref_cnt[:3] == [0, 0, 0]
    assert list(bm.free_block_ids) == [3, 2] and len(bm.policy) == 2  # 0, 1 evictable
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    b = req("b", range(10))
    assert admit(bm, b) == [0, 1]
    assert b.block_ids == [0, 1, 3] and bm.ref_cnt[:2] == [1, 1] and len(bm.policy) == 0


def test_can_allocate_counts_evictable_hits_as_taken():
    bm = BlockManager(3, BS)
    a = req("a", range(9))
    run(bm, a)
    bm.free(a)  # blocks 0, 1 evictable, block 2 free: 3 "free"
    b = req("b", range(16))  # hits [0, 1] and needs 2 more blocks: only 1 left
    blocks, num_cached = bm.get_computed_blocks(b)
    assert blocks == [0, 1]
    assert not bm.can_allocate(b, 16 - num_cached, blocks)
    assert bm.can_allocate(b, 1, blocks)  # a chunk of 1 token needs 1 block


def _head_evicted(window, num_evicted):
    """A 26-token request ran with every layer sliding `window` (6 cached blocks, ids 0-5), left
    its first 4 blocks evictable (release_before) and ended; taking blocks then evicted the head
    of its chain, `num_evicted` blocks (LRU: the released ones first), and gave them back."""
    bm = BlockManager(8, BS, sliding_window=window)
    a = req("a", range(26))
    assert run(bm, a) == list(range(7))
    bm.release_before(a, 16)
    bm.free(a)
    bm.return_blocks(bm.take_blocks(2 + num_evicted))  # the 2 free ones, then evictions
    assert sorted(bm.hash_to_block) == sorted(a.block_hashes[num_evicted:6])
    return bm


def test_sliding_window_hit_needs_only_the_blocks_of_the_window_before_it():
    """Window 9, blocks of 4: the query at 24 reads keys 16..24, so blocks 4 and 5 (16..23) are
    all a hit of 24 tokens needs; the evicted head of the chain becomes RELEASED entries (vLLM's
    null blocks) and the request computes from 24 on. It found no hit at all once block 0 was
    evicted (the walk from block 0 stopped at the first miss)."""
    from numa_runtime.kv_cache.block_manager import RELEASED
    bm = _head_evicted(window=9, num_evicted=4)
    b = req("b", range(27))
    blocks, num_cached = bm.get_computed_blocks(b)
    assert (blocks, num_cached) == ([RELEASED] * 4 + [4, 5], 24)
    # 1 new block; the hits 4 and 5 stop being free, the RELEASED entries take none
    assert bm.can_allocate(b, 3, blocks, reserve=5) and not bm.can_allocate(b, 3, blocks, reserve=6)
    bm.allocate(b, 3, blocks)
    assert b.block_ids == [RELEASED] * 4 + [4, 5, 7] and bm.ref_cnt[4:6] == [1, 1]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (24, 24)
    assert (bm.query_tokens, bm.hit_tokens, bm.hit_blocks) == (26 + 27, 24, 6)
    b.num_computed_tokens = 27
    bm.cache_full_blocks(b)
    bm.release_before(b, 28 - 9 + 1)  # a query at 28 reads keys 20..: block 4 leaves, the others stay
    assert b.block_ids == [RELEASED] * 5 + [5, 7] and bm.ref_cnt == [0] * 5 + [1, 0, 1]
    bm.free(b)
    assert len(bm.policy) + len(bm.free_block_ids) == bm.num_blocks and not any(bm.ref_cnt)
    # a window of 10 reads key 15 too (block 3, evicted): one block short, no hit
    bm = _head_evicted(window=10, num_evicted=4)
    assert bm.get_computed_blocks(req("b", range(27))) == ([], 0)
    # ... with block 3 still cached it hits; where the window reaches back to block 0 the hit is the
    # plain prefix, and with the whole chain cached the longest one
    bm = _head_evicted(window=10, num_evicted=3)
    assert bm.get_computed_blocks(req("b", range(27))) == ([RELEASED] * 3 + [3, 4, 5], 24)
    bm = _head_evicted(window=100, num_evicted=0)
    assert bm.get_computed_blocks(req("b", range(27))) == ([0, 1, 2, 3, 4, 5], 24)
    assert bm.get_computed_blocks(req("c", list(range(26)) + [1])) == ([0, 1, 2, 3, 4, 5], 24)
    # the hashes chain: a block's hash stands for its whole prefix, so another head never hits
    bm = _head_evicted(window=9, num_evicted=4)
    assert bm.get_computed_blocks(req("d", [7] + list(range(1, 27)))) == ([], 0)


def test_generated_tokens_are_cached():
    bm = BlockManager(8, BS)
    a = req("a", range(6))
    run(bm, a)  # blocks [0, 1]; block 1 holds 2 tokens
    for t in (40, 41):
        a.append_output_token(t)
        bm.allocate(a, 1)
        a.num_computed_tokens += 1
        bm.cache_full_blocks(a)
    assert a.block_ids == [0, 1] and bm.block_hash[1] is not None
    b = req("b", list(range(6)) + [40, 41, 7])  # next turn: conversation so far + new text
    assert bm.get_computed_blocks(b) == ([0, 1], 8)


def test_duplicate_block_not_cached_twice():
    bm = BlockManager(8, BS)
    a, b = req("a", range(5)), req("b", range(5))
    admit(bm, a)
    admit(bm, b)  # both miss: computed concurrently
    compute(bm, a)
    compute(bm, b)
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    assert bm.hash_to_block == {bm.block_hash[0]: 0} and bm.block_hash[2] is None
    bm.free(b)
    assert list(bm.free_block_ids)[-2:] == [3, 2]  # b's copy goes back to the free pool
    bm.free(a)
    assert 0 in bm.policy


def test_blocks_cached_ahead_of_their_kv_are_never_evicted_saved_or_kept_uncomputed():
    """The scheduler caches the full blocks a step is to compute before it runs: they are hits
    at once, but until commit_computed they are never saved to a tier, a request freeing one
    returns it to the free pool (not the cache), and uncache_uncomputed takes them out again
    (then the request registers them anew)."""
    from numa_runtime.kv_cache.disk_tier import DiskTier
    bm = BlockManager(6, BS, tier=DiskTier(8, True))
    a = req("a", range(10))
    bm.allocate(a, 10)
    bm.cache_full_blocks(a, 10)  # the step computes a's 10 tokens
    assert bm.num_uncomputed == 2 and bm.get_computed_blocks(req("b", range(9))) == ([0, 1], 8)
    bm.offload_all()
    assert len(bm.tier) == 0
    assert bm.uncache_uncomputed() == {0, 1} and bm.hash_to_block == {} and bm.num_uncomputed == 0
    bm.cache_full_blocks(a, 10)  # scheduled again
    assert bm.hash_to_block == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    bm.commit_computed()
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert bm.num_uncomputed == 0 and len(bm.hash_to_block) == 2
    bm.offload_all()
    assert len(bm.tier) == 2
    c = req("c", range(50, 60))
    bm.allocate(c, 10)
    bm.cache_full_blocks(c, 10)
    bm.free(c)  # before its step ran (an abort)
    assert bm.num_uncomputed == 0 and c.block_hashes[0] not in bm.hash_to_block
    assert len(bm.policy) == 0 and sorted(bm.free_block_ids) == [3, 4, 5]


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = req("a", range(9))
    run(bm, a)
    bm.free(a)
    assert bm.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert bm.hash_to_block == {} and bm.num_free_blocks == 8


def _fill_and_release(bm, rid, tokens):
    r = req(rid, tokens)
    run(bm, r)
    bm.free(r)
    return r


def _script(bm):
    """a is cached, then hit again by h; a one-off b streams through; c needs 3 blocks."""
    _fill_and_release(bm, "a", range(0, 9))       # [0, 1, 2]: caches 0, 1; 2 partial -> free
    h = req("h", list(range(0, 8)) + [7])         # hits a's 0, 1; takes 3 (partial)
    assert admit(bm, h) == [0, 1] and h.block_ids == [0, 1, 3]
    bm.free(h)
    b = _fill_and_release(bm, "b", range(100, 108))  # one-off: [4, 2], both cached
    assert b.block_ids == [] and bm.block_hash[4] is not None and bm.block_hash[2] is not None
    c = req("c", range(200, 212))                 # 3 blocks: 1 free, 2 evicted
    bm.allocate(c, 12)
    return c


def test_lru_eviction_order():
    bm = BlockManager(5, BS, eviction="lru")
    _fill_and_release(bm, "a", range(0, 9))
    assert list(bm.policy._queue) == [1, 0]  # released tail first: the leaf goes first
    bm = BlockManager(5, BS, eviction="lru")
    c = _script(bm)
    # queue was [1, 0, 2, 4] (h re-released a's blocks before b): a's prefix is evicted
    assert c.block_ids == [3, 1, 0] and bm.num_evictions == 2
    assert bm.get_computed_blocks(req("a2", range(0, 9))) == ([], 0)
    assert bm.get_computed_blocks(req("b2", range(100, 109))) == ([4, 2], 8)


def test_reuse_aware_eviction_protects_hit_blocks():
    bm = BlockManager(5, BS, eviction=ReuseAwareEviction(5, protected_fraction=0.5))
    c = _script(bm)
    # before c: protected [1, 0] (hit by h), probation [2, 4] (one-off b): b goes
    assert c.block_ids == [3, 2, 4] and bm.num_evictions == 2
    assert bm.get_computed_blocks(req("a2", range(0, 9))) == ([0, 1], 8)
    assert bm.get_computed_blocks(req("b2", range(100, 109))) == ([], 0)
    assert list(bm.policy._protected) == [1, 0] and len(bm.policy._probation) == 0


def test_continuation_blocks_start_protected():
    bm = BlockManager(16, BS, eviction="reuse")
    _fill_and_release(bm, "t1", range(0, 9))                  # turn 1 caches 0, 1
    t2 = req("t2", list(range(0, 9)) + [50, 51, 52, 53, 54])  # 8 of 14 cached: a continuation
    assert admit(bm, t2) == [0, 1]
    compute(bm, t2)
    assert t2.block_ids == [0, 1, 3, 4] and bm.block_hash[3] is not None  # 4 is partial
    one = req("one", list(range(0, 4)) + list(range(300, 313)))  # 4 of 17 cached: a one-off
    assert admit(bm, one) == [0]
    compute(bm, one)
    assert one.block_ids == [0, 5, 6, 7, 8]  # 8 is partial
    bm.free(one)
    bm.free(t2)
    # t2's new block 3 is protected like the hit blocks 0, 1; the one-off's blocks are not
    assert list(bm.policy._protected) == [3, 1, 0]
    assert list(bm.policy._probation) == [7, 6, 5]


def test_lru_policy_unit():
    p = LRUEviction(8)
    for b in (5, 3, 7):
        p.add_evictable(b)
    p.touch(5)  # hits do not reorder LRU
    p.remove(3)
    assert len(p) == 2 and 3 not in p
    assert [p.pop_victim(), p.pop_victim()] == [5, 7]


def test_reuse_policy_unit_order_and_aging():
    p = ReuseAwareEviction(4, protected_fraction=0.5)  # protected holds at most 2
    p.touch(1)
    p.touch(2)
    p.touch(3)
    for b in (1, 2, 9, 3):  # 9 never hit -> probation
        p.add_evictable(b)
    # 1 was the oldest protected block when 3 arrived: demoted to probation's newest end
    assert list(p._probation) == [9, 1] and list(p._protected) == [2, 3]
    p.remove(2)
    assert len(p) == 3 and 2 not in p
    p.add_evictable(2)  # still marked hit: back to protected, 3 stays
    assert list(p._protected) == [3, 2]
    assert [p.pop_victim() for _ in range(4)] == [9, 1, 3, 2]
    # an evicted block forgets its hit mark (its id will hold other tokens)
    p.add_evictable(3)
    assert list(p._probation) == [3]


def test_unknown_policy():
    with pytest.raises(ValueError, match="Unknown eviction policy"):
        BlockManager(4, BS, eviction="mru")
