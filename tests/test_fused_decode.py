"""Decode steps of a quantized model in one OpenMP region (models/llama.py _fused_forward over
qgemm.FusedDecoder, cython_kernels/decode_layers.h) against the same steps op by op
(NUMA_RUNTIME_FUSED_DECODE=0): the same kernel functions in the same order, so the logits must
be bitwise equal, on every architecture feature the decoder layer has (q/k/v bias, q/k norms,
sliding windows, GQA), every KV cache type, several thread counts and 2 ranks under mpirun."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from models import build_model
from quant_helpers import decode_logits

from numa_runtime import Engine, SamplingParams
from numa_runtime._kernels import qgemm
from numa_runtime.plan import StepPlan

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384, max_position_embeddings=256)
PROMPT = [1, 17, 42, 99, 5, 200, 13, 7, 300, 64, 3, 250, 11]
# NOTE: mistral's window (16 keys) is shorter than the prompt plus its decode, so decode rows
# attend over a sliding window; qwen3 has q/k norms and a head_dim other than hidden / heads
ARCH_KW = {"llama": {}, "qwen2": {}, "qwen3": dict(head_dim=48), "mistral": dict(sliding_window=16)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for arch, kw in ARCH_KW.items():
        d = str(tmp_path_factory.mktemp(arch))
        build_model(d, arch=arch, **SHAPE, **kw)
        out[arch] = d
    return out


def engine(model_dir, fused: bool, monkeypatch, **kw):
    monkeypatch.setenv("NUMA_RUNTIME_FUSED_DECODE", "1" if fused else "0")
    kw.setdefault("quantization", "int4")
    kw.setdefault("max_model_len", 256)
    e = Engine(model_dir, dtype="bfloat16", kv_cache_memory=1 << 24, **kw)
    assert (e.runner.model.fused is not None) == fused
    return e


def both(model_dir, monkeypatch, **kw):
    return engine(model_dir, True, monkeypatch, **kw), engine(model_dir, False, monkeypatch, **kw)


def batch_prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(n)
    return [rng.integers(3, 384, int(rng.integers(1, 20))).tolist() for _ in range(n)]


def assert_same_batch(f, o, n: int, max_tokens: int) -> None:
    """n sequences at once (decode steps of several rows): the same greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = batch_prompts(n)
    assert [x.token_ids for x in f.generate(prompts, params)] == [x.token_ids for x in o.generate(prompts, params)]


@pytest.mark.parametrize("arch,quantization,kv", [
    ("llama", "int4", "auto"), ("qwen2", "int8", "int8"), ("qwen3", "int4-g64-zero", "auto"),
    ("mistral", "int4-g32-sym", "float32"), ("qwen2", "int8-channel", "bfloat16")])
def test_fused_decode_is_bitwise_op_by_op(models, monkeypatch, arch, quantization, kv):
    """One sequence decoded token by token (every position a decode step), then a batch of
    sequences whose decode steps have several rows."""
    f, o = both(models[arch], monkeypatch, quantization=quantization, kv_cache_dtype=kv)
    try:
        lf, lo = decode_logits(f, PROMPT), decode_logits(o, PROMPT)
        assert np.isfinite(lf).all()
        np.testing.assert_array_equal(lf, lo)
        assert_same_batch(f, o, 5, 12)
    finally:
        f.close()
        o.close()


@pytest.mark.skipif(qgemm.cpu_level() < 2, reason="row tiles need AVX-512 VNNI (level 2)")
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_decode_batches_in_row_tiles(models, monkeypatch, quantization):
    """Decode steps of more than 8 rows run their GEMVs in row tiles (qgemm_q8tile.h) on both
    paths: 20 sequences give the same greedy tokens fused with tiles, op by op with tiles, and
    op by op on the decode kernel alone (tiles off: the same numbers by construction)."""
    f, o = both(models["qwen2"], monkeypatch, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = batch_prompts(20)
    try:
        want = [x.token_ids for x in f.generate(prompts, params)]
        assert [x.token_ids for x in o.generate(prompts, params)] == want
        old = qgemm._set_q8_tiles(False)
        try:
            assert [x.token_ids for x in o.generate(prompts, params)] == want
            assert [x.token_ids for x in f.generate(prompts, params)] == want
        finally:
            qgemm._set_q8_tiles(old)
    finally:
        f.close()
        o.close()


@pytest.mark.skipif(not qgemm.has_amx(), reason="AMX-INT8 tiles need a CPU with AMX-INT8")
@pytest.mark.parametrize("quantization", ["int4", "int8", "int4-g64-min"])
def test_decode_batches_take_amx_tiles_in_the_region(models, monkeypatch, quantization):
    """Where AMX-INT8 is present, the region runs the GEMVs of a decode batch past 8 rows on its
    matrix tiles (qgemm_amx.h), as QLinear.forward does: the region's AMX count rises with AMX
    on and stays with it off, and the greedy tokens equal op by op with the VNNI row tiles (the
    same integers and float operations, so the same bits)."""
    f, o = both(models["llama"], monkeypatch, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = batch_prompts(20)
    try:
        before = qgemm._fused_amx_gemvs()
        want = [x.token_ids for x in f.generate(prompts, params)]
        assert qgemm._fused_amx_gemvs() > before
        old = qgemm._set_amx(False)
        try:
            before = qgemm._fused_amx_gemvs()
            assert [x.token_ids for x in f.generate(prompts, params)] == want
            assert qgemm._fused_amx_gemvs() == before
            assert [x.token_ids for x in o.generate(prompts, params)] == want
        finally:
            qgemm._set_amx(old)
    finally:
        f.close()
        o.close()


@pytest.mark.parametrize("threads,barrier,redundant", [
    (1, "auto", "auto"), (2, "auto", "auto"), (2, "auto", "off"), (3, "own", "auto"), (5, "own", "auto"),
    (5, "own", "on"), (7, "own", "on"), (7, "own", "off"), (8, "own", "auto"), (5, "omp", "auto"),
    (5, "omp", "off")])
def test_fused_decode_equals_op_by_op_at_other_thread_counts(models, monkeypatch, threads, barrier, redundant):
    """The k slices of a GEMV depend on the thread count (split.h): both paths take the same.
    Our dissemination barrier at team sizes that are not powers of two, and with more threads
    than cpus (its waiters then sleep on a futex), and libgomp's barrier, which "auto" takes
    when the team outnumbers the cpus. Steps of one row run redundant ("auto"; "on": every
    step up to 8 rows): every thread computes the norms and int8 roundings itself and the
    residual alternates between two buffers; "off": a barrier after each share of the rows. The
    partial sums of sliced GEMVs are added where they are read: o_proj and down_proj (128
    columns) are sliced at 3, 5 and 7 threads, the qkv projection (384 columns) at 7."""
    old, old_red = qgemm._force_barrier(barrier), qgemm._force_redundant(redundant)
    f, o = both(models["qwen3"], monkeypatch, num_threads=threads)
    try:
        np.testing.assert_array_equal(decode_logits(f, PROMPT), decode_logits(o, PROMPT))
        assert_same_batch(f, o, threads + 2, 6)
        assert_same_batch(f, o, 11, 4)  # steps of 9 to 11 rows: row tiles, never redundant
    finally:
        qgemm._force_barrier(old)
        qgemm._force_redundant(old_red)
        f.close()
        o.close()


@pytest.mark.parametrize("nbytes,threads,redundant", [(0, 2, "auto"), (64, 5, "auto"), (1 << 20, 3, "off")])
def test_barrier_wait_prefetch_leaves_results_alone(models, monkeypatch, nbytes, threads, redundant):
    """The barrier waits prefetch the next GEMV's weights (decode_layers.h nd_pf_arm): off, one
    line, and more than any thread's share; on our barrier (whose waits prefetch) at 2, 3 and 5
    threads (5 may outnumber the cpus: its waits then sleep), steps of one row redundant or not.
    Only a hint: the same logits and tokens as op by op."""
    old = qgemm._set_wait_prefetch(nbytes)
    old_bar = qgemm._force_barrier("own")
    old_red = qgemm._force_redundant(redundant)
    f, o = both(models["qwen2"], monkeypatch, num_threads=threads)
    try:
        np.testing.assert_array_equal(decode_logits(f, PROMPT), decode_logits(o, PROMPT))
        assert_same_batch(f, o, 3, 5)
    finally:
        assert qgemm._set_wait_prefetch(old) == nbytes
        qgemm._force_barrier(old_bar)
        qgemm._force_redundant(old_red)
        f.close()
        o.close()


@pytest.mark.parametrize("arch,threads,redundant,kv", [
    ("qwen3", 7, "auto", "auto"), ("qwen2", 2, "off", "int8"), ("mistral", 5, "on", "float32"),
    ("llama", 3, "auto", "bfloat16")])
def test_attention_items_that_rotate_their_own_rows_equal_a_rope_phase(models, monkeypatch, arch, threads,
                                                                       redundant, kv):
    """Each attention item of the region rotates its kv head's queries itself and the item that
    ends at the newest key writes it into the cache (decode_layers.h nd_item_rope, the default),
    instead of a phase of its own and a barrier: the same logits and batch tokens as with that
    phase, and as op by op, for each KV cache type. qwen3: q/k norms, qkv's k slices at 7
    threads (the items add them up); qwen2: q/k/v bias; mistral: a sliding window. (Items cut
    into key ranges, of which only the last writes the cache:
    test_fused_decode_merges_split_attention_like_op_by_op.)"""
    old_red = qgemm._force_redundant(redundant)
    ids = PROMPT
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = batch_prompts(threads + 1)
    got = []
    try:
        for fused, rope in [(True, True), (True, False), (False, True)]:
            assert qgemm._set_rope_in_items(rope) is True
            e = engine(models[arch], fused, monkeypatch, num_threads=threads, kv_cache_dtype=kv)  # fresh KV blocks
            try:
                got.append((decode_logits(e, ids), [x.token_ids for x in e.generate(prompts, params)]))
            finally:
                e.close()
                qgemm._set_rope_in_items(True)
    finally:
        qgemm._force_redundant(old_red)
    for logits, tokens in got[1:]:
        np.testing.assert_array_equal(logits, got[0][0])
        assert tokens == got[0][1]


@pytest.mark.parametrize("redundant", ["auto", "off"])
def test_fused_decode_merges_split_attention_like_op_by_op(tmp_path, monkeypatch, redundant):
    """Past 256 keys a decode row's attention is cut into key ranges (NR_SPLIT_MIN 128 keys,
    up to 2 x threads / kv heads items) that are merged after the items: redundant steps (one
    row, as here) merge them in each thread's own copy of the attention rows, without the
    barrier after the merges.
    Every position of a 300-token prompt decoded one token at a time, at 3 threads."""
    build_model(str(tmp_path), arch="qwen2", **dict(SHAPE, max_position_embeddings=512))
    ids = np.random.default_rng(3).integers(3, 384, 300).tolist()
    old = qgemm._force_redundant(redundant)
    f, o = both(str(tmp_path), monkeypatch, num_threads=3, max_model_len=512)
    try:
        np.testing.assert_array_equal(decode_logits(f, ids), decode_logits(o, ids))
    finally:
        qgemm._force_redundant(old)
        f.close()
        o.close()


@pytest.mark.parametrize("amx", [True, False])
def test_fused_decode_tiled_attention_is_bitwise_op_by_op(tmp_path, monkeypatch, amx):
    """8 query heads on 2 kv heads of 32: a decode row's item has 4 query vectors, so attention
    runs the tiled bf16 path (on AMX-BF16 tiles where present, else vdpbf16ps) in both the
    fused region and op by op, and both follow attention's AMX switch."""
    from numa_runtime._kernels import attention
    if amx and not attention.HAS_AMX:
        pytest.skip("this CPU has no AMX-BF16 for the attention tiles")
    build_model(str(tmp_path), arch="qwen2", **dict(SHAPE, hidden_size=256, num_attention_heads=8))
    old = attention._set_amx(amx)
    f, o = both(str(tmp_path), monkeypatch, kv_cache_dtype="bfloat16")
    try:
        assert attention.amx_enabled() == amx
        lf = decode_logits(f, PROMPT)
        np.testing.assert_array_equal(lf, decode_logits(o, PROMPT))
        assert_same_batch(f, o, 4, 8)
        if amx:  # the tiles ran: vdpbf16ps sums the same products in another order
            attention._set_amx(False)
            assert not np.array_equal(lf, decode_logits(f, PROMPT))
    finally:
        attention._set_amx(old)
        f.close()
        o.close()


@pytest.mark.parametrize("level", [0, 1])
def test_fused_decode_equals_op_by_op_at_lower_isa_levels(models, monkeypatch, level):
    """The int8 GEMV and attention kernels forced down to AVX2 (0) or AVX-512 without VNNI /
    BF16 (1): both paths take the forced level."""
    from numa_runtime._kernels import attention
    old_q, old_a = qgemm._force_cpu_level(level), attention._force_paths(level=level)
    f, o = both(models["qwen2"], monkeypatch, kv_cache_dtype="bfloat16")
    try:
        np.testing.assert_array_equal(decode_logits(f, PROMPT), decode_logits(o, PROMPT))
        assert_same_batch(f, o, 3, 6)
    finally:
        qgemm._force_cpu_level(old_q)
        attention._force_paths(*old_a)
        f.close()
        o.close()


def test_decode_batches_past_the_fused_bound_run_op_by_op(models, monkeypatch):
    """More decode rows than FusedDecoder.MAX_ROWS take the op-by-op path (prefill rows always
    do); the tokens are those of the op-by-op engine either way."""
    f, o = both(models["qwen2"], monkeypatch, max_num_seqs=80)
    model, decode_rows, fused_rows = f.runner.model, [], []
    forward, fused_forward = model.forward, model._fused_forward

    def spy_forward(plan):
        if plan.num_tokens == plan.num_seqs:
            decode_rows.append(plan.num_tokens)
        return forward(plan)

    def spy_fused(plan, *a):
        fused_rows.append(plan.num_tokens)
        return fused_forward(plan, *a)

    monkeypatch.setattr(model, "forward", spy_forward)
    monkeypatch.setattr(model, "_fused_forward", spy_fused)
    try:
        prompts = batch_prompts(qgemm.FusedDecoder.MAX_ROWS + 6)
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert [x.token_ids for x in f.generate(prompts, params)] == [x.token_ids for x in o.generate(prompts, params)]
        assert max(decode_rows) > qgemm.FusedDecoder.MAX_ROWS
        assert fused_rows == [n for n in decode_rows if n <= qgemm.FusedDecoder.MAX_ROWS]
    finally:
        f.close()
        o.close()


@pytest.mark.parametrize("types", [{"v_proj": "Q8_0"}, {"k_proj": "Q4_1", "v_proj": "Q8_0", "up_proj": "Q8_0"},
                                   {"v_proj": "Q5_0", "up_proj": "Q5_1", "down_proj": "Q6_K"},
                                   {"v_proj": "Q8_0", "down_proj": "Q3_K"}, {"v_proj": "Q8_0", "down_proj": "Q2_K"},
                                   {"v_proj": "IQ4_NL", "up_proj": "IQ4_NL", "down_proj": "IQ4_XS"}])
def test_mixed_format_linears_are_fused_too(models, tmp_path, monkeypatch, types):
    """A GGUF whose q/k/v (or gate/up) differ in format loads them as a ConcatLinear of
    QLinears (each part its own int8 rounding of the input); the fused step runs its parts and
    adds its bias after them as ConcatLinear does: bitwise the op-by-op logits (qwen2: q/k/v
    bias)."""
    from gguf_helpers import write_gguf
    path = str(tmp_path / "mixed.gguf")
    write_gguf(models["qwen2"], path, "Q4_0", arch="qwen2", types=types)
    f, o = both(path, monkeypatch, quantization=None)
    try:
        assert len(f.runner.model.layers[0].qkv_proj.parts) > 1
        np.testing.assert_array_equal(decode_logits(f, PROMPT), decode_logits(o, PROMPT))
        assert_same_batch(f, o, 4, 8)
    finally:
        f.close()
        o.close()


def test_the_fused_path_is_taken_only_where_it_applies(models, monkeypatch):
    """f32 engines keep exact activations, dense linears have no int8 path, and the switch
    turns it off: those run op by op."""
    monkeypatch.setenv("NUMA_RUNTIME_FUSED_DECODE", "1")
    for kw in (dict(dtype="float32", quantization="int4"), dict(dtype="bfloat16")):
        e = Engine(models["llama"], kv_cache_memory=1 << 22, max_model_len=64, **kw)
        try:
            assert e.runner.model.fused is None, kw
        finally:
            e.close()


def test_fused_decoder_refuses_steps_it_cannot_run(models, monkeypatch):
    f = engine(models["llama"], True, monkeypatch)
    try:
        m = f.runner.model
        b = m._buffers(1)
        bt = np.zeros((1, 4), np.int32)
        ok = dict(positions=np.array([3]), slot_mapping=np.array([3]), block_tables=bt,
                  query_start=np.array([0, 1], np.int32), context_lens=np.array([4], np.int32))
        m.fused.run(b, *ok.values(), 0, 2 * len(m.layers))
        bad = [dict(ok, positions=np.array([10 ** 6])), dict(ok, slot_mapping=np.array([10 ** 9])),
               dict(ok, query_start=np.array([0, 2], np.int32)), dict(ok, block_tables=np.full((1, 4), -1, np.int32)),
               dict(ok, context_lens=np.array([1000], np.int32))]
        for args in bad:
            with pytest.raises(ValueError, match="FusedDecoder.run"):
                m.fused.run(b, *args.values(), 0, 2)
        with pytest.raises(ValueError, match="stages"):
            m.fused.run(b, *ok.values(), 0, 2 * len(m.layers) + 1)
    finally:
        f.close()


def decode_plan(ids: list[int], ctx: list[int], logits_rows: list[int], bs: int) -> StepPlan:
    """A decode step of len(ids) sequences: sequence s holds keys [s * 16, s * 16 + ctx[s]) of a
    fresh engine's cache (one block each, block size bs >= 16), its new token the last of them."""
    n = len(ids)
    pos = np.array([c - 1 for c in ctx], np.int64)
    return StepPlan(token_ids=np.asarray(ids, np.int64), positions=pos,
                    slot_mapping=np.array([s * bs + p for s, p in enumerate(pos)], np.int64),
                    query_start=np.arange(n + 1, dtype=np.int32), context_lens=np.asarray(ctx, np.int32),
                    block_tables=np.arange(n, dtype=np.int32)[:, None],
                    logits_indices=np.asarray(logits_rows, np.int64))


@pytest.mark.parametrize("threads", [1, 2, 5, 7])
def test_the_region_runs_the_head_and_its_argmax(models, monkeypatch, threads):
    """On one rank a decode step of up to 4 logits rows (two int8 rows each fit one pass, QG_MR_Q8)
    ends with the final norm, lm_head and each row's argmax in the region: the logits of the
    op-by-op head for any subset of the rows (a row that does not sample gets none), and argmax
    ids equal to numpy's over the logits (at 7 threads the head's GEMV is cut into k slices)."""
    f, o = both(models["qwen2"], monkeypatch, num_threads=threads)
    try:
        fused = f.runner.model.fused
        assert fused.head_fits(1) and fused.head_fits(4) and not fused.head_fits(5)
        bs = f.config.block_size
        for rows in ([0], [1], [0, 2], [0, 1, 2, 3], [3, 1]):
            plan = decode_plan([5, 77, 300, 9], [1, 3, 2, 4], rows, bs)
            lf, lo = f.runner.execute(plan), o.runner.execute(plan)
            np.testing.assert_array_equal(lf, lo)
            assert o.runner.greedy_ids is None  # op by op: the sampler takes the argmax
            np.testing.assert_array_equal(f.runner.greedy_ids, lf.argmax(axis=1))
        plan = decode_plan([5] * 5, [1] * 5, list(range(5)), bs)  # 10 int8 rows: the head after the region
        f.runner.execute(plan)
        assert f.runner.greedy_ids is None
    finally:
        f.close()
        o.close()


def test_region_argmax_ties_and_padding_follow_numpy(models, monkeypatch):
    """Ties go to the lowest index across the threads' column ranges, a NaN counts as the
    largest (numpy), and columns past the vocabulary (padding) are never chosen."""
    f = engine(models["qwen2"], True, monkeypatch, num_threads=5)
    try:
        model, bs = f.runner.model, f.config.block_size
        fused, V = model.fused, model.cfg.vocab_size
        plan = decode_plan([5, 77], [1, 1], [0, 1], bs)
        logits = f.runner.execute(plan)
        top = logits.argmax(axis=1)
        # a vocabulary that ends before the first row's largest logit
        assert fused.set_head(model.norm, model.lm_head, int(top[0]))
        logits = f.runner.execute(plan)
        np.testing.assert_array_equal(f.runner.greedy_ids, logits[:, :top[0]].argmax(axis=1))
        # every logit equal (the final norm's weights 0): index 0 on every row
        assert fused.set_head(np.zeros_like(model.norm), model.lm_head, V)
        logits = f.runner.execute(plan)
        assert (logits == logits[0, 0]).all()
        np.testing.assert_array_equal(f.runner.greedy_ids, [0, 0])
        # every logit NaN: numpy's argmax is the first NaN
        assert fused.set_head(np.full_like(model.norm, np.nan), model.lm_head, V)
        logits = f.runner.execute(plan)
        assert np.isnan(logits).all()
        np.testing.assert_array_equal(f.runner.greedy_ids, np.argmax(logits, axis=1))
        assert not fused.set_head(model.norm, model.lm_head, V + 1000)  # more tokens than columns
    finally:
        f.close()


def test_greedy_rows_whose_logits_change_do_not_take_the_region_argmax(models, monkeypatch):
    """logit_bias, repetition penalties and min_tokens change a greedy row's logits after the
    region computed its argmax: the sampler then takes the argmax of the changed row. The op-by-op
    engine (which never has a region argmax) gives the same tokens."""
    f, o = both(models["llama"], monkeypatch)
    try:
        plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        base = f.generate(PROMPT, plain)[0].outputs[0].token_ids
        forced = next(t for t in range(3, 384) if t not in base)
        for sp in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={forced: 100.0}),
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.8),
                   SamplingParams(temperature=0, max_tokens=8, min_tokens=8, stop_token_ids=[base[1]])):
            got = f.generate(PROMPT, sp)[0].outputs[0].token_ids
            assert got == o.generate(PROMPT, sp)[0].outputs[0].token_ids, sp
            if sp.logit_bias:
                assert got == [forced] * 8
    finally:
        f.close()
        o.close()


def run_mpi(n, model_dir, fused: bool, prompts, quantization="int4-g32-min"):
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1",
               NUMA_RUNTIME_FUSED_DECODE="1" if fused else "0", NUMA_RUNTIME_LOG_LEVEL="INFO",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = ["mpirun", "-np", str(n), sys.executable, os.path.join(HERE, "mpi", "fused_decode.py"),
           model_dir, quantization, json.dumps(prompts)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(line) == 1, p.stdout[-3000:]
    return dict(json.loads(line[0][7:]), log=p.stderr)


def test_two_ranks_fused_equal_op_by_op(models):
    """Under tensor parallelism each half layer is one region and o / delta are all-reduced
    between them: the tokens of the op-by-op steps (which all-reduce the same sums)."""
    prompts = [PROMPT, PROMPT[:4], PROMPT[5:]]
    f, o = run_mpi(2, models["qwen2"], True, prompts), run_mpi(2, models["qwen2"], False, prompts)
    assert f["world"] == 2 and f["fused"] and not o["fused"]
    assert f["tokens"] == o["tokens"]


def test_per_channel_int8_splits_the_mlp_on_its_packing_unit(tmp_path):
    """'int8-channel' on 2 ranks of 5 query heads over 1 kv head: the MLP's 352 columns are
    split by attention load, which cut them 139 + 213 before, so that both ranks' down_proj
    slices were zero-padded to the int8 packing unit (4) and both ranks decoded op by op while
    rank 0 logged the region. The split now keeps to multiples of 4: every rank runs the region
    (no rank logs op by op), with the tokens of the op-by-op steps, and a rank that does run op
    by op says which linear keeps it there."""
    build_model(str(tmp_path), arch="qwen3", hidden_size=160, num_attention_heads=5, num_key_value_heads=1,
                head_dim=112, intermediate_size=352, vocab_size=397, max_position_embeddings=256)
    prompts = [PROMPT, PROMPT[3:]]
    f = run_mpi(2, str(tmp_path), True, prompts, "int8-channel")
    o = run_mpi(2, str(tmp_path), False, prompts, "int8-channel")
    assert f["world"] == 2 and f["fused"] and "op by op" not in f["log"], f["log"][-3000:]
    assert "one OpenMP region per half layer" in f["log"]
    assert f["tokens"] == o["tokens"]


def test_a_model_the_region_cannot_take_says_which_linear(tmp_path, monkeypatch, caplog):
    """An MLP of 202 columns in 'int8-channel' packs down_proj's input to 204 (units of 4),
    which the region does not take: the engine decodes op by op and its log names the linear."""
    build_model(str(tmp_path), arch="llama", hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                head_dim=64, intermediate_size=202, vocab_size=397, max_position_embeddings=256)
    caplog.set_level("INFO", logger="numa_runtime")
    monkeypatch.setenv("NUMA_RUNTIME_FUSED_DECODE", "1")
    e = Engine(str(tmp_path), dtype="bfloat16", quantization="int8-channel", kv_cache_memory=1 << 22,
               max_model_len=64)
    try:
        assert e.runner.model.fused is None
        assert ("decode steps: op by op (layer 0 mlp.down_proj has 202 input features on this rank, padded to "
                "204 for its packing)") in caplog.text
        assert "OpenMP region" not in caplog.text
    finally:
        e.close()
