"""The bf16 attention path (bf16 cache, AVX-512 BF16: Q K^T and P V on vdpbf16ps) against the
numpy reference, with a tolerance derived from its two roundings (Q * scale and P to bf16)."""
import os

import numpy as np
import pytest

from test_kernels import ATTN_CASES, LONG_CASES, build_batch

from numa_runtime._kernels import attention, ops
from numa_runtime.backend import cpu, reference as ref

pytestmark = pytest.mark.skipif(attention.TILE_LEVEL < 2, reason="this CPU has no AVX-512 BF16")

U = 2.0 ** -8  # bf16 unit roundoff: 8 significant bits, round to nearest even

BF16_CASES = [  # hq, hk, d, bs, new tokens, cached prefix: groups 1..7, 32, 40; odd D
    (7, 7, 24, 16, [70], [0]),                  # MHA, prefill across two key tiles
    (4, 2, 23, 7, [50, 1], [9, 60]),            # odd D, odd block size, prefill + decode
    (6, 2, 80, 16, [129], [7]),                 # group 3, D 80, three key tiles
    (8, 2, 72, 16, [65], [0]),                  # group 4, D 72
    (5, 1, 128, 16, [33], [200]),               # group 5, chunk after a cached prefix
    (12, 2, 128, 16, [20, 3], [64, 0]),         # group 6, chunk starting on a tile boundary
    (14, 2, 81, 5, [40, 1], [100, 30]),         # group 7, odd D
    (64, 2, 64, 16, [3], [50]),                 # group 32: one row per item
    (40, 1, 17, 16, [2], [90]),                 # group 40: 48 query lanes (32 + 16), odd D
    (14, 2, 64, 16, [300], [0]),                # Qwen2.5-0.5B's heads: a prefill of 5 key tiles
    (16, 2, 128, 16, [90], [45]),               # group 8, D 128, after an unaligned prefix
    (8, 1, 96, 3, [40], [20]),                  # D 96 (3 AMX steps), blocks of 3 (keys copied)
]


@pytest.fixture(params=["amx", "vdpbf16ps"] if attention.HAS_AMX else ["vdpbf16ps"])
def bf16_path(request):
    """Every item of >= 1 query vector on the bf16 path: its products on AMX-BF16 tiles (where
    the CPU has them; heads of D a multiple of 32) and on vdpbf16ps."""
    old = attention._force_paths(level=2, tiled_min=1)
    old_amx = attention._set_amx(request.param == "amx")
    yield request.param
    attention._set_amx(old_amx)
    attention._force_paths(*old)


def run(batch, scale, window, level=None):
    q, kc, vc, bt, qs, cl = batch
    old = attention._force_paths(level=level) if level is not None else None
    try:
        return cpu.paged_attention(q, kc, vc, bt, qs, cl, scale, np.full(q.shape, 7.0, np.float32),
                                   window=window)
    finally:
        if old is not None:
            attention._force_paths(*old)


def check_bf16_path(out, batch, scale, window):
    """out of the bf16 path against the reference run on bf16(Q * scale), its first rounding
    (deterministic). The second rounds each probability to bf16: weight j becomes w_j (1 + e_j)
    with |e_j| <= U, and since the sum l adds the rounded weights, o' - o = sum_j w_j e_j
    (v_j - o) / W' with W' >= W (1 - U), so |o' - o| <= U / (1 - U) * (attn(|V|) + |o|);
    1e-5 more covers f32 sums taken in another order."""
    q, kc, vc, bt, qs, cl = batch
    qr = ref.bf16_to_f32(ref.f32_to_bf16(q * np.float32(scale)))
    fill = lambda: np.full(q.shape, 7.0, np.float32)  # noqa: E731 rows of idle sequences stay
    want = ref.paged_attention(qr, kc, vc, bt, qs, cl, 1.0, fill(), window=window)
    absv = ref.paged_attention(qr, kc, vc & np.uint16(0x7FFF), bt, qs, cl, 1.0, fill(), window=window)
    bound = U / (1 - U) * (absv + np.abs(want)) + 1e-5
    err = np.abs(out - want)
    assert np.all(err <= bound), f"max error {err.max():.3g}, worst error / bound {(err / bound).max():.3g}"


@pytest.mark.parametrize("window", [0, 1, 5, 37, 64])
@pytest.mark.parametrize("case", BF16_CASES + ATTN_CASES)
def test_bf16_path_matches_reference(case, window, bf16_path):
    hq, hk, d, bs, new, prefix = case
    batch = build_batch(hq, hk, d, bs, new, prefix, "bf16", fused=hq == 14)
    out = run(batch, d ** -0.5, window)
    check_bf16_path(out, batch, d ** -0.5, window)
    if window == 0:  # the forced level took effect: the f32 tiles (level 1) round differently
        assert not np.array_equal(out, run(batch, d ** -0.5, window, level=1))
    if window == 0 and bf16_path == "amx" and d % 32 == 0 and max(new) > 1:
        # the AMX tiles ran: vdpbf16ps sums the same products in another order
        attention._set_amx(False)
        try:
            assert not np.array_equal(out, run(batch, d ** -0.5, window))
        finally:
            attention._set_amx(True)


@pytest.mark.parametrize("hq, hk", [(4, 4), (4, 2), (6, 2)])
def test_prompt_rows_take_the_bf16_path_however_few(hq, hk):
    """first_prompt_seq: the rows of the sequences from it on are prompt rows, which take the
    bf16 path of a bf16 cache even alone in their item (fewer query vectors than the tiled
    threshold: one row with 1-3 query heads a kv head), so a prompt's last row gives the
    values it gives inside the whole prompt; without it (a decode row), the f32 dot products."""
    d, bs = 64, 16
    whole = build_batch(hq, hk, d, bs, [1, 9], [30, 40], "bf16", fused=False)
    q, kc, vc, bt, qs, cl = whole
    # the last row of sequence 1 on its own: its 8 earlier rows are in the cache already
    alone = (np.ascontiguousarray(q[[0, 9]]), kc, vc, bt, np.array([0, 1, 2], np.int32), cl)

    def attn(batch, first):
        out = np.full(batch[0].shape, 7.0, np.float32)
        return cpu.paged_attention(*batch, d ** -0.5, out, first_prompt_seq=first)

    ref_whole = attn(whole, 1)
    got = attn(alone, 1)
    assert np.allclose(got[1], ref_whole[9], rtol=0, atol=1e-6)  # the bf16 path, alone or not
    direct = attn(alone, None)  # a decode row: the f32 dot products, not the bf16 roundings
    assert not np.allclose(direct[1], ref_whole[9], rtol=0, atol=1e-6)
    assert np.array_equal(direct[0], got[0])  # sequence 0 is a decode row either way
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="first_prompt_seq"):
            attn(alone, bad)


@pytest.mark.usefixtures("bf16_path")
@pytest.mark.parametrize("threads", [1, 7, 16])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("case", LONG_CASES)
def test_bf16_path_split_context(case, window, threads):
    """Key ranges split over threads (flash-decoding partials from the bf16 path)."""
    hq, hk, d, bs, new, prefix = case
    batch = build_batch(hq, hk, d, bs, new, prefix, "bf16", fused=False)
    old = ops.get_num_threads()
    try:
        ops.set_num_threads(threads)
        out = run(batch, d ** -0.5, window)
    finally:
        ops.set_num_threads(old)
    check_bf16_path(out, batch, d ** -0.5, window)


@pytest.mark.usefixtures("bf16_path")
@pytest.mark.parametrize("window", [0, 9, 70])
@pytest.mark.parametrize("case", BF16_CASES[:7] + [(8, 2, 64, 16, [1, 40], [2100, 900])])
def test_bf16_path_exact_on_hard_attention(case, window):
    """Integer Q and K scaled by 64 make every bf16 rounding exact: distinct scores differ by
    >= 64, so each query averages the V rows of its best visible keys (weight exp(0) = 1, the
    others < e^-64). Any key masked wrongly or missed shows at f32 precision."""
    hq, hk, d, bs, new, prefix = case
    q, kc, vc, bt, qs, cl = build_batch(hq, hk, d, bs, new, prefix, "bf16", fused=False)
    rng = np.random.default_rng(d * 1000 + hq)
    q = rng.integers(-2, 3, q.shape).astype(np.float32)
    kc[:] = ref.f32_to_bf16(rng.integers(-2, 3, kc.shape).astype(np.float32))
    batch = (q, kc, vc, bt, qs, cl)
    want = ref.paged_attention(q, kc, vc, bt, qs, cl, 64.0, np.full(q.shape, 7.0, np.float32),
                               window=window)
    np.testing.assert_allclose(run(batch, 64.0, window), want, rtol=1e-5, atol=1e-5)


def test_bf16_engine_prompt_logprobs_close_to_f32_tiles(tmp_path):
    """A bf16 engine (bf16 weights and KV cache): turning the bf16 path on moves the prompt
    log-probs (prefill: every item on a tiled path) less than the bf16 engine already differs
    from the f32 one, and leaves an f32 engine (f32 cache: never the bf16 path) bit-identical.
    Random llama, 6 q / 2 kv heads of 40, prompts of 150, 70 and 33 tokens (1 to 3 key tiles)."""
    from models import build_model
    from numa_runtime import Engine
    build_model(str(tmp_path), arch="llama", num_attention_heads=6, num_key_value_heads=2,
                hidden_size=96, head_dim=40, seed=4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, n).tolist() for n in (150, 70, 33)]
    lp = {}
    for dtype in ("float32", "bfloat16"):
        eng = Engine(str(tmp_path), dtype=dtype, backend="cpu", kv_cache_memory=1 << 24,
                     max_model_len=256)
        for level in (1, 2):
            old = attention._force_paths(level=level)
            try:
                lp[dtype, level] = np.concatenate([eng.prompt_logprobs(p) for p in prompts])
            finally:
                attention._force_paths(*old)
        eng.close()
    np.testing.assert_array_equal(lp["float32", 2], lp["float32", 1])
    path = np.abs(lp["bfloat16", 2] - lp["bfloat16", 1])
    engine = np.abs(lp["bfloat16", 1] - lp["float32", 1])
    # NOTE: on this model the path moves log-probs by about half of what bf16 weights and KV
    # already do (mean 0.020 vs 0.038 nats; max 0.10 vs 0.27).
    assert path.mean() < 0.75 * engine.mean(), (path.mean(), engine.mean())
    assert path.max() < engine.max(), (path.max(), engine.max())
    assert path.max() > 0  # the bf16 engine did take the bf16 path


def test_empty_inputs_are_no_work():
    """T = 0 (numpy 2.4 gives an empty array strides of 0): nothing written, nothing read; it was
    refused as "not contiguous in its last axis"."""
    from numa_runtime._kernels import attention
    kc = np.zeros((4, 16, 2, 64), np.float32)
    vc = kc.copy()
    empty = np.zeros((0, 2, 64), np.float32)
    attention.reshape_and_cache(empty, empty, kc, vc, np.zeros(0, np.int64))
    out = np.zeros((0, 4, 64), np.float32)
    got = attention.paged_attention(np.zeros((0, 4, 64), np.float32), kc, vc, np.zeros((0, 1), np.int32),
                                    np.zeros(1, np.int32), np.zeros(0, np.int32), 0.1, out)
    assert got.shape == (0, 4, 64) and not kc.any()
