"""Operator profiler (AS_PROFILE=ON): report format, op counts that follow the model's
structure, reset, Chrome trace, zero cost when off, and every rank's rows under mpirun."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from models import build_model

from numa_runtime import Engine, SamplingParams
from numa_runtime.backend import get_backend
from numa_runtime.recorder import NULL_RECORDER

BACKEND = os.environ.get("NUMA_RUNTIME_TEST_BACKEND", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAYERS = 2
PROMPTS = [[1, 17, 42, 99, 5], list(range(3, 30))]
COLUMNS = ["rank", "opname", "count", "min_ms", "max_ms", "ave_ms", "total_ms", "percentage"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_model(str(path), arch="llama", num_hidden_layers=LAYERS)
    return str(path)


def make_engine(model_dir):
    return Engine(model_dir, dtype="float32", backend=BACKEND, kv_cache_memory=1 << 24, max_model_len=256)


def generate(eng, max_tokens):
    # both prompts prefill in the first step and sample in every step: max_tokens steps
    eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def parse_report(text: str) -> dict[str, list[dict]]:
    """{section: rows} from the report; checks the headers and the column line."""
    lines = text.splitlines()
    heads = [i for i, l in enumerate(lines) if l.startswith("*** ")]
    assert [lines[i] for i in heads] == ["*** reshape ***", "*** alloc ***", "*** forward ***"]
    out = {}
    for i, start in enumerate(heads):
        assert lines[start + 1].split() == COLUMNS
        end = heads[i + 1] if i + 1 < len(heads) else len(lines)
        rows = []
        for l in lines[start + 2:end]:
            if l.strip():
                f = l.split()
                rows.append({"rank": int(f[0]), "opname": f[1], "count": int(f[2]),
                             **{c: float(v) for c, v in zip(COLUMNS[3:], f[3:])}})
        out[lines[start][4:-4]] = rows
    return out


def counts(stats, rank=0, section="forward"):
    return {r["opname"]: r["count"] for r in stats if r["rank"] == rank and r["section"] == section}


def per_step_forward(steps, layers=LAYERS):
    # rms_norm: layer 0's input norm; add_rms_norm: every other norm, the final one included
    return {"Linear": steps * (4 * layers + 1), "rms_norm": steps, "add_rms_norm": steps * 2 * layers,
            "paged_attention": steps * layers, "rotary": steps * layers, "reshape_and_cache": steps * layers,
            "silu_and_mul": steps * layers, "embedding": steps}


def test_report_format_and_counts(model_dir, monkeypatch):
    monkeypatch.setenv("AS_PROFILE", "ON")
    eng = make_engine(model_dir)
    generate(eng, 6)
    report = parse_report(eng.get_op_profiling_info(model_name="tiny-llama"))
    assert "model tiny-llama" in eng.get_op_profiling_info(model_name="tiny-llama")
    for section, rows in report.items():
        assert rows, section
        assert {r["rank"] for r in rows} == {0}
        totals = [r["total_ms"] for r in rows]
        assert totals == sorted(totals, reverse=True), section
        assert abs(sum(r["percentage"] for r in rows) - 100.0) < 0.1, section
        for r in rows:
            assert r["min_ms"] <= r["ave_ms"] <= r["max_ms"]
    forward = {r["opname"]: r["count"] for r in report["forward"]}
    assert forward == {**per_step_forward(6), "sample": 6, "update": 6}
    assert {r["opname"]: r["count"] for r in report["reshape"]} == {"schedule": 6}
    alloc = {r["opname"]: r["count"] for r in report["alloc"]}
    assert alloc["free"] == 2 and alloc["get_computed_blocks"] == 2 and alloc["allocate"] >= 2
    # the structure holds the same rows as the text
    stats = eng.get_op_profiling_stats()
    assert set(stats[0]) == {"section", *COLUMNS}
    assert counts(stats) == forward
    eng.close()


def test_reset_starts_a_new_window(model_dir, monkeypatch):
    monkeypatch.setenv("AS_PROFILE", "ON")
    eng = make_engine(model_dir)
    generate(eng, 5)
    assert counts(eng.get_op_profiling_stats())["Linear"] == 5 * (4 * LAYERS + 1)
    eng.reset_op_profiling()
    assert eng.get_op_profiling_stats() == []
    generate(eng, 3)
    assert counts(eng.get_op_profiling_stats()) == {**per_step_forward(3), "sample": 3, "update": 3}
    eng.close()


def test_chrome_trace(model_dir, monkeypatch, tmp_path):
    path = str(tmp_path / "auto.json")
    monkeypatch.setenv("AS_PROFILE", "ON")
    monkeypatch.setenv("AS_PROFILE_TRACE", path)
    monkeypatch.setenv("AS_PROFILE_TRACE_STEPS", "3")
    eng = make_engine(model_dir)
    generate(eng, 5)
    events = json.load(open(path))["traceEvents"]  # written once 3 steps were kept
    names = [e["name"] for e in events if e["ph"] == "X"]
    assert names.count("schedule") == 3 and names.count("Linear") == 3 * (4 * LAYERS + 1)
    assert {e["pid"] for e in events} == {0}
    out = eng.export_chrome_trace(str(tmp_path / "last.json"), steps=2)
    events = json.load(open(out))["traceEvents"]
    assert [e["name"] for e in events].count("embedding") == 2
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")
    eng.close()


def test_scratch_forwards_are_steps_of_their_own(model_dir, monkeypatch, tmp_path):
    """Embeddings and prompt logprobs run forwards outside Engine.step: each is a step of its
    own (as the workers count them), so the kept steps stay bounded."""
    monkeypatch.setenv("AS_PROFILE", "ON")
    monkeypatch.setenv("AS_PROFILE_TRACE", str(tmp_path / "t.json"))
    monkeypatch.setenv("AS_PROFILE_TRACE_STEPS", "3")
    eng = make_engine(model_dir)
    try:
        generate(eng, 1)
        for _ in range(5):
            eng.embed([list(range(3, 20))])
        eng.prompt_logprobs(list(range(3, 20)))
        rec = eng.recorder
        assert rec.num_steps == 1 + 5 + 1
        assert len(rec.trace()) == 3 and max(len(step) for step in rec.trace()) < 40
        events = json.load(open(eng.export_chrome_trace(str(tmp_path / "last.json"), steps=1)))["traceEvents"]
        assert [e["name"] for e in events].count("Linear") == 4 * LAYERS + 1  # the prompt logprobs' forward
        assert counts(eng.get_op_profiling_stats())["embedding"] == 1 + 5 + 1
    finally:
        eng.close()


def test_the_trace_holds_the_first_steps_whatever_runs_them(model_dir, monkeypatch, tmp_path):
    """Embeddings' forwards are steps: the trace is written after the third of 3, and holds those
    (it waited for an engine step, by then holding the last 3 steps)."""
    path = tmp_path / "t.json"
    monkeypatch.setenv("AS_PROFILE_TRACE", str(path))
    monkeypatch.setenv("AS_PROFILE_TRACE_STEPS", "3")
    eng = make_engine(model_dir)
    try:
        for _ in range(2):
            eng.embed([list(range(3, 20))])
        assert not path.exists()
        eng.embed([list(range(3, 20))])
        first = path.read_text()
        names = [e["name"] for e in json.loads(first)["traceEvents"]]
        assert names.count("embedding") == 3 and "sample" not in names
        generate(eng, 2)
        eng.embed([list(range(3, 20))])
        assert path.read_text() == first  # written once
    finally:
        eng.close()
    assert path.read_text() == first


def test_a_quantized_embedding_table_is_timed(model_dir, monkeypatch, tmp_path):
    """A GGUF's Q8_0 token table is looked up row by row from the file (StoredRows): the lookup
    counts as `embedding`, once a step (it had no row)."""
    from gguf_helpers import write_gguf
    path = str(tmp_path / "m.gguf")
    write_gguf(model_dir, path, "Q8_0")
    monkeypatch.setenv("AS_PROFILE", "ON")
    eng = Engine(path, dtype="float32", backend=BACKEND, kv_cache_memory=1 << 24, max_model_len=256)
    try:
        from numa_runtime.models.llama import StoredRows
        assert isinstance(eng.runner.model.embed, StoredRows)
        generate(eng, 3)
        assert counts(eng.get_op_profiling_stats())["embedding"] == 3
    finally:
        eng.close()


def test_a_trace_of_fewer_steps_is_written_at_close(model_dir, monkeypatch, tmp_path):
    path = str(tmp_path / "short.json")
    monkeypatch.setenv("AS_PROFILE_TRACE", path)  # alone: profiling on
    monkeypatch.delenv("AS_PROFILE", raising=False)
    monkeypatch.setenv("AS_PROFILE_TRACE_STEPS", "32")
    with pytest.raises(KeyError):
        with make_engine(model_dir) as eng:
            generate(eng, 4)
            assert not os.path.exists(path)
            raise KeyError("the script fails")
    names = [e["name"] for e in json.load(open(path))["traceEvents"]]
    assert names.count("schedule") == 4 and names.count("Linear") == 4 * (4 * LAYERS + 1)


@pytest.mark.parametrize("env, message", [
    ({"AS_PROFILE": "enabled"}, "AS_PROFILE='enabled' is neither on nor off"),
    ({"AS_PROFILE": "off", "AS_PROFILE_TRACE": "/tmp/x.json"}, "contradict each other"),
    ({"AS_PROFILE": "ON", "AS_PROFILE_TRACE_STEPS": "-3"}, "AS_PROFILE_TRACE_STEPS='-3' is not a positive"),
    # NOTE: a folder was found out at close, after the whole run was profiled
    ({"AS_PROFILE_TRACE": "/tmp"}, r"AS_PROFILE_TRACE='/tmp' is a directory; name the trace file to write, e\.g\. "
                                   r"'/tmp/trace\.json'\."),
    ({"AS_PROFILE_TRACE": "/nonexistent/t.json"}, "names a file in a folder that does not exist or is not writable"),
])
def test_profiling_settings_it_cannot_read_are_errors(model_dir, monkeypatch, env, message):
    for name in ("AS_PROFILE", "AS_PROFILE_TRACE", "AS_PROFILE_TRACE_STEPS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        make_engine(model_dir)


def test_trace_steps_without_profiling_are_named(model_dir, monkeypatch, caplog):
    for name in ("AS_PROFILE", "AS_PROFILE_TRACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AS_PROFILE_TRACE_STEPS", "x")
    with pytest.raises(ValueError, match="AS_PROFILE_TRACE_STEPS='x' is not a positive"):
        make_engine(model_dir)
    monkeypatch.setenv("AS_PROFILE_TRACE_STEPS", "8")
    make_engine(model_dir).close()
    assert "AS_PROFILE_TRACE_STEPS applies to operator profiling, which is off" in caplog.text


def test_profiling_switch_values(monkeypatch):
    from numa_runtime import env
    monkeypatch.delenv("AS_PROFILE_TRACE", raising=False)
    for value, on in (("On", True), ("1", True), ("yes", True), ("OFF", False), ("0", False), ("", False)):
        monkeypatch.setenv("AS_PROFILE", value)
        assert env.profile_enabled() is on, value


def test_off_is_zero_cost(model_dir, monkeypatch):
    monkeypatch.delenv("AS_PROFILE", raising=False)
    monkeypatch.delenv("AS_PROFILE_TRACE", raising=False)
    eng = make_engine(model_dir)
    # the model calls the backend module and the communicator themselves: no per-op cost
    assert eng.ops is get_backend(BACKEND) and eng.runner.comm is eng.comm
    # rank 0's hooks all go to the one recorder that does nothing
    assert eng.recorder is NULL_RECORDER and not eng.recorder.enabled
    assert eng.block_manager.recorder is eng.sampler.recorder is eng.runner.recorder is NULL_RECORDER
    generate(eng, 2)
    with pytest.raises(RuntimeError, match="AS_PROFILE=ON"):
        eng.get_op_profiling_info()
    eng.close()


def test_profiling_keeps_the_kernel_paths(model_dir, monkeypatch):
    """Timed linears pass the loader's path flags to the kernel objects: a bf16 engine quantized
    at load runs the same int8-activation decode with profiling on as off."""
    monkeypatch.setenv("AS_PROFILE", "ON")
    eng = Engine(model_dir, dtype="bfloat16", backend=BACKEND, quantization="int4",
                 kv_cache_memory=1 << 24, max_model_len=256)
    try:
        lin = eng.runner.model.layers[0].o_proj
        assert type(lin).__name__ == "_TimedLinear"
        assert lin._linear.act8 and lin._linear.prefill_bf16
        generate(eng, 2)
        assert counts(eng.get_op_profiling_stats())["Linear"] > 0
    finally:
        eng.close()


@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="SKIPPED: mpirun is not installed, so profiling of worker ranks is not tested "
                           "(scripts/install.sh installs MPICH)")
def test_every_rank_under_mpirun(model_dir, tmp_path):
    trace = str(tmp_path / "trace.json")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "MPI_LOCAL", "NUMA_RUNTIME_BOUND", "AS_PROFILE"))}
    env.update(PYTHONPATH=ROOT, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1", AS_PROFILE="ON")
    cmd = ["mpirun", "-np", "2", sys.executable, os.path.join(HERE, "mpi", "profile_run.py"),
           model_dir, BACKEND, "4", "3", trace]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(line) == 1, p.stdout[-3000:]  # only rank 0 prints
    res = json.loads(line[0][7:])
    assert res["world"] == 2
    report = parse_report(res["report"])
    assert {r["rank"] for r in report["forward"]} == {0, 1}
    assert {r["rank"] for r in report["reshape"]} == {0, 1}
    for steps, stats in ((4, res["stats_a"]), (3, res["stats_b"])):
        for rank in (0, 1):
            c = counts(stats, rank)
            assert c["all_reduce_"] == steps * (2 * LAYERS + 1)  # o_proj, down_proj, embedding
            assert c["all_gather"] == steps                      # lm_head logits
            for op, n in per_step_forward(steps).items():
                assert c[op] == n, (rank, op)
            assert counts(stats, rank, "reshape")["broadcast_plan"] == steps
        assert "sample" in counts(stats, 0) and "sample" not in counts(stats, 1)
        for rank in (0, 1):
            rows = [r for r in stats if r["rank"] == rank and r["section"] == "forward"]
            assert abs(sum(r["percentage"] for r in rows) - 100.0) < 1e-6
    events = json.load(open(trace))["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert sum(1 for e in events if e["name"] == "all_gather" and e["pid"] == 1) == 2
    # the last step of every rank is the embedding's forward (rank 0 counted the scratch forwards
    # into its last engine step, rank 1 as steps of their own)
    last = json.load(open(trace + ".last"))["traceEvents"]
    for rank in (0, 1):
        names = [e["name"] for e in last if e["pid"] == rank]
        assert names.count("Linear") == 4 * LAYERS and names.count("broadcast_plan") == 1, (rank, names)
