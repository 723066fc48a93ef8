"""kv_cache_dtype="int8": the option, its KV sizing, its accuracy against f32 and bf16 KV on a
random model, the disk tier with int8 blocks, and the server flag."""
import logging
import os

import numpy as np
import pytest

from models import build_model
from test_server import ServerProcess

from numa_runtime import Engine, SamplingParams
from numa_runtime.config import EngineConfig

L, HK, D, BS = 2, 2, 16, 16  # BASE in models.py: 2 layers, 4 heads / 2 kv heads, hidden 64
TEXT = list(range(3, 250))   # a teacher-forced prompt over many blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv_int8")
    build_model(str(d), arch="llama")
    return str(d)


def engine(model_dir, kv, dtype="float32", **kw):
    kw = {"kv_cache_memory": 1 << 22, "max_model_len": 256, **kw}
    return Engine(model_dir, dtype=dtype, kv_cache_dtype=kv, **kw)


@pytest.fixture(scope="module")
def engines(model_dir):
    """One f32 engine per KV dtype (the f32 one is the exact reference)."""
    es = {kv: engine(model_dir, kv) for kv in ("float32", "bfloat16", "int8")}
    yield es
    for e in es.values():
        e.close()


def test_same_budget_holds_more_int8_blocks(model_dir, caplog):
    # bf16 rows: 2 x D bytes; int8 rows: D values + a 4-byte f32 scale
    budget = 1 << 20
    want = {"bfloat16": 2 * L * BS * HK * 2 * D, "int8": 2 * L * BS * HK * (D + 4)}
    blocks = {}
    for kv in ("bfloat16", "int8"):
        with caplog.at_level(logging.INFO, logger="numa_runtime"):
            e = engine(model_dir, kv, dtype="bfloat16", kv_cache_memory=budget)
        assert e.runner.bytes_per_block == want[kv]
        blocks[kv] = e.runner.num_blocks
        assert blocks[kv] == budget // want[kv]
        assert e.summary()["kv_cache_dtype"] == kv
        assert f"KV cache ({kv}): {blocks[kv]} blocks of 16 tokens" in caplog.text
        e.close()
    assert blocks["int8"] / blocks["bfloat16"] == pytest.approx(2 * D / (D + 4), rel=0.01)
    auto = engine(model_dir, "auto", dtype="bfloat16")
    assert auto.summary()["kv_cache_dtype"] == "bfloat16"
    auto.close()


def test_prompt_logprob_drift_is_of_bf16_order(engines):
    """Teacher-forced log-probs (prefill reads its own rows back from the cache): int8 KV moves
    them from f32 KV's more than bf16 KV does (its steps are coarser: max |x| / 127 per row),
    but by no more than a few times as much, and by little."""
    exact = engines["float32"].prompt_logprobs(TEXT)
    drift = {kv: np.abs(engines[kv].prompt_logprobs(TEXT) - exact) for kv in ("bfloat16", "int8")}
    assert drift["bfloat16"].mean() < drift["int8"].mean() < 6 * drift["bfloat16"].mean()
    assert drift["int8"].mean() < 0.1 and drift["int8"].max() < 0.5


def test_greedy_decode_on_int8_kv_matches_teacher_forcing(engines):
    """Decode steps read the int8 cache row by row: each generated token's log-prob is close to
    the one f32 KV gives the same tokens (teacher-forced)."""
    prompt = [1, 17, 42, 99, 5]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    out = engines["int8"].generate([prompt], params)[0].outputs[0]
    lp8 = np.array([x[0] for x in out.logprob_pairs])                                # [40]
    ref = engines["float32"].prompt_logprobs(prompt + list(out.token_ids))[len(prompt) - 1:]
    assert len(out.token_ids) == 40
    assert np.abs(lp8 - ref).max() < 0.25


def test_prefix_cache_hits_on_int8_blocks(engines):
    e = engines["int8"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = e.generate([TEXT[:70]], params)[0]
    hits = e.block_manager.hit_tokens
    second = e.generate([TEXT[:70]], params)[0]
    assert e.block_manager.hit_tokens - hits >= 64 and first.token_ids == second.token_ids


@pytest.mark.parametrize("bad", ["fp8", "float16", "int4", None])
def test_bad_kv_cache_dtype_is_one_sentence(bad):
    with pytest.raises(ValueError, match=r"^kv_cache_dtype must be 'auto', 'bfloat16', 'float32' or "
                                         r"'int8', got .*\.$"):
        EngineConfig(kv_cache_dtype=bad)


def test_kv_dtype_resolution_and_cuda_refusal():
    assert EngineConfig(dtype="float32").kv_dtype == "float32"
    assert EngineConfig(dtype="bfloat16", kv_cache_dtype="auto").kv_dtype == "bfloat16"
    assert EngineConfig(dtype="float32", kv_cache_dtype="bf16").kv_dtype == "bfloat16"
    assert EngineConfig(kv_cache_dtype="int8").kv_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' has no CUDA kernel yet"):
        EngineConfig(device="cuda", kv_cache_dtype="int8")
    assert EngineConfig(device="cuda", kv_cache_dtype="bfloat16").kv_dtype == "bfloat16"


def test_disk_tier_keeps_int8_blocks_and_their_scales(model_dir, tmp_path):
    """Evicted int8 blocks go to disk with their scales and come back after a restart: the same
    tokens as int8 KV without any cache; bf16 and int8 files never mix."""
    prompts = [list(range(s, s + n)) for s, n in ((3, 40), (50, 52), (110, 33))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = engine(model_dir, "int8", enable_prefix_caching=False)
    expected = [plain.generate([p], params)[0].token_ids for p in prompts]
    plain.close()

    def disk(kv, max_len=96):  # NOTE: 6 int8 blocks, 3 bf16 ones: a context the pool holds
        return engine(model_dir, kv, kv_cache_memory=6 * 2 * L * BS * HK * (D + 4), max_model_len=max_len,
                      kv_cache_dir=str(tmp_path), kv_cache_disk_load="always")
    first = disk("int8")
    assert [first.generate([p], params)[0].token_ids for p in prompts] == expected
    assert first.block_manager.num_evictions > 0
    first.close()
    second = disk("int8")
    assert len(second.block_manager.tier) == sum((len(p) + 5) // 16 for p in prompts)
    assert [second.generate([p], params)[0].token_ids for p in prompts] == expected
    assert second.block_manager.tier_hit_blocks == sum((len(p) - 1) // 16 for p in prompts)
    second.close()
    other = disk("bfloat16", 48)  # another fingerprint: it finds none of the int8 files
    assert len(other.block_manager.tier) == 0 and other.runner.disk.dir != second.runner.disk.dir
    other.close()


def test_serve_kv_cache_dtype_flag(model_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    e = engine(model_dir, "int8", kv_cache_memory=1 << 23, max_model_len=128)
    expected = e.generate([[1, 17, 42, 99, 5]], params)[0].outputs[0].text
    e.close()
    srv = ServerProcess(["--model", model_dir, "--dtype", "float32", "--max-model-len", "128",
                         "--kv-cache-memory", str(1 << 23), "--kv-cache-dtype", "int8"])
    try:
        r = srv.client().completions.create(model=os.path.basename(model_dir), prompt=[1, 17, 42, 99, 5],
                                            max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    finally:
        code = srv.stop()
    assert code == 0, srv.output()
    assert "KV cache (int8)" in srv.output()
    assert r.choices[0].text == expected
