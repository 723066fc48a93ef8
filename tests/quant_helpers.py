"""Helpers for the quantization tests: dequantized reference checkpoints and one-shot logits."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

from numa_runtime.plan import StepPlan
from numa_runtime.quant.formats import QuantFormat, dequantize, quantize

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj",  # NOTE: Phi-3's fused ones: rows quantize alike fused or not
           "w1", "w2", "w3")  # NOTE: Mixtral's experts (block_sparse_moe.experts.N.w1: gate, w3: up, w2: down)


def write_dequantized_copy(src: str, dst: str, fmt: QuantFormat | None, head: QuantFormat | None) -> None:
    """dst = src with every decoder linear replaced by dequantize(quantize(w)) in f32 (fmt None:
    as stored), and the lm_head by the same in format `head` (None: as stored): the model a quantized engine must
    reproduce. A tied lm_head becomes an untied copy of the embedding table, which itself stays
    as stored (the engine looks tokens up in the stored table). Quantizing a whole tensor equals
    quantizing row or column slices of it on group boundaries, which is what each rank does."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for name, w in tensors.items():
        if fmt is not None and name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            # NOTE: o_proj's ranks split it on whole heads (LinearFactory._weight's unit)
            unit = head_dim if name.split(".")[-2] == "o_proj" else None
            tensors[name] = dequantize(quantize(w.astype(np.float32), fmt.for_split(w.shape[1], unit)))
    if head is not None:
        w = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).astype(np.float32)
        tensors["lm_head.weight"] = dequantize(quantize(w, head.for_head(w.shape[1])))
        cfg["tie_word_embeddings"] = False
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    save_file(tensors, path, metadata={"format": "pt"})


def decode_logits(engine, ids: list[int]) -> np.ndarray:
    """Logits [T, vocab] of every position of one prompt, one token per forward as decode steps
    run (one row per linear), on a fresh engine (one process; KV blocks 0.. are free)."""
    t, bs = len(ids), engine.config.block_size
    bt = np.arange(-(-t // bs), dtype=np.int32)[None, :]
    out = []
    for i in range(t):
        plan = StepPlan(token_ids=np.asarray(ids[i:i + 1], np.int64), positions=np.array([i], np.int64),
                        slot_mapping=np.array([i], np.int64), query_start=np.array([0, 1], np.int32),
                        context_lens=np.array([i + 1], np.int32), block_tables=bt,
                        logits_indices=np.array([0], np.int64))
        out.append(engine.runner.execute(plan))
    return np.concatenate(out)


def quantized_linears(model) -> list:
    """The QLinear kernels of a model (the parts of fused linears included)."""
    found = []
    for lin in model._linears():
        found += [p for p in getattr(lin, "parts", [lin]) if hasattr(p, "act8")]
    return found


def prefill_logits(engine, ids: list[int]) -> np.ndarray:
    """Logits [T, vocab] of every position of one prompt, one forward pass on a fresh engine
    (one process; KV blocks 0.. are free)."""
    t, bs = len(ids), engine.config.block_size
    nb = -(-t // bs)
    plan = StepPlan(token_ids=np.asarray(ids, np.int64), positions=np.arange(t, dtype=np.int64),
                    slot_mapping=np.arange(t, dtype=np.int64),
                    query_start=np.array([0, t], np.int32), context_lens=np.array([t], np.int32),
                    block_tables=np.arange(nb, dtype=np.int32)[None, :],
                    logits_indices=np.arange(t, dtype=np.int64))
    return engine.runner.execute(plan)
