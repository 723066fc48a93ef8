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
    # mixture of experts: 6 experts, 2 a token (every row of a step routes its own way);
    # Qwen3-MoE renormalized with a dense first layer (mlp_only_layers), Qwen2-MoE's shared expert
    # under its sigmoid gate, not renormalized, its sparse layers every second one; Mixtral's
    # block_sparse_moe.experts.N.w1/w2/w3
    "qwen3-moe": dict(arch="qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=3, head_dim=32),
    "qwen2-moe-shared": dict(arch="qwen2_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48, decoder_sparse_step=2, num_hidden_layers=3),
    "mixtral": dict(arch="mixtral", num_local_experts=6, num_experts_per_tok=2, sliding_window=None),
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


def test_a_moe_model_in_bf16_and_on_cuda(tmp_path):
    """A bf16 engine runs the experts on bf16 weights (the logits near the f32 engine's); the CUDA
    backend, which has no expert kernels, refuses the model in one sentence before touching a GPU."""
    from numa_runtime.config import UnsupportedModelError
    build_model(str(tmp_path), **CASES["qwen3-moe"])
    f32 = Engine(str(tmp_path), dtype="float32", kv_cache_memory=1 << 24, max_model_len=256)
    bf16 = Engine(str(tmp_path), dtype="bfloat16", kv_cache_memory=1 << 24, max_model_len=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
        a, b = (e.generate([PROMPTS[2]], params)[0] for e in (f32, bf16))
        assert a.token_ids == b.token_ids
        top_a, top_b = a.logprobs[0], b.logprobs[0]
        both = set(top_a) & set(top_b)
        assert both and all(abs(top_a[t].logprob - top_b[t].logprob) < 0.1 for t in both)
    finally:
        f32.close()
        bf16.close()
    with pytest.raises(UnsupportedModelError, match=r"a mixture-of-experts model \(Qwen3MoeForCausalLM\) has no CUDA "
                                                    r"kernels yet; run it on the CPU"):
        Engine(str(tmp_path), device="cuda", kv_cache_memory=1 << 22, max_model_len=64)


def test_moe_config_rules_as_transformers(tmp_path):
    """Rules of the MoE configs that the cases above leave at their defaults, each against
    transformers in f32: Qwen3-MoE slides on every layer with use_sliding_window, Qwen2-MoE on
    its even layers below max_window_layers when config.json has no layer_types (older files);
    transformers 5's fused expert tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) read as the per-expert ones; an explicit 0, null or non-integer count is refused as written."""
    import json

    from safetensors.numpy import load_file, save_file

    from numa_runtime.config import ModelConfig, UnsupportedModelError

    def same(d, ref):
        eng = Engine(d, dtype="float32", kv_cache_memory=1 << 24, max_model_len=256)
        try:
            outs = eng.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            assert [o.token_ids for o in outs] == [hf_greedy(ref, p, 24) for p in PROMPTS[:3]]
            return eng.model_config
        finally:
            eng.close()

    q3 = str(tmp_path / "q3")
    cfg = same(q3, build_model(q3, **{**CASES["qwen3-moe"], "use_sliding_window": True, "sliding_window": 5}))
    assert cfg.layer_types == ("sliding_attention",) * 3
    q2 = str(tmp_path / "q2")
    ref = build_model(q2, **{**CASES["qwen2-moe-shared"], "use_sliding_window": True, "sliding_window": 5,
                             "max_window_layers": 2})
    with open(os.path.join(q2, "config.json")) as f:
        c = json.load(f)
    c.pop("layer_types", None)
    with open(os.path.join(q2, "config.json"), "w") as f:
        json.dump(c, f)
    cfg = same(q2, ref)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "full_attention")
    # the fused layout of transformers 5's modules, written as such
    fused = str(tmp_path / "fused")
    ref = build_model(fused, **CASES["qwen2-moe-shared"])
    t = load_file(os.path.join(fused, "model.safetensors"))
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts."
        if p + "0.gate_proj.weight" not in t:
            continue
        E = sum(1 for n in t if n.startswith(p) and n.endswith("gate_proj.weight"))
        t[p + "gate_up_proj"] = np.stack([np.concatenate([t.pop(f"{p}{j}.gate_proj.weight"),
                                                          t.pop(f"{p}{j}.up_proj.weight")]) for j in range(E)])
        t[p + "down_proj"] = np.stack([t.pop(f"{p}{j}.down_proj.weight") for j in range(E)])
    save_file(t, os.path.join(fused, "model.safetensors"), metadata={"format": "pt"})
    same(fused, ref)
    # explicit values are refused as written, never replaced by a default or truncated
    for key, value, least in (("num_experts_per_tok", 0, 1), ("num_experts_per_tok", None, 1),
                              ("num_experts_per_tok", 1.5, 1), ("moe_intermediate_size", 0, 1),
                              ("decoder_sparse_step", "2", 1), ("shared_expert_intermediate_size", -1, 0)):
        shown = {0: "0", None: "null", 1.5: "1.5", "2": '"2"', -1: "-1"}[value]
        with pytest.raises(UnsupportedModelError, match=rf"^config.json's {key} is {shown}; it must be an integer of "
                                                        rf"at least {least}.$"):
            ModelConfig.from_dict({**c, key: value})
    with pytest.raises(UnsupportedModelError, match=r"^config.json's num_experts_per_tok \(7\) must be between 1 and "
                                                    r"its num_experts \(6\).$"):
        ModelConfig.from_dict({**c, "num_experts_per_tok": 7})
    assert ModelConfig.from_dict({**c, "num_experts_per_tok": 2.0}).num_experts_per_tok == 2


def test_moe_config_defaults_and_errors_name_what_the_files_hold(tmp_path):
    """Keys a config leaves out take the MoE class's defaults (MixtralConfig: 8 kv heads, eps 1e-5,
    theta 1e6; Qwen3MoeConfig: 4 kv heads); a Mixtral whose config does not fit its weights is
    told in its own names (block_sparse_moe.experts.N.w1, intermediate_size)."""
    import json

    from numa_runtime.config import ModelConfig, UnsupportedModelError
    base = dict(architectures=["MixtralForCausalLM"], vocab_size=384, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=16, num_local_experts=4, num_experts_per_tok=2)
    c = ModelConfig.from_dict(base)
    assert (c.num_kv_heads, c.rms_norm_eps, c.rope.theta) == (8, 1e-5, 1e6)
    with pytest.raises(UnsupportedModelError, match=r"^config.json's num_experts_per_tok \(9\) must be between 1 and "
                                                    r"its num_local_experts \(4\).$"):  # it named num_experts
        ModelConfig.from_dict({**base, "num_experts_per_tok": 9})
    c = ModelConfig.from_dict({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4})
    assert (c.num_kv_heads, c.rms_norm_eps, c.rope.theta) == (4, 1e-6, 10000.0)
    build_model(str(tmp_path), **CASES["mixtral"])
    with open(os.path.join(tmp_path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({**cfg, "intermediate_size": 80}, f)
    with pytest.raises(UnsupportedModelError, match=r"model.layers.0.block_sparse_moe.experts.0.w1.weight has shape "
                                                    r"\(96, 64\), but config.json implies \(80, 64\) \(hidden_size 64, "
                                                    r"intermediate_size 80, num_local_experts 6\)"):
        Engine(str(tmp_path), dtype="float32", kv_cache_memory=1 << 22, max_model_len=64)


def test_moe_configs_that_leave_stored_tensors_out_are_refused(tmp_path):
    """A shared expert size of 0 over a stored shared expert loaded without it; a middle layer that
    the config makes dense over stored experts failed late as a bare CheckpointError (the first and
    last layers were checked)."""
    import json

    from numa_runtime.config import UnsupportedModelError

    def refused(case, change, message):
        d = str(tmp_path / case)
        build_model(d, **CASES[case])
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**cfg, **change}, f)
        with pytest.raises(UnsupportedModelError, match=message):
            Engine(d, dtype="float32", kv_cache_memory=1 << 22, max_model_len=64)
    refused("qwen2-moe-shared", {"shared_expert_intermediate_size": 0},
            r"the checkpoint holds a shared expert \(model.layers.1.mlp.shared_expert.gate_proj.weight\), but "
            r"config.json's shared_expert_intermediate_size is 0: it does not describe these weights.")
    # transformers' own size-0 shared expert: tensors of 0 rows, which is what the config says
    zero = str(tmp_path / "zero")
    ref = build_model(zero, **{**CASES["qwen2-moe-shared"], "shared_expert_intermediate_size": 0})
    with Engine(zero, dtype="float32", kv_cache_memory=1 << 22, max_model_len=64) as eng:
        out = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(ref, PROMPTS[0], 6)
    refused("qwen3-moe", {"mlp_only_layers": [0, 1]},
            r": the checkpoint lacks model.layers.1.mlp.gate_proj.weight \(3 expected tensors missing\); its layer 1 "
            r"holds a router and experts, where config.json makes the layer dense")
