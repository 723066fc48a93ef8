"""The host KV tier under the BlockManager: exact block ids, host slots and copy lists (CPU only)."""
import pytest

from numa_runtime.kv_cache import BlockManager, hash_block
from numa_runtime.kv_cache.block_manager import HostHit
from numa_runtime.kv_cache.host_tier import CopyCosts, HostKVTier
from numa_runtime.request import Request
from numa_runtime.sampling_params import SamplingParams

BS = 4
CHEAP_COPY = CopyCosts(copy_block_s=1e-6, token_s=1e-4)


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def run(bm, r):
    """Admit r (prefix hits first), compute it whole, free it; returns its block table."""
    blocks, num_cached = bm.get_computed_blocks(r)
    assert bm.can_allocate(r, r.num_tokens - num_cached, blocks)
    bm.allocate(r, r.num_tokens - num_cached, blocks)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    table = list(r.block_ids)
    bm.free(r)
    return table


def test_evicted_blocks_go_to_host_and_come_back_into_fresh_blocks():
    tier = HostKVTier(4, CHEAP_COPY)
    bm = BlockManager(4, BS, host_tier=tier)
    a = run(bm, req("a", range(9)))             # blocks 0, 1 cached, 2 holds the tail
    assert a == [0, 1, 2] and tier.drain() == ([], [])
    b = run(bm, req("b", range(100, 109)))      # free 3 and 2, then evicts 1 (a's leaf first)
    assert b == [3, 2, 1]
    assert tier.drain() == ([(1, 0)], [])          # (device block, host slot)
    assert len(tier) == 1 and bm.num_evictions == 1
    # a's prefix again: block 0 is still on the device, block 1 comes back from slot 0
    r = req("a2", range(9))
    blocks, num_cached = bm.get_computed_blocks(r)
    assert blocks == [0, HostHit(r.block_hashes[1])] and num_cached == 8
    assert run(bm, r) == [0, 1, 2]  # 1 was free again (b's tail); 2 (b's first) evicted for the tail
    assert tier.drain() == ([(2, 1)], [(0, 1)])
    assert bm.hit_tokens == 8 and tier.num_restored == 1 and tier.free_slots == [3, 2, 0]
    assert bm.hash_to_block[r.block_hashes[1]] == 1 and bm.block_hash[1] == r.block_hashes[1]


def test_a_slot_read_back_is_not_reused_before_the_next_drain():
    tier = HostKVTier(1, CHEAP_COPY)
    bm = BlockManager(2, BS, host_tier=tier)
    run(bm, req("a", range(5)))                   # block 0 cached
    run(bm, req("b", range(50, 55)))              # evicts 0 -> slot 0
    assert tier.drain() == ([(0, 0)], [])
    assert run(bm, req("a2", range(5))) == [0, 1]  # a's block back into 0; 1 evicted for the tail
    # the hit took slot 0; b's block evicted in the same step found no free slot: dropped
    assert tier.drain() == ([], [(0, 0)])
    assert tier.num_dropped == 1 and tier.free_slots == [0] and len(tier) == 0


def test_oldest_host_block_is_dropped_when_the_pool_is_full():
    tier = HostKVTier(1, CHEAP_COPY)
    bm = BlockManager(2, BS, host_tier=tier)
    run(bm, req("a", range(5)))
    run(bm, req("b", range(50, 55)))   # a's block -> host
    run(bm, req("c", range(70, 75)))   # b's block -> host, a's dropped
    assert tier.drain() == ([(0, 0), (1, 0)], [])  # the later copy into slot 0 wins
    assert tier.num_dropped == 1 and len(tier) == 1
    assert bm.get_computed_blocks(req("a2", range(5))) == ([], 0)
    assert bm.get_computed_blocks(req("b2", range(50, 55))) == ([HostHit(hash_block(None, [50, 51, 52, 53]))], 4)


def test_recompute_wins_when_copying_is_slower():
    slow = CopyCosts(copy_block_s=1.0, token_s=1e-4)
    tier = HostKVTier(4, slow)
    bm = BlockManager(2, BS, host_tier=tier)
    run(bm, req("a", range(5)))
    run(bm, req("b", range(50, 55)))
    tier.drain()
    assert len(tier) == 1
    assert bm.get_computed_blocks(req("a2", range(5))) == ([], 0)


def test_cost_model_grows_with_position():
    costs = CopyCosts(copy_block_s=1e-3, token_s=1e-5, token_ctx_s=1e-7)
    # block 0: 4 tokens * (1e-5 + 1e-7 * 2) ~ 4e-5 s < copy; far blocks cost more than the copy
    assert not costs.copy_is_cheaper(0, 4)
    assert costs.copy_is_cheaper(1000, 4)
    with pytest.raises(ValueError):
        CopyCosts(copy_block_s=-1, token_s=0)
    with pytest.raises(ValueError, match="at least one block"):
        HostKVTier(0, costs)
