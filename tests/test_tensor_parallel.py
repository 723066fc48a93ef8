"""Tensor parallel under real mpirun: greedy tokens on 2, 3 and 4 ranks equal one rank's, which
equal transformers' (float32), for head layouts that split unevenly."""
import json
import os
import subprocess
import sys

import pytest

from models import build_model, hf_greedy

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROMPTS = [[1, 17, 42, 99, 5], list(range(3, 30))]
MAX_TOKENS = 48

# vocab 383 and intermediate 90/100 divide by none of the rank counts: padded vocab chunks and
# uneven MLP columns everywhere.
LAYOUTS = {
    # the default model's layout (SmolLM2-135M): 9 heads / 3 kv heads, 6 + 3 on two ranks
    "9h3kv": dict(arch="llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                  intermediate_size=100, vocab_size=383),
    # Qwen2.5-0.5B's layout: 14 heads / 2 kv heads (3 and 4 ranks replicate kv heads unevenly)
    "14h2kv": dict(arch="qwen2", num_attention_heads=14, num_key_value_heads=2, hidden_size=112,
                   intermediate_size=90, vocab_size=383),
    "4h1kv_mqa": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=1, hidden_size=64,
                      intermediate_size=90, vocab_size=383),
    # Phi-3: fused qkv_proj and gate_up_proj, split at load and then by rank; partial rotary
    "phi3_6h2kv": dict(arch="phi3", num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                       intermediate_size=90, vocab_size=383, partial_rotary_factor=0.75),
    # mixture of experts: 5 experts of 44 columns (2 a token) and a shared expert of 50, split over
    # the ranks column-wise; the middle layer's MLP dense (mlp_only_layers)
    "qwen2moe_6h2kv": dict(arch="qwen2_moe", num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                           intermediate_size=90, vocab_size=383, num_hidden_layers=3, num_experts=5,
                           num_experts_per_tok=2, moe_intermediate_size=44, shared_expert_intermediate_size=50,
                           mlp_only_layers=[1]),
}


def _env() -> dict:
    return dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_mpi(n, model_dir, dtype="float32", max_tokens=MAX_TOKENS, timeout=300, extra=()):
    cmd = ["mpirun", "-np", str(n), sys.executable, os.path.join(HERE, "mpi", "engine_generate.py"),
           model_dir, dtype, str(max_tokens), json.dumps(PROMPTS), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(line) == 1, p.stdout[-3000:]  # only rank 0 prints
    return json.loads(line[0][7:]), p.stderr


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def single(request, tmp_path_factory):
    """(layout, model dir, one rank's greedy tokens), checked against transformers once per layout."""
    path = str(tmp_path_factory.mktemp(request.param))
    ref = build_model(path, **LAYOUTS[request.param])
    one, _ = run_mpi(1, path)
    assert one["world"] == 1
    assert one["tokens"] == [hf_greedy(ref, p, MAX_TOKENS) for p in PROMPTS]
    return request.param, path, one["tokens"]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_tp_greedy_equals_one_rank(single, ranks):
    layout, path, tokens = single
    multi, log = run_mpi(ranks, path)
    assert multi["world"] == ranks
    assert multi["tokens"] == tokens
    # rank 0 logs every rank's share at start-up
    shares = [l for l in log.splitlines() if "tensor parallel: rank " in l]
    assert [l.split("tensor parallel: ")[1].split(" holds")[0] for l in shares] == [
        "rank %d/%d" % (r, ranks) for r in range(ranks)]
    if (layout, ranks) == ("9h3kv", 2):  # whole kv heads with their query heads: 6 + 3
        assert "rank 0/2 holds q heads 0-5 (6), kv heads 0-1 (2)" in log
        assert "rank 1/2 holds q heads 6-8 (3), kv heads 2-2 (1)" in log


@pytest.mark.parametrize("single", ["9h3kv"], indirect=True)
def test_tp_int8_kv_equals_one_rank(single):
    # each rank quantizes the rows of its own kv heads (6 + 3 heads: 2 + 1 kv heads)
    _, path, _ = single
    one, _ = run_mpi(1, path, extra=["kv_cache_dtype=int8"])
    multi, log = run_mpi(2, path, extra=["kv_cache_dtype=int8"])
    assert one["kv_cache_dtype"] == multi["kv_cache_dtype"] == "int8" and "KV cache (int8)" in log
    assert multi["tokens"] == one["tokens"]


def test_more_ranks_than_heads(tmp_path):
    build_model(str(tmp_path), arch="llama", num_attention_heads=2, num_key_value_heads=1,
                hidden_size=32)
    # asked for one model over 3 ranks: a clear error
    cmd = ["mpirun", "-np", "3", sys.executable, os.path.join(HERE, "mpi", "engine_generate.py"),
           str(tmp_path), "float32", "4", json.dumps(PROMPTS), "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode != 0
    assert "Cannot split 2 attention heads over 3 ranks; use 1 to 2 ranks" in p.stdout + p.stderr
    # not asked: the default rule runs replicas, and says why
    multi, log = run_mpi(3, str(tmp_path), max_tokens=4)
    one, _ = run_mpi(1, str(tmp_path), max_tokens=4)
    assert multi["data_parallel"] == 3 and multi["tokens"] == one["tokens"]
    assert "3 ranks exceed the model's 2 attention heads: 3 replicas of 1 rank(s)" in log


@pytest.mark.parametrize("single", ["9h3kv"], indirect=True)
@pytest.mark.parametrize("ranks", [2, 4])
def test_data_parallel_greedy_equals_one_rank(single, ranks):
    # two replicas: of one rank each (2 ranks), of two tensor-parallel ranks each (4 ranks)
    _, path, tokens = single
    multi, log = run_mpi(ranks, path, extra=["2"])
    assert multi["world"] == ranks and multi["data_parallel"] == 2
    assert multi["routed"] == [1, 1]  # one prompt per replica: the least loaded took each
    assert [r["replica"] for r in multi["per_rank"]] == [r * 2 // ranks for r in range(ranks)]
    assert multi["tokens"] == tokens
    assert "parallel: 2 replica(s) x %d tensor-parallel rank(s) (asked for)" % (ranks // 2) in log
    if ranks == 4:  # NOTE: each replica's leader logged the shares: every line twice
        assert log.count("tensor parallel: rank 0/2") == 1 and log.count("tensor parallel: rank 1/2") == 1, log


def test_chat_cli_under_mpirun_says_a_bad_value_once():
    cmd = ["mpirun", "-np", "2", sys.executable, "-m", "numa_runtime", "hi", "--max-tokens", "0"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert p.returncode == 2 and p.stderr.count("error: max_tokens must be") == 1, p.stderr


def test_readme_command_on_two_ranks_with_the_default_model():
    # The default model (SmolLM2-135M: 9 heads / 3 kv heads) split 6 + 3 over two ranks
    cmd = ["mpirun", "-np", "2", sys.executable, "-m", "numa_runtime", "What is the capital of France?",
           "--max-tokens", "12"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "rank 0/2 holds q heads 0-5 (6), kv heads 0-1 (2)" in p.stderr
    assert "Paris" in p.stdout, p.stdout
