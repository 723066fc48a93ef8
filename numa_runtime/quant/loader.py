"""One rank's linear layers from any weight source: dense, quantized while loading, or
already quantized in the file (GGUF, AWQ, GPTQ).

    linear = LinearFactory(ops, ckpt, dtype, quant)      # quant: QuantFormat or None
    qkv = linear([(q_name, rows, None), (k_name, rows, None), (v_name, rows, None)], bias)

A part is (tensor name, output-row slice or None, input-column slice or None): the slice this
rank holds of W [N, K]. Parts are fused along the output dimension.
- Dense checkpoint, no quantization: ops.Linear over the concatenated slices (bf16 or f32).
- Dense checkpoint + `quant`: every slice is read from the mmap as f32, quantized and dropped,
  tensor by tensor, so no rank ever holds more than one unquantized slice.
- A checkpoint with `quantized(name, rows, cols)` (GGUF, AWQ/GPTQ) hands over its own integer
  blocks; parts of different formats run as separate linears writing into one output.
- The lm_head (`head`) has a format of its own, `head_quant` (head_quantization): stored
  quantized heads stay as they are; a dense one is quantized at load only to `head_quant`.
"""
from __future__ import annotations

import numpy as np

from .formats import QuantError, QuantFormat, QuantizedWeight, concat_rows, quantize
from .reference import ACT8_BLOCK
from .packing import pack
from ..weights import load_rows

Part = tuple  # (name, rows: slice | None, cols: slice | None)


def qlinear(ops, qw: QuantizedWeight, bias: np.ndarray | None = None, bf16: bool = False,
            act8: bool | None = None, residual: bool = False):
    """The backend's QLinear over one quantized weight (packed once here). `bf16`: the engine
    computes in bf16, so prefill may round the dequantized weights to bf16 (matrix units) and,
    unless `act8` is False, decode may round its activations to int8 blocks (integer dot
    products); `residual`: as two int8 rows, x and its rounding residual (about 15 bits)."""
    lin = ops.QLinear(pack(qw), qw.fmt.bits, qw.fmt.kind, qw.group, qw.in_features,
                      qw.out_features, bias, qw.fmt.ks)
    lin.prefill_bf16 = bf16
    lin.act8 = bf16 if act8 is None else act8
    lin.act8_residual = residual
    return lin


def _group_words(fmt: QuantFormat) -> str:
    """'the quantization group of 128 (nor of 64 or 32, tried too)': the groups a weight's input
    features were fitted to (QuantFormat.for_k), for an error that none divides them."""
    smaller = [g for g in (64, 32) if g < fmt.group_size] if fmt.fit_group else []
    tried = f" (nor of {' or '.join(str(g) for g in smaller)}, tried too)" if smaller else ""
    return f"the quantization group of {fmt.group_size}{tried}"


# NOTE: vocabulary rows of a dense lm_head quantized at a time (the f32 copy of one chunk is
# what a rank holds unquantized: 16384 x 896 x 4 B = 59 MB for Qwen2.5-0.5B, not 545 MB)
HEAD_CHUNK = 16384


class LinearFactory:
    def __init__(self, ops, ckpt, dtype: str, quant: QuantFormat | None = None,
                 head_quant: QuantFormat | None = None):
        self.ops, self.ckpt, self.dtype, self.quant = ops, ckpt, dtype, quant
        self.head_quant = head_quant
        self.bf16 = dtype == "bfloat16"

    def split_align(self, k: int, world: int = 1, what: str = "mlp.down_proj", even: bool = False) -> int:
        """Input columns a rank's slice of a row-parallel weight with k input features (the
        MLP's down_proj) must come in multiples of: the file's quantization blocks (its
        super-blocks where `world` ranks can each have one, else their 32-element groups), or the
        group we quantize it in (1 for dense weights), the same group on every rank count.
        `even` (an MoE's experts, split with no other load to balance them): super-blocks only
        where they share out within 10% (Qwen3-30B-A3B's 768 columns are 3 super-blocks: 2 + 1
        on 2 ranks would make one rank stream twice the other's expert bytes every token).
        One group a row ('int8-channel'): the int8 activation blocks of decode (ACT8_BLOCK, 32)
        where k holds one a rank, so that each rank rounds the activation blocks one rank rounds
        (its blocks start at its slice's first column: an 88/112 split of 200 columns gave other
        logits on 2 ranks than on 1 in a bf16 engine); else the k of a packed unit (4) where k
        allows it, so that no rank's slice is padded (a padded slice decodes op by op:
        qgemm.fused_decode_usable)."""
        q = self.quant
        if q is None:
            own = 1
        elif q.group_size < 0:
            own = ACT8_BLOCK if k // ACT8_BLOCK >= world else q.pack_k if k % q.pack_k == 0 else 1
        else:
            own = q.for_split(k).group_size
        if q is not None and q.group_size > 0 and k % own:  # NOTE: no rank count can help; say so first
            raise QuantError(f"model.layers.*.{what}.weight: its {k} input features are not a multiple of "
                             f"{_group_words(q.for_split(k))}; choose a quantization whose group divides them, "
                             "or 'int8-channel'.")
        stored = getattr(self.ckpt, "split_align", 1)
        cut = getattr(self.ckpt, "cut_align", None)  # NOTE: a GGUF's super-blocks may be cut into groups of 32
        units = k // stored if cut and stored > cut else 0
        if units and (units < world or (even and -(-units // world) * world > 1.1 * units)):
            # NOTE: fewer super-blocks than ranks: cut ones take f16 group scales (gguf_checkpoint); an
            # AWQ/GPTQ group cannot be cut, so its splits stay on groups (uneven ones where need be)
            stored = cut
        return max(own, stored)

    def smaller_group(self, ks: list[int], world: int, slices: list[int]) -> str | None:
        """The quantization to name where the group we quantize in at load is what keeps the
        row-parallel weights with ks input features (the MLPs') from splitting over `world`
        ranks and an explicit group of 64 or 32 would split them all and divide every other
        input width (`slices`: the hidden size, which q/k/v and gate/up take whole, and o_proj's
        input features on each rank; an explicit group is not fitted to a width), e.g.
        'int8-g64-sym'; else None."""
        q = self.quant
        if q is None or q.group_size < 0 or getattr(self.ckpt, "split_align", 1) != 1:
            return None
        for g in (64, 32):
            if (g < min(q.for_split(k).group_size for k in ks) and all(k % g == 0 and k // g >= world for k in ks)
                    and all(n % g == 0 for n in slices)):
                return f"int{q.bits}-g{g}-{q.kind}"
        return None

    def __call__(self, parts: list[Part], bias: np.ndarray | None = None):
        weights = [self._weight(*p) for p in parts]
        if all(isinstance(w, np.ndarray) for w in weights):
            return self.ops.Linear(weights[0] if len(weights) == 1 else np.concatenate(weights), bias)
        if all(isinstance(w, QuantizedWeight) for w in weights):
            try:
                return qlinear(self.ops, concat_rows(weights), bias, self.bf16)
            except QuantError:
                pass  # NOTE: mixed formats (e.g. a GGUF with Q6_K v and Q4_K q/k): one linear each
        return ConcatLinear([self._single(w) for w in weights], bias)

    def head(self, name: str, rows: slice, padded_rows: int):
        """lm_head: vocabulary rows `rows`, zero rows appended up to `padded_rows`. A head the
        file holds quantized stays as stored; a dense one is quantized to `head_quant` if set
        (the tied embedding table is read separately and stays as stored)."""
        native = getattr(self.ckpt, "quantized", None)
        w = native(name, rows, None) if native is not None else None
        if w is not None and self.head_quant is not None:  # NOTE: asked for by name, never by "auto"
            raise QuantError("lm_head_quantization names a format, but the file stores its lm_head quantized "
                             "already (it runs as stored); drop the setting.")
        if w is None and self.head_quant is None:  # NOTE: dense, as stored: padded as it is read
            return self.ops.Linear(load_rows(self.ckpt, name, self.dtype, rows, padded_rows))
        if w is None:
            w = self._quantized_head(name, rows)
        pad = padded_rows - w.out_features
        if pad:
            w = concat_rows([w, zero_rows(w, pad)])
        # NOTE: the logits take two int8 rows per activation row (x and its residual, ~15 bits):
        # with one (8 bits) SmolLM2-135M's answer to "What is the capital of France?" on 2
        # ranks flipped at a near tie (the headline command); f32 activations cost 30% more
        # time than the int8 rows on a 2-core Zen 4, where the head is a quarter of a step
        return qlinear(self.ops, w, bf16=self.bf16, residual=True)

    def _full_shape(self, name: str) -> tuple:
        """[N, K] of the whole tensor, not of this rank's slice."""
        shape = getattr(self.ckpt, "shape", None)
        return shape(name) if shape is not None else self.ckpt.raw(name).shape

    def _quantized_head(self, name: str, rows: slice) -> QuantizedWeight:
        step = HEAD_CHUNK
        k = self._full_shape(name)[1]
        fmt = self.head_quant.for_head(k)
        g = fmt.group_size
        if g > 0 and k % g:
            raise QuantError(f"lm_head_quantization (int8 in groups of {g}): the lm_head's {k} input features "
                             f"are not a multiple of {g}; use 'int8-channel' or a group that divides {k}.")
        starts = range(rows.start, rows.stop, step) or [rows.start]  # NOTE: a rank may hold no rows
        parts = []
        for r0 in starts:
            w = self.ckpt.load(name, "float32", rows=slice(r0, min(r0 + step, rows.stop)))  # [n, K]
            parts.append(quantize(w, fmt))
        return parts[0] if len(parts) == 1 else concat_rows(parts)

    def _weight(self, name: str, rows: slice | None, cols: slice | None, unit: int | None = None):
        native = getattr(self.ckpt, "quantized", None)
        quant = self.quant
        if native is not None:
            qw = native(name, rows, cols)
            if qw is not None:
                return qw
        if quant is None:
            return self.ckpt.load(name, self.dtype, rows=rows, cols=cols)
        w = self.ckpt.load(name, "float32", rows=rows, cols=cols)            # [n, k] this slice
        # NOTE: the group follows from the whole tensor's k (and the split's unit), never from
        # this rank's slice, so 1 and N ranks quantize the same groups
        full = self._full_shape(name)                                         # [N, K] whole
        k = full[1]
        fmt = quant.for_split(k, unit)
        n, g = w.shape[1], fmt.group_size
        if g > 0 and n % g:
            if n == k:
                raise QuantError(f"{name}: its {k} input features are not a multiple of {_group_words(fmt)}; "
                                 "choose a quantization whose group divides them, or 'int8-channel'.")
            raise QuantError(f"{name}: this rank's slice of its {k} input features has {n}, not a "
                             f"multiple of the quantization group of {g}; use fewer ranks, or a "
                             f"quantization whose group divides it.")
        if g < 0 and n != k:  # NOTE: per-row scales of a column slice: the whole row's scale
            return quantize(w, fmt, self._row_absmax(name, rows, full[0]))
        return quantize(w, fmt)

    def _row_absmax(self, name: str, rows: slice | None, n: int) -> np.ndarray:
        """The largest |w| of each of the rows `rows` over all input columns, read a chunk of
        rows at a time (a rank never holds the whole tensor unquantized)."""
        rows = rows if rows is not None else slice(0, n)
        out = [np.abs(self.ckpt.load(name, "float32", rows=slice(r0, min(r0 + 1024, rows.stop)))).max(axis=1)
               for r0 in range(rows.start, rows.stop, 1024)]
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _single(self, w):
        return qlinear(self.ops, w, bf16=self.bf16) if isinstance(w, QuantizedWeight) else self.ops.Linear(w)


def zero_rows(like: QuantizedWeight, n: int) -> QuantizedWeight:
    """n output rows of weight zero in the format of `like` (padding)."""
    ng = like.scales.shape[1]
    off = None if like.offsets is None else np.zeros((n, ng), like.offsets.dtype)
    sup = None if like.supers is None else tuple(None if a is None else np.zeros((n, a.shape[1]), a.dtype)
                                                 for a in like.supers)
    return QuantizedWeight(like.fmt, np.zeros((n, like.q.shape[1]), like.q.dtype),
                           np.zeros((n, ng), like.scales.dtype), off, like.in_features, sup)


class ConcatLinear:
    """Linears of the same input fused along the output: y = [y_0 | y_1 | ...] + bias."""

    def __init__(self, parts: list, bias: np.ndarray | None = None):
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else np.asarray(bias, np.float32)
        self.nbytes = sum(p.nbytes for p in parts)

    def forward(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        # x: [M, K] -> out: [M, sum N_i]
        if out is None:
            out = np.empty((x.shape[0], self.out_features), np.float32)
        n0 = 0
        for p in self.parts:
            out[:, n0:n0 + p.out_features] = p.forward(x)
            n0 += p.out_features
        if self.bias is not None:
            out += self.bias
        return out


# NOTE: vLLM's names for a checkpoint that brings its own quantization: they quantize nothing at
# load, they only assert what the file holds (vLLM's --quantization gguf / awq / gptq)
CHECKPOINT_METHODS = {"gguf": "gguf", "awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq"}


def parse_quantization(name: str | None) -> QuantFormat | None:
    """EngineConfig.quantization -> format (None: weights as stored, also for a checkpoint
    method name such as 'gguf' or 'awq', which check_checkpoint_method compares with the file)."""
    if name in (None, "") or str(name).lower() in ("none", *CHECKPOINT_METHODS):
        return None
    return QuantFormat.parse(name)


def checkpoint_method(ckpt) -> str | None:
    """'gguf', 'awq' or 'gptq' for a checkpoint that stores quantized weights, else None."""
    from ..gguf_checkpoint import GGUFCheckpoint
    if isinstance(ckpt, GGUFCheckpoint):
        return "gguf"
    return getattr(ckpt, "method", None)


def check_checkpoint_method(name: str | None, ckpt, where) -> None:
    """One sentence when `name` is a checkpoint method (parse_quantization) the file does not hold."""
    want = CHECKPOINT_METHODS.get(str(name).lower()) if name is not None else None
    if want is None:
        return
    have = checkpoint_method(ckpt)
    if have != want:
        held = f"holds {have.upper()} weights" if have else "is a dense checkpoint"
        an = "an" if want.upper()[0] in "AEFHILMNORSX" else "a"  # NOTE: as the letters are spoken: an AWQ, a GPTQ
        raise QuantError(f"quantization={name!r} (--quantization) names the format of {an} {want.upper()} checkpoint, "
                         f"but {where} {held}; drop it, or pass 'int8'/'int4' to quantize a dense one at load.")


# NOTE: chosen by perplexity (bench/bench_perplexity.py, bench/RESULTS.md)
HEAD_DEFAULT = "int8"
HEAD_FORMATS_HINT = "None, 'auto' or an int8 format such as 'int8' or 'int8-channel'"


def stores_quantized(ckpt) -> bool:
    """Whether a checkpoint brings quantized linears of its own (a GGUF of Q8_0/Q4_x/K-quants, AWQ,
    GPTQ); a dense one (safetensors, an F16/BF16/F32 GGUF) is quantized at load."""
    if ckpt is None or getattr(ckpt, "quantized", None) is None:
        return False
    from .hf_quant import HFQuantCheckpoint
    if isinstance(ckpt, HFQuantCheckpoint):  # NOTE: quantized, whatever it left dense (modules_to_not_convert)
        return True
    name = "model.layers.0.self_attn.q_proj.weight"
    return name in ckpt and not isinstance(ckpt.raw(name), np.ndarray)


def head_quantization(name: str | None, quantization: str | None, ckpt=None) -> QuantFormat | None:
    """EngineConfig.lm_head_quantization -> the format a dense lm_head is quantized to at load
    (None: as stored). "auto": the int8 default (HEAD_DEFAULT) when the decoder linears are
    quantized at load from a dense checkpoint (like llama.cpp, which keeps the output matrix at
    >= 6 bits), else as stored: a file that brings its own quantization (GGUF Q8_0/Q4_x/Q5_x,
    K-quants, IQ4, AWQ, GPTQ) keeps its lm_head. An explicit int8 format quantizes any dense
    lm_head."""
    if name in (None, "") or str(name).lower() == "none":
        return None
    if name == "auto":
        if parse_quantization(quantization) is not None and not stores_quantized(ckpt):
            return QuantFormat.parse(HEAD_DEFAULT)
        return None
    try:
        fmt = QuantFormat.parse(name) if isinstance(name, str) else None
    except QuantError as e:
        if isinstance(name, str) and name.lower().startswith("int8"):  # NOTE: its own fault (a group), not the kind
            raise QuantError(f"lm_head_quantization {name!r}: {e}") from None
        fmt = None
    if fmt is None or fmt.bits != 8:
        raise QuantError(f"lm_head_quantization must be {HEAD_FORMATS_HINT}, not {name!r}.")
    return fmt
