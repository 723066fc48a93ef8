"""Frozen, validated configuration: what the model is (ModelConfig) and how we run it (EngineConfig)."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
from dataclasses import dataclass

# config.json without "architectures": its model_type's causal LM (transformers' auto mapping)
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "llama",  # NOTE: Llama's layer with fused qkv/gate_up tensors (split at load)
    # mixture-of-experts MLPs (models/moe.py) under the attention of their dense family
    "Qwen2MoeForCausalLM": "qwen2",
    "Qwen3MoeForCausalLM": "qwen3",
    "MixtralForCausalLM": "llama",
    # base models without an LM head (embedding checkpoints such as Qwen3-Embedding)
    "LlamaModel": "llama",
    "MistralModel": "llama",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
           "float": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
           "auto": "bfloat16"}  # NOTE: vLLM's default spelling: bf16 here whatever the checkpoint stores


def compute_dtype(value) -> str:
    """EngineConfig.dtype (and --dtype) as vLLM spells it: "bfloat16" or "float32"; ValueError
    (one sentence) for float16, which the CPU kernels do not compute in, or anything else."""
    dt = _DTYPES.get(str(value).lower().replace("torch.", ""))
    if dt == "float16":
        raise ValueError(f"dtype {value!r} is not a compute dtype here: numa_runtime computes in bfloat16 or "
                         "float32 (float16 checkpoints load as either); use 'bfloat16' (or 'auto').")
    if dt not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' (or 'auto') or 'float32', got {value!r}.")
    return dt


class UnsupportedModelError(ValueError):
    """The model directory holds something this runtime cannot run."""


# vLLM's --runner / --convert / --task (Engine(runner=, convert=, task=)): the values taken, per flag;
# POOLING_VALUES make embeddings pool the last token where the checkpoint declares no pooling
# NOTE: vLLM's logprobs_mode (Engine, --logprobs-mode): log-probabilities here are always the model's
# own distribution (before temperature, penalties, logit_bias, top-k/top-p), its default
LOGPROBS_MODES = ("raw_logprobs",)
RUNNER_VALUES = {"runner": ("auto", "generate", "pooling"), "convert": ("auto", "none", "embed"),
                 "task": ("auto", "generate", "embed", "embedding")}
POOLING_VALUES = frozenset({"pooling", "embed", "embedding"})

@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    partial_rotary_factor: float = 1.0
    freq_factors: tuple = ()  # [rot_dim/2] divisors of the inverse frequencies; () = none
    # yarn: the attention factor's mscale terms (DeepSeek style) and whether the correction
    # range is rounded to whole dimensions (transformers' `truncate`, default true)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    factor_given: bool = True  # yarn without `factor`: max_position_embeddings / original


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-family model, read from a Hugging Face config.json."""

    model_dir: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    checkpoint_dtype: str
    sliding_window: int | None = None
    layer_types: tuple = ()  # per layer "full_attention" | "sliding_attention"; () = all full
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    # a sentence-transformers embedding checkpoint (modules.json / 1_Pooling, as Qwen3-Embedding
    # ships): its pooling ("mean", "last" or "cls"); None: none declared
    pooling: str | None = None
    max_seq_length: int | None = None  # sentence_bert_config.json's: the longest input (caps max_model_len)
    lowercase: bool = False  # sentence_bert_config.json's do_lower_case
    # whether embeddings are unit length by default: as vLLM, yes, but for a sentence-transformers
    # checkpoint whose modules.json lists no Normalize module
    embed_normalize: bool = True
    # Matryoshka embeddings (config.json's is_matryoshka or matryoshka_dimensions, as vLLM reads
    # them): a request may keep the first `dimensions` values; () with is_matryoshka: any
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple = ()
    # mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral): num_experts routed experts of
    # moe_intermediate_size columns, num_experts_per_tok of them a token (softmax, then top-k,
    # renormalized with norm_topk_prob); Qwen2-MoE's shared expert of
    # shared_expert_intermediate_size columns under a sigmoid gate; moe_layers: per layer whether
    # its MLP is the sparse block (else the dense MLP of intermediate_size). 0 experts: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple = ()

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any layer's MLP is the dense one of intermediate_size."""
        return not all(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def is_embedding_model(self) -> bool:
        """A base model without an LM head, or a sentence-transformers embedding checkpoint: it
        embeds text, it does not generate."""
        return not self.architecture.endswith("ForCausalLM") or self.pooling is not None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    def window(self, layer: int) -> int:
        """Sliding window of `layer` in keys (the query sees itself and window - 1 earlier
        keys, as transformers' sliding_window_overlay), 0 for full attention."""
        if self.sliding_window and self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return 0

    @property
    def min_window(self) -> int:
        """The smallest window when every layer slides (KV older than it is never read
        again), else 0."""
        windows = [self.window(i) for i in range(self.num_layers)]
        return min(windows) if windows and all(windows) else 0

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        h, i, l = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h) + 3 * h * self.shared_expert_intermediate_size
        mlps = sum(moe if self.is_moe_layer(j) else 3 * h * i for j in range(l))
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return l * per_layer + mlps + emb + h

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        if os.path.isfile(model_dir):
            raise FileNotFoundError(f"{model_dir!r} is a file, not a model directory; pass a Hugging Face "
                                    "model directory (config.json + *.safetensors) or a .gguf file.")
        if os.path.isfile(model_dir.rstrip("/" + os.sep)):  # NOTE: a file named with a trailing slash
            raise FileNotFoundError(f"{model_dir!r} names a file as a directory; drop the trailing slash.")
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"Model directory {model_dir!r} does not exist; pass a Hugging Face "
                                    "model directory (config.json + *.safetensors) or omit it for the default model.")
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            ggufs = sorted(f for f in os.listdir(model_dir) if f.lower().endswith(".gguf"))
            hint = f" To run a GGUF file in it, name the file ({os.path.join(model_dir, ggufs[0])})." if ggufs else ""
            raise FileNotFoundError(f"{model_dir!r} has no config.json; it is not a Hugging Face model directory."
                                    f"{hint}")
        with open(path) as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise UnsupportedModelError(f"{path} is not valid JSON ({e}).") from None
        if not isinstance(cfg, dict):  # NOTE: a list or a number failed later with an AttributeError
            raise UnsupportedModelError(f"{path} is not a JSON object of model settings.")
        config = cls.from_dict(cfg, model_dir)
        pooling, normalize = sentence_transformers_pooling(model_dir)  # NOTE: a GGUF's directory has none
        if pooling:
            config = dataclasses.replace(config, pooling=pooling, embed_normalize=normalize)
        return dataclasses.replace(config, **sentence_bert_config(model_dir))

    @classmethod
    def from_dict(cls, cfg: dict, model_dir: str = "") -> "ModelConfig":
        try:
            return cls._from_dict(cfg, model_dir)
        except KeyError as e:
            raise UnsupportedModelError(f"config.json lacks the field {e.args[0]!r}.") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, UnsupportedModelError):
                raise
            raise UnsupportedModelError(f"config.json has a malformed value ({e}).") from None

    @classmethod
    def _from_dict(cls, cfg: dict, model_dir: str = "") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not archs and cfg.get("model_type") in _BY_MODEL_TYPE:  # NOTE: as transformers' AutoModelForCausalLM
            archs = [_BY_MODEL_TYPE[cfg["model_type"]]]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            raise UnsupportedModelError(
                f"config.json names no architecture (model_type {cfg.get('model_type')!r}); numa_runtime runs "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}.")
        if arch is None:
            raise UnsupportedModelError(
                f"Unsupported architecture {archs or cfg.get('model_type')!r}; numa_runtime runs "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}.")
        from .quant.hf_quant import check_quantization_config, read_quantization_config
        qcfg = read_quantization_config(model_dir, cfg)
        if qcfg:  # AWQ / GPTQ int4, or one clear error
            check_quantization_config(qcfg)
        mlx = cfg.get("quantization")
        if not qcfg and isinstance(mlx, dict) and "bits" in mlx:  # NOTE: mlx-lm writes its own key so
            raise UnsupportedModelError(f"{model_dir or 'The model'} is an MLX-quantized checkpoint ({mlx.get('bits')} "
                                        f"bits, config.json's "
                                        "'quantization'), which numa_runtime does not read; use the model's "
                                        "original weights, or its GGUF, AWQ or GPTQ files.")
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"Unsupported activation {act!r}; only silu is supported.")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # NOTE: the classes' own defaults where a key is left out (MixtralConfig: 8 kv heads, eps 1e-5,
        # theta 1e6; Qwen3MoeConfig 4 and Qwen2MoeConfig 16 kv heads; Qwen3Config head_dim 128, ...)
        class_default = _CLASS_DEFAULTS.get(arch, {})
        head_dim = cfg.get("head_dim") or class_default.get("head_dim") or hidden // num_heads
        num_kv = int(cfg.get("num_key_value_heads") or class_default.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv:
            told = "" if cfg.get("num_key_value_heads") else f", {arch}'s default where config.json leaves it out"
            raise UnsupportedModelError(f"num_attention_heads ({num_heads}) is not a multiple of "
                                        f"num_key_value_heads ({num_kv}{told}).")
        family, kind = SUPPORTED_ARCHITECTURES[arch], _kind(arch)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", "")
        if dtype not in _DTYPES:
            raise UnsupportedModelError(f"Unsupported checkpoint dtype {dtype!r}; use bf16, f16 or f32.")
        sliding, layer_types = _sliding_window(cfg, family, arch)
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dims = cfg.get("matryoshka_dimensions") or ()
        if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) and d > 0 for d in dims):
            raise UnsupportedModelError(f"matryoshka_dimensions must be a list of positive integers, got {dims!r}.")
        pooling = cfg.get("gguf_pooling")  # NOTE: ours, from an embedding GGUF's pooling_type (gguf_model)
        if pooling not in (None, "mean", "last", "cls"):
            raise UnsupportedModelError(f"gguf_pooling must be 'mean', 'last' or 'cls', got {pooling!r}.")
        return cls(
            pooling=pooling, is_matryoshka=bool(cfg.get("is_matryoshka")) or bool(dims),
            matryoshka_dimensions=tuple(dims),
            model_dir=model_dir, architecture=arch, vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]), num_heads=num_heads, num_kv_heads=num_kv,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", class_default.get("rms_norm_eps", 1e-6))),
            rope=_rope_config({**class_default, **cfg} if "rope_theta" in class_default else cfg, int(head_dim), kind),
            max_position_embeddings=int(cfg.get("max_position_embeddings", _MAX_POSITIONS[kind])),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # NOTE: as transformers builds each family: Qwen2 has q/k/v biases and no o bias, Mistral
            # none (whatever attention_bias says), Llama and Qwen3 follow attention_bias; only Llama's
            # MLP reads mlp_bias
            qkv_bias=(bool(cfg.get("qkv_bias", True)) if arch == "Qwen2MoeForCausalLM" else family == "qwen2")
            or (kind != "mistral" and bool(cfg.get("attention_bias", False))),
            o_bias=family != "qwen2" and kind != "mistral" and bool(cfg.get("attention_bias", False)),
            mlp_bias=kind == "llama" and bool(cfg.get("mlp_bias", False)), qk_norm=family == "qwen3",
            checkpoint_dtype=_DTYPES[dtype], sliding_window=sliding, layer_types=layer_types,
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos, **_moe_fields(cfg, arch))


# NOTE: the configuration classes' own defaults, where they differ from the generic ones (heads //
# kv heads, eps 1e-6, theta 1e4), for a config.json that leaves the key out
_CLASS_DEFAULTS = {"MixtralForCausalLM": {"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
                   "Qwen3MoeForCausalLM": {"num_key_value_heads": 4},
                   "Qwen2MoeForCausalLM": {"num_key_value_heads": 16},
                   "Qwen3ForCausalLM": {"head_dim": 128, "num_key_value_heads": 32},
                   "Qwen2ForCausalLM": {"num_key_value_heads": 32}, "MistralForCausalLM": {"num_key_value_heads": 8},
                   "Phi3ForCausalLM": {"rms_norm_eps": 1e-5}}


def _moe_fields(cfg: dict, arch: str) -> dict:
    """ModelConfig's mixture-of-experts fields of a Qwen2-MoE, Qwen3-MoE or Mixtral config.json
    (as transformers reads them: Qwen's num_experts, which transformers 5 writes as
    num_local_experts, decoder_sparse_step and mlp_only_layers; Mixtral's every layer sparse,
    renormalized, its experts of intermediate_size); {} for a dense architecture."""
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        return {}
    n = int(cfg["num_hidden_layers"])
    qwen, qwen2 = arch != "MixtralForCausalLM", arch.startswith("Qwen2")
    key = "num_experts" if cfg.get("num_experts") is not None or "num_local_experts" not in cfg else "num_local_experts"
    experts = _count(cfg, key, 60 if qwen2 else 128 if qwen else 8, 0 if qwen else 1)
    if experts == 0:  # NOTE: as transformers: Qwen's num_experts 0 leaves every layer's MLP dense
        return {}
    top_k = _count(cfg, "num_experts_per_tok", 4 if qwen2 else 8 if qwen else 2, 1)
    if top_k > experts:
        raise UnsupportedModelError(f"config.json's num_experts_per_tok ({top_k}) must be between 1 and its {key} "
                                    f"({experts}).")
    if qwen:
        step = _count(cfg, "decoder_sparse_step", 1, 1)
        only_mlp = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        layers = tuple(i not in only_mlp and (i + 1) % step == 0 for i in range(n))
        inter = _count(cfg, "moe_intermediate_size", 1408 if qwen2 else 768, 1)
    else:
        layers, inter = (True,) * n, _count(cfg, "intermediate_size", None, 1)
    shared = _count(cfg, "shared_expert_intermediate_size", 5632, 0) if qwen2 else 0
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)) if qwen else True,
            "shared_expert_intermediate_size": shared, "moe_layers": layers}


def _count(cfg: dict, key: str, default: int | None, least: int) -> int:
    """config.json's integer `key` of at least `least`; `default` where the key is absent (an
    explicit null, 0 or 1.5 is refused as written, not replaced or truncated)."""
    if key not in cfg and default is not None:
        return default
    value = cfg.get(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise UnsupportedModelError(f"config.json's {key} is {json.dumps(value)}; it must be an integer of at least "
                                    f"{least}.")
    return value


# sentence-transformers' Pooling modes -> ours (one per checkpoint)
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls",
               "pooling_mode_max_tokens": None, "pooling_mode_mean_sqrt_len_tokens": None,
               "pooling_mode_weightedmean_tokens": None}
_ST_MODE_NAMES = {"mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken",
                  "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
                  "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
                  "weightedmean": "pooling_mode_weightedmean_tokens"}


def sentence_bert_config(model_dir: str) -> dict:
    """sentence_bert_config.json's max_seq_length (the longest input; vLLM takes it as the
    model's length) and do_lower_case (texts lowercased), as ModelConfig fields; {} without it."""
    path = os.path.join(model_dir, "sentence_bert_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
        longest = cfg.get("max_seq_length")
        if longest is not None and (isinstance(longest, bool) or not isinstance(longest, int) or longest < 1):
            raise ValueError(f"max_seq_length must be a positive integer, got {longest!r}")
    except (json.JSONDecodeError, AttributeError, ValueError) as e:
        raise UnsupportedModelError(f"{path} is not a sentence-transformers config ({e}).") from None
    return {"max_seq_length": longest, "lowercase": bool(cfg.get("do_lower_case", False))}


def sentence_transformers_pooling(model_dir: str) -> tuple[str | None, bool]:
    """(pooling, normalize) a sentence-transformers checkpoint declares: its Pooling module's
    config (1_Pooling/config.json as modules.json names it): "mean", "last" or "cls"; whether
    modules.json lists a Normalize module after it. (None, True) when the directory holds no
    such module. UnsupportedModelError for a pooling this runtime cannot do, or a module that
    changes the embedding after the pooling (Dense, ...): its output would be wrong."""
    where, normalize = "1_Pooling", True
    modules = os.path.join(model_dir, "modules.json")
    if os.path.isfile(modules):
        try:
            with open(modules) as f:
                listed = json.load(f)
            kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in listed]
            where = next((m.get("path") or "" for m, k in zip(listed, kinds) if k == "Pooling"), None)
        except (json.JSONDecodeError, TypeError, AttributeError) as e:
            raise UnsupportedModelError(f"{modules} is not a sentence-transformers module list ({e}).") from None
        if where is None:
            return None, True
        other = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
        if other:
            raise UnsupportedModelError(f"{modules} lists a {other[0]} module, which numa_runtime does not run "
                                        "(it pools the final hidden states, normalized or not).")
        normalize = "Normalize" in kinds
    path = os.path.join(model_dir, where, "config.json")
    if not os.path.isfile(path):
        return None, True
    try:
        with open(path) as f:
            cfg = json.load(f)
        modes = [k for k in _ST_POOLING if cfg.get(k)]
        # NOTE: sentence-transformers 6 writes one string, "pooling_mode": "lasttoken"
        if not modes and isinstance(cfg.get("pooling_mode"), str):
            modes = [_ST_MODE_NAMES.get(cfg["pooling_mode"], f"pooling_mode {cfg['pooling_mode']!r}")]
    except (json.JSONDecodeError, AttributeError) as e:
        raise UnsupportedModelError(f"{path} is not a sentence-transformers pooling config ({e}).") from None
    if len(modes) != 1 or _ST_POOLING.get(modes[0]) is None or cfg.get("include_prompt") is False:
        asked = ", ".join(modes) if modes else f"no pooling mode it names (its keys: {', '.join(sorted(cfg))})"
        raise UnsupportedModelError(
            f"{path} asks for {asked}{' without the prompt' if cfg.get('include_prompt') is False else ''}; "
            "numa_runtime pools embeddings by one of mean tokens, last token or CLS token.")
    return _ST_POOLING[modes[0]], normalize


# transformers' defaults for keys a config.json leaves out, per model class
_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768, "phi3": 4096}
_DEFAULT_WINDOW = 4096  # MistralConfig's, and Qwen2/Qwen3Config's with use_sliding_window


def _kind(arch: str) -> str:
    """The transformers model class family of an architecture: llama, mistral, qwen2, qwen3 or phi3."""
    return "mistral" if arch.startswith(("Mistral", "Mixtral")) else "phi3" if arch.startswith("Phi3") else \
        SUPPORTED_ARCHITECTURES[arch]


def _sliding_window(cfg: dict, family: str, arch: str = "") -> tuple[int | None, tuple]:
    """(window, per-layer types) as transformers reads them: an explicit `layer_types` wins;
    Mistral slides on every layer; Qwen2/Qwen3 only with use_sliding_window, on the layers
    from max_window_layers on (28 when not given, transformers' default); Llama only where
    layer_types say so (as vLLM: a Llama config's bare sliding_window, left by a conversion
    from Mistral, is no window for transformers' Llama attention)."""
    n = int(cfg["num_hidden_layers"])
    # NOTE: a key left out is the class default (4096 for Mistral, and for Qwen with
    # use_sliding_window); an explicit null is no window
    # (Mixtral's class default: none)
    window = cfg.get("sliding_window", _DEFAULT_WINDOW if arch.startswith(("Mistral", "Qwen")) else None)
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if arch == "LlamaForCausalLM" and not cfg.get("layer_types"):
        window = None
    if not window:
        return None, ()
    window = int(window)
    if window < 1:
        raise UnsupportedModelError(f"sliding_window must be a positive number of tokens, got {window}.")
    if arch == "Qwen3MoeForCausalLM":  # NOTE: transformers' Qwen3-MoE slides on every layer (no layer_types)
        return window, ("sliding_attention",) * n
    types = cfg.get("layer_types")
    if types:
        if len(types) != n or any(t not in ("full_attention", "sliding_attention") for t in types):
            raise UnsupportedModelError(f"layer_types {types!r} must list 'full_attention' or "
                                        f"'sliding_attention' for each of the {n} layers.")
        return window, tuple(types)
    first = int(cfg.get("max_window_layers", 28)) if family in ("qwen2", "qwen3") else 0
    if arch == "Qwen2MoeForCausalLM":  # NOTE: Qwen2MoeConfig's: the even layers below max_window_layers
        return window, tuple("sliding_attention" if i % 2 == 0 and i < first else "full_attention" for i in range(n))
    return window, tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))


def _longrope(cfg: dict, merged: dict, rot_dim: int, kind: str = "phi3") -> tuple[tuple, float]:
    """LongRoPE (Phi-3/3.5/4) within its original context: the short factors (divisors of the
    inverse frequencies) and the attention factor, as transformers computes them. Past
    original_max_position_embeddings transformers switches every new token to the long factors
    (supported_len keeps max_model_len below that)."""
    # NOTE: a Phi-3's long factors are checked though never run (as transformers' Phi3Config refuses
    # a config without them or of the wrong length): a broken config is said, not served; other
    # families' transformers configs only warn
    for key in ("short_factor", "long_factor") if kind == "phi3" else ("short_factor",):
        f = merged.get(key)
        if not isinstance(f, list) or len(f) != rot_dim // 2 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf for x in f):
            got = (f"{len(f)} entries" if isinstance(f, list) and len(f) != rot_dim // 2 else
                   "a list with a value that is not a positive number" if isinstance(f, list) else
                   "nothing" if f is None else repr(f)[:40])
            raise UnsupportedModelError(f"longrope scaling needs {key}: {rot_dim // 2} positive numbers (one "
                                        f"per rotary frequency), got {got}.")
    short = merged["short_factor"]
    original = merged.get("original_max_position_embeddings")
    if original is None:
        raise UnsupportedModelError("longrope scaling needs original_max_position_embeddings (the pretrained "
                                    "context).")
    if not isinstance(original, int) or isinstance(original, bool) or original < 2:
        raise UnsupportedModelError(f"original_max_position_embeddings must be an integer of at least 2 (the "
                                    f"pretrained context), got {original!r}.")
    factor = merged.get("factor")
    factor = float(factor) if factor is not None else int(cfg.get("max_position_embeddings", original)) / original
    attention = merged.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return tuple(float(f) for f in short), float(attention)


def _rope_config(cfg: dict, head_dim: int, kind: str = "llama") -> RopeConfig:
    # NOTE: transformers >= 4.56 writes `rope_parameters` (theta inside); older configs use
    # `rope_theta` + `rope_scaling`. Both are accepted. `rope_freq_factors` is ours, not
    # transformers': llama.cpp's `rope_freqs.weight` (Llama 3.1/3.2 GGUFs store llama3 scaling
    # so), one divisor per inverse frequency, applied after the rope type's scaling
    # (rope_inv_freq); gguf_model writes it from the GGUF.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    # NOTE: as transformers, rope_scaling (the key users edit, e.g. to turn on yarn, in its old
    # spelling "type" too) wins over rope_parameters: one that names its type replaces their
    # scaling keys; theta stays where it was given; null means a key's default
    if scaling.get("type") is not None and scaling.get("rope_type") is None:
        scaling["rope_type"] = scaling["type"]
    if scaling.get("rope_type") is not None:
        params = {k: v for k, v in params.items() if k == "rope_theta"}
    merged = {k: v for k, v in {**params, **scaling}.items() if v is not None}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta") or 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "su" or (kind == "phi3" and rope_type == "yarn"):  # NOTE: as transformers' Phi3Config reads them
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"Unsupported rope scaling type {rope_type!r}; supported: "
                                    f"{', '.join(SUPPORTED_ROPE_TYPES)}.")
    if rope_type in ("linear", "dynamic") and merged.get("factor") is None:
        raise UnsupportedModelError(f"rope scaling {rope_type!r} needs its 'factor'.")
    if cfg.get("original_max_position_embeddings") is not None:  # NOTE: transformers reads the top level first
        merged["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    partial = float(merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    if int(head_dim * partial) % 2:
        raise UnsupportedModelError(f"The rotary dimension ({head_dim} x partial_rotary_factor {partial}) must be "
                                    "even: rope rotates pairs of values.")
    factors = tuple(float(f) for f in cfg.get("rope_freq_factors") or ())
    if rope_type == "longrope":
        factors, merged["attention_factor"] = _longrope(cfg, merged, int(head_dim * partial), kind)
    if factors and (len(factors) != int(head_dim * partial) // 2 or not all(0 < f < math.inf for f in factors)):
        raise UnsupportedModelError(f"rope_freq_factors must hold {int(head_dim * partial) // 2} positive "
                                    f"numbers (one per rotary frequency), got {len(factors)}.")
    num = (int, float)
    for key in ("mscale", "mscale_all_dim"):
        if merged.get(key) is not None and (isinstance(merged[key], bool) or not isinstance(merged[key], num)):
            raise UnsupportedModelError(f"rope scaling's {key} must be a number, got {merged[key]!r}.")
    return RopeConfig(
        mscale=merged.get("mscale"), mscale_all_dim=merged.get("mscale_all_dim"),
        truncate=bool(merged.get("truncate", True)), factor_given=merged.get("factor") is not None,
        theta=theta, rope_type=rope_type, factor=float(merged.get("factor") or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"),
        beta_fast=float(merged.get("beta_fast", 32.0)), beta_slow=float(merged.get("beta_slow", 1.0)),
        attention_factor=merged.get("attention_factor"), partial_rotary_factor=partial,
        freq_factors=factors)


@dataclass(frozen=True)
class EngineConfig:
    """How to run: dtype, lengths, batching limits, KV cache budget, threads, backend."""

    dtype: str = "bfloat16"
    max_model_len: int | None = None
    num_threads: int | None = None
    # the server's rank 0, with num_threads and OMP_NUM_THREADS unset and at least
    # RESERVE_MIN_CPUS cpus, computes on one cpu fewer: that one runs the HTTP server
    reserve_server_core: bool = False
    block_size: int = 16
    # bytes per rank, the whole pool (what sequences do not hold, the prefix cache keeps); None:
    # kv_cache_fraction of memory, no more than max_num_seqs sequences at max_model_len need
    kv_cache_memory: int | None = None
    kv_cache_fraction: float | None = None  # None: 0.2 (kv_cache_memory, when given, is the size instead)
    kv_cache_dtype: str = "auto"        # "auto" (the dtype's: bf16 or f32), "bfloat16", "float32" or "int8"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # NOTE: greedy decode steps of up to 4 sequences, with nothing waiting, run this many steps
    # per scheduling round (vLLM's multi-step scheduling; engine._burst_len): the per-step Python
    # work (schedule, sampling, outputs) runs once per burst with cold caches instead of every
    # step. Bursts are kept to about BURST_SECONDS of decode; 1: off
    num_scheduler_steps: int = 8
    enable_prefix_caching: bool = True
    eviction: str = "lru"
    backend: str = "cpu"
    device: str = "cpu"                # "cuda": the model shard on a GPU (cuda_backend/)
    host_kv_cache_memory: int = 0      # bytes of pinned host memory behind the GPU KV cache (0: off)
    cuda_graphs: bool = True           # device "cuda": replay decode steps as CUDA graphs
    seed: int = 0
    quantization: str | None = None  # quantize dense weights at load: "int8", "int4", ...
    lm_head_quantization: str | None = "auto"  # "auto": int8 when `quantization` is set; None: as stored
    # prefill rows of quantized linears in a bf16 engine: "bf16" (AMX-BF16 tiles, bf16 panels or
    # the f32 path) or "int8" blocks as decode rows take (qkv_proj at bf16 precision; VNNI or
    # AMX-INT8): faster where AVX-512 VNNI is present without AMX-BF16 (qgemm.prefill_int8_wins),
    # +0.16% perplexity on the default model
    prefill_activations: str = "bf16"
    data_parallel: int | None = None  # model replicas over the MPI ranks; None: ParallelConfig.resolve's rule
    kv_cache_dir: str | None = None     # a disk tier under the prefix cache (kv_cache/disk_tier.py)
    kv_cache_disk_bytes: int = 8 << 30  # its size cap per rank
    kv_cache_disk_load: str = "auto"    # "auto": load hits when reading beats recomputing; "always"
    # "auto": the model's generation_config.json sampling values (temperature, top_p, top_k, min_p,
    # repetition_penalty) are the defaults of requests that leave them unset, as vLLM's
    # --generation-config auto; "vllm": SamplingParams' own defaults
    generation_config: str = "auto"

    def __post_init__(self):
        from .kv_cache.eviction import POLICIES
        from .sampling_params import _is_int
        object.__setattr__(self, "dtype", compute_dtype(self.dtype))
        # NOTE: here, on every rank before the load (the pool's policy is made on rank 0 alone, after it)
        if not isinstance(self.eviction, str) or self.eviction not in POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(sorted(POLICIES))}, got {self.eviction!r}.")
        for name in ("max_model_len", "num_threads", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_memory"):
            v = getattr(self, name)
            if (v is not None or name in ("block_size", "max_num_seqs", "max_num_batched_tokens")) and (
                    not _is_int(v) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
            if v is not None:
                object.__setattr__(self, name, int(v))  # NOTE: numpy integers too, as the parts below check int
        for name in ("reserve_server_core", "enable_prefix_caching", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.kv_cache_fraction is not None and self.kv_cache_memory is not None:  # NOTE: the memory sizes the pool
            raise ValueError("kv_cache_memory gives the KV cache's size, so kv_cache_fraction would do nothing; give "
                             "one of them.")
        # NOTE: None stays None beside kv_cache_memory (a config replaced with both set would be refused)
        fraction = self.kv_cache_fraction if self.kv_cache_fraction is not None else (
            0.2 if self.kv_cache_memory is None else None)
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, numbers.Real)):
            raise ValueError(f"kv_cache_fraction must be a number in (0, 0.95], got {fraction!r}.")
        object.__setattr__(self, "kv_cache_fraction", None if fraction is None else float(fraction))
        kv = self.kv_cache_dtype
        if kv not in ("auto", "int8") and _DTYPES.get(str(kv)) not in ("bfloat16", "float32"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'bfloat16', 'float32' or 'int8', got {kv!r}.")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}.")
        object.__setattr__(self, "seed", int(self.seed))
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' (the model's sampling defaults) or 'vllm' "
                             f"(none), got {self.generation_config!r}.")
        if not isinstance(self.num_scheduler_steps, int) or self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be a positive integer, got {self.num_scheduler_steps!r}.")
        from .quant.loader import head_quantization, parse_quantization
        if self.quantization is not None:
            parse_quantization(self.quantization)  # raises one sentence on a bad name
        head = head_quantization(self.lm_head_quantization, self.quantization)  # same
        if self.prefill_activations not in ("bf16", "int8"):
            raise ValueError(f"prefill_activations must be 'bf16' or 'int8', got {self.prefill_activations!r}.")
        if self.prefill_activations == "int8" and self.dtype != "bfloat16":
            raise ValueError("prefill_activations='int8' needs dtype='bfloat16' (a float32 engine keeps exact "
                             "activations).")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}.")
        if not isinstance(self.host_kv_cache_memory, int) or self.host_kv_cache_memory < 0:
            raise ValueError(f"host_kv_cache_memory must be a non-negative number of bytes, "
                             f"got {self.host_kv_cache_memory!r}.")
        if self.device == "cuda" and self.quantization is not None and parse_quantization(self.quantization):
            raise ValueError(f"quantization={self.quantization!r} has no CUDA kernel yet; drop it (bf16 weights) "
                             "or run on device='cpu'.")
        if self.device == "cuda" and head is not None:
            raise ValueError("An int8 lm_head has no CUDA kernel yet; pass lm_head_quantization=None "
                             "or run on device='cpu'.")
        if self.device == "cuda" and self.kv_dtype != self.dtype:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} has no CUDA kernel yet (the GPU KV cache "
                             f"holds {self.dtype}); drop it or run on device='cpu'.")
        if self.host_kv_cache_memory and self.device != "cuda":
            raise ValueError("host_kv_cache_memory is a tier behind the GPU KV cache; it needs device='cuda'.")
        if self.host_kv_cache_memory and not self.enable_prefix_caching:
            raise ValueError("The host KV tier (host_kv_cache_memory) keeps prefix-cache blocks; it needs "
                             "enable_prefix_caching=True.")
        if self.data_parallel is not None and (isinstance(self.data_parallel, bool) or not isinstance(
                self.data_parallel, int) or self.data_parallel < 1):
            raise ValueError(f"data_parallel must be a positive integer, got {self.data_parallel!r}.")
        self.disk_tier  # validates
        if self.kv_cache_dir is None and (self.kv_cache_disk_bytes != EngineConfig.kv_cache_disk_bytes
                                          or self.kv_cache_disk_load != EngineConfig.kv_cache_disk_load):
            # NOTE: accepted and ignored before (an invalid value too)
            raise ValueError("kv_cache_disk_bytes and kv_cache_disk_load apply to the KV disk tier; give kv_cache_dir "
                             "too.")
        if self.kv_cache_dir is not None and not self.enable_prefix_caching:
            raise ValueError("The KV disk tier (kv_cache_dir) keeps prefix-cache blocks; it needs "
                             "enable_prefix_caching=True.")
        if self.kv_cache_dir is not None and self.device != "cpu":
            raise ValueError("The KV disk tier (kv_cache_dir) runs with the CPU backend; on a GPU use the host "
                             "KV tier (host_kv_cache_memory) instead.")
        if self.kv_cache_fraction is not None and not 0.0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction!r}.")

    @property
    def kv_dtype(self) -> str:
        """The KV cache's element type: "bfloat16", "float32" or "int8" ("auto": the dtype)."""
        kv = self.kv_cache_dtype
        return self.dtype if kv == "auto" else "int8" if kv == "int8" else _DTYPES[str(kv)]

    @property
    def disk_tier(self):
        """The disk tier's DiskTierConfig, or None without kv_cache_dir."""
        if self.kv_cache_dir is None:
            return None
        from .kv_cache.disk_tier import DiskTierConfig
        return DiskTierConfig(str(self.kv_cache_dir), self.kv_cache_disk_bytes, self.kv_cache_disk_load)


# NOTE: the concurrency from which data-parallel replicas beat one tensor-parallel model.
# Measured on one node only (bench/RESULTS.md, `bench/numa_scaling.py --modes tp dp`): 2
# replicas beat 2-way TP only at 64 concurrent sequences (1.10x), lost at 1 and 16, and a
# replica must hold the whole model in its node's memory. So the default stays tensor
# parallel (None) until a multi-node measurement says otherwise; --data-parallel N asks.
DP_CROSSOVER_CONCURRENCY: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """How the MPI ranks are used: `data_parallel` replicas of the model, each tensor parallel
    over `tensor_parallel` consecutive ranks (replica r: ranks r*tp .. r*tp + tp - 1)."""

    world_size: int
    data_parallel: int
    reason: str = ""
    asked_as: str = ""  # how the count was asked for, for errors: "--data-parallel 2", "data_parallel=2", ...

    def __post_init__(self):
        if self.data_parallel > self.world_size or self.world_size % self.data_parallel:
            raise ValueError(
                f"{self.asked_as or f'data_parallel={self.data_parallel}'} does not divide the {self.world_size} "
                f"MPI rank(s); "
                f"start a multiple of {self.data_parallel} ranks (mpirun -np N) or choose a divisor of "
                f"{self.world_size}.")

    @property
    def tensor_parallel(self) -> int:
        return self.world_size // self.data_parallel

    def replica_of(self, rank: int) -> int:
        return rank // self.tensor_parallel

    def leader_of(self, replica: int) -> int:
        return replica * self.tensor_parallel

    @classmethod
    def resolve(cls, world_size: int, data_parallel: int | None, num_heads: int,
                max_num_seqs: int, asked_as: str = "") -> "ParallelConfig":
        """The asked replica count, else the default rule (the one place it lives):
        1. more ranks than attention heads: the fewest replicas whose groups have no more ranks
           than heads (tensor parallel cannot use more);
        2. max_num_seqs >= DP_CROSSOVER_CONCURRENCY: one replica per rank (no all-reduce);
        3. otherwise one model over all ranks (tensor parallel): each sequence decodes fastest.
        """
        if data_parallel is not None:
            return cls(world_size, data_parallel, "asked for", asked_as)
        if world_size <= 1:
            return cls(world_size, 1, "one rank")
        if world_size > num_heads:
            dp = next(d for d in range(2, world_size + 1)
                      if world_size % d == 0 and world_size // d <= num_heads)
            return cls(world_size, dp, f"{world_size} ranks exceed the model's {num_heads} attention "
                                       f"heads: {dp} replicas of {world_size // dp} rank(s)")
        crossover = DP_CROSSOVER_CONCURRENCY
        if crossover is not None and max_num_seqs >= crossover:
            return cls(world_size, world_size, f"max_num_seqs {max_num_seqs} >= {crossover}, where "
                                               "replicas beat tensor parallel: one replica per rank")
        if crossover is None:
            why = ("replicas beat it on one node only from 64 concurrent sequences and each holds the "
                   "whole model; ask for replicas with --data-parallel N (config.DP_CROSSOVER_CONCURRENCY)")
        else:
            why = f"max_num_seqs {max_num_seqs} < {crossover}, where one model decodes each sequence faster"
        return cls(world_size, 1, "tensor parallel over all ranks: " + why)


def asked_replicas(data_parallel: int | None, spelled: str = "data_parallel={}") -> tuple[int | None, str]:
    """The replica count asked for, and how, for errors: the caller's `data_parallel` (its setting
    `spelled` with {} for the count: "--data-parallel {}", "data_parallel={}"), else numa-launch's
    NUMA_RUNTIME_DATA_PARALLEL, else (None, ""). Both set and different: ValueError in one
    sentence (the caller's value silently won over the launcher's)."""
    from . import env
    launched = env.data_parallel()
    if data_parallel is None:
        if launched is None:
            return None, ""
        return launched, f"NUMA_RUNTIME_DATA_PARALLEL={launched} (set by numa-launch --dp or --tp)"
    name = spelled.format(data_parallel)
    if launched is not None and launched != data_parallel:
        raise ValueError(f"{name} and NUMA_RUNTIME_DATA_PARALLEL={launched} (set by numa-launch --dp or --tp) "
                         f"disagree; drop {spelled.split('{')[0].rstrip(' =')} or launch with numa-launch --dp "
                         f"{data_parallel}.")
    return data_parallel, name


def replicas_for_tp(tp, data_parallel: int | None, ranks: int, given: str, start: str,
                    dp_spelled: str = "data_parallel={}") -> int | None:
    """vLLM's tensor_parallel_size against an MPI job of `ranks`: the replicas the ranks beyond one
    replica's make (vLLM's tp x dp; 1 where one replica takes them all, so that no default rule
    turns them into replicas; None where data_parallel is given, by the caller or by numa-launch
    --dp's NUMA_RUNTIME_DATA_PARALLEL), or ValueError in one sentence. `given` names the setting
    as its caller spells it ("--tensor-parallel-size 2", "tensor_parallel_size=2"), `dp_spelled`
    its data_parallel (asked_replicas); `start` says how to start a job of N ranks, with {n} for N."""
    name = given.split("=")[0].split(" ")[0]
    if not isinstance(tp, numbers.Integral) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"{name} must be a positive integer, got {tp!r}.")
    data_parallel, asked_as = asked_replicas(data_parallel, dp_spelled)
    if data_parallel is not None:
        given += f" with {asked_as}"
    if ranks % tp or (data_parallel is not None and data_parallel * tp != ranks):
        n = tp * (data_parallel or 1)
        raise ValueError(f"{given} needs {n} MPI rank(s), but this job has {ranks}: {start.format(n=n)}.")
    return ranks // tp if data_parallel is None else None


def kv_pool_blocks(budget_bytes: int, bytes_per_block: int, max_num_seqs: int, max_model_len: int,
                   block_size: int, cap: bool = True) -> int:
    """Blocks a KV pool of `budget_bytes` holds; with `cap` (a budget of the default share of
    memory) no more than every sequence at full length needs (+1: a window's partial first
    block). A budget given (kv_cache_memory) is the pool: what sequences do not hold, the
    prefix cache keeps (as vLLM's pool takes its whole share)."""
    n = budget_bytes // bytes_per_block
    return int(min(n, max_num_seqs * -(-max_model_len // block_size) + 1) if cap else n)


def context_in_pool(max_model_len: int, num_blocks: int, block_size: int, window: int = 0) -> int:
    """The context one request can really use: no more tokens than the pool holds, unless every
    layer slides a window of `window` keys and the pool holds that window and one block more
    (older blocks are released, as the scheduler counts them)."""
    if window and num_blocks >= -(-window // block_size) + 1:
        return max_model_len
    return min(max_model_len, num_blocks * block_size)


def supported_len(model: ModelConfig) -> int:
    """The longest context the model's positions cover, as vLLM derives it: a yarn scaling's
    original length times its factor, a linear one's max_position_embeddings times its factor
    (configs that turn these on, e.g. Qwen2.5's documented yarn, keep the trained
    max_position_embeddings); max_position_embeddings otherwise. "dynamic" NTK stays within
    max_position_embeddings: past it its frequencies would change with the sequence's length."""
    r, limit = model.rope, model.max_position_embeddings
    if r.rope_type == "yarn" and r.factor_given:
        limit = max(limit, int((r.original_max_position_embeddings or limit) * r.factor))
    elif r.rope_type == "linear":
        limit = max(limit, int(limit * r.factor))
    elif r.rope_type == "longrope":
        limit = min(limit, r.original_max_position_embeddings)
    # NOTE: a sentence-transformers model's own limit is the last word, as vLLM takes it
    return min(limit, model.max_seq_length) if model.max_seq_length else limit


def rope_inv_freq(model: ModelConfig):
    """Inverse frequencies [rot_dim/2] and the attention scaling for the model's rope type."""
    import numpy as np
    r = model.rope
    rot_dim = int(model.head_dim * r.partial_rotary_factor)
    base = r.theta
    inv = 1.0 / (base ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim))
    scale = 1.0
    if r.rope_type == "linear":
        inv = inv / r.factor
    elif r.rope_type == "llama3":
        old = r.original_max_position_embeddings or model.max_position_embeddings  # NOTE: as transformers
        low_wl, high_wl = old / r.low_freq_factor, old / r.high_freq_factor
        wl = 2 * math.pi / inv
        smooth = (old / wl - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        scaled = np.where(wl > low_wl, inv / r.factor, inv)
        mid = (wl <= low_wl) & (wl >= high_wl)
        inv = np.where(mid, (1 - smooth) * inv / r.factor + smooth * inv, scaled)
    elif r.rope_type == "yarn":
        old = r.original_max_position_embeddings or model.max_position_embeddings
        factor = r.factor if r.factor_given else model.max_position_embeddings / old

        def corr_dim(n_rot):
            return (rot_dim * math.log(old / (n_rot * 2 * math.pi))) / (2 * math.log(base))
        low, high = corr_dim(r.beta_fast), corr_dim(r.beta_slow)
        if r.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rot_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rot_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrap = 1 - ramp
        inv = (inv / factor) * (1 - extrap) + inv * extrap

        def get_mscale(m: float = 1.0) -> float:  # YaRN's Eq. 21, as transformers' yarn_get_mscale
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
        if r.attention_factor is not None:
            scale = r.attention_factor
        elif r.mscale and r.mscale_all_dim:
            scale = get_mscale(r.mscale) / get_mscale(r.mscale_all_dim)
        else:
            scale = get_mscale()
    elif r.rope_type == "longrope":  # NOTE: the short factors are freq_factors (_longrope)
        scale = r.attention_factor
    # NOTE: "dynamic" NTK only changes frequencies past the trained length; within
    # max_position_embeddings it equals "default", and max_model_len is capped there (supported_len).
    if r.freq_factors:  # llama.cpp: theta_i = pos * inv_i / factors_i, with any scaling type
        inv = inv / np.asarray(r.freq_factors, dtype=np.float64)
    return inv, float(scale)


# NOTE: transformers' GenerationConfig defaults: a value equal to its default is no choice of the
# model's (vLLM reads the file's difference from them)
_HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def generation_defaults(model_dir: str) -> dict:
    """The sampling values a model's generation_config.json chooses (those transformers would not
    use anyway): temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as
    max_tokens (vLLM's reading: a request's default, and on the server a cap); {} without the file."""
    path = os.path.join(model_dir, "generation_config.json")
    try:
        with open(path) as f:
            gen = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(gen, dict):
        return {}
    from .sampling_params import SamplingParams
    out = {}
    for key, default in _HF_SAMPLING_DEFAULTS.items():
        v = gen.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v != default:
            v = int(v) if key == "top_k" else float(v)
            try:  # NOTE: a value no request could use is the file's fault: left out, and said so
                SamplingParams(**{key: v})
            except ValueError as e:
                logging.getLogger("numa_runtime").warning("%s: %s is ignored (%s)", path, key, e)
                continue
            out[key] = v
    new = gen.get("max_new_tokens")
    if isinstance(new, int) and not isinstance(new, bool):
        if new > 0:
            out["max_tokens"] = new
        else:
            logging.getLogger("numa_runtime").warning("%s: max_new_tokens %d is ignored (not positive)", path, new)
    return out
