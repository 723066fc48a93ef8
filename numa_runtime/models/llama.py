"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over backend ops, tensor parallel.

Megatron-style split over `world` ranks (which rank holds what: sharding.py): q/k/v and
gate/up by output rows, o_proj and down_proj by input columns followed by an all-reduce,
embedding and lm_head by vocabulary (embedding: masked lookup + all-reduce; lm_head:
all-gather of logits).
"""
from __future__ import annotations

import logging

import numpy as np

from ..backend.reference import KV_CACHE_DTYPES, kv_row_width
from ..config import ModelConfig, UnsupportedModelError, rope_inv_freq
from ..gguf_model import open_checkpoint
from ..quant.loader import LinearFactory, head_quantization, parse_quantization
from ..plan import EMBED
from ..sharding import ShardLayout, shard_layouts
from ..weights import Checkpoint

log = logging.getLogger("numa_runtime")


def _head_rows(heads: slice, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


class DecoderLayer:
    def __init__(self, linear: LinearFactory, cfg: ModelConfig, lay: ShardLayout, ckpt: Checkpoint, i: int):
        p = f"model.layers.{i}."
        d = cfg.head_dim
        qr, kr = _head_rows(lay.q_heads, d), _head_rows(lay.kv_heads, d)
        f = lambda n, **kw: ckpt.load(p + n, "float32", **kw)
        qkv_b = None
        if cfg.qkv_bias:
            qkv_b = np.concatenate([f("self_attn.q_proj.bias", rows=qr), f("self_attn.k_proj.bias", rows=kr),
                                    f("self_attn.v_proj.bias", rows=kr)])
        self.qkv_proj = linear([(p + "self_attn.q_proj.weight", qr, None), (p + "self_attn.k_proj.weight", kr, None),
                                (p + "self_attn.v_proj.weight", kr, None)], qkv_b)
        # NOTE: a row-parallel bias is added by rank 0 only, so the all-reduce sums it once.
        o_b = f("self_attn.o_proj.bias") if cfg.o_bias and lay.rank == 0 else None
        self.o_proj = linear([(p + "self_attn.o_proj.weight", None, qr)], o_b)
        gu_b = None
        if cfg.mlp_bias:
            gu_b = np.concatenate([f("mlp.gate_proj.bias", rows=lay.inter), f("mlp.up_proj.bias", rows=lay.inter)])
        self.gate_up_proj = linear([(p + "mlp.gate_proj.weight", lay.inter, None),
                                    (p + "mlp.up_proj.weight", lay.inter, None)], gu_b)
        d_b = f("mlp.down_proj.bias") if cfg.mlp_bias and lay.rank == 0 else None
        self.down_proj = linear([(p + "mlp.down_proj.weight", None, lay.inter)], d_b)
        self.input_norm = f("input_layernorm.weight")
        self.post_norm = f("post_attention_layernorm.weight")
        self.q_norm = f("self_attn.q_norm.weight") if cfg.qk_norm else None
        self.k_norm = f("self_attn.k_norm.weight") if cfg.qk_norm else None


class LlamaModel:
    """Weights of one rank's shard and its forward pass over a StepPlan."""

    def __init__(self, cfg: ModelConfig, ops, comm, dtype: str, max_model_len: int, progress=None,
                 quantization: str | None = None, lm_head_quantization: str | None = None):
        self.cfg, self.ops, self.comm, self.dtype = cfg, ops, comm, dtype
        ckpt = open_checkpoint(cfg)  # safetensors, or the GGUF file the directory points at
        linear = LinearFactory(ops, ckpt, dtype, parse_quantization(quantization),
                               head_quantization(lm_head_quantization, quantization, ckpt))
        # NOTE: quantized weights split the MLP on group boundaries
        self.lay = lay = ShardLayout.build(cfg, comm.rank, comm.world_size, linear.split_align)
        if comm.rank == 0 and comm.world_size > 1:
            for other in shard_layouts(cfg, comm.world_size, linear.split_align):
                log.info("tensor parallel: %s", other.describe())
        _check_tensors(cfg, ckpt)
        self.embed = _embedding_table(ckpt, dtype, lay.vocab)
        self.layers = []
        for i in range(cfg.num_layers):
            self.layers.append(DecoderLayer(linear, cfg, lay, ckpt, i))
            if progress:
                progress(i + 1, cfg.num_layers)
        self.norm = ckpt.load("model.norm.weight", "float32")
        # NOTE: a dense lm_head is quantized at load only to lm_head_quantization (int8 when the
        # decoder is quantized, by default); the embedding table stays as stored. An embedding
        # model has no lm_head
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in ckpt
        self.lm_head = None if cfg.is_embedding_model else linear.head(
            "model.embed_tokens.weight" if tied else "lm_head.weight", lay.vocab, lay.vocab_chunk)
        inv_freq, attn_scale = rope_inv_freq(cfg)
        pos = np.arange(max_model_len, dtype=np.float64)[:, None] * inv_freq[None, :]
        # cos_sin: [max_model_len, rot_dim] = [cos | sin]
        self.cos_sin = np.ascontiguousarray(
            np.concatenate([np.cos(pos), np.sin(pos)], axis=1) * attn_scale, dtype=np.float32)
        self.scale = cfg.head_dim ** -0.5
        self.windows = [cfg.window(i) for i in range(cfg.num_layers)]  # 0 = full attention

    def _linears(self) -> list:
        head = [] if self.lm_head is None else [self.lm_head]  # an embedding model has none
        return head + [getattr(l, n) for l in self.layers for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds in its own memory (the mmapped embedding excluded)."""
        own = sum(getattr(x, "nbytes", 0) or getattr(x, "weight").nbytes for x in self._linears())
        return own + (0 if isinstance(self.embed, np.memmap) else self.embed.nbytes)

    def weight_buffers(self) -> list[tuple[int, int]]:
        """(address, bytes) of the weights this rank packed into its own memory, for checking
        which node their pages are on (numa.memory_report). Linears that do not expose their
        buffer (data_ptr) are left out."""
        return [(x.data_ptr, x.nbytes) for x in self._linears() if getattr(x, "data_ptr", 0)]

    def kv_bytes_per_block(self, block_size: int, kv_dtype: str) -> int:
        """KV bytes of one block on this rank, all layers (int8 rows include their scales)."""
        row = kv_row_width(self.cfg.head_dim, kv_dtype) * np.dtype(KV_CACHE_DTYPES[kv_dtype]).itemsize
        return 2 * self.cfg.num_layers * block_size * self.lay.num_kv_heads * row

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: str) -> None:
        """kv_cache: per layer (K, V), each [num_blocks, block_size, kv heads, row] of kv_dtype
        (row: head_dim, or head_dim + 4 for int8; backend/reference.py)."""
        shape = (num_blocks, block_size, self.lay.num_kv_heads, kv_row_width(self.cfg.head_dim, kv_dtype))
        # NOTE: np.zeros maps fresh pages; they land on this rank's node at first write.
        self.kv_cache = [(np.zeros(shape, KV_CACHE_DTYPES[kv_dtype]), np.zeros(shape, KV_CACHE_DTYPES[kv_dtype]))
                         for _ in self.layers]

    def embed_tokens(self, ids: np.ndarray) -> np.ndarray:
        # ids: [T] -> x: [T, hidden]
        ops, lay = self.ops, self.lay
        x = np.empty((ids.shape[0], self.cfg.hidden_size), np.float32)
        if lay.world == 1:
            return ops.embedding(ids, self.embed, x)
        local = ids - lay.vocab.start
        inside = (local >= 0) & (local < self.embed.shape[0])
        if self.embed.shape[0]:  # NOTE: a tiny vocabulary over many ranks leaves the last ones none
            ops.embedding(np.where(inside, local, 0).astype(np.int64), self.embed, x)
        x[~inside] = 0.0
        self.comm.all_reduce_(x)
        return x

    def forward(self, plan) -> np.ndarray | None:
        """Run one step; returns logits [S', vocab] for plan.logits_indices (every rank), or
        for an EMBED plan the final normed hidden states [S', hidden] of those rows."""
        ops, cfg, lay, comm = self.ops, self.cfg, self.lay, self.comm
        T, H, D = plan.num_tokens, cfg.hidden_size, cfg.head_dim
        hq, hk = lay.num_q_heads, lay.num_kv_heads
        eps = cfg.rms_norm_eps
        residual = self.embed_tokens(plan.token_ids)      # [T, H]
        h = np.empty_like(residual)                        # [T, H] normed input
        delta = None                                       # [T, H] last sublayer output
        attn = np.empty((T, hq, D), np.float32)            # [T, hq, D]
        for i, (layer, (kc, vc)) in enumerate(zip(self.layers, self.kv_cache)):
            if delta is None:
                ops.rms_norm(residual, layer.input_norm, eps, h)
            else:
                ops.add_rms_norm(delta, residual, layer.input_norm, eps, h)
            qkv = layer.qkv_proj.forward(h)                # [T, (hq + 2 hk) D]
            # q, k, v: strided views into qkv (the kernels take any row stride)
            qkv3 = qkv.reshape(T, hq + 2 * hk, D)
            q, k, v = qkv3[:, :hq], qkv3[:, hq:hq + hk], qkv3[:, hq + hk:]
            if layer.q_norm is not None:
                # NOTE: per-head norms run over [T * heads, D] rows, which needs contiguous q, k
                q, k = np.ascontiguousarray(q), np.ascontiguousarray(k)
                ops.rms_norm(q.reshape(T * hq, D), layer.q_norm, eps, q.reshape(T * hq, D))
                ops.rms_norm(k.reshape(T * hk, D), layer.k_norm, eps, k.reshape(T * hk, D))
            ops.rotary(q, k, plan.positions, self.cos_sin)
            ops.reshape_and_cache(k, v, kc, vc, plan.slot_mapping)
            ops.paged_attention(q, kc, vc, plan.block_tables, plan.query_start, plan.context_lens,
                                self.scale, attn, self.windows[i])
            o = layer.o_proj.forward(attn.reshape(T, hq * D))   # [T, H] partial sum
            if lay.world > 1:
                comm.all_reduce_(o)
            ops.add_rms_norm(o, residual, layer.post_norm, eps, h)
            gu = layer.gate_up_proj.forward(h)                  # [T, 2 I_local]
            act = np.empty((T, gu.shape[1] // 2), np.float32)
            ops.silu_and_mul(gu, act)
            delta = layer.down_proj.forward(act)                # [T, H] partial sum
            if lay.world > 1:
                comm.all_reduce_(delta)
        idx = plan.logits_indices
        if idx.shape[0] == 0:
            return np.zeros((0, cfg.vocab_size), np.float32)
        last = np.ascontiguousarray(residual[idx])
        last += delta[idx]
        hn = np.empty_like(last)
        ops.rms_norm(last, self.norm, eps, hn)
        if plan.kind == EMBED:
            return hn
        logits = self.lm_head.forward(hn)                   # [S', vocab_chunk]
        if lay.world > 1:
            logits = comm.all_gather(logits)
        return logits[:, :cfg.vocab_size] if logits.shape[1] != cfg.vocab_size else logits


def _embedding_table(ckpt: Checkpoint, dtype: str, rows: slice) -> np.ndarray:
    """The embedding rows of this rank. Lookups read T rows a step, so when the kernel can
    read the stored dtype directly (bf16 or f32) we keep the mmapped view: no copy, no RSS
    for rows never used. (bf16 -> f32 is exact, so an f32 engine may read bf16 rows.)"""
    name = "model.embed_tokens.weight"
    raw = ckpt.raw(name)
    if raw.dtype == np.uint16 or (raw.dtype == np.float32 and dtype == "float32"):
        return raw[rows]
    return ckpt.load(name, dtype, rows=rows)


def _check_tensors(cfg: ModelConfig, ckpt: Checkpoint) -> None:
    """Fail before reading weights if the checkpoint lacks what the config promises."""
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in (0, cfg.num_layers - 1):
        for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                  "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
            need.append(f"model.layers.{i}.{n}")
    missing = [n for n in need if n not in ckpt]
    if missing:
        raise UnsupportedModelError(f"The checkpoint in {cfg.model_dir!r} lacks {missing[0]} "
                                    f"({len(missing)} expected tensors missing).")
    shape = ckpt.raw("model.layers.0.self_attn.q_proj.weight").shape
    if tuple(shape) != (cfg.q_size, cfg.hidden_size):
        raise UnsupportedModelError(f"q_proj has shape {tuple(shape)}, but config.json implies "
                                    f"{(cfg.q_size, cfg.hidden_size)}.")
