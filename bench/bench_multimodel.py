"""Several models in one server: load and unload of a model, and memory against one server per model.

    python bench/bench_multimodel.py                      # the Qwen2.5-0.5B shape + the tiny model
    python bench/bench_multimodel.py --big qwen0.5b --small tiny --num-threads 1 [--out /tmp/x]
    python bench/bench_multimodel.py --quick              # two tiny models (a smoke run)

Every server is the real `python -m numa_runtime.serve` on 127.0.0.1 (one rank), every request
a streamed completion through the official `openai` client (random prompt token ids, so that
no prompt hits the prefix cache); readiness is GET /health. Each model gets the same KV pool
(--kv-cache-memory) in every server. Three phases:

1. **load**: `--model SMALL --model BIG` with a budget that holds both. SMALL loads at start-up;
   the first request to BIG loads it. Load time = that request's time to first token minus the
   median of warm requests' (the server's own figure, `load_seconds` in /v1/models, beside it).
   Memory (RSS, PSS, USS: psutil `memory_full_info`, summed over the server's processes) is
   taken with SMALL alone and with both loaded (after each has served a request).
2. **separate**: one server per model, both running at once (so that PSS shares the common
   pages between them as it would in production), each after a request.
3. **unload**: a budget that holds BIG but not both. A request to BIG unloads SMALL; a request
   to SMALL then unloads BIG (least recently used, idle): the server's `unload_seconds` of BIG,
   and the memory before and after.

"one server <= separate servers" is the issue's target; the difference is what one Python
runtime, its libraries and the server around the models cost. Writes OUT.json and OUT.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_serving import Server, free_port  # noqa: E402
from bench.common import CACHE, SHAPES, TINY, build_once, write_report  # noqa: E402

MIB = 1 << 20


def model_dir(spec: str) -> str:
    """A built-in random shape's directory (built once), or a model directory as given."""
    if spec in SHAPES:
        return SHAPES[spec]()
    path = os.path.abspath(os.path.expanduser(spec))
    if not os.path.exists(path):  # NOTE: a traceback from ModelConfig before, whose advice did not fit
        raise SystemExit(f"bench_multimodel.py: {spec}: no such model directory or file (or a shape: "
                         f"{', '.join(sorted(SHAPES))}).")
    return path


def start(models: list[str], a, budget: int | None = None) -> Server:
    """A server of `models` (the first loads at start-up); several models need `budget`."""
    port = free_port()
    cmd = [sys.executable, "-m", "numa_runtime.serve", "--port", str(port), "--dtype", a.dtype,
           "--kv-cache-memory", str(a.kv_bytes), "--max-model-len", str(a.max_model_len),
           "--log-level", "warning", *[x for m in models for x in ("--model", m)]]
    if a.num_threads:
        cmd += ["--num-threads", str(a.num_threads)]
    if budget is not None:
        cmd += ["--memory-budget", str(budget), "--load-timeout", str(a.load_timeout)]
    return Server(cmd, port, timeout=a.start_timeout, ready_path="/health")


def memory(server: Server) -> dict:
    """MiB of RSS (and its anonymous part: RSS less file-backed and shared pages), PSS and USS
    of the server and its children (ranks under a launcher)."""
    import psutil
    root = psutil.Process(server.proc.pid)
    total = dict.fromkeys(("rss", "anon", "pss", "uss"), 0)
    for p in [root, *root.children(recursive=True)]:
        m = p.memory_full_info()
        for k in total:
            total[k] += m.rss - m.shared if k == "anon" else getattr(m, k)
    return {k: v / MIB for k, v in total.items()}


class Client:
    """Streamed completions of random prompts to one server; the latency to the first chunk."""

    def __init__(self, server: Server, a):
        import numpy as np
        import openai
        self.client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0,
                                    timeout=a.load_timeout + 600)
        self.rng, self.a = np.random.default_rng(0), a

    def ttft(self, name: str, vocab: int) -> float:
        prompt = self.rng.integers(3, vocab, self.a.prompt_tokens).tolist()
        t0 = time.perf_counter()
        first = None
        stream = self.client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if first is None and chunk.choices:
                first = time.perf_counter() - t0
        if first is None:
            raise RuntimeError(f"{name}: the stream ended without a token.")
        return first

    def warm(self, name: str, vocab: int) -> float:
        return statistics.median(self.ttft(name, vocab) for _ in range(self.a.warm_requests))

    def models(self) -> dict:
        return {m.id: m.model_extra for m in self.client.models.list().data}


def phase_load(dirs, names, vocab, a, budget) -> dict:
    small, big = names
    srv = start(dirs, a, budget)
    try:
        c = Client(srv, a)
        c.warm(small, vocab[small])
        mem_small = memory(srv)
        assert not c.models()[big]["loaded"], "the big model was loaded before its first request"
        first = c.ttft(big, vocab[big])
        warm = c.warm(big, vocab[big])
        mem_both = memory(srv)
        listed = c.models()
    finally:
        srv.stop()
    return {"first_ttft_s": first, "warm_ttft_s": warm, "load_s": first - warm,
            "server_load_s": listed[big]["load_seconds"], "listed": listed,
            "memory_small_only": mem_small, "memory_both": mem_both,
            "big_resident": {k: mem_both[k] - mem_small[k] for k in mem_both}}


def phase_separate(dirs, names, vocab, a) -> dict:
    servers = []
    try:
        for d in dirs:
            servers.append(start([d], a))
        for srv, name in zip(servers, names):
            Client(srv, a).warm(name, vocab[name])
        return {name: memory(srv) for srv, name in zip(servers, names)}
    finally:
        for srv in servers:
            srv.stop()


def phase_unload(dirs, names, vocab, a, budget) -> dict:
    small, big = names
    srv = start(dirs, a, budget)
    try:
        c = Client(srv, a)
        c.warm(small, vocab[small])
        c.ttft(big, vocab[big])  # loads big, unloads small (both do not fit)
        c.warm(big, vocab[big])
        mem_big = memory(srv)
        first_small = c.ttft(small, vocab[small])  # loads small, unloads big
        warm_small = c.warm(small, vocab[small])
        mem_after = memory(srv)
        listed = c.models()
    finally:
        srv.stop()
    if listed[big]["loaded"] or not listed[small]["loaded"]:
        raise RuntimeError(f"Expected the big model unloaded and the small one loaded, got {listed}.")
    return {"server_unload_s": listed[big]["unload_seconds"], "server_load_small_s": listed[small]["load_seconds"],
            "small_first_ttft_s": first_small, "small_warm_ttft_s": warm_small,
            "memory_big_loaded": mem_big, "memory_after_unload": mem_after,
            "released": {k: mem_big[k] - mem_after[k] for k in mem_big}, "listed": listed}


def budgets(dirs, names, a) -> tuple[int, int, dict]:
    """(a budget for both, a budget for the big one but not both, each model's estimate).

    NOTE: the router checks a model that is not loaded by its estimate and a loaded one by what
    it holds: the big one's estimate plus an eighth of the small one's leaves no room for the
    small one beside the big one, nor for the big one's estimate beside the small one."""
    from numa_runtime.serve.router import ModelRouter, ModelSpec, RouterConfig
    specs = tuple(ModelSpec(n, d) for n, d in zip(names, dirs))
    kw = {"dtype": a.dtype, "kv_cache_memory": a.kv_bytes}
    fp = ModelRouter(RouterConfig(specs, 1 << 50, kw)).footprint
    both = 2 * sum(fp.values())
    return both, fp[names[1]] + fp[names[0]] // 8, fp


def markdown(r: dict) -> str:
    L, S, U, c = r["load"], r["separate"], r["unload"], r["config"]
    small, big = c["names"]
    one, sep = L["memory_both"], {k: sum(m[k] for m in S.values()) for k in L["memory_both"]}
    row = lambda label, m: f"| {label} | {m['rss']:.0f} | {m['anon']:.0f} | {m['pss']:.0f} | {m['uss']:.0f} |"  # noqa: E731
    return "\n".join([
        f"models: {big} (big) and {small} (small), {c['dtype']}, KV pool {c['kv_bytes'] / MIB:.0f} MiB each, "
        f"{c['num_threads'] or 'all'} thread(s){'; --quick' if r['quick'] else ''}", "",
        "| load / unload of the big model | seconds |", "| --- | --- |",
        f"| first request TTFT (loads it) | {L['first_ttft_s']:.3f} |",
        f"| warm TTFT (median of {c['warm_requests']}) | {L['warm_ttft_s']:.3f} |",
        f"| load = first - warm (server's load_seconds) | {L['load_s']:.3f} ({L['server_load_s']:.3f}) |",
        f"| unload (server's unload_seconds, LRU when the small one needs room) | {U['server_unload_s']:.3f} |",
        "", "| memory, MiB | RSS | anon RSS | PSS | USS |", "| --- | --- | --- | --- | --- |",
        row(f"one server, {small} only", L["memory_small_only"]),
        row("one server, both loaded", one),
        row(f"resident {big} (both - {small} only)", L["big_resident"]),
        *[row(f"separate server, {n}", m) for n, m in S.items()],
        row("separate servers, sum", sep),
        row("separate sum - one server (saved)", {k: sep[k] - one[k] for k in sep}),
        row(f"one-at-a-time server, {big} loaded", U["memory_big_loaded"]),
        row(f"same, after {big} unloaded ({small} loaded)", U["memory_after_unload"]),
        ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", default="qwen0.5b", help=f"the model loaded and unloaded: {sorted(SHAPES)} or a "
                                                       "model directory (default qwen0.5b)")
    ap.add_argument("--small", default="tiny", help="the other model, loaded at start-up (default tiny)")
    ap.add_argument("--quick", action="store_true", help="two tiny models (a smoke run)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-bytes", type=int, default=None,
                    help="every model's KV pool (--kv-cache-memory); default: 64 MiB, or what two sequences of "
                         "--max-model-len tokens of the larger model need where that is more (the server refuses "
                         "a context its pool cannot hold)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--warm-requests", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=None, help="compute threads of every server")
    ap.add_argument("--load-timeout", type=float, default=600.0, help="the servers' --load-timeout")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    ap.add_argument("--out", default="/tmp/bench_multimodel", help="writes OUT.json and OUT.md")
    a = ap.parse_args(argv)
    if a.quick:
        given = [k for k in ("big", "small", "kv_bytes", "max_model_len", "prompt_tokens", "warm_requests")
                 if getattr(a, k) != ap.get_default(k)]
        if given:
            ap.error(f"--quick picks its own models and sizes; drop --{given[0].replace('_', '-')} (or --quick).")
        a.big, a.small = "tiny", os.path.join(CACHE, "tiny-b")
        build_once(a.small, "tiny-b", TINY)
        a.kv_bytes, a.max_model_len, a.prompt_tokens, a.warm_requests = 4 * MIB, 256, 32, 3
    dirs = [model_dir(a.small), model_dir(a.big)]
    names = [os.path.basename(os.path.normpath(d)) for d in dirs]
    if names[0] == names[1]:
        ap.error(f"--big and --small must be different models (both are named {names[0]!r}).")
    from numa_runtime.config import ModelConfig
    from numa_runtime.models.llama import kv_block_bytes
    cfgs = [ModelConfig.from_dir(d) for d in dirs]
    vocab = {n: c.vocab_size for n, c in zip(names, cfgs)}
    if a.kv_bytes is None:
        a.kv_bytes = max([64 * MIB] + [2 * -(-a.max_model_len // 16) * kv_block_bytes(c, c.num_kv_heads, 16, a.dtype)
                                       for c in cfgs])
    both, one_at_a_time, estimate = budgets(dirs, names, a)
    print(f"models {names}, estimates (MiB) {[round(estimate[n] / MIB) for n in names]}", flush=True)
    report = {"quick": a.quick,
              "config": {"names": names, "dirs": dirs, "dtype": a.dtype, "kv_bytes": a.kv_bytes,
                         "num_threads": a.num_threads, "warm_requests": a.warm_requests,
                         "prompt_tokens": a.prompt_tokens, "budget_both": both,
                         "budget_one_at_a_time": one_at_a_time, "estimate_bytes": estimate}}
    report["load"] = phase_load(dirs, names, vocab, a, both)
    print(f"load {report['load']['load_s']:.3f} s", flush=True)
    report["separate"] = phase_separate(dirs, names, vocab, a)
    report["unload"] = phase_unload(dirs, names, vocab, a, one_at_a_time)
    md = markdown(report)
    paths = write_report(a.out, report, md)
    print("\n" + md + "\nwrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
