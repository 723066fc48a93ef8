"""The CUDA backend's Triton kernels against the numpy specification (backend/reference.py)."""
import numpy as np
import pytest

from cuda_device import device, requires_cuda

from numa_runtime.backend import reference as ref

pytestmark = requires_cuda

TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2)}


def _t(a, dtype="float32"):
    import torch
    t = torch.from_numpy(np.array(a)).to(device())  # a copy: never aliases `a`
    return t.to(getattr(torch, dtype)) if t.is_floating_point() else t


def _np(t):
    return t.float().cpu().numpy()


def _bf16_round(a):
    return ref.bf16_to_f32(ref.f32_to_bf16(a))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 96), (3, 4095)])
def test_rms_norm_and_fused_residual(dtype, rows, cols):
    from numa_runtime.cuda_backend import kernels
    rng = np.random.default_rng(rows + cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    res = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    if dtype == "bfloat16":
        x, res = _bf16_round(x), _bf16_round(res)
    out = _t(np.zeros_like(x), dtype)
    kernels.rms_norm(_t(x, dtype), _t(w), 1e-5, out)
    np.testing.assert_allclose(_np(out), ref.rms_norm(x, w, 1e-5, np.empty_like(x)), **TOL[dtype])
    r = _t(res, dtype)
    kernels.rms_norm(_t(x, dtype), _t(w), 1e-5, out, residual=r)
    want_res = res + x
    np.testing.assert_allclose(_np(r), want_res, **TOL[dtype])
    np.testing.assert_allclose(_np(out), ref.rms_norm(_np(r), w, 1e-5, np.empty_like(x)), **TOL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,inter", [(1, 96), (5, 1025)])
def test_silu_and_mul(dtype, rows, inter):
    from numa_runtime.cuda_backend import kernels
    x = np.random.default_rng(inter).standard_normal((rows, 2 * inter)).astype(np.float32) * 4
    if dtype == "bfloat16":
        x = _bf16_round(x)
    out = _t(np.zeros((rows, inter), np.float32), dtype)
    kernels.silu_and_mul(_t(x, dtype), out)
    np.testing.assert_allclose(_np(out), ref.silu_and_mul(x, np.empty((rows, inter), np.float32)),
                               **TOL[dtype])


@pytest.mark.parametrize("hq,hk,d,rot,norm", [(4, 2, 16, 16, False), (3, 1, 24, 12, False),
                                              (4, 4, 32, 32, True), (8, 2, 64, 32, True)])
def test_rotary_and_cache(hq, hk, d, rot, norm):
    from numa_runtime.cuda_backend import kernels
    rng = np.random.default_rng(hq * d + rot)
    t, nb, bs, eps = 9, 5, 4, 1e-6
    qkv = rng.standard_normal((t, (hq + 2 * hk) * d)).astype(np.float32)
    pos = rng.integers(0, 50, t).astype(np.int64)
    slots = rng.permutation(nb * bs)[:t].astype(np.int64)
    slots[3] = -1  # skipped
    ang = rng.standard_normal((64, rot // 2))
    cos_sin = np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(np.float32)
    qn = rng.standard_normal(d).astype(np.float32) if norm else None
    kn = rng.standard_normal(d).astype(np.float32) if norm else None
    # reference: norms, rotary, reshape_and_cache
    q = qkv[:, :hq * d].reshape(t, hq, d).copy()
    k = qkv[:, hq * d:(hq + hk) * d].reshape(t, hk, d).copy()
    v = qkv[:, (hq + hk) * d:].reshape(t, hk, d).copy()
    if norm:
        q = ref.rms_norm(q.reshape(-1, d), qn, eps, np.empty((t * hq, d), np.float32)).reshape(t, hq, d)
        k = ref.rms_norm(k.reshape(-1, d), kn, eps, np.empty((t * hk, d), np.float32)).reshape(t, hk, d)
    ref.rotary(q, k, pos, cos_sin)
    kc, vc = np.zeros((nb, bs, hk, d), np.float32), np.zeros((nb, bs, hk, d), np.float32)
    ref.reshape_and_cache(k, v, kc, vc, slots)
    # kernel, on a row-strided view of a wider buffer
    wide = np.zeros((t, qkv.shape[1] + 8), np.float32)
    wide[:, :qkv.shape[1]] = qkv
    g = _t(wide)[:, :qkv.shape[1]]
    kv = _t(np.zeros((nb, 2, 2, bs, hk, d), np.float32))  # [NB, layers, K|V, BS, Hk, D]
    gkc, gvc = kv[:, 1, 0], kv[:, 1, 1]
    kernels.rotary_and_cache(g, hq, hk, d, _t(pos), _t(slots), _t(cos_sin), gkc, gvc,
                             None if qn is None else _t(qn), None if kn is None else _t(kn), eps)
    np.testing.assert_allclose(_np(g[:, :hq * d]).reshape(t, hq, d), q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(gkc), kc, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(_np(gvc), vc)


def _attention_case(rng, hq, hk, d, bs, new, ctx, dtype):
    """Sequences with `new[s]` new tokens at the end of `ctx[s]` cached ones, shuffled blocks."""
    nblk = [-(-c // bs) for c in ctx]
    nb = sum(nblk) + 3
    ids = rng.permutation(nb).astype(np.int32)
    tables = np.zeros((len(ctx), max(nblk)), np.int32)
    o = 0
    for s, n in enumerate(nblk):
        tables[s, :n] = ids[o:o + n]
        o += n
    kc = rng.standard_normal((nb, bs, hk, d)).astype(np.float32)
    vc = rng.standard_normal((nb, bs, hk, d)).astype(np.float32)
    q = rng.standard_normal((sum(new), hq, d)).astype(np.float32)
    if dtype == "bfloat16":
        kc, vc, q = _bf16_round(kc), _bf16_round(vc), _bf16_round(q)
    qs = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    return q, kc, vc, tables, qs, np.asarray(ctx, np.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hq,hk,d,bs,window", [(4, 2, 16, 16, 0), (8, 1, 24, 4, 0), (4, 4, 64, 16, 5),
                                               (16, 2, 128, 16, 0), (6, 3, 32, 8, 33)])
def test_paged_attention_decode_and_chunked_prefill(dtype, hq, hk, d, bs, window):
    from numa_runtime.cuda_backend import kernels
    rng = np.random.default_rng(hq + d + bs)
    new = [1, 7, 1, 70, 3]      # decodes, a prefill chunk behind cached tokens, a whole prompt
    ctx = [1, 40, 129, 70, 3]
    q, kc, vc, tables, qs, cl = _attention_case(rng, hq, hk, d, bs, new, ctx, dtype)
    scale = d ** -0.5
    want = ref.paged_attention(q, kc, vc, tables, qs, cl, scale, np.zeros_like(q), window)
    out = _t(np.zeros_like(q), dtype)
    # the cache as the model keeps it: each block's layers (here 3) and K/V together
    kv = _t(np.zeros((kc.shape[0], 3, 2) + kc.shape[1:], np.float32), dtype)
    kv[:, 1, 0], kv[:, 1, 1] = _t(kc, dtype), _t(vc, dtype)
    kernels.paged_attention(_t(q, dtype), kv[:, 1, 0], kv[:, 1, 1], _t(tables), _t(qs), _t(cl),
                            scale, out, window, max_query_len=max(new))
    np.testing.assert_allclose(_np(out), want, **TOL[dtype])


def test_paged_attention_empty_context_gives_zeros():
    """A padding row of a captured decode batch (context 0) reads nothing and yields zeros."""
    from numa_runtime.cuda_backend import kernels
    rng = np.random.default_rng(3)
    q, kc, vc, tables, qs, cl = _attention_case(rng, 4, 2, 16, 16, [1, 1], [5, 1], "float32")
    cl[1] = 0
    out = _t(np.full_like(q, 7.0))
    kernels.paged_attention(_t(q), _t(kc), _t(vc), _t(tables), _t(qs), _t(cl), 0.25, out)
    want = ref.paged_attention(q[:1], kc, vc, tables[:1], qs[:2], cl[:1], 0.25, np.zeros_like(q[:1]))
    np.testing.assert_allclose(_np(out)[:1], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(_np(out)[1], 0.0)
