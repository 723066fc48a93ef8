"""Microbenchmark of every backend.cpu op against backend.reference and torch (where torch
has the op), on Qwen2.5-0.5B shapes (H 896, 14 q heads / 2 kv heads of 64, I 4864, V 151936).

    python bench/bench_kernels.py [--quick] [--threads N]
    python bench/bench_kernels.py --attention [--threads N]

Prints one markdown table; times are the best of repeated calls, in microseconds.
--attention times paged attention's paths (dot products straight from the cache rows,
register-tiled f32 products over transposed key tiles, bf16 dot products on AVX-512 BF16, and
those products on AMX-BF16 tiles) on batch-1 decode and prefill, short and long.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from numa_runtime.backend import cpu, reference as ref  # noqa: E402

H, HQ, HK, D, INTER, VOCAB, BS = 896, 14, 2, 64, 4864, 151936, 16
RNG = np.random.default_rng(0)
warnings.filterwarnings("ignore", category=RuntimeWarning)  # the reference's exp overflows


def T_():
    import torch
    return torch


def F_():
    import torch.nn.functional as F
    return F


def randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def best_us(fn, min_time: float) -> float:
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 3 or (spent < min_time and reps < 100):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best * 1e6


def paged_batch(new, prefix, dtype):
    """q [T, HQ, D], caches, block tables for sequences with `prefix` cached + `new` tokens."""
    need = [(p + n + BS - 1) // BS for p, n in zip(prefix, new)]
    nb = sum(need) + 1
    kv = {"f32": "float32", "bf16": "bfloat16", "int8": "int8"}[dtype]
    cache = lambda: np.zeros((nb, BS, HK, ref.kv_row_width(D, kv)), ref.KV_CACHE_DTYPES[kv])  # noqa: E731
    kc, vc = cache(), cache()
    bt = np.zeros((len(new), max(need)), np.int32)
    ids = RNG.permutation(np.arange(1, nb)).astype(np.int32)
    off = 0
    for s, n in enumerate(need):
        bt[s, :n] = ids[off:off + n]
        off += n
        pos = np.arange(prefix[s] + new[s])
        slots = bt[s, pos // BS].astype(np.int64) * BS + pos % BS
        cpu.reshape_and_cache(randn(len(pos), HK, D), randn(len(pos), HK, D), kc, vc, slots)
    qs = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    cl = (np.array(prefix) + np.array(new)).astype(np.int32)
    return randn(sum(new), HQ, D), kc, vc, bt, qs, cl


def torch_sdpa(q, kc, vc, bt, qs, cl):  # called in the torch-only child process
    """torch SDPA on the same batch, K/V already gathered to dense [1, HK, ctx, D] per
    sequence (so it is timed without the paging our kernel pays for)."""
    import torch
    import torch.nn.functional as F
    calls = []
    for s in range(len(cl)):
        n, ctx = int(qs[s + 1] - qs[s]), int(cl[s])
        blocks = bt[s, :(ctx + BS - 1) // BS]
        k = ref.kv_as_f32(kc[blocks]).reshape(-1, HK, D)[:ctx]
        v = ref.kv_as_f32(vc[blocks]).reshape(-1, HK, D)[:ctx]
        qt = torch.from_numpy(q[qs[s]:qs[s + 1]]).transpose(0, 1)[None]
        kt = torch.from_numpy(np.ascontiguousarray(k.transpose(1, 0, 2)))[None]
        vt = torch.from_numpy(np.ascontiguousarray(v.transpose(1, 0, 2)))[None]
        # causal with a cached prefix: query i sees keys 0..ctx-n+i
        mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n)
        calls.append((qt, kt, vt, None if n == 1 else mask))

    def run():
        for qt, kt, vt, m in calls:
            F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m, enable_gqa=True)
    return run


def cases(quick: bool):
    """(op, shape, cpu fn, reference fn, torch factory or None); a torch factory returns the
    torch callable and is only called in the torch-only child process."""
    T = 128 if quick else 512
    x, res, w = randn(T, H), randn(T, H), randn(H)
    out = np.empty_like(x)
    big = randn(1 << 20 if quick else 1 << 22)
    big16 = ref.f32_to_bf16(big)
    yield ("f32_to_bf16", f"[{big.size}]", lambda: cpu.f32_to_bf16(big),
           lambda: ref.f32_to_bf16(big), lambda: lambda: T_().from_numpy(big).to(T_().bfloat16))
    yield ("bf16_to_f32", f"[{big.size}]", lambda: cpu.bf16_to_f32(big16),
           lambda: ref.bf16_to_f32(big16), None)
    table = ref.f32_to_bf16(randn(VOCAB // 8, H))
    ids = RNG.integers(0, len(table), T)
    yield ("embedding bf16", f"[{T}] of {table.shape}", lambda: cpu.embedding(ids, table, out),
           lambda: ref.embedding(ids, table, out), None)
    for rows in (1, T):
        yield ("rms_norm", f"[{rows}, {H}]", lambda r=rows: cpu.rms_norm(x[:r], w, 1e-6, out[:r]),
               lambda r=rows: ref.rms_norm(x[:r], w, 1e-6, out[:r]),
               lambda r=rows: lambda: F_().rms_norm(T_().from_numpy(x[:r]), (H,), T_().from_numpy(w), 1e-6))
    yield ("add_rms_norm", f"[{T}, {H}]", lambda: cpu.add_rms_norm(x, res, w, 1e-6, out),
           lambda: ref.add_rms_norm(x, res, w, 1e-6, out), None)
    gu, act = randn(T, 2 * INTER), np.empty((T, INTER), np.float32)
    yield ("silu_and_mul", f"[{T}, {2 * INTER}]", lambda: cpu.silu_and_mul(gu, act),
           lambda: ref.silu_and_mul(gu, act),
           lambda: lambda: F_().silu(T_().from_numpy(gu[:, :INTER])) * T_().from_numpy(gu[:, INTER:]))
    yield ("add_", f"[{T}, {H}]", lambda: cpu.add_(res, x), lambda: ref.add_(res, x),
           lambda: lambda: T_().from_numpy(res).add_(T_().from_numpy(x)))
    q, k = randn(T, HQ, D), randn(T, HK, D)
    pos = np.arange(T, dtype=np.int64)
    cs = np.concatenate([np.cos(pos[:, None] * 1e-3 + np.zeros(D // 2)),
                         np.sin(pos[:, None] * 1e-3 + np.zeros(D // 2))], 1).astype(np.float32)
    yield ("rotary", f"q [{T}, {HQ}, {D}]", lambda: cpu.rotary(q, k, pos, cs),
           lambda: ref.rotary(q, k, pos, cs), None)
    slots = np.arange(T, dtype=np.int64)
    for kv in ("bfloat16", "int8"):
        kc = np.zeros((T // BS + 1, BS, HK, ref.kv_row_width(D, kv)), ref.KV_CACHE_DTYPES[kv])
        vc = kc.copy()
        yield (f"reshape_and_cache {kv}", f"[{T}, {HK}, {D}]",
               lambda kc=kc, vc=vc: cpu.reshape_and_cache(k, k, kc, vc, slots),
               lambda kc=kc, vc=vc: ref.reshape_and_cache(k, k, kc, vc, slots), None)
    n_pre = 512 if quick else 2048
    for dtype in ("f32", "bf16", "int8"):
        b = paged_batch([n_pre], [0], dtype)
        o = np.empty_like(b[0])
        yield (f"attention prefill {dtype}", f"1 x {n_pre} new",
               lambda b=b, o=o: cpu.paged_attention(*b, D ** -0.5, o),
               lambda b=b, o=o: ref.paged_attention(*b, D ** -0.5, o), lambda b=b: torch_sdpa(*b))
    n_seq, ctx = (8, 512) if quick else (16, 2048)
    for dtype in ("f32", "bf16", "int8"):
        b = paged_batch([1] * n_seq, [ctx - 1] * n_seq, dtype)
        o = np.empty_like(b[0])
        yield (f"attention decode {dtype}", f"{n_seq} x 1 new, ctx {ctx}",
               lambda b=b, o=o: cpu.paged_attention(*b, D ** -0.5, o),
               lambda b=b, o=o: ref.paged_attention(*b, D ** -0.5, o), lambda b=b: torch_sdpa(*b))
    n = 4 if quick else 16
    logits = randn(n, VOCAB) * 3
    ones, zeros = np.ones(n, np.float32), np.zeros(n, np.float32)
    u = RNG.random(n)
    for name, k_, p_ in (("top_k 50", 50, 1.0), ("top_p 0.9", 0, 0.9), ("plain", 0, 1.0)):
        kk, pp = np.full(n, k_, np.int32), np.full(n, p_, np.float32)
        yield (f"sample {name}", f"[{n}, {VOCAB}]",
               lambda kk=kk, pp=pp: cpu.sample(logits, ones, kk, pp, zeros, u),
               lambda kk=kk, pp=pp: ref.sample(logits, ones, kk, pp, zeros, u),
               (lambda: lambda: T_().multinomial(T_().softmax(
                   T_().from_numpy(logits).topk(50).values, -1), 1)) if k_ else None)
    lo = np.empty_like(logits)
    yield ("log_softmax", f"[{n}, {VOCAB}]", lambda: cpu.log_softmax(logits, lo),
           lambda: ref.log_softmax(logits, lo),
           lambda: lambda: T_().log_softmax(T_().from_numpy(logits), -1))


def attention_paths(min_time: float) -> None:
    """Paged attention, bf16 cache: each case on the direct path, the f32 tiled path in AVX2
    (tile level 0, what AVX2-only CPUs run) and, where the CPU has AVX-512, in AVX-512 (level 1),
    where it has AVX-512 BF16 the bf16 tiled path on vdpbf16ps (level 2), and where it has
    AMX-BF16 that path's products on AMX tiles (the default there)."""
    from numa_runtime._kernels import attention
    avx512, bf16, amx = attention.TILE_LEVEL >= 1, attention.TILE_LEVEL >= 2, attention.HAS_AMX
    print("| case | direct us | tiled f32 AVX2 us | tiled f32 AVX-512 us | tiled bf16 us | tiled bf16 on AMX us "
          "| default path |\n| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, new, prefix in [("decode, ctx 512", [1], [511]), ("decode, ctx 8192", [1], [8191]),
                              ("decode, ctx 16000", [1], [15999]), ("decode 16 seqs, ctx 2048", [1] * 16, [2047] * 16),
                              ("prefill 512", [512], [0]), ("prefill chunk 2048 after 6144", [2048], [6144])]:
        b = paged_batch(new, prefix, "bf16")
        o = np.empty_like(b[0])
        times = []
        paths = [(1, 1 << 30, False), (0, 1, False)] + [(1, 1, False)] * avx512 + [(2, 1, False)] * bf16 + [
            (2, 1, True)] * amx
        for level, tiled_min, on in paths:
            old = attention._force_paths(level=min(level, attention.TILE_LEVEL), tiled_min=tiled_min)
            old_amx = attention._set_amx(on)
            times.append(best_us(lambda: cpu.paged_attention(*b, D ** -0.5, o), min_time))
            attention._set_amx(old_amx)
            attention._force_paths(*old)
        group = HQ // HK
        rows = 1 if new[0] == 1 else max(1, 32 // group)
        default = ("direct" if rows * group < attention.TILED_MIN_QUERIES else
                   "tiled bf16 on AMX" if amx else "tiled bf16" if bf16 else
                   "tiled f32 AVX-512" if avx512 else "tiled f32 AVX2")
        cols = " | ".join(f"{t:.1f}" for t in times) + " | -" * (5 - len(times))
        print(f"| {name} | {cols} | {default} |", flush=True)


def torch_times(quick: bool, threads: int) -> dict:
    """Torch timings from a child process: torch ships its own OpenMP runtime, whose spinning
    threads would slow ours (and ours its) if both lived in one process."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-only",
                          "--threads", str(threads)] + (["--quick"] if quick else []),
                         capture_output=True, text=True)
    if out.returncode:
        print("torch timings failed:", out.stderr.strip().splitlines()[-1:], file=sys.stderr)
        return {}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes, shorter timing")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--attention", action="store_true", help="attention paths only")
    args = ap.parse_args()
    min_time = 0.05 if args.quick else 0.3
    if args.torch_only:
        T_().set_num_threads(args.threads)
        print(json.dumps({f"{op} {shape}": best_us(make(), min_time)
                          for op, shape, _, _, make in cases(args.quick) if make}))
        return
    cpu.set_num_threads(args.threads)
    if args.attention:
        print(f"threads {args.threads}; best of repeats, microseconds\n")
        attention_paths(min_time)
        return
    rows = [(op, shape, best_us(fn, min_time), best_us(ref_fn, min_time / 3))
            for op, shape, fn, ref_fn, _ in cases(args.quick)]
    tt = torch_times(args.quick, args.threads)
    print(f"threads {args.threads}; best of repeats, microseconds\n")
    print("| op | shape | cpu us | reference us | torch us | x reference | x torch |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for op, shape, t, tr in rows:
        tq = tt.get(f"{op} {shape}")
        print(f"| {op} | {shape} | {t:.1f} | {tr:.1f} | {'-' if tq is None else f'{tq:.1f}'} "
              f"| {tr / t:.1f} | {'-' if tq is None else f'{tq / t:.2f}'} |")


if __name__ == "__main__":
    main()
