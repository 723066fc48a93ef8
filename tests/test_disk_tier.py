"""Disk tier under the prefix cache: exact block ids and ops with a plain-Python KV store, the
file format's checks, and an Engine restarted on the same directory (one rank and two)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from models import build_model
from numa_runtime import Engine, SamplingParams
from numa_runtime.kv_cache import BlockManager
from numa_runtime.kv_cache.disk_tier import DiskStore, DiskTier, model_fingerprint, worth_loading
from numa_runtime.plan import StepPlan
from numa_runtime.kv_cache.tier import OP_DELETE, OP_LOAD, OP_SAVE, join_hash, ops_array, split_hash
from numa_runtime.request import Request, RequestStatus
from numa_runtime.sampling_params import SamplingParams as SP
from numa_runtime.scheduler import Scheduler, SchedulerConfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BS = 4


# ------------------------------------------------------------------ a plain-Python KV store
class FakeKV:
    """The pool as lists of token ids per block and the disk as a dict: what a rank would do."""

    def __init__(self, num_blocks):
        self.pool = [[None] * BS for _ in range(num_blocks)]
        self.disk: dict[int, list] = {}

    def run(self, plan):
        """Apply the tier ops in order, then write the step's tokens to their slots."""
        for op, block_id, lo, hi in plan.tier_ops.tolist():
            h = join_hash(lo, hi)
            if op == OP_SAVE:
                self.disk[h] = list(self.pool[block_id])
            elif op == OP_LOAD:
                self.pool[block_id] = list(self.disk[h])
            else:
                self.disk.pop(h, None)
        for t, slot in zip(plan.token_ids.tolist(), plan.slot_mapping.tolist()):
            self.pool[slot // BS][slot % BS] = t

    def context(self, table, n):
        """The token ids the KV of blocks `table` holds for positions [0, n)."""
        return [self.pool[table[p // BS]][p % BS] for p in range(n)]


def make_sched(num_blocks, capacity, tier_cls=DiskTier, window=0):
    tier = tier_cls(capacity, True)
    bm = BlockManager(num_blocks, BS, tier=tier, sliding_window=window)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                     sliding_window=window), bm), tier


def serve(sched, kv, rid, tokens):
    """Run one request to completion (1 output token); check that every step's attention would
    read exactly its own tokens from the pool (those of its sliding window, if the model has one)."""
    r = Request(rid, list(tokens), SP(max_tokens=1))
    sched.add_request(r)
    window = sched.config.sliding_window
    while sched.has_unfinished():
        out = sched.schedule()
        kv.run(out.plan)
        for s, req in enumerate(out.scheduled):
            n = int(out.plan.context_lens[s])
            first = n - int(out.plan.query_start[s + 1] - out.plan.query_start[s])  # its first query
            lo = max(0, first - window + 1) if window else 0
            assert kv.context(out.plan.block_tables[s], n)[lo:] == req.all_token_ids[lo:n]
        sched.update(out, [7] * len(out.sampling))
        for q in out.sampling:
            sched.finish_request(q, RequestStatus.FINISHED_LENGTH)
    return r


def test_evicted_blocks_go_to_disk_and_come_back_exactly():
    sched, tier = make_sched(num_blocks=4, capacity=8)
    bm, kv = sched.block_manager, FakeKV(4)
    a = serve(sched, kv, "a", range(0, 9))           # blocks [0, 1, 2]: 0, 1 cached
    assert (bm.hash_to_block, len(tier)) == ({a.block_hashes[0]: 0, a.block_hashes[1]: 1}, 0)
    b = serve(sched, kv, "b", range(100, 113))       # 4 blocks: evicts a's 1 then 0
    assert bm.num_evictions == 2 and list(tier.index) == [a.block_hashes[1], a.block_hashes[0]]
    assert kv.disk == {a.block_hashes[0]: [0, 1, 2, 3], a.block_hashes[1]: [4, 5, 6, 7]}
    # a again: both blocks miss DRAM and hit the disk. b left block 0 free (its partial block)
    # and cached 3, 2, 1 (LRU order 1, 2, 3): the loads take block 0, then evict b's leaf, 1
    a2 = Request("a2", list(range(0, 9)), SP(max_tokens=1))
    assert bm.get_computed_blocks(a2) == ([0, 1], 8) and bm.tier_hit_blocks == 2
    ops = tier.take_ops()
    rows = [(o, bid, join_hash(lo, hi)) for o, bid, lo, hi in ops.tolist()]
    assert rows == [(OP_LOAD, 0, a.block_hashes[0]), (OP_SAVE, 1, b.block_hashes[2]),
                    (OP_LOAD, 1, a.block_hashes[1])]
    assert list(tier.index) == [a.block_hashes[0], b.block_hashes[2], a.block_hashes[1]]  # LRU order
    kv.run(StepPlan.empty(ops))
    r = serve(sched, kv, "a3", range(0, 9))            # the pool check inside proves the loaded bytes
    assert r.num_cached_tokens == 8 and bm.hit_blocks == 2


def test_capacity_deletes_the_oldest_disk_blocks():
    sched, tier = make_sched(num_blocks=3, capacity=2)
    kv = FakeKV(3)
    hashes = []
    for i in range(4):  # each evicts the previous one's 2 cached blocks
        hashes.append(serve(sched, kv, f"r{i}", range(10 * i, 10 * i + 9)).block_hashes[:2])
    assert len(tier) == 2 and set(kv.disk) == set(tier.index)
    assert list(tier.index) == [hashes[2][1], hashes[2][0]]


def test_loading_never_evicts_the_chain_it_extends():
    sched, tier = make_sched(num_blocks=4, capacity=8)
    bm, kv = sched.block_manager, FakeKV(4)
    a = serve(sched, kv, "a", range(0, 13))  # [0, 1, 2, 3]: 0, 1, 2 cached; LRU 2, 1, 0
    x = serve(sched, kv, "x", range(500, 508))  # takes free 3, evicts a's 2: [3, 2]
    assert x.block_ids == [] and list(tier.index) == [a.block_hashes[2]]
    assert list(bm.policy._queue) == [1, 0, 2, 3] and not bm.free_block_ids
    # a again: 0, 1 hit in DRAM; a's third block is on disk. The LRU victim would be 1 (the
    # chain itself); it must be x's leaf, 2.
    a2 = Request("a2", list(range(0, 13)), SP(max_tokens=1))
    assert bm.get_computed_blocks(a2) == ([0, 1, 2], 12)
    rows = [(o, bid, join_hash(lo, hi)) for o, bid, lo, hi in tier.take_ops().tolist()]
    assert rows == [(OP_SAVE, 2, x.block_hashes[1]), (OP_LOAD, 2, a.block_hashes[2])]
    kv.run(StepPlan.empty(ops_array(rows)))
    r = serve(sched, kv, "a3", range(0, 13))
    assert r.num_cached_tokens == 12 and bm.tier_hit_blocks == 1


def test_a_full_disk_tier_never_loads_the_block_it_just_dropped():
    """The disk tier is at its cap and the returning prefix is the oldest thing on it: taking a
    pool block for the load evicts a cached block, whose save drops that very entry. The load
    stops there (the rest is recomputed) and the pool stays whole; it raised a KeyError and left
    the chain out of the eviction policy (the engine failed on every later request)."""
    sched, tier = make_sched(num_blocks=4, capacity=2)
    bm, kv = sched.block_manager, FakeKV(4)
    a = serve(sched, kv, "a", range(0, 9))        # a's 2 blocks cached
    serve(sched, kv, "b", range(100, 113))        # evicts a's blocks to disk (now full: 2 of 2)
    assert list(tier.index) == [a.block_hashes[1], a.block_hashes[0]]
    a2 = Request("a2", list(range(0, 9)), SP(max_tokens=1))
    blocks, n = bm.get_computed_blocks(a2)
    kv.run(StepPlan.empty(tier.take_ops()))
    assert len(blocks) == n // BS and set(tier.index) == set(kv.disk)
    assert len(bm.policy) + len(bm.free_block_ids) == bm.num_blocks  # every block free or evictable
    assert all(bm.hash_to_block[bm.block_hash[b]] == b for b in blocks)
    r = serve(sched, kv, "a3", range(0, 9))       # the pool check inside proves the KV it reads
    assert r.num_output_tokens == 1 and bm.num_free_blocks == bm.num_blocks


def test_a_block_still_in_memory_is_a_hit_not_a_second_copy():
    """A chain whose first block went to disk while a later one stayed in memory: the load
    takes the later block as a hit; it loaded a second copy, two blocks claimed one hash, and
    the next eviction of both raised a KeyError."""
    sched, tier = make_sched(num_blocks=6, capacity=8)
    bm, kv = sched.block_manager, FakeKV(6)
    a = serve(sched, kv, "a", range(0, 13))       # 3 cached blocks of a
    first = bm.hash_to_block[a.block_hashes[0]]
    bm.policy.remove(first)                       # evict only the first block of the chain
    bm.policy.add_evictable(first)
    bm.policy._queue.move_to_end(first, last=False)
    free, bm.free_block_ids = bm.free_block_ids, type(bm.free_block_ids)()
    assert bm._take_block() == first              # the LRU victim: saved to disk, forgotten in memory
    bm.free_block_ids = free
    bm.free_block_ids.append(first)
    assert a.block_hashes[0] in tier.index and a.block_hashes[1] in bm.hash_to_block
    a2 = Request("a2", list(range(0, 13)), SP(max_tokens=1))
    blocks, n = bm.get_computed_blocks(a2)
    kv.run(StepPlan.empty(tier.take_ops()))
    assert n == 12 and len(set(blocks)) == 3 and bm.tier_hit_blocks == 1
    assert sorted(bm.hash_to_block.values()) == sorted(b for b in range(6) if bm.block_hash[b] is not None)
    for i in range(4):                            # churn: every block is evicted at least once
        serve(sched, kv, f"x{i}", range(300 + 20 * i, 313 + 20 * i))
    r = serve(sched, kv, "a3", range(0, 13))
    assert r.num_output_tokens == 1


def test_a_sliding_window_hit_loads_only_the_blocks_of_its_window():
    """Every layer slides a window of 9 (2 blocks before a hit): a chain whose head went to disk
    hits from the window on; only the window's block on disk is loaded (the head stays RELEASED),
    and the load never evicts the window's block still in memory, even when it comes after the
    loaded one and is the LRU victim (it was evicted, then loaded back as a second load)."""
    from numa_runtime.kv_cache.block_manager import RELEASED
    sched, tier = make_sched(num_blocks=6, capacity=16, window=9)
    bm, kv = sched.block_manager, FakeKV(6)
    a = serve(sched, kv, "a", range(0, 21))           # 5 cached blocks, ids 0-4
    serve(sched, kv, "b", range(100, 117))            # evicts ids 0, 1, 2, then 4 (a's last) to disk
    assert [h in bm.hash_to_block for h in a.block_hashes] == [False, False, False, True, False]
    kv.run(StepPlan.empty(tier.take_ops()))
    a2 = Request("a2", list(range(0, 21)), SP(max_tokens=1))
    assert bm.get_computed_blocks(a2) == ([RELEASED] * 3 + [3, 4], 20)
    rows = [(o, bid, join_hash(lo, hi)) for o, bid, lo, hi in tier.take_ops().tolist()]
    assert rows == [(OP_LOAD, 4, a.block_hashes[4])]
    kv.run(StepPlan.empty(ops_array(rows)))
    r = serve(sched, kv, "a3", range(0, 21))          # the pool check inside proves the window's KV
    assert r.num_cached_tokens == 20 and bm.tier_hit_blocks == 1

    sched, tier = make_sched(num_blocks=6, capacity=16, window=9)
    bm, kv = sched.block_manager, FakeKV(6)
    a = serve(sched, kv, "a", range(0, 21))
    for b in (3, 4, 3):  # LRU: 3, 4, 0, 1, 2
        bm.policy._queue.move_to_end(b, last=False)
    free, bm.free_block_ids = bm.free_block_ids, type(bm.free_block_ids)()
    assert bm._take_block() == 3                      # the window's first block goes to disk
    bm.free_block_ids = free
    assert bm.take_blocks(1) == [5]                   # held elsewhere: nothing free, a load evicts
    assert not bm.free_block_ids and list(bm.policy._queue) == [4, 0, 1, 2]
    kv.run(StepPlan.empty(tier.take_ops()))
    a2 = Request("a2", list(range(0, 21)), SP(max_tokens=1))
    assert bm.get_computed_blocks(a2) == ([RELEASED] * 3 + [0, 4], 20)
    rows = [(o, bid, join_hash(lo, hi)) for o, bid, lo, hi in tier.take_ops().tolist()]
    assert rows == [(OP_SAVE, 0, a.block_hashes[0]), (OP_LOAD, 0, a.block_hashes[3])]


def test_failed_load_is_redone_without_the_block():
    sched, tier = make_sched(num_blocks=4, capacity=8)
    bm, kv = sched.block_manager, FakeKV(4)
    a = serve(sched, kv, "a", range(0, 9))
    serve(sched, kv, "b", range(100, 113))   # a's blocks to disk
    kv.disk[a.block_hashes[1]] = ["garbage"] * BS  # a rank's copy went bad
    r = Request("a2", list(range(0, 9)), SP(max_tokens=1))
    sched.add_request(r)
    out = sched.schedule()
    assert r.num_computed_tokens == 8 and out.num_scheduled_tokens == [1]
    kv.run(StepPlan.empty(out.plan.tier_ops))  # the loads ran; the check failed; no forward
    hits = bm.tier_hit_blocks
    sched.redo_without(out, {a.block_hashes[1]})
    assert r.num_computed_tokens == 0 and list(sched.waiting) == [r] and r.block_ids == []
    # NOTE: a start over, not a preemption (vllm:num_preemptions would say the pool is too small), and the
    # failed load is no tier hit
    assert sched.num_preemptions == 0 and r.num_preemptions == 0 and bm.tier_hit_blocks == hits - 1
    assert a.block_hashes[1] not in bm.hash_to_block and a.block_hashes[1] not in tier
    assert a.block_hashes[0] in bm.hash_to_block  # its load was fine: still a hit
    assert tier.take_ops()[-1, 0] == OP_DELETE
    kv.disk.pop(a.block_hashes[1])
    out = sched.schedule()
    assert r.num_cached_tokens == 4 and out.num_scheduled_tokens == [5]
    kv.run(out.plan)
    assert kv.context(out.plan.block_tables[0], 9) == list(range(9))


def test_hash_words_round_trip():
    for h in (0, 1, (1 << 64) - 1, 1 << 64, (1 << 128) - 1, 0x8000_0000_0000_0000_1234):
        assert join_hash(*split_hash(h)) == h


def test_worth_loading_rule():
    assert worth_loading(12 * 1024, 0.5e9)      # Qwen2.5-0.5B: 12 KB of KV per token
    assert not worth_loading(1024, 1e5)        # a toy model recomputes faster than it reads


# ------------------------------------------------------------------ files
def test_store_round_trip_and_corruption_is_dropped(tmp_path):
    st = DiskStore(str(tmp_path), "fp", rank=0, block_bytes=64)
    payloads = {h: (np.arange(64) + h % 251).astype(np.uint8) for h in (1, 2, 3, 1 << 100)}
    for h, p in payloads.items():
        st.save(h, p)
    assert sorted(st.scan()) == sorted(payloads)
    assert np.array_equal(st.read(1 << 100), payloads[1 << 100])
    with open(st.path(1), "r+b") as f:  # flip one payload byte
        f.seek(50)
        b = f.read(1)
        f.seek(50)
        f.write(bytes([b[0] ^ 1]))
    with open(st.path(2), "r+b") as f:
        f.truncate(st.file_bytes - 1)
    os.rename(st.path(3), st.path(4))   # a file under another hash's name
    open(st.path(5) + ".tmp", "wb").close()  # a write that never finished
    assert st.read(1) is None and not os.path.exists(st.path(1)) and st.num_bad == 1
    assert sorted(st.scan()) == [1 << 100]
    assert sorted(os.listdir(st.dir)) == [".lock.r0", os.path.basename(st.path(1 << 100))]


def test_scan_orders_files_as_written_when_their_mtimes_tie(tmp_path, monkeypatch):
    """Files written within one clock tick share an mtime (ext4 before Linux 6.13): the order was
    then the hashes', so a smaller cap after a restart kept chain tails whose heads it dropped.
    Each file's header carries its write number; a restart continues after the highest."""
    import numa_runtime.kv_cache.disk_tier as dt
    st = DiskStore(str(tmp_path), "fp", rank=0, block_bytes=64)
    order = [9, 3, 1 << 90, 7, 1, 5]
    for h in order:
        st.save(h, np.full(64, h % 251, np.uint8))
    real_stat = os.stat

    class Tied:
        def __init__(self, r):
            self._r = r

        def __getattr__(self, name):
            return 1_000_000_000 if name == "st_mtime_ns" else getattr(self._r, name)
    monkeypatch.setattr(dt.os, "stat", lambda p, *a, **k: Tied(real_stat(p, *a, **k)))
    assert st.scan() == order
    st.close()
    again = DiskStore(str(tmp_path), "fp", rank=0, block_bytes=64)
    assert again.scan() == order
    again.save(2, np.zeros(64, np.uint8))
    assert again.scan() == order + [2]
    # a file of before the write numbers (0 there) is older than any numbered one, then by mtime
    with open(again.path(7), "r+b") as f:
        f.seek(dt._HEADER.size - 4)
        f.write(bytes(4))
    assert again.scan() == [7, 9, 3, 1 << 90, 1, 5, 2]


def test_a_read_only_directory_is_refused_or_outlived(tmp_path, monkeypatch):
    """A directory an earlier run left that can no longer be written (a read-only remount) is
    refused in one sentence at start; one that turns read-only under a running server loses
    cache entries, never a request (a failed remove inside the save's handler raised)."""
    import builtins
    import errno
    from numa_runtime.kv_cache import disk_tier
    st = DiskStore(str(tmp_path), "fp", rank=0, block_bytes=64)
    st.save(1, np.arange(64, dtype=np.uint8))
    with open(st.path(2), "wb") as f:  # a truncated file, found at the next read
        f.write(b"x")

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system")

    def no_writes(path, mode="r", *a, **k):
        return read_only() if "w" in mode else builtins.open(path, mode, *a, **k)
    monkeypatch.setattr(disk_tier, "open", no_writes, raising=False)
    monkeypatch.setattr(disk_tier.os, "remove", read_only)
    with pytest.raises(ValueError, match=r"^Cannot write to the KV cache directory .*Read-only file system.*"
                       "pass a writable --kv-cache-dir"):
        DiskStore(str(tmp_path), "fp", rank=0, block_bytes=64)
    assert st.save(3, np.zeros(64, np.uint8)) is False
    assert st.read(2) is None and st.num_bad == 1
    st.delete(1)
    assert np.array_equal(st.read(1), np.arange(64, dtype=np.uint8))  # NOTE: still there, still valid


def test_fingerprint_tells_models_dtypes_and_layouts_apart(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_model(str(a), seed=0)
    build_model(str(b), seed=1)  # same config and shapes, other weights
    fp = model_fingerprint(str(a), "float32", 16, 1)
    assert fp == model_fingerprint(str(a), "float32", 16, 1)
    assert len({fp, model_fingerprint(str(b), "float32", 16, 1), model_fingerprint(str(a), "bfloat16", 16, 1),
                model_fingerprint(str(a), "float32", 16, 2), model_fingerprint(str(a), "float32", 8, 1)}) == 5
    # weights edited in place (same size and header, bytes outside the sampled windows) are another model
    path = str(a / "model.safetensors")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert model_fingerprint(str(a), "float32", 16, 1) != fp


# ------------------------------------------------------------------ end to end
PROMPTS = [list(range(s, s + n)) for s, n in ((3, 40), (50, 52), (110, 33), (200, 60))]  # no shared prefix
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("disk_tier_model")
    build_model(str(d), arch="qwen2")
    return str(d)


def engine(model_dir, cache_dir, blocks=6, **kw):
    # bytes per block: 2 layers x K,V x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8192; a
    # context the pool holds (an asked max_model_len past it is refused)
    return Engine(model_dir, dtype="float32", kv_cache_memory=blocks * 8192, max_model_len=min(128, 16 * blocks),
                  kv_cache_dir=cache_dir, kv_cache_disk_load="always", **kw)


def tokens(eng, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in eng.generate(prompts, GREEDY)]


def test_restart_serves_hits_from_disk_with_equal_text(model_dir, tmp_path):
    plain = Engine(model_dir, dtype="float32", kv_cache_memory=1 << 22, max_model_len=128,
                   enable_prefix_caching=False)
    expected = [tokens(plain, [p])[0] for p in PROMPTS]
    plain.close()
    first = engine(model_dir, str(tmp_path))
    assert [tokens(first, [p])[0] for p in PROMPTS] == expected  # one by one: the pool of 6 evicts
    assert first.block_manager.num_evictions > 0 and len(first.block_manager.tier) > 0
    first.close()
    second = engine(model_dir, str(tmp_path))  # the restart: a new Engine on the same directory
    tier = second.block_manager.tier
    assert len(tier) == sum((len(p) + 5) // 16 for p in PROMPTS)  # every full computed block
    assert [tokens(second, [p])[0] for p in PROMPTS] == expected
    bm = second.block_manager
    assert bm.tier_hit_blocks == bm.hit_blocks == sum((len(p) - 1) // 16 for p in PROMPTS)
    second.close()


def test_a_disk_cap_below_the_pool_keeps_the_heads_of_the_chains(model_dir, tmp_path):
    """The shutdown flush wrote each chain head first, and the cap's trim then dropped the heads:
    a restart found tails it could never reach (a lookup walks a chain from its head) and hit
    nothing. The heads are kept now: a cap of 3 blocks gives a 100-token prompt 3 blocks back."""
    probe = engine(model_dir, str(tmp_path / "probe"))
    size = probe.runner.disk.file_bytes
    probe.close()
    prompt, cache = list(range(3, 103)), str(tmp_path / "disk")
    first = engine(model_dir, cache, blocks=8, kv_cache_disk_bytes=3 * size)
    want = tokens(first, [prompt])
    assert len(first.block_manager.hash_to_block) >= 6  # more full blocks than the cap
    first.close()
    second = engine(model_dir, cache, blocks=8, kv_cache_disk_bytes=3 * size)
    out = second.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 3 * 16 and [out.outputs[0].token_ids] == want
    second.close()


def test_a_full_disk_leaves_no_entry_behind(model_dir, tmp_path, monkeypatch):
    """Block files that cannot be written (a full disk) are no tier entries: the index kept them,
    so every later hit queued a load that failed, threw its step away and preempted its requests."""
    import builtins
    import errno
    from numa_runtime.kv_cache import disk_tier

    def full_disk(path, mode="r", *a, **k):
        if str(path).endswith(".tmp") and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(path, mode, *a, **k)
    monkeypatch.setattr(disk_tier, "open", full_disk, raising=False)
    plain = Engine(model_dir, dtype="float32", kv_cache_memory=1 << 22, max_model_len=128,
                   enable_prefix_caching=False)
    expected = [tokens(plain, [p])[0] for p in PROMPTS]
    plain.close()
    eng = engine(model_dir, str(tmp_path))
    try:
        for _ in range(2):
            assert [tokens(eng, [p])[0] for p in PROMPTS] == expected
        bm = eng.block_manager
        assert bm.num_evictions > 0 and bm.tier.num_saved > 0  # NOTE: it tried
        assert len(bm.tier) == 0 and bm.tier_hit_blocks == 0 and eng.scheduler.num_preemptions == 0
        assert _blocks(eng.runner.disk.dir) == []
    finally:
        eng.close()


def _blocks(folder):
    """The block files of a store's folder (not its ranks' lock files)."""
    return sorted(n for n in os.listdir(folder) if not n.startswith(".lock."))


def test_corrupt_and_truncated_files_are_dropped(model_dir, tmp_path):
    first = engine(model_dir, str(tmp_path))
    expected = tokens(first)
    first.close()
    store_dir = first.runner.disk.dir
    files = _blocks(store_dir)
    _flip_byte(os.path.join(store_dir, files[0]))
    with open(os.path.join(store_dir, files[1]), "r+b") as f:
        f.truncate(100)
    second = engine(model_dir, str(tmp_path))
    assert len(second.block_manager.tier) == len(files) - 2 and second.runner.disk.num_bad == 2
    # and one that goes bad while the server runs: found at load time, the step is redone
    third_victim = os.path.join(store_dir, _blocks(store_dir)[0])
    _flip_byte(third_victim)
    assert tokens(second) == expected
    assert second.runner.disk.num_bad == 3 and second.block_manager.tier.num_dropped == 1
    assert second.scheduler.num_preemptions == 0  # NOTE: the redone step's requests started over, unpreempted
    assert not os.path.exists(third_victim)
    second.close()


def _flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))


def test_bad_disk_tier_settings_are_clear():
    with pytest.raises(ValueError, match="kv_cache_disk_load must be one of"):
        Engine("unused", kv_cache_dir="/tmp/x", kv_cache_disk_load="sometimes")
    for cap in (-1, 0):  # NOTE: 0 was accepted, held nothing and deleted the files already there
        with pytest.raises(ValueError, match="kv_cache_disk_bytes must be a positive number of bytes .to run without"):
            Engine("unused", kv_cache_dir="/tmp/x", kv_cache_disk_bytes=cap)
    # the disk tier's settings without its directory were accepted and ignored (invalid ones too)
    for kw in ({"kv_cache_disk_load": "bogus"}, {"kv_cache_disk_bytes": -1}, {"kv_cache_disk_load": "always"}):
        with pytest.raises(ValueError, match="apply to the KV disk tier; give kv_cache_dir too"):
            Engine("unused", **kw)
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):  # it was accepted and unused
        Engine("unused", kv_cache_dir="/tmp/x", enable_prefix_caching=False)


def test_one_engine_at_a_time_owns_a_folder(model_dir, tmp_path):
    """Two engines of one model on one folder each kept their own index and cap (the folder held
    twice its cap) and deleted each other's temporary files in flight: the second is refused in
    one sentence while the first is open, and takes the folder once it is closed; another model's
    engine (its own subfolder) and another rank's store are not in the way."""
    first = engine(model_dir, str(tmp_path))
    with pytest.raises(ValueError, match=r"^The KV cache directory .* is in use by another engine or server of "
                       r"this model \(rank 0's files\); give each its own --kv-cache-dir\.$"):
        engine(model_dir, str(tmp_path))
    st = first.runner.disk
    DiskStore(str(tmp_path), os.path.basename(st.dir), rank=1, block_bytes=64).close()
    other = Engine(model_dir, dtype="bfloat16", kv_cache_memory=1 << 22, max_model_len=64,
                   kv_cache_dir=str(tmp_path))  # NOTE: another dtype: another fingerprint
    assert other.runner.disk.dir != st.dir
    other.close()
    expected = tokens(first)
    first.close()
    second = engine(model_dir, str(tmp_path))
    assert tokens(second) == expected
    second.close()
    st2 = DiskStore(str(tmp_path), "fp", rank=0, block_bytes=64)
    del st2  # NOTE: a dropped store gives its lock back (a model router's worker drops its engine)
    DiskStore(str(tmp_path), "fp", rank=0, block_bytes=64).close()


def test_the_folder_is_free_after_a_failed_start_and_beside_a_forked_child(model_dir, tmp_path):
    """A start-up that fails after the store took the lock gives it back at once (a REPL keeping
    the traceback kept the runner: the corrected retry was "in use"); close() unlocks before a
    process forked meanwhile (a multiprocessing pool) ends (the lock is the shared open file's)."""
    import multiprocessing
    import sys
    try:
        engine(model_dir, str(tmp_path), kv_cache_disk_bytes=100)
    except ValueError:
        sys.last_value = sys.exc_info()[1]  # NOTE: as the REPL, IPython and Jupyter keep it
    else:
        raise AssertionError("a cap below one block file was taken")
    try:
        engine(model_dir, str(tmp_path)).close()
    finally:
        del sys.last_value
    first = engine(model_dir, str(tmp_path))
    pool = multiprocessing.get_context("fork").Pool(1)
    try:
        assert pool.apply(abs, (-1,)) == 1  # NOTE: the child lives on beside the closed engine
        first.close()
        engine(model_dir, str(tmp_path)).close()
    finally:
        pool.terminate()
        pool.join()
    # ... and a forked child that closes its copy of an open engine's store leaves the parent's lock alone
    # (it unlocked the shared open file: two engines then shared the folder)
    first = engine(model_dir, str(tmp_path))
    pid = os.fork()
    if pid == 0:
        try:
            first.runner.disk.close()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    with pytest.raises(ValueError, match="is in use by another engine"):
        engine(model_dir, str(tmp_path))
    first.close()
    # ... and a start-up cut while the store reads its files (Ctrl-C in a large tier's scan) gives it back
    from numa_runtime.kv_cache import disk_tier

    def cut(self):
        raise OSError("the scan was cut short")
    real, disk_tier.DiskStore.scan = disk_tier.DiskStore.scan, cut
    try:
        with pytest.raises(OSError, match="cut short"):
            engine(model_dir, str(tmp_path))
    finally:
        disk_tier.DiskStore.scan = real
    engine(model_dir, str(tmp_path)).close()


def test_a_disk_cap_below_one_block_file_is_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"kv_cache_disk_bytes \(100\) is below one block file"):
        engine(model_dir, str(tmp_path), kv_cache_disk_bytes=100)


def test_two_ranks_restart_from_their_own_shards(model_dir, tmp_path):
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = os.path.join(HERE, "mpi", "disk_tier_restart.py")

    def run():
        p = subprocess.run(["mpirun", "-np", "2", sys.executable, script, model_dir, str(tmp_path),
                            json.dumps(PROMPTS)], capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][0][7:])

    first, second = run(), run()
    assert first["tier_hits"] == 0 and second["tier_hits"] == sum((len(p) - 1) // 16 for p in PROMPTS)
    assert second["tokens"] == first["tokens"]
    names = [n for d in os.listdir(tmp_path) for n in os.listdir(tmp_path / d)]
    assert {n.rsplit(".", 1)[1] for n in names} == {"r0", "r1"}
    assert sum(n.endswith(".r0") for n in names) == sum(n.endswith(".r1") for n in names)


def test_bench_prefix_cache_disk_tier_and_restart_smoke(model_dir, tmp_path):
    """The multi-turn benchmark with the disk tier off and on and a restart half-way, on the
    tiny model (a smoke run: only that it works and what it counts, no timing)."""
    out = str(tmp_path / "prefix")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_prefix_cache.py"), "--engine", "--quick",
                        "--clients", "3", "--turns", "3", "--one-offs", "4", "--threads", "1", "--max-tokens", "2",
                        "--policies", "reuse", "--disk-tier", "--restart", "--disk-load", "always", "--blocks", "64",
                        "--model", model_dir, "--dtype", "float32", "--out", out],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    off_base, off, on_base, on = json.load(open(out + ".json"))["policies"]
    assert (off["disk"], on["disk"]) == (False, True) and off["restarts"] == on["restarts"] == 1
    assert (off_base["disk"], on_base["disk"]) == (False, True) and off_base["restarts"] == on_base["restarts"] == 0
    assert off["disk_hit_blocks"] == 0 and on["disk_hit_blocks"] > 0
    # "kept": the hit rate after the restart over that of the same turns in the run without it
    for row in (off, on):
        assert 0 < row["conv_hit_same_turns_no_restart"] < 1
        assert row["restart_kept"] == row["conv_hit_after_restart"] / row["conv_hit_same_turns_no_restart"]
    assert on["restart_kept"] > off["restart_kept"]
    # the first turn of a conversation after the restart finds its history only on disk (with
    # this seeded workload, 3 clients x 3 turns, some conversation spans the restart)
    assert on["conv_hit_after_restart"] > off["conv_hit_after_restart"]
    assert "| conv hit after restart (same turns, no restart; kept) |" in open(out + ".md").read()


def test_blocks_a_decode_burst_evicts_are_saved_before_it_writes_them(tmp_path):
    """A burst of decode steps (a quantized bf16 engine) takes blocks that evict cached ones; their
    saves to the disk tier run before the burst writes into them. They used to run in the next
    plan, after it: the file held the burst's KV under the evicted block's hash, with a valid
    checksum, and a rerun of the first prompt (in the same engine, or after a restart) changed."""
    import random
    d = str(tmp_path / "m")
    build_model(d, arch="llama", max_position_embeddings=4096)
    kw = dict(dtype="bfloat16", quantization="int8", max_model_len=192, num_threads=2, block_size=16,
              kv_cache_memory=12 * 4096, kv_cache_dir=str(tmp_path / "kv"), kv_cache_disk_load="always")
    rng = random.Random(1)
    a, b = [rng.randrange(3, 383) for _ in range(65)], [rng.randrange(3, 383) for _ in range(32)]

    def sp(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    e = Engine(d, **kw)
    try:
        assert e._burst_rows > 0
        first = e.generate([a], sp(8))[0].token_ids
        e.generate([b], sp(140))  # NOTE: its bursts evict a's blocks
        assert e.block_manager.num_evictions > 0 and e.block_manager.tier.num_saved > 0
        assert e.generate([a], sp(8))[0].token_ids == first
    finally:
        e.close()
    e = Engine(d, **kw)
    try:
        again = e.generate([a], sp(8))[0].token_ids
        assert e.block_manager.tier_hit_blocks > 0 and again == first
    finally:
        e.close()
