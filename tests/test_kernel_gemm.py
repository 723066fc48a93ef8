"""numa_runtime._kernels.gemm.Linear against the numpy specification (reference.Linear).

Tolerances, per output element y[m, n], with scale[m, n] = sum_k |x[m, k]| * |W[n, k]| (the
natural bound of a dot product's rounding error):
- f32 weights: |y - ref(x)| <= 1e-4 * scale  (f32 accumulation in another order);
- bf16 weights: the kernel rounds x to bf16 (nearest-even) first, as oneDNN's bf16 x bf16 -> f32
  does, so |y - ref(bf16(x))| <= 1e-4 * scale, and against the unrounded x
  |y - ref(x)| <= 2**-8 * scale (bf16 has 8 significant bits: per-element error <= 2**-9).
A wrong column, row, bias or padding value is an O(scale) error, far above both.
"""
import numpy as np
import pytest

from numa_runtime._kernels import gemm, ops
from numa_runtime.backend import reference as ref

MS = [1, 3, 7, 16, 17, 33, 300]
SHAPES = [(7, 5), (64, 1), (896, 1152), (4095, 13), (129, 4097)]  # (K, N)

_cache = {}


def make(k, n, dtype, with_bias):
    """(our Linear, reference Linear, weight as f32) for one case, built once."""
    key = (k, n, dtype, with_bias)
    if key not in _cache:
        rng = np.random.default_rng(k * 7919 + n)
        w = rng.standard_normal((n, k), dtype=np.float32)
        b = rng.standard_normal(n, dtype=np.float32) if with_bias else None
        if dtype == "bfloat16":
            w = ref.f32_to_bf16(w)
        _cache[key] = (gemm.Linear(w, b), ref.Linear(w, b), ref.as_f32(w))
    return _cache[key]


def bf16_round(x):
    return ref.bf16_to_f32(ref.f32_to_bf16(x))


def assert_close(y, expect, scale, rtol):
    err = np.abs(y.astype(np.float64) - expect)
    worst = np.unravel_index(np.argmax(err - rtol * scale), err.shape)
    assert np.all(err <= rtol * scale + 1e-30), (
        f"max error {err[worst]:.3g} at {worst}, allowed {rtol * scale[worst]:.3g}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_reference(dtype, k, n, with_bias):
    lin, reflin, w32 = make(k, n, dtype, with_bias)
    assert (lin.in_features, lin.out_features, lin.dtype) == (k, n, dtype)
    rng = np.random.default_rng(1)
    for m in MS:
        x = rng.standard_normal((m, k), dtype=np.float32)
        scale = np.abs(x).astype(np.float64) @ np.abs(w32).T.astype(np.float64)
        if dtype == "bfloat16":
            xq = bf16_round(x)
            expect_q = reflin.forward(xq).astype(np.float64)
            expect = reflin.forward(x).astype(np.float64)
        else:
            expect_q = expect = reflin.forward(x).astype(np.float64)
        y = lin.forward(x)
        assert y.shape == (m, n) and y.dtype == np.float32
        assert_close(y, expect_q, scale, 1e-4)
        assert_close(y, expect, scale, 2.0**-8)
        out = np.full((m, n), np.nan, dtype=np.float32)
        assert lin.forward(x, out=out) is out
        np.testing.assert_array_equal(out, y)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("k,n", [(896, 1152), (129, 4097), (7, 5)])
def test_small_and_large_m_paths_agree(dtype, k, n):
    if not gemm._dnnl_usable(dtype == "bfloat16"):
        pytest.skip("SKIPPED LOUDLY: oneDNN has no non-reference %s matmul on this CPU "
                    "(cpu_level %d), so every M runs our own kernel" % (dtype, gemm.cpu_level()))
    lin, _, w32 = make(k, n, dtype, True)
    rng = np.random.default_rng(2)
    saved = lin.small_m_max
    try:
        for m in [1, 5, 16, 40]:
            x = rng.standard_normal((m, k), dtype=np.float32)
            lin.small_m_max = 0          # oneDNN matmul
            y_dnnl = lin.forward(x)
            lin.small_m_max = 1 << 30    # streaming kernel
            y_small = lin.forward(x)
            scale = np.abs(x).astype(np.float64) @ np.abs(w32).T.astype(np.float64)
            assert_close(y_small, y_dnnl.astype(np.float64), scale, 1e-5)
            assert "ref" not in lin.impl_info(m)  # a reference oneDNN kernel would be 100x slower
    finally:
        lin.small_m_max = saved


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_thread_counts_give_same_result(threads):
    lin, _, _ = make(129, 4097, "bfloat16", True)
    x = np.random.default_rng(3).standard_normal((7, 129), dtype=np.float32)
    y2 = lin.forward(x)
    old = ops.get_num_threads()
    try:
        ops.set_num_threads(threads)
        assert ops.get_num_threads() == threads
        np.testing.assert_array_equal(lin.forward(x), y2)
        tiny, reflin, _ = make(7, 5, "float32", False)  # one block, idle threads
        xt = x[:, :7].copy()
        np.testing.assert_allclose(tiny.forward(xt), reflin.forward(xt), rtol=1e-5, atol=1e-5)
    finally:
        ops.set_num_threads(old)


@pytest.mark.parametrize("level", [0, 1])
def test_lower_cpu_levels_match(level):
    """The AVX2 (level 0) and AVX-512F (level 1) kernels agree with the best one."""
    if level >= gemm.cpu_level():
        pytest.skip(f"SKIPPED LOUDLY: level {level} is not below this CPU's best (cpu_level {gemm.cpu_level()}), "
                    "so there is nothing better to compare it with; an AVX-512 BF16 machine runs it")
    for dtype in ["bfloat16", "float32"]:
        lin, _, w32 = make(129, 4097, dtype, True)
        x = np.random.default_rng(6).standard_normal((7, 129), dtype=np.float32)
        best = lin.forward(x).astype(np.float64)
        old = gemm._force_cpu_level(level)
        try:
            y = lin.forward(x)
        finally:
            gemm._force_cpu_level(old)
        scale = np.abs(x).astype(np.float64) @ np.abs(w32).T.astype(np.float64)
        assert_close(y, best, scale, 1e-5)


def test_nbytes_and_packing_is_a_copy():
    w = np.random.default_rng(4).standard_normal((13, 4095), dtype=np.float32)
    lin = gemm.Linear(w)
    assert lin.nbytes == 64 * 4096 * 4  # N padded to 64, K to 16 (f32): one packed copy
    x = np.random.default_rng(5).standard_normal((1, 4095), dtype=np.float32)
    y = lin.forward(x)
    w[:] = 0  # the Linear must not alias the caller's array
    np.testing.assert_array_equal(lin.forward(x), y)
    assert gemm.Linear(ref.f32_to_bf16(w)).nbytes == 64 * 4096 * 2  # bf16: K padded to 32


def test_bad_inputs_raise():
    lin, _, _ = make(7, 5, "float32", False)
    with pytest.raises(ValueError):
        lin.forward(np.zeros((2, 6), dtype=np.float32))
    with pytest.raises(ValueError):
        lin.forward(np.zeros((2, 7), dtype=np.float64))
    with pytest.raises(ValueError):
        lin.forward(np.zeros((7, 2), dtype=np.float32).T)
    with pytest.raises(ValueError):
        lin.forward(np.zeros((2, 7), dtype=np.float32), out=np.zeros((2, 6), dtype=np.float32))
    with pytest.raises(ValueError):
        gemm.Linear(np.zeros((5, 7), dtype=np.float32), bias=np.zeros(4, dtype=np.float32))
    assert lin.forward(np.zeros((0, 7), dtype=np.float32)).shape == (0, 5)
