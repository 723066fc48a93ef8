"""Write GGUF files from random Hugging Face models (tests only), the way llama.cpp's converter
lays them out (q/k rows permuted for llama), and the f32 reference directory the GGUF must
reproduce (dequantized with the gguf package's own block math, independent of ours)."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from numa_runtime.gguf_checkpoint import BLOCK_NAMES, CONFIG_TENSORS, EXPERT_STACKS, TOP_NAMES
from numa_runtime.weights import MIXTRAL_EXPERT_NAMES

TO_GGUF = {v: k for k, v in TOP_NAMES.items()}
# block bytes and the offsets of its f16 d fields, for the types gguf-py cannot quantize
KQUANT_D = {"Q4_K": (144, [0, 2]), "Q5_K": (176, [0, 2]), "Q6_K": (210, [208]), "Q2_K": (84, [80, 82]),
            "Q3_K": (110, [108]), "IQ4_XS": (136, [0]), "IQ4_NL": (18, [0]), "IQ2_XXS": (66, [0])}


def gguf_name(hf: str) -> str:
    """The GGUF name of a Hugging Face tensor; expert j of a stack is "blk.N.ffn_X_exps.weight[j]"."""
    if hf in TO_GGUF:
        return TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    rest = rest.replace("block_sparse_moe.", "mlp.")  # NOTE: Mixtral's names, as Qwen-MoE's
    bits = rest.split(".")
    if bits[:2] == ["mlp", "experts"]:
        proj = MIXTRAL_EXPERT_NAMES.get(bits[3], bits[3])
        return f"blk.{layer}.{[k for k, v in EXPERT_STACKS.items() if v == proj][0]}[{bits[2]}]"
    inv = {**{v: k for k, v in BLOCK_NAMES.items()}, "mlp.gate_up_proj.weight": "ffn_up.weight"}  # Phi-3
    return f"blk.{layer}.{inv[rest]}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: rotate-half pairs interleaved within each head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: str, rng) -> tuple[np.ndarray, object]:
    """(data for GGUFWriter.add_tensor, raw_dtype) of f32 w [N, K] in GGUF type qtype."""
    import gguf
    T = gguf.GGMLQuantizationType
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    if qtype == "BF16":
        return gguf.quants.quantize(w, T.BF16), T.BF16
    if qtype in KQUANT_D:
        # NOTE: gguf-py cannot quantize K-quants; any bytes are a valid block, so random
        # integers with small finite f16 scales make a well-formed tensor.
        size, d_at = KQUANT_D[qtype]
        per = gguf.GGML_QUANT_SIZES[T[qtype]][0]  # elements a block
        blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // per, size), dtype=np.uint8)
        for at in d_at:
            d = (rng.uniform(0.0005, 0.002, blocks.shape[:2])).astype(np.float16)
            blocks[:, :, at:at + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
        if qtype in ("Q4_K", "Q5_K", "Q2_K"):
            _center_min_blocks(blocks, qtype, rng)
        return blocks.reshape(w.shape[0], -1), T[qtype]
    return gguf.quants.quantize(w, T[qtype]), T[qtype]


def _center_min_blocks(blocks: np.ndarray, qtype: str, rng) -> None:
    """Random codes of a "min" K-quant (w = d sc q - dmin m) average (2^bits - 1) / 2: set
    dmin and each sub-block's m so that dmin m is about d sc times that average, so that the
    weights centre on 0 and a random model's greedy tokens do not repeat one token."""
    f16 = lambda a: a.astype(np.float16).view(np.uint8).reshape(*a.shape, 2)
    shape = blocks.shape[:2]
    # NOTE: scales within a factor of 1.5 of each other: rows of like norms (a random lm_head
    # with rows far apart in norm repeats its largest rows' tokens)
    d = rng.uniform(0.8, 1.2, shape).astype(np.float32)
    if qtype == "Q2_K":  # 16 bytes of (sc | m << 4), 4-bit each; d, dmin at 80, 82
        sc = 2 * rng.integers(5, 8, shape + (16,)).astype(np.uint8)  # even: m = sc / 2 exactly
        d *= 0.0012
        blocks[:, :, 80:82] = f16(d)
        blocks[:, :, 82:84] = f16(d * 1.5 * 2)           # dmin = 3 d: m = sc / 2
        blocks[:, :, 0:16] = sc | ((sc // 2) << 4)
        return
    mean = 7.5 if qtype == "Q4_K" else 15.5                # Q5_K: 5-bit codes
    d *= 0.0045 / mean / 48
    blocks[:, :, 0:2] = f16(d)
    blocks[:, :, 2:4] = f16(d * mean)                      # dmin = d mean: m = sc
    sc = rng.integers(40, 64, shape + (8,)).astype(np.uint8)  # 6-bit sub-scales and mins, packed
    m = sc
    blocks[:, :, 4:8] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    blocks[:, :, 8:12] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    blocks[:, :, 12:16] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)


def add_metadata(w, keys: dict, prefix: str = "") -> None:
    """GGUF metadata on writer w: str, bool, float (float32), int (uint32) or a list (array)."""
    for key, val in keys.items():
        key = prefix + key
        if isinstance(val, str):
            w.add_string(key, val)
        elif isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        else:
            w.add_array(key, list(val))


def write_gguf(hf_dir: str, path: str, qtype: str, arch: str = "llama", seed: int = 0,
               norm_type: str = "F32", types: dict | None = None, extra=None, split_max_tensors: int = 0,
               chat_template: str | None = "{% for m in messages %}{{ m['content'] }}{% endfor %}",
               expert_sizes: bool = True, meta: dict | None = None) -> None:
    """The model in hf_dir (f32 safetensors + tokenizer.json) as a GGUF: 2-D weights in qtype,
    or in types[projection] for the projections it names (e.g. {"v_proj": "Q8_0"}: a mix).
    extra(writer): adds more metadata or tensors (rope scaling, experts, ...); chat_template: the
    default template's source, or None for none; meta: {key: value} in place of the value this
    writes for a key (None: the key left out), e.g. a wrong block_count."""
    import gguf
    from safetensors.numpy import load_file
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    rng = np.random.default_rng(seed)
    # NOTE: split_max_tensors > 0 writes llama.cpp's split files (STEM-00001-of-0000N.gguf ...)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    if meta:
        add = w.add_key_value

        def replaced(key, val, vtype, *args, **kw):
            if key in meta and meta[key] is None:
                return
            add(key, meta.get(key, val), vtype, *args, **kw)
        w.add_key_value = replaced
    a = arch + "."
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for key, val in [("block_count", cfg["num_hidden_layers"]), ("context_length", cfg["max_position_embeddings"]),
                     ("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                     ("attention.head_count", cfg["num_attention_heads"]),
                     ("attention.head_count_kv", cfg["num_key_value_heads"]), ("attention.key_length", hd),
                     ("rope.dimension_count", int(hd * (cfg.get("rope_parameters") or cfg).get(
                         "partial_rotary_factor", 1.0)))]:
        w.add_uint32(a + key, val)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:  # NOTE: the keys llama.cpp's converter writes for a mixture of experts
        w.add_uint32(a + "expert_count", experts)
        w.add_uint32(a + "expert_used_count", cfg["num_experts_per_tok"])
        if expert_sizes and cfg.get("moe_intermediate_size"):  # NOTE: older qwen2moe files lack the sizes
            w.add_uint32(a + "expert_feed_forward_length", cfg["moe_intermediate_size"])
        if expert_sizes and cfg.get("shared_expert_intermediate_size"):
            w.add_uint32(a + "expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(a + "rope.freq_base", (cfg.get("rope_parameters") or cfg).get("rope_theta", 10000.0))
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tj = json.load(f)
    vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["id"] for t in tj["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")  # NOTE: the test tokenizer's split, GPT-2's regex (models.py)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_array("tokenizer.ggml.token_type", [3 if i in special else 1 for i in range(len(tokens))])
    w.add_uint32("tokenizer.ggml.bos_token_id", cfg["bos_token_id"])
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    if chat_template is not None:
        w.add_string("tokenizer.chat_template", chat_template)
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    stacks = {}  # NOTE: experts, stacked as llama.cpp's converter does: [E, N, K]
    for name, t in sorted(load_file(os.path.join(hf_dir, "model.safetensors")).items()):
        t = t.astype(np.float32)
        proj = name.split(".")[-2]
        if arch in ("llama", "mistral") and proj in heads:  # NOTE: weights and biases, as llama.cpp's converter
            t = permute(t, heads[proj])
        g = gguf_name(name)
        if g.endswith("]"):
            stack, j = g[:-1].split("[")
            stacks.setdefault(stack, {})[int(j)] = t
            continue
        # NOTE: the router and the shared expert's gate stay f32 ([H], not [1, H]), as llama-quantize keeps them
        router = g.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
        t = t.reshape(-1) if g.endswith("ffn_gate_inp_shexp.weight") else t
        data, raw = encode(t, (types or {}).get(proj, qtype) if t.ndim == 2 and not router else norm_type, rng)
        w.add_tensor(g, data, raw_dtype=raw)
    for stack, experts in sorted(stacks.items()):
        proj = EXPERT_STACKS[stack.split(".", 2)[-1]]
        parts = [encode(experts[j], (types or {}).get(proj, qtype), rng) for j in range(len(experts))]
        w.add_tensor(stack, np.stack([d for d, _ in parts]), raw_dtype=parts[0][1])
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_reference(hf_dir: str, gguf_path: str, out_dir: str) -> None:
    """hf_dir with every tensor replaced by the GGUF's, dequantized by the gguf package in f32
    and un-permuted: the model Engine(gguf_path) must equal."""
    import gguf
    from safetensors.numpy import save_file
    shutil.copytree(hf_dir, out_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    heads = {f"attn_{p}.{kind}": cfg[n] for p, n in (("q", "num_attention_heads"), ("k", "num_key_value_heads"))
             for kind in ("weight", "bias")}
    tensors = {}
    names = {gguf_name(n): n for n in _hf_names(hf_dir)}
    for t in reader.tensors:
        if t.name in CONFIG_TENSORS:  # NOTE: read into config.json (rope factors), as hf_dir's config has them
            continue
        shape = [int(d) for d in reversed(t.shape)]
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
        suffix = t.name.split(".", 2)[-1]
        if arch in ("llama", "mistral") and suffix in heads:
            n = heads[suffix]
            x = x.reshape(n, shape[0] // n // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
        if suffix in EXPERT_STACKS:
            for j in range(shape[0]):
                tensors[names[f"{t.name}[{j}]"]] = np.ascontiguousarray(x[j])
            continue
        if suffix == "ffn_gate_inp_shexp.weight":
            x = x.reshape(1, -1)
        tensors[names[t.name]] = np.ascontiguousarray(x)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def _hf_names(hf_dir: str) -> list[str]:
    from safetensors import safe_open
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "np") as f:
        return list(f.keys())


def write_reference_from_gguf(gguf_path: str, out_dir: str) -> None:
    """An f32 safetensors directory of a GGUF model (config and tokenizer from its metadata,
    weights dequantized by the gguf package and un-permuted): the numpy reference model."""
    import gguf
    from safetensors.numpy import save_file

    from numa_runtime.gguf_checkpoint import hf_name
    from numa_runtime.gguf_model import gguf_model_dir
    meta_dir = gguf_model_dir(gguf_path)
    os.makedirs(out_dir)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(meta_dir, f), out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "float32"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    heads = {f"attn_{p}.{kind}": cfg[n] for p, n in (("q", "num_attention_heads"), ("k", "num_key_value_heads"))
             for kind in ("weight", "bias")}
    tensors = {}
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
        suffix = t.name.split(".", 2)[-1]
        if arch in ("llama", "mistral") and suffix in heads:
            n = heads[suffix]
            x = x.reshape(n, shape[0] // n // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
        tensors[hf_name(t.name, arch)] = np.ascontiguousarray(x)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
