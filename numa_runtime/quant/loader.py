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
"""
from __future__ import annotations

import numpy as np

from .formats import QuantError, QuantFormat, QuantizedWeight, concat_rows, quantize
from .packing import pack

Part = tuple  # (name, rows: slice | None, cols: slice | None)


def qlinear(ops, qw: QuantizedWeight, bias: np.ndarray | None = None, bf16: bool = False):
    """The backend's QLinear over one quantized weight (packed once here). `bf16`: the engine
    computes in bf16, so prefill may round the dequantized weights to bf16 (matrix units)."""
    lin = ops.QLinear(pack(qw), qw.fmt.bits, qw.fmt.kind, qw.group, qw.in_features,
                      qw.out_features, bias)
    lin.prefill_bf16 = bf16
    return lin


class LinearFactory:
    def __init__(self, ops, ckpt, dtype: str, quant: QuantFormat | None = None):
        self.ops, self.ckpt, self.dtype, self.quant = ops, ckpt, dtype, quant
        self.bf16 = dtype == "bfloat16"

    @property
    def split_align(self) -> int:
        """Input columns a rank's slice of a row-parallel weight must come in multiples of:
        the file's quantization blocks, or the group we quantize in (1 for dense weights)."""
        q = self.quant
        # NOTE: a format that fits its group to K (plain "int8"/"int4") needs only 32
        own = 1 if q is None or q.group_size < 0 else (32 if q.fit_group else q.group_size)
        return max(own, getattr(self.ckpt, "split_align", 1))

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
        """lm_head: vocabulary rows `rows`, zero rows appended up to `padded_rows`. Kept as
        stored: quantized only when the file holds it quantized (an int4 lm_head costs more
        accuracy than it saves time on the models we target)."""
        w = self._weight(name, rows, None, quantize_dense=False)
        pad = padded_rows - w.shape[0] if isinstance(w, np.ndarray) else padded_rows - w.out_features
        if isinstance(w, np.ndarray):
            if pad:
                w = np.concatenate([w, np.zeros((pad, w.shape[1]), w.dtype)])
            return self.ops.Linear(w)
        if pad:
            w = concat_rows([w, zero_rows(w, pad)])
        return qlinear(self.ops, w, bf16=self.bf16)

    def _weight(self, name: str, rows: slice | None, cols: slice | None, quantize_dense=True):
        native = getattr(self.ckpt, "quantized", None)
        if native is not None:
            qw = native(name, rows, cols)
            if qw is not None:
                return qw
        if self.quant is None or not quantize_dense:
            return self.ckpt.load(name, self.dtype, rows=rows, cols=cols)
        w = self.ckpt.load(name, "float32", rows=rows, cols=cols)            # [n, k] this slice
        fmt = self.quant.for_k(w.shape[1])
        if fmt.group_size > 0 and w.shape[1] % fmt.group_size:
            raise QuantError(f"{name}: this rank's slice has {w.shape[1]} input features, not a "
                             f"multiple of the group size {fmt.group_size}; use fewer ranks or a "
                             f"smaller group size.")
        return quantize(w, fmt)

    def _single(self, w):
        return qlinear(self.ops, w, bf16=self.bf16) if isinstance(w, QuantizedWeight) else self.ops.Linear(w)


def zero_rows(like: QuantizedWeight, n: int) -> QuantizedWeight:
    """n output rows of weight zero in the format of `like` (padding)."""
    ng = like.scales.shape[1]
    off = None if like.offsets is None else np.zeros((n, ng), np.float16)
    return QuantizedWeight(like.fmt, np.zeros((n, like.q.shape[1]), like.q.dtype),
                           np.zeros((n, ng), np.float16), off, like.in_features)


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


def parse_quantization(name: str | None) -> QuantFormat | None:
    """EngineConfig.quantization -> format (None: weights as stored)."""
    return None if name in (None, "", "none") else QuantFormat.parse(name)
