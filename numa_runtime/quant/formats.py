"""Quantized weight formats: what a format is, how weights are quantized, and how they come back.

A quantized weight W [N, K] holds integers q in groups of `group_size` consecutive k of one
output row, with one f16 scale s per group and, for asymmetric formats, one f16 offset:

| kind   | bits | q         | dequantized w (f32)       | sources                          |
| ------ | ---- | --------- | ------------------------- | -------------------------------- |
| "sym"  | 8    | -127..127 | q * s                     | int8 at load, GGUF Q8_0          |
| "sym"  | 4    | 0..15     | q * s - 8 s               | int4 at load, GGUF Q4_0          |
| "zero" | 4    | 0..15     | q * s - s z (z: 0..15)    | AWQ, GPTQ                        |
| "min"  | 4    | 0..15     | q * s + m                 | GGUF Q4_1, Q4_K                  |
| "sym"  | 5    | 0..31     | q * s - 16 s              | GGUF Q5_0                        |
| "min"  | 5    | 0..31     | q * s + m                 | GGUF Q5_1, Q5_K                  |
| "sym"  | 6    | 0..63     | q * s - 32 s (groups 16)  | GGUF Q6_K                        |
| "sym"  | 3    | 0..7      | q * s - 4 s (groups 16)   | GGUF Q3_K                        |
| "min"  | 2    | 0..3      | q * s + m (groups 16)     | GGUF Q2_K                        |
| "nl"   | 4    | 0..15     | NL[q] * s                 | GGUF IQ4_NL, IQ4_XS              |

"nl": the 4-bit code indexes IQ4_NL's 16 non-linear int8 levels (NL_VALUES; llama.cpp's table,
denser near zero), w = NL[q] s, exact in f32 like the others; the kernels look the level up
from the nibble in a register (one byte shuffle per 64 codes).

With `ks` (k per super-block, 256: GGUF's K-quants) a group's scale is an int8 multiple sc of an
f16 scale d of its super-block, s = d sc, and a "min" group's offset is -dmin m (m int8): the
K-quants' own numbers, exact in f32 (an f16 times an int8), at 8 + 8 bits a group plus 32 a
super-block instead of 16 + 16 a group (Q4_K: 4.625 bits a weight, not 5). int2 super-block
formats (GGUF Q2_K) keep the file's 4-bit sub-scale and min of a group in one byte (0..15 each):
2.625 bits a weight, the file's own.

2-, 3-, 5- and 6-bit weights exist so that GGUF files keep their own bit widths (llama-quantize's
Q4_K_M/Q5_K_M mixes hold Q5_0, Q5_K and Q6_K tensors, its Q2_K/Q3_K_x files Q2_K and Q3_K ones);
they are not offered for quantizing at load. Their packed layouts (packing.py) are merged in
registers into the int4 path's nibble bytes, so the kernels reuse its integer dot products: int5/6
as a 4-bit nibble plus its high bits in a plane of their own, int2/3 as 2-bit crumbs plus (int3)
a plane of third bits.

NOTE: scales and offsets are stored as f16: every real source (GGUF, AWQ, GPTQ) stores f16
scales, so they map without loss, and at 4 bits in groups of 32 an f16 scale + offset costs 1
bit per weight against 2 in f32 (decode streams every byte). F16C converts 8 of them in one
instruction on every x86-64-v3 CPU. bf16/f32 scales given to us are rounded to f16 once (the
quantizer picks f16 scales before rounding the weights, so its q are computed against them).
An f16 scale times a <= 8-bit integer is exact in f32, so `dequantize` here and the kernels'
in-register dequantization produce the very same f32 weights.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np

KINDS = ("sym", "zero", "min", "nl")
# IQ4_NL's levels (GGUF IQ4_NL and IQ4_XS): code q stands for NL_VALUES[q] times the scale
NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
GROUP_SIZES = (32, 64, 128)
BITS = (2, 3, 4, 5, 6, 8)
# k per packed unit (packing.py): one 64-byte row of lanes for int4/int8; for int5/int6 a plane
# row of high bits and the nibble rows of the k it covers; for int2/int3 a row of crumbs (and
# the third bits)
UNIT_K = {4: 8, 8: 4, 5: 32, 6: 16, 2: 16, 3: 16}


class QuantError(ValueError):
    """A quantized format or tensor we cannot represent or read."""


@dataclass(frozen=True)
class QuantFormat:
    """bits 2, 3, 4, 5, 6 or 8; group_size 32/64/128 (16 for int2/3/4/6), or -1 for one group
    per output row (int8 only); kind "sym" | "zero" | "min" | "nl" (not int8; "nl" int4 only)."""

    bits: int = 8
    group_size: int = 128
    kind: str = "sym"
    fit_group: bool = False  # a weight whose K the group does not divide takes 64 or 32
    ks: int = 0  # k per super-block of int8 sub-scales (GGUF K-quants: 256); 0: f16 scales

    def for_k(self, k: int) -> "QuantFormat":
        """The format a weight with k input features gets (fit_group: the largest of
        group_size, 64, 32 that divides k; otherwise this format)."""
        if not self.fit_group or self.group_size == -1 or k % self.group_size == 0:
            return self
        for g in (64, 32):
            if g < self.group_size and k % g == 0:
                return QuantFormat(self.bits, g, self.kind)
        return self

    def for_head(self, k: int) -> "QuantFormat":
        """The lm_head's format: for_k(k), or one scale per row where a fitted group divides no k
        (the head's kernels take whole groups only)."""
        f = self.for_k(k)
        if self.fit_group and f.group_size > 0 and k % f.group_size:
            return QuantFormat(f.bits, -1, f.kind)
        return f

    def for_split(self, k: int, unit: int | None = None) -> "QuantFormat":
        """The format of a weight with k input features whose rank slices start and end on
        multiples of `unit` (None: only the whole k, or a split aligned to for_k(k)'s group):
        for_k of their common divisor where a group fits it, so that every rank count
        quantizes the same groups (o_proj: unit = head_dim); where none fits it, fitted int8
        takes one scale per row (head_dim 16 on 2 ranks), other formats for_k(k)."""
        if unit:
            common = math.gcd(k, unit)
            f = self.for_k(common)
            if f.group_size < 0 or common % f.group_size == 0:
                return f
            if self.fit_group and self.bits == 8:
                return QuantFormat(8, -1, self.kind)
        return self.for_k(k)

    def __post_init__(self):
        if self.bits not in BITS:
            raise QuantError(f"Quantized weights have 2, 3, 4, 5, 6 or 8 bits, not {self.bits}.")
        if self.kind not in KINDS:
            raise QuantError(f"Quantization kind must be one of {KINDS}, not {self.kind!r}.")
        if self.bits == 8 and self.kind != "sym":
            raise QuantError("int8 weights are symmetric only (kind='sym').")
        if self.kind == "nl" and self.bits != 4:
            raise QuantError("Non-linear levels (kind='nl', GGUF IQ4) are 4-bit codes only.")
        if self.bits in (2, 3, 4, 6) and self.group_size == 16:
            pass  # the 16-element sub-blocks of GGUF's Q6_K, Q3_K and Q2_K
        elif self.group_size not in GROUP_SIZES + (-1,):
            extra = " (or 16)" if self.bits == 4 else " (or 'channel': one per output row)" if self.bits == 8 else ""
            sizes = ", ".join(map(str, GROUP_SIZES[:-1])) + f" or {GROUP_SIZES[-1]}"
            raise QuantError(f"int{self.bits} groups must be {sizes}{extra}, not {self.group_size}.")
        if self.ks and (self.ks != 256 or self.bits == 8 or self.kind == "zero"
                        or self.group_size < 0 or self.ks % self.group_size):
            raise QuantError(f"Super-block scales (ks={self.ks}) are for int2-6 'sym', 'min' or "
                             f"'nl' groups that divide 256.")
        if self.ks and self.bits == 2 and self.kind != "min":
            raise QuantError("int2 super-block formats are 'min' (GGUF Q2_K: 4-bit sub-scales and "
                             "mins, one byte a column).")
        if self.group_size == -1 and self.bits != 8:
            raise QuantError(f"int{self.bits} weights need groups of 32, 64 or 128 (per-row is "
                             f"for int8 only).")

    @property
    def has_offsets(self) -> bool:
        """Whether groups carry a second value besides the scale (zero point or min)."""
        return self.kind in ("zero", "min")

    @property
    def pack_k(self) -> int:
        """k per packed unit (a 32-bit lane of a row for int4/int8)."""
        return UNIT_K[self.bits]

    @property
    def qmax(self) -> int:
        """Largest unsigned code of the asymmetric and sub-8-bit symmetric formats."""
        return (1 << self.bits) - 1

    @property
    def super_bytes(self) -> int:
        """Bytes of one super-block's f16 scales (d, and dmin for "min") for 16 columns."""
        return 0 if not self.ks else (64 if self.has_offsets else 32)

    def padded_k(self, k: int) -> int:
        """K as stored: per-row int8 pads K to 4 with zero weights; grouped formats need whole
        groups."""
        if self.group_size == -1:
            return -(-k // 4) * 4
        if k % self.group_size:
            raise QuantError(f"in_features {k} is not a multiple of the group size "
                             f"{self.group_size}; use a group size that divides it.")
        if self.ks and k % self.ks:
            raise QuantError(f"in_features {k} is not a multiple of the super-block ({self.ks}).")
        return k

    def group_of(self, k: int) -> int:
        """Group size of a weight with k input features."""
        return self.padded_k(k) if self.group_size == -1 else self.group_size

    @classmethod
    def parse(cls, name: str) -> "QuantFormat":
        """'int8' (groups of 128, or 64/32 where 128 does not divide K, or for o_proj head_dim:
        for_split), 'int4' (groups of 32 with a min), or e.g. 'int4-g128-sym', 'int8-channel'
        (an explicit group is kept). Every rank count quantizes the same groups."""
        parts = str(name).lower().split("-")
        base = {"int8": cls(8, 128, "sym"), "int4": cls(4, 32, "min")}.get(parts[0])
        if base is None:
            raise QuantError(f"Unknown quantization {name!r}; use 'int8' or 'int4' "
                             f"(optionally -g32/-g64/-g128, -g16 for int4, -channel, -sym/-zero/-min).")
        bits, group, kind = base.bits, base.group_size, base.kind
        fit = True
        seen = {}  # NOTE: "group" and "kind" options given, each once
        for p in parts[1:]:
            what = "group" if p == "channel" or (p.startswith("g") and p[1:].isdigit()) else (
                "kind" if p in KINDS else None)
            if what is not None and what in seen:
                raise QuantError(f"Quantization {name!r} gives two {what}s ({seen[what]!r} and {p!r}); give one.")
            if what is not None:
                seen[what] = p
            if p.startswith("g") and p[1:].isdigit():
                group, fit = int(p[1:]), False
            elif p == "channel":
                group, fit = -1, False
            elif p == "nl":
                raise QuantError("Non-linear levels (nl) are GGUF IQ4's format, read from the file; "
                                 "they are not offered for quantizing at load.")
            elif p in KINDS:
                kind = p
            else:
                raise QuantError(f"Unknown quantization option {p!r} in {name!r}.")
        return cls(bits, group, kind, fit)


@dataclass
class QuantizedWeight:
    """Logical (unpacked) quantized weight of one Linear.

    q: [N, Kp] uint8 (int2-6 codes) or int8; scales: [N, Kp / group] f16;
    offsets: [N, Kp / group] f16 zero points (kind "zero") or mins (kind "min"), else None.
    in_features: K (Kp - K trailing zero columns for per-row int8).
    With fmt.ks: scales and offsets are int8 sub-scales sc and m, and supers = (d, dmin or
    None), f16 [N, Kp / ks]: s = d sc, offset -dmin m."""

    fmt: QuantFormat
    q: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    in_features: int
    supers: tuple | None = None

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def group(self) -> int:
        return self.fmt.group_of(self.in_features)

    def rows(self, sl: slice) -> "QuantizedWeight":
        """Output rows `sl` (a copy)."""
        off = None if self.offsets is None else self.offsets[sl].copy()
        sup = None if self.supers is None else tuple(None if a is None else a[sl].copy() for a in self.supers)
        return QuantizedWeight(self.fmt, self.q[sl].copy(), self.scales[sl].copy(), off,
                               self.in_features, sup)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the output dimension (fused q/k/v, gate/up)."""
    f, k = parts[0].fmt, parts[0].in_features
    if any(p.fmt != f or p.in_features != k for p in parts):
        raise QuantError("Cannot fuse quantized weights of different formats or input sizes.")
    off = np.concatenate([p.offsets for p in parts]) if f.has_offsets else None
    sup = None
    if f.ks:
        sup = (np.concatenate([p.supers[0] for p in parts]),
               np.concatenate([p.supers[1] for p in parts]) if f.has_offsets else None)
    return QuantizedWeight(f, np.concatenate([p.q for p in parts]),
                           np.concatenate([p.scales for p in parts]), off, k, sup)


def to_f16_scales(s: np.ndarray) -> np.ndarray:
    """f32/bf16-valued scales -> f16; one clear error when they do not fit."""
    with np.errstate(over="ignore"):
        s16 = np.asarray(s, dtype=np.float32).astype(np.float16)
    if not np.all(np.isfinite(s16)):
        raise QuantError("A quantization scale or offset is outside the f16 range (|x| > 65504); "
                         "this weight cannot be stored in our formats.")
    return s16


def offset_term(fmt: QuantFormat, scales: np.ndarray, offsets: np.ndarray | None) -> np.ndarray:
    """c per group, in f32 (exact): w = q * s + c."""
    s = scales.astype(np.float32)
    if fmt.bits == 8 or fmt.kind == "nl":
        return np.zeros_like(s)
    if fmt.kind == "sym":
        return s * np.float32(-(1 << (fmt.bits - 1)))
    o = offsets.astype(np.float32)
    return -(s * o) if fmt.kind == "zero" else o


def super_terms(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """(s, c) per group [N, ng] f32 of a weight with super-block scales: s = d sc, c = -half s
    ("sym"), 0 ("nl") or -dmin m ("min"); each an f16 times an int8, exact in f32."""
    gps = qw.fmt.ks // qw.group
    d = np.repeat(qw.supers[0].astype(np.float32), gps, axis=1)
    s = d * qw.scales.astype(np.float32)
    if qw.fmt.kind == "nl":
        return s, np.zeros_like(s)
    if qw.fmt.kind == "sym":
        return s, s * np.float32(-(1 << (qw.fmt.bits - 1)))
    dmin = np.repeat(qw.supers[1].astype(np.float32), gps, axis=1)
    return s, -(dmin * qw.offsets.astype(np.float32))


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """The f32 weights [N, K] the kernels compute with (bit for bit)."""
    n, kp = qw.q.shape
    g = qw.group
    if qw.fmt.ks:
        s, c = super_terms(qw)
        s, c = s[:, :, None], c[:, :, None]
    else:
        s = qw.scales.astype(np.float32)[:, :, None]                    # [N, ng, 1]
        c = offset_term(qw.fmt, qw.scales, qw.offsets)[:, :, None]      # [N, ng, 1]
    q = qw.q.reshape(n, kp // g, g)
    q = (NL_VALUES[q] if qw.fmt.kind == "nl" else q).astype(np.float32)  # [N, ng, G]
    w = q * s + c
    return np.ascontiguousarray(w.reshape(n, kp)[:, :qw.in_features])


def quantize(w: np.ndarray, fmt: QuantFormat, row_absmax: np.ndarray | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of f32 weights [N, K] (scales chosen per group from the
    group's range, rounded to f16 before the weights are rounded against them). row_absmax
    [N] (per-row int8 only): the largest |w| of each whole row, where w is a column slice of
    it, so that the slice takes the whole row's scale."""
    w = np.asarray(w, dtype=np.float32)
    if row_absmax is not None and (fmt.group_size != -1 or fmt.kind != "sym"):
        raise QuantError("row_absmax is for per-row int8 weights only.")
    n, k = w.shape
    kp = fmt.padded_k(k)
    g = fmt.group_of(k)
    if kp != k:
        w = np.concatenate([w, np.zeros((n, kp - k), np.float32)], axis=1)
    wg = w.reshape(n, kp // g, g)                                         # [N, ng, G]
    half = 1 << (fmt.bits - 1)
    if fmt.ks:
        return _quantize_super(wg, fmt, k)
    if fmt.kind == "nl":
        s = to_f16_scales(np.abs(wg).max(axis=2) / 127.0)
        return QuantizedWeight(fmt, _nearest_level(wg * _inverse(s)).reshape(n, kp), s, None, k)
    if fmt.kind == "sym":
        qmax = 127.0 if fmt.bits == 8 else float(half - 1)
        amax = np.abs(wg).max(axis=2) if row_absmax is None else np.asarray(row_absmax, np.float32)[:, None]
        s = to_f16_scales(amax / qmax)
        inv = _inverse(s)
        lo = -127 if fmt.bits == 8 else -half
        q = np.clip(np.rint(wg * inv), lo, qmax)
        q = q.astype(np.int8) if fmt.bits == 8 else (q + half).astype(np.uint8)
        return QuantizedWeight(fmt, q.reshape(n, kp), s, None, k)
    mn, mx = wg.min(axis=2), wg.max(axis=2)
    top = float(fmt.qmax)
    if fmt.kind == "min":
        s = to_f16_scales((mx - mn) / top)
        m = to_f16_scales(mn)
        q = np.clip(np.rint((wg - m.astype(np.float32)[..., None]) * _inverse(s)), 0, top)
        return QuantizedWeight(fmt, q.astype(np.uint8).reshape(n, kp), s, m, k)
    s = to_f16_scales((np.maximum(mx, 0) - np.minimum(mn, 0)) / top)
    inv = _inverse(s)
    z = np.clip(np.rint(-np.minimum(mn, 0) * inv[..., 0]), 0, top)
    q = np.clip(np.rint(wg * inv) + z[..., None], 0, top)
    return QuantizedWeight(fmt, q.astype(np.uint8).reshape(n, kp), s, z.astype(np.float16), k)


def _int8_multiples(v: np.ndarray, gps: int, top: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """v [N, ng] f32 -> (d f16 [N, ng / gps], m int8 [N, ng]) with d m close to v: d the
    super-block's largest |v| / top (rounded to f16), m = rint(v / d) in -top..top (top 15 for
    the 4-bit sub-scales and mins of int2 super-block formats, v >= 0 there: m in 0..15)."""
    n, ng = v.shape
    vs = v.reshape(n, ng // gps, gps)
    d = to_f16_scales(np.abs(vs).max(axis=2) / float(top))
    m = np.clip(np.rint(vs * _inverse(d)), -top, top).astype(np.int8)
    return d, m.reshape(n, ng)


def _quantize_super(wg: np.ndarray, fmt: QuantFormat, k: int) -> QuantizedWeight:
    """quantize() for super-block formats: the groups' f32 scales (and mins) as int8 multiples
    of one f16 value per super-block, then the weights rounded against s = d sc."""
    n, ng, g = wg.shape
    gps, top = fmt.ks // g, float(fmt.qmax)
    if fmt.bits == 2:  # 4-bit sub-scales and mins >= 0: the range that includes 0
        lo, hi = np.minimum(wg.min(axis=2), 0), np.maximum(wg.max(axis=2), 0)
        d, sc = _int8_multiples((hi - lo) / top, gps, 15)
        dmin, m = _int8_multiples(-lo, gps, 15)
        qw = QuantizedWeight(fmt, np.zeros((n, ng * g), np.uint8), sc, m, k, (d, dmin))
    elif fmt.kind in ("sym", "nl"):
        half = 1 << (fmt.bits - 1)
        d, sc = _int8_multiples(np.abs(wg).max(axis=2) / (127.0 if fmt.kind == "nl" else half - 1), gps)
        qw = QuantizedWeight(fmt, np.zeros((n, ng * g), np.uint8), sc, None, k, (d, None))
    else:
        mn, mx = wg.min(axis=2), wg.max(axis=2)
        d, sc = _int8_multiples((mx - mn) / top, gps)
        dmin, m = _int8_multiples(-mn, gps)
        qw = QuantizedWeight(fmt, np.zeros((n, ng * g), np.uint8), sc, m, k, (d, dmin))
    s, c = super_terms(qw)
    with np.errstate(divide="ignore"):
        inv = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0).astype(np.float32)[..., None]
    if fmt.kind == "nl":
        qw.q = _nearest_level(wg * inv).reshape(n, ng * g)
        return qw
    qw.q = np.clip(np.rint((wg - c[..., None]) * inv), 0, top).astype(np.uint8).reshape(n, ng * g)
    return qw


def _nearest_level(v: np.ndarray) -> np.ndarray:
    """The code of the NL level nearest each v (v in level units), uint8."""
    mid = (NL_VALUES[1:].astype(np.float32) + NL_VALUES[:-1]) / 2
    return np.searchsorted(mid, v).astype(np.uint8)


def _inverse(s16: np.ndarray) -> np.ndarray:
    # s: [N, ng] f16 -> 1/s as [N, ng, 1] f32 (0 where s == 0: such groups are all zero)
    s = s16.astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0).astype(np.float32)
    return inv[..., None]
