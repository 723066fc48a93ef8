"""The kernel wrappers' argument checks: arrays already in a kernel's form take the fast path
(arrays.pxi), everything else the full checks. These tests hold both to one contract: what is
refused is refused with the same error, and what is converted gives the reference's result."""
import numpy as np
import pytest

from numa_runtime._kernels.gemm import Linear
from numa_runtime._kernels.qgemm import QLinear
from numa_runtime.backend import cpu, reference as ref

RNG = np.random.default_rng(7)


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def swapped(a):
    return a.astype(a.dtype.newbyteorder(">"))


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


# ----------------------------------------------------------------------------- row ops
@pytest.mark.parametrize("bad, err", [
    (lambda x: x.astype(np.float64), TypeError),           # another dtype
    (swapped, TypeError),                                  # float32, but big-endian
    (lambda x: np.asfortranarray(np.repeat(x, 3, 0))[:, ::2], ValueError),  # strided last axis
    (lambda x: x.tolist(), TypeError),                     # not an array
])
def test_rms_norm_refuses_what_is_not_rows(bad, err):
    x, w = randn(3, 16), randn(16)
    with pytest.raises(err):
        cpu.rms_norm(bad(x), w, 1e-6, np.empty_like(x))
    with pytest.raises(err):  # the same as out
        cpu.rms_norm(x, w, 1e-6, bad(np.empty_like(x)))


def test_row_ops_refuse_read_only_outputs():
    x, w = randn(3, 16), randn(16)
    with pytest.raises(ValueError, match="writable"):
        cpu.rms_norm(x, w, 1e-6, readonly(x))
    with pytest.raises(ValueError, match="writable"):
        cpu.add_rms_norm(x, readonly(x), w, 1e-6, np.empty_like(x))
    with pytest.raises(ValueError, match="writable"):
        cpu.silu_and_mul(randn(3, 32), readonly(x))


def test_rms_norm_takes_1d_and_3d_rows_and_any_weight_form():
    x3 = randn(2, 3, 16)
    out = np.empty_like(x3)
    cpu.rms_norm(x3, randn(16).astype(np.float32)[None, :], 1e-6, out)  # [1, H] weight: reshaped
    w = np.ones(16, np.float32)
    want = ref.rms_norm(x3.reshape(6, 16), w, 1e-6, np.empty((6, 16), np.float32))
    cpu.rms_norm(x3, w, 1e-6, out)
    np.testing.assert_allclose(out.reshape(6, 16), want, rtol=2e-6, atol=2e-6)
    x1, o1 = randn(16), np.empty(16, np.float32)
    cpu.rms_norm(x1, w, 1e-6, o1)
    np.testing.assert_allclose(o1, ref.rms_norm(x1[None], w, 1e-6, np.empty((1, 16), np.float32))[0],
                               rtol=2e-6, atol=2e-6)
    with pytest.raises(TypeError, match="float32"):
        cpu.rms_norm(x1, w.astype(np.float64), 1e-6, o1)
    with pytest.raises(ValueError, match="elements"):
        cpu.rms_norm(x1, w[:15], 1e-6, o1)


def test_embedding_ids_in_any_int_form_and_out_of_range():
    table = randn(50, 8)
    out = np.empty((4, 8), np.float32)
    for ids in ([1, 2, -1, 49], np.array([1, 2, -1, 49], np.int32), np.array([[1, 2, -1, 49]])):
        cpu.embedding(ids, table, out)
        np.testing.assert_array_equal(out, table[[1, 2, 49, 49]])
    for bad in ([0, 0, 0, 50], [-51, 0, 0, 0]):
        with pytest.raises(IndexError):
            cpu.embedding(np.array(bad), table, out)
    with pytest.raises(TypeError, match="float32 or bf16"):
        cpu.embedding(np.array([0]), table.astype(np.float64), out[:1])
    with pytest.raises(TypeError, match="float32 or bf16"):
        cpu.embedding(np.array([0]), swapped(table), out[:1])


# ----------------------------------------------------------------------------- rotary
def test_rotary_positions_and_cos_sin_in_any_form():
    q, k = randn(3, 2, 8), randn(3, 1, 8)
    cos_sin = randn(10, 8).astype(np.float64)      # converted
    pos = [9, 0, 4]                                # a list, converted
    want_q, want_k = q.copy(), k.copy()
    ref.rotary(want_q, want_k, np.array(pos), cos_sin.astype(np.float32))
    cpu.rotary(q, k, pos, cos_sin)
    np.testing.assert_allclose(q, want_q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, want_k, rtol=1e-5, atol=1e-5)
    for bad in ([10, 0, 0], [0, -1, 0]):
        with pytest.raises(IndexError, match="position out of range"):
            cpu.rotary(q, k, np.array(bad), cos_sin)
    with pytest.raises(TypeError, match="float32"):
        cpu.rotary(q.astype(np.float64), k, np.array(pos), cos_sin)
    with pytest.raises(TypeError, match="float32"):
        cpu.rotary(swapped(q), k, np.array(pos), cos_sin)
    with pytest.raises(ValueError, match="writable"):
        cpu.rotary(q, readonly(k), np.array(pos), cos_sin)


# ----------------------------------------------------------------------------- KV cache + attention
def _decode_case(dtype=np.float32):
    hq, hk, d, bs, ctx = 4, 2, 16, 4, 9
    kc = np.zeros((4, bs, hk, d), dtype)
    vc = np.zeros_like(kc)
    slots = np.arange(ctx, dtype=np.int64)
    cpu.reshape_and_cache(randn(ctx, hk, d), randn(ctx, hk, d), kc, vc, slots)
    q = randn(1, hq, d)
    return q, kc, vc, np.array([[0, 1, 2, 3]], np.int32), np.array([0, 1], np.int32), np.array([ctx], np.int32)


def test_paged_attention_plan_arrays_in_any_int_form():
    q, kc, vc, bt, qs, cl = _decode_case()
    want = ref.paged_attention(q, kc, vc, bt, qs, cl, 0.25, np.zeros_like(q))
    for conv in (lambda a: a.astype(np.int64), lambda a: a.tolist(), lambda a: np.asfortranarray(a)):
        got = cpu.paged_attention(q, kc, vc, conv(bt), conv(qs), conv(cl), 0.25, np.full_like(q, 7.0))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_attention_refuses_bad_caches_and_outputs():
    q, kc, vc, bt, qs, cl = _decode_case()
    k1 = randn(1, 2, 16)
    for bad_k, bad_v, err in [(kc, vc[:, :2], ValueError),                 # shapes differ
                              (kc, vc.astype(np.uint16), ValueError),      # dtypes differ
                              (kc.astype(np.float64), vc.astype(np.float64), TypeError),
                              (swapped(kc), swapped(vc), TypeError),
                              (np.asfortranarray(kc), vc, ValueError),     # not C-contiguous
                              (kc[..., None], vc[..., None], ValueError)]:  # not 4-D
        with pytest.raises(err):
            cpu.reshape_and_cache(k1, k1, bad_k, bad_v, np.array([0]))
        with pytest.raises(err):
            cpu.paged_attention(q, bad_k, bad_v, bt, qs, cl, 0.25, np.empty_like(q))
    with pytest.raises(ValueError, match="writable"):
        cpu.paged_attention(q, kc, vc, bt, qs, cl, 0.25, readonly(q))
    with pytest.raises(ValueError, match="q's shape"):
        cpu.paged_attention(q, kc, vc, bt, qs, cl, 0.25, np.empty((1, 2, 16), np.float32))
    with pytest.raises(TypeError, match="float32"):
        cpu.reshape_and_cache(swapped(k1), k1, kc, vc, np.array([0]))
    with pytest.raises(ValueError, match="disagree"):
        cpu.reshape_and_cache(k1, randn(1, 1, 16), kc, vc, np.array([0]))
    with pytest.raises(ValueError, match="head dim 8 needs rows of 8"):   # k's head dim is not the cache's
        cpu.reshape_and_cache(randn(1, 2, 8), randn(1, 2, 8), kc, vc, np.array([0]))


# ----------------------------------------------------------------------------- linears
def _linears():
    w = randn(24, 40)
    yield Linear(cpu.f32_to_bf16(w)), 40, 24
    yield Linear(w), 40, 24
    from numa_runtime.quant.formats import QuantFormat, quantize
    from numa_runtime.quant.packing import pack
    qw = quantize(w[:, :32], QuantFormat.parse("int4"))
    yield QLinear(pack(qw), 4, qw.fmt.kind, qw.group, 32, 24), 32, 24


@pytest.mark.parametrize("lin, k, n", list(_linears()))
def test_linear_forward_refuses_what_it_cannot_read(lin, k, n):
    x = randn(2, k)
    y = lin.forward(x)
    out = np.full((2, n), np.nan, np.float32)
    assert lin.forward(x, out) is out
    np.testing.assert_array_equal(out, y)
    for bad in (x.astype(np.float64), swapped(x), np.asfortranarray(x), randn(2, k + 1), x[None]):
        with pytest.raises(ValueError):
            lin.forward(bad)
    for bad in (out.astype(np.float64), swapped(out), np.asfortranarray(out), out[:1], out[:, :-1]):
        with pytest.raises(ValueError):
            lin.forward(x, bad)
