"""The blocked layout the kernels stream (cython_kernels/qgemm_kernels.h), written and read
back in numpy.

W [N, Kp] is cut into blocks of NB = 16 output columns (N padded with zero rows). A block is one
contiguous byte stream of its groups, each group:
    scales   f16 [16]
    offsets  f16 [16]           (zero points or mins; absent for "sym" and "nl")
    rows     [G / pack_k][16]   32-bit lanes: lane j = column j at pack_k consecutive k
             (int4: nibble i at bits 4i..4i+3, unsigned; int8: byte i, signed)
Every 64-byte row is one cache line of 16 columns; the stream holds the scales next to the
integers they scale, so decode reads one sequential stream per block.

int5/int6 (GGUF Q5_x, Q6_K) come in units of U = 32 (int5) or 16 (int6) k instead of rows:
    plane    [16] uint32        lane j: the high bits (q >> 4) of column j's U codes
    rows     [U / 8][16]        the low nibbles (q & 15), laid out as int4 rows
int2/int3 (GGUF Q2_K, Q3_K) come in units of U = 16 k:
    crumbs   [16] uint32        lane j: the low 2 bits (q & 3) of column j's 16 codes
    third    [4] uint64         int3 only: word 2 r + e holds the third bit (q >> 2) of column j
                                at k = 8 r + 2 b + e in bit 4 j + b
The crumb of unit-local k = 8 r + 2 b + e sits at bit 8 b + 2 (2 r + e) (the int6 plane's
layout): shifted right by 2 (2 r + e), each lands on bits 0-1 of the byte the int4 path's masks
take it into, and each third-bit word is the byte mask (one bit a byte) that adds 4 to it.
Super-block formats (fmt.ks, GGUF K-quants) start each block's stream with the super-blocks'
    d        f16 [16]  per super-block, then dmin f16 [16] ("min")
and their groups' meta is int8 [16] sub-scales (then int8 [16] mins) instead of the f16 ones
(int2, GGUF Q2_K: one byte [16] a column, its 4-bit sub-scale | its 4-bit min << 4).
The high bits of unit-local k = 8 r + 2 b + e (r: nibble row, b: byte of its lane, e: 0/1) sit
at bit 8 b + (bits - 4) (2 r + e) of the plane lane: shifted by a constant per nibble row, they
land on bit 4 (and 5) of the very bytes the int4 path's two masks take each nibble into.
"""
from __future__ import annotations

import numpy as np

from .formats import QuantFormat, QuantizedWeight

NB = 16


def unit_bytes(fmt: QuantFormat) -> int:
    """Bytes of one packed unit of fmt.pack_k k (16 columns)."""
    return {4: 64, 8: 64, 2: 64, 3: 96}.get(fmt.bits, 64 + fmt.pack_k // 8 * 64)


def nib_meta(fmt: QuantFormat) -> bool:
    """int2 super-block formats (GGUF Q2_K): a column's sub-scale and min in one byte, sc | m << 4."""
    return bool(fmt.ks) and fmt.bits == 2


def meta_bytes(fmt: QuantFormat) -> int:
    """Bytes of a group's scales (and offsets) for 16 columns: f16, or int8 with fmt.ks."""
    return 16 if nib_meta(fmt) else (16 if fmt.ks else 32) * (2 if fmt.has_offsets else 1)


def group_bytes(fmt: QuantFormat, group: int) -> int:
    return meta_bytes(fmt) + group // fmt.pack_k * unit_bytes(fmt)


def _plane_shift(width: int, u: int) -> np.ndarray:
    """Bit position in the plane (or crumb) lane of each unit-local k, `width` bits each (see the
    module docstring)."""
    i = np.arange(u)
    r, b, e = i // 8, (i % 8) // 2, i % 2
    return (8 * b + width * (2 * r + e)).astype(np.uint32)


def _lane_bytes(lanes: np.ndarray) -> np.ndarray:
    """Per-column lanes [Nb, 16, ng, units, L] uint32 -> unit bytes [Nb, ng, units, 64 L]."""
    nb, _, ng, nu, _ = lanes.shape
    return lanes.transpose(0, 2, 3, 4, 1).copy().view(np.uint8).reshape(nb, ng, nu, -1)


def _pack_plane(v: np.ndarray, width: int) -> np.ndarray:
    """Codes [.., U] of `width` bits -> one plane lane [..] (the bits of unit-local k at
    _plane_shift)."""
    return (v << _plane_shift(width, v.shape[-1])).sum(axis=-1, dtype=np.uint64).astype(np.uint32)


def _hb_units(q: np.ndarray, bits: int, nb: int, ng: int, g: int) -> np.ndarray:
    """int2/3/5/6 codes q [Np, Kp] -> the unit bytes [Nb, ng, G / U * unit_bytes]."""
    u = UNIT_K_HB[bits]
    qq = q.astype(np.uint32).reshape(nb, NB, ng, g // u, u)             # [Nb, 16, ng, units, U]
    if bits in (2, 3):
        parts = [_lane_bytes(_pack_plane(qq & np.uint32(3), 2)[..., None])]
        if bits == 3:
            i = np.arange(u)
            t, b = 2 * (i // 8) + i % 2, (i % 8) // 2                   # word and byte of each k
            third = ((qq >> np.uint32(2)) & np.uint32(1)).astype(np.uint64)
            pos = (4 * np.arange(NB)[:, None] + b[None, :]).astype(np.uint64)   # [16, U]
            words = np.zeros((nb, ng, g // u, 4), np.uint64)
            for w in range(4):
                sel = third[..., t == w] << pos[:, t == w][None, :, None, None, :]  # [Nb,16,ng,units,4]
                words[..., w] = sel.sum(axis=(1, 4), dtype=np.uint64)
            parts.append(words.view(np.uint8))
        return np.concatenate(parts, axis=3).reshape(nb, ng, -1)
    plane = _pack_plane(qq >> np.uint32(4), bits - 4)                  # [Nb, 16, ng, units]
    nib = (qq & np.uint32(0xF)).reshape(nb, NB, ng, g // u, u // 8, 8)
    lanes = np.zeros(nib.shape[:5], np.uint32)
    for i in range(8):
        lanes |= nib[..., i] << np.uint32(4 * i)                        # [Nb, 16, ng, units, U/8]
    unit = np.concatenate([plane[..., None], lanes], axis=4)            # [Nb, 16, ng, units, 1+U/8]
    return _lane_bytes(unit).reshape(nb, ng, -1)


def _hb_codes(rows: np.ndarray, bits: int, n: int, g: int) -> np.ndarray:
    """Inverse of _hb_units: the unit bytes [Nb, ng, G / U * unit_bytes] -> codes [n, Kp]."""
    u = UNIT_K_HB[bits]
    nb, ng = rows.shape[:2]
    units = np.ascontiguousarray(rows).reshape(nb, ng, g // u, -1)      # [Nb, ng, units, ub]

    def lanes(a: np.ndarray) -> np.ndarray:  # unit bytes [.., 64 L] -> [Nb, 16, ng, units, L]
        return np.ascontiguousarray(a).view(np.uint32).reshape(nb, ng, g // u, -1, NB).transpose(0, 4, 1, 2, 3)

    if bits in (2, 3):
        crumb = lanes(units[..., :64])[..., :1]                         # [Nb, 16, ng, units, 1]
        q = (crumb >> _plane_shift(2, u)) & np.uint32(3)                # [.., U]
        if bits == 3:
            i = np.arange(u)
            t, b = 2 * (i // 8) + i % 2, (i % 8) // 2
            words = np.ascontiguousarray(units[..., 64:96]).view(np.uint64)    # [Nb, ng, units, 4]
            pos = (4 * np.arange(NB)[:, None] + b[None, :]).astype(np.uint64)  # [16, U]
            w = words[..., t].transpose(0, 1, 2, 3)                      # [Nb, ng, units, U]
            third = (w[:, None] >> pos[None, :, None, None, :]) & np.uint64(1)  # [Nb,16,ng,units,U]
            q = q | (third.astype(np.uint32) << np.uint32(2))
        return q.astype(np.uint8).reshape(nb * NB, ng * g)[:n]
    unit = lanes(units)                                                 # [Nb, 16, ng, units, 1+U/8]
    hb = (unit[..., :1] >> _plane_shift(bits - 4, u)) & np.uint32((1 << (bits - 4)) - 1)  # [.., U]
    nib = np.stack([(unit[..., 1:] >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(8)], axis=5)
    q = nib.reshape(hb.shape) | (hb << np.uint32(4))
    return q.astype(np.uint8).reshape(nb * NB, ng * g)[:n]


UNIT_K_HB = {5: 32, 6: 16, 2: 16, 3: 16}


def pack(qw: QuantizedWeight) -> np.ndarray:
    """The packed uint8 stream [Nb * ng * group_bytes] of a quantized weight."""
    fmt, g = qw.fmt, qw.group
    n, kp = qw.q.shape
    nb, ng, pk = -(-n // NB), kp // g, fmt.pack_k
    pad = nb * NB - n
    q = np.pad(qw.q, ((0, pad), (0, 0)))
    gb, mb = group_bytes(fmt, g), meta_bytes(fmt)
    out = np.empty((nb, ng, gb), np.uint8)
    meta = [qw.scales] + ([qw.offsets] if fmt.has_offsets else [])
    dt, w = (np.int8, 16) if fmt.ks else (np.float16, 32)
    if nib_meta(fmt):
        sc, mn = np.asarray(qw.scales, np.int16), np.asarray(qw.offsets, np.int16)
        if sc.min(initial=0) < 0 or sc.max(initial=0) > 15 or mn.min(initial=0) < 0 or mn.max(initial=0) > 15:
            raise ValueError("int2 super-block sub-scales and mins must be 0..15")
        meta = [(sc | (mn << 4)).astype(np.uint8).view(np.int8)]
    for i, m in enumerate(meta):
        m16 = np.pad(np.asarray(m, dt), ((0, pad), (0, 0)))              # [Np, ng]
        out[:, :, w * i:w * i + w] = (m16.reshape(nb, NB, ng).transpose(0, 2, 1)
                                      .copy().view(np.uint8))
    head = _supers(qw, nb, pad)
    if fmt.bits in UNIT_K_HB:
        out[:, :, mb:] = _hb_units(q, fmt.bits, nb, ng, g)
        return np.concatenate([head, out.reshape(nb, -1)], axis=1).reshape(-1)
    # lanes: [Np, Kp / pk] uint32, k-th of a lane in bits (32 / pk) * i
    if fmt.bits == 4:
        q4 = q.astype(np.uint32).reshape(nb * NB, kp // pk, pk)
        lanes = np.zeros(q4.shape[:2], np.uint32)
        for i in range(pk):
            lanes |= q4[:, :, i] << np.uint32(4 * i)
    else:
        lanes = np.ascontiguousarray(q.astype(np.int8)).view(np.uint32)   # little-endian bytes
    rows = lanes.reshape(nb, NB, ng, g // pk).transpose(0, 2, 3, 1)     # [Nb, ng, rows, 16]
    out[:, :, mb:] = rows.copy().view(np.uint8).reshape(nb, ng, -1)
    return np.concatenate([head, out.reshape(nb, -1)], axis=1).reshape(-1)


def _supers(qw: QuantizedWeight, nb: int, pad: int) -> np.ndarray:
    """The super-block area at the head of each block [Nb, ns * super_bytes] (empty without ks)."""
    if not qw.fmt.ks:
        return np.zeros((nb, 0), np.uint8)
    parts = [a for a in qw.supers if a is not None]
    ns = parts[0].shape[1]
    out = np.empty((nb, ns, len(parts), 32), np.uint8)
    for i, a in enumerate(parts):
        a16 = np.pad(np.asarray(a, np.float16), ((0, pad), (0, 0)))      # [Np, ns]
        out[:, :, i] = a16.reshape(nb, NB, ns).transpose(0, 2, 1).copy().view(np.uint8)
    return out.reshape(nb, -1)


def unpack(packed: np.ndarray, fmt: QuantFormat, n: int, k: int) -> QuantizedWeight:
    """Inverse of `pack`: the reference reads the kernels' bytes back into logical form."""
    kp, g, pk = fmt.padded_k(k), fmt.group_of(k), fmt.pack_k
    nb, ng = -(-n // NB), kp // g
    nm = 2 if fmt.has_offsets else 1
    sup = None
    if fmt.ks:
        ns = kp // fmt.ks
        blocks = packed.reshape(nb, -1)
        head = np.ascontiguousarray(blocks[:, :ns * fmt.super_bytes]).reshape(nb, ns, nm, 32)
        arrs = [head[:, :, i].copy().view(np.float16).transpose(0, 2, 1).reshape(nb * NB, ns)[:n].copy()
                for i in range(nm)]
        sup = (arrs[0], arrs[1] if nm == 2 else None)
        packed = np.ascontiguousarray(blocks[:, ns * fmt.super_bytes:]).reshape(-1)
    mb = meta_bytes(fmt)
    dt, w = (np.int8, 16) if fmt.ks else (np.float16, 32)
    s = packed.reshape(nb, ng, group_bytes(fmt, g))
    meta = [np.ascontiguousarray(s[:, :, w * i:w * i + w]).view(dt)   # [Nb, ng, 16]
            .transpose(0, 2, 1).reshape(nb * NB, ng)[:n] for i in range(1 if nib_meta(fmt) else nm)]
    if nib_meta(fmt):
        b = meta[0].view(np.uint8)
        meta = [(b & 15).astype(np.int8), (b >> 4).astype(np.int8)]
    if fmt.bits in UNIT_K_HB:
        q = _hb_codes(s[:, :, mb:], fmt.bits, n, g)
        return QuantizedWeight(fmt, q, meta[0].copy(), meta[1].copy() if nm == 2 else None, k, sup)
    lanes = (np.ascontiguousarray(s[:, :, mb:]).view(np.uint32)
             .reshape(nb, ng, g // pk, NB).transpose(0, 3, 1, 2).reshape(nb * NB, kp // pk)[:n])
    if fmt.bits == 4:
        q = np.stack([(lanes >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(pk)], axis=2)
        q = q.astype(np.uint8).reshape(n, kp)
    else:
        q = np.ascontiguousarray(lanes).view(np.int8).reshape(n, kp)
    return QuantizedWeight(fmt, q, meta[0].copy(), meta[1].copy() if nm == 2 else None, k, sup)
