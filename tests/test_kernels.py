"""Every op of backend.cpu against backend.reference (the specification) on odd shapes."""
import numpy as np
import pytest

from numa_runtime._kernels import ops
from numa_runtime.backend import cpu, reference as ref

RNG = np.random.default_rng(1234)
ROWS = [1, 7, 33]
COLS = [1, 7, 33, 4095]


def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def close(a, b, rtol=2e-6, atol=2e-6):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- dtype helpers
def test_bf16_roundtrip_exact():
    x = randn(33, 4095, scale=100.0)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-45, 3.4e38,
                         1.00390625, 1.01171875], np.float32)  # last two: rounding ties
    x.reshape(-1)[:len(specials)] = specials
    b = cpu.f32_to_bf16(x)
    assert b.dtype == np.uint16 and b.shape == x.shape
    np.testing.assert_array_equal(b, ref.f32_to_bf16(x))
    np.testing.assert_array_equal(cpu.bf16_to_f32(b).view(np.uint32),
                                  ref.bf16_to_f32(b).view(np.uint32))


# ----------------------------------------------------------------------------- elementwise
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("h", [7, 4095])
def test_embedding(dtype, h):
    table = randn(50, h)
    if dtype == "bf16":
        table = ref.f32_to_bf16(table)
    ids = RNG.integers(0, 50, 33).astype(np.int64)
    out = np.full((33, h), np.nan, np.float32)
    got = cpu.embedding(ids, table, out)
    assert got is out
    np.testing.assert_array_equal(out, ref.embedding(ids, table, np.empty_like(out)))
    with pytest.raises(IndexError):
        cpu.embedding(np.array([50]), table, out[:1])


@pytest.mark.parametrize("r", ROWS)
@pytest.mark.parametrize("h", COLS)
def test_rms_norm(r, h):
    x, w = randn(r, h, scale=3.0), randn(h)
    out = np.empty_like(x)
    assert cpu.rms_norm(x, w, 1e-6, out) is out
    close(out, ref.rms_norm(x, w, 1e-6, np.empty_like(x)))


def test_rms_norm_strided_rows_in_place():
    buf = randn(7, 200)
    x = buf[:, 10:110]  # row stride 200
    want = ref.rms_norm(x.copy(), np.ones(100, np.float32), 1e-5, np.empty((7, 100), np.float32))
    cpu.rms_norm(x, np.ones(100, np.float32), 1e-5, x)
    close(x, want)


@pytest.mark.parametrize("r", ROWS)
@pytest.mark.parametrize("h", [7, 4095])
def test_add_rms_norm(r, h):
    x, res, w = randn(r, h), randn(r, h), randn(h)
    res2 = res.copy()
    want = ref.add_rms_norm(x, res2, w, 1e-6, np.empty_like(x))
    out = x  # the model normalises in place
    cpu.add_rms_norm(x.copy(), res, w, 1e-6, out)
    close(res, res2, 0, 0)
    close(out, want)


@pytest.mark.parametrize("r", ROWS)
@pytest.mark.parametrize("inter", COLS)
def test_silu_and_mul(r, inter):
    x = randn(r, 2 * inter, scale=6.0)
    x[0, :2] = [-100.0, 100.0] if inter > 1 else [-100.0, 3.0]
    out = np.empty((r, inter), np.float32)
    cpu.silu_and_mul(x, out)
    close(out, ref.silu_and_mul(x, np.empty_like(out)), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("h", COLS)
def test_add_(h):
    a, b = randn(33, h), randn(33, h)
    want = a + b
    assert cpu.add_(a, b) is a
    close(a, want, 0, 0)


# ----------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("hq,hk,d,rot", [(14, 2, 64, 64), (4, 1, 72, 72), (8, 8, 128, 64)])
@pytest.mark.parametrize("t", [1, 7, 33])
def test_rotary_on_fused_qkv_views(hq, hk, d, rot, t):
    qkv = randn(t, (hq + 2 * hk) * d)
    q = qkv[:, :hq * d].reshape(t, hq, d)  # token stride (hq + 2hk) * d
    k = qkv[:, hq * d:(hq + hk) * d].reshape(t, hk, d)
    pos = RNG.integers(0, 500, t).astype(np.int64)
    inv = 1.0 / 10000 ** (np.arange(0, rot, 2) / rot)
    ang = np.arange(512)[:, None] * inv[None]
    cos_sin = np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(np.float32)
    want_q, want_k = q.copy(), k.copy()
    ref.rotary(want_q, want_k, pos, cos_sin)
    v_before = qkv[:, (hq + hk) * d:].copy()
    cpu.rotary(q, k, pos, cos_sin)
    close(q, want_q, 1e-5, 1e-5)
    close(k, want_k, 1e-5, 1e-5)
    np.testing.assert_array_equal(qkv[:, (hq + hk) * d:], v_before)


# ----------------------------------------------------------------------------- KV cache + attention
KV_DTYPES = {"f32": "float32", "bf16": "bfloat16", "int8": "int8"}


def make_cache(nb, bs, hk, d, dtype):
    name = KV_DTYPES[dtype]
    shape = (nb, bs, hk, ref.kv_row_width(d, name))
    return np.zeros(shape, ref.KV_CACHE_DTYPES[name]), np.zeros(shape, ref.KV_CACHE_DTYPES[name])


@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("d", [72, 7])
def test_reshape_and_cache(dtype, d):
    t, hk, bs = 33, 2, 5
    kv = randn(t, 2 * hk, d)
    kv[4, 1] = 0.0  # an all-zero row (int8: scale 0)
    k, v = kv[:, :hk], kv[:, hk:]  # strided views
    slots = RNG.permutation(12 * bs)[:t].astype(np.int64)
    slots[[3, 9]] = -1
    kc, vc = make_cache(12, bs, hk, d, dtype)
    kc2, vc2 = kc.copy(), vc.copy()
    cpu.reshape_and_cache(k, v, kc, vc, slots)
    ref.reshape_and_cache(k, v, kc2, vc2, slots)
    np.testing.assert_array_equal(kc, kc2)
    np.testing.assert_array_equal(vc, vc2)
    with pytest.raises(IndexError):
        cpu.reshape_and_cache(k[:1], v[:1], kc, vc, np.array([12 * bs]))


@pytest.mark.parametrize("d", [1, 7, 33, 64, 4095])
def test_quantize_kv_rows(d):
    """int8 rows: per-row absmax / 127 scale, values within half a step, zero rows exact."""
    x = randn(6, 3, d, scale=3.0)
    x[2, 1] = 0.0
    x[0, 0, 0] = 1e4  # one outlier sets its row's scale only
    rows = ref.quantize_kv(x)                       # [6, 3, d + 4] int8
    assert rows.shape == (6, 3, d + 4) and rows.dtype == np.int8
    scale = np.ascontiguousarray(rows[..., d:]).view(np.float32)[..., 0]
    np.testing.assert_array_equal(scale, (np.abs(x).max(-1) / np.float32(127)).astype(np.float32))
    assert np.abs(rows[..., :d]).max() == 127
    back = ref.dequantize_kv(rows)
    assert np.all(np.abs(back - x) <= scale[..., None] * 0.5001 + 1e-30)
    np.testing.assert_array_equal(back[2, 1], 0.0)
    assert np.abs(back[0, 1] - x[0, 1]).max() < 1e4 / 254 / 10  # the outlier coarsens its row only


@pytest.mark.parametrize("case", [(7, 7, 33, 3, [1, 6], [40, 9]), (4, 2, 64, 16, [1, 30], [700, 0])])
def test_int8_cache_close_to_f32(case):
    """int8 KV changes attention by no more than its rounding: close to f32 KV, not equal."""
    hq, hk, d, bs, new, prefix = case
    q, kc8, vc8, bt, qs, cl = build_batch(hq, hk, d, bs, new, prefix, "int8", fused=False)
    nb = kc8.shape[0]
    kc, vc = make_cache(nb, bs, hk, d, "f32")
    kc[:], vc[:] = ref.dequantize_kv(kc8), ref.dequantize_kv(vc8)
    out8 = cpu.paged_attention(q, kc8, vc8, bt, qs, cl, d ** -0.5, np.zeros(q.shape, np.float32))
    close(out8, cpu.paged_attention(q, kc, vc, bt, qs, cl, d ** -0.5, np.zeros(q.shape, np.float32)),
          1e-5, 2e-6)  # int8 reads are exactly its dequantized rows
    kf, vf = make_cache(nb, bs, hk, d, "f32")
    exact = RNG.standard_normal(kf.shape).astype(np.float32), RNG.standard_normal(vf.shape).astype(np.float32)
    kf[:], vf[:] = exact
    kc8[:], vc8[:] = ref.quantize_kv(exact[0]), ref.quantize_kv(exact[1])
    want = cpu.paged_attention(q, kf, vf, bt, qs, cl, d ** -0.5, np.zeros(q.shape, np.float32))
    out8 = cpu.paged_attention(q, kc8, vc8, bt, qs, cl, d ** -0.5, np.zeros(q.shape, np.float32))
    err = np.abs(out8 - want).max()
    assert 0 < err < 0.03, err


def test_cache_row_width_is_checked():
    """An int8 cache needs D + 4 bytes per row, the others D elements."""
    k = randn(2, 2, 16)
    for dtype, row, need in ((np.int8, 16, 20), (np.uint16, 20, 16), (np.float32, 20, 16)):
        kc = np.zeros((4, 4, 2, row), dtype)
        with pytest.raises(ValueError, match=f"rows of {need}"):
            cpu.reshape_and_cache(k, k, kc, kc.copy(), np.arange(2))
        with pytest.raises(ValueError, match=f"rows of {need}"):
            cpu.paged_attention(k, kc, kc.copy(), np.zeros((1, 1), np.int32), np.array([0, 2]),
                                np.array([2]), 0.25, np.empty_like(k))


def build_batch(hq, hk, d, bs, new, prefix, dtype, fused):
    """A cache holding `prefix[s]` earlier tokens of each sequence plus its `new[s]` ones."""
    need = [(p + n + bs - 1) // bs for p, n in zip(prefix, new)]
    nb = sum(need) + 3
    kc, vc = make_cache(nb, bs, hk, d, dtype)
    ids = RNG.permutation(np.arange(1, nb))
    bt = np.zeros((len(new), max(need) + 2), np.int32)  # padded with 0
    off = 0
    for s, n in enumerate(need):
        bt[s, :n] = ids[off:off + n]
        off += n
    for s, (p, n) in enumerate(zip(prefix, new)):
        pos = np.arange(p + n)
        slots = bt[s, pos // bs].astype(np.int64) * bs + pos % bs
        cpu.reshape_and_cache(randn(p + n, hk, d), randn(p + n, hk, d), kc, vc, slots)
    t = sum(new)
    if fused:
        q = randn(t, (hq + 2 * hk) * d)[:, :hq * d].reshape(t, hq, d)
    else:
        q = randn(t, hq, d)
    query_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    context_lens = (np.array(prefix) + np.array(new)).astype(np.int32)
    return q, kc, vc, bt, query_start, context_lens


ATTN_CASES = [  # hq, hk, d, bs, new tokens, cached prefix
    (14, 2, 64, 16, [7, 1, 33], [0, 20, 5]),     # prefill + decode + prefill over a prefix
    (4, 1, 72, 5, [1, 1, 1], [40, 0, 7]),        # MQA decode, odd head dim and block size
    (8, 8, 128, 16, [100], [37]),                # MHA chunked prefill after a cached prefix
    (14, 2, 128, 5, [1, 9, 0, 1], [130, 0, 3, 64]),  # a sequence with no new tokens
    (4, 2, 256, 16, [65], [0]),
    (6, 3, 80, 16, [1, 2], [3, 90]),
    (7, 7, 33, 3, [1, 6, 1], [41, 9, 0]),        # 7 kv heads, head dim 33, blocks of 3
    (5, 1, 7, 4, [12, 1], [5, 17]),              # head dim 7 (one vector tail only)
]


@pytest.fixture
def f32_tiles():
    """The f32 paths only: a bf16 cache at tile level 2 takes the bf16 path, whose roundings
    of Q and P have their own tolerance (tests/test_attention_bf16.py)."""
    from numa_runtime._kernels import attention
    old = attention._force_paths(level=min(attention.TILE_LEVEL, 1))
    yield
    attention._force_paths(*old)


@pytest.mark.usefixtures("f32_tiles")
@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("case", ATTN_CASES)
def test_paged_attention(case, dtype):
    hq, hk, d, bs, new, prefix = case
    q, kc, vc, bt, qs, cl = build_batch(hq, hk, d, bs, new, prefix, dtype, fused=hq == 14)
    scale = d ** -0.5
    out = np.full(q.shape, 7.0, np.float32)
    assert cpu.paged_attention(q, kc, vc, bt, qs, cl, scale, out) is out
    want = ref.paged_attention(q, kc, vc, bt, qs, cl, scale, np.full(q.shape, 7.0, np.float32))
    close(out, want, 1e-5, 2e-6)


LONG_CASES = [  # long contexts with few items: the key range is split over threads
    (14, 2, 64, 16, [1], [3000]),               # batch-1 decode at 3K context
    (4, 1, 72, 5, [1, 1], [1500, 700]),         # MQA, odd head dim and block size
    (8, 2, 64, 16, [1, 40], [2100, 900]),       # decode beside a prefill chunk
    (2, 2, 128, 16, [1, 0], [520, 3]),          # just over two splits; an idle sequence
    (3, 3, 33, 7, [1, 1], [900, 260]),          # odd head dim and block size, 3 kv heads
]


@pytest.mark.usefixtures("f32_tiles")
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("threads", [1, 2, 7, 16])
@pytest.mark.parametrize("case", LONG_CASES)
def test_paged_attention_split_context(case, threads, dtype):
    """Flash-decoding: any thread count (so any number of splits) gives the reference."""
    hq, hk, d, bs, new, prefix = case
    q, kc, vc, bt, qs, cl = build_batch(hq, hk, d, bs, new, prefix, dtype, fused=False)
    want = ref.paged_attention(q, kc, vc, bt, qs, cl, d ** -0.5, np.zeros(q.shape, np.float32))
    old = ops.get_num_threads()
    try:
        ops.set_num_threads(threads)
        out = cpu.paged_attention(q, kc, vc, bt, qs, cl, d ** -0.5, np.full(q.shape, 7.0, np.float32))
    finally:
        ops.set_num_threads(old)
    close(out, want, 1e-5, 2e-6)


@pytest.mark.parametrize("dtype", ["f32", "int8"])
@pytest.mark.parametrize("threads", [1, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 37, 600])
def test_paged_attention_sliding_window(window, threads, dtype):
    """Each query sees the `window` newest keys up to itself; prefill and decode, long and
    short, split and unsplit."""
    q, kc, vc, bt, qs, cl = build_batch(6, 2, 64, 16, [1, 45, 1, 3], [2000, 30, 3, 700],
                                        dtype, fused=False)
    want = ref.paged_attention(q, kc, vc, bt, qs, cl, 0.125, np.zeros(q.shape, np.float32),
                               window=window)
    old = ops.get_num_threads()
    try:
        ops.set_num_threads(threads)
        out = cpu.paged_attention(q, kc, vc, bt, qs, cl, 0.125,
                                  np.full(q.shape, 7.0, np.float32), window=window)
    finally:
        ops.set_num_threads(old)
    close(out, want, 1e-5, 2e-6)
    full = ref.paged_attention(q, kc, vc, bt, qs, cl, 0.125, np.zeros(q.shape, np.float32))
    assert window >= 2003 or not np.allclose(full, want)  # the window changes the result


@pytest.fixture(params=["direct", "tiled-avx2", "tiled-avx512"])
def attn_path(request):
    """Every f32 attention path: dot products from cache rows, and register-tiled f32 products
    on AVX2 and on AVX-512 where this CPU has it (the bf16 path: tests/test_attention_bf16.py)."""
    from numa_runtime._kernels import attention
    level, tiled_min = {"direct": (1, 1 << 30), "tiled-avx2": (0, 1), "tiled-avx512": (1, 1)}[request.param]
    old = attention._force_paths(level, tiled_min)
    yield request.param
    attention._force_paths(*old)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8"])
@pytest.mark.parametrize("case", ATTN_CASES + LONG_CASES)
def test_paged_attention_every_path(case, dtype, attn_path):
    hq, hk, d, bs, new, prefix = case
    q, kc, vc, bt, qs, cl = build_batch(hq, hk, d, bs, new, prefix, dtype, fused=hq == 14)
    want = ref.paged_attention(q, kc, vc, bt, qs, cl, d ** -0.5, np.zeros(q.shape, np.float32),
                               window=37)
    out = cpu.paged_attention(q, kc, vc, bt, qs, cl, d ** -0.5, np.full(q.shape, 7.0, np.float32),
                              window=37)
    close(out, want, 1e-5, 2e-6)
    want = ref.paged_attention(q, kc, vc, bt, qs, cl, d ** -0.5, np.zeros(q.shape, np.float32))
    out = cpu.paged_attention(q, kc, vc, bt, qs, cl, d ** -0.5, np.full(q.shape, 7.0, np.float32))
    close(out, want, 1e-5, 2e-6)


def test_paged_attention_rejects_short_block_table():
    q, kc, vc, bt, qs, cl = build_batch(4, 1, 64, 16, [1], [40], "f32", False)
    with pytest.raises(ValueError):
        cpu.paged_attention(q, kc, vc, bt[:, :1], qs, cl, 0.125, np.empty_like(q))


# ----------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_sample_stays_in_the_vocabulary_on_a_nan_or_inf_logit(bad):
    """min_p over a row with a NaN or +inf logit (a diverged model): the token is still an id of
    the vocabulary (it read the word before its own buffer, e.g. 2433026 of 151936)."""
    from numa_runtime._kernels import sampling
    for v in (16, 1000, 151936):
        x = np.random.default_rng(0).standard_normal((2, v)).astype(np.float32)
        x[:, 5] = bad
        ids = sampling.sample(x, np.ones(2, np.float32), np.array([0, 3], np.int32), np.ones(2, np.float32),
                              np.array([0.1, 0.1], np.float32), np.array([0.5, 0.9]))
        assert ((0 <= ids) & (ids < v)).all(), (v, ids)


def test_sample_greedy_lowest_index_on_ties():
    logits = randn(33, 4095)
    logits[5, [9, 100, 4000]] = 50.0
    logits[6] = 0.0
    n = len(logits)
    zeros = np.zeros(n, np.float32)
    ids = cpu.sample(logits, zeros, np.zeros(n, np.int32), np.ones(n, np.float32), zeros,
                     RNG.random(n))
    np.testing.assert_array_equal(ids, logits.argmax(1))
    assert ids[5] == 9 and ids[6] == 0


@pytest.mark.parametrize("v", [7, 33, 4095])
def test_sample_matches_reference(v):
    n = 96
    logits = randn(n, v, scale=4.0)
    logits[:, RNG.integers(0, v, 3)] = logits.max()  # exact ties across tokens
    logits[::7] *= 40.0  # peaked rows: p underflows to 0 for most tokens
    temp = RNG.choice([0.0, 0.2, 0.7, 1.0, 2.0], n).astype(np.float32)
    top_k = RNG.choice([0, 0, 1, 3, 40, v, v + 5], n).astype(np.int32)
    top_p = RNG.choice([1.0, 1.0, 0.95, 0.5, 0.1], n).astype(np.float32)
    min_p = RNG.choice([0.0, 0.0, 0.05, 0.3], n).astype(np.float32)
    uniform = RNG.random(n)
    uniform[:4] = [0.0, 0.5, 0.9999999, 1 - 2 ** -53]
    got = cpu.sample(logits, temp, top_k, top_p, min_p, uniform)
    want = ref.sample(logits, temp, top_k, top_p, min_p, uniform)
    np.testing.assert_array_equal(got, want)


def test_min_p_cuts_before_top_p_as_vllm_v1():
    """vLLM V1 applies min_p (a logits processor) before top_k/top_p: p = [0.5, 0.3, 0.1, 0.1] with
    min_p 0.5 keeps [0.5, 0.3] = [0.625, 0.375]; top_p 0.6 of that keeps token 0 alone. The old
    order (top_p over the whole mass first: [0.5, 0.3]; then min_p) sampled token 1 37.5% of the time."""
    n = 2000
    logits = np.tile(np.log(np.array([0.5, 0.3, 0.1, 0.1], np.float32)), (n, 1))
    ones = np.ones(n, np.float32)
    args = (logits, ones, np.zeros(n, np.int32), np.full(n, 0.6, np.float32), np.full(n, 0.5, np.float32),
            (np.arange(n) + 0.5) / n)
    for impl in (cpu, ref):
        assert (impl.sample(*args) == 0).all()
    # min_p alone keeps [0.625, 0.375]; top_p 0.7 of the kept mass then keeps both
    args = args[:3] + (np.full(n, 0.7, np.float32),) + args[4:]
    for impl in (cpu, ref):
        assert abs(np.mean(impl.sample(*args) == 1) - 0.375) < 0.01


@pytest.mark.parametrize("v", [4, 5000])
def test_top_k_keeps_the_tokens_tied_with_the_kth_as_vllm(v):
    """vLLM masks only logits below the k-th: logits [2, 1, 1, 1, ...] with top_k 2 keep tokens
    0-3 (p 0.475 / 0.175 x3), [1, 1, 1, 0, ...] with top_k 1 keep 0-2 uniformly; exactly k were
    kept, by index (token 1 alone, token 0 alone)."""
    n = 6000
    u = (np.arange(n) + 0.5) / n
    ones, full = np.ones(n, np.float32), np.ones(n, np.float32)
    for head, k, want in (([2.0, 1.0, 1.0, 1.0], 2, [0.475, 0.175, 0.175, 0.175]),
                          ([1.0, 1.0, 1.0, 0.0], 1, [1 / 3, 1 / 3, 1 / 3, 0.0])):
        row = np.full(v, -30.0, np.float32)
        row[:4] = head
        logits = np.tile(row, (n, 1))
        args = (logits, ones, np.full(n, k, np.int32), full, np.zeros(n, np.float32), u)
        for impl in (cpu, ref):
            counts = np.bincount(impl.sample(*args), minlength=v)[:4] / n
            np.testing.assert_allclose(counts, want, atol=2e-3, err_msg=impl.__name__)
        # with min_p and top_p on (the other path of the kernel) the ties stay too
        args = (logits, ones, np.full(n, k, np.int32), np.full(n, 0.999, np.float32),
                np.full(n, 1e-3, np.float32), u)
        np.testing.assert_array_equal(cpu.sample(*args), ref.sample(*args))
        assert len(set(cpu.sample(*args))) == (4 if k == 2 else 3)


@pytest.mark.parametrize("n,v", [(1, 1), (7, 33), (3, 4095)])
def test_log_softmax(n, v):
    x = randn(n, v, scale=10.0)
    out = np.empty_like(x)
    cpu.log_softmax(x, out)
    close(out, ref.log_softmax(x, np.empty_like(x)), rtol=1e-6, atol=2e-5)


# ----------------------------------------------------------------------------- DRAM read probe
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [0, 1, 13, 100003])
def test_read_words_sums_every_word(threads, n):
    """bench/limits.py's DRAM probe reads every word: its sum wraps mod 2**64 like numpy's."""
    a = RNG.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    old = ops.get_num_threads()
    ops.set_num_threads(threads)
    try:
        assert ops.read_words(a) == int(a.sum(dtype=np.uint64))
    finally:
        ops.set_num_threads(old)
    with pytest.raises(TypeError, match="uint64"):
        ops.read_words(a.astype(np.int64))


def test_a_cpu_below_x86_64_v3_is_refused_in_one_sentence(monkeypatch):
    """The kernels are built for x86-64-v3: on an older CPU their import stopped the process with
    SIGILL (module init holds AVX instructions). The package refuses first, naming what is missing."""
    import importlib
    import io

    import numa_runtime._kernels as k
    assert k._missing_x86_64_v3() == []  # NOTE: this machine runs the kernels
    monkeypatch.setattr(k, "open", lambda *a, **kw: io.StringIO("processor\t: 0\nflags\t\t: fpu sse sse2 avx\n"),
                        raising=False)
    assert k._missing_x86_64_v3() == ["avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"]
    with pytest.raises(ImportError, match=r"^numa_runtime's kernels need an x86-64-v3 CPU \(AVX2, FMA, F16C, "
                                          r"BMI1/2, LZCNT, MOVBE: .*\); this CPU lacks avx2, fma, f16c, bmi1, "
                                          r"bmi2, abm, movbe\.$"):
        importlib.reload(k)
    monkeypatch.undo()
    importlib.reload(k)
    assert k._missing_x86_64_v3() == []
