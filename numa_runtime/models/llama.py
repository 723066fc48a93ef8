"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, and the mixture-of-experts
Qwen2-MoE, Qwen3-MoE and Mixtral: models/moe.py) over backend ops, tensor parallel.

Megatron-style split over `world` ranks (which rank holds what: sharding.py): q/k/v and
gate/up by output rows, o_proj and down_proj by input columns followed by an all-reduce,
embedding and lm_head by vocabulary (embedding: masked lookup + all-reduce; lm_head:
all-gather of logits).
"""
from __future__ import annotations

import contextlib
import logging
from functools import partial

import numpy as np

from .. import env
from ..backend.reference import KV_CACHE_DTYPES, kv_row_width
from ..config import ModelConfig, UnsupportedModelError, rope_inv_freq
from ..gguf_model import open_checkpoint
from ..quant.formats import QuantError
from ..quant.loader import (LinearFactory, check_checkpoint_method, head_quantization, parse_quantization,
                            stores_quantized)
from ..plan import EMBED
from ..profiler import TimedOps
from ..recorder import FORWARD
from ..sharding import ShardLayout, shard_layouts, split_heads
from ..weights import trim_heap
from ..weights import Checkpoint, load_rows
from .moe import MoEBlock, check_moe_tensors, swiglu

log = logging.getLogger("numa_runtime")


def _head_rows(heads: slice, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def kv_block_bytes(cfg: ModelConfig, num_kv_heads: int, block_size: int, kv_dtype: str) -> int:
    """KV bytes of one block of a rank holding `num_kv_heads` kv heads, all layers (int8 rows
    include their scales)."""
    row = kv_row_width(cfg.head_dim, kv_dtype) * np.dtype(KV_CACHE_DTYPES[kv_dtype]).itemsize
    return 2 * cfg.num_layers * block_size * num_kv_heads * row


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
        # NOTE: o_proj's input columns split on whole heads (unit: head_dim), so its group is
        # one that divides head_dim wherever one does
        self.o_proj = linear([(p + "self_attn.o_proj.weight", None, qr, cfg.head_dim)], o_b)
        self.input_norm = f("input_layernorm.weight")
        self.post_norm = f("post_attention_layernorm.weight")
        self.q_norm = f("self_attn.q_norm.weight") if cfg.qk_norm else None
        self.k_norm = f("self_attn.k_norm.weight") if cfg.qk_norm else None
        # NOTE: a sparse layer's MLP is the experts' block; gate_up_proj/down_proj are None there
        self.moe = MoEBlock(linear, cfg, lay, ckpt, i) if cfg.is_moe_layer(i) else None
        self.gate_up_proj = self.down_proj = None
        if self.moe is not None:
            return
        gu_b = None
        if cfg.mlp_bias:
            gu_b = np.concatenate([f("mlp.gate_proj.bias", rows=lay.inter), f("mlp.up_proj.bias", rows=lay.inter)])
        self.gate_up_proj = linear([(p + "mlp.gate_proj.weight", lay.inter, None),
                                    (p + "mlp.up_proj.weight", lay.inter, None)], gu_b)
        d_b = f("mlp.down_proj.bias") if cfg.mlp_bias and lay.rank == 0 else None
        self.down_proj = linear([(p + "mlp.down_proj.weight", None, lay.inter)], d_b)

    def linears(self) -> list:
        mlp = self.moe.linears() if self.moe is not None else [self.gate_up_proj, self.down_proj]
        return [self.qkv_proj, self.o_proj] + mlp


def _parts(lin) -> list:
    """The QLinears of a linear (a ConcatLinear's parts), or [lin]."""
    return list(getattr(lin, "parts", [lin]))


def _not_fused(layers) -> str:
    """Why FusedDecoder does not take these layers' linears (qgemm.fused_decode_usable), in words."""
    names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    for i, spec in enumerate(layers):
        for name, lin in zip(names, spec[:4]):
            parts = _parts(lin)
            where = f"layer {i} {name}"
            if name.endswith("down_proj") and len(parts) > 1:
                return f"{where} is {len(parts)} parts"
            for q in parts:
                if not hasattr(q, "act8"):
                    return f"{where} is dense"
                if not q.act8:
                    return f"{where} takes float activations (f32-exact or profiled)"
                if q.packed_k != q.in_features:
                    return (f"{where} has {q.in_features} input features on this rank, padded to "
                            f"{q.packed_k} for its packing")
    return "its linears do not fit the region"


class LlamaModel:
    """Weights of one rank's shard and its forward pass over a StepPlan."""

    def __init__(self, cfg: ModelConfig, ops, comm, dtype: str, max_model_len: int, progress=None,
                 quantization: str | None = None, lm_head_quantization: str | None = None,
                 prefill_activations: str = "bf16"):
        self.cfg, self.ops, self.comm, self.dtype = cfg, ops, comm, dtype
        ckpt = open_checkpoint(cfg)  # safetensors, or the GGUF file the directory points at
        check_checkpoint_method(quantization, ckpt, getattr(ckpt, "path", cfg.model_dir))
        if parse_quantization(quantization) is not None and stores_quantized(ckpt):
            raise ValueError(f"{getattr(ckpt, 'path', cfg.model_dir)} holds quantized weights already; "
                             f"quantization={quantization!r} (--quantization) quantizes dense bf16/f16/f32 "
                             "checkpoints while loading: drop it.")
        linear = LinearFactory(ops, ckpt, dtype, parse_quantization(quantization),
                               head_quantization(lm_head_quantization, quantization, ckpt))
        # NOTE: a split or format this rank cannot take names the model and the rank count
        with _named_errors(getattr(ckpt, "path", cfg.model_dir), comm.world_size):
            # NOTE: quantized weights split the MLP on group boundaries
            align = linear.split_align(cfg.intermediate_size, comm.world_size) if cfg.has_dense_mlp else 1
            world, shared = comm.world_size, cfg.shared_expert_intermediate_size
            moe_align = (linear.split_align(cfg.moe_intermediate_size, world, "mlp.experts.*.down_proj", even=True)
                         if cfg.num_experts else 1,
                         linear.split_align(shared, world, "mlp.shared_expert.down_proj", even=True) if shared else 1)
            try:
                self.lay = lay = ShardLayout.build(cfg, comm.rank, comm.world_size, align, moe_align)
            except UnsupportedModelError as e:
                ks = [k for k in (cfg.intermediate_size if cfg.has_dense_mlp else 0,
                                  cfg.moe_intermediate_size if cfg.num_experts else 0, shared or 0) if k]
                heads = split_heads(cfg.num_heads, cfg.num_kv_heads, world)
                q = linear.smaller_group(ks, world, [cfg.hidden_size] + [(h.stop - h.start) * cfg.head_dim
                                                                         for h, _ in heads])
                if q is not None:
                    raise UnsupportedModelError(f"{str(e).rstrip('.')}, or a smaller quantization group: "
                                                f"quantization={q!r} (--quantization {q}).") from None
                own = linear.quant
                if own is None or own.group_size < 0 or getattr(ckpt, "split_align", 1) != 1:
                    raise
                # NOTE: the groups are the ones asked for at load: say so, and what splits at any column
                alt = (": quantization='int8-channel' (one scale per output channel) splits at any column"
                       if own.bits == 8 else "")
                raise UnsupportedModelError(f"{str(e).rstrip('.')}; the groups are those of quantization="
                                            f"{quantization!r}{alt}.") from None
            if comm.rank == 0 and comm.world_size > 1 and (env.mpi_world() or (0, 1))[0] == 0:
                # NOTE: the first replica's leader: every replica splits alike (a log line a replica)
                for other in shard_layouts(cfg, comm.world_size, align, moe_align):
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
            if cfg.tie_word_embeddings and "lm_head.weight" in ckpt and comm.rank == 0 and not _same_first_row(
                    ckpt, "lm_head.weight", "model.embed_tokens.weight"):
                # NOTE: as vLLM, the tie wins (transformers would warn and keep the stored head)
                log.warning("%s stores an lm_head.weight though config.json says tie_word_embeddings: true; "
                            "it is not read: the input embedding serves as the output head", cfg.model_dir)
            if tied and not cfg.tie_word_embeddings and not cfg.is_embedding_model and comm.rank == 0:
                # NOTE: as transformers (which warns and starts a random head), not silently
                log.warning("%s has no lm_head.weight though config.json says tie_word_embeddings: false; "
                            "the input embedding serves as the output head", cfg.model_dir)
            self.lm_head = None if cfg.is_embedding_model else linear.head(
                "model.embed_tokens.weight" if tied else "lm_head.weight", lay.vocab, lay.vocab_chunk)
        inv_freq, attn_scale = rope_inv_freq(cfg)
        pos = np.arange(max_model_len, dtype=np.float64)[:, None] * inv_freq[None, :]
        # cos_sin: [max_model_len, rot_dim] = [cos | sin]
        self.cos_sin = np.ascontiguousarray(
            np.concatenate([np.cos(pos), np.sin(pos)], axis=1) * attn_scale, dtype=np.float32)
        self.scale = cfg.head_dim ** -0.5
        self.windows = [cfg.window(i) for i in range(cfg.num_layers)]  # 0 = full attention
        self._kept: dict[int, _StepBuffers] = {}  # tokens per step -> its buffers (_buffers)
        self.fused = None  # set with the KV cache (_fused_decoder)
        # [S'] int64: each logits row's argmax, when the step's region computed it; else None
        self.greedy_ids = None
        self.prefill_int8 = self._set_prefill_activations(prefill_activations)
        trim_heap()  # NOTE: the load's freed slices (f32 copies quantized at load, split tensors)

    def _set_prefill_activations(self, mode: str) -> bool:
        """Prefill rows of the int8-activation linears (those a bf16 engine quantized: act8) take
        int8 blocks too under "int8", but for the attention input (qkv_proj: prefill_act8 = 2,
        the bf16 panels where usable, else two int8 rows). SmolLM2-135M Q4_1,
        bench_perplexity.py: 18.30 with bf16 prefill, 18.40 with every prefill row in int8
        (llama.cpp's Q4_1: 18.39), 18.33 with qkv_proj on bf16 panels (18.33 as two int8 rows)
        and the rest int8; qkv_proj is about 7% of the MACs. NOTE: "bf16" is the default: the
        default model's answer to the README's question (Paris, by 0.12 logits over "L" with
        bf16 prefill, 0.06 with int8 on one rank) left Paris with int8 prefill on two ranks."""
        lins = [p for lin in self._linears() for p in _parts(lin) if getattr(p, "act8", False)]
        qkv = {id(p) for l in self.layers for p in _parts(l.qkv_proj)}
        self._act8 = bool(lins)  # decode rows take int8 activations: a mixed step runs its kinds apart
        on = mode == "int8"
        if on and not lins:
            raise ValueError(f"prefill_activations='int8' needs quantized weights (quantization=... or a "
                             f"quantized checkpoint); {self.cfg.model_dir} has none.")
        for p in lins:
            p.prefill_act8 = (2 if id(p) in qkv else 1) if on else 0
        # NOTE: linears whose prompt rows take the int8 blocks of decode rows (prefill_act8 1):
        # a mixed step runs both kinds in one call there (_rows_apart), with the same values
        self._one_path = {id(lin) for lin in self._linears()
                          if all(getattr(p, "act8", False) and p.prefill_act8 == 1 for p in _parts(lin))}
        if lins and self.lay.rank == 0:
            wins = getattr(self.ops, "prefill_int8_wins", None)
            hint = "" if on or wins is None or not wins() else \
                " (prefill_activations='int8' / --prefill-activations int8 runs faster on this CPU)"
            path = getattr(self.ops, "prefill_path", None)
            log.info("prefill activations: %s%s", "int8 blocks (qkv_proj at 15+ bits)" if on else
                     f"{path() if path else 'bf16 weights'} (int8 blocks only in decode steps)", hint)
        return on

    def _linears(self) -> list:
        head = [] if self.lm_head is None else [self.lm_head]  # an embedding model has none
        return head + [lin for l in self.layers for lin in l.linears()]

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
        return kv_block_bytes(self.cfg, self.lay.num_kv_heads, block_size, kv_dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: str) -> None:
        """kv_cache: per layer (K, V), each [num_blocks, block_size, kv heads, row] of kv_dtype
        (row: head_dim, or head_dim + 4 for int8; backend/reference.py)."""
        shape = (num_blocks, block_size, self.lay.num_kv_heads, kv_row_width(self.cfg.head_dim, kv_dtype))
        # NOTE: np.zeros maps fresh pages; they land on this rank's node at first write.
        self.kv_cache = [(np.zeros(shape, KV_CACHE_DTYPES[kv_dtype]), np.zeros(shape, KV_CACHE_DTYPES[kv_dtype]))
                         for _ in self.layers]
        self.fused = self._fused_decoder()

    def _fused_decoder(self):
        """The one-region decode of a quantized model (decode_layers.h), or None: another
        backend, linears it does not take (dense, f32-exact, profiled), or switched off."""
        make = getattr(self.ops, "fused_decoder", None)
        if make is None or not env.fused_decode():
            return None
        cfg, lay = self.cfg, self.lay
        # NOTE: a mixture of experts runs the attention halves in the region and each sparse MLP
        # half between two calls (models/moe.py, the experts in a region of their own): where a
        # sparse layer's MLP would be, the table holds the stand-in, never run there
        stand_in = self._stand_in_mlp()
        mlps = [(l.gate_up_proj, l.down_proj) if l.moe is None else stand_in for l in self.layers]
        layers = [(l.qkv_proj, l.o_proj, gu, down, l.input_norm, l.post_norm, l.q_norm, l.k_norm, kc, vc, w)
                  for l, (gu, down), (kc, vc), w in zip(self.layers, mlps, self.kv_cache, self.windows)]
        fused = make(layers, cfg.hidden_size, cfg.head_dim, lay.num_q_heads, lay.num_kv_heads,
                     stand_in[0].out_features // 2, cfg.rms_norm_eps, self.scale, self.cos_sin)
        # NOTE: on one rank the step's region runs the final norm and lm_head too (and each row's
        # argmax, for greedy rows); tensor parallel ranks all-gather their vocabulary slices after it
        head = fused is not None and lay.world == 1 and self.lm_head is not None and not cfg.num_experts and \
            fused.set_head(self.norm, self.lm_head, cfg.vocab_size)
        if fused is None:
            # NOTE: ranks decide apart (their slices differ): each that runs op by op says why
            if lay.rank == 0 or lay.world > 1:
                ranks = getattr(self.comm, "world_ranks", None)  # NOTE: the MPI rank, not the replica's
                log.info("decode steps%s: op by op (%s)", "" if lay.world == 1 else
                         f" on rank {ranks[lay.rank] if ranks else lay.rank}", _not_fused(layers))
        elif lay.rank == 0:
            unit = "step" if lay.world == 1 and not cfg.num_experts else "half layer"
            log.info("decode steps: one OpenMP region per %s%s (FusedDecoder)", unit,
                     ", lm_head included" if head else "")
        return fused

    def embed_tokens(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        # ids: [T] -> x: [T, hidden] (into `out` when given)
        ops, lay = self.ops, self.lay
        x = np.empty((ids.shape[0], self.cfg.hidden_size), np.float32) if out is None else out
        lookup = self.embed.lookup if isinstance(self.embed, StoredRows) else (
            lambda rows, into: ops.embedding(rows, self.embed, into))
        if isinstance(self.embed, StoredRows) and isinstance(ops, TimedOps):  # AS_PROFILE: timed as ops.embedding
            lookup = ops.profiler.timed(FORWARD, "embedding", lookup)
        if lay.world == 1:
            if isinstance(self.embed, StoredRows) and ((ids < 0) | (ids >= self.embed.shape[0])).any():
                raise IndexError(f"token id {int(ids[(ids < 0) | (ids >= self.embed.shape[0])][0])} is outside "
                                 f"the vocabulary of {self.embed.shape[0]}.")
            return lookup(ids, x)
        local = ids - lay.vocab.start
        inside = (local >= 0) & (local < self.embed.shape[0])
        if self.embed.shape[0]:  # NOTE: a tiny vocabulary over many ranks leaves the last ones none
            lookup(np.where(inside, local, 0).astype(np.int64), x)
        x[~inside] = 0.0
        self.comm.all_reduce_(x)
        return x

    def _stand_in_mlp(self) -> tuple:
        """The (gate_up, down) pair whose width the step buffers (gu, act) and the FusedDecoder's
        MLP stages take: a dense layer's MLP (a model's dense layers may be wider or narrower than
        its experts), or of a model of experts only, an expert's."""
        dense = next((l for l in self.layers if l.moe is None), None)
        return (dense.gate_up_proj, dense.down_proj) if dense is not None else self.layers[0].moe.experts[0]

    def _buffers(self, T: int) -> "_StepBuffers":
        """The activation buffers of a step of T tokens: every layer writes the same ones, and
        steps of up to KEEP_BUFFER_TOKENS tokens (decode) keep theirs for the next step of T."""
        b = self._kept.get(T)
        if b is None:
            b = _StepBuffers(T, self.cfg, self.lay, self._stand_in_mlp()[0].out_features // 2)
            if T <= KEEP_BUFFER_TOKENS:
                if len(self._kept) >= KEEP_BUFFERS:
                    del self._kept[next(iter(self._kept))]  # the oldest
                self._kept[T] = b
        return b

    def forward(self, plan) -> np.ndarray | None:
        """Run one step; returns logits [S', vocab] for plan.logits_indices (every rank), or
        for an EMBED plan the final normed hidden states [S', hidden] of those rows."""
        # NOTE: a step of decode rows only lets a decode batch take int8 activations (qgemm);
        # a step of prompt rows only keeps bf16 activations however few its rows (2: a prompt's
        # cached-prefix tail computes as in a whole prefill); a mixed step runs each linear twice
        # (_rows_apart), its decode rows as the first and its prompt rows as the second; the flag
        # is this thread's, and is cleared after the step
        only_prompt = 0 < plan.num_prompt_rows == plan.num_tokens
        self.ops.set_decode_step(1 if plan.decode_only else 2 if only_prompt else 0)
        self.greedy_ids = None
        try:
            return self._forward(plan)
        finally:
            self.ops.set_decode_step(False)

    def _forward(self, plan) -> np.ndarray | None:
        ops, lay, comm = self.ops, self.lay, self.comm
        eps, tp = self.cfg.rms_norm_eps, lay.world > 1
        rms_norm, add_rms_norm = ops.rms_norm, ops.add_rms_norm
        rotary, reshape_and_cache, paged_attention = ops.rotary, ops.reshape_and_cache, ops.paged_attention
        pos, slots, cos_sin, scale = plan.positions, plan.slot_mapping, self.cos_sin, self.scale
        # NOTE: the plan's int32 arrays as the attention kernel takes them, converted once a step
        bt, qs, cl = (np.ascontiguousarray(a, dtype=np.int32)
                      for a in (plan.block_tables, plan.query_start, plan.context_lens))
        b = self._buffers(plan.num_tokens)
        residual = self.embed_tokens(plan.token_ids, b.residual)  # [T, H]
        if self.fused is not None and plan.decode_only and plan.num_tokens <= self.fused.MAX_ROWS:
            return self._fused_forward(plan, b, bt, qs, cl)
        h, v, attn, o, gu, act, delta = b.h, b.v, b.attn, b.o, b.gu, b.act, b.delta
        # NOTE: the sequences from s0 on hold prompt rows (the decode rows, one a sequence, come
        # first); in a mixed step whose linears take int8 activations for decode rows (act8), its
        # linears run those d rows apart (_rows_apart); d = 0: one call takes every row
        s0 = plan.num_seqs if plan.num_prompt_rows < 0 else plan.num_tokens - plan.num_prompt_rows
        d = s0 if self._act8 and 0 < plan.num_prompt_rows < plan.num_tokens else 0
        apart = self._rows_apart
        qk_norm = self.cfg.qk_norm
        q, k = (b.qn, b.kn) if qk_norm else (b.q, b.k)  # the views of b.qkv, or their normed copies
        first = True
        for layer, (kc, vc), window in zip(self.layers, self.kv_cache, self.windows):
            if first:
                rms_norm(residual, layer.input_norm, eps, h)
                first = False
            else:
                add_rms_norm(delta, residual, layer.input_norm, eps, h)
            apart(d, layer.qkv_proj.forward, h, b.qkv, lins=(layer.qkv_proj,))  # q, k, v: views of b.qkv
            if qk_norm:
                self._qk_norm(layer, b)
            rotary(q, k, pos, cos_sin)
            reshape_and_cache(k, v, kc, vc, slots)
            paged_attention(q, kc, vc, bt, qs, cl, scale, attn, window, s0)
            apart(d, layer.o_proj.forward, b.attn_rows, o, lins=(layer.o_proj,))  # [T, H] partial sum
            if tp:
                comm.all_reduce_(o)
            add_rms_norm(o, residual, layer.post_norm, eps, h)
            if layer.moe is not None:
                apart(d, partial(layer.moe.forward, ops), h, delta)  # [T, H] partial sum
                if tp:
                    comm.all_reduce_(delta)
                continue
            apart(d, partial(swiglu, ops, layer.gate_up_proj, layer.down_proj), h, delta, gu, act,
                  lins=(layer.gate_up_proj, layer.down_proj))  # [T, H] partial sum
            if tp:
                comm.all_reduce_(delta)
        return self._head(plan, residual, delta, d)

    def _rows_apart(self, d: int, fn, *arrays, lins=(), mixed: bool | None = None) -> None:
        """fn(*arrays) over rows of a step; in a mixed step (`mixed`, by default d > 0), in two
        calls: rows [:d] (decode rows) as a step of decode rows runs them, then rows [d:] (prompt
        rows) as a step of prompt rows does, so that a row's values take the path of its kind,
        whatever rows share its step (either part may be empty: the logits rows of a mixed step
        whose prompt does not end in it are decode rows only); in one call where both kinds take
        the same path in every linear of `lins` (those fn runs). NOTE: the slices of C-contiguous
        rows are C-contiguous; each function writes its out arrays."""
        if not (d > 0 if mixed is None else mixed) or (lins and all(id(lin) in self._one_path for lin in lins)):
            fn(*arrays)
            return
        n, step = arrays[0].shape[0], self.ops.set_decode_step
        try:
            if d > 0:
                step(1)
                fn(*(a[:d] for a in arrays))
            if d < n:
                step(2)
                fn(*(a[d:] for a in arrays))
        finally:
            step(0)

    def _fused_forward(self, plan, b: "_StepBuffers", bt, qs, cl) -> np.ndarray:
        """A decode step in one OpenMP region (one rank), or one region per half layer with the
        all-reduces of o and delta between them (tensor parallel): the values of _forward."""
        args = (b, plan.positions, plan.slot_mapping, bt, qs, cl)
        stages = 2 * len(self.layers)
        idx, V = plan.logits_indices, self.cfg.vocab_size
        if self.lay.world == 1 and plan.kind != EMBED and self.fused.head_fits(idx.shape[0]):
            logits, self.greedy_ids = self.fused.run(*args, 0, stages, idx)
            return logits[:, :V] if logits.shape[1] != V else logits
        if self.cfg.num_experts:  # NOTE: a sparse layer's MLP half between the calls (_fused_decoder)
            for i, layer in enumerate(self.layers):
                o = self.fused.run(*args, 2 * i, 2 * i + 1)
                if self.lay.world > 1:
                    self.comm.all_reduce_(o)
                if layer.moe is None:
                    delta = self.fused.run(*args, 2 * i + 1, 2 * i + 2)
                else:
                    self.ops.add_rms_norm(b.o, b.residual, layer.post_norm, self.cfg.rms_norm_eps, b.h)
                    delta = layer.moe.forward(self.ops, b.h, b.delta)
                if self.lay.world > 1:
                    self.comm.all_reduce_(delta)
        elif self.lay.world == 1:
            self.fused.run(*args, 0, stages)
        else:
            for s in range(stages):
                self.comm.all_reduce_(self.fused.run(*args, s, s + 1))
        return self._head(plan, b.residual, b.delta, 0)

    def burst_rows(self) -> int:
        """The most rows of a decode burst (decode_burst): a step's region must end with the
        head and its argmax (one rank, quantized linears, head_fits); 0: no bursts."""
        if self.fused is None or self.lay.world != 1 or self.lm_head is None:
            return 0
        return max((s for s in range(1, self.fused.MAX_ROWS + 1) if self.fused.head_fits(s)), default=0)

    def decode_burst(self, plan, steps: int) -> np.ndarray:
        """`steps` greedy decode steps of the plan's rows in a row (every row samples; the
        block tables hold the blocks of all of them): step j + 1 takes each row's argmax of step
        j as its token, one position further. Returns the tokens [steps, S] (int64)."""
        S, bs = plan.num_seqs, self.kv_cache[0][0].shape[1]
        if not (0 < S <= self.burst_rows() and plan.num_tokens == S and steps >= 1):
            raise ValueError(f"decode_burst: {plan.num_tokens} tokens of {S} sequences, {steps} steps")
        idx = np.ascontiguousarray(plan.logits_indices, dtype=np.int64)
        if not np.array_equal(idx, np.arange(S)):
            raise ValueError("decode_burst: every row of the plan must sample")
        bt, qs = (np.ascontiguousarray(a, dtype=np.int32) for a in (plan.block_tables, plan.query_start))
        cl = plan.context_lens.astype(np.int32)  # a copy: advanced step by step
        if int(cl.max()) + steps - 1 > bt.shape[1] * bs:
            raise ValueError(f"decode_burst: {steps} steps need more blocks than the block tables hold")
        b = self._buffers(S)
        pos, slots, ids = plan.positions.astype(np.int64), plan.slot_mapping.astype(np.int64), plan.token_ids
        rows, stages = np.arange(S), 2 * len(self.layers)
        out = np.empty((steps, S), np.int64)
        self.ops.set_decode_step(True)
        try:
            for j in range(steps):
                if j:
                    pos += 1
                    cl += 1
                    slots = bt[rows, pos // bs].astype(np.int64) * bs + pos % bs
                self.embed_tokens(ids, b.residual)
                _, ids = self.fused.run(b, pos, slots, bt, qs, cl, 0, stages, idx)
                out[j] = ids
        finally:
            self.ops.set_decode_step(False)
        return out

    def _qk_norm(self, layer: DecoderLayer, b: "_StepBuffers") -> None:
        """Per-head norms of q and k (Qwen3) over [T * heads, D] rows, which needs contiguous
        q and k: b.qn, b.kn = the normed q and k views of b.qkv."""
        D = self.cfg.head_dim
        np.copyto(b.qn, b.q)
        np.copyto(b.kn, b.k)
        qr, kr = b.qn.reshape(-1, D), b.kn.reshape(-1, D)
        self.ops.rms_norm(qr, layer.q_norm, self.cfg.rms_norm_eps, qr)
        self.ops.rms_norm(kr, layer.k_norm, self.cfg.rms_norm_eps, kr)

    def _head(self, plan, residual: np.ndarray, delta: np.ndarray, d: int) -> np.ndarray:
        """The final norm of the rows plan.logits_indices, then lm_head (or, for EMBED, the
        normed rows themselves); d: the step's decode rows (_rows_apart), 0 for one call."""
        cfg, idx = self.cfg, plan.logits_indices
        if idx.shape[0] == 0:
            return np.zeros((0, cfg.vocab_size), np.float32)
        hn = delta[idx]                                     # [S', H] copies of the rows
        self.ops.add_rms_norm(hn, residual[idx], self.norm, cfg.rms_norm_eps, hn)
        if plan.kind == EMBED:
            return hn
        if d:  # NOTE: a mixed step: its decode rows' logits rows first, then its prompts'
            logits = np.empty((idx.shape[0], self.lm_head.out_features), np.float32)
            self._rows_apart(int(np.count_nonzero(idx < d)), self.lm_head.forward, hn, logits,
                             lins=(self.lm_head,), mixed=True)
        else:
            logits = self.lm_head.forward(hn)               # [S', vocab_chunk]
        if self.lay.world > 1:
            logits = self.comm.all_gather(logits)
        return logits[:, :cfg.vocab_size] if logits.shape[1] != cfg.vocab_size else logits


# NOTE: a step of at most this many tokens (a decode batch) keeps its activation buffers for the
# next step of as many tokens, up to KEEP_BUFFERS sizes; a larger one (a prefill chunk) allocates
# its buffers once for all its layers and drops them after the step.
KEEP_BUFFER_TOKENS = 256
KEEP_BUFFERS = 4


class _StepBuffers:
    """Activations of one step of T tokens, written by every layer in turn."""

    def __init__(self, T: int, cfg: ModelConfig, lay: ShardLayout, inter: int):
        H, D, hq, hk = cfg.hidden_size, cfg.head_dim, lay.num_q_heads, lay.num_kv_heads
        f32 = np.float32
        self.residual = np.empty((T, H), f32)                 # [T, H] the residual stream
        self.h = np.empty((T, H), f32)                        # [T, H] normed input of a sublayer
        self.qkv = np.empty((T, (hq + 2 * hk) * D), f32)      # [T, (hq + 2 hk) D]
        qkv3 = self.qkv.reshape(T, hq + 2 * hk, D)
        # q: [T, hq, D], k, v: [T, hk, D], strided views of qkv (the kernels take any row stride)
        self.q, self.k, self.v = qkv3[:, :hq], qkv3[:, hq:hq + hk], qkv3[:, hq + hk:]
        if cfg.qk_norm:  # [T, hq, D], [T, hk, D]: q and k normed per head (_qk_norm)
            self.qn, self.kn = np.empty((T, hq, D), f32), np.empty((T, hk, D), f32)
        self.attn = np.empty((T, hq, D), f32)                 # [T, hq, D]
        self.attn_rows = self.attn.reshape(T, hq * D)         # [T, hq D], the same memory
        self.o = np.empty((T, H), f32)                        # [T, H] o_proj's partial sum
        self.gu = np.empty((T, 2 * inter), f32)               # [T, 2 I_local] = [gate | up]
        self.act = np.empty((T, inter), f32)                  # [T, I_local]
        self.delta = np.empty((T, H), f32)                    # [T, H] the last sublayer's output


def _embedding_table(ckpt: Checkpoint, dtype: str, rows: slice):
    """The embedding rows of this rank. Lookups read T rows a step, so when the kernel can
    read the stored dtype directly (bf16 or f32) we keep the mmapped view: no copy, no RSS
    for rows never used. (bf16 -> f32 is exact, so an f32 engine may read bf16 rows.) A table
    the file stores quantized (GGUF) stays there too: StoredRows dequantizes the rows a step reads."""
    name = "model.embed_tokens.weight"
    raw = ckpt.raw(name)
    if raw.dtype == np.uint16 or (raw.dtype == np.float32 and dtype == "float32"):
        return raw[rows]
    if getattr(ckpt, "quantized", None) is not None and not isinstance(raw, np.ndarray):
        return StoredRows(ckpt, name, rows)
    return load_rows(ckpt, name, dtype, rows)


class StoredRows:
    """A rank's rows of an embedding table the file stores quantized, left in the (memory-mapped)
    file: a lookup dequantizes the distinct rows it reads, in f32 as llama.cpp's get_rows does
    (a dense copy of Qwen2.5-7B's Q4_K table is 1 GB a rank in bf16; the file holds 280 MB)."""

    nbytes = 0  # NOTE: no memory of its own

    def __init__(self, ckpt, name: str, rows: slice):
        self.ckpt, self.name, self.start = ckpt, name, rows.start
        self.shape = (rows.stop - rows.start, ckpt.raw(name).shape[1])

    def lookup(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[t] = row ids[t] of this rank's rows (ids in range), f32."""
        from ..quant.formats import dequantize
        if ids.shape[0]:
            distinct, where = np.unique(ids, return_inverse=True)
            w = self.ckpt.quantized(self.name, distinct + self.start, None)
            out[...] = dequantize(w)[where.reshape(-1)]
        return out


@contextlib.contextmanager
def _named_errors(source: str, world: int):
    """Errors of loading a shard (a split that cuts a group or block, a tensor the model lacks)
    prefixed with the model and, on several ranks, their count."""
    try:
        yield
    except (QuantError, UnsupportedModelError) as e:
        where = "" if world == 1 else f" on {world} ranks"
        job = (env.mpi_world() or (0, 1))[1]
        if job > world:  # NOTE: a replica's group: say so, the job has more ranks than the message counts
            where += (f" (a replica of the job's {job} ranks, which run {job // world} replicas; data_parallel={job} "
                      "runs one a rank)")
        raise type(e)(f"{source}{where}: {e}") from None


def _check_tensors(cfg: ModelConfig, ckpt: Checkpoint) -> None:
    """Fail before reading weights if the checkpoint lacks what the config promises."""
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):  # NOTE: a middle layer's gap failed later, as a bare CheckpointError
        mlp = () if cfg.is_moe_layer(i) else ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
        for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", *mlp, "input_layernorm.weight", "post_attention_layernorm.weight"):
            need.append(f"model.layers.{i}.{n}")
    missing = [n for n in need if n not in ckpt]
    stored = getattr(ckpt, "stored_name", lambda n: n)  # NOTE: a GGUF's own names in its errors
    source = getattr(ckpt, "config_source", "config.json")
    if missing:
        first = missing[0]
        layer = first.split(".")[2] if first.startswith("model.layers.") else None
        sparse = (layer is not None and first.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight",
                                                         "mlp.down_proj.weight"))
                  and f"model.layers.{layer}.mlp.gate.weight" in ckpt)
        why = (f"; its layer {layer} holds a router and experts, where {source} makes the layer dense "
               "(num_experts, decoder_sparse_step, mlp_only_layers)") if sparse else ""
        raise UnsupportedModelError(f"the checkpoint lacks {stored(first)} ({len(missing)} expected "
                                    f"tensors missing){why}.")
    # NOTE: every tensor's shape, as transformers checks them: a slice past a tensor's end would
    # be cut short without a word (a wrong num_key_value_heads, intermediate_size or vocab_size)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    want = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
            "lm_head.weight": (cfg.vocab_size, h)}
    per_layer = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                 "self_attn.o_proj.bias": (h,), "self_attn.q_norm.weight": (cfg.head_dim,),
                 "self_attn.k_norm.weight": (cfg.head_dim,), "mlp.gate_proj.weight": (i, h),
                 "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
                 "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    for layer in range(cfg.num_layers):
        want.update({f"model.layers.{layer}.{n}": shape for n, shape in per_layer.items()
                     if not (cfg.is_moe_layer(layer) and n.startswith("mlp."))})
    for name, shape in want.items():
        if name in ckpt and tuple(ckpt.raw(name).shape) != shape:
            raise UnsupportedModelError(
                f"{stored(name)} has shape {tuple(ckpt.raw(name).shape)}, but {source} implies {shape} "
                f"(hidden_size {h}, intermediate_size {i}, {cfg.num_heads} attention and {cfg.num_kv_heads} "
                f"key/value heads of {cfg.head_dim}, vocab_size {cfg.vocab_size}): the config does not describe "
                "these weights.")
    if cfg.num_experts:
        check_moe_tensors(cfg, ckpt)


def _same_first_row(ckpt, a: str, b: str) -> bool:
    """Whether two stored matrices begin alike (a tied head some checkpoints also store)."""
    try:
        first = slice(0, 1)
        return bool(np.array_equal(ckpt.load(a, "float32", rows=first), ckpt.load(b, "float32", rows=first)))
    except Exception:  # noqa: BLE001 - a check for a warning only
        return False
