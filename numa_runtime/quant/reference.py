"""QLinear in numpy: the specification of numa_runtime._kernels.qgemm.QLinear.

It reads the very bytes the kernel streams (packing.unpack) and dequantizes them with
formats.dequantize, so a kernel test compares against the same f32 weights, bit for bit.
"""
from __future__ import annotations

import numpy as np

from .formats import GROUP_SIZES, QuantFormat, dequantize
from .packing import unpack


ACT8_M_MAX = 8   # qgemm.pyx ACT8_M_MAX (qgemm_q8.h QG_MR_Q8)
ACT8_BLOCK = 32  # qgemm_q8.h QG_QB


def quantize_activations(x: np.ndarray, group: int) -> np.ndarray:
    """x [M, K] f32 as the int8-activation decode path sees it: within each weight group of
    `group` k, blocks of ACT8_BLOCK k (the group's last one shorter) are scaled by absmax / 127
    and rounded to the nearest integer (ties to even) in [-127, 127]; returns the dequantized
    values q * absmax / 127 (f32, the kernel's arithmetic)."""
    x = np.asarray(x, dtype=np.float32)
    out = np.zeros_like(x)
    K = x.shape[1]
    for g0 in range(0, K, group):
        for k0 in range(g0, min(g0 + group, K), ACT8_BLOCK):
            k1 = min(k0 + ACT8_BLOCK, g0 + group, K)
            blk = x[:, k0:k1]
            amax = np.max(np.abs(blk), axis=1, keepdims=True) if k1 > k0 else np.zeros((x.shape[0], 1), np.float32)
            with np.errstate(divide="ignore"):
                inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
            q = np.clip(np.rint(blk * inv), -127, 127).astype(np.float32)
            out[:, k0:k1] = q * (amax / np.float32(127.0)).astype(np.float32)
    return out


class QLinear:
    """y = x @ W.T + b with W given as a packed quantized stream (see qgemm.QLinear)."""

    def __init__(self, packed: np.ndarray, bits: int, kind: str, group: int, in_features: int,
                 out_features: int, bias: np.ndarray | None = None):
        # NOTE: a group that is not 32/64/128 is per-row int8 (group = padded K)
        fmt = QuantFormat(bits, group if group in GROUP_SIZES else -1, kind)
        self.in_features, self.out_features, self.bits, self.kind = in_features, out_features, bits, kind
        self.group = group
        self.weight = dequantize(unpack(np.asarray(packed), fmt, out_features, in_features))  # [N, K]
        self.bias = None if bias is None else np.asarray(bias, dtype=np.float32)
        self.nbytes = np.asarray(packed).nbytes

    # NOTE: set by the loader for bf16 engines: decode rows (M <= ACT8_M_MAX) are rounded to
    # int8 blocks first, as the kernel's integer dot-product path does
    act8 = False

    @property
    def dtype(self) -> str:
        return f"int{self.bits}"

    def forward(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        # x: [M, K] -> out: [M, N]
        if self.act8 and x.shape[0] <= ACT8_M_MAX:
            x = quantize_activations(x, self.group)
        y = x @ self.weight.T
        if self.bias is not None:
            y += self.bias
        if out is None:
            return y.astype(np.float32)
        out[...] = y
        return out
