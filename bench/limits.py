"""Machine limits the kernels are judged against: DRAM read bandwidth and bf16 GEMM peak.

    python bench/limits.py [--threads N]      # prints JSON
    python bench/limits.py --threads 16 --working-sets 64 256 346 763 4096   # read GB/s by buffer size

The second form reads buffers of each size (MB) over and over, as decode reads a model's
weights every token: sizes that a large L3 holds in part read faster than DRAM (a "% of the
DRAM limit" above 100% for a model of that size means it came partly from cache).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from numa_runtime._kernels import gemm, ops  # noqa: E402


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def dram_read_gbps(num_threads: int | None = None, gib: float = 1.0, repeats: int = 5) -> float:
    """DRAM read bandwidth in GB/s (1e9 B/s): best of `repeats` full reads of a `gib` GiB buffer
    by ops.read_words (vector loads, each OpenMP thread a contiguous share, as the decode
    kernels stream their weights) on `num_threads` threads (default: as many as the kernels
    use). NOTE: it replaced a numpy sum in Python threads, which read 66-87 GB/s on SPR-16 while
    both runtimes' decode streamed ~120 GB/s of weights there."""
    a = np.ones(int(gib * (1 << 30)) // 8, dtype=np.uint64)  # pages touched here
    old = ops.get_num_threads()
    if num_threads:
        ops.set_num_threads(num_threads)
    try:
        ops.read_words(a)  # warm the TLB path
        return a.nbytes / _best_of(lambda: ops.read_words(a), repeats) / 1e9
    finally:
        ops.set_num_threads(old)


def read_gbps_by_size(sizes_mb: list[float], num_threads: int | None = None, repeats: int = 20) -> list[dict]:
    """For each size (MB, 1e6 B): best and median GB/s of `repeats` back-to-back full reads of
    one buffer of that size by ops.read_words (as dram_read_gbps), after one read to warm it."""
    old = ops.get_num_threads()
    if num_threads:
        ops.set_num_threads(num_threads)
    out = []
    try:
        for mb in sizes_mb:
            a = np.ones(int(mb * 1e6) // 8, dtype=np.uint64)
            ops.read_words(a)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                ops.read_words(a)
                times.append(time.perf_counter() - t0)
            out.append({"mb": mb, "best_gbps": round(a.nbytes / min(times) / 1e9, 1),
                        "median_gbps": round(a.nbytes / float(np.median(times)) / 1e9, 1)})
            del a
    finally:
        ops.set_num_threads(old)
    return out


def peak_bf16_gflops(n: int = 4096, repeats: int = 3) -> float:
    """Our Linear (oneDNN path) at a square bf16 GEMM of size n, in GFLOP/s."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, n), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    lin = gemm.Linear(w)
    x = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), dtype=np.float32)
    lin.forward(x, out)
    t = _best_of(lambda: lin.forward(x, out), repeats)
    return 2.0 * n * n * n / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="smaller buffers / GEMM")
    ap.add_argument("--working-sets", type=float, nargs="+", default=None, metavar="MB",
                    help="read bandwidth of buffers of these sizes (MB) read over and over, instead")
    args = ap.parse_args()
    if args.threads:
        ops.set_num_threads(args.threads)
    if args.working_sets:
        print(json.dumps({"threads": ops.get_num_threads(), "reads": read_gbps_by_size(args.working_sets)}, indent=2))
        return
    gib = 0.5 if args.quick else 1.0
    print(json.dumps({
        "threads": ops.get_num_threads(),
        "dram_read_gbps": round(dram_read_gbps(gib=gib), 2),
        "peak_bf16_gflops": round(peak_bf16_gflops(2048 if args.quick else 4096), 1),
    }, indent=2))


if __name__ == "__main__":
    main()
