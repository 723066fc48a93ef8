"""The blocked layout the kernels stream (cython_kernels/qgemm_kernels.h), written and read
back in numpy.

W [N, Kp] is cut into blocks of NB = 16 output columns (N padded with zero rows). A block is one
contiguous byte stream of its groups, each group:
    scales   f16 [16]
    offsets  f16 [16]           (zero points or mins; absent for "sym")
    rows     [G / pack_k][16]   32-bit lanes: lane j = column j at pack_k consecutive k
             (int4: nibble i at bits 4i..4i+3, unsigned; int8: byte i, signed)
Every 64-byte row is one cache line of 16 columns; the stream holds the scales next to the
integers they scale, so decode reads one sequential stream per block.
"""
from __future__ import annotations

import numpy as np

from .formats import QuantFormat, QuantizedWeight

NB = 16
KINDS = {"sym": 0, "zero": 1, "min": 2}


def group_bytes(fmt: QuantFormat, group: int) -> int:
    meta = 32 if fmt.kind == "sym" else 64
    return meta + group // fmt.pack_k * 64


def pack(qw: QuantizedWeight) -> np.ndarray:
    """The packed uint8 stream [Nb * ng * group_bytes] of a quantized weight."""
    fmt, g = qw.fmt, qw.group
    n, kp = qw.q.shape
    nb, ng, pk = -(-n // NB), kp // g, fmt.pack_k
    pad = nb * NB - n
    q = np.pad(qw.q, ((0, pad), (0, 0)))
    # lanes: [Np, Kp / pk] uint32, k-th of a lane in bits (32 / pk) * i
    if fmt.bits == 4:
        q4 = q.astype(np.uint32).reshape(nb * NB, kp // pk, pk)
        lanes = np.zeros(q4.shape[:2], np.uint32)
        for i in range(pk):
            lanes |= q4[:, :, i] << np.uint32(4 * i)
    else:
        lanes = np.ascontiguousarray(q.astype(np.int8)).view(np.uint32)   # little-endian bytes
    rows = lanes.reshape(nb, NB, ng, g // pk).transpose(0, 2, 3, 1)     # [Nb, ng, rows, 16]
    gb = group_bytes(fmt, g)
    out = np.empty((nb, ng, gb), np.uint8)
    meta = [qw.scales] + ([] if fmt.kind == "sym" else [qw.offsets])
    for i, m in enumerate(meta):
        m16 = np.pad(np.asarray(m, np.float16), ((0, pad), (0, 0)))      # [Np, ng]
        out[:, :, 32 * i:32 * i + 32] = (m16.reshape(nb, NB, ng).transpose(0, 2, 1)
                                         .copy().view(np.uint8))
    out[:, :, 32 * len(meta):] = rows.copy().view(np.uint8).reshape(nb, ng, -1)
    return out.reshape(-1)


def unpack(packed: np.ndarray, fmt: QuantFormat, n: int, k: int) -> QuantizedWeight:
    """Inverse of `pack`: the reference reads the kernels' bytes back into logical form."""
    kp, g, pk = fmt.padded_k(k), fmt.group_of(k), fmt.pack_k
    nb, ng = -(-n // NB), kp // g
    nm = 1 if fmt.kind == "sym" else 2
    s = packed.reshape(nb, ng, group_bytes(fmt, g))
    meta = [np.ascontiguousarray(s[:, :, 32 * i:32 * i + 32]).view(np.float16)   # [Nb, ng, 16]
            .transpose(0, 2, 1).reshape(nb * NB, ng)[:n] for i in range(nm)]
    lanes = (np.ascontiguousarray(s[:, :, 32 * nm:]).view(np.uint32)
             .reshape(nb, ng, g // pk, NB).transpose(0, 3, 1, 2).reshape(nb * NB, kp // pk)[:n])
    if fmt.bits == 4:
        q = np.stack([(lanes >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(pk)], axis=2)
        q = q.astype(np.uint8).reshape(n, kp)
    else:
        q = np.ascontiguousarray(lanes).view(np.int8).reshape(n, kp)
    return QuantizedWeight(fmt, q, meta[0].copy(), meta[1].copy() if nm == 2 else None, k)
