"""qgemm.MoEExperts (qgemm_moe.h): a decode step's (row, expert) pairs in one OpenMP region,
against the same experts run op by op (QLinear.forward on int8 activations, silu_and_mul) and
against numpy on the dequantized packed weights, for several formats, shapes and every kernel
level this CPU can force; and a bf16 MoE engine whose decode steps take it against the same
engine with it switched off (NUMA_RUNTIME_FUSED_DECODE=0), on 1 and 2 ranks."""
import os

import numpy as np
import pytest

from numa_runtime._kernels import ops, qgemm
from numa_runtime.quant.formats import QuantFormat, dequantize, quantize
from numa_runtime.quant.loader import qlinear
from numa_runtime.backend import cpu

LEVELS = list(range(qgemm.cpu_level() + 1))
# (gate_up format, down format, H, I): K-quant-like super-block scales, int8 per row with output
# tails (H = 200: 12.5 column blocks), int5 under int6
CASES = [(QuantFormat(4, 32, "sym"), QuantFormat(4, 32, "sym"), 256, 96),
         (QuantFormat(4, 32, "min", ks=256), QuantFormat(6, 16, "sym", ks=256), 512, 256),
         (QuantFormat(8, -1, "sym"), QuantFormat(8, -1, "sym"), 200, 68),
         (QuantFormat(5, 32, "min"), QuantFormat(8, 32, "sym"), 128, 160)]


def experts(fg, fd, H, I, E, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(E):
        wg = quantize(rng.standard_normal((2 * I, H), dtype=np.float32) * 0.1, fg)
        wd = quantize(rng.standard_normal((H, I), dtype=np.float32) * 0.1, fd)
        out.append((qlinear(cpu, wg, bf16=True), qlinear(cpu, wd, bf16=True), dequantize(wg), dequantize(wd)))
    return out


def pairs(M, E, k, rng):
    top = np.stack([rng.choice(E, k, replace=False) for _ in range(M)])  # NOTE: not in expert order
    coef = rng.uniform(0.1, 1.0, (M, k)).astype(np.float32)
    return np.repeat(np.arange(M), k), top.reshape(-1), coef.reshape(-1)


def op_by_op(exps, x, rows, ex, coef):
    out = np.zeros_like(x)
    o = np.lexsort((ex, rows))  # NOTE: each row's experts in expert order, as the region sums them
    for r, e, c in zip(rows[o], ex[o], coef[o]):
        gu = exps[e][0].forward(np.ascontiguousarray(x[r:r + 1]))
        act = np.empty((1, gu.shape[1] // 2), np.float32)
        ops.silu_and_mul(gu, act)
        y = exps[e][1].forward(act)
        y *= c
        out[r:r + 1] += y
    return out


def reference(exps, x, rows, ex, coef):
    """float64 numpy on the dequantized weights (exact activations)."""
    out = np.zeros(x.shape, np.float64)
    for r, e, c in zip(rows, ex, coef):
        gu = x[r].astype(np.float64) @ exps[e][2].T.astype(np.float64)
        g, u = np.split(gu, 2)
        out[r] += c * ((g / (1 + np.exp(-g)) * u) @ exps[e][3].T.astype(np.float64))
    return out


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("M", [1, 3, 9, 40])
def test_moe_experts_equal_the_op_by_op_path_and_numpy(level, case, M):
    fg, fd, H, I = CASES[case]
    E, k = 6, 3
    exps = experts(fg, fd, H, I, E, seed=case)
    moe = cpu.moe_experts([e[0] for e in exps], [e[1] for e in exps])
    assert moe is not None
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, H), dtype=np.float32)
    rows, ex, coef = pairs(M, E, k, rng)
    old, step = qgemm._force_cpu_level(level), qgemm.set_decode_step(1)
    try:
        assert moe.usable(M) and not moe.usable(moe.MAX_ROWS + 1)
        got = moe.forward(x, ex.reshape(M, k), coef.reshape(M, k), np.full((M, H), np.nan, np.float32))
        want = op_by_op(exps, x, rows, ex, coef)
    finally:
        qgemm._force_cpu_level(old)
        qgemm.set_decode_step(step)
    # NOTE: the same int8 rows and block kernel; only the order of k-slice sums may differ
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    ref = reference(exps, x, rows, ex, coef)
    # NOTE: int8 activations (gate_up's input and down's): within a percent of the exact sums
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()


def test_moe_experts_refuses_what_it_cannot_run():
    """f32-exact experts (an f32 engine's), mixed formats, a bad pair list: None or one error."""
    fmt = QuantFormat(4, 32, "sym")
    exps = experts(fmt, fmt, 128, 64, 3)
    gate_ups, downs = [e[0] for e in exps], [e[1] for e in exps]
    exact = [qlinear(cpu, quantize(np.ones((128, 128), np.float32), fmt), bf16=False) for _ in range(3)]
    assert cpu.moe_experts(exact, downs) is None
    other = qlinear(cpu, quantize(np.ones((128, 128), np.float32), QuantFormat(8, 32, "sym")), bf16=True)
    assert cpu.moe_experts(gate_ups[:2] + [other], downs) is None
    moe = cpu.moe_experts(gate_ups, downs)
    x, out = np.zeros((2, 128), np.float32), np.zeros((2, 128), np.float32)
    with pytest.raises(ValueError, match="top and coef must be"):
        moe.forward(x, np.array([1, 0]), np.ones(2, np.float32), out)
    with pytest.raises(ValueError, match="an expert out of range"):
        moe.forward(x, np.array([[0], [3]]), np.ones((2, 1), np.float32), out)
    step = qgemm.set_decode_step(2)  # a step of prompt rows keeps exact activations: not this path
    try:
        assert not moe.usable(1)
    finally:
        qgemm.set_decode_step(step)


@pytest.mark.parametrize("shape", ["dense-layer-narrower", "experts-only"])
def test_a_bf16_moe_engine_decodes_through_it_on_one_and_two_ranks(tmp_path, monkeypatch, shape):
    """int4 experts in a bf16 engine: decode steps run the attention halves in the FusedDecoder's
    region (whether the model's dense layer is as wide as its experts or not, or it has none) and
    the experts in one region per block (the calls are counted); greedy tokens equal those of the
    same engine op by op, and those of 2 ranks (each its columns of every expert, partial sums
    all-reduced)."""
    from models import build_model
    from test_quant_model import MOE, PROMPT, result, run_mpi

    from numa_runtime import Engine, SamplingParams
    build_model(str(tmp_path), **{**MOE, **({"moe_intermediate_size": 512} if shape == "dense-layer-narrower"
                                            else {"mlp_only_layers": []})})
    sparse = 2 if shape == "dense-layer-narrower" else 3
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens(**kw):
        eng = Engine(str(tmp_path), dtype="bfloat16", quantization="int4", kv_cache_memory=1 << 23,
                     max_model_len=128, **kw)
        calls = []
        # NOTE: the attention halves in the FusedDecoder's region (the sparse MLP halves between its calls)
        assert (eng.runner.model.fused is not None) == (os.environ.get("NUMA_RUNTIME_FUSED_DECODE") != "0")
        for layer in eng.runner.model.layers:
            if layer.moe is not None and layer.moe.fused is not None:
                layer.moe.fused = _Counted(layer.moe.fused, calls)
        try:
            return list(eng.generate([PROMPT], params)[0].token_ids), len(calls)
        finally:
            eng.close()

    fused, n = tokens()
    assert n >= sparse * (24 - 1)  # every sparse layer, every decode step
    monkeypatch.setenv("NUMA_RUNTIME_FUSED_DECODE", "0")
    plain, n0 = tokens()
    assert n0 == 0 and plain == fused
    monkeypatch.delenv("NUMA_RUNTIME_FUSED_DECODE")
    assert result(run_mpi(2, str(tmp_path), "int4", prefill="bf16"))["tokens"] == [fused]


class _Counted:
    def __init__(self, inner, calls):
        self.inner, self.calls, self.MAX_ROWS = inner, calls, inner.MAX_ROWS

    def usable(self, M):
        return self.inner.usable(M)

    def forward(self, *args):
        self.calls.append(1)
        return self.inner.forward(*args)


@pytest.mark.parametrize("M", [1, 5, 300])
def test_a_rank_invariant_linear_gives_the_same_bits_on_any_thread_count(M):
    """The MoE router (replicated on every rank) must pick the same experts on ranks of different
    thread counts (serve reserves a core on rank 0): with rank_invariant the f32 product of one
    16-column block (which 2 threads otherwise split over k) and of a prefill's rows (oneDNN
    otherwise) has the same bits on 1 and 2 threads."""
    from numa_runtime._kernels import gemm
    rng = np.random.default_rng(M)
    w = rng.standard_normal((16, 2048), dtype=np.float32)
    x = rng.standard_normal((M, 2048), dtype=np.float32)
    lin = gemm.Linear(w)
    lin.rank_invariant = True
    old = ops.get_num_threads()
    try:
        ops.set_num_threads(1)
        one = lin.forward(x)
        ops.set_num_threads(2)
        two = lin.forward(x)
    finally:
        ops.set_num_threads(old)
    assert np.array_equal(one, two)
    np.testing.assert_allclose(one, x @ w.T, rtol=1e-4, atol=1e-3)


def test_experts_of_k_quants_split_evenly_over_ranks():
    """An expert's columns split on a K-quant's 256-column super-blocks only where they share out
    within 10%: Qwen3-30B-A3B's 768 (3 super-blocks) go 384 + 384 on 2 ranks (groups of 32 with
    f16 scales), not 512 + 256 (one rank streaming twice the other's bytes); the dense MLP keeps
    its super-block split (its attention load is balanced against it)."""
    from types import SimpleNamespace

    from numa_runtime.quant.loader import LinearFactory
    lf = LinearFactory(None, SimpleNamespace(split_align=256, cut_align=32), "bfloat16")
    assert lf.split_align(768, 2, even=True) == 32
    assert lf.split_align(768, 3, even=True) == 256
    assert lf.split_align(2048, 2, even=True) == 256
    assert lf.split_align(768, 2) == 256
    # AWQ/GPTQ groups cannot be cut: an uneven split on them (2 + 1 groups of 256), never one at 32
    assert LinearFactory(None, SimpleNamespace(split_align=256), "bfloat16").split_align(768, 2, even=True) == 256
