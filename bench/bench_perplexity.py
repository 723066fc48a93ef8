"""Perplexity of the real SmolLM2-135M-Instruct (the default model's Q4_1 GGUF) on real English
text, computed as llama.cpp's `llama-perplexity` does: the text's first tokens cut into
non-overlapping chunks of n_ctx, each chunk one forward pass, only the second half of each
chunk scored (every scored token sees at least n_ctx / 2 tokens before it).

    python bench/bench_perplexity.py                                  # bf16, int8, int4
    python bench/bench_perplexity.py --variants bf16 int8 int8-channel int8-g32 int4
    python bench/bench_perplexity.py --llama-perplexity /path/to/llama-perplexity
    python bench/bench_perplexity.py --variants bf16 --kv-cache-dtype bfloat16 int8   # KV drift
    python bench/bench_perplexity.py --variants int4 int8 --prefill-activations bf16 int8   # int8 prefill
    python bench/bench_perplexity.py --variants f32 gguf-f32 gguf-bf16 --gguf smollm2-q6_k.gguf

Variants: "bf16" and "f32" run the GGUF's weights dequantized into a bf16 Hugging Face directory
(default_model_dir()) in that dtype; "int4" runs the GGUF's Q4_1 blocks as they are (Engine's
default); any other name (int8, int8-channel, int8-g32, int4-g128-sym, ...) is quantized at
load from that bf16 directory, the lm_head as --lm-head-quantization says. With
--llama-perplexity, that binary runs on the same GGUF, text, n_ctx and number of chunks.

"gguf-f32" / "gguf-bf16" run the file --gguf (the same model in another GGUF type, e.g. made by
llama-quantize from the bf16 directory) in that dtype, each tensor at its own bit width (Q5_x as
int5, Q6_K as int6, Q2_K/Q3_K as int4 groups of 16, IQ4 as int4 "nl" levels).

--kv-cache-dtype runs every variant with each KV cache dtype given (auto: the variant's dtype)
and reports, beside each perplexity, the drift of the scored tokens' log-probs from the first
KV dtype's on the same weights: mean and max |log p - log p_ref| over every scored token.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import write_report  # noqa: E402

TEXT = "/usr/share/common-licenses/GPL-3"  # real English prose on every Debian system


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default=TEXT, help="UTF-8 text file (default: the GPL-3 licence text)")
    ap.add_argument("--tokens", type=int, default=8192, help="score the first this many tokens of the text "
                    "(rounded down to whole chunks)")
    ap.add_argument("--n-ctx", type=int, default=512, help="chunk length (llama-perplexity -c)")
    ap.add_argument("--variants", nargs="+", default=["bf16", "int8", "int4"])
    ap.add_argument("--lm-head-quantization", default="auto",
                    help="lm_head of the variants quantized at load: auto, none or an int8 format")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "bfloat16", "float32", "int8"],
                    help="KV cache dtypes (auto, bfloat16, float32, int8) to run each variant with; the "
                         "others' log-prob drift is measured against the first")
    ap.add_argument("--prefill-activations", nargs="+", default=["bf16"], choices=["bf16", "int8"],
                    help="prefill activations of the quantized variants (bf16, int8), each in turn; "
                         "the log-prob drift of the others is measured against the first")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gguf", default=None, metavar="FILE", help="the GGUF file of the gguf-f32 / gguf-bf16 variants")
    ap.add_argument("--llama-perplexity", default=None, metavar="PATH",
                    help="also run this llama.cpp llama-perplexity binary on the same GGUF and text")
    ap.add_argument("--out", default="/tmp/bench_perplexity")
    args = ap.parse_args(argv)
    if args.n_ctx < 4 or args.n_ctx % 2:
        ap.error(f"--n-ctx must be an even number of at least 4, not {args.n_ctx}.")
    if args.tokens < args.n_ctx:
        ap.error(f"--tokens ({args.tokens}) must hold at least one chunk of --n-ctx ({args.n_ctx}) tokens.")
    if not os.path.isfile(args.text):
        ap.error(f"--text {args.text} is not a file.")
    gguf_variants = [v for v in args.variants if v in ("gguf-f32", "gguf-bf16")]
    if gguf_variants and not args.gguf:
        ap.error(f"the variant {gguf_variants[0]} needs --gguf FILE.")
    if args.gguf is not None and not gguf_variants:
        ap.error("--gguf is the file of the gguf-f32 / gguf-bf16 variants; name one in --variants.")
    if args.gguf is not None and not os.path.isfile(args.gguf):
        ap.error(f"--gguf {args.gguf} is not a file.")
    if args.llama_perplexity is not None and not os.access(args.llama_perplexity, os.X_OK):
        ap.error(f"--llama-perplexity {args.llama_perplexity} is not an executable file.")
    return args


def chunks_of(ids: list[int], n_ctx: int, max_tokens: int, bos: int | None) -> list[list[int]]:
    """Non-overlapping chunks of n_ctx tokens from the start of `ids`; like llama-perplexity,
    each chunk's first token becomes BOS when the tokenizer adds one."""
    n = min(len(ids), max_tokens) // n_ctx
    out = [list(ids[i * n_ctx:(i + 1) * n_ctx]) for i in range(n)]
    if bos is not None:
        for c in out:
            c[0] = bos
    return out


def perplexity_of(logprobs_per_chunk: list, n_ctx: int) -> tuple[float, int]:
    """exp(mean negative log-likelihood) over the second half of each chunk: logprobs[j] is
    token j + 1's, and llama-perplexity scores tokens n_ctx/2 + 1 .. n_ctx - 1."""
    first = n_ctx // 2
    nll, count = 0.0, 0
    for lp in logprobs_per_chunk:
        scored = lp[first:]
        nll -= float(sum(float(x) for x in scored))
        count += len(scored)
    return math.exp(nll / count), count


def tokenize(text: str) -> tuple[list[int], int | None]:
    """The default model's tokens of `text`, and the BOS it adds (None: it adds none)."""
    from numa_runtime.default_model import default_model_path
    from numa_runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(default_model_path())
    plain, special = tok.encode("a", add_special_tokens=False), tok.encode("a")
    bos = special[0] if len(special) > len(plain) else None
    return tok.encode(text, add_special_tokens=False), bos


def logprob_drift(lps: list, ref: list, n_ctx: int) -> tuple[float, float]:
    """Mean and max |lp - ref| over the scored tokens (the second half of every chunk)."""
    import numpy as np
    d = np.concatenate([np.abs(np.asarray(a[n_ctx // 2:], np.float64) - np.asarray(b[n_ctx // 2:], np.float64))
                        for a, b in zip(lps, ref)])
    return float(d.mean()), float(d.max())


# variants without quantized linears (prefill_activations does not apply)
DENSE = ("bf16", "f32", "gguf-f32")


def engine_for(variant: str, kv_cache_dtype: str, args, prefill: str = "bf16"):
    from numa_runtime import Engine
    from numa_runtime.default_model import default_model_dir, find_default_gguf
    kw = dict(max_model_len=args.n_ctx, num_threads=args.threads, kv_cache_memory=64 << 20,
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    if variant not in DENSE:
        kw["prefill_activations"] = prefill
    if variant in ("bf16", "f32"):
        return Engine(default_model_dir(), dtype="bfloat16" if variant == "bf16" else "float32", **kw)
    if variant == "int4":
        return Engine(find_default_gguf(), **kw)
    if variant in ("gguf-f32", "gguf-bf16"):
        return Engine(args.gguf, dtype="float32" if variant == "gguf-f32" else "bfloat16", **kw)
    head = None if args.lm_head_quantization == "none" else args.lm_head_quantization
    return Engine(default_model_dir(), quantization=variant, lm_head_quantization=head, **kw)


def run_variant(variant: str, kv_cache_dtype: str, chunks: list[list[int]], args,
                prefill: str = "bf16") -> tuple[dict, list]:
    """The variant's perplexity with this KV dtype and prefill activations, and its log-probs per chunk."""
    eng = engine_for(variant, kv_cache_dtype, args, prefill)
    try:
        t0 = time.perf_counter()
        lps = [eng.prompt_logprobs(c) for c in chunks]
        secs = time.perf_counter() - t0
        head = getattr(eng.runner.model.lm_head, "dtype", "?")
        kv = eng.summary()["kv_cache_dtype"]
        taken = "int8" if getattr(eng.runner.model, "prefill_int8", False) else "exact/bf16"
    finally:
        eng.close()
    ppl, n = perplexity_of(lps, args.n_ctx)
    return {"ppl": ppl, "scored_tokens": n, "seconds": secs, "lm_head": head, "kv_cache": kv,
            "prefill": taken}, lps


def run_llama(args, n_chunks: int) -> dict:
    """llama-perplexity on the same GGUF and text; its 'Final estimate: PPL = x +/- e' line."""
    from numa_runtime.default_model import find_default_gguf
    cmd = [args.llama_perplexity, "-m", find_default_gguf(), "-f", args.text, "-c", str(args.n_ctx),
           "-b", str(args.n_ctx), "--chunks", str(n_chunks)]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", p.stdout + p.stderr)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"llama-perplexity failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    toks = re.search(r"tokenizing the input .*?\n.*?(\d+) tokens", p.stdout + p.stderr)
    return {"ppl": float(m.group(1)), "ppl_err": float(m.group(2)), "command": " ".join(cmd),
            "text_tokens": int(toks.group(1)) if toks else None}


def main(argv=None) -> None:
    args = parse_args(argv)
    with open(args.text, encoding="utf-8") as f:
        ids, bos = tokenize(f.read())
    chunks = chunks_of(ids, args.n_ctx, args.tokens, bos)
    if not chunks:
        raise SystemExit(f"{args.text} has {len(ids)} tokens, fewer than one chunk of {args.n_ctx}.")
    results = {}
    for v in args.variants:
        ref = None
        for kv in args.kv_cache_dtype:
            for pre in (["bf16"] if v in DENSE else args.prefill_activations):
                r, lps = run_variant(v, kv, chunks, args, pre)
                if ref is None:
                    ref = lps
                else:
                    r["logprob_drift_mean"], r["logprob_drift_max"] = logprob_drift(lps, ref, args.n_ctx)
                name = v if len(args.kv_cache_dtype) == 1 else f"{v} kv={kv}"
                results[name if len(args.prefill_activations) == 1 else f"{name} prefill={pre}"] = {"weights": v, **r}
    if args.llama_perplexity:
        results["llama.cpp Q4_1"] = run_llama(args, len(chunks))
    base = next((r["ppl"] for r in results.values() if r.get("weights") == "bf16"), None)
    lines = [f"SmolLM2-135M-Instruct (Q4_1 GGUF), {os.path.basename(args.text)}: {len(chunks)} chunks of "
             f"{args.n_ctx} tokens ({len(ids)} in the text), second half of each chunk scored; log-prob "
             f"drift of the scored tokens against KV {args.kv_cache_dtype[0]} on the same weights", "",
             "| weights | KV cache | lm_head | prefill activations | perplexity | vs bf16 | mean abs log-prob drift | max |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        rel = f"{(r['ppl'] / base - 1) * 100:+.2f}%" if base else "-"
        drift = (f"{r['logprob_drift_mean']:.5f} | {r['logprob_drift_max']:.4f}" if "logprob_drift_mean" in r
                 else "- | -")
        lines.append(f"| {r.get('weights', name)} | {r.get('kv_cache', 'f16')} | {r.get('lm_head', 'as stored')} | "
                     f"{r.get('prefill', 'int8 (Q8_1)')} | {r['ppl']:.4f} | {rel} | {drift} |")
    report = {"text": args.text, "text_tokens": len(ids), "n_ctx": args.n_ctx, "chunks": len(chunks),
              "bos": bos, "results": results}
    print("\n".join(lines))
    write_report(args.out, report, "\n".join(lines))


if __name__ == "__main__":
    main()
