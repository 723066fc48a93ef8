"""Scheduler without a model: exact plans, budgets, chunked prefill, prefix hits, preemption."""
import random

import numpy as np
import pytest

from numa_runtime.kv_cache import BlockManager
from numa_runtime.plan import StepPlan
from numa_runtime.request import Request, RequestStatus
from numa_runtime.sampling_params import SamplingParams
from numa_runtime.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(num_blocks=8, max_num_seqs=4, budget=8, max_model_len=64, block_size=BS, **kw):
    bm = BlockManager(num_blocks, block_size, eviction=kw.pop("eviction", "lru"),
                      sliding_window=kw.get("sliding_window", 0))
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, **kw), bm)


def req(rid, tokens, max_tokens=3):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


class FakeModel:
    """Samples token = position % 7 of the row it samples from. Keeps a fake KV cache (the
    token id written at each slot) and checks that every sequence's cache, read through its
    block table, holds exactly its tokens: prefix sharing, chunking and preemption included."""

    def __init__(self, sched):
        bm = sched.block_manager
        self.window = sched.config.sliding_window  # only keys inside it are read
        self.sched, self.bs = sched, bm.block_size
        self.kv = np.full(bm.num_blocks * bm.block_size, -1, np.int64)  # [num_slots]

    def step(self, out):
        p = out.plan
        for s, r in enumerate(out.scheduled):
            rows = slice(p.query_start[s], p.query_start[s + 1])
            written = set((p.slot_mapping[rows] // self.bs).tolist())
            assert written <= set(r.block_ids)
            # a block shared with another request (a prefix hit) is read-only, but for one this
            # request computes in this step (cached at scheduling, a hit of a later admission)
            bm = self.sched.block_manager
            assert all(bm.ref_cnt[b] == 1 or bm._uncomputed.get(b) == r.request_id for b in written)
        self.kv[p.slot_mapping] = p.token_ids
        for s, r in enumerate(out.scheduled):
            first_query = p.context_lens[s] - (p.query_start[s + 1] - p.query_start[s])
            pos = np.arange(max(0, first_query - self.window + 1) if self.window else 0,
                            p.context_lens[s])
            slots = p.block_tables[s][pos // self.bs] * self.bs + pos % self.bs
            assert self.kv[slots].tolist() == r.all_token_ids[pos[0]:p.context_lens[s]]
        return [int(p.positions[i]) % 7 for i in p.logits_indices]


def drive(sched, arrivals=None, max_steps=10_000, on_step=None):
    """Run to completion; `arrivals` maps step -> requests added before it. Stops a request
    at max_tokens (the engine's job). Returns the SchedulerOutputs."""
    arrivals = dict(arrivals or {})
    model, outs = FakeModel(sched), []
    for step in range(max_steps):
        for r in arrivals.pop(step, []):
            sched.add_request(r)
        if not sched.has_unfinished() and not arrivals:
            return outs
        out = sched.schedule()
        if on_step:
            on_step(sched, out)
        sched.update(out, model.step(out))
        for r in out.sampling:
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
        outs.append(out)
    raise AssertionError("did not finish")


def expected_output(r):
    return [(r.num_prompt_tokens + k - 1) % 7 for k in range(r.sampling_params.max_tokens)]


def test_exact_plan_chunked_prefill_then_decode():
    sched = make(num_blocks=8, budget=8)
    a, b = req("a", range(10)), req("b", range(100, 103))
    sched.add_request(a)
    sched.add_request(b)
    model = FakeModel(sched)

    out = sched.schedule()  # a's first chunk uses the whole budget; b waits
    p = out.plan
    assert out.scheduled == [a] and out.num_scheduled_tokens == [8] and out.sampling == []
    assert p.token_ids.tolist() == list(range(8)) and p.positions.tolist() == list(range(8))
    assert p.slot_mapping.tolist() == list(range(8))
    assert p.query_start.tolist() == [0, 8] and p.context_lens.tolist() == [8]
    assert p.block_tables.tolist() == [[0, 1]] and p.logits_indices.tolist() == []
    sched.update(out, model.step(out))
    assert a.num_computed_tokens == 8 and a.output_token_ids == []

    out = sched.schedule()  # a finishes its prompt, b prefills whole: both sample
    p = out.plan
    assert out.scheduled == [a, b] and out.num_scheduled_tokens == [2, 3] and out.sampling == [a, b]
    assert p.token_ids.tolist() == [8, 9, 100, 101, 102]
    assert p.positions.tolist() == [8, 9, 0, 1, 2]
    assert p.slot_mapping.tolist() == [8, 9, 12, 13, 14]
    assert p.query_start.tolist() == [0, 2, 5] and p.context_lens.tolist() == [10, 3]
    assert p.block_tables.tolist() == [[0, 1, 2], [3, 0, 0]] and p.logits_indices.tolist() == [1, 4]
    sched.update(out, model.step(out))
    assert a.output_token_ids == [9 % 7] and b.output_token_ids == [2]

    out = sched.schedule()  # two decodes
    p = out.plan
    assert p.token_ids.tolist() == [2, 2] and p.positions.tolist() == [10, 3]
    assert p.slot_mapping.tolist() == [10, 15] and p.context_lens.tolist() == [11, 4]
    assert p.query_start.tolist() == [0, 1, 2] and p.logits_indices.tolist() == [0, 1]
    sched.update(out, model.step(out))

    out = sched.schedule()  # b's decode at position 4 opens block 4
    assert out.plan.block_tables.tolist() == [[0, 1, 2], [3, 4, 0]]
    assert out.plan.slot_mapping.tolist() == [11, 16]
    # the plan survives the broadcast format
    back = StepPlan.from_buffer(out.plan.to_buffer())
    for f in ("token_ids", "positions", "slot_mapping", "query_start", "context_lens",
              "block_tables", "logits_indices"):
        assert np.array_equal(getattr(back, f), getattr(out.plan, f))


def test_empty_step():
    sched = make()
    out = sched.schedule()
    p = out.plan
    assert out.is_empty and p.num_tokens == 0 and p.num_seqs == 0
    assert p.query_start.tolist() == [0] and p.block_tables.shape == (0, 0)
    assert p.logits_indices.shape == (0,)
    sched.update(out, [])


def test_chunked_prefill_never_stalls_decodes():
    sched = make(num_blocks=64, budget=6, max_model_len=128)
    outs = drive(sched, {0: [req("d1", range(3), 20), req("d2", range(10, 13), 20)],
                         3: [req("long", range(100, 140), 2)]})
    for out in outs:
        assert out.plan.num_tokens <= 6
        decoding = [r for r in out.scheduled if r.request_id in ("d1", "d2")]
        if out.plan.step_id >= 1 and any(r.request_id == "long" for r in out.scheduled):
            # while the long prompt is chunked in, both decodes still run each step
            assert len(decoding) == 2 and out.num_scheduled_tokens[:2] == [1, 1]
    long_chunks = [n for out in outs for r, n in zip(out.scheduled, out.num_scheduled_tokens)
                   if r.request_id == "long" and r.num_prompt_tokens]
    assert long_chunks[:3] == [4, 4, 4] and sum(long_chunks) == 40 + 1  # + 1 decode


def test_long_prefill_threshold_caps_chunks():
    sched = make(num_blocks=64, budget=32, max_model_len=128, long_prefill_token_threshold=5)
    outs = drive(sched, {0: [req("a", range(12), 1), req("b", range(50, 62), 1)]})
    assert [o.num_scheduled_tokens for o in outs] == [[5, 5], [5, 5], [2, 2]]


def test_budget_and_max_num_seqs_respected():
    rng = random.Random(0)
    sched = make(num_blocks=40, max_num_seqs=3, budget=10, max_model_len=64)
    reqs = [req(f"r{i}", [rng.randrange(50) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 10))
            for i in range(30)]

    def check(s, out):
        assert s.num_running <= 3

    outs = drive(sched, {i: [r] for i, r in enumerate(reqs)}, on_step=check)
    for o in outs:
        assert o.plan.num_tokens <= 10 and o.plan.num_seqs <= 3
    for r in reqs:
        assert r.output_token_ids == expected_output(r) and r.status == RequestStatus.FINISHED_LENGTH


def test_prefix_hit_skips_computed_tokens():
    sched = make(num_blocks=16, budget=32)
    a = req("a", range(10), 1)
    drive(sched, {0: [a]})
    b = req("b", list(range(8)) + [70, 71, 72], 2)
    sched.add_request(b)
    model = FakeModel(sched)
    model.kv[:8] = range(8)  # what a left in blocks 0 and 1
    out = sched.schedule()
    assert b.num_cached_tokens == 8 and out.num_scheduled_tokens == [3]
    assert out.plan.token_ids.tolist() == [70, 71, 72] and out.plan.positions.tolist() == [8, 9, 10]
    assert out.plan.context_lens.tolist() == [11] and out.plan.block_tables[0, :2].tolist() == [0, 1]
    assert sched.prefix_cache_hits == 8 and sched.prefix_cache_queries == 10 + 11
    sched.update(out, model.step(out))
    out = sched.schedule()  # decode at position 11 fills b's third block with a generated token
    sched.update(out, model.step(out))
    sched.finish_request(b, RequestStatus.FINISHED_LENGTH)
    c = req("c", b.all_token_ids[:12] + [5], 1)
    assert sched.block_manager.get_computed_blocks(c)[1] == 12


def test_prefix_hit_block_table_and_kv():
    sched = make(num_blocks=16, budget=32)
    a = req("a", range(10), 2)
    b = req("b", list(range(8)) + [70, 71, 72], 2)
    seen = {}
    drive(sched, {0: [a], 5: [b]}, on_step=lambda s, o: seen.update(
        {r.request_id: list(r.block_ids) for r in o.scheduled}))
    assert seen["b"][:2] == [0, 1]  # a's cached blocks, freed by then, reused (FakeModel checks KV)
    assert b.num_cached_tokens == 8 and b.output_token_ids == expected_output(b)


def test_same_step_admissions_hit_the_blocks_the_first_one_computes():
    """Requests sharing a prefix admitted in one step: the first computes the prefix, the others
    take its full blocks as prefix hits in that same step (blocks were cached only after the
    forward, so each computed the prefix again); n equal prompts hold the prefix's blocks once.
    FakeModel checks that every KV read is the reader's tokens (written earlier in the step)."""
    sched = make(num_blocks=32, max_num_seqs=8, budget=64)
    system = list(range(100, 114))  # 3 full blocks and 2 tokens
    reqs = [req(f"r{i}", system + [i, 50 + i], 2) for i in range(4)] + [req(f"n{i}", system, 2) for i in range(3)]
    first = []
    drive(sched, {0: reqs}, on_step=lambda s, out: first or first.append(
        (list(out.num_scheduled_tokens), [list(r.block_ids) for r in out.scheduled])))
    sizes, tables = first[0]
    assert sizes == [16, 4, 4, 4, 2, 2, 2]
    assert all(t[:3] == tables[0][:3] for t in tables)
    assert len({b for t in tables for b in t}) == 3 + 7  # the shared prefix once, one tail each
    assert [r.num_cached_tokens for r in reqs] == [0] + [12] * 6
    assert sched.prefix_cache_hits == 12 * 6 and sched.block_manager.miss_tokens == 16 + 3 * 4 + 3 * 2
    assert all(r.output_token_ids == expected_output(r) for r in reqs)


def test_chunked_prefill_admissions_hit_the_chunk_computed_beside_them():
    """A prompt chunked over two steps: a request sharing it, admitted in the second step, hits
    the blocks of the first chunk (computed) and of the second (computed in that step)."""
    sched = make(num_blocks=16, budget=8)
    a, b = req("a", range(100, 114), 1), req("b", list(range(100, 112)) + [7, 8], 1)
    outs = drive(sched, {0: [a], 1: [b]})
    assert [o.num_scheduled_tokens for o in outs[:2]] == [[8], [6, 2]]
    assert b.num_cached_tokens == 12 and b.output_token_ids == expected_output(b)


def test_a_step_that_did_not_run_uncaches_the_blocks_it_cached_ahead():
    """Blocks a step cached when it was scheduled hold no KV until it runs: when it does not
    (redo_without, a step never updated, an abort in flight), they leave the prefix cache, a
    request that took them as hits starts over, and the rest runs again."""
    sched = make(num_blocks=16, budget=64)
    bm = sched.block_manager
    a, b = req("a", range(10), 1), req("b", list(range(8)) + [70, 71], 1)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2] and bm.num_uncomputed == 2
    sched.redo_without(out, set())  # e.g. another block's load failed its check: nothing ran
    assert bm.hash_to_block == {} and bm.num_uncomputed == 0
    assert bm.get_computed_blocks(req("c", range(10))) == ([], 0)
    assert sched.running == [a] and a.num_computed_tokens == 0 and a.block_ids == [0, 1, 2]
    assert list(sched.waiting) == [b] and b.block_ids == [] and b.num_computed_tokens == 0
    assert sched.prefix_cache_hits == 0 and sched.prefix_cache_queries == 10  # b's lookup taken back
    out = sched.schedule()  # again, but never updated (it did not run): the next schedule drops it
    assert b.num_cached_tokens == 8 and bm.num_uncomputed == 2
    out = sched.schedule()
    assert out.scheduled == [a, b] and b.num_cached_tokens == 8 and sched.prefix_cache_queries == 20
    model = FakeModel(sched)
    sched.update(out, model.step(out))
    assert bm.num_uncomputed == 0 and len(bm.hash_to_block) == 2
    assert a.output_token_ids == expected_output(a)[:1] and b.output_token_ids == expected_output(b)[:1]
    # an abort in flight: the blocks it would have computed go back to the pool, not to the cache
    c = req("c", range(200, 210), 1)
    sched.add_request(c)
    out = sched.schedule()
    assert bm.num_uncomputed == 2 and c.block_hashes[0] in bm.hash_to_block
    assert sched.abort_request("c")
    assert bm.num_uncomputed == 0 and not set(c.block_hashes) & set(bm.hash_to_block)
    assert all(bm.block_hash[b] is None for b in bm.free_block_ids)


def test_preemption_recomputes_newest_without_overcommit():
    sched = make(num_blocks=10, max_num_seqs=8, budget=16, max_model_len=64)
    rng = random.Random(1)
    reqs = [req(f"r{i}", [rng.randrange(1000) for _ in range(rng.randrange(4, 20))], rng.randrange(5, 17))
            for i in range(12)]
    events = []

    def check(s, out):
        bm = s.block_manager
        held = [b for r in s.running for b in r.block_ids]  # waiting requests hold none
        assert all(bm.ref_cnt[b] == held.count(b) for b in range(bm.num_blocks))
        assert len(set(held)) + bm.num_free_blocks == bm.num_blocks
        for v in out.preempted:
            events.append((v.request_id, v.num_output_tokens))
            assert v.block_ids == [] and v.num_computed_tokens == 0
            assert v.status == RequestStatus.PREEMPTED and v not in out.scheduled
            assert s.waiting[0].status == RequestStatus.PREEMPTED
            # the newest running request is the one that goes
            assert all(r.arrival_time <= v.arrival_time for r in s.running)

    drive(sched, {0: reqs}, on_step=check)
    assert events, "the pool is small enough that preemption must happen"
    assert any(n > 0 for _, n in events), "some preempted request had generated tokens to recompute"
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions == len(events)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_cnt) and bm.usage == 0.0
    assert not sched.has_unfinished() and sched.num_waiting == sched.num_running == 0


@pytest.mark.parametrize("eviction", ["lru", "reuse"])
def test_random_traffic_with_shared_prefixes(eviction):
    rng = random.Random(2)
    sched = make(num_blocks=24, max_num_seqs=5, budget=12, max_model_len=80, eviction=eviction)
    system = list(range(500, 512))
    arrivals = {}
    for i in range(40):
        tokens = system[:rng.randrange(0, 13)] + [rng.randrange(100) for _ in range(rng.randrange(1, 25))]
        arrivals.setdefault(rng.randrange(60), []).append(req(f"q{i}", tokens, rng.randrange(1, 20)))
    all_reqs = [r for rs in arrivals.values() for r in rs]
    drive(sched, arrivals)
    assert all(r.output_token_ids == expected_output(r) for r in all_reqs)
    assert sched.prefix_cache_hits > 0 and sched.block_manager.usage == 0.0


def test_abort_running_waiting_and_in_flight():
    sched = make(num_blocks=16, max_num_seqs=1, budget=4)
    a, b, c = req("a", range(10)), req("b", range(20, 25)), req("c", range(30, 33))
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    assert out.scheduled == [a] and a.block_ids == [0]
    assert sched.abort_request("b")  # waiting
    assert b.status == RequestStatus.FINISHED_ABORTED and sched.num_waiting == 1
    assert sched.abort_request("a")  # in flight: update must skip it
    sched.update(out, [])
    assert a.status == RequestStatus.FINISHED_ABORTED and a.num_computed_tokens == 0
    assert a.block_ids == [] and sched.block_manager.num_free_blocks == 16
    assert not sched.abort_request("a") and not sched.abort_request("nope")
    out = sched.schedule()
    assert out.scheduled == [c]
    assert sched.abort_request("c") and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16


def test_impossible_requests_rejected():
    sched = make(num_blocks=4, max_model_len=32)  # pool holds 16 tokens
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(req("a", range(40), 1))
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request(req("b", range(10), 30))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(req("c", range(10), 7))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(Request("d", [1], SamplingParams(max_tokens=None)))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(req("e", []))
    sched.add_request(req("f", range(10), 6))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("f", range(3), 1))
    assert sched.num_waiting == 1


def test_config_validated():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


@pytest.mark.parametrize("window", [1, 5, 9])
def test_sliding_window_releases_blocks_outside_it(window):
    """With every layer sliding, blocks wholly before the next query's window go back to the
    pool (RELEASED in the table), so a 40-token request runs in 5 blocks of 4."""
    from numa_runtime.kv_cache.block_manager import RELEASED
    sched = make(num_blocks=5, budget=8, max_model_len=64, sliding_window=window)
    r = req("a", range(10), max_tokens=30)
    seen = []

    def check(sched, out):
        bm = sched.block_manager
        for q in sched.running:
            gone = max(0, q.num_computed_tokens - window + 1) // BS
            assert q.block_ids[:gone] == [RELEASED] * gone
            assert all(b >= 0 for b in q.block_ids[gone:])
            seen.append(gone)
        live = sum(1 for b in r.block_ids if b >= 0)
        assert live + bm.num_free_blocks == bm.num_blocks

    drive(sched, {0: [r]}, on_step=check)
    assert r.output_token_ids == expected_output(r)
    assert max(seen) >= (40 - window) // BS - 1  # blocks really were released along the way
    assert sched.block_manager.num_free_blocks == 5


def test_sliding_window_admission_counts_only_the_window():
    sched = make(num_blocks=5, budget=8, max_model_len=64, sliding_window=5)
    sched.add_request(req("fits", range(10), max_tokens=40))  # 50 tokens, 5 live blocks at most
    with pytest.raises(ValueError, match="KV blocks"):
        make(num_blocks=5, budget=8, max_model_len=64).add_request(req("x", range(10), max_tokens=40))


def test_sliding_window_chunks_only_what_the_pool_cannot_hold_beside_the_window():
    """Window 9, 6 blocks of 4, a budget of 64: a 20-token prompt fits the pool (5 blocks, +1 for a
    window's unaligned start) and is one chunk (the first cap made every prompt a few tokens a
    step); a 40-token one runs in chunks that fit beside the 8 tokens of window before each (20,
    then 12s), and its KV is its tokens throughout (FakeModel checks)."""
    sched = make(num_blocks=6, budget=64, max_model_len=128, sliding_window=9)
    short = req("short", range(20), max_tokens=1)
    assert [list(o.num_scheduled_tokens) for o in drive(sched, {0: [short]})] == [[20]]
    sched = make(num_blocks=6, budget=64, max_model_len=128, sliding_window=9)
    long = req("long", range(40), max_tokens=2)
    chunks = []
    drive(sched, {0: [long]}, on_step=lambda s, out: chunks.append(list(out.num_scheduled_tokens)))
    assert chunks[:3] == [[20], [12], [8]] and sum(c[0] for c in chunks) == 40 + 1
    assert long.output_token_ids == expected_output(long)


@pytest.mark.parametrize("window", [9, 13])
def test_sliding_window_prefix_hit_after_the_head_of_the_chain_was_evicted(window):
    """Every layer slides; a 30-token prompt and its 3 tokens leave 8 cached blocks, the released
    ones evictable first, so another request evicts the head of the chain. The prompt again plus
    3 tokens hits its first 32 tokens from the blocks of the window before them (2 or 3 blocks;
    RELEASED before them), and every query reads exactly its window's tokens (FakeModel checks).
    It found no hit once block 0 was gone."""
    from numa_runtime.kv_cache.block_manager import RELEASED
    sched = make(num_blocks=8, budget=64, max_model_len=128, sliding_window=window)
    bm = sched.block_manager
    a = req("a", range(30), max_tokens=3)
    b = req("b", list(range(30)) + expected_output(a) + [40, 41, 42], max_tokens=3)
    tables = []

    def check(sched, out):
        if b in out.scheduled and not tables:
            tables.append(list(b.block_ids))
            assert bm.hit_tokens == b.num_cached_tokens == 32 and b.num_computed_tokens == 32
            assert a.block_hashes[0] not in bm.hash_to_block and bm.num_evictions > 0

    drive(sched, {0: [a], 10: [req("x", range(500, 512), max_tokens=1)], 20: [b]}, on_step=check)
    need = -(-(window - 1) // BS)
    assert tables[0][:8 - need] == [RELEASED] * (8 - need) and RELEASED not in tables[0][8 - need:]
    assert b.output_token_ids == expected_output(b)
    assert bm.num_free_blocks == bm.num_blocks


def test_reserved_blocks_hold_back_admissions_but_not_running_requests():
    """Blocks reserved for a waiting scratch forward (an embedding) are not given to new
    requests; running requests still step (and free their blocks as they end)."""
    s = make(num_blocks=8, budget=16)
    s.add_request(req("a", range(8), max_tokens=4))   # 2 blocks, then 3
    s.schedule()
    s.block_manager.reserve("embedding", 5)          # 6 free: room for "b" (2) but not beside 5
    s.add_request(req("b", range(100, 108)))
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["a"] and s.num_waiting == 1
    s.block_manager.reserve("embedding", 0)
    out = s.schedule()
    assert sorted(r.request_id for r in out.scheduled) == ["a", "b"]


def test_reservations_of_two_owners_add_up_and_each_releases_its_own():
    """A waiting embedding and a waiting prompt_logprobs request each keep their blocks free:
    new admissions leave the sum free, and releasing one keeps the other's."""
    s = make(num_blocks=8, budget=16)
    bm = s.block_manager
    bm.reserve("embedding", 3)
    bm.reserve("prompt_logprobs", 4)
    assert bm.reserved_blocks == 7
    s.add_request(req("b", range(100, 108)))          # 2 blocks: 8 free, 7 of them reserved
    assert s.schedule().scheduled == [] and s.num_waiting == 1
    bm.reserve("embedding", 0)
    assert bm.reserved_blocks == 4
    assert [r.request_id for r in s.schedule().scheduled] == ["b"]


def test_a_request_that_arrived_earlier_queues_ahead_of_later_ones():
    """add_request orders the waiting queue by arrival: a request that waited outside the
    scheduler (a prompt_logprobs request waiting for KV room) goes ahead of those added after it,
    behind those added before it; equal arrivals (a request's n sequences) keep their order."""
    s = make(num_blocks=8, budget=16)
    early, later = req("early", range(8)), req("later", range(20, 28))
    late = [req(f"late{i}", range(40 + 8 * i, 48 + 8 * i)) for i in range(2)]
    early.arrival_time, later.arrival_time = 10.0, 12.0
    late[0].arrival_time = late[1].arrival_time = 11.0
    s.add_request(early)
    s.add_request(later)
    for r in late:
        s.add_request(r)
    assert [r.request_id for r in s.waiting] == ["early", "late0", "late1", "later"]
