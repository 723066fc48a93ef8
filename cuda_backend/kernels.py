"""Triton kernels of the CUDA backend and their Python-facing functions.

The same semantics as numa_runtime/backend/reference.py (the specification), over torch
tensors on one device, in the activation dtype (bf16 or f32; every kernel computes in f32):

    rms_norm(x, w, eps, out, residual=None)    residual += x first when given (fused add)
    silu_and_mul(gate_up, out)                 [T, 2I] -> [T, I]
    rotary_and_cache(qkv, ...)                 q/k norms (Qwen3), rotary, K/V into the cache
    paged_attention(q, k_cache, v_cache, ...)  decode and chunked prefill over block tables

Every function launches one kernel and allocates nothing, so a decode step can be captured
in a CUDA graph. The kernels also run under Triton's interpreter (TRITON_INTERPRET=1) on CPU
tensors, which is how they are checked on machines without a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(int(n)))


# ----------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, x_stride, res_stride, out_stride, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * res_stride + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
        # NOTE: normalise what was stored, so that a bf16 residual stream is self-consistent
        x = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(var + eps) * w
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """out = rms_norm(x) * weight; with `residual`: residual += x, out = rms_norm(residual) * weight.
    x, out, residual: [R, H] (rows may be strided, last axis contiguous); weight: [H] f32."""
    rows, n = x.shape
    if rows == 0:
        return out
    res = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](x, res, weight, out, n, x.stride(0), res.stride(0), out.stride(0), eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=_pow2(n))
    return out


# ----------------------------------------------------------------------------- SiLU and mul
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] contiguous; out: [T, I] = silu(gate) * up."""
    rows, inter = out.shape
    if rows == 0:
        return out
    block = min(1024, _pow2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, inter, BLOCK=block)
    return out


# ----------------------------------------------------------------------------- rotary + cache
@triton.jit
def _rotary_cache_kernel(qkv_ptr, pos_ptr, slot_ptr, cs_ptr, qn_ptr, kn_ptr, kc_ptr, vc_ptr,
                         row_stride, block_stride, eps, BS: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                         HALF: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr,
                         BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    # program (t, h): h < HQ is query head h; HQ <= h < HQ + HK is kv head h - HQ
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_q = h < HQ
    base = qkv_ptr + t * row_stride + h * D
    i = tl.arange(0, BLOCK_HALF)
    mi = i < HALF
    r = tl.arange(0, BLOCK_REST)
    mr = (ROT + r) < D
    x1 = tl.load(base + i, mask=mi, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i, mask=mi, other=0.0).to(tl.float32)
    xr = tl.load(base + ROT + r, mask=mr, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(xr * xr, axis=0)
        inv = tl.math.rsqrt(ss / D + eps)
        if is_q:
            n_ptr = qn_ptr
        else:
            n_ptr = kn_ptr
        x1 = x1 * inv * tl.load(n_ptr + i, mask=mi, other=0.0)
        x2 = x2 * inv * tl.load(n_ptr + HALF + i, mask=mi, other=0.0)
        xr = xr * inv * tl.load(n_ptr + ROT + r, mask=mr, other=0.0)
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cs_ptr + pos * ROT + i, mask=mi, other=1.0)
    sin = tl.load(cs_ptr + pos * ROT + HALF + i, mask=mi, other=0.0)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if is_q:
        ty = qkv_ptr.dtype.element_ty
        tl.store(base + i, y1.to(ty), mask=mi)
        tl.store(base + HALF + i, y2.to(ty), mask=mi)
        if HAS_NORM:
            tl.store(base + ROT + r, xr.to(ty), mask=mr)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            kv = h - HQ
            ty = kc_ptr.dtype.element_ty
            cache_off = (slot // BS) * block_stride + (slot % BS) * (HK * D) + kv * D
            dst = kc_ptr + cache_off
            tl.store(dst + i, y1.to(ty), mask=mi)
            tl.store(dst + HALF + i, y2.to(ty), mask=mi)
            tl.store(dst + ROT + r, xr.to(ty), mask=mr)
            vsrc = qkv_ptr + t * row_stride + (HQ + HK) * D + kv * D
            vdst = vc_ptr + cache_off
            j = tl.arange(0, BLOCK_D)
            tl.store(vdst + j, tl.load(vsrc + j, mask=j < D).to(ty), mask=j < D)


def _block_stride(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The stride between blocks of K and V caches whose blocks are each contiguous."""
    bs, hk, d = k_cache.shape[1:]
    for c in (k_cache, v_cache):
        if c.stride()[1:] != (hk * d, d, 1):
            raise ValueError(f"KV cache blocks must be contiguous [block_size, Hk, D]; got strides {c.stride()}.")
    if k_cache.stride(0) != v_cache.stride(0):
        raise ValueError("K and V caches must have the same block stride.")
    return k_cache.stride(0)


def rotary_and_cache(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                     positions: torch.Tensor, slot_mapping: torch.Tensor, cos_sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, q_norm: torch.Tensor | None = None,
                     k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """In place on q (the first num_q_heads * head_dim columns of qkv): optional per-head RMSNorm
    (q_norm), then neox rotary. K gets the same (k_norm) and is written, with V, into the cache.

    qkv: [T, (Hq + 2 Hk) D], rows may be strided; positions, slot_mapping: [T] int64 (slot < 0:
    not written); cos_sin: [max_pos, rot] f32 = [cos | sin]; k_cache, v_cache: [NB, BS, Hk, D]
    (blocks may be strided, as layer views of a cache that keeps each block's layers together).
    """
    t = qkv.shape[0]
    if t == 0:
        return
    rot = cos_sin.shape[1]
    half = rot // 2
    rest = head_dim - rot
    has_norm = q_norm is not None
    # NOTE: without norms the dims past `rot` of q stay as they are; of k they are still copied
    _rotary_cache_kernel[(t, num_q_heads + num_kv_heads)](
        qkv, positions, slot_mapping, cos_sin, q_norm if has_norm else cos_sin,
        k_norm if has_norm else cos_sin, k_cache, v_cache, qkv.stride(0), _block_stride(k_cache, v_cache), eps,
        BS=k_cache.shape[1],
        HQ=num_q_heads, HK=num_kv_heads, D=head_dim, HALF=half, ROT=rot, HAS_NORM=has_norm,
        BLOCK_HALF=_pow2(half), BLOCK_REST=_pow2(max(rest, 1)), BLOCK_D=_pow2(head_dim))


# ----------------------------------------------------------------------------- paged attention
@triton.jit
def _paged_attention_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, qs_ptr, ctx_ptr,
                            q_stride, bt_stride, block_stride, scale_log2, window,
                            HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    # program (s, kv, tile): BLOCK_M rows of (query token, head of kv's group) pairs of sequence s
    s = tl.program_id(0)
    kv = tl.program_id(1)
    tile = tl.program_id(2)
    q0 = tl.load(qs_ptr + s)
    n_new = tl.load(qs_ptr + s + 1) - q0
    ctx = tl.load(ctx_ptr + s)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    if tile * BLOCK_M >= n_new * GROUP:
        return
    tok = rows // GROUP
    head = kv * GROUP + rows % GROUP
    row_ok = tok < n_new
    qpos = ctx - n_new + tok                              # [BLOCK_M] positions of the queries
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q_off = (q0 + tok).to(tl.int64)[:, None] * q_stride + head[:, None] * D + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dm[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = tl.minimum(ctx, ctx - n_new + (tile * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    first = ctx * 0  # NOTE: of ctx's integer type in both branches
    if window > 0:
        first = tl.maximum(ctx - n_new + (tile * BLOCK_M) // GROUP - window + 1, 0)
        first = (first // BLOCK_N) * BLOCK_N
    start = first
    # NOTE: a while loop, not range(first, last): Triton's interpreter cannot range over loaded values
    while start < last:
        kpos = start + tl.arange(0, BLOCK_N)              # [BLOCK_N]
        k_ok = kpos < last
        blk = tl.load(bt_ptr + s.to(tl.int64) * bt_stride + kpos // BS, mask=k_ok, other=0)
        row = blk.to(tl.int64) * block_stride + (kpos % BS) * (HK * D)
        kv_off = row[:, None] + kv * D + d[None, :]
        k = tl.load(kc_ptr + kv_off, mask=k_ok[:, None] & dm[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = sc * scale_log2                               # [BLOCK_M, BLOCK_N], log2 units
        ok = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :]
        if window > 0:
            ok = ok & (kpos[None, :] > qpos[:, None] - window)
        sc = tl.where(ok, sc, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(sc - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + kv_off, mask=k_ok[:, None] & dm[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32),
                                                input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        start += BLOCK_N
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q0 + tok).to(tl.int64)[:, None] * (HQ * D) + head[:, None] * D + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                    scale: float, out: torch.Tensor, window: int = 0, max_query_len: int = 1) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its cached keys (reference.py's
    paged_attention): q: [T, Hq, D] (token rows may be strided); k_cache, v_cache: [NB, BS, Hk, D];
    block_tables: [S, max_blocks] int32; query_start: [S+1] int32; context_lens: [S] int32;
    out: [T, Hq, D] contiguous (cache blocks may be strided, as in rotary_and_cache). `max_query_len` bounds query_start's gaps (1 for decode).
    A sequence with context 0 gets zeros (padding rows of a captured decode batch)."""
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    hq, d = q.shape[1], q.shape[2]
    hk, bs = k_cache.shape[2], k_cache.shape[1]
    group = hq // hk
    block_m = _pow2(min(group * max_query_len, 64), 16)
    tiles = triton.cdiv(group * max_query_len, block_m)
    block_n = 32 if d > 128 else 64
    _paged_attention_kernel[(num_seqs, hk, tiles)](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens,
        q.stride(0), block_tables.stride(0), _block_stride(k_cache, v_cache), scale * _LOG2E, window,
        HQ=hq, HK=hk, D=d, BS=bs, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=_pow2(d, 16),
        # NOTE: on CPU tensors (Triton's interpreter) bf16 dots are wrong; dot in f32 there
        IEEE=q.dtype == torch.float32 or q.device.type == "cpu")
    return out
