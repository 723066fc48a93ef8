"""numa_runtime vs llama.cpp on the same GGUF files, same thread count, one run.

    bench/build_llamacpp.sh SRC_DIR BUILD_DIR                      # llama-bench, llama-quantize, ...
    python bench/bench_llamacpp.py --llama-bin BUILD_DIR/bin --shape qwen0.5b --threads 16
    python bench/bench_llamacpp.py --llama-bin BUILD_DIR/bin --depth 8192 16000 --types bf16
    python bench/bench_llamacpp.py --shape tiny --quick            # our half only (no --llama-bin)

The model (--model DIR, or a random one of --shape) is written once as a bf16 GGUF, then
`llama-quantize` makes Q8_0 and Q4_0 files from it with llama.cpp's default rules (the tensor
types it chose are recorded). For each file, one after the other, each in its own process:
  llama.cpp  llama-bench -m FILE -p 512 -n 64 -t T -r R -o json: decode (tg) and prefill (pp) tok/s;
  ours       Engine(FILE): batch-1 decode tok/s (after an 8-token prompt) and the prefill of one
             512-token prompt (time to its first token), mean of R after a warm-up.
Extra rows: ours quantized at load (quantization="int8" / "int4") from the bf16 safetensors,
against llama.cpp Q8_0 / Q4_0. Our decode is also given as a fraction of the DRAM read limit
(bench/limits.py, same run) in the bytes our engine reads per token: its packed linears,
lm_head included (plus the KV cache at depth). --op-by-op adds each quantized row of ours run
again with NUMA_RUNTIME_FUSED_DECODE=0 (decode steps op by op instead of one OpenMP region);
--prefill-int8 adds it again with prefill_activations="int8" (int8 prefill activations, as
llama.cpp's; the default is bf16); --one-step adds each GGUF row again with
num_scheduler_steps=1 (one decode step per scheduling round; the default runs up to 8, as a
burst). --rounds R alternates decode only R - 1 more times after each file's first pass
(llama-bench, then each of our rows on that file) and reports medians and the range of the
paired ratios: a shared host's load moves both runtimes by more than the gap between them.
--depth D...: llama.cpp's prefill of D tokens (-p D -n 0) and decode after D tokens
(-p 0 -n G -d D), flash attention off and on (-fa 0,1), against ours (the --depth-type file,
bf16 by default): prefill of D tokens, then decode right after it. Writes OUT.json and OUT.md and prints the markdown.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from statistics import median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.common import CACHE, build_once, write_report  # noqa: E402
from bench import common  # noqa: E402

QUANT_TYPES = {"bf16": None, "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M",
               "q6_k": "Q6_K", "q3_k_m": "Q3_K_M", "q2_k": "Q2_K", "iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL"}
AT_LOAD = {"int8": "q8_0", "int4": "q4_0"}  # ours quantized at load -> the llama.cpp row it faces
LONG_CONTEXT = 32768
# --op-by-op: our quantized rows again with decode steps run op by op (models/llama.py)
OP_BY_OP = {"NUMA_RUNTIME_FUSED_DECODE": "0"}
SHAPE_DICTS = {"qwen0.5b": common.QWEN05B, "llama3.2-1b": common.LLAMA1B, "tiny": common.TINY,
               "qwen3-moe-6l": common.QWEN3_MOE_6L}


# ----------------------------------------------------------------------------- files
def model_dir_for(args) -> str:
    """--model DIR, else the random model of --shape with room for long contexts (built once)."""
    if args.model:
        d = os.path.abspath(os.path.expanduser(args.model))
        if not os.path.isfile(os.path.join(d, "config.json")):
            raise SystemExit(f"--model {args.model}: no config.json there; give a Hugging Face model directory.")
        return d
    shape = dict(SHAPE_DICTS[args.shape], max_position_embeddings=max(
        SHAPE_DICTS[args.shape]["max_position_embeddings"], LONG_CONTEXT if args.shape != "tiny" else 0))
    name = args.shape if args.shape == "tiny" else f"{args.shape}-32k"
    return build_once(os.path.join(CACHE, name), name, shape)


def tool(bin_dir: str | None, name: str) -> str | None:
    path = os.path.join(bin_dir, name) if bin_dir else None
    return path if path and os.access(path, os.X_OK) else None


def make_ggufs(model_dir: str, work: str, types: list[str], quantize_bin: str | None, threads: int) -> dict:
    """{type: path} of the GGUF files (written once into `work`); types without llama-quantize
    are left out with a note."""
    from bench.bench_compare import hf_to_gguf
    os.makedirs(work, exist_ok=True)
    files = {}
    bf16 = os.path.join(work, "model-bf16.gguf")
    if not os.path.exists(bf16):
        hf_to_gguf(model_dir, bf16 + ".tmp")
        os.replace(bf16 + ".tmp", bf16)
    files["bf16"] = bf16
    for t in types:
        if QUANT_TYPES[t] is None:
            continue
        out = os.path.join(work, f"model-{t}.gguf")
        if not os.path.exists(out):
            if quantize_bin is None:
                print(f"{t}: skipped (no llama-quantize; give --llama-bin)", flush=True)
                continue
            p = subprocess.run([quantize_bin, bf16, out + ".tmp", QUANT_TYPES[t], str(threads)],
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"llama-quantize {QUANT_TYPES[t]} failed: {p.stderr.strip()[-2000:]}")
            os.replace(out + ".tmp", out)
        files[t] = out
    return {t: files[t] for t in types if t in files}


def tensor_types(path: str) -> dict:
    """{tensor role: {type: count}} of a GGUF file (blk.N. dropped from the names)."""
    import gguf
    roles: dict[str, Counter] = {}
    for t in gguf.GGUFReader(path).tensors:
        role = t.name.split(".", 2)[2] if t.name.startswith("blk.") else t.name
        roles.setdefault(role, Counter())[t.tensor_type.name] += 1
    return {r: dict(c) for r, c in sorted(roles.items())}


# ----------------------------------------------------------------------------- llama.cpp
def llama_bench(bench_bin: str, path: str, threads: int, extra: list[str], timeout: int) -> list[dict]:
    """llama-bench's JSON records for one file (one per test)."""
    cmd = [bench_bin, "-m", path, "-t", str(threads), "-o", "json", *extra]
    print("  $ " + " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [{"error": f"timed out after {timeout} s", "cmd": cmd}]
    if p.returncode != 0:
        return [{"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1], "cmd": cmd}]
    keep = ("n_prompt", "n_gen", "n_depth", "flash_attn", "avg_ts", "stddev_ts", "n_threads", "type_k",
            "model_size", "build_commit", "build_number", "cpu_info")
    return [{k: r.get(k) for k in keep} for r in json.loads(p.stdout)]


def pick(records: list[dict], **want) -> dict | None:
    for r in records:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def fa_label(v) -> str:
    """llama-bench's flash_attn field: -1 auto, 0 off, 1 on."""
    return {-1: "auto", 0: "off", 1: "on"}.get(v, str(v))


# ----------------------------------------------------------------------------- ours (child)
def child(a) -> dict:
    """One process: Engine on one file (or the bf16 safetensors quantized at load); time decode,
    prefill and the --depth runs."""
    import numpy as np
    from numa_runtime import Engine, SamplingParams
    longest = max([a.prefill, *a.depth]) + a.gen + 16
    eng = Engine(a.model_path, dtype="bfloat16", num_threads=a.threads, max_model_len=longest,
                 enable_prefix_caching=False, quantization=a.quantization,
                 prefill_activations=a.prefill_activations or "bf16", num_scheduler_steps=a.num_scheduler_steps)
    rng = np.random.default_rng(0)
    vocab = eng.model_config.vocab_size

    def run(prompt_len: int, gen: int) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s after it) of one request alone."""
        eng.add_request(rng.integers(3, vocab, prompt_len).tolist(),
                        SamplingParams(temperature=0, max_tokens=gen + 1, ignore_eos=True))
        t0, steps, n = time.perf_counter(), [], 0
        while eng.has_unfinished_requests():
            outs = eng.step()
            # NOTE: tokens so far (a step may bring several: decode bursts, num_scheduler_steps)
            n = max([n] + [len(o.token_ids) for o in outs])
            steps.append((time.perf_counter(), n))
        first = next(i for i, (_, k) in enumerate(steps) if k > 0)  # the step of the first token
        decoded = steps[-1][1] - steps[first][1]
        return prompt_len / (steps[first][0] - t0), decoded / (steps[-1][0] - steps[first][0]) if decoded else 0.0

    m = eng.model_config
    # the packed linears one decode step streams, lm_head included (of a mixture of experts, the
    # num_experts_per_tok experts a token's row reads in each sparse layer)
    size = lambda x: getattr(x, "nbytes", 0) or x.weight.nbytes  # noqa: E731
    nbytes = every = sum(size(x) for x in eng.runner.model._linears())
    for layer in eng.runner.model.layers:
        moe = getattr(layer, "moe", None)
        if moe is not None:
            routed = sum(size(x) for pair in moe.experts for x in pair)
            nbytes -= routed - routed * m.num_experts_per_tok // m.num_experts
    out = {"bytes_per_token": nbytes, "active_fraction": nbytes / every,
           "prefill_int8": bool(getattr(eng.runner.model, "prefill_int8", False)),
           "kv_bytes_per_context_token": 2 * m.num_layers * m.kv_size * 2,  # K and V, bf16
           "depth": {}}
    run(8 if a.decode_only else a.prefill, 4)  # warm-up: kernel primitives for these shapes, first-touch pages
    decode = [run(8, a.gen)[1] for _ in range(a.reps)]
    prefill = [] if a.decode_only else [run(a.prefill, 0)[0] for _ in range(a.reps)]
    out.update(decode_tok_s=float(np.mean(decode)), decode_all=decode,
               prefill_tok_s=float(np.mean(prefill)) if prefill else None, prefill_all=prefill)
    for d in a.depth:
        runs = [run(d, a.gen) for _ in range(a.depth_reps)]
        out["depth"][str(d)] = {"prefill_tok_s": float(np.mean([r[0] for r in runs])),
                                "decode_tok_s": float(np.mean([r[1] for r in runs]))}
    eng.close()
    return out


def run_ours(a, path: str, quantization: str | None, depth: list[int], env_extra: dict | None = None,
             prefill: str = "bf16", steps: int = 8, decode_only: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model-path", path,
           "--threads", str(a.threads), "--prefill", str(a.prefill), "--gen", str(a.gen),
           "--reps", str(a.reps), "--depth-reps", str(a.depth_reps)]
    cmd += ["--quantization", quantization] if quantization else []
    cmd += ["--prefill-activations", prefill, "--num-scheduler-steps", str(steps)]
    cmd += ["--decode-only"] if decode_only else []
    cmd += ["--depth", *map(str, depth)] if depth else []
    print(f"  ours: Engine({os.path.basename(path)!r}, quantization={quantization!r}, prefill_activations={prefill!r})"
          + (f", depth {depth}" if depth else ""), flush=True)
    # NOTE: the child sees this checkout first and the caller's PYTHONPATH after it
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=path, PYTHONUNBUFFERED="1", **(env_extra or {}))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"error": ((p.stderr or p.stdout).strip().splitlines() or [f"exit {p.returncode}"])[-1]}
    return json.loads(lines[-1][7:])


# ----------------------------------------------------------------------------- driver
def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def num(x, fmt="{:.1f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def alternate(a, bench_bin: str | None, path: str, rows: list[dict]) -> None:
    """--rounds R: R - 1 more rounds of decode only, llama-bench then each of `rows` (ours on this
    file), one after the other, so that both runtimes meet the host's load in turn. Each row gets
    `pairs`: (llama.cpp, ours) decode tok/s of every round, the first pass included."""
    if a.rounds < 2 or not bench_bin:
        return
    for row in rows:
        lc, o = (row["llama_cpp"] or {}).get("decode"), row["ours_result"]
        row["pairs"] = [(lc["avg_ts"], o["decode_tok_s"])] if lc and "error" not in o else []
    for r in range(1, a.rounds):
        print(f"  decode round {r + 1} of {a.rounds}", flush=True)
        recs = llama_bench(bench_bin, path, a.threads, ["-p", "0", "-n", str(a.gen), "-r", str(a.reps)], a.timeout)
        ld = (pick(recs, n_gen=a.gen) or {}).get("avg_ts")
        for row in rows:
            steps = 1 if "one step" in row["ours"] else 8
            o = run_ours(a, path, None, [], steps=steps, decode_only=True)
            if ld and "error" not in o:
                row["pairs"].append((ld, o["decode_tok_s"]))


def measure(a) -> dict:
    from bench.limits import dram_read_gbps
    model_dir = model_dir_for(a)
    bench_bin, quant_bin = tool(a.llama_bin, "llama-bench"), tool(a.llama_bin, "llama-quantize")
    if a.llama_bin and not (bench_bin and quant_bin):
        raise SystemExit(f"--llama-bin {a.llama_bin}: no llama-bench and llama-quantize there; "
                         f"build them with bench/build_llamacpp.sh.")
    work = a.work or os.path.join(model_dir, "gguf")
    report = {"model": model_dir, "threads": a.threads, "llama_bin": a.llama_bin,
              "llama_cpp_build": None, "files": {}, "rows": [], "depth": {},
              "skipped": None if bench_bin else "llama.cpp binaries not given (--llama-bin): our half only"}
    dram = report["dram_read_gbps"] = dram_read_gbps(a.threads, gib=0.25 if a.quick else 1.0)
    print(f"model {model_dir}, {a.threads} threads, DRAM read {dram:.1f} GB/s", flush=True)
    files = make_ggufs(model_dir, work, a.types, quant_bin, a.threads)
    for t, path in files.items():
        report["files"][t] = {"path": path, "bytes": os.path.getsize(path), "tensor_types": tensor_types(path)}
    llama = {}
    for t, path in files.items():
        print(f"{t}: {path}", flush=True)
        if bench_bin:
            recs = llama_bench(bench_bin, path, a.threads, ["-p", str(a.prefill), "-n", str(a.gen),
                                                            "-r", str(a.reps)], a.timeout)
            llama[t] = {"records": recs, "decode": pick(recs, n_gen=a.gen), "prefill": pick(recs, n_prompt=a.prefill)}
            report["llama_cpp_build"] = report["llama_cpp_build"] or next(
                ({k: r.get(k) for k in ("build_commit", "build_number", "cpu_info")} for r in recs if "error" not in r), None)
        ours = run_ours(a, path, None, a.depth if t == a.depth_type else [])
        report["rows"].append({"ours": f"{t.upper()} GGUF", "file": t, "quantization": None, "ours_result": ours,
                               "llama_cpp": llama.get(t)})
        if a.op_by_op and t != "bf16":
            report["rows"].append({"ours": f"{t.upper()} GGUF, op by op", "file": t, "quantization": None,
                                   "ours_result": run_ours(a, path, None, [], OP_BY_OP), "llama_cpp": llama.get(t)})
        if a.prefill_int8 and t != "bf16":
            report["rows"].append({"ours": f"{t.upper()} GGUF, int8 prefill", "file": t, "quantization": None,
                                   "ours_result": run_ours(a, path, None, [], prefill="int8"), "llama_cpp": llama.get(t)})
        if a.one_step:
            report["rows"].append({"ours": f"{t.upper()} GGUF, one step a round", "file": t, "quantization": None,
                                   "ours_result": run_ours(a, path, None, [], steps=1), "llama_cpp": llama.get(t)})
        alternate(a, bench_bin, path, [row for row in report["rows"] if row["file"] == t and row["quantization"] is None
                                       and "op by op" not in row["ours"] and "int8 prefill" not in row["ours"]])
    if not a.no_load_quant:
        for q, t in AT_LOAD.items():
            if t not in a.types:
                continue
            ours = run_ours(a, model_dir, q, [])
            report["rows"].append({"ours": f"{q} at load (bf16 safetensors)", "file": t, "quantization": q,
                                   "ours_result": ours, "llama_cpp": llama.get(t)})
            if a.op_by_op:
                report["rows"].append({"ours": f"{q} at load, op by op", "file": t, "quantization": q,
                                       "ours_result": run_ours(a, model_dir, q, [], OP_BY_OP),
                                       "llama_cpp": llama.get(t)})
            if a.prefill_int8:
                report["rows"].append({"ours": f"{q} at load, int8 prefill", "file": t, "quantization": q,
                                       "ours_result": run_ours(a, model_dir, q, [], prefill="int8"),
                                       "llama_cpp": llama.get(t)})
    if a.depth and bench_bin and a.depth_type in files:
        fa = ["-fa", "0,1"]
        ds = ",".join(map(str, a.depth))
        pre = llama_bench(bench_bin, files[a.depth_type], a.threads,
                          ["-p", ds, "-n", "0", "-r", str(a.depth_reps), "--no-warmup", *fa], a.timeout * 4)
        dec = llama_bench(bench_bin, files[a.depth_type], a.threads,
                          ["-p", "0", "-n", str(a.gen), "-d", ds, "-r", str(a.depth_reps), *fa], a.timeout * 4)
        report["depth"] = {"prefill": pre, "decode": dec}
    return report


def markdown(r: dict, a) -> str:
    dram = r["dram_read_gbps"]
    lines = [f"model `{r['model']}`, {r['threads']} threads, DRAM read {dram:.1f} GB/s (bench/limits.py)"]
    if r["llama_cpp_build"]:
        b = r["llama_cpp_build"]
        lines.append(f"llama.cpp build {b.get('build_number')} ({b.get('build_commit')}), {b.get('cpu_info')}")
    if r["skipped"]:
        lines.append(f"llama.cpp: {r['skipped']}")
    lines += ["", f"| ours | vs llama.cpp | llama.cpp decode tok/s | ours decode tok/s | ours/llama.cpp | "
              f"llama.cpp prefill {a.prefill} tok/s | ours prefill tok/s | ours/llama.cpp | "
              f"ours MB read/token | ours decode of DRAM limit | llama.cpp decode of DRAM limit |", "|" + " --- |" * 11]
    for row in r["rows"]:
        o, lc = row["ours_result"], row["llama_cpp"] or {}
        ld, lp = (lc.get("decode") or {}).get("avg_ts"), (lc.get("prefill") or {}).get("avg_ts")
        if "error" in o:
            lines.append(f"| {row['ours']} | {row['file'].upper()} | {num(ld)} | error: {o['error'][:120]} |"
                         + " - |" * 7)
            continue
        limit = dram * 1e9 / o["bytes_per_token"]
        # llama.cpp reads its whole file's tensors a token (model_size: llama-bench's count), of a
        # mixture of experts the share of it ours reads (k of E experts)
        lsize = (lc.get("decode") or {}).get("model_size")
        lsize = lsize and lsize * o.get("active_fraction", 1.0)
        lfrac = f"{ld * lsize / (dram * 1e9):.0%}" if ld and lsize else "-"
        od, dr = o["decode_tok_s"], ratio(o["decode_tok_s"], ld)
        pairs = row.get("pairs") or []
        if len(pairs) > 1:  # --rounds: medians over the paired rounds, and the range of the ratios
            rs = sorted(b / c for c, b in pairs)
            ld, od = median([c for c, _ in pairs]), median([b for _, b in pairs])
            dr = f"{median(rs):.2f}x ({rs[0]:.2f}-{rs[-1]:.2f}x, {len(rs)} rounds)"
        lines.append(f"| {row['ours']} | {row['file'].upper()} | {num(ld)} | {od:.1f} | "
                     f"{dr} | {num(lp, '{:.0f}')} | {o['prefill_tok_s']:.0f} | "
                     f"{ratio(o['prefill_tok_s'], lp)} | {o['bytes_per_token'] / 1e6:.3g} | "
                     f"{od / limit:.0%} | {lfrac} |")
    fas = sorted({fa_label((row["llama_cpp"] or {}).get("decode", {}).get("flash_attn")) for row in r["rows"]
                  if (row["llama_cpp"] or {}).get("decode")})
    if fas:
        lines.append(f"\nllama-bench flash attention: {', '.join(fas)} (its default); ours and llama.cpp: mean of "
                     f"{a.reps} runs after a warm-up")
    errors = [f"- llama-bench on {row['file']}: {x['error']}" for row in r["rows"] if row["llama_cpp"]
              for x in row["llama_cpp"]["records"] if "error" in x]
    errors += [f"- llama-bench at depth ({k}): {x['error']}" for k, recs in r["depth"].items() for x in recs
               if "error" in x]
    lines += ["", "Errors:", *errors] if errors else []
    lines += ["", "llama-quantize's tensor types (role: type x count):"]
    for t, f in r["files"].items():
        types = ", ".join(f"{role} {'/'.join(f'{k}x{v}' for k, v in c.items())}"
                          for role, c in f["tensor_types"].items() if not role.endswith("norm.weight"))
        lines.append(f"- {t.upper()} ({f['bytes'] / 1e6:.0f} MB): {types}")
    bf16 = next((row["ours_result"] for row in r["rows"] if row["file"] == a.depth_type and not row["quantization"]), {})
    if a.depth and bf16.get("depth"):
        pre, dec = r["depth"].get("prefill", []), r["depth"].get("decode", [])
        lines += ["", f"Long context, {a.depth_type.upper()} GGUF, batch 1 (ours: prefill of D tokens, then decode right after; "
                  "llama.cpp: -p D -n 0 and -p 0 -n G -d D)", "",
                  "| D | metric | llama.cpp fa off | llama.cpp fa on | ours | ours / better llama.cpp | "
                  "ours decode of DRAM limit (weights + KV) |", "|" + " --- |" * 7]
        for d in a.depth:
            od = bf16["depth"].get(str(d), {})
            for metric, recs, want, key in (("decode tok/s", dec, dict(n_depth=d, n_gen=a.gen), "decode_tok_s"),
                                            ("prefill tok/s", pre, dict(n_prompt=d), "prefill_tok_s")):
                vals = {fa: (pick(recs, flash_attn=fa, **want) or {}).get("avg_ts") for fa in (0, 1)}
                best = max([v for v in vals.values() if v] or [0])
                limit = ""
                if key == "decode_tok_s" and od.get(key):
                    nbytes = bf16["bytes_per_token"] + bf16["kv_bytes_per_context_token"] * d
                    limit = f"{od[key] / (dram * 1e9 / nbytes):.0%}"
                lines.append(f"| {d} | {metric} | {num(vals[0])} | {num(vals[1])} | {num(od.get(key))} | "
                             f"{ratio(od.get(key), best)} | {limit} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="Hugging Face model directory (bf16 safetensors)")
    ap.add_argument("--shape", default="qwen0.5b", choices=sorted(SHAPE_DICTS),
                    help="random model when --model is not given (default qwen0.5b)")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMACPP_BIN"),
                    help="folder with llama-bench and llama-quantize (default $LLAMACPP_BIN); "
                         "left out: our half only")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--types", nargs="+", default=["bf16", "q8_0", "q4_0"], choices=list(QUANT_TYPES),
                    help="GGUF types to compare (q2_k, q3_k_m, q4_k_m, q5_k_m, q6_k, iq4_xs, iq4_nl: llama-quantize's mixes)")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--depth", type=int, nargs="*", default=[], help="long-context runs, e.g. 8192 16000")
    ap.add_argument("--depth-reps", type=int, default=1)
    ap.add_argument("--depth-type", default="bf16", choices=list(QUANT_TYPES),
                    help="the GGUF type of the --depth runs (one of --types; default bf16)")
    ap.add_argument("--no-load-quant", action="store_true", help="skip ours quantized at load (int8/int4)")
    ap.add_argument("--op-by-op", action="store_true",
                    help="each quantized row of ours again with NUMA_RUNTIME_FUSED_DECODE=0 (decode op by op)")
    ap.add_argument("--prefill-int8", action="store_true",
                    help="each quantized row of ours again with prefill_activations='int8'")
    ap.add_argument("--rounds", type=int, default=1,
                    help="decode side by side in R rounds (llama-bench, then ours, R - 1 more times "
                         "after the first pass): medians and the range of the paired ratios")
    ap.add_argument("--one-step", action="store_true",
                    help="each GGUF row of ours again with num_scheduler_steps=1 (no decode bursts)")
    ap.add_argument("--work", help="where the GGUF files go (default MODEL_DIR/gguf)")
    ap.add_argument("--quick", action="store_true", help="small probe, 32/8 tokens, 1 repeat (a smoke run)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    ap.add_argument("--out", default="/tmp/bench_llamacpp", help="writes OUT.json and OUT.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--quantization", help=argparse.SUPPRESS)
    ap.add_argument("--prefill-activations", help=argparse.SUPPRESS)
    ap.add_argument("--num-scheduler-steps", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.prefill, a.gen, a.reps = 32, 8, 1
    for name in ("threads", "prefill", "gen", "reps", "depth_reps", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1.")
    if any(d < 1 for d in a.depth):
        ap.error("--depth values must be positive token counts.")
    if a.depth and a.depth_type not in a.types:
        ap.error(f"--depth-type {a.depth_type} must be one of --types ({' '.join(a.types)}).")
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    a.llama_bin = os.path.abspath(os.path.expanduser(a.llama_bin)) if a.llama_bin else None
    report = measure(a)
    md = markdown(report, a)
    print()
    print(md)
    write_report(a.out, report, md)


if __name__ == "__main__":
    main()
