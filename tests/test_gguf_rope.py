"""GGUF rope and attention metadata: a llama3 rope (as Llama 3.1/3.2 GGUFs store it, the
`rope_freqs.weight` divisors), linear and yarn scaling and a sliding window run as transformers
runs the model the file was made from (greedy tokens in float32), and the same file without that
metadata does not (so each case can fail). Experts and rope settings we cannot run are refused in
one sentence naming the file; tensors we do not use are named in a warning."""
import json
import logging
import math
import os

import numpy as np
import pytest

from gguf_helpers import add_metadata, write_gguf
from models import build_model, hf_greedy

from numa_runtime import Engine, SamplingParams
from numa_runtime.config import UnsupportedModelError
from numa_runtime.gguf_model import gguf_model_dir

PROMPTS = [[1, 17, 42, 99, 5, 200, 13, 7, 300, 64, 3, 250, 11], list(range(3, 40))]
MAX_TOKENS = 32
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def llama3_factors(rope: dict, theta: float, dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it (conversion/llama.py
    generate_extra_tensors): per frequency, the divisor llama3 scaling applies."""
    import torch
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                              rope["high_freq_factor"], rope["factor"])
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def metadata(keys: dict, tensors: dict | None = None, arch: str = "llama"):
    """write_gguf's `extra`: `{arch}.key` metadata (str, float32, uint32 or bool array) and tensors."""
    def extra(w):
        add_metadata(w, keys, f"{arch}.")
        for name, data in (tensors or {}).items():
            w.add_tensor(name, data)
    return extra


# case: (build_model arguments, the GGUF metadata of the scaling: keys, tensors)
CASES = {
    "llama3-rope-freqs": (dict(rope_scaling=LLAMA3, rope_theta=500000.0),
                          ({}, {"rope_freqs.weight": llama3_factors(LLAMA3, 500000.0, 16)})),
    "linear": (dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
               ({"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}, {})),
    "yarn": (dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                "beta_fast": 32.0, "beta_slow": 1.0}),
             ({"rope.scaling.type": "yarn", "rope.scaling.factor": 8.0, "rope.scaling.original_context_length": 64,
               "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0}, {})),
    "yarn-attention-factor": (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5,
                                                 "original_max_position_embeddings": 128}),
                              ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                "rope.scaling.original_context_length": 128,
                                "rope.scaling.yarn_attn_factor": 1.5}, {})),
    # Mistral v0.1 GGUFs: arch "llama" with a window; shorter than the prompts + new tokens
    "mistral-sliding-window": (dict(arch="mistral", sliding_window=7), ({"attention.sliding_window": 7}, {})),
}


def greedy(path: str) -> list[list[int]]:
    eng = Engine(path, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)
    try:
        outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        return [list(o.token_ids) for o in outs]
    finally:
        eng.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_rope_matches_transformers_f32(tmp_path, case):
    kw, (keys, tensors) = CASES[case]
    hf_dir = str(tmp_path / "hf")
    ref = build_model(hf_dir, **{"arch": "llama", **kw})
    expected = [hf_greedy(ref, p, MAX_TOKENS) for p in PROMPTS]
    path, plain = str(tmp_path / "m.gguf"), str(tmp_path / "plain.gguf")
    write_gguf(hf_dir, path, "F32", extra=metadata(keys, tensors))
    write_gguf(hf_dir, plain, "F32")
    assert greedy(path) == expected
    assert greedy(plain) != expected  # the metadata changes the tokens: this test can fail
    with open(os.path.join(gguf_model_dir(path), "config.json")) as f:
        config = json.load(f)
    if "rope_freqs.weight" in tensors:  # the divisors as stored, exactly
        assert config["rope_freq_factors"] == [float(x) for x in tensors["rope_freqs.weight"]]


def test_rope_freq_factors_divide_every_frequency():
    """rope_inv_freq (the CPU and CUDA rope tables both take theirs from it): llama.cpp's
    theta_i = pos * base^(-2i/d) / factors_i, on top of a scaling type."""
    from numa_runtime.config import ModelConfig, rope_inv_freq
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=64, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=4, rope_theta=10000.0)
    factors = [1.0, 2.0, 3.5, 8.0, 1.0, 1.25, 4.0, 8.0]
    plain, _ = rope_inv_freq(ModelConfig.from_dict(base))
    inv, scale = rope_inv_freq(ModelConfig.from_dict({**base, "rope_freq_factors": factors}))
    np.testing.assert_array_equal(inv, plain / np.array(factors))
    linear = {**base, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    inv2, _ = rope_inv_freq(ModelConfig.from_dict({**linear, "rope_freq_factors": factors}))
    np.testing.assert_allclose(inv2, plain / 2.0 / np.array(factors), rtol=1e-15)
    with pytest.raises(UnsupportedModelError, match="rope_freq_factors must hold 8 positive numbers"):
        ModelConfig.from_dict({**base, "rope_freq_factors": factors[:4]})


ERRORS = {
    # NOTE: a router without the stacked experts of today's converter (old files had one tensor an expert)
    "mixture-of-experts": (dict(keys={"expert_count": 8, "expert_used_count": 2},
                                tensors={"blk.0.ffn_gate_inp.weight": np.zeros((8, 64), np.float32)}),
                           r"its experts are not stored as llama.cpp stores them today"),
    "longrope": (dict(keys={"rope.scaling.type": "longrope"}),
                 "GGUF rope scaling type 'longrope' is not supported"),
    "yarn-extrapolation": (dict(keys={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                      "rope.scaling.yarn_ext_factor": 0.5}),
                           r"yarn rope with extrapolation factor 0.5 or log multiplier 0.0 is not supported"),
    "window-pattern": (dict(keys={"attention.sliding_window": 8, "attention.sliding_window_pattern": 4}),
                       "cannot tell which layers slide"),
    "factor-count": (dict(keys={}, tensors={"rope_freqs.weight": np.ones(3, np.float32)}),
                     "rope_freqs.weight holds 3 factors where the rope has 8 frequencies"),
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama"))
    build_model(d, arch="llama")
    return d


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_unsupported_gguf_metadata_is_one_sentence(llama_dir, tmp_path, case):
    spec, match = ERRORS[case]
    path = str(tmp_path / f"{case}.gguf")
    write_gguf(llama_dir, path, "F32", extra=metadata(spec["keys"], spec.get("tensors")))
    with pytest.raises(UnsupportedModelError, match=match) as e:
        Engine(path, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)
    msg = str(e.value)
    assert msg.startswith(path) and msg.endswith(".") and ". " not in msg.replace(path, "")


PHI3_ERRORS = {
    # NOTE: llama.cpp's phi3 graph takes no rope_freqs (it refuses the file), and runs a lone
    # short factor tensor that the converter never writes alone
    "rope-freqs": (dict(keys={}, tensors={"rope_freqs.weight": np.ones(8, np.float32)}),
                   r"holds rope tensors numa_runtime does not apply \(rope_freqs.weight\)"),
    "lone-short": (dict(keys={}, tensors={"rope_factors_short.weight": np.full(8, 4.0, np.float32)}),
                   "holds rope_factors_short.weight without rope_factors_long.weight; a longrope GGUF holds both"),
    "lone-long": (dict(keys={}, tensors={"rope_factors_long.weight": np.full(8, 4.0, np.float32)}),
                  "holds rope_factors_long.weight without rope_factors_short.weight"),
    "bogus-type": (dict(keys={"rope.scaling.type": "bogus"}),
                   r"rope scaling bogus \(phi3.rope.scaling.\*\) in a phi3 GGUF is not supported; Phi-3 models"),
    "linear": (dict(keys={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
               "rope scaling linear .* is not supported; Phi-3 models scale their rope by longrope only"),
    "factor-alone": (dict(keys={"rope.scaling.factor": 4.0}), "rope scaling linear .* is not supported"),
    "longrope-and-factor": (dict(keys={"rope.scaling.type": "longrope", "rope.scaling.factor": 64.0},
                                 tensors={"rope_factors_short.weight": np.ones(8, np.float32),
                                          "rope_factors_long.weight": np.ones(8, np.float32)}),
                            r"a rope scaling factor of 64 beside longrope \(phi3.rope.scaling.\*\) in a phi3 GGUF"),
    "yarn": (dict(keys={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}),
             "rope scaling yarn .* is not supported"),
    "longrope-without-factors": (dict(keys={"rope.scaling.type": "longrope"}),
                                 "a phi3 GGUF with longrope scaling needs both rope_factors_short.weight and"),
    "factors-and-linear": (dict(keys={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
                                tensors={"rope_factors_short.weight": np.ones(8, np.float32),
                                         "rope_factors_long.weight": np.ones(8, np.float32)}),
                           r"rope scaling linear \(phi3.rope.scaling.\*\) in a phi3 GGUF is not supported"),
}


@pytest.mark.parametrize("case", sorted(PHI3_ERRORS))
def test_phi3_rope_metadata_it_cannot_run_is_one_sentence(tmp_path_factory, tmp_path, case):
    """A phi3 GGUF's rope scaling keys and rope tensors other than longrope's were ignored without
    a word (the file ran as if it had none); each is refused (transformers' Phi-3 scales by
    longrope only; llama.cpp refuses rope_freqs in a phi3 file)."""
    spec, match = PHI3_ERRORS[case]
    hf_dir = str(tmp_path / "hf")
    build_model(hf_dir, arch="phi3")
    path = str(tmp_path / f"{case}.gguf")
    write_gguf(hf_dir, path, "F32", arch="phi3", extra=metadata(spec["keys"], spec.get("tensors"), "phi3"))
    with pytest.raises(UnsupportedModelError, match=match) as e:
        Engine(path, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)
    msg = str(e.value)
    assert msg.startswith(path) and msg.endswith(".") and ". " not in msg.replace(path, "")


def test_unused_tensors_are_named_in_a_warning(llama_dir, tmp_path, caplog):
    path = str(tmp_path / "m.gguf")
    extra = {"blk.0.attn_post_norm.weight": np.ones(64, np.float32),
             "rope_freqs.weight": np.ones(8, np.float32)}  # read into config.json: not ignored
    write_gguf(llama_dir, path, "F32", extra=metadata({}, extra))
    with caplog.at_level(logging.WARNING, logger="numa_runtime"):
        greedy(path)
    warnings = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(warnings) == 1
    assert "blk.0.attn_post_norm.weight" in warnings[0] and "rope_freqs" not in warnings[0]


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
     "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.7,
     "mscale_all_dim": 0.7},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "truncate": False},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},  # no original
], ids=["mscale", "mscale-equal", "no-truncate", "llama3-no-original"])
def test_rope_tables_equal_transformers(rope):
    """rope_inv_freq against transformers' own rope functions: the inverse frequencies and the
    attention factor, for the keys that change them (yarn's mscale, mscale_all_dim and truncate;
    llama3 without original_max_position_embeddings)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from numa_runtime.config import ModelConfig, rope_inv_freq
    base = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=512)
    hf_config = LlamaConfig(**base, rope_parameters={"rope_theta": 10000.0, **rope})
    want, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    ours, scale = rope_inv_freq(ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"],
                                                       "rope_parameters": {"rope_theta": 10000.0, **rope}}))
    np.testing.assert_allclose(ours, want.double().numpy(), rtol=1e-6)
    assert scale == pytest.approx(float(want_scale), rel=1e-9)


@pytest.mark.parametrize("arch,edit", [
    # a Llama config's bare sliding_window (left by a conversion from Mistral): no window in transformers
    ("llama", lambda c: c.update(sliding_window=7)),
    # rope_scaling added to a transformers-5 config (rope_parameters default): rope_scaling wins
    ("llama", lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 128})),
    # ... in its old spelling ("type", as the Qwen2.5 model cards say to add it): it ran plain rope
    ("llama", lambda c: c.update(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    ("llama", lambda c: c.update(rope_scaling={"type": "linear", "factor": 4.0})),
    # use_sliding_window without max_window_layers: transformers' default of 28 (no layer slides here)
    ("qwen2", lambda c: (c.update(use_sliding_window=True, sliding_window=5), c.pop("max_window_layers", None),
                         c.pop("layer_types", None))),
    # a top-level original_max_position_embeddings (Phi-3 style) comes first for yarn
    ("llama", lambda c: c.update(original_max_position_embeddings=64, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": None})),
], ids=["llama-bare-window", "rope-scaling-wins", "old-type-yarn-wins", "old-type-linear-wins",
        "qwen2-default-window-layers", "top-level-original"])
def test_config_readings_equal_transformers(tmp_path, arch, edit):
    """Config fields transformers reads in its own way: the engine's f32 logits equal its own
    (each of these ran silently with other attention or rope before)."""
    import json
    import torch
    from transformers import AutoModelForCausalLM
    from models import build_model
    from numa_runtime import Engine
    from numa_runtime.plan import EXECUTE
    d = str(tmp_path / "m")
    build_model(d, arch=arch)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    ids = list(range(3, 60))
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    eng = Engine(d, dtype="float32", kv_cache_memory=1 << 22)
    try:
        got = eng._forward_once(ids, np.arange(len(ids)), EXECUTE)
    finally:
        eng.close()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("model_type,extra", [
    ("mistral", {}), ("mistral", {"sliding_window": None}), ("mistral", {"attention_bias": True, "mlp_bias": True}),
    ("qwen2", {"use_sliding_window": True}), ("qwen2", {"mlp_bias": True}), ("qwen3", {"attention_bias": True}),
    ("qwen3", {"use_sliding_window": True, "max_window_layers": 1, "mlp_bias": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True}), ("llama", {}),
])
def test_keys_a_config_leaves_out_or_its_class_ignores_read_as_transformers(model_type, extra):
    """A config.json without sliding_window or max_position_embeddings takes its class's defaults
    (Mistral: a 4096 window and 131072 positions; Qwen: 32768, and 4096 with use_sliding_window),
    and attention_bias / mlp_bias count only where the class builds biases from them (Mistral
    has none, Qwen2/Qwen3 no MLP bias). Llama's defaults applied to every family before: full
    attention, 2048 positions, and a refusal for "missing" bias tensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from numa_runtime.config import ModelConfig
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, **extra)
    hf_cfg = AutoConfig.for_model(model_type, **base)
    arch = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "llama": "LlamaForCausalLM"}[model_type]
    ours = ModelConfig.from_dict({**base, "architectures": [arch]})
    assert ours.max_position_embeddings == hf_cfg.max_position_embeddings
    window = getattr(hf_cfg, "sliding_window", None)
    types = getattr(hf_cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        window = None  # NOTE: transformers keeps the number but no layer slides
    slides = ours.sliding_window if "sliding_attention" in ours.layer_types else None
    assert slides == window, (ours.sliding_window, ours.layer_types, window, types)
    torch.manual_seed(0)
    layer = AutoModelForCausalLM.from_config(hf_cfg).model.layers[0]
    assert ours.qkv_bias == (layer.self_attn.q_proj.bias is not None)
    assert ours.o_bias == (layer.self_attn.o_proj.bias is not None)
    assert ours.mlp_bias == (layer.mlp.gate_proj.bias is not None)


@pytest.mark.parametrize("model_type,arch", [("qwen3", "Qwen3ForCausalLM"), ("mistral", "MistralForCausalLM"),
                                             ("phi3", "Phi3ForCausalLM"), ("llama", "LlamaForCausalLM"),
                                             ("qwen2", "Qwen2ForCausalLM"), ("mixtral", "MixtralForCausalLM"),
                                             ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_sizes_a_config_leaves_out_are_its_classs_defaults(model_type, arch):
    """head_dim, num_key_value_heads and rms_norm_eps left out of config.json: each class's own
    default, as transformers reads them (Qwen3 head_dim 128, Qwen2/Qwen3 32 kv heads, Mistral 8,
    Phi-3 eps 1e-5: the generic defaults refused such a Qwen3 or Mistral for its tensors' shapes,
    and ran a Phi-3 with a tenfold eps); a default that does not fit the heads says so."""
    from transformers import AutoConfig
    from numa_runtime.config import ModelConfig
    from numa_runtime.config import UnsupportedModelError
    base = dict(vocab_size=64, hidden_size=256, intermediate_size=40, num_hidden_layers=2, num_attention_heads=32)
    hf = AutoConfig.for_model(model_type, **base)
    ours = ModelConfig.from_dict({**base, "architectures": [arch]})
    want_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (ours.head_dim, ours.num_kv_heads, ours.rms_norm_eps) == (want_dim, hf.num_key_value_heads, hf.rms_norm_eps)
    if model_type not in ("qwen2", "qwen3"):  # NOTE: 32 kv heads whatever the attention heads
        return
    with pytest.raises(UnsupportedModelError, match=rf"^num_attention_heads \(16\) is not a multiple of "
                                                    rf"num_key_value_heads \(32, {arch}'s default where config.json "
                                                    r"leaves it out\)\.$"):
        ModelConfig.from_dict({**base, "num_attention_heads": 16, "architectures": [arch]})


def test_configs_rope_cannot_run_are_refused(tmp_path):
    from numa_runtime.config import ModelConfig, UnsupportedModelError
    base = dict(vocab_size=8, hidden_size=28, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                architectures=["LlamaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="rotary dimension .* must be even"):
        ModelConfig.from_dict(base)  # head_dim 7
    with pytest.raises(UnsupportedModelError, match="rope scaling 'linear' needs its 'factor'"):
        ModelConfig.from_dict({**base, "hidden_size": 32, "rope_scaling": {"rope_type": None, "type": "linear"}})


@pytest.mark.parametrize("change,match", [
    (dict(long_factor=[1.0] * 5), r"needs long_factor: 8 positive numbers \(one per rotary frequency\), got 5 entries"),
    (dict(long_factor=None), "needs long_factor: 8 positive numbers .*, got nothing"),
    (dict(long_factor=[1.0] * 7 + [-2.0]), "needs long_factor: .*, got a list with a value that is not a positive"),
    (dict(short_factor=[1.0] * 9), r"needs short_factor: 8 positive numbers .*, got 9 entries"),
    (dict(original_max_position_embeddings=32.0), r"original_max_position_embeddings must be an integer of at "
                                                  r"least 2 \(the pretrained context\), got 32\.0"),
    (dict(original_max_position_embeddings="32"), "must be an integer of at least 2 .*, got '32'"),
    (dict(original_max_position_embeddings=1), "must be an integer of at least 2 .*, got 1"),
    (dict(original_max_position_embeddings=None), r"longrope scaling needs original_max_position_embeddings"),
])
def test_longrope_configs_transformers_refuses_are_refused(change, match):
    """The long factors are never run (the context ends where they start) but a Phi-3 config of
    the wrong length or without them is refused, as transformers' Phi3Config refuses it (other
    families' configs only warn there, and load here); an unusable original context is named with
    its value (it was said to be missing)."""
    from numa_runtime.config import ModelConfig
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
               "original_max_position_embeddings": 64}
    base = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=256, architectures=["Phi3ForCausalLM"])
    assert ModelConfig.from_dict({**base, "rope_scaling": scaling}).rope.rope_type == "longrope"
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_dict({**base, "rope_scaling": {**scaling, **change}})
    llama = {**base, "architectures": ["LlamaForCausalLM"], "rope_scaling": {**scaling, **change}}
    if "long_factor" in change:  # NOTE: as transformers' LlamaConfig, which only warns: never run here
        assert ModelConfig.from_dict(llama).rope.rope_type == "longrope"
    else:
        with pytest.raises(UnsupportedModelError, match=match):
            ModelConfig.from_dict(llama)
