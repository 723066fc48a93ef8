"""Decode and prefill on every kernel ISA level, and at long context (issue: older x86 servers
and long conversations).

    python bench/bench_isa_context.py                      # Qwen2.5-0.5B shape, bf16, all cores
    python bench/bench_isa_context.py --levels 2 1 0 --contexts 512 8192 16000
    python bench/bench_isa_context.py --quantization int4 --contexts 512   # quantized at load
    python bench/bench_isa_context.py --quantization int4 --lm-head-quantization none   # bf16 lm_head

Part 1, ISA levels: each level runs in its own process with our kernels capped at that level
(gemm._force_cpu_level, attention._force_paths) and oneDNN capped at the matching ISA
(ONEDNN_MAX_CPU_ISA: 2 -> AVX512_CORE_AMX, 1 -> AVX512_CORE, 0 -> AVX2), so a machine with
AVX512_BF16 stands in for Skylake/Cascade Lake (level 1) and Zen 1-3/Haswell (level 0). Batch-1
decode is reported as tok/s and as a fraction of the DRAM limit (bench/limits.py probe /
weight bytes read per token: the packed linears of the run, so a quantized format counts the
bytes it streams). Each level's process also pairs every timed 512-token decode with a DRAM
probe right after it (--rounds pairs; on a shared machine the bandwidth drifts between
processes): "of adjacent probe" is the median over the pairs of decode bytes/s / probe.
Part 2, long context at the best level: prefill of C tokens (tok/s) and batch-1 decode right
after it, for each C in --contexts.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import CACHE, QWEN05B, add_model_args, build_once, resolve_model, write_report  # noqa: E402

ONEDNN_ISA = {2: "AVX512_CORE_AMX", 1: "AVX512_CORE", 0: "AVX2"}
LONG_SHAPE_LEN = 32768


def child(args) -> dict:
    """One process: build the Engine at one kernel level, time prefill and decode."""
    import numpy as np
    from numa_runtime import Engine, SamplingParams
    from numa_runtime._kernels import attention, gemm, qgemm
    gemm._force_cpu_level(args.level)
    # NOTE: level 2 stands for AVX-512 with BF16 and VNNI, 1 for AVX-512 without either (Skylake)
    qgemm._force_cpu_level(args.level)
    attention._force_paths(level=args.level)
    if args.level < 2:  # NOTE: a CPU of that level has no AMX: its crossovers, not this host's
        gemm.SMALL_M_MAX = 16
        qgemm._set_amx(False)
        qgemm._set_amx_bf16(False)
        attention._set_amx(False)
    eng = Engine(args.model_dir, dtype=args.dtype, num_threads=args.threads,
                 max_model_len=max(args.contexts) + args.decode_tokens + 8,
                 enable_prefix_caching=False, max_num_batched_tokens=args.chunk,
                 quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                 lm_head_quantization=None if args.lm_head_quantization == "none" else args.lm_head_quantization)
    from bench.limits import dram_read_gbps
    rng = np.random.default_rng(0)
    vocab = eng.model_config.vocab_size
    # NOTE: each module clamps a forced level to what this CPU has: say so, not measure it silently
    levels = {"gemm": gemm.cpu_level(), "qgemm": qgemm.cpu_level(), "attention": attention._force_paths()[0]}
    short = {k: v for k, v in levels.items() if v != args.level}
    if short:
        print(f"bench_isa_context.py: level {args.level} asked, but this CPU runs "
              + ", ".join(f"{k} at level {v}" for k, v in short.items()) + ".", file=sys.stderr, flush=True)
    out = {"level": gemm.cpu_level(), "levels": levels, "contexts": {}, "pairs": [],
           "bytes_per_token": sum(getattr(x, "nbytes", 0) for x in eng.runner.model._linears())}
    for ctx in args.contexts:
        # warm-up request of the same length (oneDNN primitives, page faults), then the timed one
        # (at 512: --rounds timed ones, each followed by a DRAM probe)
        rounds = 1 + (max(1, args.rounds) if ctx == 512 else 1)
        best = None
        for r in range(rounds):
            eng.add_request(rng.integers(3, vocab, ctx).tolist(),
                            SamplingParams(temperature=0, max_tokens=args.decode_tokens + 1, ignore_eos=True))
            t0 = time.perf_counter()
            steps, n = [], 0
            while eng.has_unfinished_requests():
                outs = eng.step()
                n = max([n] + [len(o.token_ids) for o in outs])  # tokens so far (bursts bring several)
                steps.append((time.perf_counter(), n))
            # the step that emits the first token ends the prefill; the later ones decode
            first = next(i for i, (_, k) in enumerate(steps) if k > 0)
            t_first, t_end = steps[first][0], steps[-1][0]
            res = {"prefill_tok_s": ctx / (t_first - t0),
                   "decode_tok_s": (steps[-1][1] - steps[first][1]) / (t_end - t_first)}
            if r == 0:
                continue  # the warm-up
            if best is None or res["decode_tok_s"] > best["decode_tok_s"]:
                best = res
            if ctx == 512:
                probe = dram_read_gbps(args.threads or None, repeats=3)
                out["pairs"].append({"decode_tok_s": res["decode_tok_s"], "dram_read_gbps": probe,
                                     "of_probe": res["decode_tok_s"] * out["bytes_per_token"] / (probe * 1e9)})
        out["contexts"][ctx] = best
    return out


def run_level(args, level: int, contexts: list[int]) -> dict:
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=ONEDNN_ISA[level], PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model-dir", args.model_dir,
           "--level", str(level), "--dtype", args.dtype, "--decode-tokens", str(args.decode_tokens),
           "--chunk", str(args.chunk), "--rounds", str(args.rounds), "--contexts", *map(str, contexts)]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    cmd += ["--lm-head-quantization", args.lm_head_quantization]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if res.returncode != 0:
        raise SystemExit(f"level {level} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, default_shape="qwen0.5b with room for %d-token contexts" % LONG_SHAPE_LEN)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--levels", type=int, nargs="+", default=[2, 1, 0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 8192, 16000])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed 512-token decodes per level, each paired with a DRAM probe")
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--quantization", default=None, help="quantize at load (int8, int4, ...)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32", "int8"],
                    help="KV cache dtype (int8: quantized rows with a scale each)")
    ap.add_argument("--lm-head-quantization", default="auto",
                    help="auto (int8 with --quantization), none (as stored), or an int8 format")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--out", default="/tmp/bench_isa_context")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--level", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    if args.model or args.shape:
        args.model_dir = resolve_model(args.model, args.shape or "qwen0.5b")
    else:  # Qwen2.5-0.5B's shape with room for long prompts
        args.model_dir = build_once(os.path.join(CACHE, "qwen0.5b-32k"), "qwen0.5b-32k",
                                    dict(QWEN05B, max_position_embeddings=LONG_SHAPE_LEN))
    from numa_runtime._kernels import gemm
    from bench.limits import dram_read_gbps
    best = gemm.cpu_level()
    levels = [lv for lv in args.levels if lv <= best]
    dram = dram_read_gbps(args.threads)
    results = {lv: run_level(args, lv, [512]) for lv in levels}
    long = run_level(args, best, args.contexts)
    per_token = long["bytes_per_token"]  # the linears one decode step streams, as packed
    limit = dram * 1e9 / per_token
    report = {"dram_read_gbps": dram, "bytes_per_token": per_token, "decode_limit_tok_s": limit,
              "levels": {}, "long": {}}
    lines = [f"model {args.model_dir}, {args.dtype}, quantization {args.quantization}, "
             f"lm_head {args.lm_head_quantization}, "
             f"{per_token / 1e6:.0f} MB read per token, DRAM read {dram:.1f} GB/s, "
             f"decode limit {limit:.1f} tok/s", "",
             "| kernel level | decode tok/s (batch 1, 512 context) | of DRAM limit | "
             "adjacent probes GB/s | of adjacent probe (median) | prefill 512 tok/s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for lv, res in results.items():
        r = report["levels"][lv] = dict(res["contexts"]["512"], pairs=res["pairs"])
        fr = sorted(p["of_probe"] for p in res["pairs"])
        probes = "/".join(f"{p['dram_read_gbps']:.0f}" for p in res["pairs"])
        lines.append(f"| {lv} ({ONEDNN_ISA[lv]}) | {r['decode_tok_s']:.1f} | "
                     f"{r['decode_tok_s'] / limit:.0%} | {probes} | {fr[len(fr) // 2]:.0%} | "
                     f"{r['prefill_tok_s']:.0f} |")
    lines += ["", "| context | prefill tok/s | decode tok/s after it |", "| --- | --- | --- |"]
    for ctx in args.contexts:
        r = report["long"][ctx] = long["contexts"][str(ctx)]
        lines.append(f"| {ctx} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} |")
    print("\n".join(lines))
    write_report(args.out, report, "\n".join(lines))


if __name__ == "__main__":
    main()
