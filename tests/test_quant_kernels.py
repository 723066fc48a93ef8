"""numa_runtime._kernels.qgemm.QLinear against the numpy reference that reads the same packed
bytes (numa_runtime.quant.reference.QLinear), for every format, group size and kernel level.

The dequantized f32 weights are the same bit for bit (an f16 scale times a <= 8-bit integer is
exact), so the only difference is the order of the f32 sums: per output element
|y - ref| <= 1e-5 * sum_k |x[m, k]| |W[n, k]|. A wrong nibble, scale, offset, column or row is
an error of the order of the weights themselves, far above that.
"""
import numpy as np
import pytest

from numa_runtime._kernels import qgemm
from numa_runtime.quant.formats import QuantError, QuantFormat, dequantize, quantize
from numa_runtime.quant.packing import pack, unpack
from numa_runtime.quant.reference import QLinear as RefQLinear

FORMATS = [QuantFormat(8, -1, "sym")] + [QuantFormat(8, g, "sym") for g in (32, 64, 128)] + [
    QuantFormat(4, g, k) for g in (32, 64, 128) for k in ("sym", "zero", "min")]
# int5/int6 (GGUF Q5_x, Q6_K at their own widths): a plane of high bits beside the int4 nibbles
FORMATS += [QuantFormat(5, 32, "sym"), QuantFormat(5, 32, "min"), QuantFormat(5, 128, "zero"),
            QuantFormat(6, 16, "sym"), QuantFormat(6, 64, "min")]
# super-block scales (GGUF K-quants as stored: int8 sub-scales and mins under f16 d and dmin)
FORMATS += [QuantFormat(4, 32, "min", ks=256), QuantFormat(4, 64, "sym", ks=256),
            QuantFormat(5, 32, "min", ks=256), QuantFormat(6, 16, "sym", ks=256),
            QuantFormat(4, 16, "sym", ks=256), QuantFormat(4, 16, "min", ks=256), QuantFormat(4, 16, "min")]
# int2/int3 (GGUF Q2_K, Q3_K at their own widths): 2-bit crumbs and, for int3, byte masks of third bits
FORMATS += [QuantFormat(2, 16, "min", ks=256), QuantFormat(3, 16, "sym", ks=256), QuantFormat(2, 32, "min"),
            QuantFormat(3, 64, "sym"), QuantFormat(2, 16, "sym"), QuantFormat(3, 128, "zero")]
# IQ4_NL's non-linear levels (GGUF IQ4_NL, IQ4_XS): a byte shuffle or float permute per code
FORMATS += [QuantFormat(4, 32, "nl"), QuantFormat(4, 128, "nl"), QuantFormat(4, 32, "nl", ks=256)]
MS = [1, 2, 3, 7, 33, 100, 300]
LEVELS = list(range(qgemm.cpu_level() + 1))


def unit(fmt):
    """The k a weight's in_features must be a multiple of (per-row int8: 128 for the shapes)."""
    return fmt.ks or (128 if fmt.group_size == -1 else fmt.group_size)


def shapes(fmt):
    """(K, N): N never a multiple of the 16-column block; K odd where the format allows."""
    g = unit(fmt)
    out = [(g, 1), (3 * g, 37), (5 * g, 100)]
    if fmt.group_size == -1:
        out += [(13, 5), (1001, 17)]
    return out


def make(fmt, k, n, with_bias, seed=0):
    rng = np.random.default_rng(seed + k * 31 + n)
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.1
    b = rng.standard_normal(n, dtype=np.float32) if with_bias else None
    qw = quantize(w, fmt)
    p = pack(qw)
    args = (p, fmt.bits, fmt.kind, qw.group, k, n, b, fmt.ks)
    return qgemm.QLinear(*args), RefQLinear(*args), qw


def check(y, ref, x, w):
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64) + 1e-30
    err = np.abs(y.astype(np.float64) - ref) / scale
    assert err.max() <= 1e-5, f"max relative error {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_qlinear_matches_reference(fmt, level):
    old = qgemm._force_cpu_level(level)
    try:
        rng = np.random.default_rng(1)
        for k, n in shapes(fmt):
            lin, ref, qw = make(fmt, k, n, with_bias=n % 2 == 1)
            assert (lin.in_features, lin.out_features, lin.nbytes) == (k, n, ref.nbytes)
            for m in MS:
                x = rng.standard_normal((m, k), dtype=np.float32)
                out = np.full((m, n), np.nan, np.float32)
                y = lin.forward(x, out=out)
                assert y is out
                check(y, ref.forward(x).astype(np.float64), x, ref.weight)
    finally:
        qgemm._force_cpu_level(old)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_pack_roundtrip_and_dequant_error(fmt):
    """unpack(pack(q)) is q; dequantized weights are within half a step of the originals."""
    k = 256
    rng = np.random.default_rng(2)
    w = rng.standard_normal((19, k), dtype=np.float32)
    qw = quantize(w, fmt)
    back = unpack(pack(qw), fmt, 19, k)
    assert np.array_equal(back.q, qw.q) and np.array_equal(back.scales, qw.scales)
    assert (back.offsets is None) == (qw.offsets is None)
    if qw.offsets is not None:
        assert np.array_equal(back.offsets, qw.offsets)
    g = qw.group
    step = np.repeat(qw.scales.astype(np.float32), g, axis=1)[:, :k]   # [N, K] scale per weight
    err = np.abs(dequantize(qw) - w)
    # half a step of rounding, plus the f16 rounding of the scale/min over <= 15 steps; "nl":
    # half the widest gap between levels (24), or 127 - 113 at the top, over up to 127 steps
    half, steps = (14, 127) if fmt.kind == "nl" else (0.5, 16)
    assert np.all(err <= step * (half + 2 ** -9 * steps) + 1e-6)


def test_nbytes_is_bits_plus_scales():
    lin, _, _ = make(QuantFormat(4, 32, "min"), 256, 32, False)
    assert lin.nbytes == 32 * 256 // 2 + 32 * (256 // 32) * 4        # 4 bits + f16 scale + f16 min
    lin, _, _ = make(QuantFormat(8, 128, "sym"), 256, 32, False)
    assert lin.nbytes == 32 * 256 + 32 * 2 * 2


def test_bad_inputs_are_clear_errors():
    lin, _, _ = make(QuantFormat(4, 32, "sym"), 64, 16, False)
    with pytest.raises(ValueError, match="expects x as C-contiguous float32"):
        lin.forward(np.zeros((2, 63), np.float32))
    with pytest.raises(ValueError, match="out must be"):
        lin.forward(np.zeros((2, 64), np.float32), out=np.zeros((2, 15), np.float32))
    with pytest.raises(ValueError, match="packed weights have"):
        qgemm.QLinear(np.zeros(10, np.uint8), 4, "sym", 32, 64, 16)
    with pytest.raises(QuantError, match="multiple of the group size"):
        quantize(np.zeros((4, 48), np.float32), QuantFormat(4, 32, "sym"))
    with pytest.raises(QuantError, match="f16 range"):
        quantize(np.full((1, 32), 1e9, np.float32), QuantFormat(8, 32, "sym"))


BF16_PATHS = [pytest.param("amx", marks=pytest.mark.skipif(
                  not qgemm.has_amx_bf16(), reason="the AMX-BF16 prefill needs AMX-BF16 and AVX512-BF16, "
                  "which this CPU lacks")),
              pytest.param("panels", marks=pytest.mark.skipif(
                  not qgemm._panel_usable(), reason="the bf16 panel path needs AVX-512 BF16 and a "
                  "non-reference oneDNN bf16 matmul, which this CPU lacks"))]


@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_bf16_prefill_paths_match_bf16_reference(fmt, path, monkeypatch):
    """With prefill_bf16, M >= PANEL_M_MIN rows run on bf16 weights: AMX-BF16 tiles over weights
    dequantized per task where the CPU has them, else oneDNN over bf16 panels. The result is the
    product of the bf16-rounded dequantized weights and bf16-rounded x (exact products, f32
    sums): over several panels and a ragged last one, column and row tails, K past a 32-k step;
    fewer rows keep the exact f32 path, but in a step with prompt rows."""
    from numa_runtime.backend.reference import bf16_to_f32, f32_to_bf16
    monkeypatch.setattr(qgemm, "_PANEL_BYTES", 1 << 14)  # 64-column panels: 100 columns are 2
    old = qgemm._set_amx_bf16(path == "amx")
    try:
        if path == "panels":
            # NOTE: oneDNN's reference matmul would give the right numbers 1000x slower
            assert not qgemm._panels(384, 100).impl_info(qgemm.PANEL_M_MIN, 64).startswith("ref")
        rng = np.random.default_rng(3)
        g = unit(fmt)
        # (8192, 201): on AMX several blocks of K, chunks of rows and groups of column tasks
        cases = [(3 * g, 37), (5 * g, 100), (g, 200), (8192, 201)] + (
            [(1001, 17), (13, 5)] if fmt.group_size == -1 else [])
        for k, n in cases:
            lin, ref, _ = make(fmt, k, n, with_bias=n % 2 == 1)
            lin.prefill_bf16 = True
            w16 = bf16_to_f32(f32_to_bf16(ref.weight)).astype(np.float64)
            for m in (qgemm.PANEL_M_MIN, 100, 300):
                x = rng.standard_normal((m, k), dtype=np.float32)
                y = lin.forward(x, out=np.full((m, n), np.nan, np.float32))
                want = bf16_to_f32(f32_to_bf16(x)).astype(np.float64) @ w16.T
                if ref.bias is not None:
                    want += ref.bias
                check(y, want, x, ref.weight)
                assert not np.array_equal(y, ref.forward(x)), "the bf16 path was not taken"
            x = rng.standard_normal((qgemm.PANEL_M_MIN - 1, k), dtype=np.float32)
            check(lin.forward(x), ref.forward(x).astype(np.float64), x, ref.weight)
            # a step with prompt rows (set_decode_step(2)): the bf16 path however few the rows,
            # so a prompt row's result does not depend on how many rows share its step
            mode = qgemm.set_decode_step(2)
            try:
                for m in (1, 5, qgemm.PANEL_M_MIN - 1):
                    x = rng.standard_normal((m, k), dtype=np.float32)
                    y = lin.forward(x)
                    want = bf16_to_f32(f32_to_bf16(x)).astype(np.float64) @ w16.T
                    if ref.bias is not None:
                        want += ref.bias
                    check(y, want, x, ref.weight)
                    assert not np.array_equal(y, ref.forward(x)), "the bf16 path was not taken"
            finally:
                qgemm.set_decode_step(mode)
    finally:
        qgemm._set_amx_bf16(old)


@pytest.mark.parametrize("path", ["amx", "other"])
@pytest.mark.parametrize("fmt", [QuantFormat(8, 32, "sym"), QuantFormat(4, 64, "min")], ids=str)
def test_forward_silu_is_silu_and_mul_then_forward(fmt, path):
    """forward_silu(x2) = forward(silu_and_mul(x2)) bit for bit: on the AMX-BF16 tiles silu(gate)
    * up is computed (as ops' silu_and_mul computes it) while x is rounded to bf16; on every
    other path (fewer rows, no AMX, f32) the layer runs silu_and_mul first. Row tails, a K
    that is not a multiple of 32, bias."""
    from numa_runtime._kernels import ops
    if path == "amx" and not qgemm.has_amx_bf16():
        pytest.skip("the fused silu needs the AMX-BF16 prefill, which this CPU lacks")
    old = qgemm._set_amx_bf16(path == "amx")
    try:
        rng = np.random.default_rng(5)
        for k, n in ((320, 70), (1024 + 192, 33)):
            lin, _, _ = make(fmt, k, n, with_bias=True)
            for bf16 in (True, False):
                lin.prefill_bf16 = bf16
                for m in (1, qgemm.PANEL_M_MIN, 77):
                    x2 = rng.standard_normal((m, 2 * k), dtype=np.float32) * 3
                    act = np.empty((m, k), np.float32)
                    ops.silu_and_mul(x2, act)
                    assert lin.fuses_silu(m) == (path == "amx" and bf16 and m >= qgemm.PANEL_M_MIN)
                    got = lin.forward_silu(x2, out=np.full((m, n), np.nan, np.float32))
                    np.testing.assert_array_equal(got, lin.forward(act))
        with pytest.raises(ValueError, match="forward_silu expects"):
            lin.forward_silu(np.zeros((4, k), np.float32))
    finally:
        qgemm._set_amx_bf16(old)


@pytest.mark.parametrize("level", LEVELS)
def test_a_nan_activation_reaches_the_output_on_the_int8_path(level):
    """A NaN in a decode row gives that row NaN outputs on int8 activation blocks, as on the exact
    path and in the numpy spec (it came out finite: as -absmax of its block); other rows stay
    finite. Full blocks of 32 and 16 and a ragged per-row int8 block (K = 1001) alike."""
    old = qgemm._force_cpu_level(level)
    try:
        for fmt, k in ((QuantFormat(4, 32, "min"), 256), (QuantFormat(6, 16, "sym"), 64),
                       (QuantFormat(8, -1, "sym"), 1001)):
            lin, _, _ = make(fmt, k, 37, with_bias=True)
            for resid in (False, True):
                lin.act8, lin.act8_residual = True, resid
                x = np.random.default_rng(1).standard_normal((3, k), dtype=np.float32)
                x[1, k - 2] = np.nan
                y = lin.forward(x)
                assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all(), (fmt, resid)
    finally:
        qgemm._force_cpu_level(old)


def test_a_forced_level_below_vnni_runs_no_amx_tiles():
    """AMX comes with VNNI: at a forced level 1 or 0 a bf16-prefill linear takes the panels or
    the exact path, as such a CPU would (bench_isa_context's prefill rows measured AMX tiles)."""
    if not qgemm.has_amx_bf16():
        pytest.skip("no AMX-BF16 here")
    lin, _, _ = make(QuantFormat(4, 32, "min"), 256, 64, with_bias=False)
    lin.prefill_bf16 = True
    old = qgemm._force_cpu_level(qgemm.cpu_level())
    try:
        assert lin.fuses_silu(64)  # the AMX-BF16 tile path
        for level in (1, 0):
            qgemm._force_cpu_level(level)
            assert not lin.fuses_silu(64), level
    finally:
        qgemm._force_cpu_level(old)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_act8_decode_path_matches_reference(fmt, level):
    """With act8 the decode rows (M <= ACT8_M_MAX) are rounded to int8 blocks and run on integer
    dot products (VNNI at level 2, vpmaddubsw at 1 and 0): the result is the dequantized weights
    times the dequantized int8 activations of quantize_activations (exact integer sums, f32
    scaling), at every level; with the bound raised, any row count (8 rows per pass). The int8
    rounding itself moves each y by about 1% of sum |x| |w|, far above the 1e-5 bound, so the
    check tells the paths apart. By default more rows keep the exact path."""
    from numa_runtime.quant.reference import quantize_activations
    old = qgemm._force_cpu_level(level)
    old_m = qgemm._set_act8_m_max(1 << 30)
    try:
        rng = np.random.default_rng(4)
        for k, n in shapes(fmt):
            lin, ref, qw = make(fmt, k, n, with_bias=n % 2 == 1)
            lin.act8 = ref.act8 = True
            for resid in (False, True):
                lin.act8_residual = ref.act8_residual = resid
                for m in (1, 2, 3, 5, 8, 9, 19, 100):
                    x = rng.standard_normal((m, k), dtype=np.float32)
                    x[0, : min(k, 5)] *= 40.0  # an outlier block, as real activations have
                    xq = quantize_activations(x, qw.group, resid)
                    ref.act8 = False
                    want = ref.forward(xq).astype(np.float64)
                    ref.act8 = True
                    check(lin.forward(x), want, xq, ref.weight)
                    if m <= qgemm.ACT8_M_MAX:
                        check(ref.forward(x).astype(np.float64), want, xq, ref.weight)
            lin.act8_residual = ref.act8_residual = False
        qgemm._set_act8_m_max(old_m)
        lin, ref, _ = make(fmt, 3 * unit(fmt), 37, False)
        lin.act8 = ref.act8 = True
        x = rng.standard_normal((qgemm.ACT8_M_MAX + 1, lin.in_features), dtype=np.float32)
        check(lin.forward(x), ref.forward(x).astype(np.float64), x, ref.weight)  # exact path
    finally:
        qgemm._set_act8_m_max(old_m)
        qgemm._force_cpu_level(old)


def test_residual_activations_carry_about_15_bits():
    """act8_residual (the lm_head): x and its rounding residual as two int8 rows. Against the
    exact product, the error is about 100 times smaller than with one int8 row, and the kernel
    shows the same on every level."""
    from numa_runtime.quant.reference import quantize_activations
    rng = np.random.default_rng(9)
    fmt = QuantFormat(8, -1, "sym")
    lin, ref, qw = make(fmt, 896, 640, False)
    x = rng.standard_normal((3, 896), dtype=np.float32)
    x[:, :7] *= 30.0
    exact = x.astype(np.float64) @ ref.weight.T.astype(np.float64)
    one = quantize_activations(x, qw.group)
    two = quantize_activations(x, qw.group, residual=True)
    e1 = np.abs(one - x).max() / np.abs(x).max()
    e2 = np.abs(two - x).max() / np.abs(x).max()
    assert 1e-3 < e1 < 1e-2 and e2 < e1 / 100, (e1, e2)
    lin.act8 = True
    for level in LEVELS:
        old = qgemm._force_cpu_level(level)
        try:
            errs = []
            for resid in (False, True):
                lin.act8_residual = resid
                errs.append(np.abs(lin.forward(x) - exact).max())
            assert errs[1] < errs[0] / 30, (level, errs)
        finally:
            qgemm._force_cpu_level(old)


def test_head_rows_of_a_prompt_step_take_int8_activations():
    """The lm_head (act8_residual) in a step of prompt rows (set_decode_step(2)): up to
    ACT8_M_MAX rows (the prompts' last rows, one a prompt) take the two int8 rows as in decode,
    each row's result the same bits as that row alone and as in a decode step, on every level
    and in the numpy reference; more rows keep the prompt path, and a linear without the flag
    keeps it for any rows."""
    from numa_runtime.quant.reference import set_decode_step as ref_step
    rng = np.random.default_rng(12)
    for fmt in (QuantFormat(4, 32, "sym"), QuantFormat(8, 32, "sym")):
        lin, ref, _ = make(fmt, 384, 200, False)
        x = rng.standard_normal((qgemm.ACT8_M_MAX + 1, 384), dtype=np.float32)
        for level in LEVELS:
            old = qgemm._force_cpu_level(level)
            try:
                for flag in (True, False):
                    lin.act8 = ref.act8 = lin.prefill_bf16 = True
                    lin.act8_residual = ref.act8_residual = flag
                    one = lin.forward(x[:1])  # a few rows outside any step: the decode rule
                    mode, ref_mode = qgemm.set_decode_step(2), ref_step(2)
                    try:
                        few = lin.forward(x[:qgemm.ACT8_M_MAX])
                        many = lin.forward(x)
                        want = ref.forward(x[:qgemm.ACT8_M_MAX])
                    finally:
                        qgemm.set_decode_step(mode)
                        ref_step(ref_mode)
                    if flag:
                        assert np.array_equal(few[:1], one), (fmt, level)
                        check(few, want.astype(np.float64), x[:qgemm.ACT8_M_MAX], ref.weight)
                        assert not np.array_equal(many[:1], one), "more rows took the int8 path"
                    else:
                        assert not np.array_equal(few[:1], one), "a prompt step took the int8 path"
            finally:
                qgemm._force_cpu_level(old)


def test_quantize_activations_blocks():
    """Blocks of 32 within each group, absmax / 127 per block, ties to even, zeros stay zero."""
    from numa_runtime.quant.reference import quantize_activations
    x = np.zeros((1, 96), np.float32)
    x[0, 0], x[0, 1] = 127.0, 0.5        # 0.5 * 127 / 127 = 0.5 -> 0 (ties to even)
    x[0, 32], x[0, 33] = 2.0, 1.0        # its own block: 2 -> 127, 1 -> 63.5 -> 64
    q = quantize_activations(x, 64)      # group 64: blocks [0, 32), [32, 64); [64, 96) all zero
    assert q[0, 0] == 127.0 and q[0, 1] == 0.0
    assert q[0, 32] == 2.0 and q[0, 33] == np.float32(64 * np.float32(2.0 / 127))
    assert not q[0, 64:].any()
    q48 = quantize_activations(np.ones((1, 96), np.float32) * np.arange(96, dtype=np.float32), 48)
    # group 48: blocks [0, 32), [32, 48), [48, 80), [80, 96): block [32, 48) is scaled by 47
    assert q48[0, 47] == 47.0 and q48[0, 31] == 31.0


def test_decode_step_takes_int8_activations_for_a_batch():
    """set_decode_step(True) (a step of decode rows only, set by the model): a decode batch of
    more than ACT8_M_MAX rows takes the int8 path too, like the reference; prefill steps and
    other threads keep the exact path for those rows."""
    import threading
    from numa_runtime.quant.reference import quantize_activations, set_decode_step as ref_step
    fmt = QuantFormat(4, 32, "sym")
    lin, ref, qw = make(fmt, 256, 80, True)
    lin.act8 = ref.act8 = True
    rng = np.random.default_rng(12)
    m = 16
    x = rng.standard_normal((m, 256), dtype=np.float32)
    ref.act8 = False
    exact = ref.forward(x).astype(np.float64)
    int8 = ref.forward(quantize_activations(x, qw.group)).astype(np.float64)
    ref.act8 = True
    assert not qgemm.set_decode_step(True) and not ref_step(True)
    try:
        check(lin.forward(x), int8, x, ref.weight)
        check(ref.forward(x).astype(np.float64), int8, x, ref.weight)
        seen = {}
        t = threading.Thread(target=lambda: seen.update(y=lin.forward(x)))
        t.start()
        t.join()
        check(seen["y"], exact, x, ref.weight)  # the flag is per thread
        big = rng.standard_normal((qgemm.ACT8_DECODE_M_MAX + 1, 256), dtype=np.float32)
        ref.act8 = False
        check(lin.forward(big), ref.forward(big).astype(np.float64), big, ref.weight)
        ref.act8 = True
    finally:
        assert qgemm.set_decode_step(False) and ref_step(False)
    check(lin.forward(x), exact, x, ref.weight)
    assert np.abs(exact - int8).max() > 1e-3


def test_panel_size_grows_with_the_thread_count(monkeypatch):
    """About PANEL_BYTES_PER_THREAD of bf16 panel per thread, 2 MiB at least; a fixed
    _PANEL_BYTES (benchmarks, tests) overrides the rule."""
    from numa_runtime._kernels import ops
    old = ops.get_num_threads()
    try:
        sizes = {}
        for nt in (1, 2, 16, 64):
            ops.set_num_threads(nt)
            sizes[nt] = qgemm._panel_bytes()
        assert sizes == {1: 1 << 21, 2: 1 << 21, 16: 16 * qgemm.PANEL_BYTES_PER_THREAD,
                         64: 64 * qgemm.PANEL_BYTES_PER_THREAD}
        monkeypatch.setattr(qgemm, "_PANEL_BYTES", 1 << 14)
        assert qgemm._panel_bytes() == 1 << 14
    finally:
        ops.set_num_threads(old)


def act8_cases(fmt, seed: int, rows, big_row: int):
    """(linear with int8 activations, its numpy reference, x, x as the kernels round it, (k, n,
    rows, resid)) over the format's shapes, without and with residual rows, at each row count;
    row `big_row` of x has a few large values."""
    from numa_runtime.quant.reference import quantize_activations
    rng = np.random.default_rng(seed)
    for k, n in shapes(fmt):
        lin, ref, qw = make(fmt, k, n, with_bias=n % 2 == 1)
        lin.act8 = True
        for resid in (False, True):
            lin.act8_residual = resid
            for m in rows:
                x = rng.standard_normal((m, k), dtype=np.float32)
                x[big_row, : min(k, 3)] *= 50.0
                yield lin, ref, x, quantize_activations(x, qw.group, resid), (k, n, m, resid)


@pytest.mark.skipif(qgemm.cpu_level() < 2, reason="the row-tile kernel needs AVX-512 VNNI (level 2)")
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_row_tiles_equal_the_decode_kernel_bitwise(fmt):
    """More than ACT8_M_MAX int8 rows run in row tiles (qgemm_q8tile.h) on VNNI (a lean kernel for
    int4 and int8 with f16 group scales, the generic one for the rest), or in AMX-INT8 matrix
    tiles (qgemm_amx.h) where present and the format's blocks are whole: the same exact
    integer block sums and the same f32 operations per output as the decode kernels (lean and
    generic), so each row
    is bitwise what that kernel gives it, tails of tiles and the residual rows included, at 1
    and 2 threads; and all equal the numpy reference on the dequantized int8 activations."""
    from numa_runtime._kernels import ops
    old_m = qgemm._set_act8_m_max(1 << 30)
    old_t = ops.get_num_threads()
    try:
        for lin, ref, x, xq, case in act8_cases(fmt, 21, (9, 12, 13, 16, 24, 33, 37), big_row=1):
            got = []
            for threads in (1, 2):
                ops.set_num_threads(threads)
                for tiles, amx, lean in ((True, True, True), (True, False, True), (True, False, False),
                                         (False, False, True), (False, False, False)):
                    qgemm._set_q8_tiles(tiles)
                    qgemm._set_amx(amx)
                    qgemm._set_q8t_lean(lean)
                    qgemm._set_q8_lean(lean)
                    got.append(lin.forward(x))
            for g in got[1:]:
                assert np.array_equal(got[0], g), case
            check(got[0], ref.forward(xq).astype(np.float64), xq, ref.weight)
    finally:
        qgemm._set_q8_tiles(True)
        qgemm._set_amx(True)
        qgemm._set_q8t_lean(True)
        qgemm._set_q8_lean(True)
        ops.set_num_threads(old_t)
        qgemm._set_act8_m_max(old_m)


@pytest.mark.skipif(qgemm.cpu_level() < 2, reason="the lean decode kernel needs AVX-512 VNNI (level 2)")
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_the_lean_decode_kernel_equals_the_generic_one_bitwise(fmt):
    """Decode rows (up to 8 int8 rows a pass over a weight block) of int4 and int8 with f16 group
    scales run a lean VNNI kernel (qgemm_q8.h qg_q8_lean_mr; QLinear.lean_tiles says which
    formats): the generic kernel's integer block sums (its offset's product as their start) and
    float operations in the same order, so bitwise its outputs, at 1-8 rows, residual rows
    included, at 1 and at 2 threads (k slices); other formats keep the generic kernel. Both
    equal the numpy reference on the dequantized int8 activations."""
    from numa_runtime._kernels import ops
    old_t = ops.get_num_threads()
    try:
        for lin, ref, x, xq, case in act8_cases(fmt, 22, (1, 2, 3, 4, 8), big_row=0):
            for threads in (1, 2):  # NOTE: k slices (and so the sums' order) follow the threads
                ops.set_num_threads(threads)
                got = []
                for lean in (True, False):
                    qgemm._set_q8_lean(lean)
                    got.append(lin.forward(x))
                assert np.array_equal(got[0], got[1]), (*case, threads)
                check(got[0], ref.forward(xq).astype(np.float64), xq, ref.weight)
    finally:
        qgemm._set_q8_lean(True)
        ops.set_num_threads(old_t)


@pytest.mark.parametrize("level", LEVELS)
def test_prefill_act8_modes(level):
    """prefill_act8 (set by the model for prefill_activations="int8"): rows beyond the decode rule
    take int8 blocks (1), or (2) the bf16 panels where usable, else int8 blocks as two rows; 0
    keeps the exact path. Decode rows follow act8 alone. The reference backend does the same
    (without panels)."""
    from numa_runtime.quant.reference import quantize_activations
    old = qgemm._force_cpu_level(level)
    try:
        fmt = QuantFormat(4, 32, "sym")
        lin, ref, qw = make(fmt, 256, 72, True)
        rng = np.random.default_rng(3)
        x = rng.standard_normal((40, 256), dtype=np.float32)
        x[:, 0] *= 60.0
        exact = ref.forward(x).astype(np.float64)  # act8 and prefill_act8 off
        one = ref.forward(quantize_activations(x, qw.group)).astype(np.float64)
        two = ref.forward(quantize_activations(x, qw.group, True)).astype(np.float64)
        assert np.abs(one - exact).max() > 1e-2 and np.abs(two - exact).max() < np.abs(one - exact).max() / 30
        lin.act8 = ref.act8 = False  # prefill_act8 alone
        for mode, want in ((0, exact), (1, one), (2, two)):
            lin.prefill_act8 = ref.prefill_act8 = mode
            check(lin.forward(x), want, x, ref.weight)
            check(ref.forward(x).astype(np.float64), want, x, ref.weight)
        small = x[:qgemm.ACT8_M_MAX]
        check(lin.forward(small), exact[:qgemm.ACT8_M_MAX], small, ref.weight)  # decode rows: act8 off
        if qgemm._panel_usable():
            lin.prefill_bf16 = True
            lin.prefill_act8 = 2  # the panels: bf16 products, not two int8 rows
            y = lin.forward(x)
            lin.prefill_act8 = 0
            assert np.array_equal(y, lin.forward(x))
    finally:
        qgemm._force_cpu_level(old)
