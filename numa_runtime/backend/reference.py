"""Reference ops in numpy: the specification every backend implements.

Conventions shared by every backend:
- activations are float32, C-contiguous;
- bf16 tensors are stored as uint16 arrays holding the upper 16 bits of an IEEE float32
  (round-to-nearest-even when converting from f32);
- ops that take `out` write into it and return it; none allocates when `out` is given.

The Cython backend (`numa_runtime.backend.cpu`) must agree with these functions to within
float32 rounding (exactly where noted); tests in tests/test_kernels.py compare them.
"""
from __future__ import annotations

import numpy as np


# ----------------------------------------------------------------------------- dtype helpers
def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16 bits (uint16). NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_to_f32(x: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> f32, exact. One allocation: the shift writes the result (any
    input layout, e.g. a slice of a memory-mapped checkpoint, is read once)."""
    x = np.asarray(x, dtype=np.uint16)
    out = np.empty(x.shape, dtype=np.uint32)
    np.left_shift(x, 16, out=out, dtype=np.uint32)
    return out.view(np.float32)


def as_f32(w: np.ndarray) -> np.ndarray:
    return bf16_to_f32(w) if w.dtype == np.uint16 else np.asarray(w, dtype=np.float32)


# ----------------------------------------------------------------------------- linear
class Linear:
    """y = x @ W.T + b with W: [out_features, in_features] (f32 or bf16 bits), b: [out] f32.

    A backend may repack W at construction (once); `forward` never repacks. For bf16 weights
    the activations may be rounded to bf16 before the product (oneDNN bf16 x bf16 -> f32),
    so bf16 results match this reference to bf16 tolerance, f32 ones to f32 tolerance.
    """

    rank_invariant = False  # the backend's flag: results that do not depend on the thread count

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None):
        # weight: [N, K]
        self.out_features, self.in_features = weight.shape
        self.weight = as_f32(weight)
        self.bias = None if bias is None else np.asarray(bias, dtype=np.float32)
        self.nbytes = self.weight.nbytes
        self.data_ptr = self.weight.ctypes.data  # where the weights live (numa.memory_report)

    def forward(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        # x: [M, K] -> out: [M, N]
        y = x @ self.weight.T
        if self.bias is not None:
            y += self.bias
        if out is None:
            return y.astype(np.float32)
        out[...] = y
        return out


# QLinear: the same contract over packed int8/int4 weights, specified in numa_runtime/quant.
from ..quant.reference import QLinear, set_decode_step  # noqa: E402,F401


# ----------------------------------------------------------------------------- elementwise
def embedding(ids: np.ndarray, table: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[t] = table[ids[t]] as f32. ids: [T] int64, table: [V, H] f32|bf16, out: [T, H]."""
    out[...] = as_f32(table[ids])
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
    """out = x / sqrt(mean(x^2) + eps) * weight over the last axis. x, out: [R, H]."""
    var = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    out[...] = (x / np.sqrt(var + eps)).astype(np.float32) * weight
    return out


def add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float,
                 out: np.ndarray) -> np.ndarray:
    """residual += x (in place); out = rms_norm(residual). All [T, H] f32."""
    residual += x
    return rms_norm(residual, weight, eps, out)


def silu_and_mul(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """x: [T, 2*I] = [gate | up]; out: [T, I] = silu(gate) * up."""
    inter = x.shape[1] // 2
    g, u = x[:, :inter], x[:, inter:]
    with np.errstate(over="ignore"):  # exp(-g) -> inf for very negative g gives silu = -0, as intended
        out[...] = g / (1.0 + np.exp(-g)) * u
    return out


def add_(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a += b, same shape f32."""
    a += b
    return a


def rotary(q: np.ndarray, k: np.ndarray, positions: np.ndarray, cos_sin: np.ndarray) -> None:
    """In-place neox-style (rotate-half) rotary embedding, as Hugging Face Llama applies it.

    q: [T, Hq, D], k: [T, Hk, D] f32; positions: [T] int64;
    cos_sin: [max_pos, rot_dim] f32, first rot_dim/2 columns cos, last rot_dim/2 sin
    (rot_dim <= D; dims past rot_dim are left untouched).
    """
    rot = cos_sin.shape[1]
    half = rot // 2
    cos = cos_sin[positions, :half][:, None, :]
    sin = cos_sin[positions, half:][:, None, :]
    for t in (q, k):
        x1 = t[..., :half].copy()
        x2 = t[..., half:rot].copy()
        t[..., :half] = x1 * cos - x2 * sin
        t[..., half:rot] = x2 * cos + x1 * sin


# ----------------------------------------------------------------------------- KV cache + attention
# A KV cache row (one slot of one kv head) is D f32 or bf16 values, or for an int8 cache D
# int8 values q followed by their scale s as the 4 bytes of a native f32: x ~= q * s with
# s = max |x| / 127 over the row (symmetric; an all-zero row has s = 0).
KV_CACHE_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "int8": np.int8}  # numpy storage
KV_SCALE_BYTES = 4


def kv_row_width(head_dim: int, kv_dtype: str) -> int:
    """Elements of one cache row for kv_dtype ("float32", "bfloat16" or "int8")."""
    return head_dim + KV_SCALE_BYTES if kv_dtype == "int8" else head_dim


def quantize_kv(x: np.ndarray) -> np.ndarray:
    """x: [..., D] f32 -> [..., D + 4] int8 rows: q = rint(x * (127 / max |x|)), then the
    scale max |x| / 127 (every operation in f32, as the kernel does it)."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=-1, keepdims=True) if x.shape[-1] else np.zeros(x.shape[:-1] + (1,), np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(amax > 0, np.minimum(np.float32(127) / amax, np.finfo(np.float32).max), np.float32(0))
    q = np.clip(np.rint(x * inv.astype(np.float32)), -127, 127).astype(np.int8)
    scale = (amax / np.float32(127)).astype(np.float32)
    return np.concatenate([q, scale.view(np.int8)], axis=-1)


def dequantize_kv(rows: np.ndarray) -> np.ndarray:
    """[..., D + 4] int8 rows -> [..., D] f32 (q * s)."""
    d = rows.shape[-1] - KV_SCALE_BYTES
    scale = np.ascontiguousarray(rows[..., d:]).view(np.float32)  # [..., 1]
    return rows[..., :d].astype(np.float32) * scale


def kv_as_f32(rows: np.ndarray) -> np.ndarray:
    """Cache rows of any KV dtype as f32 [..., D]."""
    return dequantize_kv(rows) if rows.dtype == np.int8 else as_f32(rows)


def reshape_and_cache(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      slot_mapping: np.ndarray) -> None:
    """Write new K/V rows into the paged cache.

    k, v: [T, Hk, D] f32; k_cache, v_cache: [num_blocks, block_size, Hk, D] f32 or bf16 bits,
    or [num_blocks, block_size, Hk, D + 4] int8 (quantize_kv); slot_mapping: [T] int64,
    slot = block_id * block_size + offset; a slot < 0 is skipped.
    """
    nb, bs = k_cache.shape[:2]
    kc = k_cache.reshape(nb * bs, *k_cache.shape[2:])
    vc = v_cache.reshape(nb * bs, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if k_cache.dtype == np.int8:
        kc[slots] = quantize_kv(k[valid])
        vc[slots] = quantize_kv(v[valid])
    elif k_cache.dtype == np.uint16:
        kc[slots] = f32_to_bf16(k[valid])
        vc[slots] = f32_to_bf16(v[valid])
    else:
        kc[slots] = k[valid]
        vc[slots] = v[valid]


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, query_start: np.ndarray, context_lens: np.ndarray,
                    scale: float, out: np.ndarray, window: int = 0,
                    first_prompt_seq: int | None = None) -> np.ndarray:
    """Causal attention for a batch of sequences through their block tables.
    (first_prompt_seq: which sequences hold prompt rows, for backends whose precision follows
    the path; here every row is exact f32 and it changes nothing.)

    q: [T, Hq, D] f32, the new tokens of all sequences packed back to back;
    query_start: [S+1] int32, sequence s owns q rows query_start[s]:query_start[s+1];
    context_lens: [S] int32, tokens in the cache for s *including* its new ones (already
      written by reshape_and_cache); the new tokens are the last ones, so query row i of s
      sits at position context_lens[s] - n_new + i and sees keys 0..that position;
    block_tables: [S, max_blocks] int32; k_cache/v_cache: [num_blocks, block_size, Hk, row]
      with row = D (f32, bf16) or D + 4 (int8, dequantized as read);
    grouped-query: query head h reads kv head h // (Hq // Hk).
    window > 0 (sliding window): the query at position P sees only keys P - window + 1 .. P.
    out: [T, Hq, D] f32. Softmax in f32 with max subtraction.
    """
    bs = k_cache.shape[1]
    hq, hk = q.shape[1], k_cache.shape[2]
    group = hq // hk
    for s in range(len(context_lens)):
        q0, q1 = int(query_start[s]), int(query_start[s + 1])
        n_new, ctx = q1 - q0, int(context_lens[s])
        if n_new == 0:
            continue
        nblk = (ctx + bs - 1) // bs
        blocks = block_tables[s, :nblk]
        keys = kv_as_f32(k_cache[blocks].reshape(nblk * bs, hk, -1)[:ctx])  # [ctx, Hk, D]
        vals = kv_as_f32(v_cache[blocks].reshape(nblk * bs, hk, -1)[:ctx])
        keys = np.repeat(keys, group, axis=1)  # [ctx, Hq, D]
        vals = np.repeat(vals, group, axis=1)
        qs = q[q0:q1]  # [n, Hq, D]
        scores = np.einsum("nhd,chd->hnc", qs, keys) * scale  # [Hq, n, ctx]
        pos = ctx - n_new + np.arange(n_new)
        mask = np.arange(ctx)[None, :] > pos[:, None]  # [n, ctx]
        if window > 0:
            mask |= np.arange(ctx)[None, :] <= pos[:, None] - window
        scores = np.where(mask[None], -np.inf, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[q0:q1] = np.einsum("hnc,chd->nhd", p, vals)
    return out


# ----------------------------------------------------------------------------- sampling
def sample(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
           min_p: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """One token per row. logits: [N, V] f32 (penalties already applied); per-row params:
    temperature [N] f32 (0 = greedy: argmax, lowest index on ties), top_k [N] int32
    (<= 0 = off), top_p [N] f32 (1 = off), min_p [N] f32 (0 = off), uniform [N] f64 in [0, 1).

    Non-greedy rows, in vLLM V1's order: p = softmax(logits / T); drop tokens with
    p < min_p * max(p); keep the top_k most likely; then the smallest prefix (by descending p,
    ties by lower index) whose share of the kept mass reaches top_p; renormalise and pick the
    token where the cumulative mass of the kept tokens, in descending-p order, first exceeds
    uniform * total.
    Returns [N] int64.
    """
    n, v = logits.shape
    ids = np.empty(n, dtype=np.int64)
    for r in range(n):
        row = logits[r].astype(np.float64)
        if temperature[r] <= 0:
            ids[r] = int(np.argmax(row))
            continue
        z = row / float(temperature[r])
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.lexsort((np.arange(v), -p))
        ps = p[order]
        if min_p[r] > 0:
            m = ps >= min_p[r] * ps[0]
            ps, order = ps[m], order[m]
        keep = len(ps) if top_k[r] <= 0 else min(int(top_k[r]), len(ps))
        while keep < len(ps) and ps[keep] == ps[keep - 1]:  # NOTE: as vLLM: ties with the k-th stay
            keep += 1
        ps, order = ps[:keep], order[:keep]
        if top_p[r] < 1.0:
            cum = np.cumsum(ps) / ps.sum()
            cut = int(np.searchsorted(cum, top_p[r])) + 1
            ps, order = ps[:cut], order[:cut]
        cum = np.cumsum(ps)
        j = int(np.searchsorted(cum, uniform[r] * cum[-1], side="right"))
        ids[r] = int(order[min(j, len(order) - 1)])
    return ids


def log_softmax(logits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in f32. logits, out: [N, V]."""
    m = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)) + m
    out[...] = logits - lse
    return out


# ----------------------------------------------------------------------------- reductions
def reduce_sum(dst: np.ndarray, srcs: list[np.ndarray]) -> np.ndarray:
    """dst = sum(srcs) elementwise (f32, or bf16 bits accumulated in f32 and rounded once)."""
    if dst.dtype == np.uint16:
        acc = sum(bf16_to_f32(s) for s in srcs)
        dst[...] = f32_to_bf16(acc)
    else:
        acc = np.zeros_like(dst)
        for s in srcs:
            acc += s
        dst[...] = acc
    return dst


def set_num_threads(n: int) -> None:
    """numpy picks its own threads; nothing to do."""
