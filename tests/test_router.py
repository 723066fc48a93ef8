"""Data-parallel routing on rank 0 (router.py) without a model, and the replica-count rule."""
import pytest

from numa_runtime.config import EngineConfig, ParallelConfig
from numa_runtime.kv_cache import BlockManager
from numa_runtime.request import Request, RequestStatus
from numa_runtime.router import ReplicaRouter
from numa_runtime.sampling_params import SamplingParams
from numa_runtime.scheduler import Scheduler, SchedulerConfig

BS = 4


def router(n=2, num_blocks=16, max_num_seqs=4, max_len=64):
    return ReplicaRouter([Scheduler(SchedulerConfig(max_num_seqs, max_len, max_len), BlockManager(num_blocks, BS))
                          for _ in range(n)])


def req(rid, tokens, max_tokens=2):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def run_to_end(rt, reqs):
    """Step until every request has max_tokens outputs (token 5 each), then finish them."""
    while any(len(r.output_token_ids) < r.sampling_params.max_tokens for r in reqs):
        out = rt.schedule()
        rt.update(out, [5] * len(out.sampling))
        for r in out.sampling:
            if len(r.output_token_ids) == r.sampling_params.max_tokens:
                rt.finish_request(r, RequestStatus.FINISHED_LENGTH)


def test_new_requests_go_to_the_least_loaded_replica():
    rt = router(3)
    for i in range(7):
        rt.add_request(req(str(i), range(100 * i, 100 * i + 5)))
    assert [rt.where[str(i)] for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert rt.num_waiting == 7 and rt.routed == [3, 2, 2]


def test_new_requests_avoid_a_replica_whose_blocks_an_embedding_reserved():
    """Replica 0's blocks are reserved for a waiting embedding (it admits nothing new meanwhile):
    new requests go to the other replicas, also when replica 0 caches their prefix."""
    rt = router(2)
    a = req("a", range(0, 13))
    rt.add_request(a)
    run_to_end(rt, [a])                       # replica 0 caches a's prefix
    rt.replicas[0].block_manager.reserve("embedding", 16)  # all of them: no room for a new prompt
    for i in range(3):
        rt.add_request(req(f"b{i}", range(0, 13)))
    assert [rt.where[f"b{i}"] for i in range(3)] == [1, 1, 1]


def test_long_prompts_spread_over_the_replicas():
    """Long and short prompts alternating: with equal sequence counts the replica holding fewer
    tokens takes the next one (every long prompt went to replica 0, whose pool filled while
    replica 1's stayed a third used)."""
    rt = router(2, num_blocks=64)
    for i in range(8):
        rt.add_request(req(str(i), range(1000 * i, 1000 * i + (60 if i % 2 == 0 else 3))))
    longs = [rt.where[str(i)] for i in range(0, 8, 2)]
    assert sorted(longs) == [0, 0, 1, 1], rt.where
    assert abs(rt.tokens(0) - rt.tokens(1)) <= 60


def test_a_conversation_sticks_to_the_replica_caching_its_prefix():
    rt = router(2, num_blocks=128, max_len=256)
    turn1 = req("a1", range(1, 150))  # 149 tokens: 37 full blocks once computed
    rt.add_request(turn1)
    assert rt.where["a1"] == 0
    run_to_end(rt, [turn1])
    assert not rt.has_unfinished() and rt.where == {}
    for rid, to in (("b", 0), ("c", 1), ("d", 0)):  # least loaded, ties to the lowest index
        rt.add_request(req(rid, range(100 * ord(rid), 100 * ord(rid) + 5)))
        assert rt.where[rid] == to
    # the next turn repeats the conversation so far: replica 0 holds its prefix, though
    # replica 1 is less loaded
    turn2 = req("a2", turn1.all_token_ids + [7, 8, 9])
    rt.add_request(turn2)
    assert rt.where["a2"] == 0 and rt.routed_by_prefix == 1
    out = rt.schedule()
    assert turn2 in out.scheduled
    assert rt.replicas[0].block_manager.hit_tokens == 148  # served by the prefix cache


def test_a_short_shared_system_prompt_does_not_pile_chats_onto_one_replica():
    """Every chat of the default model starts with its template's system prompt (a block or two,
    cached on replica 0): all went to replica 0 while replica 1 idled. A prefix of a few blocks
    is worth less than a sequence more on its replica: the chats spread."""
    rt = router(2, num_blocks=64, max_num_seqs=8)
    system = list(range(1, 17))  # 4 blocks of 4
    first = req("s", system + [99, 98])
    rt.add_request(first)
    run_to_end(rt, [first])
    for i in range(8):
        rt.add_request(req(f"c{i}", system + [200 + i, 300 + i, 400 + i]))
    assert rt.routed == [5, 4] and sorted(rt.where.values()) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_full_replica_sends_the_conversation_elsewhere():
    rt = router(2, max_num_seqs=2)
    turn1 = req("a1", range(1, 14))
    rt.add_request(turn1)
    run_to_end(rt, [turn1])
    for rid, to in (("x", 0), ("y", 1), ("z", 0)):  # replica 0, which caches a1, is full now
        rt.add_request(req(rid, range(100 * ord(rid), 100 * ord(rid) + 5)))
        assert rt.where[rid] == to
    rt.add_request(req("a2", turn1.all_token_ids + [7]))
    assert rt.where["a2"] == 1 and rt.routed_by_prefix == 0


def test_a_replica_whose_free_blocks_are_the_prefix_hits_has_no_room():
    """Replica 0 caches a conversation's 6 blocks (evictable: free) and runs another request; the
    next turn needs 3 blocks beside its 6 hits, and replica 0 has only 1 block that is neither a
    hit nor in use: it goes to the idle replica 1 (it waited on replica 0 for the other to end)."""
    rt = router(2, num_blocks=10)
    turn1 = req("a1", range(1, 25))                       # 24 tokens: 6 full blocks, cached
    rt.add_request(turn1)
    run_to_end(rt, [turn1])
    other = req("o", range(200, 212), max_tokens=8)       # 3 blocks on replica 0
    rt.add_request(other)
    rt.replicas[1].add_request(req("gone", range(500, 502)))  # NOTE: so "o" lands on replica 0
    assert rt.where["o"] == 0
    rt.replicas[1].abort_request("gone")
    rt.schedule()
    turn2 = req("a2", turn1.all_token_ids + list(range(30, 39)))  # 35 tokens: 9 blocks, 6 cached
    rt.add_request(turn2)
    assert rt.where["a2"] == 1 and rt.routed_by_prefix == 0


def test_a_request_id_in_use_on_any_replica_is_refused():
    """Each replica knows only its own ids: a duplicate went to the other replica, and its outputs
    were taken for the first request's (then a KeyError)."""
    rt = router(2)
    rt.add_request(req("x", range(1, 5)))
    with pytest.raises(ValueError, match="Request id 'x' is already in use"):
        rt.add_request(req("x", range(9, 12)))
    assert rt.where == {"x": 0} and rt.num_waiting == 1


def test_outputs_and_updates_follow_replica_order():
    rt = router(2)
    a, b, c = req("a", range(1, 4)), req("b", range(10, 16)), req("c", range(20, 22))
    for r in (a, b, c):
        rt.add_request(r)
    out = rt.schedule()
    assert [len(p.token_ids) for p in out.plan] == [3 + 2, 6]
    assert out.sampling == [a, c, b] and out.scheduled == [a, c, b]
    rt.update(out, [11, 12, 13])
    assert (a.output_token_ids, c.output_token_ids, b.output_token_ids) == ([11], [12], [13])
    assert rt.abort_request("b") and not rt.abort_request("b") and "b" not in rt.where
    s = rt.stats()
    assert s["num_running"] == 2 and s["routed"] == [2, 1] and len(s["replicas"]) == 2
    assert 0 < s["kv_usage"] == rt.block_manager.usage < 1


def test_parallel_config_rule_and_errors():
    p = ParallelConfig.resolve(4, None, num_heads=9, max_num_seqs=64)
    assert (p.data_parallel, p.tensor_parallel) == (1, 4) and "tensor parallel" in p.reason
    p = ParallelConfig.resolve(16, None, num_heads=9, max_num_seqs=64)  # TP cannot use 16 ranks
    assert (p.data_parallel, p.tensor_parallel) == (2, 8) and "exceed" in p.reason
    p = ParallelConfig.resolve(4, 2, num_heads=9, max_num_seqs=64)
    assert [p.replica_of(r) for r in range(4)] == [0, 0, 1, 1] and p.leader_of(1) == 2
    with pytest.raises(ValueError, match="data_parallel=3 does not divide the 4 MPI rank"):
        ParallelConfig.resolve(4, 3, num_heads=9, max_num_seqs=64)
    with pytest.raises(ValueError, match="data_parallel=2 does not divide the 1 MPI rank"):
        ParallelConfig.resolve(1, 2, num_heads=9, max_num_seqs=64)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="data_parallel must be a positive integer"):
            EngineConfig(data_parallel=bad)


def test_asked_replicas_against_the_launchers(monkeypatch):
    """An Engine's data_parallel and numa-launch's NUMA_RUNTIME_DATA_PARALLEL that disagree are
    refused (the argument silently won); errors name the setting that asked."""
    from numa_runtime.config import asked_replicas
    monkeypatch.delenv("NUMA_RUNTIME_DATA_PARALLEL", raising=False)
    assert asked_replicas(None) == (None, "") and asked_replicas(2) == (2, "data_parallel=2")
    monkeypatch.setenv("NUMA_RUNTIME_DATA_PARALLEL", "1")
    assert asked_replicas(None) == (1, "NUMA_RUNTIME_DATA_PARALLEL=1 (set by numa-launch --dp or --tp)")
    assert asked_replicas(1, "--data-parallel {}") == (1, "--data-parallel 1")
    with pytest.raises(ValueError, match=r"^data_parallel=2 and NUMA_RUNTIME_DATA_PARALLEL=1 \(set by numa-launch "
                                         r"--dp or --tp\) disagree; drop data_parallel or launch with numa-launch "
                                         r"--dp 2\.$"):
        asked_replicas(2)
    with pytest.raises(ValueError, match=r"^NUMA_RUNTIME_DATA_PARALLEL=2 \(set by numa-launch --dp or --tp\) does not "
                                         r"divide the 1 "):
        ParallelConfig.resolve(1, 2, num_heads=9, max_num_seqs=64,
                               asked_as="NUMA_RUNTIME_DATA_PARALLEL=2 (set by numa-launch --dp or --tp)")


def test_the_router_knows_every_replicas_request_ids():
    """Engine._id_taken reads the scheduler's `requests`; the router had none, so an automatic id
    could take one a caller had given ("0#0" of an n=2 request: 'already in use')."""
    rt = router(2)
    rt.add_request(req("0#0", range(1, 6)))
    rt.add_request(req("x", range(50, 56)))
    assert "0#0" in rt.requests and "x" in rt.requests and "y" not in rt.requests
    assert {rt.where["0#0"], rt.where["x"]} == {0, 1}


def test_models_dir_expands_a_home_path(tmp_path, monkeypatch):
    """`--models-dir=~/models` reaches serve unexpanded (bash leaves ~ after =): it was 'not a
    directory', where --model's expands."""
    from numa_runtime.serve.router import model_paths_in_dir
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "a.gguf").write_bytes(b"")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_paths_in_dir("~/models") == [str(tmp_path / "models" / "a.gguf")]


def test_models_dir_names_what_it_leaves_out(tmp_path, caplog):
    """A broken .gguf link and the parts of a split model without its first file were left out
    without a word; hidden entries (.cache) were served as models."""
    from numa_runtime.serve.router import model_paths_in_dir
    d = tmp_path / "models"
    d.mkdir()
    (d / "a.gguf").write_bytes(b"")
    (d / "broken.gguf").symlink_to(tmp_path / "nowhere.gguf")
    (d / "s-00002-of-00002.gguf").write_bytes(b"")
    (d / ".cache").mkdir()
    (d / ".cache" / "config.json").write_text("{}")
    assert model_paths_in_dir(str(d)) == [str(d / "a.gguf")]
    assert f"{d / 'broken.gguf'} is not a readable file (a broken link?); it is not served" in caplog.text
    assert (f"{d / 's-00002-of-00002.gguf'} is part 2 of a split GGUF model whose first file is missing; it is "
            "not served") in caplog.text
    assert ".cache" not in caplog.text
