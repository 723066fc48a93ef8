"""The CUDA backend on one GPU: decode speed and the host KV tier on multi-turn traffic.

    python bench/bench_cuda.py [--shape llama3.2-1b|llama3.1-8b] [--batch 1 16 64] [--multiturn] [--hf 1 64]

decode: closed-loop batches of B requests (prompt 64 random tokens, 256 new), output tok/s
and, for batch 1, weight bytes read per second against the GPU's HBM bandwidth (--hbm-gbs).
--hf B...: the same decode with transformers' generate on the same GPU at batch sizes B (default 1).
--multiturn: 20 clients x 8 turns (64 new user tokens, 32 answer tokens per turn), the GPU KV
pool at half the working set; TTFT p50/p99 and prefix hit rate with the host tier off
(recompute only) and on.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from bench.common import SHAPES, percentiles, resolve_model, random_prompts, weights_bytes_per_token, write_report


def decode(model: str, dtype: str, batch: int, new_tokens: int = 256) -> dict:
    from numa_runtime import Engine, SamplingParams
    eng = Engine(model, dtype=dtype, device="cuda", max_model_len=1024, max_num_seqs=max(batch, 1))
    rng = np.random.default_rng(0)
    vocab = eng.model_config.vocab_size
    eng.generate(random_prompts(rng, batch, 64, 64, vocab), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for p in random_prompts(rng, batch, 64, 64, vocab):
        eng.add_request(p, params)
    eng.step()  # the prefill step
    steps, t0 = 0, time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    dt = time.perf_counter() - t0
    wb = weights_bytes_per_token(eng.model_config, dtype)
    gpu_ms = graph_step_ms(eng.runner.graphs, batch)
    replays = eng.runner.graphs.num_replays
    eng.close()
    del eng
    free_gpu_memory()
    return {"batch": batch, "steps": steps, "seconds": dt, "tok_s": batch * steps / dt,
            "step_ms": 1e3 * dt / steps, "weights_gbs": wb * steps / dt / 1e9, "gpu_step_ms": gpu_ms,
            "gpu_weights_gbs": wb / gpu_ms / 1e6, "graph_replays": replays}


def free_gpu_memory() -> None:
    """Give the memory of closed engines back before the next one loads (an 8B model)."""
    import gc
    import torch
    gc.collect()
    torch.cuda.empty_cache()


def graph_step_ms(graphs, batch: int, reps: int = 100) -> float:
    """GPU time of one decode step alone: replays of the captured graph of `batch`'s bucket
    (the engine's step adds scheduling, the logits copy and sampling on the CPU)."""
    import torch
    g = graphs.graphs[graphs.bucket(batch)].graph
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / reps


def profile_decode(model: str, dtype: str, steps: int = 20) -> str:
    """CUDA time per kernel over eager batch-1 decode steps (torch.profiler table)."""
    import torch
    from numa_runtime import Engine, SamplingParams
    eng = Engine(model, dtype=dtype, device="cuda", max_model_len=1024, max_num_seqs=1, cuda_graphs=False)
    eng.add_request(list(range(3, 67)), SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True))
    for _ in range(5):
        eng.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)


def hf_decode(model: str, batches: list[int], new_tokens: int = 256) -> list[dict]:
    """transformers' generate on the same GPU: greedy, `new_tokens` new tokens for each of a
    batch of 64-token prompts (no padding), output tok/s per batch size."""
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    out = [_hf_generate(m, b, new_tokens) for b in batches]
    del m
    torch.cuda.empty_cache()
    return out


def _hf_generate(m, batch: int, new_tokens: int) -> dict:
    import torch
    ids = torch.randint(3, m.config.vocab_size, (batch, 64), device="cuda")
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        m.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"batch": batch, "tok_s": batch * new_tokens / dt}


def multiturn(model: str, dtype: str, host_bytes: int, clients: int = 20, turns: int = 8,
              user: int = 64, answer: int = 32) -> dict:
    from numa_runtime import Engine, SamplingParams
    from numa_runtime.config import ModelConfig
    cfg = ModelConfig.from_dir(model)
    item = 2 if dtype == "bfloat16" else 4
    block_bytes = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * item
    working_blocks = clients * (-(-turns * (user + answer) // 16))
    eng = Engine(model, dtype=dtype, device="cuda", max_model_len=2048, max_num_seqs=clients,
                 kv_cache_memory=working_blocks // 2 * block_bytes, host_kv_cache_memory=host_bytes)
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True)
    history = [[] for _ in range(clients)]
    turn = [0] * clients
    start, ttft, live = {}, {}, {}

    def submit(c):
        history[c] = history[c] + rng.integers(3, cfg.vocab_size, user).tolist()
        rid = eng.add_request(history[c], params)
        live[rid], start[rid] = c, time.perf_counter()

    for c in range(clients):
        submit(c)
    t0 = time.perf_counter()
    while live:
        for o in eng.step():
            if o.request_id not in ttft and o.outputs[0].token_ids:
                ttft[o.request_id] = time.perf_counter() - start[o.request_id]
            if o.finished:
                c = live.pop(o.request_id)
                history[c] = history[c] + o.outputs[0].token_ids
                turn[c] += 1
                if turn[c] < turns:
                    submit(c)
    bm = eng.block_manager
    tier = eng.runner.host_tier
    return {"host_kv_bytes": host_bytes, "gpu_blocks": eng.runner.num_blocks, "working_set_blocks": working_blocks,
            "seconds": time.perf_counter() - t0, "ttft_ms": {k: 1e3 * v for k, v in percentiles(list(ttft.values())).items()},
            "prefix_hit_rate": bm.hit_rate, "evictions": bm.num_evictions,
            "host_restored_blocks": tier.num_restored if tier else 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3.2-1b")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--hbm-gbs", type=float, default=4800.0, help="the GPU's HBM bandwidth (H200: 4800)")
    ap.add_argument("--hf", type=int, nargs="*", default=None, metavar="B",
                    help="also transformers' generate at these batch sizes (none given: 1)")
    ap.add_argument("--multiturn", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print CUDA time per kernel of eager batch-1 decode")
    ap.add_argument("--out", default="/tmp/bench_cuda")
    args = ap.parse_args(argv)
    model = resolve_model(args.model, args.shape) if args.model else None
    from numa_runtime.cuda_backend import CudaUnavailableError, check_available
    try:
        check_available()
    except CudaUnavailableError as e:
        raise SystemExit(f"bench_cuda.py: {e}") from None
    model = model or resolve_model(None, args.shape)
    report = {"model": model, "dtype": args.dtype, "decode": [decode(model, args.dtype, b) for b in args.batch]}
    lines = [f"# CUDA backend, {os.path.basename(model)} ({args.dtype})", "",
             "| batch | tok/s | step ms | weights GB/s | % of HBM | GPU-only step ms | GPU-only % of HBM |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for d in report["decode"]:
        lines.append(f"| {d['batch']} | {d['tok_s']:.1f} | {d['step_ms']:.2f} | {d['weights_gbs']:.0f} | "
                     f"{100 * d['weights_gbs'] / args.hbm_gbs:.0f}% | {d['gpu_step_ms']:.3f} | "
                     f"{100 * d['gpu_weights_gbs'] / args.hbm_gbs:.0f}% |")
    if args.profile:
        print(profile_decode(model, args.dtype))
    if args.hf is not None:
        report["hf"] = hf_decode(model, args.hf or [1])
        ours = {d["batch"]: d["tok_s"] for d in report["decode"]}
        lines += ["", "| batch | transformers generate tok/s | numa_runtime / transformers |", "| --- | --- | --- |"]
        for h in report["hf"]:
            ratio = f"{ours[h['batch']] / h['tok_s']:.2f}x" if h["batch"] in ours else "-"
            lines.append(f"| {h['batch']} | {h['tok_s']:.1f} | {ratio} |")
    if args.multiturn:
        multiturn(model, args.dtype, 0, turns=2)  # warm-up: compiles, first captures
        report["multiturn"] = [multiturn(model, args.dtype, h) for h in (0, 4 << 30)]
        lines += ["", "| host tier | TTFT p50 ms | TTFT p99 ms | prefix hit rate | restored blocks | seconds |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for m in report["multiturn"]:
            lines.append(f"| {'on' if m['host_kv_bytes'] else 'off'} | {m['ttft_ms']['p50']:.1f} | "
                         f"{m['ttft_ms']['p99']:.1f} | {m['prefix_hit_rate']:.2f} | {m['host_restored_blocks']} | "
                         f"{m['seconds']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(args.out, report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
