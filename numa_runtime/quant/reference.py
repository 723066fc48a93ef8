"""QLinear in numpy: the specification of numa_runtime._kernels.qgemm.QLinear.

It reads the very bytes the kernel streams (packing.unpack) and dequantizes them with
formats.dequantize, so a kernel test compares against the same f32 weights, bit for bit.
"""
from __future__ import annotations

import threading

import numpy as np

from .formats import GROUP_SIZES, QuantFormat, dequantize
from .packing import unpack


ACT8_M_MAX = 8   # qgemm.pyx ACT8_M_MAX (qgemm_q8.h QG_MR_Q8)
ACT8_BLOCK = 32  # qgemm_q8.h QG_QB
ACT8_DECODE_M_MAX = 64  # qgemm.pyx: rows of a decode-only step
_step = threading.local()


def set_decode_step(mode: int) -> int:
    """qgemm.set_decode_step: 1, every row of this thread's next steps is a decode row; 2, every
    row is a prompt row (no int8 activations by the decode rule); 0, mixed or not said."""
    if int(mode) not in (0, 1, 2):
        raise ValueError(f"set_decode_step takes 0, 1 or 2, got {mode}")
    old = getattr(_step, "decode", 0)
    _step.decode = int(mode)
    return old


def act8_rows(m: int) -> bool:
    """Whether m rows take int8 activations on a linear flagged act8."""
    mode = getattr(_step, "decode", 0)
    return mode != 2 and (m <= ACT8_M_MAX or (mode == 1 and m <= ACT8_DECODE_M_MAX))


def _int8_blocks(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) of x [M, K] f32, both [M, K] f32: q in [-127, 127] and each k's block scale."""
    q, sc = np.zeros_like(x), np.zeros_like(x)
    K = x.shape[1]
    for g0 in range(0, K, group):
        for k0 in range(g0, min(g0 + group, K), ACT8_BLOCK):
            k1 = min(k0 + ACT8_BLOCK, g0 + group, K)
            blk = x[:, k0:k1]
            amax = np.max(np.abs(blk), axis=1, keepdims=True)
            with np.errstate(divide="ignore"):
                inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
            q[:, k0:k1] = np.clip(np.rint(blk * inv), -127, 127)
            sc[:, k0:k1] = (amax / np.float32(127.0)).astype(np.float32)
    return q, sc


def quantize_activations(x: np.ndarray, group: int, residual: bool = False) -> np.ndarray:
    """x [M, K] f32 as the int8-activation decode path sees it: within each weight group of
    `group` k, blocks of ACT8_BLOCK k (the group's last one shorter) are scaled by absmax / 127
    and rounded to the nearest integer (ties to even) in [-127, 127]; returns the dequantized
    values q * absmax / 127 (f32, the kernel's arithmetic). `residual` (QLinear.act8_residual):
    the residual x - q * scale (rounded once to f32, as the kernel's FMA) is quantized the same
    way, and the two dequantized rows are returned summed (f64; the kernel adds their products)."""
    x = np.asarray(x, dtype=np.float32)
    q, sc = _int8_blocks(x, group)
    first = q * sc
    if not residual:
        return first
    # NOTE: q * scale is exact in f64 (7 + 24 bits), so this rounds once, like the FMA
    rest = (x.astype(np.float64) - q.astype(np.float64) * sc.astype(np.float64)).astype(np.float32)
    q2, sc2 = _int8_blocks(rest, group)
    return first.astype(np.float64) + (q2 * sc2).astype(np.float64)


class QLinear:
    """y = x @ W.T + b with W given as a packed quantized stream (see qgemm.QLinear)."""

    def __init__(self, packed: np.ndarray, bits: int, kind: str, group: int, in_features: int,
                 out_features: int, bias: np.ndarray | None = None, ks: int = 0):
        # NOTE: a group that is not 32/64/128 is per-row int8 (group = padded K), but Q6_K's 16
        fmt = QuantFormat(bits, group if group in GROUP_SIZES or bits != 8 else -1, kind, ks=ks)
        self.in_features, self.out_features, self.bits, self.kind = in_features, out_features, bits, kind
        self.group, self.ks = group, ks
        self.weight = dequantize(unpack(np.asarray(packed), fmt, out_features, in_features))  # [N, K]
        self.bias = None if bias is None else np.asarray(bias, dtype=np.float32)
        self.nbytes = np.asarray(packed).nbytes

    # NOTE: set by the loader for bf16 engines: decode rows (M <= ACT8_M_MAX) are rounded to
    # int8 blocks first, as the kernel's integer dot-product path does
    act8 = False
    act8_residual = False  # the lm_head: x and its int8 rounding residual, two int8 rows
    # other rows: 0 as given, 1 int8 blocks, 2 int8 blocks with the residual (qgemm.QLinear takes
    # its bf16 panels for 2 where usable; this backend has none)
    prefill_act8 = 0

    @property
    def dtype(self) -> str:
        return f"int{self.bits}"

    def forward(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        # x: [M, K] -> out: [M, N]
        rows = act8_rows(x.shape[0])
        # NOTE: the lm_head's few rows take int8 in a step of prompt rows too (qgemm QLinear._path)
        if self.act8 and (rows or self.act8_residual and x.shape[0] <= ACT8_M_MAX):
            x = quantize_activations(x, self.group, self.act8_residual)
        elif self.prefill_act8 and not rows:
            x = quantize_activations(x, self.group, self.act8_residual or self.prefill_act8 == 2)
        y = x @ self.weight.T
        if self.bias is not None:
            y += self.bias
        if out is None:
            return y.astype(np.float32)
        out[...] = y
        return out
