"""Models named by a Hugging Face Hub id (numa_runtime/hub.py), read through huggingface_hub's own
cache with HF_HUB_OFFLINE=1 (no network here): the engine and the server take `ORG/NAME` as vLLM
does, the server names the model so, and a Hub id that cannot be had is one sentence."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from test_server import ROOT, ServerProcess, tiny_model_dir

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """HF_HOME whose hub cache holds the tiny model as the repository test-org/tiny (as
    snapshot_download leaves it: snapshots/REV/..., refs/main)."""
    src = tiny_model_dir(tmp_path_factory)
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--test-org--tiny"
    shutil.copytree(src, repo / "snapshots" / REV)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return str(home), src


def _run(code: str, home: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": home, "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_engine_takes_a_hub_id(hub_home):
    home, src = hub_home
    code = ("import json; from numa_runtime import Engine, SamplingParams\n"
            "sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)\n"
            "out = [Engine(m, dtype='float32', kv_cache_memory=1 << 22).generate('Hello', sp)[0].token_ids\n"
            f"       for m in ('test-org/tiny', {src!r})]\n"
            "print(json.dumps(out))")
    r = _run(code, home)
    assert r.returncode == 0, r.stderr
    hub, local = json.loads(r.stdout.strip().splitlines()[-1])
    assert hub == local and len(hub) == 8


def test_a_hub_id_that_cannot_be_had_is_one_sentence(hub_home):
    home, _ = hub_home
    r = _run("from numa_runtime import Engine\nEngine('test-org/missing')", home)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("FileNotFoundError: 'test-org/missing' is no local path, and fetching it from the "
                           "Hugging Face Hub failed"), r.stderr
    assert "pass a local model directory or .gguf file." in last


def test_the_server_serves_a_hub_id_under_that_name(hub_home):
    home, _ = hub_home
    srv = ServerProcess(["--model", "test-org/tiny", "--dtype", "float32", "--max-model-len", "256",
                         "--num-threads", "1"], env={"HF_HOME": home, "HF_HUB_OFFLINE": "1"})
    try:
        c = srv.client()
        assert [m.id for m in c.models.list().data] == ["test-org/tiny"]
        r = c.completions.create(model="test-org/tiny", prompt="Hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
    finally:
        assert srv.stop() == 0, srv.output()
