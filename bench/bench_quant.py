"""Quantized linear benchmark: qgemm.QLinear per format vs the DRAM read probe (and bf16 Linear).

    python bench/bench_quant.py [--quick] [--threads N] [--level L] [--model NAME] [--formats F..] [--bf16-prefill] [--out PATH]
    python bench/bench_quant.py --decode-batch [--threads N] [--rows 16 32 64 512]   # each path at these row counts
    python bench/bench_quant.py --decode-batch --model Llama-3.2-1B --formats Q4_0 Q8_0 Q4_K Q5_K Q6_K Q3_K Q2_K
    python bench/bench_quant.py --bf16-prefill --m 512 --panel-mib 2 8 32 --formats int4-g32-sym bf16

For M = 1 it reports GB/s of packed weight bytes actually read (QLinear.nbytes / time: integers,
scales and offsets) and that as a fraction of the DRAM read bandwidth measured in the same run
(bench/limits.py), so "fraction of the decode limit" is counted in the bytes each format streams.
For M = 512 (prefill) it reports GFLOP/s (2 M N K / time). Weights are cycled over copies of
about 256 MiB at M = 1 so that they come from DRAM, as in decode. --level caps the ISA level
(1 AVX-512, 0 AVX2). Writes PATH.json and PATH.md when --out is given.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from bench_gemm import SHAPES, timeit  # noqa: E402
from limits import dram_read_gbps  # noqa: E402

from numa_runtime._kernels import gemm, ops, qgemm  # noqa: E402
from numa_runtime.quant.formats import QuantFormat, quantize  # noqa: E402
from numa_runtime.quant.loader import qlinear  # noqa: E402
from numa_runtime.backend import cpu  # noqa: E402

FORMATS = ["int8-g128", "int8-g32", "int8-channel", "int4-g32-sym", "int4-g32-min", "int4-g128-zero"]
# Llama-3.2-1B's K (2048, 8192) are multiples of the K-quants' 256-element super-blocks
SHAPES = dict(SHAPES, **{"Llama-3.2-1B": [("qkv", 2048, 3072), ("o_proj", 2048, 2048), ("gate_up", 2048, 16384),
                                          ("down", 8192, 2048), ("lm_head", 2048, 128256)]})


def is_gguf_type(name: str) -> bool:
    from numa_runtime.gguf_checkpoint import LOSSLESS, NEAR_LOSSLESS
    return name.upper() in LOSSLESS or name.upper() in NEAR_LOSSLESS


def parse_format(name: str) -> QuantFormat:
    """A quantize-at-load name (int4-g32-sym, int8-channel, ...) or a GGUF block type as the
    engine runs it (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL; Q2_K-Q6_K, IQ4_XS with their
    super-block scales)."""
    from numa_runtime.gguf_checkpoint import LOSSLESS, NEAR_LOSSLESS
    if name.upper() in LOSSLESS:
        return LOSSLESS[name.upper()][0]
    if name.upper() in NEAR_LOSSLESS:
        return replace(NEAR_LOSSLESS[name.upper()][0], ks=256)
    return QuantFormat.parse(name)


COLD_BYTES = 256 << 20


def build(fmt_name: str, k: int, n: int, copies_for: int, bf16: bool = False):
    """(list of linears over copies of one weight, bytes read per call)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
    if fmt_name == "bf16":
        lin = gemm.Linear((w.view(np.uint32) >> 16).astype(np.uint16))
        nbytes = n * k * 2
        make = lambda: gemm.Linear((w.view(np.uint32) >> 16).astype(np.uint16))  # noqa: E731
    else:
        # NOTE: a group that does not divide K falls back to 64/32 (as quantization="int8" does); a
        # GGUF type keeps its blocks (parse_format; --formats Q4_0 failed here)
        fmt = parse_format(fmt_name)
        fmt = (fmt if is_gguf_type(fmt_name) else replace(fmt, fit_group=True)).for_k(k)
        qw = quantize(w, fmt)
        lin = qlinear(cpu, qw, bf16=bf16)
        nbytes = lin.nbytes
        make = lambda: qlinear(cpu, qw, bf16=bf16)  # noqa: E731
    copies = max(1, min(256, -(-copies_for // nbytes)))
    return [lin] + [make() for _ in range(copies - 1)], nbytes


def bench(model: str, formats: list[str], ms: list[int], min_time: float, bf16: bool = False) -> list[dict]:
    rows = []
    for layer, k, n in SHAPES[model]:
        for f in formats:
            lins, nbytes = build(f, k, n, COLD_BYTES, bf16)
            for m in ms:
                x = np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)
                out = np.empty((m, n), np.float32)
                use = lins if m == 1 else lins[:1]

                def run():
                    for lin in use:
                        lin.forward(x, out)
                t = timeit(run, min_time) / len(use)
                rows.append({"layer": layer, "K": k, "N": n, "format": f, "M": m, "us": t * 1e6,
                             "bytes": nbytes, "gbps": nbytes / t / 1e9,
                             "gflops": 2.0 * m * n * k / t / 1e9})
                print(json.dumps(rows[-1]), flush=True)
    return rows


PATHS = ("f32", "int8", "int8_no_amx", "int8_generic", "int8_no_tiles", "bf16_tiles", "panels")
DECODE_BATCH_FORMATS = ("int4-g32-sym", "int8-channel")


def decode_batch(model: str, rows=(16, 32, 64), formats=DECODE_BATCH_FORMATS,
                 rounds: int = 3) -> list[dict]:
    """One linear per shape of `model` (gate_up, down) at several row counts: us on the f32
    tile path, on int8 activations as the engine runs them (AMX-INT8 matrix tiles where present,
    qgemm_amx.h, else VNNI row tiles, qgemm_q8tile.h), on the VNNI row tiles with AMX off ("-"
    without AMX), on the generic VNNI kernel of the row tiles or, at 8 rows or fewer, of the decode
    rows (AMX off; "-" where the lean ones do not take the format, or no VNNI), on the decode kernel alone (tiles off; "-" where it is the same kernel: 8 rows
    or fewer, or no VNNI), on the AMX-BF16 tiles (qgemm_amxbf16.h; "-" without AMX-BF16) and on
    the bf16 panels (oneDNN, AMX where present); the int8 and bf16 rows in GMAC/s too. Rows beyond a decode batch (64) take int8 as prefill_activations="int8" would."""
    out = []
    shapes = [s for s in SHAPES[model] if s[0] in ("gate_up", "down")]
    tiled = qgemm.cpu_level() >= 2
    for layer, k, n in shapes:
        w = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32) * 0.05
        for name in formats:
            fmt = parse_format(name)
            lin = qlinear(cpu, quantize(w, fmt.for_k(k)), bf16=True)
            lean = lin.lean_tiles
            for m in rows:
                x = np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)
                r = {"layer": layer, "K": k, "N": n, "format": name, "M": m}
                # NOTE: the paths alternate over `rounds` rounds and each keeps its best: a shared
                # host's load moves one timing of a path by more than the gaps between paths
                for path in [p for _ in range(rounds) for p in PATHS]:
                    if (path in ("panels", "bf16_tiles") and m < qgemm.PANEL_M_MIN) or \
                            (path == "bf16_tiles" and not qgemm.has_amx_bf16()) or \
                            (path == "int8_no_amx" and (m <= qgemm.ACT8_M_MAX or not qgemm.has_amx())) or \
                            (path == "int8_no_tiles" and (m <= qgemm.ACT8_M_MAX or not tiled)) or \
                            (path == "int8_generic" and (not tiled or not lean)):
                        r[path] = None
                        continue
                    lin.act8, lin.prefill_bf16 = path.startswith("int8"), path in ("panels", "bf16_tiles")
                    old_b = qgemm._set_amx_bf16(path == "bf16_tiles")
                    old = qgemm.set_decode_step(path.startswith("int8"))
                    old_m = qgemm._set_act8_m_max(m if path.startswith("int8") else qgemm.ACT8_M_MAX)
                    old_t = qgemm._set_q8_tiles(path != "int8_no_tiles")
                    old_a = qgemm._set_amx(path not in ("int8_no_amx", "int8_generic"))
                    old_l = qgemm._set_q8t_lean(path != "int8_generic")
                    old_dl = qgemm._set_q8_lean(path != "int8_generic")
                    try:
                        t = timeit(lambda: lin.forward(x), 0.3 / rounds) * 1e6
                        r[path] = t if r.get(path) is None else min(r[path], t)
                    finally:
                        qgemm.set_decode_step(old)
                        qgemm._set_act8_m_max(old_m)
                        qgemm._set_q8_tiles(old_t)
                        qgemm._set_amx(old_a)
                        qgemm._set_amx_bf16(old_b)
                        qgemm._set_q8t_lean(old_l)
                        qgemm._set_q8_lean(old_dl)
                out.append(r)
                cell = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
                gmac = lambda v: "-" if v is None else f"{m * k * n / v / 1e3:.0f}"  # noqa: E731
                print(f"| {layer} | {k} x {n} | {name} | {m} | {cell(r['f32'])} | {cell(r['int8'])} "
                      f"({gmac(r['int8'])}) | {cell(r['int8_no_amx'])} ({gmac(r['int8_no_amx'])}) | "
                      f"{cell(r['int8_generic'])} ({gmac(r['int8_generic'])}) | "
                      f"{cell(r['int8_no_tiles'])} ({gmac(r['int8_no_tiles'])}) | "
                      f"{cell(r['bf16_tiles'])} ({gmac(r['bf16_tiles'])}) | "
                      f"{cell(r['panels'])} ({gmac(r['panels'])}) |", flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one model, two formats, short timing")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--level", type=int, default=None, help="cap the qgemm ISA level")
    ap.add_argument("--model", default=None, choices=sorted(SHAPES),
                    help="shapes to measure (default Qwen2.5-0.5B; SmolLM2-135M with --quick)")
    ap.add_argument("--bf16-prefill", action="store_true",
                    help="quantized linears as a bf16 engine builds them: large M on bf16 panels")
    ap.add_argument("--formats", nargs="+", default=None,
                    help="formats to run (default: all; with --decode-batch int4-g32-sym int8-channel); "
                         "GGUF types (Q4_K, Q6_K, ...) as the engine runs them")
    ap.add_argument("--decode-batch", action="store_true",
                    help="row counts of --rows: f32 path / int8 activations (row tiles, and without) / bf16 panels (us)")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64],
                    help="with --decode-batch: rows per call (default 16 32 64; 512: a prefill)")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 512],
                    help="rows per call (default 1 512) of linears as a float32 engine builds them (f32 "
                         "activations); a bf16 engine's paths: --bf16-prefill, --decode-batch")
    ap.add_argument("--panel-mib", type=float, nargs="+", default=None,
                    help="with --bf16-prefill: each size of the bf16 panel in turn (default: qgemm's rule per thread count)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        ops.set_num_threads(args.threads)
    if args.level is not None:
        qgemm._force_cpu_level(args.level)
    if args.decode_batch:
        print("| layer | K x N | format | rows | f32 us | int8 activations us (GMAC/s) | "
              "int8 on VNNI row tiles, AMX off, us (GMAC/s) | the generic VNNI kernel us (GMAC/s) | "
              "int8 without row tiles us (GMAC/s) | bf16 on AMX-BF16 tiles us (GMAC/s) | bf16 panels us (GMAC/s) |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        decode_batch(args.model or "Qwen2.5-0.5B", tuple(args.rows), tuple(args.formats or DECODE_BATCH_FORMATS))
        return
    formats = args.formats or (["int8-g128", "int4-g32-min"] if args.quick else FORMATS + ["bf16"])
    # NOTE: --quick measures SmolLM2-135M's shapes unless a model is named (the report named the default)
    model = args.model or ("SmolLM2-135M" if args.quick else "Qwen2.5-0.5B")
    ms = args.m
    dram = dram_read_gbps(args.threads, gib=0.25 if args.quick else 1.0)
    rows = []
    for mib in args.panel_mib or [None]:
        qgemm._PANEL_BYTES, qgemm._PANELS = None if mib is None else int(mib * 2 ** 20), {}
        for r in bench(model, formats, ms,
                       0.05 if args.quick else 0.5, args.bf16_prefill):
            rows.append(dict(r, panel_mib=qgemm._panel_bytes() / 2 ** 20))
    for r in rows:
        r["dram_fraction"] = r["gbps"] / dram if r["M"] == 1 else None
    report = {"config": {"threads": ops.get_num_threads(), "qgemm_level": qgemm.cpu_level(),
                         "bf16_prefill": args.bf16_prefill,
                         "model": model, "dram_read_gbps": dram}, "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"{model}: DRAM read probe {dram:.1f} GB/s, {report['config']['threads']} threads, "
                    f"qgemm level {qgemm.cpu_level()}\n\n| layer | K x N | format | M | panel MiB | us | GB/s | "
                    f"of DRAM | GFLOP/s |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
            for r in rows:
                frac = f"{r['dram_fraction']:.0%}" if r["dram_fraction"] else ""
                f.write(f"| {r['layer']} | {r['K']} x {r['N']} | {r['format']} | {r['M']} | {r['panel_mib']:g} | "
                        f"{r['us']:.1f} | {r['gbps']:.1f} | {frac} | {r['gflops']:.1f} |\n")


if __name__ == "__main__":
    main()
