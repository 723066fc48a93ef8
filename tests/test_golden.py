"""Golden tests: the Engine's greedy tokens equal Hugging Face transformers' in float32."""
import os

import numpy as np
import pytest

from models import build_model, hf_greedy

from numa_runtime import Engine, SamplingParams

BACKEND = os.environ.get("NUMA_RUNTIME_TEST_BACKEND", "cpu")
PROMPTS = [[1, 17, 42, 99, 5], [1, 300, 7], list(range(3, 40)), [1, 200]]

CASES = {
    "llama-gqa": dict(arch="llama"),
    "llama-mqa-headdim24": dict(arch="llama", num_key_value_heads=1, head_dim=24),
    "llama-mha-tied": dict(arch="llama", num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope": dict(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                        rope_theta=500000.0),
    "llama-linear-rope-bias": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0},
                                   attention_bias=True, mlp_bias=True),
    "mistral": dict(arch="mistral", sliding_window=None),
    "qwen2-bias-tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3-qknorm": dict(arch="qwen3", head_dim=32),
    # sliding windows shorter than the prompts + 64 new tokens, so the window changes tokens
    "mistral-sliding": dict(arch="mistral", sliding_window=7),
    "qwen2-sliding-upper-layers": dict(arch="qwen2", use_sliding_window=True, sliding_window=5,
                                       max_window_layers=1),
    # Phi-3: fused qkv_proj/gate_up_proj; Phi-4-mini's partial rotary with longrope (short factors,
    # its attention factor from max/original positions); Phi-3-mini-4k's window on every layer
    "phi3-tied": dict(arch="phi3", tie_word_embeddings=True),
    "phi3-longrope-partial": dict(arch="phi3", partial_rotary_factor=0.75, max_position_embeddings=4096,
                                  original_max_position_embeddings=256, rope_scaling={
                                      "rope_type": "longrope", "short_factor": [1.0, 1.3, 2.0, 3.5, 6.0, 9.0],
                                      "long_factor": [1.5, 2.0, 4.0, 8.0, 16.0, 30.0]}),
    "phi3-sliding": dict(arch="phi3", sliding_window=7),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers_f32(tmp_path, case):
    kw = dict(CASES[case])
    ref = build_model(str(tmp_path), **kw)
    expected = [hf_greedy(ref, p, 64) for p in PROMPTS]
    eng = Engine(str(tmp_path), dtype="float32", backend=BACKEND, kv_cache_memory=1 << 24,
                 max_model_len=256)
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for p, o, e in zip(PROMPTS, outs, expected):
        assert o.token_ids == e, f"{case}: prompt {p} diverged"
        assert o.finish_reason == "length"


def test_a_longrope_context_ends_at_the_original_length(tmp_path):
    """LongRoPE runs its short factors: the context stops where transformers would switch to the
    long ones, and a longer max_model_len is refused saying so."""
    build_model(str(tmp_path), **CASES["phi3-longrope-partial"])
    eng = Engine(str(tmp_path), dtype="float32", kv_cache_memory=1 << 22)
    assert eng.max_model_len == 256
    eng.close()
    with pytest.raises(ValueError, match=r"max_model_len=512 exceeds what the model supports \(256 tokens\) \(its "
                                         "longrope scaling runs with the short factors"):
        Engine(str(tmp_path), dtype="float32", kv_cache_memory=1 << 22, max_model_len=512)


@pytest.mark.parametrize("ckpt_dtype", ["bfloat16", "float16"])
def test_half_checkpoints_load_exactly(tmp_path, ckpt_dtype):
    ref = build_model(str(tmp_path), arch="llama", dtype=ckpt_dtype)
    expected = [hf_greedy(ref, p, 64) for p in PROMPTS[:2]]
    eng = Engine(str(tmp_path), dtype="float32", backend=BACKEND, kv_cache_memory=1 << 24, max_model_len=256)
    outs = eng.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def test_bf16_logits_close_to_f32(tmp_path):
    """bf16 weights + bf16 KV: the first-step logits stay within a stated tolerance of f32."""
    import torch
    ref = build_model(str(tmp_path), arch="qwen2")
    prompt = PROMPTS[2]
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0, -1].numpy()
    eng = Engine(str(tmp_path), dtype="bfloat16", backend=BACKEND, kv_cache_memory=1 << 24, max_model_len=256)
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    lp = np.log(np.exp(want - want.max()) / np.exp(want - want.max()).sum())
    got_top = {t: v.logprob for t, v in out.logprobs[0].items()}
    # NOTE: tolerance: bf16 has 8 mantissa bits; over 2 layers the log-probs of the top
    # tokens stay within 0.15 nats of the f32 reference on this model.
    for tok, val in got_top.items():
        assert abs(val - lp[tok]) < 0.15, (tok, val, lp[tok])
    assert int(np.argmax(want)) in got_top


def test_prompt_logprobs_match_transformers_f32(tmp_path):
    """Engine.prompt_logprobs: log p(token i | tokens < i) for i >= 1, as transformers computes it."""
    import torch
    ref = build_model(str(tmp_path), arch="qwen2", tie_word_embeddings=True)
    prompt = PROMPTS[2]
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].double(), dim=-1)
    want = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()
    eng = Engine(str(tmp_path), dtype="float32", backend=BACKEND, kv_cache_memory=1 << 24, max_model_len=64)
    got = eng.prompt_logprobs(prompt)
    assert got.shape == (len(prompt) - 1,)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="prompt_logprobs needs 2 to 64 tokens"):
        eng.prompt_logprobs(list(range(3, 70)))
    eng.close()
