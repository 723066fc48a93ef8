"""Decode bursts (EngineConfig.num_scheduler_steps, vLLM's multi-step scheduling): greedy decode
steps of up to 4 sequences run several steps per scheduling round (models/llama.py decode_burst,
engine._burst_len). The tokens, stops, finish reasons and prefix cache are those of one step per
round; bursts run only where nothing but timing changes."""
import numpy as np
import pytest

from models import build_model

from numa_runtime import Engine, SamplingParams
from numa_runtime import engine as engine_mod

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384, max_position_embeddings=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("burst"))
    build_model(d, arch="qwen2", **SHAPE)
    return d


class Counted:
    """The engine's runner with its bursts recorded: (sequences, steps) per execute_burst."""

    def __init__(self, eng):
        self.bursts, runner = [], eng.runner
        inner = runner.execute_burst

        def execute_burst(plan, steps):
            self.bursts.append((plan.num_seqs, steps))
            return inner(plan, steps)
        runner.execute_burst = execute_burst


def make(model_dir, steps, **kw):
    e = Engine(model_dir, dtype="bfloat16", quantization="int4", kv_cache_memory=1 << 24, max_model_len=256,
               num_scheduler_steps=steps, **kw)
    return e, Counted(e)


@pytest.fixture(scope="module")
def engines(model_dir):
    b, o = make(model_dir, 8), make(model_dir, 1)
    yield b, o
    b[0].close()
    o[0].close()


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 384, int(rng.integers(2, 30))).tolist() for _ in range(n)]


def run(eng, ps, sp):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in eng.generate(ps, sp)]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_burst_tokens_equal_one_step_per_round(engines, n):
    (b, cb), (o, co) = engines
    sp = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True)
    ps = prompts(n, n)
    cb.bursts.clear()
    assert run(b, ps, sp) == run(o, ps, sp)
    assert cb.bursts and all(s <= n and 2 <= k <= 8 for s, k in cb.bursts), cb.bursts
    assert not co.bursts
    # 29 tokens: the last burst is cut to the tokens left (no step past max_tokens)
    assert sum(k for s, k in cb.bursts if s == 1) <= 29


def test_stops_inside_a_burst_end_where_one_step_ends(engines):
    """A stop token id, a stop string and eos each land in the middle of a burst: the output
    ends at the stop as one step per round ends it, with the same finish reason."""
    (b, cb), (o, _) = engines
    p = prompts(1, 7)
    want = run(o, p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    ids, text = want[0], want[1]
    cases = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[5]]),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[len(text) // 2:len(text) // 2 + 3]])]
    for sp in cases:
        cb.bursts.clear()
        got = run(b, p, sp)
        assert got == run(o, p, sp), sp
        assert len(got[0][0]) < 24 and got[0][2] == "stop", got
        assert cb.bursts
    # the model's eos on the 6th token: the same stop (eos ids are the tokenizer's and the config's)
    eos = ids[5]
    for e in (b, o):
        e.eos_ids.add(eos)
    try:
        sp = SamplingParams(temperature=0, max_tokens=24)
        got = run(b, p, sp)
        assert got == run(o, p, sp) and got[0][2] == "stop"
    finally:
        for e in (b, o):
            e.eos_ids.discard(eos)


def test_the_prefix_cache_after_a_burst_serves_the_same_blocks(engines):
    """The blocks a burst filled are hashed as one step per round hashes them: a prompt that
    repeats a burst-decoded sequence hits the same cached blocks and decodes the same tokens as
    the same two requests one step per round."""
    (b, cb), (o, _) = engines
    p = prompts(1, 11)[0]
    sp, sp8 = (SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (40, 8))
    cb.bursts.clear()
    first = [e.generate(p, sp)[0].outputs[0].token_ids for e in (b, o)]
    assert first[0] == first[1] and cb.bursts
    again = p + first[0][:36]
    got = [e.generate(again, sp8)[0] for e in (b, o)]
    assert got[0].num_cached_tokens == got[1].num_cached_tokens >= 32
    assert got[0].outputs[0].token_ids == got[1].outputs[0].token_ids


def test_no_burst_where_it_would_change_more_than_timing(engines, monkeypatch):
    """Sampling with temperature, logprobs, penalties, bias and min_tokens run one step per round;
    so do 5 sequences (past the fused head's 4 rows), a round with a request waiting, and any
    round when bursts would last longer than BURST_SECONDS."""
    (b, cb), (o, _) = engines
    p = prompts(1, 3)
    for sp in (SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={7: 3.0}),
               SamplingParams(temperature=0, max_tokens=12, min_tokens=12)):
        cb.bursts.clear()
        assert run(b, p, sp) == run(o, p, sp), sp
        assert not cb.bursts, sp
    cb.bursts.clear()
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert run(b, prompts(5, 5), sp) == run(o, prompts(5, 5), sp)
    assert all(s <= 4 for s, _ in cb.bursts)  # only once some of the 5 finished
    # max_num_seqs 1: the second request waits while the first decodes, so the first decodes one
    # step a round; the second, alone, bursts (its 9 tokens after the one of its prefill at most)
    (w, cw), (w1, _) = make(b.model_config.model_dir, 8, max_num_seqs=1), make(b.model_config.model_dir, 1, max_num_seqs=1)
    try:
        ps = prompts(2, 9)
        assert run(w, ps, sp) == run(w1, ps, sp)
        assert 0 < sum(k for _, k in cw.bursts) <= 9, cw.bursts
    finally:
        w.close()
        w1.close()
    monkeypatch.setattr(engine_mod, "BURST_SECONDS", 0.0)
    cb.bursts.clear()
    assert run(b, p, sp) == run(o, p, sp)
    assert not cb.bursts


def test_num_scheduler_steps_is_checked(model_dir):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        Engine(model_dir, num_scheduler_steps=0)
