"""GGUF files as models: `Engine("x.gguf")`, `serve --model x.gguf`.

`gguf_model_dir(path)` writes, once per file, a small Hugging Face style directory in the cache
(config.json from the GGUF metadata, tokenizer.json + tokenizer_config.json with the chat
template, and `model.gguf`, a symlink to the file): no weights are copied. The weights are read
from the GGUF itself by gguf_checkpoint.GGUFCheckpoint, per rank, quantized blocks as they are.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from . import env
from .config import UnsupportedModelError

GGUF_LINK = "model.gguf"
INDEX = "gguf_tensors.json"
ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM"}


def is_gguf_dir(model_dir: str) -> bool:
    return os.path.exists(os.path.join(model_dir, GGUF_LINK))


def gguf_model_dir(path: str, name: str | None = None) -> str:
    """The cache directory describing the GGUF at `path` (made on first use; one writer at a
    time, renamed into place when complete). Its base name, which the server reports as the
    model name, is `name` or the file's stem."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist.")
    st = os.stat(path)
    key = hashlib.sha1(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = name or os.path.splitext(os.path.basename(path))[0]
    parent = os.path.join(env.cache_dir(), "gguf", key)
    target = os.path.join(parent, stem)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(target, "config.json")):
            tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
            try:
                _describe(path, tmp)
                os.chmod(tmp, 0o755)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _describe(path: str, out_dir: str) -> None:
    import gguf

    from .default_model import _write_tokenizer
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the gguf package raises many kinds
        raise UnsupportedModelError(f"{path} is not a readable GGUF file ({e}).") from None
    meta = {name: field.contents() for name, field in reader.fields.items()}
    config = hf_config(meta, {t.name for t in reader.tensors}, path)
    for name, obj in (("config.json", config), ("generation_config.json", {
            "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)
    _write_tokenizer(meta, out_dir, prefix=config["model_type"] + ".")
    # NOTE: the tensor index, so that loading maps the file without re-parsing its metadata
    # (the gguf reader takes seconds to a minute on a 49K-token vocabulary)
    index = {"architecture": meta["general.architecture"], "tensors": [
        {"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
         "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in reader.tensors]}
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump(index, f)
    os.symlink(path, os.path.join(out_dir, GGUF_LINK))


def hf_config(meta: dict, tensor_names: set, path: str = "") -> dict:
    """A Hugging Face config.json for a llama/mistral/qwen2/qwen3 GGUF."""
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; "
                                    f"numa_runtime runs {', '.join(sorted(ARCHS))}.")
    a = arch + "."
    try:
        hidden, n_head = int(meta[a + "embedding_length"]), int(meta[a + "attention.head_count"])
        head_dim = int(meta.get(a + "attention.key_length", hidden // n_head))
        if int(meta.get(a + "rope.dimension_count", head_dim)) != head_dim or a + "rope.scaling.type" in meta:
            raise UnsupportedModelError(f"{path}: partial rotary or rope scaling in a GGUF is not supported.")
        tokens = meta["tokenizer.ggml.tokens"]
        eos = int(meta["tokenizer.ggml.eos_token_id"])
        return {
            "architectures": [ARCHS[arch]], "model_type": arch, "hidden_size": hidden,
            "intermediate_size": int(meta[a + "feed_forward_length"]),
            "num_hidden_layers": int(meta[a + "block_count"]),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(meta.get(a + "attention.head_count_kv", n_head)),
            "head_dim": head_dim, "hidden_act": "silu",
            "max_position_embeddings": int(meta.get(a + "context_length", 2048)),
            # NOTE: GGUF stores eps and theta as float32; str() of the float32 gives back 1e-05
            "rms_norm_eps": float(str(np.float32(meta[a + "attention.layer_norm_rms_epsilon"]))),
            "rope_theta": float(str(np.float32(meta.get(a + "rope.freq_base", 10000.0)))),
            "attention_bias": "blk.0.attn_q.bias" in tensor_names and arch != "qwen2",
            "vocab_size": int(meta.get(a + "vocab_size", len(tokens))),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", eos)), "eos_token_id": eos,
            "torch_dtype": "bfloat16",
        }
    except KeyError as e:
        raise UnsupportedModelError(f"{path}: the GGUF metadata lacks {e.args[0]!r}.") from None


def open_checkpoint(cfg):
    """The weights of a model directory: the GGUF it points at, or its safetensors."""
    from .weights import Checkpoint
    if is_gguf_dir(cfg.model_dir):
        from .gguf_checkpoint import GGUFCheckpoint
        with open(os.path.join(cfg.model_dir, INDEX)) as f:
            index = json.load(f)
        return GGUFCheckpoint(os.path.realpath(os.path.join(cfg.model_dir, GGUF_LINK)), index,
                              cfg.num_heads, cfg.num_kv_heads)
    with open(os.path.join(cfg.model_dir, "config.json")) as f:
        qcfg = json.load(f).get("quantization_config")
    if qcfg:
        from .quant.hf_quant import HFQuantCheckpoint
        return HFQuantCheckpoint(Checkpoint(cfg.model_dir), qcfg)
    return Checkpoint(cfg.model_dir)
