"""Several models in one server: the ModelRouter's loading, LRU unloading and routing, and the
server (one process and under mpirun -np 2) through the official openai client."""
import json
import os
import time

import httpx
import numpy as np
import openai
import pytest

from models import build_model
from numa_runtime import Engine, SamplingParams
from numa_runtime.serve.router import (ModelLoadError, ModelRouter, ModelSpec, ModelUnavailableError,
                                       RouterConfig, models_in_dir, parse_bytes)

KW = dict(dtype="float32", kv_cache_memory=1 << 20, max_model_len=128)
PROMPT = [1, 17, 42, 99, 5, 7]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    expected = {}
    for name, arch, seed in (("alpha", "llama", 0), ("beta", "qwen2", 1), ("gamma", "qwen3", 2)):
        build_model(str(root / name), arch=arch, seed=seed)
        eng = Engine(str(root / name), **KW)
        expected[name] = eng.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
        eng.close()
    assert len({tuple(t) for t in expected.values()}) == 3  # the models really differ
    return str(root), expected


def router(root, names, budget_models: float):
    """A router whose budget holds `budget_models` times the largest model's footprint."""
    specs = tuple(ModelSpec(n, os.path.join(root, n)) for n in names)
    probe = ModelRouter(RouterConfig(specs, 1 << 40, KW))
    budget = int(max(probe.footprint.values()) * budget_models)
    return ModelRouter(RouterConfig(specs, budget, KW))


def run(r, name, rid):
    r.route[rid] = name
    r.add_request(PROMPT, GREEDY, request_id=rid)
    while r.has_unfinished_requests():
        for o in r.step():
            if o.finished:
                return o.outputs[0].token_ids


def test_routes_by_model_and_unloads_the_least_recently_used(models):
    root, expected = models
    r = router(root, ["alpha", "beta", "gamma"], 2.2)  # two fit at once
    assert run(r, "alpha", "a1") == expected["alpha"]
    assert run(r, "beta", "b1") == expected["beta"]
    assert list(r.engines) == ["alpha", "beta"] and not r.owner
    assert run(r, "alpha", "a2") == expected["alpha"]  # alpha is now the most recent
    assert run(r, "gamma", "c1") == expected["gamma"]  # needs room: beta goes
    assert list(r.engines) == ["alpha", "gamma"]
    assert set(r.load_seconds) == {"alpha", "beta", "gamma"} and set(r.unload_seconds) == {"beta"}
    r.close()
    assert not r.engines


def test_the_engine_gauges_count_every_loaded_model(models):
    """AsyncEngine's gauges (and so /metrics and the queue limit) read a router's engines: they
    were always 0 on a server of several models, and --max-queue never refused."""
    from numa_runtime.serve.async_engine import AsyncEngine
    root, _ = models
    r = router(root, ["alpha", "beta"], 2.5)
    try:
        for rid, name in (("a", "alpha"), ("b", "beta")):
            r.route[rid] = name
            r.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), request_id=rid)
        r.step()
        a = AsyncEngine(r)
        a._update_stats()
        assert a.stats.num_running + a.stats.num_waiting == 2 and a.stats.kv_cache_usage > 0
    finally:
        r.close()


def test_a_busy_model_is_never_unloaded(models):
    root, expected = models
    r = router(root, ["alpha", "beta"], 1.5)  # one at a time
    r.route["a1"] = "alpha"
    r.add_request(PROMPT, GREEDY, request_id="a1")
    r.step()  # alpha has an unfinished request
    r.route["b1"] = "beta"
    with pytest.raises(ModelUnavailableError, match="does not fit in the memory budget beside the busy"):
        r.add_request(PROMPT, GREEDY, request_id="b1")
    r.abort_request("a1")
    assert run(r, "beta", "b2") == expected["beta"] and list(r.engines) == ["beta"]
    r.close()


def test_a_model_whose_prompt_logprobs_request_waits_for_room_is_not_unloaded(models):
    """alpha's prompt_logprobs request waits for KV room (Engine's pending queue) while its running
    requests finish; in the step between their end and its admission, a request for beta found
    alpha's scheduler empty, unloaded alpha, and the waiting request never got an output. Now
    alpha counts as busy until it ran, and its output comes."""
    root, expected = models
    kw = dict(KW, kv_cache_memory=12 * 8192, block_size=16)
    specs = tuple(ModelSpec(n, os.path.join(root, n)) for n in ("alpha", "beta"))
    probe = ModelRouter(RouterConfig(specs, 1 << 40, kw))
    r = ModelRouter(RouterConfig(specs, int(max(probe.footprint.values()) * 1.5), kw))  # one at a time
    try:
        for i in range(2):
            r.route[f"run{i}"] = "alpha"
            r.add_request(list(range(3 + i, 43 + i)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          request_id=f"run{i}")
        got = r.step()
        r.route["p"] = "alpha"
        r.add_request(list(range(7, 127)), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                      request_id="p")
        alpha = r.engines["alpha"]
        while alpha.scheduler.has_unfinished():
            got += r.step()
        assert alpha.has_work() and not any(o.request_id == "p" for o in got)
        r.route["b"] = "beta"
        with pytest.raises(ModelUnavailableError, match="beside the busy models"):
            r.add_request(PROMPT, GREEDY, request_id="b")
        while r.has_unfinished_requests():
            got += r.step()
        p = [o for o in got if o.request_id == "p" and o.finished]
        assert len(p) == 1 and len(p[0].prompt_logprobs) == 120
        assert run(r, "beta", "b2") == expected["beta"] and list(r.engines) == ["beta"]
    finally:
        r.close()


UNLOAD_SCRIPT = """
import sys, psutil
from numa_runtime import SamplingParams
from numa_runtime.serve.router import ModelRouter, ModelSpec, RouterConfig
p = psutil.Process()
anon = lambda: p.memory_info().rss - p.memory_info().shared
kw = dict(dtype="float32", kv_cache_memory=1 << 20, max_model_len=128, num_threads=1)
r = ModelRouter(RouterConfig((ModelSpec("mid", sys.argv[1]), ModelSpec("alpha", sys.argv[2])), 1 << 40, kw))
r.get("alpha")
before = anon()
r.route["a"] = "mid"
r.add_request(list(range(3, 60)), SamplingParams(max_tokens=2), request_id="a")
while r.has_unfinished_requests():
    r.step()
loaded = anon()
r._unload("mid")
print(before, loaded, anon())
"""


def test_unloading_gives_the_memory_back(models, tmp_path):
    """An unloaded model's memory goes back to the OS: the anonymous RSS returns near where it
    was before the load (glibc kept over half of it before). A fresh process, so that only the
    router's allocations are measured."""
    import subprocess
    import sys
    root, _ = models
    mid = str(tmp_path / "mid")  # 48 MB of f32 weights
    build_model(mid, arch="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2)
    p = subprocess.run([sys.executable, "-c", UNLOAD_SCRIPT, mid, os.path.join(root, "alpha")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    before, loaded, after = map(int, p.stdout.split()[-3:])
    assert loaded - before > 40 << 20  # the model really was resident
    assert after - before < (loaded - before) / 4, (before, loaded, after)


def test_bad_configurations_are_clear(models, tmp_path):
    root, _ = models
    spec = ModelSpec("alpha", os.path.join(root, "alpha"))
    with pytest.raises(ValueError, match="more than the memory budget"):
        ModelRouter(RouterConfig((spec,), 1 << 10, KW))
    with pytest.raises(ValueError, match="Two models are named 'alpha'"):
        RouterConfig((spec, spec), 1 << 30, KW)
    with pytest.raises(FileNotFoundError,
                       match="holds no model \\(a subdirectory with config.json, or a .gguf file\\)"):
        models_in_dir(str(tmp_path))
    assert [m.name for m in models_in_dir(root)] == ["alpha", "beta", "gamma"]
    assert parse_bytes("16G") == 16 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("1000") == 1000
    with pytest.raises(ValueError, match="Cannot read 'lots' as a size"):
        parse_bytes("lots")


def without_weights(model_dir, dest):
    """A copy of model_dir without its weight files (its config and tokenizer read fine)."""
    import shutil
    dest.mkdir()
    for f in os.listdir(model_dir):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(model_dir, f), dest / f)
    return dest


# ------------------------------------------------------------------ the server
def serve(root, names, budget, launcher=(), extra=(), env=None):
    from test_server import ServerProcess
    args = [a for n in names for a in ("--model", os.path.join(root, n))]
    return ServerProcess([*args, "--dtype", "float32", "--kv-cache-memory", str(1 << 20), "--max-model-len", "128",
                          "--memory-budget", str(budget), *extra], launcher=launcher,
                         env={"OMP_NUM_THREADS": "1", "MPI4PY_RC_THREAD_LEVEL": "funneled", **(env or {})})


def budget_for(root, names, n):
    specs = tuple(ModelSpec(m, os.path.join(root, m)) for m in names)
    return int(max(ModelRouter(RouterConfig(specs, 1 << 40, KW)).footprint.values()) * n)


@pytest.mark.parametrize("ranks", [1, 2])
def test_server_serves_each_model_by_name(models, ranks):
    root, expected = models
    launcher = ["mpirun", "-np", "2"] if ranks == 2 else []
    names = ["alpha", "beta"]
    # NOTE: numa-launch --tp 2 sets NUMA_RUNTIME_DATA_PARALLEL=1, one model over all ranks: allowed (it was refused)
    srv = serve(root, names, budget_for(root, names, 2.5), launcher,
                env={"NUMA_RUNTIME_DATA_PARALLEL": "1"} if ranks == 2 else None)
    try:
        client = srv.client()
        assert [m.id for m in client.models.list().data] == names
        # a series a model from the first scrape (they were one unlabelled series until the first request)
        from prometheus_client.parser import text_string_to_metric_families
        first = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.base + "/metrics").text)}
        for fam in ("vllm:num_requests_running", "vllm:prefix_cache_queries"):
            assert sorted(smp.labels.get("model_name") for smp in first[fam].samples) == names, first[fam].samples
        for name in names:
            text = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
            ref = Engine(os.path.join(root, name), **KW)
            assert text == ref.tokenizer.decode(expected[name], skip_special_tokens=True)
            # embeddings go to the model named too (the client asks for base64)
            emb = client.embeddings.create(model=name, input=[PROMPT]).data[0].embedding
            np.testing.assert_allclose(emb, ref.embed([PROMPT])[0], atol=2e-5)
            ref.close()
        for name in names:  # structured output (it was a 500 on a server of several models)
            fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"enum": ["yes", "no"]}}}
            out = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "?"}],
                                                 max_tokens=8, response_format=fmt).choices[0]
            assert out.finish_reason == "stop" and out.message.content in ('"yes"', '"no"')
        with pytest.raises(openai.NotFoundError, match="does not exist; this server serves 'alpha', 'beta'"):
            client.completions.create(model="delta", prompt="x", max_tokens=2)
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and "Name the model" in r.json()["error"]["message"]
        # one registry for every model (it counted the first model's requests only), labelled by model
        from test_server import metric
        for name in names:
            assert metric(srv.base, f'numa_runtime_requests_total{{model_name="{name}"}}') == 2
            assert metric(srv.base, f'numa_runtime_generation_tokens_total{{model_name="{name}"}}') >= 8
        assert metric(srv.base, 'numa_runtime_http_responses_total{code="404"}') == 1
        assert metric(srv.base, 'numa_runtime_http_responses_total{code="400"}') >= 1
        assert all(m["max_model_len"] == 128 for m in httpx.get(srv.base + "/v1/models").json()["data"])
        # the engine gauges per model, as vLLM labels them (they were the models' sums, unlabelled)
        from prometheus_client.parser import text_string_to_metric_families
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.base + "/metrics").text)}
        for fam in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                    "vllm:num_preemptions", "numa_runtime_prefix_cache_hit_rate", "vllm:prefix_cache_queries",
                    "vllm:prefix_cache_hits"):
            assert sorted(smp.labels.get("model_name") for smp in fams[fam].samples) == names, fams[fam].samples
        # the openai client's models.retrieve (it was a 404 "no such endpoint")
        assert client.models.retrieve("beta").model_dump()["id"] == "beta"
        # a --model string as typed names its model too, as with one model (it was a 404); the card's root is it
        path = os.path.join(root, "beta")
        got = client.completions.create(model=path, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.model == "beta" and got.choices[0].text == client.completions.create(
            model="beta", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        assert client.models.retrieve(path).model_dump()["root"] == path
        assert [m.root for m in client.models.list().data] == [os.path.join(root, n) for n in names]
        with pytest.raises(openai.NotFoundError, match="'delta' does not exist"):
            client.models.retrieve("delta")
        # a body that is not a JSON object is answered for what it is (it was told to name the model)
        for body in (b'{"model": "alpha", "prompt": "hi"', b"not json", b"[1, 2]"):
            r = httpx.post(srv.base + "/v1/completions", content=body, timeout=30,
                           headers={"Content-Type": "application/json"})
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and "Name the model" not in message, message
            assert ("not valid JSON" if body[0] != ord("[") else "valid dictionary or object") in message, message
        for bad in (["alpha"], {"a": 1}, 7):
            r = httpx.post(srv.base + "/v1/completions", json={"model": bad, "prompt": "x"}, timeout=30)
            assert r.status_code == 400 and "'model' must be a string" in r.json()["error"]["message"]
        # NOTE: /ping (SageMaker's health check is a POST without a body) and a POST no route has go to an app
        # as on a server of one model (they were 400 "Name the model")
        for method in ("GET", "POST"):
            assert httpx.request(method, srv.base + "/ping", timeout=30).json() == {"status": "ok"}
        assert httpx.post(srv.base + "/v1/responses/resp_x/cancel", timeout=30).status_code == 404
        # CORS once around every model's answers (/v1/models the dispatcher's own), as on one model
        page = {"Origin": "https://chat.example"}
        pre = httpx.options(srv.base + "/v1/completions", headers={**page, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        for r in (httpx.get(srv.base + "/v1/models", headers=page),
                  httpx.post(srv.base + "/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 1},
                             headers=page, timeout=30)):
            assert r.status_code == 200 and r.headers.get_list("access-control-allow-origin") == ["*"]
    finally:
        assert srv.stop() == 0, srv.output()


def test_loading_model_gets_503_with_retry_after_then_serves(models):
    root, expected = models
    names = ["alpha", "beta"]
    srv = serve(root, names, budget_for(root, names, 1.5), extra=["--load-timeout", "0.01"])
    try:
        r = httpx.post(srv.base + "/v1/completions", json={"model": "beta", "prompt": PROMPT, "max_tokens": 8,
                                                           "temperature": 0, "ignore_eos": True}, timeout=30)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "model_loading"

        def loaded():
            return {m["id"]: m["loaded"] for m in httpx.get(srv.base + "/v1/models").json()["data"]}
        deadline = time.monotonic() + 120
        while loaded() != {"alpha": False, "beta": True}:  # beta replaces alpha (one fits)
            assert time.monotonic() < deadline, srv.output()
            time.sleep(0.05)  # NOTE: polling interval of the condition above, not a wait for it
        listed = {m["id"]: m for m in httpx.get(srv.base + "/v1/models").json()["data"]}
        # the server's own seconds: alpha loaded at start-up and was unloaded for beta
        assert listed["alpha"]["load_seconds"] > 0 and listed["alpha"]["unload_seconds"] > 0
        assert listed["beta"]["load_seconds"] > 0 and listed["beta"]["unload_seconds"] is None
        client = srv.client()
        text = client.completions.create(model="beta", prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        ref = Engine(os.path.join(root, "beta"), **KW)
        assert text == ref.tokenizer.decode(expected["beta"], skip_special_tokens=True)
        ref.close()
    finally:
        assert srv.stop() == 0, srv.output()


def test_gguf_files_among_several_models(models, tmp_path):
    """--model x.gguf beside a directory, and a .gguf file in --models-dir: each named by the
    file's stem, each answering as Engine(x.gguf) does."""
    from gguf_helpers import write_gguf
    root, _ = models
    path = str(tmp_path / "alpha-q8.gguf")
    write_gguf(os.path.join(root, "alpha"), path, "Q8_0")
    ref = Engine(path, **KW)
    want = ref.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text
    ref.close()
    os.symlink(os.path.join(root, "beta"), str(tmp_path / "beta"))
    assert [m.name for m in models_in_dir(str(tmp_path))] == ["alpha-q8", "beta"]
    srv = serve(root, ["beta"], budget_for(root, ["alpha", "beta"], 2.5), extra=("--model", path))
    try:
        client = srv.client()
        assert [m.id for m in client.models.list().data] == ["beta", "alpha-q8"]
        text = client.completions.create(model="alpha-q8", prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        assert text == want
    finally:
        assert srv.stop() == 0, srv.output()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_model_that_fails_to_load_leaves_the_others_serving(models, tmp_path, ranks):
    """A model whose weights are missing fails on every rank alike: its request gets a 500 that
    says why, and the other models still load and serve (under mpirun the worker used to exit
    and rank 0 hung on the next load)."""
    root, expected = models
    bad = without_weights(os.path.join(root, "alpha"), tmp_path / "broken")
    launcher = ["mpirun", "-np", "2"] if ranks == 2 else []
    srv = serve(root, ["alpha", "beta"], budget_for(root, ["alpha", "beta"], 1.5), launcher,
                extra=["--model", str(bad)])
    try:
        client = srv.client()
        kw = dict(prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(model="alpha", **kw).choices[0].text
        with pytest.raises(openai.InternalServerError, match="The model 'broken' failed to load: "):
            client.completions.create(model="broken", **kw)
        ref = Engine(os.path.join(root, "beta"), **KW)
        want = ref.tokenizer.decode(expected["beta"], skip_special_tokens=True)
        ref.close()
        assert client.completions.create(model="beta", **kw).choices[0].text == want
    finally:
        assert srv.stop() == 0, srv.output()


def test_each_model_gets_the_kv_pool_of_the_budget_rule(models):
    """Without --kv-cache-memory each model's KV pool is the budget rule's share, not a pool the
    engine sizes from the host's memory (which loaded several models far past the budget)."""
    root, _ = models
    specs = tuple(ModelSpec(n, os.path.join(root, n)) for n in ("alpha", "beta"))
    kw = {k: v for k, v in KW.items() if k != "kv_cache_memory"}
    r = ModelRouter(RouterConfig(specs, 64 << 20, kw))
    try:
        eng = r.get("alpha")
        assert eng.runner.kv_cache_bytes <= r._kv_bytes() == int((64 << 20) * 0.25 / 2)
    finally:
        r.close()


def test_a_model_that_fails_to_load_on_one_rank_fails_on_every_rank(models, tmp_path):
    """A load that fails on one rank alone (its node is out of memory) fails on every rank: the
    request gets a 500 naming the rank and its error, and the loaded model keeps serving on both
    ranks (rank 0 used to wait for ever in a collective the failed worker never reached)."""
    import resource
    from test_server_robust import _rank_process
    root, expected = models
    big = str(tmp_path / "big")  # 48 MB of f32 weights, 24 MB a rank
    build_model(big, arch="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2)
    srv = serve(root, ["alpha"], 1 << 30, ["mpirun", "-np", "2"], extra=["--model", big],
                env={"NUMA_RUNTIME_LOAD_RETRY_S": "2"})
    worker = None
    try:
        client = srv.client()
        kw = dict(prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        want = client.completions.create(model="alpha", **kw).choices[0].text
        worker = _rank_process(srv.proc.pid, 1)
        soft, hard = resource.prlimit(worker.pid, resource.RLIMIT_DATA)
        with open(f"/proc/{worker.pid}/status") as f:  # VmData: what RLIMIT_DATA limits
            data = int(next(ln for ln in f if ln.startswith("VmData:")).split()[1]) << 10
        # room for serving alpha, not for big's 24 MB of weights
        resource.prlimit(worker.pid, resource.RLIMIT_DATA, (data + (8 << 20), hard))
        with pytest.raises(openai.InternalServerError,
                           match="The model 'big' failed to load: Rank 1 failed to load the model \\(MemoryError"):
            client.completions.create(model="big", **kw)
        assert client.completions.create(model="alpha", **kw).choices[0].text == want
        resource.prlimit(worker.pid, resource.RLIMIT_DATA, (soft, hard))
        deadline = time.monotonic() + 60
        while True:  # NOTE: within NUMA_RUNTIME_LOAD_RETRY_S of the failure a request fails at once, saying so
            try:
                assert client.completions.create(model="big", **kw).choices[0].text  # loads now
                break
            except openai.InternalServerError as e:
                assert "a request loads it again" in str(e) and time.monotonic() < deadline, e
        assert client.completions.create(model="alpha", **kw).choices[0].text == want
    finally:
        assert srv.stop() == 0, srv.output()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_first_model_that_fails_to_load_leaves_the_next_to_start_and_none_stops_start_up(models, tmp_path, ranks):
    """The first model loads at start-up: a broken one there (the first name of a --models-dir) stopped the
    server and every model with it; the next one that loads now starts it, the broken one answering its
    requests with a 500. With none that loads every rank exits, rank 0 with one line (no traceback, and
    under mpirun no worker left in its loop)."""
    import subprocess
    import sys
    from test_server import ROOT
    root, _ = models
    bad = without_weights(os.path.join(root, "alpha"), tmp_path / "broken")
    worse = without_weights(os.path.join(root, "beta"), tmp_path / "worse")
    launcher = ["mpirun", "-np", "2"] if ranks == 2 else []
    srv = serve(root, [], budget_for(root, ["alpha"], 1.5), launcher,
                extra=["--model", str(bad), "--model", os.path.join(root, "alpha")])
    try:
        client = srv.client()
        kw = dict(prompt=PROMPT, max_tokens=4, temperature=0)
        assert client.completions.create(model="alpha", **kw).choices[0].text
        with pytest.raises(openai.InternalServerError, match="The model 'broken' failed to load: "):
            client.completions.create(model="broken", **kw)
    finally:
        assert srv.stop() == 0, srv.output()
    cmd = [*launcher, sys.executable, "-m", "numa_runtime.serve", "--model", str(bad), "--model", str(worse),
           "--dtype", "float32", "--kv-cache-memory", str(1 << 20)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "MPI4PY_RC_THREAD_LEVEL": "funneled"})
    err = p.stderr
    assert p.returncode == 2 and "Traceback" not in err, err
    assert err.count("numa-serve: error: The model 'broken' failed to load: ") == 1, err


def test_models_dir_entries_that_cannot_be_served_are_named_and_the_rest_serve(models, tmp_path):
    """--models-dir with a .gguf that is no GGUF and a model of an architecture numa_runtime does not run:
    either stopped every model of the folder at start-up; each is now named in one log line and the
    others serve. A folder of none that serves stops start-up in one sentence."""
    import json
    import shutil
    import subprocess
    import sys
    from test_server import ROOT
    root, _ = models
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copytree(os.path.join(root, "alpha"), folder / "good")
    (folder / "aaa.gguf").write_bytes(b"not a gguf file at all" * 10)
    shutil.copytree(os.path.join(root, "beta"), folder / "other")
    cfg = json.loads((folder / "other" / "config.json").read_text())
    (folder / "other" / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    shutil.copytree(os.path.join(root, "beta"), folder / "zlist")
    (folder / "zlist" / "config.json").write_text("[1, 2]")  # NOTE: an AttributeError stopped the folder
    srv = serve(root, [], budget_for(root, ["alpha"], 1.5), extra=["--models-dir", str(folder)])
    try:
        client = srv.client()
        assert [m.id for m in client.models.list().data] == ["good"]
        assert client.completions.create(model="good", prompt=PROMPT, max_tokens=4).choices[0].text
        out = srv.output()
        assert "--models-dir: %s is not served: " % (folder / "aaa.gguf") in out, out
        assert "--models-dir: %s is not served: " % (folder / "other") in out and "FooForCausalLM" in out
        assert "--models-dir: %s is not served: " % (folder / "zlist") in out and "not a JSON object" in out
    finally:
        assert srv.stop() == 0, srv.output()
    # a tokenizer.json that does not parse is named and left out too (it stopped every model, naming none)
    shutil.copytree(os.path.join(root, "beta"), folder / "badtok")
    (folder / "badtok" / "tokenizer.json").write_text('{1: "x"}')
    srv = serve(root, [], budget_for(root, ["alpha"], 1.5), extra=["--models-dir", str(folder)])
    try:
        assert [m.id for m in srv.client().models.list().data] == ["good"]
        out = srv.output()
        assert "--models-dir: %s is not served: %s is not a tokenizer.json the tokenizers library reads (" % (
            folder / "badtok", folder / "badtok" / "tokenizer.json") in out, out
    finally:
        assert srv.stop() == 0, srv.output()
    shutil.rmtree(folder / "good")
    shutil.rmtree(folder / "zlist")
    shutil.rmtree(folder / "badtok")
    # an empty folder beside --model serves the --model (it refused to start), as a folder of unservable files does
    empty = tmp_path / "empty"
    empty.mkdir()
    srv = serve(root, ["alpha"], budget_for(root, ["alpha"], 1.5), extra=["--models-dir", str(empty)])
    try:
        assert [m.id for m in srv.client().models.list().data] == ["alpha"]
    finally:
        assert srv.stop() == 0, srv.output()
    p = subprocess.run([sys.executable, "-m", "numa_runtime.serve", "--models-dir", str(folder), "--dtype",
                        "float32"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "numa-serve: error: --models-dir '%s' holds no model numa_runtime serves: " % folder in p.stderr, p.stderr


def test_a_models_dir_entry_that_fails_on_one_rank_is_left_out_on_every_rank(models, tmp_path):
    """Each rank listed --models-dir by itself: a GGUF that rank 1 could not convert (a cache it cannot
    write, as on another host) was left out there alone, the ranks' lists differed, and rank 1 loaded
    another model for the one rank 0 asked (wrong text, then an abort). The ranks now agree: it is left
    out on every rank, named with the rank it failed on, and the rest serve."""
    import shutil
    from gguf_helpers import write_gguf
    root, _ = models
    folder = tmp_path / "models"
    folder.mkdir()
    write_gguf(os.path.join(root, "alpha"), str(folder / "a.gguf"), "Q8_0")
    shutil.copytree(os.path.join(root, "beta"), folder / "z_good")
    rank1_cache = 'if [ "$PMI_RANK" = 1 ]; then export NUMA_RUNTIME_CACHE=/proc/no-cache; fi; exec "$@"'
    launcher = ["mpirun", "-np", "2", "sh", "-c", rank1_cache, "sh"]
    srv = serve(root, [], budget_for(root, ["beta"], 1.5), launcher, extra=["--models-dir", str(folder)],
                env={"NUMA_RUNTIME_CACHE": str(tmp_path / "cache")})
    try:
        client = srv.client()
        assert [m.id for m in client.models.list().data] == ["z_good"]
        ref = Engine(str(folder / "z_good"), **KW)
        want = ref.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].text
        ref.close()
        got = client.completions.create(model="z_good", prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
        assert got == want
        assert "--models-dir: %s is not served: " % (folder / "a.gguf") in srv.output() and "(rank 1)" in srv.output()
    finally:
        assert srv.stop() == 0, srv.output()


def test_the_operator_profile_of_each_model(models, tmp_path):
    """AS_PROFILE=ON with several models: /debug/profile said profiling was off; it answers the
    first model's report, or that of ?model=NAME (loading it as a request does). Each model
    writes its AS_PROFILE_TRACE to a file of its own (they overwrote one file)."""
    import httpx
    root, _ = models
    names = ["alpha", "beta"]
    trace = tmp_path / "trace.json"
    srv = serve(root, names, budget_for(root, names, 2.5), extra=["--num-threads", "1"],
                env={"AS_PROFILE": "ON", "AS_PROFILE_TRACE": str(trace), "AS_PROFILE_TRACE_STEPS": "2"})
    try:
        srv.client().completions.create(model="alpha", prompt=PROMPT, max_tokens=2)
        first = httpx.get(srv.base + "/debug/profile", timeout=60)
        beta = httpx.get(srv.base + "/debug/profile?model=beta", timeout=120)
        missing = httpx.get(srv.base + "/debug/profile?model=nope", timeout=60)
        srv.client().completions.create(model="beta", prompt=PROMPT, max_tokens=3)
    finally:
        assert srv.stop() == 0, srv.output()
    assert first.status_code == 200 and "model alpha" in first.text, first.text[:500]
    assert beta.status_code == 200 and "model beta" in beta.text, beta.text[:500]
    assert missing.status_code == 404 and "'nope' does not exist" in missing.text
    assert not trace.exists()
    for name in names:
        events = json.loads((tmp_path / f"trace.{name}.json").read_text())["traceEvents"]
        assert [e["args"]["name"] for e in events if e["ph"] == "M"] == [f"rank 0 ({name})"]
        assert sum(e["name"] == "schedule" for e in events) == 2


def test_per_model_engine_stats_outlive_an_unload(models):
    """Each model's prefix-cache hit rate and preemptions count over its life, unloaded or not
    (the hit rate covered the loaded models only)."""
    root, _ = models
    r = router(root, ["alpha", "beta"], 1.2)  # one model at a time

    def ask(name, rid):  # NOTE: a prompt of several KV blocks
        r.route[rid] = name
        r.add_request(PROMPT * 8, GREEDY, request_id=rid)
        while r.has_unfinished_requests():
            r.step()
    for rid in ("a1", "a2"):  # NOTE: the second finds the first's prompt blocks cached
        ask("alpha", rid)
    stats = {row[0]: row for row in r.model_stats()}
    hit = stats["alpha"][4]
    assert hit > 0 and r.hit_rate == pytest.approx(hit)
    queries, hits = stats["alpha"][6:8]
    assert queries == 2 * len(PROMPT * 8) and hits / queries == pytest.approx(hit)
    ask("beta", "b1")  # NOTE: alpha unloaded for it
    assert list(r.engines) == ["beta"]
    stats = {row[0]: row for row in r.model_stats()}
    assert stats["alpha"][1:5] == (0, 0, 0.0, hit) and stats["beta"][4] == 0.0
    assert stats["alpha"][6:8] == (queries, hits) and stats["beta"][7] == 0 < stats["beta"][6]
    assert 0 < r.hit_rate < hit  # NOTE: beta's lookups found nothing cached
    r.close()


def test_a_reloaded_model_writes_a_trace_of_its_own(models, tmp_path, monkeypatch):
    """AS_PROFILE_TRACE: a model loaded again wrote over the trace of its first load."""
    root, _ = models
    monkeypatch.setenv("AS_PROFILE_TRACE", str(tmp_path / "trace.json"))
    monkeypatch.setenv("AS_PROFILE_TRACE_STEPS", "2")
    r = router(root, ["alpha", "beta"], 1.2)  # one model at a time
    try:
        for rid, name in (("a1", "alpha"), ("b1", "beta"), ("a2", "alpha")):  # NOTE: alpha unloaded, then back
            run(r, name, rid)
        assert list(r.engines) == ["alpha"]
    finally:
        r.close()
    for file, label in (("trace.alpha.json", "alpha"), ("trace.beta.json", "beta"),
                        ("trace.alpha.2.json", "alpha, load 2")):
        events = json.loads((tmp_path / file).read_text())["traceEvents"]
        assert [e["args"]["name"] for e in events if e["ph"] == "M"] == [f"rank 0 ({label})"], file
        assert sum(e["name"] == "schedule" for e in events) == 2, file


def test_a_model_that_fails_to_load_never_unloads_the_others(models, tmp_path):
    """Each request for a broken model unloaded the idle models to make room, then failed: every
    such request cost the others a reload. Weights that cannot be opened fail before anything is
    unloaded, and a failure is remembered until the model's files change."""
    import shutil
    root, expected = models
    for name in ("alpha", "broken"):
        shutil.copytree(os.path.join(root, "alpha"), tmp_path / name)
    weights = next(f for f in os.listdir(tmp_path / "broken") if f.endswith(".safetensors"))
    os.rename(tmp_path / "broken" / weights, tmp_path / weights)
    r = router(str(tmp_path), ["alpha", "broken"], 1.2)  # one model at a time
    assert run(r, "alpha", "a1") == expected["alpha"]
    for _ in range(2):
        with pytest.raises(ModelLoadError, match="The model 'broken' failed to load: "):
            r.get("broken")
        assert list(r.engines) == ["alpha"] and not r.unload_seconds
    os.rename(tmp_path / weights, tmp_path / "broken" / weights)  # fixed: it loads on the next request
    assert run(r, "broken", "b1") == expected["alpha"]
    assert list(r.engines) == ["broken"]
    assert run(r, "alpha", "a2") == expected["alpha"]
    (tmp_path / "broken" / "tokenizer.json").write_text("{bad")  # a file the load parses, broken
    with pytest.raises(ModelLoadError, match=r"tokenizer.json is not valid JSON"):
        r.get("broken")
    assert list(r.engines) == ["alpha"]
    shutil.copy(tmp_path / "alpha" / "tokenizer.json", tmp_path / "broken" / "tokenizer.json")
    path = tmp_path / "broken" / weights  # a truncated download: its header reads, its tensors do not
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    unloads = dict(r.unload_seconds)
    for _ in range(2):
        with pytest.raises(ModelLoadError, match=r"is truncated: it ends at byte .*download it again"):
            r.get("broken")
        assert list(r.engines) == ["alpha"] and r.unload_seconds == unloads
    r.close()


def test_a_load_that_fails_for_memory_is_not_retried_at_the_others_cost(models, tmp_path, monkeypatch):
    """A load that fails for a reason other than its files (here MemoryError) may pass later, so it
    is not remembered as broken files are; but each request for it unloaded the idle models again
    and failed again. For NUMA_RUNTIME_LOAD_RETRY_S after a failure its requests fail at once, naming when
    the next load comes; then it loads."""
    import shutil
    import numa_runtime.engine as engine_module
    root, expected = models
    for name in ("alpha", "big"):
        shutil.copytree(os.path.join(root, "alpha"), tmp_path / name)
    real = engine_module.Engine
    fail = {"big": True}

    def engine(model_dir, **kw):
        if fail.get(os.path.basename(model_dir)):
            raise MemoryError("no memory for its weights")
        return real(model_dir, **kw)
    monkeypatch.setattr(engine_module, "Engine", engine)
    r = router(str(tmp_path), ["alpha", "big"], 1.2)  # one model at a time
    with pytest.raises(ModelLoadError, match="The model 'big' failed to load: no memory"):
        r.get("big")
    assert run(r, "alpha", "a1") == expected["alpha"]
    fail["big"] = False  # NOTE: the memory is there now, but the retry waits its time
    with pytest.raises(ModelLoadError, match=r"failed to load: no memory for its weights \(a request loads it "
                                             r"again [0-9]+ s from now\)\.$"):
        r.get("big")
    assert list(r.engines) == ["alpha"] and not r.unload_seconds  # NOTE: alpha stayed
    monkeypatch.setenv("NUMA_RUNTIME_LOAD_RETRY_S", "0")
    assert run(r, "big", "b1") == expected["alpha"]
    assert list(r.engines) == ["big"]
    r.close()


@pytest.mark.parametrize("kw", [dict(dtype="float32", kv_cache_memory=200_000),
                                dict(dtype="float32", kv_cache_memory=150_000, kv_cache_dtype="int8",
                                     max_model_len=128, block_size=8),
                                dict(dtype="bfloat16", kv_cache_memory=1 << 20, max_num_seqs=2)])
def test_an_unloaded_models_context_is_the_one_it_loads_with(models, kw):
    """/v1/models (and /tokenize) showed an unloaded model's max_position_embeddings, more than its
    KV pool holds: clients sized prompts that got a 400 once it loaded."""
    root, _ = models
    specs = tuple(ModelSpec(n, os.path.join(root, n)) for n in ("alpha", "beta", "gamma"))
    r = ModelRouter(RouterConfig(specs, 1 << 40, kw))
    for name in r.specs:
        before = r.context_len(name)
        assert before == r.get(name).max_model_len, (name, before)
    r.close()


def test_an_asked_context_a_models_pool_cannot_hold_is_refused_at_start(models):
    """--max-model-len past what a model's KV pool holds: that model could never load (the Engine
    refuses it, as vLLM does), so the server refuses it at start-up, naming the model."""
    root, _ = models
    specs = tuple(ModelSpec(n, os.path.join(root, n)) for n in ("alpha", "beta", "gamma"))
    kw = dict(dtype="float32", kv_cache_memory=150_000, kv_cache_dtype="int8", max_model_len=512, block_size=8)
    with pytest.raises(ValueError, match=r"^max_model_len=512 is larger than the KV cache of model '(alpha|beta|gamma)' "
                                         r"holds \(\d+ tokens\); raise --kv-cache-memory or lower --max-model-len\.$"):
        ModelRouter(RouterConfig(specs, 1 << 40, kw))


def test_a_model_waits_for_room_that_a_busy_model_holds(models):
    """One model fits at a time and alpha streams: a request for beta waits (up to --load-timeout)
    for alpha's request to end, then beta replaces it. It got a 503 at once."""
    import threading
    root, expected = models
    names = ["alpha", "beta"]
    srv = serve(root, names, budget_for(root, names, 1.5), extra=["--load-timeout", "120", "--num-threads", "1"])
    try:
        client = srv.client()
        stream = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=100, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))  # alpha is running
        assert first.choices[0].text is not None
        answer = {}
        t = threading.Thread(target=lambda: answer.setdefault("beta", client.completions.create(
            model="beta", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})))
        t.start()
        rest = "".join(c.choices[0].text for c in stream)  # alpha's request runs to its end
        t.join(timeout=300)
        assert rest and "beta" in answer, srv.output()
        ref = Engine(os.path.join(root, "beta"), **KW)
        want = ref.tokenizer.decode(expected["beta"], skip_special_tokens=True)
        assert answer["beta"].choices[0].text == want
        ref.close()
        assert {m["id"]: m["loaded"] for m in httpx.get(srv.base + "/v1/models").json()["data"]} == \
            {"alpha": False, "beta": True}
    finally:
        assert srv.stop() == 0, srv.output()


def test_requests_that_arrive_after_a_waiting_model_queue_behind_it(models):
    """The router: while beta waits for the room busy alpha holds, a request to alpha that arrived
    after beta began to wait is held (alpha drains, then beta loads); one that arrived before is not."""
    root, expected = models
    r = router(root, ["alpha", "beta", "gamma"], 1.05)  # one model at a time
    r.route["a1"] = "alpha"
    r.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id="a1")
    with pytest.raises(ModelUnavailableError, match="beside the busy models"):
        r.get("beta", since=10.0)
    r.waiters[object()] = ("beta", 10.0)  # NOTE: what the HTTP side records while beta's request waits
    r.route["a2"], r.since["a2"] = "alpha", 11.0
    with pytest.raises(ModelUnavailableError, match="once 'beta', which asked first, has loaded"):
        r.add_request(PROMPT, GREEDY, request_id="a2")
    r.route["a0"], r.since["a0"] = "alpha", 9.0  # arrived before beta asked: runs
    r.add_request(PROMPT, GREEDY, request_id="a0")
    while r.has_unfinished_requests():
        r.step()
    with pytest.raises(ModelUnavailableError, match="once 'beta', which asked first"):
        r.get("gamma", since=12.0)  # NOTE: asked later: its load does not take beta's room
    assert r.get("beta", since=10.0) is r.engines["beta"] and list(r.engines) == ["beta"]
    r.close()


def test_a_steady_load_on_one_model_does_not_keep_another_out(models):
    """Three clients keep alpha busy without a pause; one model fits at a time. A request for beta
    waits until alpha's requests in flight end, then loads, while the later alpha requests wait
    behind it (through the HTTP side's waiters); then alpha serves again, and no client saw an error."""
    import threading
    from test_server_robust import wait_for
    root, expected = models
    names = ["alpha", "beta"]
    srv = serve(root, names, budget_for(root, names, 1.5), extra=["--load-timeout", "30", "--num-threads", "1"])
    stop, errors, counts, chunks = threading.Event(), [], [0, 0, 0], [0, 0, 0]

    def load(i):
        client = srv.client()
        try:
            while not stop.is_set():
                for _ in client.completions.create(model="alpha", prompt=PROMPT, max_tokens=90, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                    chunks[i] += 1
                counts[i] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    try:
        client = srv.client()
        client.completions.create(model="alpha", prompt=PROMPT, max_tokens=1)  # alpha loaded first
        threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
        for i, t in enumerate(threads):  # NOTE: a third of a request apart, so that one always runs
            t.start()
            wait_for(lambda: chunks[i] >= 30, what="this client's stream a third of the way")
        wait_for(lambda: min(counts) >= 2, what="both clients' alpha requests running back to back")
        answer = client.completions.create(model="beta", prompt=PROMPT, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        ref = Engine(os.path.join(root, "beta"), **KW)
        want = ref.tokenizer.decode(expected["beta"], skip_special_tokens=True)
        assert answer.choices[0].text == want
        ref.close()
        before = list(counts)
        wait_for(lambda: min(c - b for c, b in zip(counts, before)) >= 1, what="alpha served again after beta")
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
    finally:
        stop.set()
        assert srv.stop() == 0, srv.output()


def test_a_max_model_len_one_model_cannot_take_is_refused_at_start_up(models, tmp_path):
    """It surfaced at that model's first request (and, with the context listing, broke /v1/models
    for every model); every rank checks it before any collective."""
    root, _ = models
    short = str(tmp_path / "short")
    build_model(short, arch="llama", max_position_embeddings=64)
    specs = (ModelSpec("alpha", os.path.join(root, "alpha")), ModelSpec("short", short))
    with pytest.raises(ValueError, match=r"max_model_len=128 exceeds what model 'short' supports \(64 tokens\)"):
        ModelRouter(RouterConfig(specs, 1 << 30, KW))


def test_a_refused_add_queues_no_abort(models):
    """A request the engine refused was never added; aborting it anyway removed the route of its
    retry (a model waiting for room) from the router, and the retry failed with "names no model"."""
    import asyncio
    from numa_runtime.serve.async_engine import AsyncEngine
    root, _ = models
    eng = Engine(os.path.join(root, "alpha"), **KW)
    aengine = AsyncEngine(eng)
    aborted = []
    aengine.abort = aborted.append

    async def main():
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            await aengine.add("r1", list(range(3, 103)), SamplingParams(max_tokens=100), asyncio.Queue())
        task = asyncio.ensure_future(aengine.add("r2", PROMPT, GREEDY, asyncio.Queue()))
        await asyncio.sleep(0)
        task.cancel()  # NOTE: a caller that goes away while its add waits: that one is aborted
        with pytest.raises(asyncio.CancelledError):
            await task
    aengine.start()
    try:
        asyncio.run(main())
    finally:
        aengine.stop()
        eng.close()
    assert aborted == ["r2"]


def test_a_model_with_fewer_heads_than_ranks_is_refused_at_start(models):
    """Each model of a multi-model server spans every rank (no data-parallel replicas to fall back
    on): one with fewer heads than ranks is refused at start-up, naming it (GET /v1/models was a
    500 on every call, its requests a 400 that advised replicas)."""
    root, _ = models
    specs = (ModelSpec("alpha", os.path.join(root, "alpha")),)
    with pytest.raises(ValueError, match=r"^Model 'alpha' has \d+ attention heads, too few to split over 1000 ranks"):
        ModelRouter(RouterConfig(specs, 1 << 40, KW), comm_world=1000)
