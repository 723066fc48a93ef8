"""Prefix-cache hit rate on mixed traffic: multi-turn conversations + a stream of one-offs.

    python bench/bench_prefix_cache.py                 # lru vs reuse, several cache sizes
    python bench/bench_prefix_cache.py --blocks 1024 --policies lru reuse
    python bench/bench_prefix_cache.py --engine --threads 1 [--quick] [--model DIR] [--out /tmp/x]

Workload (seeded, identical for every policy): `clients` conversations of `turns` turns; each
turn's prompt is the whole conversation so far (system prompt, earlier user texts and the
model's answers) plus new user text; a client sends its next turn some steps after the last
answer (closed loop). Meanwhile one-off requests (half of them behind a shared system prompt,
the rest unique) arrive at a steady rate. The cache is smaller than the working set.

The model is simulated (token = position % 7, one step = one schedule/update). `run_workload`
takes a `run_step(SchedulerOutput) -> sampled token ids` callable; `--engine` drives a real
Engine through the same loop (its scheduler, block manager, model runner and greedy sampler; the
detokenizer is skipped), once per eviction policy, with kv_cache_memory = blocks x the model's
bytes per block. Every answer is --max-tokens (8) long; prompts are random token ids. Arrivals
stay in steps (identical for both policies); TTFT is wall clock from the scheduler's add_request
to the step that samples the first token. Default model: a random 8-layer Llama (hidden 512).
Writes OUT.json and OUT.md.

Results with their machines and commands: bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CACHE, build_once, percentiles, write_report  # noqa: E402
from numa_runtime.kv_cache import BlockManager  # noqa: E402
from numa_runtime.request import Request, RequestStatus  # noqa: E402
from numa_runtime.sampling_params import SamplingParams  # noqa: E402
from numa_runtime.scheduler import Scheduler, SchedulerConfig  # noqa: E402


@dataclass
class WorkloadConfig:
    clients: int = 20
    turns: int = 8
    system_tokens: int = 64
    user_tokens: tuple[int, int] = (40, 120)
    answer_tokens: tuple[int, int] = (30, 100)
    think_steps: tuple[int, int] = (20, 200)
    start_steps: tuple[int, int] = (0, 400)
    one_offs: int = 640                   # 4 per conversation turn
    one_off_every: int = 4                # steps between one-off arrivals
    one_off_prompt: tuple[int, int] = (100, 400)
    one_off_answer: tuple[int, int] = (16, 64)
    vocab: int = 32000
    seed: int = 0


@dataclass
class Conversation:
    cid: int
    user_texts: list[list[int]]
    answer_lens: list[int]
    think: list[int]
    history: list[int] = field(default_factory=list)
    turn: int = 0
    next_step: int = 0
    busy: bool = False


class Workload:
    """Arrivals that depend on completions (the next turn needs the last answer)."""

    def __init__(self, cfg: WorkloadConfig):
        rng = random.Random(cfg.seed)
        tok = lambda n: [rng.randrange(cfg.vocab) for _ in range(n)]  # noqa: E731
        span = lambda r: rng.randint(*r)  # noqa: E731
        self.cfg = cfg
        system = tok(cfg.system_tokens)
        self.convs = []
        for c in range(cfg.clients):
            conv = Conversation(c, [tok(span(cfg.user_tokens)) for _ in range(cfg.turns)],
                                [span(cfg.answer_tokens) for _ in range(cfg.turns)],
                                [span(cfg.think_steps) for _ in range(cfg.turns)],
                                history=list(system), next_step=span(cfg.start_steps))
            self.convs.append(conv)
        other_system = tok(cfg.system_tokens // 2)
        self.one_offs = []  # (arrival step, prompt, max_tokens)
        for i in range(cfg.one_offs):
            prefix = other_system if i % 2 == 0 else []
            self.one_offs.append((i * cfg.one_off_every, prefix + tok(span(cfg.one_off_prompt)),
                                  span(cfg.one_off_answer)))
        self.one_offs.reverse()
        self.owner: dict[str, Conversation] = {}

    def arrivals(self, step: int) -> list[Request]:
        out = []
        for conv in self.convs:
            if not conv.busy and conv.turn < self.cfg.turns and step >= conv.next_step:
                conv.history += conv.user_texts[conv.turn]
                r = Request(f"c{conv.cid}t{conv.turn}", conv.history,
                            SamplingParams(max_tokens=conv.answer_lens[conv.turn], ignore_eos=True))
                conv.busy = True
                self.owner[r.request_id] = conv
                out.append(r)
        while self.one_offs and self.one_offs[-1][0] <= step:
            _, prompt, n = self.one_offs.pop()
            out.append(Request(f"o{len(self.one_offs)}", prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
        return out

    def finished(self, r: Request, step: int) -> None:
        conv = self.owner.pop(r.request_id, None)
        if conv is not None:
            conv.history += r.output_token_ids
            conv.next_step = step + conv.think[conv.turn]
            conv.turn += 1
            conv.busy = False

    def done(self) -> bool:
        return not self.one_offs and all(c.turn == self.cfg.turns for c in self.convs)


def simulated_step(out) -> list[int]:
    """The fake model: token = position % 7 of each sampled row."""
    return (out.plan.positions[out.plan.logits_indices] % 7).tolist()


def run_workload(sched: Scheduler, workload: Workload, run_step, max_steps: int = 1_000_000) -> dict:
    """schedule -> run_step -> update until the workload is done. Returns per-request records."""
    arrived: dict[str, tuple[Request, int, float]] = {}
    records = []
    computed = prefill = 0
    for step in range(max_steps):
        for r in workload.arrivals(step):
            sched.add_request(r)
            arrived[r.request_id] = (r, step, time.perf_counter())
        if workload.done() and not sched.has_unfinished():
            break
        out = sched.schedule()
        computed += out.plan.num_tokens
        # NOTE: a decode token is one new token past the prompt; a re-prefill after preemption is prefill
        prefill += sum(n for r, n in zip(out.scheduled, out.num_scheduled_tokens)
                       if n > 1 or r.num_computed_tokens < r.num_prompt_tokens)
        sampled = run_step(out) if out.scheduled else []
        sched.update(out, sampled)
        for r in out.sampling:
            _, t0_step, t0 = arrived[r.request_id]
            if r.num_output_tokens == 1:
                records.append({"id": r.request_id, "conv": r.request_id.startswith("c"),
                                "prompt": r.num_prompt_tokens, "cached": r.num_cached_tokens,
                                "ttft_steps": step + 1 - t0_step, "ttft_s": time.perf_counter() - t0})
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
                workload.finished(r, step)
    return {"records": records, "steps": step, "computed_tokens": computed, "prefill_tokens": prefill}


def simulate(policy: str, num_blocks: int, wcfg: WorkloadConfig, block_size: int = 16,
             max_num_seqs: int = 16, budget: int = 512, run_step=simulated_step) -> dict:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=policy != "none",
                      eviction="lru" if policy == "none" else policy)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len=4096), bm)
    t0 = time.perf_counter()
    res = run_workload(sched, Workload(wcfg), run_step)
    return summarize(policy, sched, res, time.perf_counter() - t0)


def summarize(policy: str, sched: Scheduler, res: dict, wall_s: float) -> dict:
    """One row of the report from `run_workload`'s records and the block manager's counters."""
    bm, recs = sched.block_manager, res["records"]
    conv = [r for r in recs if r["conv"]]
    one = [r for r in recs if not r["conv"]]
    rate = lambda rs: sum(r["cached"] for r in rs) / max(1, sum(r["prompt"] for r in rs))  # noqa: E731
    mean = lambda rs, k: sum(r[k] for r in rs) / max(1, len(rs))  # noqa: E731
    return {"policy": policy, "blocks": bm.num_blocks, "hit_rate": bm.hit_rate, "conv_hit": rate(conv),
            "one_off_hit": rate(one), "saved": bm.hit_tokens, "queried": bm.query_tokens,
            "computed": res["computed_tokens"], "prefill": res["prefill_tokens"],
            "steps": res["steps"], "evictions": bm.num_evictions, "preemptions": sched.num_preemptions,
            "ttft_conv": mean(conv, "ttft_steps"), "wall_s": wall_s,
            "ttft_conv_s": percentiles([r["ttft_s"] for r in conv]),
            "ttft_one_off_s": percentiles([r["ttft_s"] for r in one])}


# ----------------------------------------------------------------------------- --engine
# 8 layers of hidden 512 (24M parameters, head_dim 64): prefill costs visibly more than a step's
# Python, and one core of a 2-core VM still runs the moderate workload in ~80 s per policy. Vocab 384:
# the lm_head stays small and random prompt ids stay in the tokenizer's vocabulary.
SMALL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=384, tie_word_embeddings=False,
             max_position_embeddings=2048, initializer_range=0.02)
ENGINE_SIZES = {  # (clients, turns, one-offs, KV pool blocks): the pool is below the working set
    "quick": (8, 4, 128, 256),
    "moderate": (20, 8, 640, 768),
}


def engine_workload(a, vocab: int) -> WorkloadConfig:
    """The simulator's workload with every answer `a.max_tokens` long (decode is not the point)."""
    n = (a.max_tokens, a.max_tokens)
    return WorkloadConfig(clients=a.clients, turns=a.turns, one_offs=a.one_offs, one_off_every=a.one_off_every,
                          think_steps=tuple(a.think), answer_tokens=n, one_off_answer=n, vocab=vocab,
                          seed=a.seed)


def working_set_blocks(w: WorkloadConfig, block_size: int = 16) -> int:
    """Blocks of every conversation's final history (upper bound: longest user texts)."""
    longest = w.system_tokens + w.turns * w.user_tokens[1] + (w.turns - 1) * w.answer_tokens[1]
    return w.clients * -(-longest // block_size)


def engine_step(eng):
    """Engine.step's middle: execute the plan on the model, sample greedily (no detokenizer)."""
    return lambda out: eng.sampler(eng.runner.execute(out.plan), out.sampling, eng.eos_ids)[0].tolist()


def run_engine(policy: str, num_blocks: int, bytes_per_block: int, w: WorkloadConfig, a) -> dict:
    """The workload through an Engine whose KV pool holds exactly `num_blocks` blocks."""
    from numa_runtime import Engine
    eng = Engine(a.model, dtype=a.dtype, num_threads=a.threads, max_model_len=a.max_model_len,
                 kv_cache_memory=num_blocks * bytes_per_block, eviction=policy,
                 max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.budget)
    try:
        if eng.runner.num_blocks != num_blocks:
            raise SystemExit(f"The engine made {eng.runner.num_blocks} KV blocks, not {num_blocks} "
                             "(capped at max_num_seqs full-length sequences); ask for fewer --blocks.")
        t0 = time.perf_counter()
        res = run_workload(eng.scheduler, Workload(w), engine_step(eng))
        return summarize(policy, eng.scheduler, res, time.perf_counter() - t0)
    finally:
        eng.close()


def warm_up(a) -> int:
    """Load the model once, run prefills of several lengths (the kernels' first calls), and
    return the bytes of one KV block."""
    import numpy as np

    from numa_runtime import Engine, SamplingParams
    eng = Engine(a.model, dtype=a.dtype, num_threads=a.threads, max_model_len=a.max_model_len,
                 kv_cache_memory=64 << 20, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.budget)
    rng = np.random.default_rng(12345)
    vocab = eng.model_config.vocab_size
    eng.generate([rng.integers(3, vocab, n).tolist() for n in (7, 100, a.max_model_len - 16)],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    bpb = eng.runner.bytes_per_block
    eng.close()
    return bpb


def engine_markdown(r: dict) -> str:
    c = r["config"]
    lines = [f"model `{c['model']}` ({c['dtype']}); {c['clients']} clients x {c['turns']} turns + "
             f"{c['one_offs']} one-offs, {c['max_tokens']} output tokens each, greedy; KV pool "
             f"{c['blocks']} blocks of 16 = {c['pool_fraction']:.0%} of the conversations' final histories "
             f"({c['working_set_blocks']} blocks); infinite-cache hit rate {r['infinite_cache_hit_rate']:.1%} "
             f"(simulated){'; --quick (noisy)' if r['quick'] else ''}", "",
             "| policy | hit rate | conv hit | prefill tokens | TTFT conv p50 / p99 ms | "
             "TTFT one-off p50 / p99 ms | preempt | total s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    ms = lambda d: f"{d['p50'] * 1e3:.0f} / {d['p99'] * 1e3:.0f}"  # noqa: E731
    for p in r["policies"]:
        lines.append(f"| {p['policy']} | {p['hit_rate']:.1%} | {p['conv_hit']:.1%} | {p['prefill']} | "
                     f"{ms(p['ttft_conv_s'])} | {ms(p['ttft_one_off_s'])} | {p['preemptions']} | "
                     f"{p['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def engine_main(a) -> None:
    clients, turns, one_offs, blocks = ENGINE_SIZES["quick" if a.quick else "moderate"]
    a.clients, a.turns = a.clients or clients, a.turns or turns
    a.one_offs = one_offs if a.one_offs is None else a.one_offs
    blocks = a.blocks[0] if a.blocks else blocks
    a.model = os.path.abspath(os.path.expanduser(a.model)) if a.model else build_once(
        os.path.join(CACHE, "prefix-8l512"), "prefix-8l512", SMALL)
    from numa_runtime.config import ModelConfig
    w = engine_workload(a, ModelConfig.from_dir(a.model).vocab_size)
    a.max_model_len = max(w.system_tokens + w.turns * (w.user_tokens[1] + a.max_tokens),
                          w.system_tokens // 2 + w.one_off_prompt[1] + a.max_tokens) + 16
    bpb = warm_up(a)
    ws = working_set_blocks(w)
    ideal = simulate("reuse", 1 << 16, w)
    print(f"{a.clients} clients x {a.turns} turns + {a.one_offs} one-offs; KV pool {blocks} blocks "
          f"({blocks * bpb / 2**20:.1f} MiB) vs working set {ws} blocks", flush=True)
    rows = []
    # NOTE: alternating policies so that load from other processes on the host hits both alike
    for run, policy in ((r, p) for r in range(a.repeat) for p in a.policies):
        rows.append(dict(run_engine(policy, blocks, bpb, w, a), run=run))
        p = rows[-1]
        print(f"{policy}: hit {p['hit_rate']:.1%}, prefill {p['prefill']} tokens, TTFT conv p50 "
              f"{p['ttft_conv_s']['p50'] * 1e3:.0f} ms, {p['wall_s']:.1f} s", flush=True)
    report = {"quick": a.quick, "infinite_cache_hit_rate": ideal["hit_rate"],
              "config": {"model": a.model, "dtype": a.dtype, "clients": a.clients, "turns": a.turns,
                         "one_offs": a.one_offs, "one_off_every": a.one_off_every, "think": a.think,
                         "max_tokens": a.max_tokens, "seed": a.seed, "blocks": blocks,
                         "bytes_per_block": bpb, "working_set_blocks": ws, "pool_fraction": blocks / ws,
                         "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.budget},
              "policies": rows}
    md = engine_markdown(report)
    paths = write_report(a.out, report, md)
    print("\n" + md + "\nwrote " + ", ".join(paths))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=None,
                    help="KV pool sizes (default: 768 1024 1536 2048; --engine: one size, 768, 256 with --quick)")
    ap.add_argument("--policies", nargs="+", default=["lru", "reuse"])
    ap.add_argument("--clients", type=int, default=None, help="default 20 (8 with --engine --quick)")
    ap.add_argument("--turns", type=int, default=None, help="default 8 (4 with --engine --quick)")
    ap.add_argument("--one-offs", type=int, default=None, help="default 640 (128 with --engine --quick)")
    ap.add_argument("--one-off-every", type=int, default=4, help="steps between one-off arrivals")
    ap.add_argument("--think", type=int, nargs=2, default=[20, 200], help="steps a client waits between turns")
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("--engine: the workload through a real Engine (TTFT in seconds)")
    g.add_argument("--engine", action="store_true")
    g.add_argument("--quick", action="store_true", help="smaller workload and pool (under a minute)")
    g.add_argument("--model", help="HF model directory (default: random 8-layer Llama, 24M params, built once)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: all allowed cpus)")
    g.add_argument("--max-tokens", type=int, default=8, help="output tokens of every request")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    g.add_argument("--repeat", type=int, default=1, help="run the policies in turn this many times")
    g.add_argument("--out", default="/tmp/bench_prefix_cache", help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if args.engine:
        return engine_main(args)
    args.blocks = args.blocks or [768, 1024, 1536, 2048]
    args.clients, args.turns = args.clients or 20, args.turns or 8
    args.one_offs = 640 if args.one_offs is None else args.one_offs
    wcfg = WorkloadConfig(clients=args.clients, turns=args.turns, one_offs=args.one_offs,
                          one_off_every=args.one_off_every, think_steps=tuple(args.think), seed=args.seed)
    ideal = simulate("reuse", 1 << 16, wcfg)
    print(f"workload: {args.clients} clients x {args.turns} turns + {args.one_offs} one-offs "
          f"(one every {args.one_off_every} steps), think {args.think[0]}-{args.think[1]} steps; "
          f"block 16; infinite cache hit rate {ideal['hit_rate']:.1%} "
          f"(conversation turns {ideal['conv_hit']:.1%})")
    print(f"{'blocks':>6} {'policy':>6} {'hit':>6} {'conv hit':>8} {'1-off hit':>9} {'saved tok':>9} "
          f"{'computed':>9} {'steps':>6} {'evict':>6} {'preempt':>7} {'ttft conv':>9}")
    for nb in args.blocks:
        for pol in args.policies:
            r = simulate(pol, nb, wcfg)
            print(f"{nb:>6} {pol:>6} {r['hit_rate']:>6.1%} {r['conv_hit']:>8.1%} {r['one_off_hit']:>9.1%} "
                  f"{r['saved']:>9} {r['computed']:>9} {r['steps']:>6} {r['evictions']:>6} "
                  f"{r['preemptions']:>7} {r['ttft_conv']:>9.1f}")


if __name__ == "__main__":
    main()
