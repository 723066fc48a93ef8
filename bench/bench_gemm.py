"""Linear layer benchmark: our Linear vs the oneDNN path alone vs torch.nn.functional.linear.

    python bench/bench_gemm.py [--quick] [--threads N] [--sweep] [--level L]

--level caps our kernels' ISA level (2 AVX512_BF16, 1 AVX-512F, 0 AVX2); set
ONEDNN_MAX_CPU_ISA (AVX512_CORE, AVX2) to cap oneDNN's the same way, e.g.
`ONEDNN_MAX_CPU_ISA=AVX512_CORE python bench/bench_gemm.py --quick --level 1`.

For M <= 16 it reports GB/s of weight bytes read (unpadded N*K*elsize / time) and that as a
fraction of the DRAM read bandwidth measured in the same run; for M = 512 GFLOP/s.
`--sweep` times the streaming kernel against oneDNN for M = 1..64 on a few shapes, which is
how gemm.SMALL_M_MAX was chosen.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from limits import dram_read_gbps  # noqa: E402

from numa_runtime._kernels import gemm, ops  # noqa: E402

SHAPES = {  # model: [(layer, K, N)]
    "Qwen2.5-0.5B": [("qkv", 896, 1152), ("o_proj", 896, 896), ("gate_up", 896, 9728),
                     ("down", 4864, 896), ("lm_head", 896, 151936)],
    "SmolLM2-135M": [("qkv", 576, 960), ("o_proj", 576, 576), ("gate_up", 576, 3072),
                     ("down", 1536, 576), ("lm_head", 576, 49152)],
}
MS = [1, 16, 512]
COLD_BYTES = 256 << 20  # NOTE: M <= 16 cycles through copies of the weights totalling this
                        # much, so they come from DRAM as in decode, not from the 32 MiB L3.


def _cpu_idle_fraction(dt: float = 0.05) -> float:
    """Idle share of all CPUs over dt seconds, from /proc/stat (1.0 where unavailable)."""
    def read():
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)
    try:
        i0, t0 = read()
        time.sleep(dt)
        i1, t1 = read()
    except OSError:
        return 1.0
    return (i1 - i0) / max(1, t1 - t0)


def timeit(fn, min_time: float, max_reps: int = 20, wait_quiet: float = 2.0) -> float:
    """Best time of repeated calls, after one warm-up, for about `min_time` seconds.

    NOTE: on a machine shared with other jobs a rep is started only once the CPUs were >= 90%
    idle for 50 ms (waiting up to `wait_quiet` s): a descheduled OpenMP thread stalls a whole
    call, and best-of alone does not help when every rep is disturbed.
    """
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 3 or (spent < min_time and reps < max_reps):
        deadline = time.perf_counter() + wait_quiet
        while _cpu_idle_fraction() < 0.9 and time.perf_counter() < deadline:
            pass
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def torch_linear(w: np.ndarray, dtype: str, copies: int):
    """make(x, c) -> a closure running torch.nn.functional.linear in `dtype` over c weight
    copies, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(ops.get_num_threads())
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    wts = [torch.from_numpy(w).to(tdt, copy=True) for _ in range(copies)]

    def make(x: np.ndarray, c: int):
        xt = torch.from_numpy(x).to(tdt)
        use = wts[:c]

        def run():
            with torch.inference_mode():
                for wt in use:
                    torch.nn.functional.linear(xt, wt)
        return run
    return make


def bench_case(k: int, n: int, dtype: str, ms: list[int], min_time: float) -> dict:
    """{m: (ours, oneDNN only, torch) seconds per call}."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k), dtype=np.float32)
    if dtype == "bfloat16":
        w_in = (w.view(np.uint32) >> 16).astype(np.uint16)
        w = (w_in.astype(np.uint32) << 16).view(np.float32)
    else:
        w_in = w
    copies = max(1, min(256, -(-COLD_BYTES // w_in.nbytes)))
    lins = [gemm.Linear(w_in) for _ in range(copies)]
    make_torch = torch_linear(w, dtype, copies)
    del w, w_in
    rows = {}
    for m in ms:
        x = rng.standard_normal((m, k), dtype=np.float32)
        out = np.empty((m, n), dtype=np.float32)
        use = lins if m <= 16 else lins[:1]

        def run():
            for lin in use:
                lin.forward(x, out)
        ours = timeit(run, min_time) / len(use)
        for lin in use:
            lin.small_m_max = 0
        dnnl = timeit(run, min_time) / len(use)
        for lin in use:
            lin.small_m_max = gemm.SMALL_M_MAX
        torch_t = float("nan")
        if make_torch:
            torch_t = timeit(make_torch(x, len(use)), min_time) / len(use)
        rows[m] = (ours, dnnl, torch_t)
    return rows


def fmt_rate(k: int, n: int, m: int, dtype: str, t: float) -> float:
    if m <= 16:
        return n * k * (2 if dtype == "bfloat16" else 4) / t / 1e9
    return 2.0 * m * n * k / t / 1e9


def sweep(min_time: float) -> None:
    print("| K->N | dtype | M | stream us | oneDNN us |\n| --- | --- | --- | --- | --- |")
    for k, n in [(896, 4864), (4864, 896), (896, 1152)]:
        for dtype in ["bfloat16", "float32"]:
            w = np.ones((n, k), dtype=np.uint16 if dtype == "bfloat16" else np.float32)
            lins = [gemm.Linear(w) for _ in range(max(1, COLD_BYTES // w.nbytes))]
            for m in [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]:
                x = np.ones((m, k), dtype=np.float32)
                out = np.empty((m, n), dtype=np.float32)
                times = []
                for small_m_max in [1 << 30, 0]:
                    for lin in lins:
                        lin.small_m_max = small_m_max

                    def run():
                        for lin in lins:
                            lin.forward(x, out)
                    times.append(timeit(run, min_time) / len(lins) * 1e6)
                print(f"| {k}->{n} | {dtype} | {m} | {times[0]:.0f} | {times[1]:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Qwen shapes, bf16, short timing")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sweep", action="store_true", help="small-M threshold sweep only")
    ap.add_argument("--level", type=int, default=None, help="cap our kernels' ISA level")
    args = ap.parse_args()
    if args.level is not None:
        gemm._force_cpu_level(args.level)
    if args.threads:
        ops.set_num_threads(args.threads)
    min_time = 0.1 if args.quick else 0.4
    if args.sweep:
        sweep(min_time)
        return
    # NOTE: the DRAM limit is the best of a probe before and after the table, so a neighbour's
    # load during one probe does not inflate the fractions.
    dram = dram_read_gbps(gib=0.5 if args.quick else 1.0)
    print(f"threads={ops.get_num_threads()} cpu_level={gemm.cpu_level()} "
          f"dram_read={dram:.1f} GB/s small_m_max={gemm.SMALL_M_MAX} "
          f"oneDNN bf16/f32 usable={gemm._dnnl_usable(True)}/{gemm._dnnl_usable(False)} "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}\n")
    print("| model | layer | K->N | dtype | M | unit | ours | oneDNN only | torch | ours/DRAM |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    models = {"Qwen2.5-0.5B": SHAPES["Qwen2.5-0.5B"]} if args.quick else SHAPES
    dtypes = ["bfloat16"] if args.quick else ["bfloat16", "float32"]
    for model, layers in models.items():
        for layer, k, n in layers:
            for dtype in dtypes:
                rows = bench_case(k, n, dtype, MS, min_time)
                for m, times in rows.items():
                    rates = [fmt_rate(k, n, m, dtype, t) for t in times]
                    unit = "GB/s" if m <= 16 else "GFLOP/s"
                    frac = f"{rates[0] / dram:.0%}" if m <= 16 else ""
                    print(f"| {model} | {layer} | {k}->{n} | {dtype[:4]} | {m} | {unit} | "
                          f"{rates[0]:.1f} | {rates[1]:.1f} | {rates[2]:.1f} | {frac} |",
                          flush=True)
    dram_after = dram_read_gbps(gib=0.5 if args.quick else 1.0)
    print(f"\nDRAM read before/after: {dram:.1f} / {dram_after:.1f} GB/s; "
          f"ours/DRAM against the larger: x{dram / max(dram, dram_after):.2f} of the column")


if __name__ == "__main__":
    main()
