r"""Serving benchmark: output tokens/s, TTFT and TPOT (p50/p99) at several concurrencies.

    # against a running OpenAI-compatible server
    python bench/bench_serving.py --base-url http://127.0.0.1:8000/v1
    # start numa_runtime's server, then llama.cpp's (llama-cpp-python[server]), same machine,
    # one after the other, and print both side by side as a markdown table
    python bench/bench_serving.py --compare [--model DIR] [--gguf FILE]
    # a smoke run: two concurrencies, a few short requests
    python bench/bench_serving.py --compare --quick
    # llama.cpp's own llama-server binary (bench/build_llamacpp.sh) and ours on the same GGUF
    python bench/bench_serving.py --compare --gguf model-q4_0.gguf --llama-server BUILD/bin/llama-server \
        --concurrency 1,16,64 --num-threads 16   # ours: 15 compute threads + HTTP

Each request is a streamed completion; TTFT is the time to its first token, TPOT the mean time
between its later tokens, output tokens/s the tokens of all requests over the wall time.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # NOTE: numa_runtime from this checkout, installed or not
PROMPT = ("You are a helpful assistant. Explain in a few sentences why the sky is blue, "
          "and what changes at sunset. ")


@dataclass
class Result:
    concurrency: int
    num_requests: int
    output_tokens: int
    wall_s: float
    ttft: list[float]
    tpot: list[float]
    errors: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


async def one_request(client, model: str, max_tokens: int, extra: dict) -> tuple[float, float, int]:
    """(ttft, tpot, output tokens) of one streamed completion."""
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body=extra or None)
    chunks = 0
    async for chunk in stream:
        if chunk.choices and first is None:  # the first chunk carries the first token(s)
            first = time.perf_counter()
        if chunk.choices:
            chunks += 1
        if getattr(chunk, "usage", None):
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    tokens = tokens or chunks  # a server without include_usage: one chunk per token
    first = first or end
    return first - start, (end - first) / max(1, tokens - 1), tokens


async def run_level(base_url: str, model: str, concurrency: int, num_requests: int, max_tokens: int,
                    api_key: str, extra: dict) -> Result:
    import openai
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    ttft, tpot, tokens, errors = [], [], 0, 0

    async def worker():
        nonlocal tokens, errors
        while not queue.empty():
            queue.get_nowait()
            try:
                a, b, n = await one_request(client, model, max_tokens, extra)
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors += 1
                print(f"  request failed: {e}", file=sys.stderr)
                continue
            ttft.append(a)
            tpot.append(b)
            tokens += n

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return Result(concurrency, num_requests, tokens, wall, ttft, tpot, errors)


async def first_model(base_url: str, api_key: str) -> str:
    import openai
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        return (await client.models.list()).data[0].id


def run_all(base_url: str, levels: list[int], requests_per_level, max_tokens: int, api_key: str,
            extra: dict) -> list[Result]:
    import openai
    try:
        model = asyncio.run(first_model(base_url, api_key))
    except openai.APIConnectionError:
        raise SystemExit(f"bench_serving.py: no server answers at {base_url}; start one first.") from None
    asyncio.run(run_level(base_url, model, 1, 1, 4, api_key, extra))  # warm-up
    results = []
    for c in levels:
        r = asyncio.run(run_level(base_url, model, c, requests_per_level(c), max_tokens, api_key, extra))
        print(f"  concurrency {c:3d}: {r.tokens_per_s:8.1f} tok/s  TTFT p50 {percentile(r.ttft, 50) * 1e3:7.1f} ms  "
              f"TPOT p50 {percentile(r.tpot, 50) * 1e3:6.1f} ms  errors {r.errors}", flush=True)
        results.append(r)
    return results


def table(columns: dict[str, list[Result]]) -> str:
    names = list(columns)
    head = "| concurrency | metric | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (2 + len(names))]
    rows = [("output tok/s", lambda r: f"{r.tokens_per_s:.1f}"),
            ("TTFT p50 ms", lambda r: f"{percentile(r.ttft, 50) * 1e3:.1f}"),
            ("TTFT p99 ms", lambda r: f"{percentile(r.ttft, 99) * 1e3:.1f}"),
            ("TPOT p50 ms", lambda r: f"{percentile(r.tpot, 50) * 1e3:.2f}"),
            ("TPOT p99 ms", lambda r: f"{percentile(r.tpot, 99) * 1e3:.2f}"),
            ("errors", lambda r: str(r.errors))]
    levels = [r.concurrency for r in next(iter(columns.values()))]
    for i, c in enumerate(levels):
        for label, fmt in rows:
            cells = [fmt(columns[n][i]) if i < len(columns[n]) else "-" for n in names]
            lines.append(f"| {c} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ starting servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process started with `cmd`, ready once GET `ready_path` answers 200."""

    def __init__(self, cmd: list[str], port: int, timeout: float = 900, ready_path: str = "/v1/models"):
        import httpx
        # NOTE: stderr to a file, not a pipe: a chatty server (llama.cpp) fills a pipe and blocks.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        ready_url = f"http://127.0.0.1:{port}{ready_path}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{cmd[:4]} exited ({self.proc.returncode}): {self.log.read()[-3000:]}")
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{cmd} did not start in {timeout:.0f} s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def default_gguf() -> str | None:
    try:
        from numa_runtime.default_model import find_default_gguf
        return find_default_gguf()
    except Exception:  # noqa: BLE001 - no default GGUF here
        return None


def llama_server_cmd(binary: str, gguf: str, port: int, threads: int, slots: int, max_tokens: int) -> list[str]:
    """llama-server with `slots` slots under continuous batching; its context is split evenly
    over the slots, so it holds `slots` x (prompt + max_tokens), rounded up to 256 per slot (the
    prompt's UTF-8 bytes bound its token count)."""
    per_slot = -(-(len(PROMPT.encode()) + 8 + max_tokens) // 256) * 256
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(slots * per_slot), "-t", str(threads), "--cont-batching"]


def compare(args, levels, requests_per_level) -> None:
    columns: dict[str, list[Result]] = {}
    port = free_port()
    ours = [sys.executable, "-m", "numa_runtime.serve", "--port", str(port), "--max-queue", "4096"]
    model = args.model or (args.gguf if args.llama_server else None)  # the same GGUF for both
    if model:
        ours += ["--model", model]
    # NOTE: --num-threads N is the cpus each server gets. llama-server runs -t N; ours, as
    # `serve` does by default from RESERVE_MIN_CPUS cpus on, computes on N - 1 and leaves one to
    # its HTTP thread: 16 compute threads on 16 cpus beside a busy HTTP thread stall at every
    # OpenMP barrier (SPR-16, concurrency 16: 33 ms a token against 15). --our-threads: ours alone.
    from numa_runtime.engine import RESERVE_MIN_CPUS
    n = args.num_threads
    our_threads = args.our_threads or (n - 1 if n and n >= RESERVE_MIN_CPUS else n)
    if our_threads:
        ours += ["--num-threads", str(our_threads)]
    print(f"numa_runtime: {' '.join(ours[1:])}", flush=True)
    srv = Server(ours, port)
    try:
        columns["numa_runtime"] = run_all(srv.base_url, levels, requests_per_level, args.max_tokens, "none",
                                          {"ignore_eos": True})
    finally:
        srv.stop()
    gguf = args.gguf or (default_gguf() if not args.model else None)
    if args.llama_server:
        threads = args.num_threads or len(os.sched_getaffinity(0))
        port = free_port()
        cmd = llama_server_cmd(args.llama_server, gguf, port, threads, max(64, max(levels)), args.max_tokens)
        print(f"llama.cpp: {' '.join(cmd)}", flush=True)
        srv = Server(cmd, port, ready_path="/health")
        try:
            columns[f"llama-server ({os.path.basename(gguf)})"] = run_all(
                srv.base_url, levels, requests_per_level, args.max_tokens, "none", {"ignore_eos": True})
        finally:
            srv.stop()
    elif importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp: skipped (pip install 'llama-cpp-python[server]' to compare)", flush=True)
    elif gguf is None:
        print("llama.cpp: skipped (pass --gguf FILE: the same model converted to GGUF)", flush=True)
    else:
        port = free_port()
        threads = args.num_threads or len(os.sched_getaffinity(0))
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port), "--host",
               "127.0.0.1", "--n_threads", str(threads), "--n_ctx", "4096"]
        print(f"llama.cpp: {' '.join(cmd[1:])}", flush=True)
        srv = Server(cmd, port)
        try:
            columns[f"llama.cpp ({os.path.basename(gguf)})"] = run_all(srv.base_url, levels, requests_per_level,
                                                                       args.max_tokens, "none", {})
        finally:
            srv.stop()
    print()
    print(table(columns))


def parse_args(argv=None) -> tuple[argparse.Namespace, list[int]]:
    """(args, concurrency levels), checked; --quick's values fill in only the options not given."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--compare", action="store_true", help="start our server and llama.cpp's in turn")
    ap.add_argument("--model", help="HF model directory for our server (default: the built-in model)")
    ap.add_argument("--gguf", help="the same model as GGUF for llama.cpp (default: the built-in model's GGUF)")
    ap.add_argument("--llama-server", help="a llama-server binary (bench/build_llamacpp.sh) to compare with, on --gguf "
                                           "(ours then serves the same GGUF)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="cpus per server: llama-server -t N; ours N compute threads, from 8 on N - 1 "
                         "and its HTTP thread")
    ap.add_argument("--our-threads", type=int, default=None, help="our compute threads (overrides the above)")
    # NOTE: None defaults, so that --quick can tell what was given
    ap.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,4,16,64; 1,4 with --quick)")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default ROUNDS x concurrency)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="requests per level as a multiple of its concurrency (default 4; 2 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 128; 16 with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: concurrency 1,4, rounds 2, 16 tokens, where those are not given")
    args = ap.parse_args(argv)
    for name, quick, default in (("concurrency", "1,4", "1,4,16,64"), ("rounds", 2, 4), ("max_tokens", 16, 128)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency takes comma-separated numbers such as 1,4,16, not {args.concurrency!r}.")
    if args.llama_server:
        if not (os.path.isfile(args.llama_server) and os.access(args.llama_server, os.X_OK)):
            ap.error(f"--llama-server {args.llama_server} is not an executable file; build it with "
                     f"bench/build_llamacpp.sh.")
        if not args.gguf or not os.path.isfile(args.gguf):
            ap.error("--llama-server needs --gguf FILE, the GGUF both servers run.")
        args.compare = True
    if not (args.compare or args.base_url):
        ap.error("give --base-url URL or --compare")
    return args, levels


def main(argv=None) -> int:
    args, levels = parse_args(argv)
    per_level = (lambda c: args.requests) if args.requests else (lambda c: args.rounds * c)
    if args.compare:
        compare(args, levels, per_level)
    else:
        results = run_all(args.base_url, levels, per_level, args.max_tokens, args.api_key, {})
        print()
        print(table({args.base_url: results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
