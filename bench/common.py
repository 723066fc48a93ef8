"""Shared helpers of the benchmarks: models built once from a config, percentiles, the decode
limit (weight bytes read per token), mpirun lookup and report writing.

    from bench.common import qwen05b_model, tiny_model, percentiles, weights_bytes_per_token
"""
from __future__ import annotations

import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CACHE = "/tmp/numa_runtime_bench"

# Qwen2.5-0.5B's shape as a plain Llama (no qkv bias): 24 layers, 14 heads, 2 kv heads, tied.
QWEN05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
               tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1000000.0,
               rms_norm_eps=1e-6, initializer_range=0.02)
# Llama-3.2-1B's shape: 32 heads and 8 kv heads split over 1, 2, 4 or 8 ranks (14 heads do not)
LLAMA1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=500000.0,
               rms_norm_eps=1e-5, initializer_range=0.02)
# Llama-3.1-8B's shape (untied, 128K vocab): 16 GB in bf16, built on a GPU when there is one
LLAMA8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=False, max_position_embeddings=4096, rope_theta=500000.0,
               rms_norm_eps=1e-5, initializer_range=0.02)
# Qwen3-30B-A3B's layer (128 experts of 768 columns, 8 a token; 32 heads of 128, 4 kv heads;
# untied 151936-row vocabulary) in 6 of its 48 layers: 4.2B parameters, 8.4 GB in bf16, of which
# a decode step reads 0.34B (an eighth of the model's 3.3B active per token)
QWEN3_MOE_6L = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=6,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                    tie_word_embeddings=False, max_position_embeddings=4096, rope_theta=1000000.0,
                    rms_norm_eps=1e-6, initializer_range=0.02)
# smoke runs: 4 heads and 2 kv heads split over 1, 2 or 4 ranks
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=384, tie_word_embeddings=False,
            max_position_embeddings=2048, initializer_range=0.02)
# per-op overhead: TINY's op calls at Qwen2.5-0.5B's depth, kernels that take almost no time
TINY24 = dict(TINY, num_hidden_layers=24)


# ----------------------------------------------------------------------------- models
def qwen05b_model(cache: str = os.path.join(CACHE, "qwen0.5b")) -> str:
    """A random bf16 LlamaForCausalLM of Qwen2.5-0.5B's shape, built once into `cache`."""
    return build_once(cache, "qwen0.5b", QWEN05B)


def tiny_model(cache: str = os.path.join(CACHE, "tiny")) -> str:
    """A 2-layer random bf16 Llama (vocab 384) for smoke runs, built once into `cache`."""
    return build_once(cache, "tiny", TINY)


def tiny24_model(cache: str = os.path.join(CACHE, "tiny24")) -> str:
    """TINY with 24 layers: a decode step is almost only per-op overhead (bench_engine --overhead)."""
    return build_once(cache, "tiny24", TINY24)


def llama1b_model(cache: str = os.path.join(CACHE, "llama3.2-1b")) -> str:
    """A random bf16 LlamaForCausalLM of Llama-3.2-1B's shape (splits 8 ways), built once."""
    return build_once(cache, "llama3.2-1b", LLAMA1B)


def llama8b_model(cache: str = os.path.join(CACHE, "llama3.1-8b")) -> str:
    """A random bf16 LlamaForCausalLM of Llama-3.1-8B's shape (16 GB), built once."""
    return build_once(cache, "llama3.1-8b", LLAMA8B)


SHAPES = {"qwen0.5b": qwen05b_model, "llama3.2-1b": llama1b_model, "llama3.1-8b": llama8b_model,
          "tiny": tiny_model, "tiny24": tiny24_model}


def add_model_args(ap, default_shape: str = "qwen0.5b; tiny with --quick") -> None:
    """--model / --shape / --dtype, as every engine benchmark takes them. `default_shape`: what
    the script builds without --model or --shape, for --shape's help."""
    ap.add_argument("--model", help="HF model directory (default: random Qwen2.5-0.5B shape, built once)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="built-in random model when --model is not given (default: %s)" % default_shape)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])


def resolve_model(model: str | None, shape: str) -> str:
    """--model DIR if given, else the built-in random model of --shape (built on first use)."""
    if not model:
        return SHAPES[shape]()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: --model {model}: no such directory or file.")
    return path


def build_once(out_dir: str, shape_name: str, shape: dict) -> str:
    """`out_dir` if it already holds a model, else build it there and return it.

    NOTE: bench/bench_compare.py builds the same shapes into the same default directories;
    when it is present and `out_dir` is its directory, its builder is used so that one model
    (one ~1 GB write) serves every benchmark.
    """
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    try:
        from bench import bench_compare
        if os.path.abspath(out_dir) == os.path.join(CACHE, shape_name) and shape_name in bench_compare.SHAPES:
            return bench_compare.build_shape(shape_name)
    except (ImportError, AttributeError):
        pass
    return build_random_llama(out_dir, shape)


def build_random_llama(out_dir: str, shape: dict, seed: int = 0) -> str:
    """Save a random bf16 LlamaForCausalLM of `shape` (LlamaConfig fields; or, with a
    "model_type" key, that family's config, e.g. qwen3_moe) and a locally trained byte-level BPE
    tokenizer into `out_dir` (written to a temp dir, then renamed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from models import ARCHS, train_tokenizer
    torch.manual_seed(seed)
    shape = dict(shape)
    kind = shape.pop("model_type", "llama")
    cfg = LlamaConfig(bos_token_id=1, eos_token_id=2, **shape) if kind == "llama" else \
        AutoConfig.for_model(kind, bos_token_id=1, eos_token_id=2, **shape)
    cfg.architectures = [ARCHS[kind]]
    # NOTE: the random init of billions of weights takes minutes on a CPU and seconds on a GPU
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = "%s.tmp%d" % (out_dir, os.getpid())
    os.makedirs(tmp, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    train_tokenizer(tmp)
    if os.path.exists(os.path.join(out_dir, "config.json")):  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)
    return out_dir


def random_prompts(rng, n: int, min_len: int, max_len: int, vocab: int) -> list[list[int]]:
    """n prompts of random token ids (ids 3.. avoid the special tokens), lengths uniform in
    [min_len, max_len]; random ids also keep the prefix cache from hitting."""
    return [rng.integers(3, vocab, int(rng.integers(min_len, max_len + 1))).tolist() for _ in range(n)]


# ----------------------------------------------------------------------------- numbers
def percentile(xs, q: float) -> float:
    """q-th percentile (0..100) with linear interpolation; nan for no data."""
    import numpy as np
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


def percentiles(xs, qs=(50, 99)) -> dict:
    """{"p50": ..., "p99": ...} of xs."""
    return {"p%g" % q: percentile(xs, q) for q in qs}


def weights_bytes_per_token(model_config, dtype: str = "bfloat16") -> int:
    """Bytes of weights one decode step reads per token at batch 1: every linear of every
    layer plus lm_head (vocab x hidden, read even when tied). The embedding row, norms and
    biases are negligible. `model_config`: numa_runtime.config.ModelConfig."""
    c = model_config
    h, i = c.hidden_size, c.intermediate_size
    per_layer = h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * i
    itemsize = {"bfloat16": 2, "bf16": 2, "float16": 2, "float32": 4, "fp32": 4}[dtype]
    return (c.num_layers * per_layer + c.vocab_size * h) * itemsize


# ----------------------------------------------------------------------------- running
def find_mpirun() -> str | None:
    """mpirun beside this Python (the mpich wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


def write_report(out: str, report: dict, markdown: str) -> list[str]:
    """Write OUT.json and OUT.md (OUT: a path without extension); returns the paths."""
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write(markdown)
    return [out + ".json", out + ".md"]
