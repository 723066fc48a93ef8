"""bench/bench_llamacpp.py and bench_serving.py --llama-server on the tiny model: arguments, our
half of the comparison, and (when LLAMACPP_BIN names a folder with llama.cpp's binaries, built by
bench/build_llamacpp.sh) llama.cpp's half on the same GGUF files. No timing is asserted."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_BIN = os.environ.get("LLAMACPP_BIN")
TOOLS = ("llama-bench", "llama-quantize", "llama-server")
needs_llamacpp = pytest.mark.skipif(
    not (LLAMA_BIN and all(os.access(os.path.join(LLAMA_BIN, t), os.X_OK) for t in TOOLS)),
    reason="set LLAMACPP_BIN to a folder with llama-bench, llama-quantize and llama-server "
           "(bench/build_llamacpp.sh) to run llama.cpp's half")


def _run(script: str, *args: str, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LLAMACPP_BIN", None)  # only what the arguments say
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("args, message", [
    (["--depth", "0"], "--depth values must be positive"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--model", "/nonexistent/model"], "no config.json there"),
    (["--shape", "tiny", "--llama-bin", "/nonexistent/bin"], "no llama-bench and llama-quantize there"),
])
def test_bad_arguments_are_one_sentence_errors(args, message):
    p = _run("bench_llamacpp.py", *args, check=False, timeout=300)
    assert p.returncode != 0
    assert message in p.stderr


def test_serving_llama_server_needs_a_binary_and_a_gguf(tmp_path):
    p = _run("bench_serving.py", "--llama-server", str(tmp_path / "none"), "--gguf", "x.gguf", check=False)
    assert p.returncode != 0 and "is not an executable file" in p.stderr
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    p = _run("bench_serving.py", "--llama-server", str(exe), check=False)
    assert p.returncode != 0 and "needs --gguf FILE" in p.stderr


def _check_ours(row: dict) -> None:
    o = row["ours_result"]
    assert "error" not in o, o["error"]
    for key in ("decode_tok_s", "prefill_tok_s", "bytes_per_token", "kv_bytes_per_context_token"):
        assert _positive(o[key]), key
    assert len(o["decode_all"]) == len(o["prefill_all"]) == 1  # --quick: one repeat


def test_our_half_without_llamacpp(tmp_path):
    out = str(tmp_path / "r")
    _run("bench_llamacpp.py", "--shape", "tiny", "--quick", "--depth", "40", "--work", str(tmp_path),
         "--out", out)
    r = json.load(open(out + ".json"))
    assert "--llama-bin" in r["skipped"] and r["llama_cpp_build"] is None and r["depth"] == {}
    assert _positive(r["dram_read_gbps"]) and r["threads"] == len(os.sched_getaffinity(0))
    # without llama-quantize only the bf16 file exists; ours still runs it and quantizes at load
    assert list(r["files"]) == ["bf16"]
    types = r["files"]["bf16"]["tensor_types"]
    assert types["ffn_down.weight"] == {"BF16": 2} and types["attn_norm.weight"] == {"F32": 2}
    rows = {(row["file"], row["quantization"]): row for row in r["rows"]}
    assert sorted(rows, key=str) == sorted([("bf16", None), ("q8_0", "int8"), ("q4_0", "int4")], key=str)
    for row in rows.values():
        _check_ours(row)
        assert row["llama_cpp"] is None
    nbytes = {q: rows[k]["ours_result"]["bytes_per_token"] for k, q in
              ((("bf16", None), "bf16"), (("q8_0", "int8"), "int8"), (("q4_0", "int4"), "int4"))}
    assert nbytes["int4"] < nbytes["int8"] < nbytes["bf16"]  # packed bytes the decode streams
    d = rows[("bf16", None)]["ours_result"]["depth"]["40"]
    assert _positive(d["prefill_tok_s"]) and _positive(d["decode_tok_s"])
    md = open(out + ".md").read()
    assert "| BF16 GGUF | BF16 |" in md and "| 40 | decode tok/s |" in md


@needs_llamacpp
def test_both_halves_on_the_same_files(tmp_path):
    out = str(tmp_path / "r")
    _run("bench_llamacpp.py", "--shape", "tiny", "--quick", "--depth", "40", "--work", str(tmp_path),
         "--llama-bin", LLAMA_BIN, "--out", out, timeout=1200)
    r = json.load(open(out + ".json"))
    assert r["skipped"] is None and r["llama_cpp_build"]["build_commit"]
    assert sorted(r["files"]) == ["bf16", "q4_0", "q8_0"]
    assert "Q8_0" in r["files"]["q8_0"]["tensor_types"]["ffn_up.weight"]
    assert "Q4_0" in r["files"]["q4_0"]["tensor_types"]["ffn_up.weight"]
    for row in r["rows"]:
        _check_ours(row)
        lc = row["llama_cpp"]
        assert _positive(lc["decode"]["avg_ts"]) and _positive(lc["prefill"]["avg_ts"])
        assert lc["decode"]["n_gen"] == 8 and lc["prefill"]["n_prompt"] == 32
    assert len(r["rows"]) == 5  # three files, and int8 / int4 quantized at load
    for kind, want in (("prefill", "n_prompt"), ("decode", "n_depth")):
        recs = r["depth"][kind]
        assert sorted(x["flash_attn"] for x in recs) == [0, 1]  # llama-bench: 0 off, 1 on
        assert all(x[want] == 40 and _positive(x["avg_ts"]) for x in recs)

    # the serving comparison on the Q4_0 file: both servers answer every request
    p = _run("bench_serving.py", "--llama-server", os.path.join(LLAMA_BIN, "llama-server"),
             "--gguf", r["files"]["q4_0"]["path"], "--quick", timeout=1200)
    table = p.stdout[p.stdout.index("| concurrency |"):]
    assert "numa_runtime" in table and "llama-server (model-q4_0.gguf)" in table
    errors = [line for line in table.splitlines() if "| errors |" in line]
    assert len(errors) == 2 and all(line.endswith("| 0 | 0 |") for line in errors)


@needs_llamacpp
def test_rounds_pair_each_decode_with_llamacpp(tmp_path):
    """--rounds 2 --one-step: after the first pass, one more round of llama-bench's decode, then
    ours with and without bursts; each row keeps both (llama.cpp, ours) pairs and the table gives
    the median ratio and its range."""
    out = str(tmp_path / "r")
    _run("bench_llamacpp.py", "--shape", "tiny", "--quick", "--types", "q8_0", "--no-load-quant", "--one-step",
         "--rounds", "2", "--work", str(tmp_path), "--llama-bin", LLAMA_BIN, "--out", out, timeout=1200)
    r = json.load(open(out + ".json"))
    assert [row["ours"] for row in r["rows"]] == ["Q8_0 GGUF", "Q8_0 GGUF, one step a round"]
    for row in r["rows"]:
        assert len(row["pairs"]) == 2 and all(_positive(a) and _positive(b) for a, b in row["pairs"])
    assert open(out + ".md").read().count(", 2 rounds)") == 2
