"""The Llama-family decoder on one GPU: one rank's shard as torch tensors, forward over a Batch.

The same shard layout as the CPU model (numa_runtime.models.llama.ShardLayout: q/k/v and
gate/up by output rows, o_proj and down_proj by input columns + all-reduce, embedding and
lm_head by vocabulary), the same checkpoint reader, and the same order of operations; only
the ops differ: torch matmul for the linears, cuda_backend.kernels for the rest.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from numa_runtime.config import ModelConfig, UnsupportedModelError, rope_inv_freq
from numa_runtime.gguf_model import open_checkpoint
from numa_runtime.models.llama import ShardLayout, _check_tensors, _head_rows
from numa_runtime.weights import Checkpoint

from . import kernels
from .batch import Batch

log = logging.getLogger("numa_runtime")

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class _Layer:
    """One decoder layer's weights on the device. Linears: [out, in] in the model dtype,
    biases and norm weights f32 (the kernels read norms in f32; biases in the model dtype)."""

    def __init__(self, cfg: ModelConfig, lay: ShardLayout, ckpt: Checkpoint, i: int, dtype: str, put):
        p = f"model.layers.{i}."
        qr, kr = _head_rows(lay.q_heads, cfg.head_dim), _head_rows(lay.kv_heads, cfg.head_dim)
        w = lambda n, **kw: ckpt.load(p + n, dtype, **kw)
        f = lambda n, **kw: ckpt.load(p + n, "float32", **kw)
        self.qkv = put(np.concatenate([w("self_attn.q_proj.weight", rows=qr), w("self_attn.k_proj.weight", rows=kr),
                                       w("self_attn.v_proj.weight", rows=kr)]))
        self.qkv_b = put(np.concatenate([f("self_attn.q_proj.bias", rows=qr), f("self_attn.k_proj.bias", rows=kr),
                                         f("self_attn.v_proj.bias", rows=kr)]), cast=True) if cfg.qkv_bias else None
        # NOTE: a row-parallel bias is added by rank 0 only, so the all-reduce sums it once.
        self.o = put(w("self_attn.o_proj.weight", cols=qr))
        self.o_b = put(f("self_attn.o_proj.bias"), cast=True) if cfg.o_bias and lay.rank == 0 else None
        self.gate_up = put(np.concatenate([w("mlp.gate_proj.weight", rows=lay.inter),
                                           w("mlp.up_proj.weight", rows=lay.inter)]))
        self.gate_up_b = put(np.concatenate([f("mlp.gate_proj.bias", rows=lay.inter), f("mlp.up_proj.bias", rows=lay.inter)]),
                             cast=True) if cfg.mlp_bias else None
        self.down = put(w("mlp.down_proj.weight", cols=lay.inter))
        self.down_b = put(f("mlp.down_proj.bias"), cast=True) if cfg.mlp_bias and lay.rank == 0 else None
        self.input_norm = put(f("input_layernorm.weight"))
        self.post_norm = put(f("post_attention_layernorm.weight"))
        self.q_norm = put(f("self_attn.q_norm.weight")) if cfg.qk_norm else None
        self.k_norm = put(f("self_attn.k_norm.weight")) if cfg.qk_norm else None


class CudaLlama:
    """Weights of one rank's shard on `device` and its forward pass. `tp` (None for one GPU)
    is the tensor-parallel group: all_reduce_(t) and all_gather(t) over the ranks' GPUs."""

    def __init__(self, cfg: ModelConfig, rank: int, world: int, dtype: str, max_model_len: int,
                 device: torch.device, tp=None, progress=None):
        self.cfg, self.dtype, self.device, self.tp = cfg, dtype, device, tp
        self.tdtype = TORCH_DTYPES[dtype]
        self.lay = lay = ShardLayout.build(cfg, rank, world)
        ckpt = open_checkpoint(cfg)  # safetensors, or the GGUF file the directory points at
        _check_dense(cfg, ckpt, dtype)
        _check_tensors(cfg, ckpt)
        self.embed = self._put(ckpt.load("model.embed_tokens.weight", dtype, rows=lay.vocab))
        self.layers = []
        for i in range(cfg.num_layers):
            self.layers.append(_Layer(cfg, lay, ckpt, i, dtype, self._put))
            if progress:
                progress(i + 1, cfg.num_layers)
        self.norm = self._put(ckpt.load("model.norm.weight", "float32"))
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in ckpt
        head = self.embed if tied else self._put(ckpt.load("lm_head.weight", dtype, rows=lay.vocab))
        pad = lay.vocab_chunk - head.shape[0]
        self.lm_head = F.pad(head, (0, 0, 0, pad)) if pad else head  # [vocab_chunk, H]
        inv_freq, attn_scale = rope_inv_freq(cfg)
        pos = np.arange(max_model_len, dtype=np.float64)[:, None] * inv_freq[None, :]
        # cos_sin: [max_model_len, rot_dim] = [cos | sin]
        self.cos_sin = self._put(np.concatenate([np.cos(pos), np.sin(pos)], axis=1) * attn_scale)
        self.scale = cfg.head_dim ** -0.5
        self.windows = [cfg.window(i) for i in range(cfg.num_layers)]  # 0 = full attention
        self.kv_cache = None

    def _put(self, a: np.ndarray, cast: bool = False) -> torch.Tensor:
        """numpy (bf16 as uint16 bits, or f32) -> a tensor on the device; `cast`: f32 -> model dtype."""
        a = np.ascontiguousarray(a)
        if not a.flags.writeable:  # NOTE: a memory-mapped GGUF tensor (torch wants writable memory)
            a = a.copy()
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == np.uint16 else \
            torch.from_numpy(a.astype(np.float32, copy=False))
        t = t.to(self.device)
        return t.to(self.tdtype) if cast else t

    @property
    def weight_bytes(self) -> int:
        ts = [self.embed, self.lm_head] + [getattr(l, n) for l in self.layers for n in ("qkv", "o", "gate_up", "down")]
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in ts}.values())

    def weight_buffers(self) -> list[tuple[int, int]]:
        """Host buffers holding weights (for the NUMA placement report): none, they are on the GPU."""
        return []

    def kv_bytes_per_block(self, block_size: int) -> int:
        item = torch.tensor([], dtype=self.tdtype).element_size()
        return 2 * self.cfg.num_layers * block_size * self.lay.num_kv_heads * self.cfg.head_dim * item

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        # kv_cache: [num_blocks, L, 2, block_size, Hk, D]; layer l's K is kv_cache[:, l, 0].
        # NOTE: a block's layers lie together, so moving a block to or from host memory is one copy
        self.kv_cache = torch.zeros((num_blocks, self.cfg.num_layers, 2, block_size, self.lay.num_kv_heads,
                                     self.cfg.head_dim), dtype=self.tdtype, device=self.device)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> x: [T, H]
        lay = self.lay
        if lay.world == 1:
            return F.embedding(ids, self.embed)
        local = ids - lay.vocab.start
        inside = (local >= 0) & (local < self.embed.shape[0])
        x = F.embedding(torch.where(inside, local, 0), self.embed) * inside[:, None].to(self.tdtype)
        return self.tp.all_reduce_(x)

    def forward(self, b: Batch, layer_ready=None, hidden: bool = False) -> torch.Tensor:
        """One step over batch `b`; returns f32 logits [len(b.logits_indices), vocab], or with
        `hidden` the final normed hidden states [len(b.logits_indices), H] (embeddings).
        `layer_ready(i)`, when given, is called before layer i reads its KV cache (the host
        tier's copies back into the cache wait there)."""
        cfg, lay = self.cfg, self.lay
        T, D, eps = b.token_ids.shape[0], cfg.head_dim, cfg.rms_norm_eps
        hq, hk = lay.num_q_heads, lay.num_kv_heads
        residual = self.embed_tokens(b.token_ids)                # [T, H]
        h = torch.empty_like(residual)                           # [T, H] normed input
        attn = torch.empty((T, hq, D), dtype=self.tdtype, device=self.device)
        delta = None                                             # [T, H] last sublayer output
        for i, layer in enumerate(self.layers):
            kc, vc = self.kv_cache[:, i, 0], self.kv_cache[:, i, 1]  # [NB, BS, Hk, D], blocks strided
            if delta is None:
                kernels.rms_norm(residual, layer.input_norm, eps, h)
            else:
                kernels.rms_norm(delta, layer.input_norm, eps, h, residual=residual)
            qkv = F.linear(h, layer.qkv, layer.qkv_b)            # [T, (hq + 2 hk) D]
            if layer_ready is not None:
                layer_ready(i)
            kernels.rotary_and_cache(qkv, hq, hk, D, b.positions, b.slot_mapping, self.cos_sin, kc, vc,
                                     layer.q_norm, layer.k_norm, eps)
            q = qkv[:, :hq * D].unflatten(1, (hq, D))            # [T, hq, D] strided view
            kernels.paged_attention(q, kc, vc, b.block_tables, b.query_start, b.context_lens, self.scale,
                                    attn, self.windows[i], b.max_query_len)
            o = F.linear(attn.view(T, hq * D), layer.o, layer.o_b)  # [T, H] partial sum
            if lay.world > 1:
                self.tp.all_reduce_(o)
            kernels.rms_norm(o, layer.post_norm, eps, h, residual=residual)
            gu = F.linear(h, layer.gate_up, layer.gate_up_b)     # [T, 2 I_local]
            act = torch.empty((T, gu.shape[1] // 2), dtype=self.tdtype, device=self.device)
            kernels.silu_and_mul(gu, act)
            delta = F.linear(act, layer.down, layer.down_b)      # [T, H] partial sum
            if lay.world > 1:
                self.tp.all_reduce_(delta)
        idx = b.logits_indices
        last = residual[idx] + delta[idx]                        # [S', H]
        hn = torch.empty_like(last)
        kernels.rms_norm(last, self.norm, eps, hn)
        if hidden:  # NOTE: whole on every rank (the sublayers' outputs were all-reduced)
            return hn.float()
        logits = F.linear(hn, self.lm_head).float()              # [S', vocab_chunk]
        if lay.world > 1:
            logits = self.tp.all_gather(logits)                  # [S', world * vocab_chunk]
        return logits[:, :cfg.vocab_size]


def _check_dense(cfg: ModelConfig, ckpt, dtype: str) -> None:
    """AWQ / GPTQ weights have no CUDA kernel yet: say so up front. A GGUF file's quantized
    blocks are dequantized at load into `dtype` (the CUDA kernels run dense weights)."""
    name = "model.layers.0.self_attn.q_proj.weight"
    if name not in ckpt:
        raise UnsupportedModelError(f"The model in {cfg.model_dir!r} has quantized weights (AWQ/GPTQ), which the "
                                    "CUDA backend cannot run yet; use device='cpu' or a bf16/f16/f32 checkpoint.")
    if getattr(ckpt.raw(name), "dtype", None) not in (np.uint16, np.float16, np.float32):
        log.info("%s: quantized GGUF weights are dequantized to %s on the GPU (more memory than the file)",
                 cfg.model_dir, dtype)
