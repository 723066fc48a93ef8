"""Engine core speed: output tokens/s, TTFT and TPOT at concurrency 1, 4, 16, 64, and the
scheduler + Python overhead as a share of step time.

    python bench/bench_engine.py                     # random Llama of Qwen2.5-0.5B's shape, bf16
    python bench/bench_engine.py --quick             # tiny model, few tokens (smoke run)
    python bench/bench_engine.py --model DIR --threads 16 --out /tmp/bench_engine
    python bench/bench_engine.py --shape llama3.2-1b

Closed loop, one process: C requests are kept in flight (a finished one is replaced at once)
until `--requests-per-level` (default 2 C, at least 4) requests have finished. Prompts are
64-256 random token ids, 128 output tokens, ignore_eos, greedy. Engine.add_request / step are
driven directly; TTFT = first_token_time - arrival_time (RequestOutput.metrics), TPOT = (time
the last token was seen - first_token_time) / (output tokens - 1). Throughput = output tokens
of the level / its wall time (the drain at the end included).

Overhead: with 32 requests decoding (steps whose plan is 32 decode tokens), Engine.step is
split by wrapping scheduler.schedule and runner.execute on the engine instance: schedule,
execute (the model forward; on several ranks the plan broadcast too), update (the rest:
sampling, detokenization, stop checks, outputs). overhead = (step - execute) / step.

Streaming cost: `--overhead-tokens 2000` makes those 32 requests generate 2,000 tokens each, and
the update time is also reported per window of output position (`update_by_position`): flat
means the per-step bookkeeping costs O(new tokens), rising means it touches whole sequences
(O(L) per step, O(L^2) per request). Issue 13's figure:
    python bench/bench_engine.py --concurrency 1 --overhead-batch 32 --overhead-tokens 2000
Per-token overhead at batch 1: `--overhead` skips the concurrency levels and splits batch-1
decode steps (8 requests one after another, prompts of 16-32 tokens, `--overhead-tokens` output
tokens each, default 128, so that contexts stay short) into schedule / execute / update, as medians. On the default `tiny24` shape (TINY's kernels at Qwen2.5-0.5B's
24 layers) the kernels take almost no time, so the step is the per-op and per-step overhead:
    python bench/bench_engine.py --overhead                                  # tiny24, bf16
    python bench/bench_engine.py --overhead --shape qwen0.5b --quantization int4
Software prefetch A/B: `--prefetch 0 4096 ...` skips the rest and runs decode-only rounds that
alternate the kernels' prefetch distance (qgemm._set_prefetch and gemm._set_prefetch; same
results at every distance): each round, for each distance, B requests (--prefetch-batch, default
1 and 16) decode 48 tokens after a short prompt, and the median step is kept; reported per
distance as the median over --overhead-rounds rounds (default 5). Alternating rounds in one
process keeps a shared host's drift out of the comparison.
    python bench/bench_engine.py --prefetch 0 4096 --shape qwen0.5b --quantization int4
`--wait-prefetch 0 32768 ...` runs the same rounds alternating instead how many bytes of the next
GEMV's weights each thread of the fused decode region prefetches while it waits at a barrier
(qgemm._set_wait_prefetch; decode_layers.h):
    python bench/bench_engine.py --wait-prefetch 0 32768 --shape qwen0.5b --quantization int4
`--rope-in-items` runs them alternating whether each attention item of that region rotates its
own queries and writes its newest key (decode_layers.h nd_item_rope; one barrier a layer fewer)
or a phase before the items does (qgemm._set_rope_in_items; same results either way):
    python bench/bench_engine.py --rope-in-items --shape qwen0.5b --quantization int4
`--lean-decode` alternates the decode rows' int8 kernel of int4/int8 with f16 group scales: the
generic one or the lean one (qgemm._set_q8_lean; qgemm_q8.h qg_q8_lean_mr; same results):
    python bench/bench_engine.py --lean-decode --model model-q4_0.gguf
Mixed steps: `--mixed` skips the rest: B requests (--overhead-batch, default 15 here) decode
while every fourth step a new request arrives whose prompt (the same --prompt-max random ids each
time) the prefix cache holds but for its last rows, so that its step mixes B decode rows with a
few prompt rows (each kind runs its own path: models/llama.py _rows_apart); reported: the median
decode step and the median step that holds the prompt rows, over --overhead-rounds x 8 arrivals.
    python bench/bench_engine.py --mixed --model model-q4_0.gguf --threads 2
Writes OUT.json and OUT.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import add_model_args, percentiles, random_prompts, resolve_model, write_report  # noqa: E402


def make_engine(a):
    from numa_runtime import Engine
    return Engine(a.model, dtype=a.dtype, num_threads=a.threads, quantization=a.quantization,
                  prefill_activations=a.prefill_activations,
                  # NOTE: prefetch_ab's rounds: 32-token prompts, 48 tokens out
                  max_model_len=max(a.prompt_max + max(a.output_len, a.overhead_tokens),
                                    32 + 48 if a.prefetch else 0) + 16,
                  max_num_seqs=max([*a.concurrency, a.overhead_batch + (1 if a.mixed else 0)]),
                  max_num_batched_tokens=a.max_batched_tokens,
                  # NOTE: the overhead split and the prefetch rounds time single decode steps (a
                  # burst of several, EngineConfig.num_scheduler_steps, would count as one)
                  num_scheduler_steps=1 if a.overhead or a.prefetch else 8)


def closed_loop(eng, a, rng, concurrency: int, num_requests: int) -> dict:
    """Keep `concurrency` requests in flight until `num_requests` have finished."""
    from numa_runtime import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    vocab = eng.model_config.vocab_size
    prompts = random_prompts(rng, num_requests, a.prompt_min, a.prompt_max, vocab)
    issued, done, ttft, tpot, out_tokens = 0, 0, [], [], 0
    t0 = time.monotonic()
    while done < num_requests:
        while issued < num_requests and issued - done < concurrency:
            eng.add_request(prompts[issued], params)
            issued += 1
        for o in eng.step():
            if not o.finished:
                continue
            now, m, n = time.monotonic(), o.metrics, len(o.outputs[0].token_ids)
            done += 1
            out_tokens += n
            ttft.append(m["first_token_time"] - m["arrival_time"])
            if n > 1:
                tpot.append((now - m["first_token_time"]) / (n - 1))
    wall = time.monotonic() - t0
    ms = lambda d: {k: v * 1e3 for k, v in d.items()}
    return {"concurrency": concurrency, "requests": num_requests, "output_tokens": out_tokens,
            "wall_s": wall, "output_tps": out_tokens / wall,
            "ttft_ms": ms(percentiles(ttft)), "tpot_ms": ms(percentiles(tpot))}


def step_breakdown(eng, a, rng) -> dict:
    """Mean schedule / execute / update / step time over steps that decode exactly
    `a.overhead_batch` sequences (wrappers set on the instance, removed afterwards)."""
    from numa_runtime import SamplingParams
    n = a.overhead_batch
    sched, runner = eng.scheduler, eng.runner
    clock = time.perf_counter
    cur = {}

    def timed(name, fn):
        def call(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cur[name] = cur.get(name, 0.0) + clock() - t
        return call

    planned = []  # num_tokens of the plans executed in this step
    execute = timed("execute", runner.execute)

    def execute_and_note(plan):
        planned.append(plan.num_tokens)
        return execute(plan)

    sched.schedule, runner.execute = timed("schedule", sched.schedule), execute_and_note
    totals = {"schedule": 0.0, "execute": 0.0, "step": 0.0}
    steps = 0
    by_position = []  # (output tokens of each request, update ms) of every counted step
    samples = []  # (step, schedule, execute) seconds of every counted step
    try:
        params = SamplingParams(temperature=0, max_tokens=a.overhead_tokens, ignore_eos=True)
        for p in random_prompts(rng, n * a.overhead_rounds, a.prompt_min, a.prompt_max, eng.model_config.vocab_size):
            eng.add_request(p, params)  # NOTE: max_num_seqs = n: the rounds run one after another
        while eng.has_unfinished_requests():
            cur.clear()
            planned.clear()
            t = clock()
            eng.step()
            dt = clock() - t
            # NOTE: only pure decode steps of all n sequences (no prefill chunk, none finished yet)
            if planned == [n] and eng.scheduler.stats()["num_running"] == n:
                steps += 1
                totals["step"] += dt
                totals["schedule"] += cur.get("schedule", 0.0)
                totals["execute"] += cur.get("execute", 0.0)
                update = dt - cur.get("schedule", 0.0) - cur.get("execute", 0.0)
                samples.append((dt, cur.get("schedule", 0.0), cur.get("execute", 0.0)))
                by_position.append((eng.scheduler.running[0].num_output_tokens, update * 1e3))
    finally:
        for name in ("schedule", "execute"):  # drop the instance attributes: class methods again
            vars(sched if name == "schedule" else runner).pop(name, None)
    if not steps:
        return {"running": n, "steps": 0, "note": "no step decoded all sequences at once"}
    mean = {k: v / steps * 1e3 for k, v in totals.items()}
    mean["update"] = mean["step"] - mean["schedule"] - mean["execute"]
    return {"running": n, "steps": steps, "step_ms": mean["step"], "schedule_ms": mean["schedule"],
            "execute_ms": mean["execute"], "update_ms": mean["update"],
            "overhead_share": (mean["step"] - mean["execute"]) / mean["step"],
            "median_ms": _medians(samples), "update_by_position": _windows(by_position, a.overhead_tokens)}


def _medians(samples: list[tuple[float, float, float]]) -> dict:
    """Median step / schedule / execute / update ms (update: step - schedule - execute, per step)."""
    import numpy as np
    s = np.asarray(samples) * 1e3  # [steps, 3]
    upd = s[:, 0] - s[:, 1] - s[:, 2]
    return {"step": float(np.median(s[:, 0])), "schedule": float(np.median(s[:, 1])),
            "execute": float(np.median(s[:, 2])), "update": float(np.median(upd)),
            "step_p10": float(np.percentile(s[:, 0], 10))}


def _windows(samples: list[tuple[int, float]], length: int, count: int = 8) -> list[dict]:
    """Mean update ms of the steps in each of `count` windows of output position."""
    width = max(1, -(-length // count))
    out = []
    for lo in range(0, length, width):
        ms = [u for pos, u in samples if lo <= pos < lo + width]
        if ms:
            out.append({"from_token": lo, "to_token": min(length, lo + width), "steps": len(ms),
                        "update_ms": sum(ms) / len(ms)})
    return out


def overhead_markdown(r: dict) -> str:
    s, o = r["summary"], r["overhead"]
    head = (f"model `{s['model']}` ({s['dtype']}, quantization {r['config']['quantization']}), "
            f"{s['threads_per_rank']} threads, batch-1 decode")
    if not o.get("steps"):
        return f"{head}: {o.get('note')}\n"
    m = o["median_ms"]
    return (f"{head}, {o['steps']} steps: median step {m['step']:.3f} ms (p10 {m['step_p10']:.3f}; "
            f"{1e3 / m['step']:.1f} tok/s) = schedule {m['schedule']:.3f} + execute {m['execute']:.3f} "
            f"+ update {m['update']:.3f} (medians of each part)\n")


def markdown(r: dict) -> str:
    s = r["summary"]
    lines = [f"model `{s['model']}` ({s['dtype']}), {s['threads_per_rank']} threads, "
             f"prompts {r['config']['prompt_min']}-{r['config']['prompt_max']} tokens, "
             f"{r['config']['output_len']} output tokens{', --quick (noisy)' if r['quick'] else ''}", "",
             "| concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    for lv in r["levels"]:
        lines.append(f"| {lv['concurrency']} | {lv['output_tps']:.1f} | {lv['ttft_ms']['p50']:.1f} | "
                     f"{lv['ttft_ms']['p99']:.1f} | {lv['tpot_ms']['p50']:.1f} | {lv['tpot_ms']['p99']:.1f} |")
    lines.append("")
    if r.get("scaling_c16_over_c1") is not None:
        lines.append(f"throughput concurrency 16 / concurrency 1: {r['scaling_c16_over_c1']:.2f}x")
    o = r["overhead"]
    if o.get("steps"):
        lines += ["", f"step at {o['running']} running requests ({o['steps']} decode steps): "
                  f"{o['step_ms']:.2f} ms = schedule {o['schedule_ms']:.2f} + execute {o['execute_ms']:.2f} "
                  f"+ update {o['update_ms']:.2f}; overhead (step - execute) / step = {o['overhead_share']:.1%}"]
        windows = o.get("update_by_position") or []
        if windows:
            lines += ["", "| output tokens | decode steps | update ms per step |", "| --- | --- | --- |"]
            lines += [f"| {w['from_token']}-{w['to_token']} | {w['steps']} | {w['update_ms']:.3f} |" for w in windows]
    else:
        lines += ["", f"overhead: {o.get('note')}"]
    return "\n".join(lines) + "\n"


def mixed_steps(eng, a, rng) -> dict:
    """Median step of B decode rows, and of B decode rows beside a new prompt's uncached rows."""
    from numa_runtime import SamplingParams
    import numpy as np
    prompt = random_prompts(rng, 1, a.prompt_max, a.prompt_max, eng.model_config.vocab_size)[0]
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # its blocks into the prefix cache
    run = SamplingParams(max_tokens=10 ** 6, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    decode, mixed = [], []
    for _ in range(a.overhead_rounds):
        ids = [eng.add_request(random_prompts(rng, 1, 16, 32, eng.model_config.vocab_size)[0], run)
               for _ in range(a.overhead_batch)]
        for _ in range(4):  # their prompts, then decode steps
            eng.step()
        for _ in range(8):
            for _ in range(3):
                t = time.perf_counter()
                eng.step()
                decode.append(time.perf_counter() - t)
            rid = eng.add_request(prompt, one)
            t = time.perf_counter()
            outs = eng.step()
            mixed.append(time.perf_counter() - t)
            if not any(o.request_id == rid and o.finished for o in outs):
                raise RuntimeError("the new prompt did not run in the step timed for it")
        eng.abort_request(ids)
        while eng.has_unfinished_requests():
            eng.step()
    uncached = a.prompt_max % eng.config.block_size or eng.config.block_size
    return {"batch": a.overhead_batch, "prompt_tokens": a.prompt_max, "uncached_rows": uncached,
            "decode_step_ms": float(np.median(decode)) * 1e3, "mixed_step_ms": float(np.median(mixed)) * 1e3,
            "samples": len(mixed)}


def _prefetch_knobs(a) -> list:
    """The setters prefetch_ab turns together (each returns its old value): the kernels' prefetch
    distance (--prefetch), the bytes the decode region's barrier waits prefetch (--wait-prefetch),
    whether its attention items rotate their own rows (--rope-in-items: 0 off, 1 on), or whether
    decode rows of int4/int8 with f16 group scales take the lean kernel (--lean-decode)."""
    from numa_runtime._kernels import gemm, qgemm
    if a.rope_in_items:
        return [qgemm._set_rope_in_items]
    if a.lean_decode:
        return [qgemm._set_q8_lean]
    return [qgemm._set_wait_prefetch] if a.wait_prefetch else [qgemm._set_prefetch, gemm._set_prefetch]


def prefetch_ab(eng, a) -> dict:
    """Median decode step (ms) per prefetch setting and batch, rounds alternating the settings."""
    import statistics

    from numa_runtime import SamplingParams
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    res = {b: {d: [] for d in a.prefetch} for b in a.prefetch_batch}
    knobs = _prefetch_knobs(a)
    old = [knob(a.prefetch[0]) for knob in knobs]
    try:
        for _ in range(a.overhead_rounds):
            for b in a.prefetch_batch:
                for d in a.prefetch:
                    for knob in knobs:
                        knob(d)
                    for i in range(b):
                        eng.add_request(list(range(10 + i, 42 + i)), params)
                    eng.step()  # the prefill
                    steps = []
                    while eng.has_unfinished_requests():
                        t = time.perf_counter()
                        eng.step()
                        steps.append(time.perf_counter() - t)
                    res[b][d].append(1e3 * statistics.median(steps))
    finally:
        for knob, value in zip(knobs, old):
            knob(value)
    return {str(b): {str(d): {"rounds_ms": v, "median_ms": statistics.median(v)} for d, v in r.items()}
            for b, r in res.items()}


def _ab_label(a, d: int) -> str:
    if a.rope_in_items:
        return f"rope in items {'on' if d else 'off'}"
    if a.lean_decode:
        return "lean decode kernel" if d else "generic decode kernel"
    return f"{'wait prefetch' if a.wait_prefetch else 'prefetch'} {d} B"


def prefetch_markdown(r: dict, a) -> str:
    lines = [f"model {r['summary'].get('model', '')}, quantization {a.quantization}, threads {r['threads']}; "
             f"median decode step ms over {a.overhead_rounds} alternating rounds", "",
             "| batch | " + " | ".join(_ab_label(a, d) for d in a.prefetch) + " |",
             "|" + " --- |" * (len(a.prefetch) + 1)]
    for b, row in r["prefetch"].items():
        base = row[str(a.prefetch[0])]["median_ms"]
        lines.append(f"| {b} | " + " | ".join(
            f"{row[str(d)]['median_ms']:.2f} ({row[str(d)]['median_ms'] / base:.2f}x)" for d in a.prefetch) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, default_shape="qwen0.5b; tiny with --quick, tiny24 with --overhead")
    ap.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: all allowed cpus)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests-per-level", type=int, default=None, help="default: max(2 C, 4)")
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--overhead-batch", type=int, default=32, help="running requests for the overhead split")
    ap.add_argument("--overhead-tokens", type=int, default=None,
                    help="output tokens of each of those requests (default --output-len; 2000 shows streaming cost)")
    ap.add_argument("--overhead-rounds", type=int, default=None,
                    help="batches of --overhead-batch requests run one after another (default 1; 8 with --overhead)")
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny model, concurrency 1 4 16, few tokens")
    ap.add_argument("--overhead", action="store_true",
                    help="only the batch-1 decode step split (default shape tiny24, --overhead-tokens 128)")
    ap.add_argument("--quantization", default=None, help="quantize at load (int8, int4, ...)")
    ap.add_argument("--prefetch", type=int, nargs="+", default=None,
                    help="only the prefetch A/B: these distances in bytes, e.g. 0 4096")
    ap.add_argument("--wait-prefetch", type=int, nargs="+", default=None,
                    help="only the A/B of the bytes the decode region's barrier waits prefetch of the next "
                         "GEMV's weights (qgemm._set_wait_prefetch), e.g. 0 32768")
    ap.add_argument("--rope-in-items", action="store_true",
                    help="only the A/B (off, on) of the decode region's attention items rotating their own "
                         "rows instead of a phase and a barrier before them (qgemm._set_rope_in_items)")
    ap.add_argument("--lean-decode", action="store_true",
                    help="only the A/B (generic, lean) of the decode rows' int8 kernel of int4/int8 with f16 group "
                         "scales (qgemm._set_q8_lean)")
    ap.add_argument("--prefetch-batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--mixed", action="store_true",
                    help="only the mixed-step split: decode steps of --overhead-batch rows (default 15) beside "
                         "steps that add a new prompt's few uncached rows")
    ap.add_argument("--prefill-activations", default="bf16", choices=["bf16", "int8"])
    ap.add_argument("--out", default="/tmp/bench_engine", help="writes OUT.json and OUT.md")
    a = ap.parse_args()
    if a.mixed:
        a.concurrency, a.overhead_rounds = [], a.overhead_rounds or 3
        a.overhead_batch = 15 if a.overhead_batch == 32 else a.overhead_batch
        a.prompt_max = 86 if a.prompt_max == 256 else a.prompt_max
    if a.wait_prefetch:
        a.prefetch = a.wait_prefetch
    if a.rope_in_items or a.lean_decode:
        a.prefetch = [0, 1]
    if a.prefetch:
        a.concurrency, a.overhead_rounds = [], a.overhead_rounds or 5
        a.overhead_batch = max(a.prefetch_batch)
    if a.quick:
        a.concurrency = [c for c in a.concurrency if c <= 16] or [1]
        a.prompt_min, a.prompt_max, a.output_len = 8, 32, 16
        if not a.prefetch:  # NOTE: the prefetch rounds' batches are as --prefetch-batch names them
            a.overhead_batch = min(a.overhead_batch, 8)
    if a.overhead:  # NOTE: short contexts, so that attention's kernel time stays small
        a.concurrency, a.overhead_batch, a.prompt_min, a.prompt_max = [], 1, 16, 32
        a.overhead_tokens, a.overhead_rounds = a.overhead_tokens or 128, a.overhead_rounds or 8
    if a.overhead_tokens is None or a.quick:
        a.overhead_tokens = a.output_len
    a.overhead_rounds = a.overhead_rounds or 1
    a.model = resolve_model(a.model, a.shape or ("tiny" if a.quick else "tiny24" if a.overhead else "qwen0.5b"))
    import numpy as np
    eng = make_engine(a)
    rng = np.random.default_rng(a.seed)
    closed_loop(eng, a, rng, 1, 1)  # warm-up: kernel primitives for prefill and decode shapes
    if a.mixed:
        r = mixed_steps(eng, a, rng)
        report = {"summary": eng.summary(), "threads": eng.num_threads,
                  "prefill_activations": a.prefill_activations, "mixed": r}
        eng.close()
        md = (f"| decode rows | new prompt (uncached rows) | prefill activations | decode step ms | "
              f"step with the prompt rows ms |\n| --- | --- | --- | --- | --- |\n"
              f"| {r['batch']} | {r['prompt_tokens']} ({r['uncached_rows']}) | {a.prefill_activations} | "
              f"{r['decode_step_ms']:.1f} | {r['mixed_step_ms']:.1f} |\n")
        paths = write_report(a.out, report, md)
        print("\n" + md + "\nwrote " + ", ".join(paths))
        return
    if a.prefetch:
        report = {"summary": eng.summary(), "threads": eng.num_threads, "prefetch": prefetch_ab(eng, a)}
        eng.close()
        md = prefetch_markdown(report, a)
        paths = write_report(a.out, report, md)
        print("\n" + md + "\nwrote " + ", ".join(paths))
        return
    levels = []
    for c in a.concurrency:
        n = a.requests_per_level or max(2 * c, 4)
        levels.append(closed_loop(eng, a, rng, c, n))
        lv = levels[-1]
        print(f"concurrency {c}: {lv['output_tps']:.1f} tok/s, TTFT p50 {lv['ttft_ms']['p50']:.1f} ms, "
              f"TPOT p50 {lv['tpot_ms']['p50']:.1f} ms", flush=True)
    by_c = {lv["concurrency"]: lv["output_tps"] for lv in levels}
    overhead = step_breakdown(eng, a, rng)
    report = {"quick": a.quick, "summary": eng.summary(),
              "config": {k: getattr(a, k) for k in ("prompt_min", "prompt_max", "output_len", "seed", "quantization",
                                                    "max_batched_tokens", "overhead_batch", "overhead_tokens",
                                                    "overhead_rounds")},
              "levels": levels,
              "scaling_c16_over_c1": by_c[16] / by_c[1] if 16 in by_c and 1 in by_c else None,
              "overhead": overhead, "scheduler_stats": eng.scheduler.stats()}
    eng.close()
    md = overhead_markdown(report) if a.overhead else markdown(report)
    paths = write_report(a.out, report, md)
    print("\n" + md + "\nwrote " + ", ".join(paths))


if __name__ == "__main__":
    main()
