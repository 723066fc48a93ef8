"""numa_runtime vs transformers (vs llama.cpp): decode, prefill, concurrent throughput, as
fractions of this machine's limits; plus the cost of AS_PROFILE=ON.

    python bench/bench_compare.py --quick                  # random Llama, Qwen2.5-0.5B shape, bf16
    python bench/bench_compare.py --model DIR --threads 2 --out /tmp/compare

Measured, one run, the same model and thread count for every framework (each in its own
process, one after the other):
    decode      tokens/s of one sequence (16-token prompt), after its first token
    prefill     tokens/s of one 512-token prompt (time to the first token)
    conc16      output tokens/s of 16 sequences generated together, prefill included
Limits (bench/limits.py): decode = DRAM read GB/s / weight bytes read per token; prefill =
bf16 GEMM peak / FLOPs per token (linears + causal attention); conc16 = the smaller of 16x
the decode limit and the compute limit. llama.cpp runs through llama-cpp-python when it is
installed (the model converted to a bf16 GGUF with the gguf package's writer); else skipped.
Writes <out>.json and <out>.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = {
    # Qwen2.5-0.5B's shape as a plain Llama (no qkv bias), tied embeddings
    "qwen0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                     tie_word_embeddings=True, max_position_embeddings=32768,
                     rope_theta=1000000.0, rms_norm_eps=1e-6),
    # for a smoke test of this script
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=384, tie_word_embeddings=False,
                 max_position_embeddings=2048),
}


# ----------------------------------------------------------------------------- model + limits
def build_shape(shape: str) -> str:
    """A random bf16 Llama of `shape` with a locally trained tokenizer, cached under /tmp."""
    out = os.path.join("/tmp", "numa_runtime_bench", shape)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from models import train_tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(bos_token_id=1, eos_token_id=2, **SHAPES[shape])
    cfg.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = out + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    train_tokenizer(tmp)
    os.replace(tmp, out)
    return out


def model_costs(model_dir: str, prompt_len: int) -> dict:
    """Weight bytes read per decoded token and FLOPs per prefilled token (bf16 weights)."""
    c = json.load(open(os.path.join(model_dir, "config.json")))
    h, i, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    linear = L * (h * (q + 2 * kv) + q * h + 3 * h * i) + v * h  # params read per token
    # causal attention over a prompt: on average prompt_len / 2 keys per query (QK^T and PV)
    attn = L * 2 * 2 * q * (prompt_len / 2)
    return {"weight_bytes_per_token": 2 * linear, "prefill_flops_per_token": 2 * linear + attn,
            "decode_flops_per_token": 2 * linear}


def machine_limits(threads: int, quick: bool) -> dict:
    from bench.limits import dram_read_gbps, peak_bf16_gflops
    from numa_runtime._kernels import ops
    ops.set_num_threads(threads)
    return {"dram_read_gbps": dram_read_gbps(gib=0.25 if quick else 1.0, repeats=3 if quick else 5),
            "peak_bf16_gflops": peak_bf16_gflops(1024 if quick else 4096, repeats=3)}


# ----------------------------------------------------------------------------- children
def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def run_numa(a) -> dict:
    from numa_runtime import Engine, SamplingParams
    eng = Engine(a.model, dtype="bfloat16", max_model_len=1024, num_threads=a.threads,
                 kv_cache_memory=512 << 20, max_num_seqs=16, max_num_batched_tokens=1024)
    vocab = eng.model_config.vocab_size
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def decode(seed):
        eng.add_request(_prompts(vocab, 1, 16, seed)[0], greedy(a.decode_tokens + 1))
        eng.step()  # prefill + first token
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return a.decode_tokens / (time.perf_counter() - t0)

    decode(100)  # warm-up (kernel primitives for these shapes)
    # NOTE: best of at least 3 even with --quick: decode is short and a shared machine is noisy
    out = {"decode_tps": max(decode(101 + r) for r in range(max(a.repeats, 3)))}
    if eng.recorder.enabled:  # where the decode time goes (rank 0, forward section)
        out["profile_forward_pct"] = {r["opname"]: round(r["percentage"], 1) for r in
                                      eng.get_op_profiling_stats() if r["section"] == "forward"}
    if a.decode_only:
        return out
    best = 0.0
    for r in range(a.repeats + 1):  # the first one warms up; fresh prompts miss the prefix cache
        t0 = time.perf_counter()
        eng.generate(_prompts(vocab, 1, a.prefill_tokens, 200 + r), greedy(1))
        best = max(best, a.prefill_tokens / (time.perf_counter() - t0)) if r else best
    out["prefill_tps"] = best
    t0 = time.perf_counter()
    eng.generate(_prompts(vocab, 16, a.conc_prompt, 300), greedy(a.conc_tokens))
    out["conc16_tps"] = 16 * a.conc_tokens / (time.perf_counter() - t0)
    eng.close()
    return out


def run_hf(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size

    def gen(prompts, n):
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0

    p = _prompts(vocab, 1, 16, 100)
    gen(p, 2)  # warm-up
    # decode: the difference of n+1 and 1 new tokens removes prefill and set-up
    out = {"decode_tps": max(a.decode_tokens / (gen(p, a.decode_tokens + 1) - gen(p, 1))
                             for _ in range(a.repeats))}
    best = 0.0
    for r in range(a.repeats + 1):
        ids = torch.tensor(_prompts(vocab, 1, a.prefill_tokens, 200 + r))
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids, use_cache=True)
        best = max(best, a.prefill_tokens / (time.perf_counter() - t0)) if r else best
    out["prefill_tps"] = best
    out["conc16_tps"] = 16 * a.conc_tokens / gen(_prompts(vocab, 16, a.conc_prompt, 300), a.conc_tokens)
    return out


def run_llamacpp(a) -> dict:
    try:
        import llama_cpp
    except ImportError:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    path = os.path.join(a.model, "model-bf16.gguf")
    if not os.path.exists(path):
        hf_to_gguf(a.model, path)
    llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=512, n_threads=a.threads,
                          logits_all=False, verbose=False)
    vocab = llm.n_vocab()

    def decode(seed):
        llm.reset()
        p = _prompts(vocab, 1, 17, seed)[0]
        llm.eval(p[:16])
        t0 = time.perf_counter()
        for t in _prompts(vocab, 1, a.decode_tokens, seed + 1)[0]:
            llm.eval([t])  # one token per forward, as in decoding (sampling not timed)
        return a.decode_tokens / (time.perf_counter() - t0)

    decode(100)
    out = {"decode_tps": max(decode(101 + r) for r in range(a.repeats))}
    best = 0.0
    for r in range(a.repeats + 1):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(_prompts(vocab, 1, a.prefill_tokens, 200 + r)[0])
        best = max(best, a.prefill_tokens / (time.perf_counter() - t0)) if r else best
    out["prefill_tps"] = best
    out["conc16_note"] = "llama-cpp-python runs one sequence per context: not measured"
    return out


def hf_to_gguf(model_dir: str, path: str) -> None:
    """A bf16 llama GGUF (the layout llama.cpp's convert_hf_to_gguf.py writes) of an HF Llama
    directory with a byte-level BPE tokenizer.json."""
    import gguf
    import numpy as np
    from numa_runtime.weights import Checkpoint
    c = json.load(open(os.path.join(model_dir, "config.json")))
    tok = json.load(open(os.path.join(model_dir, "tokenizer.json")))
    nh, nkv, h = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    moe = c.get("model_type") == "qwen3_moe"  # NOTE: llama.cpp's qwen3moe: q/k norms, neox rope, experts
    w = gguf.GGUFWriter(path, "qwen3moe" if moe else "llama")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    if c.get("head_dim") and c["head_dim"] != h // nh:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if moe:
        w.add_expert_count(c.get("num_experts") or c["num_local_experts"])  # NOTE: transformers 5 writes the latter
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)  # transformers 4 / 5
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
    w.add_vocab_size(c["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    vocab = dict(tok["model"]["vocab"])
    for t in tok.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    tokens = [f"[PAD{i}]" for i in range(c["vocab_size"])]  # the model's vocab may be larger
    types = [gguf.TokenType.UNUSED] * c["vocab_size"]
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    for s, i in vocab.items():
        tokens[i], types[i] = s, gguf.TokenType.CONTROL if s in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(c.get("bos_token_id", 1))
    w.add_eos_token_id(c.get("eos_token_id", 2))
    ckpt = Checkpoint(model_dir)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    sub = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
           "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    if moe:
        ckpt.split_experts()
    experts = {}  # (layer, proj) -> {expert: bf16 [N, K]}: stacked [E, N, K] as llama.cpp stores them
    for name in ckpt.names():
        if ".mlp.experts." in name:
            if name.endswith("_proj.weight"):
                _, _, layer, _, _, j, proj, _ = name.split(".")
                experts.setdefault((int(layer), proj), {})[int(j)] = name
            continue
        if name == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue
        if name in top:
            gname = top[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{sub[mod]}.{kind}"
        if name.endswith(("norm.weight", "mlp.gate.weight")):  # NOTE: the router in f32, as the converter
            w.add_tensor(gname, np.ascontiguousarray(ckpt.load(name, "float32")))
            continue
        x = np.ascontiguousarray(ckpt.load(name, "bfloat16"))  # bf16 bits, uint16
        if name.endswith(("q_proj.weight", "k_proj.weight")) and not moe:
            n = nh if "q_proj" in name else nkv  # HF rotate-half -> llama.cpp interleaved rows
            x = np.ascontiguousarray(x.reshape(n, 2, x.shape[0] // n // 2, x.shape[1])
                                     .swapaxes(1, 2).reshape(x.shape))
        w.add_tensor(gname, x, raw_shape=x.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    for (layer, proj), names in sorted(experts.items()):
        x = np.stack([ckpt.load(names[j], "bfloat16") for j in range(len(names))])
        w.add_tensor(f"blk.{layer}.ffn_{proj.split('_')[0]}_exps.weight", x, raw_shape=x.shape,
                     raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CHILDREN = {"numa": run_numa, "hf": run_hf, "llamacpp": run_llamacpp}


# ----------------------------------------------------------------------------- driver
def run_child(name: str, a, profile: bool = False, decode_only: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AS_PROFILE")}
    env.update(OMP_NUM_THREADS=str(a.threads), PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    if profile:
        env["AS_PROFILE"] = "ON"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--model", a.model,
           "--threads", str(a.threads)] + (["--quick"] if a.quick else []) + \
          (["--decode-only"] if decode_only else [])
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.timeout} s"}
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]}
    res = json.loads(lines[-1][7:])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF Llama directory (default: --shape, built and cached)")
    ap.add_argument("--shape", default="qwen0.5b", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats, smaller probes")
    ap.add_argument("--frameworks", nargs="+", default=["numa", "hf", "llamacpp"], choices=sorted(CHILDREN))
    ap.add_argument("--out", default="/tmp/bench_compare", help="writes OUT.json and OUT.md")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per framework")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.decode_tokens = 8 if a.quick else 64
    a.prefill_tokens = 512
    a.conc_prompt, a.conc_tokens = (32, 8) if a.quick else (128, 64)
    a.repeats = 1 if a.quick else 3
    if a.child:
        print("RESULT " + json.dumps(CHILDREN[a.child](a)), flush=True)
        return
    a.model = os.path.abspath(os.path.expanduser(a.model)) if a.model else build_shape(a.shape)
    costs = model_costs(a.model, a.prefill_tokens)
    lim = machine_limits(a.threads, a.quick)
    bw, peak = lim["dram_read_gbps"] * 1e9, lim["peak_bf16_gflops"] * 1e9
    limits = {"decode_tps": bw / costs["weight_bytes_per_token"],
              "prefill_tps": peak / costs["prefill_flops_per_token"],
              "conc16_tps": min(16 * bw / costs["weight_bytes_per_token"],
                                peak / costs["decode_flops_per_token"])}
    print(f"model {a.model}, {a.threads} threads; DRAM read {lim['dram_read_gbps']:.1f} GB/s, "
          f"bf16 peak {lim['peak_bf16_gflops']:.0f} GFLOP/s", flush=True)
    results = {}
    for name in a.frameworks:
        results[name] = run_child(name, a)
        print(f"  {name}: {results[name]}", flush=True)
    if "numa" in a.frameworks:
        # NOTE: alternate plain and profiled runs and keep the best of each: on a shared
        # machine one run's noise is larger than the profiler's cost.
        plain, prof = [results["numa"]], []
        for _ in range(1 if a.quick else 2):
            prof.append(run_child("numa", a, profile=True, decode_only=True))
            plain.append(run_child("numa", a, decode_only=True))
        best = lambda runs: max(runs, key=lambda x: x.get("decode_tps", 0.0))
        results["numa+AS_PROFILE"] = dict(best(prof), plain_decode_tps=best(plain).get("decode_tps"))
        print(f"  numa+AS_PROFILE: {results['numa+AS_PROFILE']}", flush=True)
    report = {"model": a.model, "threads": a.threads, "quick": a.quick, "machine": lim,
              "costs": costs, "limits": limits, "results": results}
    from bench.common import write_report  # NOTE: it makes --out's folder (a missing one lost the run)
    md = markdown(report)
    paths = write_report(a.out, report, md)
    print("\n" + md + "\nwrote " + ", ".join(paths))


def markdown(r: dict) -> str:
    lim = r["limits"]
    rows = ["| framework | decode tok/s (of limit) | prefill 512 tok/s (of limit) | conc16 out tok/s (of limit) |",
            "| --- | --- | --- | --- |",
            f"| limit | {lim['decode_tps']:.1f} | {lim['prefill_tps']:.1f} | {lim['conc16_tps']:.1f} |"]
    notes = []
    for name, res in r["results"].items():
        if "skipped" in res or "error" in res:
            notes.append(f"- {name}: {res.get('skipped') or res.get('error')}")
            continue
        cells = [f"{res[k]:.1f} ({res[k] / lim[k]:.0%})" if k in res else "-"
                 for k in ("decode_tps", "prefill_tps", "conc16_tps")]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
        if "conc16_note" in res:
            notes.append(f"- {name}: {res['conc16_note']}")
    prof = r["results"].get("numa+AS_PROFILE", {})
    if prof.get("decode_tps") and prof.get("plain_decode_tps"):
        plain, on = prof["plain_decode_tps"], prof["decode_tps"]
        notes.append(f"- AS_PROFILE=ON: decode {plain:.2f} -> {on:.2f} tok/s (best runs), a cost of "
                     f"{1 - on / plain:.1%} (negative: within this machine's noise)")
        notes.append("- numa forward time by op (%): " + ", ".join(
            f"{k} {v}" for k, v in prof.get("profile_forward_pct", {}).items()))
    m = r["machine"]
    head = (f"model `{r['model']}`, {r['threads']} threads{', --quick' if r['quick'] else ''}; "
            f"DRAM read {m['dram_read_gbps']:.1f} GB/s, bf16 peak {m['peak_bf16_gflops']:.0f} GFLOP/s, "
            f"weights read per token {r['costs']['weight_bytes_per_token'] / 1e6:.0f} MB\n\n")
    return head + "\n".join(rows) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


if __name__ == "__main__":
    main()
