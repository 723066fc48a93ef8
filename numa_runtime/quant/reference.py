"""QLinear in numpy: the specification of numa_runtime._kernels.qgemm.QLinear.

It reads the very bytes the kernel streams (packing.unpack) and dequantizes them with
formats.dequantize, so a kernel test compares against the same f32 weights, bit for bit.
"""
from __future__ import annotations

import numpy as np

from .formats import GROUP_SIZES, QuantFormat, dequantize
from .packing import unpack


class QLinear:
    """y = x @ W.T + b with W given as a packed quantized stream (see qgemm.QLinear)."""

    def __init__(self, packed: np.ndarray, bits: int, kind: str, group: int, in_features: int,
                 out_features: int, bias: np.ndarray | None = None):
        # NOTE: a group that is not 32/64/128 is per-row int8 (group = padded K)
        fmt = QuantFormat(bits, group if group in GROUP_SIZES else -1, kind)
        self.in_features, self.out_features, self.bits, self.kind = in_features, out_features, bits, kind
        self.weight = dequantize(unpack(np.asarray(packed), fmt, out_features, in_features))  # [N, K]
        self.bias = None if bias is None else np.asarray(bias, dtype=np.float32)
        self.nbytes = np.asarray(packed).nbytes

    @property
    def dtype(self) -> str:
        return f"int{self.bits}"

    def forward(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        # x: [M, K] -> out: [M, N]
        y = x @ self.weight.T
        if self.bias is not None:
            y += self.bias
        if out is None:
            return y.astype(np.float32)
        out[...] = y
        return out
