"""A GGUF file read as a checkpoint with Hugging Face tensor names, sliced per rank.

The `gguf` package parses the file and maps the tensor data (numpy memmaps); the block math is
ours. Each quantized type keeps its own bit width (quant/formats.py):
    Q8_0 -> int8 group 32 "sym";  Q4_0 -> int4 group 32 "sym" (w = d (q - 8));
    Q4_1 -> int4 group 32 "min" (w = d q + m);  Q5_0 -> int5 group 32 "sym" (w = d (q - 16));
    Q5_1 -> int5 group 32 "min"
without loss (blocks of 32 with f16 scales and offsets), and the K-quants' 256-element
super-blocks without loss too, as formats with super-block scales (quant/formats.py, ks = 256):
    Q4_K -> int4 group 32 "min";  Q5_K -> int5 group 32 "min";  Q6_K -> int6 group 16 "sym";
    Q3_K -> int3 group 16 "sym" (code q3 + 4);  Q2_K -> int2 group 16 "min"
(w = d sc q - dmin m, or d sc (q - 32)): the codes, the 4/6/8-bit sub-scales and mins and the
f16 d/dmin as stored (Q3_K and Q2_K: 3.5625 and 2.625 bits a weight against the file's 3.4375
and 2.625: Q3_K's 6-bit sub-scales take a byte each, Q2_K's 4-bit sub-scale and min share one).
The MLP is split on super-block
boundaries (down_proj's columns, sharding.balanced_split with 256-column units) wherever each rank
can have one. A rank whose columns still start or end inside a super-block (o_proj when its
heads' columns are no multiple of 256; an MLP of fewer super-blocks than ranks) takes its groups with f16
scales instead: each sub-block's d * sc and dmin * m (up to 19 significant bits) rounded to f16,
a relative change of at most 2^-11 of each; where such a product leaves f16's range the tensor
is dequantized (logged). IQ4_NL and IQ4_XS (4-bit codes of 16 non-linear levels) map without
loss onto int4 "nl" (w = s NL[q]): IQ4_NL in blocks of 32 with f16 scales, IQ4_XS with
super-block scales (6-bit sub-scales - 32 as int8 under f16 d): 4.5 and 4.3125 bits a weight
against the file's 4.5 and 4.25. F32/F16/BF16 tensors are dense. Any other type is an error naming it.

llama/mistral GGUFs store q/k rows (and q/k biases) in llama.cpp's interleaved rotary order; rows are mapped back
to Hugging Face's rotate-half order (a permutation inside each head, so a rank's whole heads stay
its own).
"""
from __future__ import annotations

import logging

import numpy as np

from .backend.reference import bf16_to_f32, f32_to_bf16
from .quant.formats import QuantError, QuantFormat, QuantizedWeight
from .weights import CheckpointError

log = logging.getLogger("numa_runtime")

BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3's fused q/k/v (split at load)
    # mixture of experts: the router, and Qwen2-MoE's shared expert and its gate ([H], HF's [1, H])
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# the experts' 3-D tensors [E, N, K] (GGUF shape [K, N, E]), read as one tensor an expert
EXPERT_STACKS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                 "ffn_down_exps.weight": "down_proj"}
# NOTE: Phi-3's ffn_up holds gate_up_proj (gate rows, then up rows; llama.cpp's SWIGLU halves)
FUSED_UP = {"phi3": "mlp.gate_up_proj.weight"}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
DENSE = ("F32", "F16", "BF16")
LOSSLESS = {"Q8_0": (QuantFormat(8, 32, "sym"), 34), "Q4_0": (QuantFormat(4, 32, "sym"), 18),
            "Q4_1": (QuantFormat(4, 32, "min"), 20), "Q5_0": (QuantFormat(5, 32, "sym"), 22),
            "Q5_1": (QuantFormat(5, 32, "min"), 24), "IQ4_NL": (QuantFormat(4, 32, "nl"), 18)}
# NOTE: K-quants in 256-element super-blocks: (format, bytes per super-block, 256); decode_kquant
NEAR_LOSSLESS = {"Q4_K": (QuantFormat(4, 32, "min"), 144, 256),
                 "Q5_K": (QuantFormat(5, 32, "min"), 176, 256),
                 "Q6_K": (QuantFormat(6, 16, "sym"), 210, 256),
                 "Q3_K": (QuantFormat(3, 16, "sym"), 110, 256),
                 "Q2_K": (QuantFormat(2, 16, "min"), 84, 256),
                 "IQ4_XS": (QuantFormat(4, 32, "nl"), 136, 256)}
PERMUTED_ARCHS = ("llama", "mistral")
# tensors gguf_model reads into config.json rather than loading: the rope frequency divisors
ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # Phi-3's
CONFIG_TENSORS = (ROPE_FREQS, *LONGROPE_FACTORS)


def gguf_name(name: str, arch: str = "") -> str:
    """The GGUF name of the Hugging Face tensor `name` (hf_name's inverse; `name` itself where
    the GGUF has none), for error messages."""
    for g, h in TOP_NAMES.items():
        if h == name:
            return g
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for g, h in BLOCK_NAMES.items():
            if h == parts[3] or (g == "ffn_up.weight" and FUSED_UP.get(arch) == parts[3]):
                return f"blk.{parts[2]}.{g}"
    return name


def hf_name(gguf_name: str, arch: str = "") -> str | None:
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in BLOCK_NAMES:
        hf = FUSED_UP.get(arch) if parts[2] == "ffn_up.weight" else None
        return f"model.layers.{int(parts[1])}.{hf or BLOCK_NAMES[parts[2]]}"
    return None


class _Rows:
    """Consecutive rows of a 2-D _Tensor, as a tensor of its own (a fused tensor's part)."""

    def __init__(self, t, start: int, n: int):
        self.name, self.type = f"{t.name}[{start}:{start + n}]", t.type
        self.shape = [t.shape[0], n, *t.shape[2:]]
        self.data = t.data[start:start + n]


def _split_fused(tensors: dict, n_head: int, n_kv_head: int, path: str) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj as Llama's separate tensors (rows of them)."""
    for name in [n for n in tensors if n.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))]:
        t = tensors.pop(name)
        rows, stem = int(t.shape[1]), name.rsplit(".", 2)[0]
        if name.endswith("qkv_proj.weight"):
            d = rows // (n_head + 2 * n_kv_head)
            parts = [("q_proj", n_head * d), ("k_proj", n_kv_head * d), ("v_proj", n_kv_head * d)]
        else:
            parts = [("gate_proj", rows // 2), ("up_proj", rows // 2)]
        if sum(n for _, n in parts) != rows:
            raise CheckpointError(f"{path}: tensor {t.name} has {rows} rows, which do not split into "
                                  f"{', '.join(p for p, _ in parts)}.")
        start = 0
        for part, n in parts:
            tensors[f"{stem}.{part}.weight"] = _Rows(t, start, n)
            start += n


class _Expert:
    """Expert j of a 3-D expert stack _Tensor, as a 2-D tensor of its own (GGUF shape [K, N])."""

    def __init__(self, t, j: int):
        n = int(t.shape[1])
        self.name, self.type, self.shape = f"{t.name}[{j}]", t.type, list(t.shape[:2])
        self.data = t.data[j * n:(j + 1) * n]


class _Tensor:
    """One tensor of the index: GGUF name, type name, GGUF shape (innermost first), and its
    bytes in the file as [rows, bytes per row] (a memmap view)."""

    def __init__(self, entry: dict, mm: np.ndarray, path: str):
        self.name, self.type, self.shape = entry["name"], entry["type"], entry["shape"]
        off, n = entry["offset"], entry["nbytes"]
        if off + n > mm.shape[0]:
            raise CheckpointError(f"{path} is truncated: tensor {self.name} ends at byte {off + n}, "
                                  f"the file has {mm.shape[0]}.")
        rows = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        self.data = mm[off:off + n].reshape(rows, n // rows) if len(self.shape) > 1 else mm[off:off + n]


class _QuantView:
    """Shape and dtype of a quantized tensor (what model code asks `raw` for); no data."""

    def __init__(self, shape):
        self.shape, self.dtype = tuple(shape), np.dtype(np.uint8)


class GGUFCheckpoint:
    """The Checkpoint interface (names, raw, load) plus `quantized` for lossless blocks."""

    def __init__(self, path: str, index: dict, n_head: int, n_kv_head: int, files: list[str] | None = None):
        """index: {"architecture", "tensors": [{name, type, shape, offset, nbytes, file}]}, read
        from the file once by gguf_model (the gguf package); `files`: the files of a split model
        (tensor field "file" indexes them), else just `path`."""
        self.path, self.arch = path, index["architecture"]
        files = files or [path]
        maps = [np.memmap(f, dtype=np.uint8, mode="r") for f in files]
        # NOTE: llama.cpp's converter permutes q/k biases (attention_bias) as it does the weights
        self.heads = {"self_attn.q_proj.weight": n_head, "self_attn.k_proj.weight": n_kv_head,
                      "self_attn.q_proj.bias": n_head, "self_attn.k_proj.bias": n_kv_head}
        self._tensors = {}
        ignored = []
        for entry in index["tensors"]:
            f = int(entry.get("file", 0))
            t = _Tensor(entry, maps[f], files[f])
            name = hf_name(t.name, self.arch)
            kind = t.type
            stack = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else ""
            if name is None and stack not in EXPERT_STACKS:
                if t.name not in CONFIG_TENSORS:
                    ignored.append(t.name)
                continue
            if kind not in DENSE and kind not in LOSSLESS and kind not in NEAR_LOSSLESS:
                raise CheckpointError(f"{path}: tensor {t.name} has GGUF type {kind}, which "
                                      f"numa_runtime does not read (supported: "
                                      f"{', '.join(DENSE + tuple(LOSSLESS) + tuple(NEAR_LOSSLESS))}).")
            if stack in EXPERT_STACKS:
                if len(t.shape) != 3:
                    raise CheckpointError(f"{path}: tensor {t.name} has shape {list(t.shape)}, not the 3 "
                                          "dimensions of stacked experts.")
                stem = f"model.layers.{int(t.name.split('.')[1])}.mlp.experts."
                for j in range(int(t.shape[2])):
                    self._tensors[f"{stem}{j}.{EXPERT_STACKS[stack]}.weight"] = _Expert(t, j)
                continue
            self._tensors[name] = t
        if self.arch == "phi3":
            _split_fused(self._tensors, n_head, n_kv_head, path)
        if ignored:
            log.warning("%s: ignoring %d GGUF tensor(s) that numa_runtime does not use: %s", path, len(ignored),
                        ", ".join(ignored[:8]) + (", ..." if len(ignored) > 8 else ""))
        self._logged = set()

    # NOTE: where a rank split may cut a super-block when its super-blocks do not share out (the cut
    # ones take f16 group scales): its 32-element groups. AWQ/GPTQ groups have no such finer unit.
    cut_align = 32

    @property
    def split_align(self) -> int:
        """What a rank's MLP columns come in multiples of: 256 where a down_proj is stored in
        super-blocks (K-quants, IQ4_XS: a split on their boundaries keeps the file's scales
        exact), 32 where one is kept in 32-element blocks, else 1. Only down_proj's blocks run
        along those columns (gate/up split by their rows): a file quantized but for a dense
        down_proj, as llama-quantize leaves an MLP width that is no multiple of 32, splits anywhere."""
        down = [t.type for n, t in self._tensors.items() if n.endswith("down_proj.weight")]
        if any(k in NEAR_LOSSLESS for k in down):
            return 256
        return 32 if any(k not in DENSE for k in down) else 1

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def stored_name(self, name: str) -> str:
        """The file's name of the tensor read as `name` (blk.N.ffn_*_exps.weight[j] for an
        expert), or the name it would have (a missing one), for error messages."""
        t = self._tensors.get(name)
        return gguf_name(name, self.arch) if t is None else t.name

    # what the model's sizes come from, for error messages (a Hugging Face checkpoint: config.json)
    config_source = "the GGUF metadata"

    def _t(self, name):
        if name not in self._tensors:
            raise CheckpointError(f"Tensor {name!r} is missing from {self.path}.")
        return self._tensors[name]

    def shape(self, name: str) -> tuple:
        return tuple(int(d) for d in reversed(self._t(name).shape))  # GGUF: innermost first

    def raw(self, name: str):
        """Dense tensors: the mmapped data (bf16 as uint16). Quantized: shape and dtype only."""
        t = self._t(name)
        kind = t.type
        if kind not in DENSE:
            return _QuantView(self.shape(name))
        dt = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[kind]
        return t.data.view(dt).reshape(self.shape(name))

    def _row_index(self, name: str, rows, n: int):
        """GGUF rows holding HF rows `rows`, a slice or an array of row numbers (q/k of llama
        GGUFs are permuted within heads)."""
        sl = rows if rows is not None else slice(0, n)
        heads = self.heads.get(name.split(".", 3)[-1]) if self.arch in PERMUTED_ARCHS else None
        if heads is None:
            return sl
        d = n // heads
        i = np.arange(sl.start, sl.stop) if isinstance(sl, slice) else np.asarray(sl)
        r = i % d
        return (i // d) * d + 2 * (r % (d // 2)) + r // (d // 2)

    def quantized(self, name: str, rows, cols: slice | None) -> QuantizedWeight | None:
        """Rows (a slice, or an array of row numbers)/cols of a Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL
        tensor as our format, bit for bit, or of a K-quant or IQ4_XS tensor with super-block
        scales (exact), or with its scales rounded to f16 off super-block boundaries
        (decode_kquant); None otherwise (dense)."""
        t = self._t(name)
        kind = t.type
        if kind not in LOSSLESS and kind not in NEAR_LOSSLESS:
            return None  # dense
        n, k = self.shape(name)
        c0, c1 = (0, k) if cols is None else (cols.start, cols.stop)
        if c0 % 32 or (c1 % 32 and c1 != k):
            raise QuantError(f"{name} ({kind}) would be split at input column {c0 if c0 % 32 else c1}, "
                             "inside a 32-element block; use a rank count whose split falls on block boundaries, "
                             "or model replicas (data_parallel, --data-parallel or numa-launch --dp).")
        idx = self._row_index(name, rows, n)
        if kind in NEAR_LOSSLESS:
            _, bsize, per = NEAR_LOSSLESS[kind]
            s0, s1 = c0 // per, -(-c1 // per)                                     # super-blocks of the slice
            blocks = np.asarray(t.data).reshape(n, k // per, bsize)[idx][:, s0:s1]
            if c0 % per == 0 and c1 % per == 0:
                return decode_kquant(kind, np.ascontiguousarray(blocks), exact=True)
            w = decode_kquant(kind, np.ascontiguousarray(blocks))
            if w is None:
                self._log_dequantized(name, kind)
                return None
            G = w.fmt.group_size
            g0, g1 = (c0 - s0 * per) // G, (c1 - s0 * per + G - 1) // G
            return QuantizedWeight(w.fmt, w.q[:, g0 * G:g0 * G + c1 - c0], w.scales[:, g0:g1],
                                   None if w.offsets is None else w.offsets[:, g0:g1], c1 - c0)
        fmt, bsize = LOSSLESS[kind]
        blocks = np.asarray(t.data).reshape(n, k // 32, bsize)
        blocks = blocks[idx][:, c0 // 32:c1 // 32]    # [n', nb, bsize]
        return decode_blocks(kind, np.ascontiguousarray(blocks), c1 - c0)

    def load(self, name: str, dtype: str, rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
        """A dense copy of (a slice of) a tensor in `dtype` ('bfloat16' -> uint16 bits, 'float32')."""
        t = self._t(name)
        kind = t.type
        shape = self.shape(name)
        if len(shape) == 1:
            w = self.raw(name)
            w = bf16_to_f32(w) if kind == "BF16" else w
            w = np.asarray(w, np.float32)[self._row_index(name, rows, shape[0])]
        elif kind in LOSSLESS:
            from .quant.formats import dequantize
            w = dequantize(self.quantized(name, rows, cols))
        else:
            idx = self._row_index(name, rows, shape[0])
            if kind in DENSE:
                w = self.raw(name)[idx]
                w = bf16_to_f32(w) if kind == "BF16" else w.astype(np.float32)
            else:
                from gguf import GGMLQuantizationType
                from gguf.quants import dequantize as gguf_dequantize
                w = gguf_dequantize(np.asarray(t.data[idx]), GGMLQuantizationType[kind]).reshape(-1, shape[1])
            if cols is not None:
                w = w[:, cols]
        w = np.ascontiguousarray(w, dtype=np.float32)
        return f32_to_bf16(w) if dtype == "bfloat16" else w

    def _log_dequantized(self, name: str, kind: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.info("%s: %s columns off a super-block boundary whose scale products leave f16's "
                     "range are held dense (%s and any other such tensor), more bytes than the "
                     "file holds", self.path, kind, name)


def decode_blocks(kind: str, blocks: np.ndarray, k: int) -> QuantizedWeight:
    """GGUF blocks [n, nb, bytes] -> our logical QuantizedWeight [n, k] (k = 32 nb)."""
    fmt = LOSSLESS[kind][0]
    n, nb, _ = blocks.shape
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]                     # [n, nb]
    if kind == "Q8_0":
        q = blocks[:, :, 2:34].copy().view(np.int8).reshape(n, nb * 32)
        return QuantizedWeight(fmt, q, d, None, k)
    if kind in ("Q5_0", "Q5_1"):
        # NOTE: [f16 m (Q5_1)], 4 bytes of high bits (bit j: element j), then low nibbles as in
        # Q4_0: q in 0..31, w = d (q - 16) or d q + m
        off = 4 if kind == "Q5_1" else 2
        qh = blocks[:, :, off:off + 4].copy().view("<u4")                      # [n, nb, 1]
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)     # [n, nb, 32]
        qs = blocks[:, :, off + 4:off + 20]
        lo = np.concatenate([qs & 0xF, qs >> 4], axis=2)
        q = (lo | (hi << 4)).reshape(n, nb * 32)
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0] if kind == "Q5_1" else None
        return QuantizedWeight(fmt, q, d, m, k)
    off = 4 if kind == "Q4_1" else 2
    qs = blocks[:, :, off:off + 16]                                            # [n, nb, 16]
    # NOTE: element j of a block is the low nibble of byte j, element j + 16 its high nibble
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(n, nb * 32).astype(np.uint8)
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0] if kind == "Q4_1" else None
    return QuantizedWeight(fmt, q, d, m, k)


def _f16_products(d: np.ndarray, sc: np.ndarray, n: int, ng: int) -> np.ndarray:
    """f16(d * sc) per sub-block [n, ng] (d [n, ns] f16 per super-block, sc [n, ns, ng / ns]),
    the product exact in f32 before the one rounding."""
    with np.errstate(over="ignore"):
        return (d.astype(np.float32)[..., None] * sc.astype(np.float32)).reshape(n, ng).astype(np.float16)


def decode_q4k(blocks: np.ndarray) -> QuantizedWeight | None:
    """Q4_K super-blocks [n, ns, 144] -> int4 group 32 "min" [n, 256 ns]: q as stored, scale
    f16(d sc) and offset f16(-dmin m) per 32-element sub-block (w = s q + offset). None when a
    product leaves f16's range (the caller keeps the tensor dense)."""
    return decode_kquant("Q4_K", blocks)


def _scale_min_k4(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of Q4_K/Q5_K's 12 bytes [n, ns, 12]: sub-blocks 0-3 in
    the low bits of bytes 0-3 / 4-7; sub-blocks 4-7 take a nibble of bytes 8-11 (scale low, min
    high) and the top 2 bits of bytes 0-3 / 4-7."""
    sc = np.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 15) | ((b[..., 0:4] >> 6) << 4)], axis=2)
    mn = np.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], axis=2)
    return sc, mn


def decode_kquant(kind: str, blocks: np.ndarray, exact: bool = False) -> QuantizedWeight | None:
    """Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_XS super-blocks [n, ns, bytes] -> our format [n, 256 ns]: the codes as
    stored; `exact`: the sub-scales and mins as int8 under the super-blocks' f16 d/dmin (ks =
    256), else each sub-block's scale (and min) rounded once to f16 (NEAR_LOSSLESS; None when a
    product leaves f16's range: the caller keeps the tensor dense)."""
    fmt = NEAR_LOSSLESS[kind][0]
    if exact:
        fmt = QuantFormat(fmt.bits, fmt.group_size, fmt.kind, ks=256)
    n, ns, _ = blocks.shape
    f16 = lambda a, b: blocks[:, :, a:b].copy().view(np.float16)[..., 0]  # noqa: E731  [n, ns]
    offsets = None
    if kind == "IQ4_XS":
        # NOTE: f16 d, 2 bytes of the sub-scales' high 2 bits (2 a sub-block), 4 bytes of their
        # low nibbles (low then high), then 8 x 16 bytes of codes: sub-block b's 32 elements are
        # the low nibbles of its 16 bytes, then the high ones; w = d (ls - 32) NL[q]
        qs = blocks[:, :, 8:136].reshape(n, ns, 8, 16)
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, ns * 256).astype(np.uint8)
        sh = blocks[:, :, 2:4].copy().view("<u2")                                 # [n, ns, 1]
        sl = blocks[:, :, 4:8]
        lo = np.stack([sl & 15, sl >> 4], axis=3).reshape(n, ns, 8)
        hi = (sh >> (2 * np.arange(8, dtype=np.uint16))) & 3
        sc = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)             # [n, ns, 8]
        d = f16(0, 2)
        if exact:
            return QuantizedWeight(fmt, q, sc.reshape(n, ns * 8).copy(), None, ns * 256, (d, None))
        scales = _f16_products(d, sc, n, ns * 8)
    elif kind in ("Q3_K", "Q2_K"):
        # NOTE: element 128 h + 32 j + l (h: half, j: 0..3, l: 0..31) has its low 2 bits at 2j
        # of qs[32 h + l]; its sub-block of 16 is 8 h + 2 j + l // 16. Q3_K: 32 bytes of hmask
        # first (bit 4 h + j of byte l: the third bit, q - 4 when clear), qs [64], 12 bytes of
        # 6-bit scales (low nibbles in bytes 0-7, low then high; the top 2 bits in bytes 8-11,
        # 2 bits per sub-block), f16 d; w = d (sc - 32) q3 = d sc' (c - 4) with c = q3 + 4.
        # Q2_K: 16 bytes of scale (low nibble) and min (high), qs [64], f16 d and dmin;
        # w = d sc q2 - dmin m
        q3 = kind == "Q3_K"
        qs = blocks[:, :, 32:96] if q3 else blocks[:, :, 16:80]
        qs = qs.reshape(n, ns, 2, 1, 32)                                         # [.., h, 1, l]
        sh = (2 * np.arange(4, dtype=np.uint8))[:, None]                        # [j, 1]
        q = (qs >> sh) & 3                                                       # [.., h, j, l]
        if q3:
            hm = blocks[:, :, 0:32].reshape(n, ns, 1, 1, 32)
            hb = (np.arange(8, dtype=np.uint8).reshape(2, 4, 1))                # bit 4 h + j
            q = q + (((hm >> hb) & 1) << 2)
            b = blocks[:, :, 96:108]
            lo = np.concatenate([b[..., 0:8] & 15, b[..., 0:8] >> 4], axis=2)   # [n, ns, 16]
            hi = (b[..., 8:12, None] >> (2 * np.arange(4, dtype=np.uint8))) & 3  # [n, ns, i, j // 4]
            sc = ((lo | (hi.transpose(0, 1, 3, 2).reshape(n, ns, 16) << 4)).astype(np.int16) - 32).astype(np.int8)
            d, mn, dmin = f16(108, 110), None, None
        else:
            sc = (blocks[:, :, 0:16] & 15).astype(np.int8)
            mn = (blocks[:, :, 0:16] >> 4).astype(np.int8)
            d, dmin = f16(80, 82), f16(82, 84)
        q = q.reshape(n, ns * 256).astype(np.uint8)
        if exact:
            return QuantizedWeight(fmt, q, sc.reshape(n, ns * 16).copy(),
                                   None if mn is None else mn.reshape(n, ns * 16).copy(), ns * 256, (d, dmin))
        scales = _f16_products(d, sc, n, ns * 16)
        if mn is not None:
            offsets = -_f16_products(dmin, mn, n, ns * 16)
    elif kind == "Q6_K":
        # NOTE: ql [128], qh [64], 16 int8 scales, f16 d. Each 128-element half h: element
        # 32 c + l (c: 0..3) has its low nibble in ql[64 h + l + 32 (c % 2)] (low for c < 2, high
        # after) and its two high bits at 2c of qh[32 h + l]; sub-block t of 16 takes scale t
        ql = blocks[:, :, 0:128].reshape(n, ns, 2, 2, 32)                  # [.., h, c % 2, l]
        qh = blocks[:, :, 128:192].reshape(n, ns, 2, 1, 32)                # [.., h, 1, l]
        lo = np.concatenate([ql & 15, ql >> 4], axis=3)                     # [.., h, c, l]
        hi = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3       # [.., h, c, l]
        q = (lo | (hi << 4)).reshape(n, ns * 256).astype(np.uint8)
        sc = blocks[:, :, 192:208].copy().view(np.int8)                    # [n, ns, 16]
        if exact:
            return QuantizedWeight(fmt, q, sc.reshape(n, ns * 16).copy(), None, ns * 256, (f16(208, 210), None))
        scales = _f16_products(f16(208, 210), sc, n, ns * 16)
    else:
        d, dmin = f16(0, 2), f16(2, 4)
        sc, mn = _scale_min_k4(blocks[:, :, 4:16])
        # codes: 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles, 2c + 1 high
        qoff = 16 if kind == "Q4_K" else 48
        qs = blocks[:, :, qoff:qoff + 128].reshape(n, ns, 4, 1, 32)
        q = np.concatenate([qs & 15, qs >> 4], axis=3)                       # [n, ns, 4, 2, 32]
        if kind == "Q5_K":
            # NOTE: qh [32] after the scales: bit j of byte l is element l of sub-block j
            qh = blocks[:, :, 16:48].reshape(n, ns, 1, 1, 32)
            sub = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
            q = q | (((qh >> sub) & 1) << 4)
        q = q.reshape(n, ns * 256).astype(np.uint8)
        if exact:
            return QuantizedWeight(fmt, q, sc.reshape(n, ns * 8).astype(np.int8), mn.reshape(n, ns * 8).astype(np.int8),
                                   ns * 256, (d, dmin))
        scales = _f16_products(d, sc, n, ns * 8)
        offsets = -_f16_products(dmin, mn, n, ns * 8)
    if not (np.isfinite(scales).all() and (offsets is None or np.isfinite(offsets).all())):
        return None
    return QuantizedWeight(fmt, q, scales, offsets, ns * 256)
