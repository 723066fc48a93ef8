"""Prefix-cache hit rate on mixed traffic: multi-turn conversations + a stream of one-offs.

    python bench/bench_prefix_cache.py                 # lru vs reuse, several cache sizes
    python bench/bench_prefix_cache.py --blocks 1024 --policies lru reuse
    python bench/bench_prefix_cache.py --engine --threads 1 [--quick] [--model DIR] [--out /tmp/x]
    python bench/bench_prefix_cache.py [--engine] --disk-tier --restart   # disk tier off/on, restart mid-way

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

--disk-tier runs every policy twice, without and with a disk tier under the pool
(kv_cache/disk_tier.py; simulated: the block manager's ops only). --restart stops arrivals half-way
(at half the steps of the run without a tier), lets the running requests finish, and replaces the
server: a new scheduler, or a new Engine on the same --kv-cache-dir (the old one writes its cached
blocks there when it closes). "conv hit after restart" is the conversations' hit rate from then on;
each variant also runs without the restart, and "kept" is that hit rate over the hit rate of the
same conversation turns in the run without it (the issue's target: >= 90%).

Results with their machines and commands: bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CACHE, build_once, percentiles, write_report  # noqa: E402
from numa_runtime.kv_cache import BlockManager  # noqa: E402
from numa_runtime.kv_cache.disk_tier import DiskTier  # noqa: E402
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


def run_workload(sched: Scheduler, workload: Workload, run_step, max_steps: int = 1_000_000,
                 restart_at: int | None = None, restart=None) -> dict:
    """schedule -> run_step -> update until the workload is done. Returns per-request records.

    With `restart_at`: from that step no request arrives until the running ones finish, then
    `restart()` -> (scheduler, run_step) replaces the server (a new process on the same disk
    tier, or with none) and arrivals resume."""
    arrived: dict[str, tuple[Request, int, float]] = {}
    records = []
    computed = prefill = 0
    schedulers, after = [sched], False
    for step in range(max_steps):
        if restart_at is not None and step >= restart_at:
            if sched.has_unfinished():
                pass  # draining: nobody arrives until the running requests finish
            else:
                sched, run_step = restart()
                schedulers.append(sched)
                restart_at, after = None, True
        for r in workload.arrivals(step) if restart_at is None or step < restart_at else ():
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
                records.append({"id": r.request_id, "conv": r.request_id.startswith("c"), "after_restart": after,
                                "prompt": r.num_prompt_tokens, "cached": r.num_cached_tokens,
                                "ttft_steps": step + 1 - t0_step, "ttft_s": time.perf_counter() - t0})
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
                workload.finished(r, step)
    return {"records": records, "steps": step, "computed_tokens": computed, "prefill_tokens": prefill,
            "schedulers": schedulers}


def simulate(policy: str, num_blocks: int, wcfg: WorkloadConfig, block_size: int = 16,
             max_num_seqs: int = 16, budget: int = 512, run_step=simulated_step, disk_blocks: int = 0,
             restart_at: int | None = None) -> dict:
    """The workload on the simulated model; `disk_blocks` > 0 puts a disk tier of that many
    blocks under the pool (plain Python: the ops are only counted); `restart_at` restarts."""
    def new_scheduler(disk_entries=()):
        tier = DiskTier(disk_blocks, True, list(disk_entries)) if disk_blocks else None
        bm = BlockManager(num_blocks, block_size, enable_prefix_caching=policy != "none",
                          eviction="lru" if policy == "none" else policy, tier=tier)
        return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len=4096), bm)

    def restart():
        bm = sched.block_manager
        if bm.tier is None:
            return new_scheduler(), run_step
        bm.offload_all()  # what Engine.close() does
        return new_scheduler(bm.tier.index), run_step

    sched = new_scheduler()
    t0 = time.perf_counter()
    res = run_workload(sched, Workload(wcfg), run_step, restart_at=restart_at, restart=restart)
    return summarize(policy, res["schedulers"][-1], res, time.perf_counter() - t0)


def summarize(policy: str, sched: Scheduler, res: dict, wall_s: float) -> dict:
    """One row of the report from `run_workload`'s records and the block manager's counters."""
    bm, recs = sched.block_manager, res["records"]
    bms = [s.block_manager for s in res.get("schedulers", [sched])]  # one per (re)start
    conv = [r for r in recs if r["conv"]]
    one = [r for r in recs if not r["conv"]]
    rate = lambda rs: sum(r["cached"] for r in rs) / max(1, sum(r["prompt"] for r in rs))  # noqa: E731
    mean = lambda rs, k: sum(r[k] for r in rs) / max(1, len(rs))  # noqa: E731
    saved, queried = sum(b.hit_tokens for b in bms), sum(b.query_tokens for b in bms)
    return {"policy": policy, "blocks": bm.num_blocks, "hit_rate": saved / max(1, queried), "conv_hit": rate(conv),
            "conv_hit_after_restart": rate([r for r in conv if r.get("after_restart")]),
            "_conv": {r["id"]: (r["cached"], r["prompt"], r["after_restart"]) for r in conv},
            "restarts": len(bms) - 1, "disk": bm.tier is not None,
            "disk_hit_blocks": sum(b.tier_hit_blocks for b in bms),
            "one_off_hit": rate(one), "saved": saved, "queried": queried,
            "computed": res["computed_tokens"], "prefill": res["prefill_tokens"],
            "steps": res["steps"], "evictions": sum(b.num_evictions for b in bms),
            "preemptions": sum(s.num_preemptions for s in res.get("schedulers", [sched])),
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
    def step(out):
        logits = eng.runner.execute(out.plan)
        if logits is None:
            raise SystemExit(f"A disk-tier file failed its check ({len(eng.runner.failed_loads)} blocks); "
                             "the benchmark expects an intact --kv-cache-dir.")
        return eng.sampler(logits, out.sampling, eng.eos_ids)[0].tolist()
    return step


def run_engine(policy: str, num_blocks: int, bytes_per_block: int, w: WorkloadConfig, a,
               disk_dir: str | None = None, restart_at: int | None = None) -> dict:
    """The workload through an Engine whose KV pool holds exactly `num_blocks` blocks; with
    `disk_dir` a disk tier under it; with `restart_at` a new Engine (same directory) mid-way."""
    from numa_runtime import Engine

    def start():
        disk = {} if disk_dir is None else dict(kv_cache_dir=disk_dir, kv_cache_disk_bytes=a.disk_bytes,
                                                kv_cache_disk_load=a.disk_load)
        e = Engine(a.model, dtype=a.dtype, num_threads=a.threads, max_model_len=a.max_model_len,
                   kv_cache_memory=num_blocks * bytes_per_block, eviction=policy,
                   max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.budget, **disk)
        if e.runner.num_blocks != num_blocks:
            raise SystemExit(f"The engine made {e.runner.num_blocks} KV blocks, not {num_blocks} "
                             "(capped at max_num_seqs full-length sequences); ask for fewer --blocks.")
        engines.append(e)
        return e

    def restart():
        engines[-1].close()  # writes its cached blocks to the disk tier, if any
        e = start()
        return e.scheduler, engine_step(e)

    engines = []
    eng = start()
    try:
        t0 = time.perf_counter()
        res = run_workload(eng.scheduler, Workload(w), engine_step(eng), restart_at=restart_at, restart=restart)
        return summarize(policy, res["schedulers"][-1], res, time.perf_counter() - t0)
    finally:
        engines[-1].close()


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


def restart_kept(rows: list[dict]) -> None:
    """Pair each restarted row with the same run without restart: the conversation turns that
    came after the restart, their hit rate in both ("kept" = with / without the restart)."""
    for row in rows:
        if row["restarts"]:
            base = next(b for b in rows if not b["restarts"] and (b["run"], b["policy"], b["disk"]) ==
                        (row["run"], row["policy"], row["disk"]))
            after = [i for i, (_, _, was_after) in row["_conv"].items() if was_after]
            hit = sum(base["_conv"][i][0] for i in after) / max(1, sum(base["_conv"][i][1] for i in after))
            row["conv_hit_same_turns_no_restart"] = hit
            row["restart_kept"] = row["conv_hit_after_restart"] / hit if hit else float("nan")
    for row in rows:
        del row["_conv"]


def engine_markdown(r: dict) -> str:
    c = r["config"]
    lines = [f"model `{c['model']}` ({c['dtype']}); {c['clients']} clients x {c['turns']} turns + "
             f"{c['one_offs']} one-offs, {c['max_tokens']} output tokens each, greedy; KV pool "
             f"{c['blocks']} blocks of 16 = {c['pool_fraction']:.0%} of the conversations' final histories "
             f"({c['working_set_blocks']} blocks); infinite-cache hit rate {r['infinite_cache_hit_rate']:.1%} "
             f"(simulated){'; --quick (noisy)' if r['quick'] else ''}", "",
             "| policy | disk tier | restart | hit rate | conv hit | conv hit after restart (same turns, no restart; "
             "kept) | disk hits (blocks) | prefill tokens | TTFT conv p50 / p99 ms | TTFT one-off p50 / p99 ms | "
             "preempt | total s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ms = lambda d: f"{d['p50'] * 1e3:.0f} / {d['p99'] * 1e3:.0f}"  # noqa: E731
    for p in r["policies"]:
        after = (f"{p['conv_hit_after_restart']:.1%} ({p['conv_hit_same_turns_no_restart']:.1%}; "
                 f"{p['restart_kept']:.0%})" if p["restarts"] else "-")
        lines.append(f"| {p['policy']} | {'on' if p['disk'] else 'off'} | {'at step %d' % p['restart_at'] if p['restarts'] else '-'} | "
                     f"{p['hit_rate']:.1%} | {p['conv_hit']:.1%} | {after} | {p['disk_hit_blocks']} | {p['prefill']} | "
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
    # NOTE: alternating variants so that load from other processes on the host hits all alike
    variants = [(r, p, d, s) for r in range(a.repeat) for p in a.policies for d in ((False, True) if a.disk_tier else (False,))
                for s in ((False, True) if a.restart else (False,))]
    for run, policy, disk, restart in variants:
        restart_at = simulate(policy, blocks, w)["steps"] // 2 if restart else None
        disk_dir = tempfile.mkdtemp(prefix="kv-disk-", dir=os.path.dirname(os.path.abspath(a.out))) if disk else None
        try:
            rows.append(dict(run_engine(policy, blocks, bpb, w, a, disk_dir, restart_at), run=run, restart_at=restart_at))
        finally:
            if disk_dir:
                shutil.rmtree(disk_dir, ignore_errors=True)
        p = rows[-1]
        print(f"{policy} disk {'on' if disk else 'off'} restart {'yes' if restart else 'no'}: hit {p['hit_rate']:.1%}, "
              f"conv after restart {p['conv_hit_after_restart']:.1%}, prefill {p['prefill']} tokens, TTFT conv "
              f"p50 {p['ttft_conv_s']['p50'] * 1e3:.0f} ms, {p['wall_s']:.1f} s", flush=True)
    restart_kept(rows)
    report = {"quick": a.quick, "infinite_cache_hit_rate": ideal["hit_rate"],
              "config": {"model": a.model, "dtype": a.dtype, "clients": a.clients, "turns": a.turns,
                         "one_offs": a.one_offs, "one_off_every": a.one_off_every, "think": a.think,
                         "max_tokens": a.max_tokens, "seed": a.seed, "blocks": blocks,
                         "bytes_per_block": bpb, "working_set_blocks": ws, "pool_fraction": blocks / ws,
                         "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.budget,
                         "disk_tier": a.disk_tier, "restart": a.restart},
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
    ap.add_argument("--disk-tier", action="store_true", help="also run each policy with a disk tier under the pool")
    ap.add_argument("--restart", action="store_true",
                    help="restart the server half-way (drain, then a new scheduler / Engine on the same disk tier)")
    ap.add_argument("--disk-blocks", type=int, default=1 << 16, help="simulated disk tier's size in blocks")
    g = ap.add_argument_group("--engine: the workload through a real Engine (TTFT in seconds)")
    g.add_argument("--disk-bytes", type=int, default=4 << 30, help="--disk-tier's size cap (kv_cache_disk_bytes)")
    g.add_argument("--disk-load", default="auto", choices=["auto", "always"], help="kv_cache_disk_load")
    g.add_argument("--engine", action="store_true")
    g.add_argument("--quick", action="store_true", help="smaller workload and pool (under a minute)")
    g.add_argument("--model", help="HF model directory (default: random 8-layer Llama, 24M params, built once)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: all allowed cpus)")
    g.add_argument("--max-tokens", type=int, default=8, help="output tokens of every request")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    g.add_argument("--repeat", type=int, default=1, help="run the policies in turn this many times")
    ap.add_argument("--out", default="/tmp/bench_prefix_cache", help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if args.engine:
        return engine_main(args)
    args.blocks = args.blocks or [768, 1024, 1536, 2048]
    args.clients, args.turns = args.clients or 20, args.turns or 8
    args.one_offs = 640 if args.one_offs is None else args.one_offs
    wcfg = WorkloadConfig(clients=args.clients, turns=args.turns, one_offs=args.one_offs,
                          one_off_every=args.one_off_every, think_steps=tuple(args.think), seed=args.seed)
    ideal = simulate("reuse", 1 << 16, wcfg)
    head = (f"workload: {args.clients} clients x {args.turns} turns + {args.one_offs} one-offs "
            f"(one every {args.one_off_every} steps), think {args.think[0]}-{args.think[1]} steps; "
            f"block 16; infinite cache hit rate {ideal['hit_rate']:.1%} "
            f"(conversation turns {ideal['conv_hit']:.1%})")
    print(head)
    lines, results = [], []
    print(f"{'blocks':>6} {'policy':>6} {'disk':>4} {'hit':>6} {'conv hit':>8} {'conv rst':>8} {'1-off hit':>9} "
          f"{'saved tok':>9} {'computed':>9} {'steps':>6} {'evict':>6} {'preempt':>7} {'ttft conv':>9}")
    for nb, pol, disk in ((n, p, d) for n in args.blocks for p in args.policies
                          for d in ((False, True) if args.disk_tier else (False,))):
        restart_at = simulate(pol, nb, wcfg)["steps"] // 2 if args.restart else None
        r = simulate(pol, nb, wcfg, disk_blocks=args.disk_blocks if disk else 0, restart_at=restart_at)
        after = f"{'-':>8}"
        if r["restarts"]:
            rows = [dict(r, run=0), dict(simulate(pol, nb, wcfg, disk_blocks=args.disk_blocks if disk else 0), run=0)]
            restart_kept(rows)
            after = f"{r['conv_hit_after_restart']:>8.1%} (kept {rows[0]['restart_kept']:.0%})"
        print(f"{nb:>6} {pol:>6} {'on' if disk else 'off':>4} {r['hit_rate']:>6.1%} {r['conv_hit']:>8.1%} {after} "
              f"{r['one_off_hit']:>9.1%} {r['saved']:>9} {r['computed']:>9} {r['steps']:>6} {r['evictions']:>6} "
              f"{r['preemptions']:>7} {r['ttft_conv']:>9.1f}")
        results.append(dict(r, blocks=nb, policy=pol, disk_tier=disk))
        lines.append(f"| {nb} | {pol} | {'on' if disk else 'off'} | {r['hit_rate']:.1%} | {r['conv_hit']:.1%} | "
                     f"{after.strip()} | {r['one_off_hit']:.1%} | {r['saved']} | {r['computed']} | {r['steps']} | "
                     f"{r['evictions']} | {r['preemptions']} | {r['ttft_conv']:.1f} |")
    # NOTE: the simulated runs write their report too (--out was taken and nothing written)
    md = "\n".join([head, "", "| blocks | policy | disk | hit | conv hit | conv hit after restart | one-off hit | "
                     "saved tok | computed | steps | evictions | preemptions | TTFT conv (steps) |",
                     "|" + " --- |" * 13, *lines]) + "\n"
    report = {"simulated": True, "workload": {"clients": args.clients, "turns": args.turns, "one_offs": args.one_offs,
                                              "one_off_every": args.one_off_every, "think": list(args.think),
                                              "seed": args.seed},
              "infinite_cache": ideal, "rows": results}
    print("wrote " + ", ".join(write_report(args.out, report, md)))


if __name__ == "__main__":
    main()
