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
    assert last.startswith("FileNotFoundError: 'test-org/missing' is no local path, and it is not in the Hugging "
                           "Face Hub cache"), r.stderr
    assert last.endswith("while HF_HUB_OFFLINE=1: fetch it first, or unset HF_HUB_OFFLINE.")
    assert f"Face Hub cache ({os.path.join(home, 'hub')})" in last  # NOTE: the folder it read (it said HF_HOME/hub)
    # NOTE: online (no network here, or a repository that does not exist where there is one)
    env = {**os.environ, "HF_HOME": home, "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    env.pop("HF_HUB_OFFLINE", None)
    r = subprocess.run([sys.executable, "-c", "from numa_runtime import Engine\nEngine('test-org/missing-x')"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("FileNotFoundError: 'test-org/missing-x' is no local path, and fetching it from the "
                           "Hugging Face Hub failed"), r.stderr[-2000:]
    assert last.endswith("pass a local model directory or .gguf file, or set HF_TOKEN for a gated model.")


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


def test_vllm_serve_flags_are_taken_or_refused_in_one_sentence(monkeypatch):
    """`vllm serve` commands carry flags such as --trust-remote-code, --disable-log-requests,
    --tensor-parallel-size, --gpu-memory-utilization: each is taken with its meaning here or
    refused naming why (each was an 'unrecognized arguments' error)."""
    from numa_runtime.serve.__main__ import check_args, engine_kwargs, parse_args
    for env in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(env, raising=False)
    ok = parse_args(["--model", "m", "--trust-remote-code", "--disable-log-requests", "--disable-log-stats",
                     "--enforce-eager", "--enable-chunked-prefill", "-tp", "1", "--pipeline-parallel-size", "1",
                     "--load-format", "safetensors"])
    assert check_args(ok) is None
    assert engine_kwargs(ok)["cuda_graphs"] is False  # NOTE: --enforce-eager: no CUDA graphs
    assert "cuda_graphs" not in engine_kwargs(parse_args(["--model", "m"]))
    for flags, msg in ((["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 needs 2 MPI rank(s), but this job "
                                                         "has 1: start it as `mpirun -np 2 python -m numa_runtime.serve"),
                       (["-pp", "2"], "--pipeline-parallel-size must be 1"),
                       (["-tp", "0"], "--tensor-parallel-size must be a positive integer, got 0."),
                       (["--model", "n", "-tp", "2"], "--tensor-parallel-size 2: with several models every model is "
                                                      "split over all 1 rank(s)"),
                       (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization (vLLM's) sizes a GPU's KV cache"),
                       (["--swap-space", "4"], "--swap-space (vLLM's) keeps preempted sequences in host memory"),
                       (["--tokenizer", "x"], "--tokenizer (vLLM's) names a tokenizer apart from the model"),
                       (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not supported"),
                       (["--load-format", "pt"], "--load-format must be auto, safetensors or gguf"),
                       # a format that is not the files' (it was accepted and ignored)
                       (["--load-format", "gguf"], "--load-format 'gguf' does not match m, which is not a .gguf file"),
                       (["--model", "x.gguf", "--load-format", "safetensors"],
                        "--load-format 'safetensors' does not match x.gguf, which is a GGUF file")):
        assert (check_args(parse_args(["--model", "m", *flags])) or "").startswith(msg), flags
    assert check_args(parse_args(["--model", "x.gguf", "--load-format", "gguf"])) is None
    assert check_args(parse_args(["--load-format", "safetensors"])).startswith(
        "--load-format 'safetensors' does not match the built-in model, which is a GGUF file")
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "4")
    four = parse_args(["--model", "m", "-tp", "2"])
    assert check_args(four) is None and engine_kwargs(four)["data_parallel"] == 2  # NOTE: vLLM's tp x dp
    # NOTE: it names both settings (it blamed -tp alone)
    assert check_args(parse_args(["--model", "m", "-tp", "2", "--data-parallel", "1"])).startswith(
        "--tensor-parallel-size 2 with --data-parallel 1 needs 2 MPI rank(s), but this job has 4")


def test_vllm_serve_keys_names_and_replicas_as_vllm_takes_them(monkeypatch, capsys):
    """VLLM_API_KEY protects the server when --api-key is not given (it served without a key);
    --served-model-name given twice keeps the last (the lists were joined); --data-parallel-size
    / -dp are --data-parallel; -tp against numa-launch --dp (NUMA_RUNTIME_DATA_PARALLEL) is
    checked (the variable overrode it), and -tp over all ranks is one replica, not the default
    rule's replicas; other VLLM_* variables are named in a warning."""
    from numa_runtime.serve.__main__ import check_args, engine_kwargs, parse_args, vllm_env_warning
    for env in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "NUMA_RUNTIME_DATA_PARALLEL",
                "VLLM_API_KEY"):
        monkeypatch.delenv(env, raising=False)
    for k in [k for k in os.environ if k.startswith("VLLM_")]:
        monkeypatch.delenv(k)
    assert parse_args(["m"]).api_key is None and vllm_env_warning() is None
    monkeypatch.setenv("VLLM_API_KEY", "k1")
    assert parse_args(["m"]).api_key == ["k1"] and parse_args(["m", "--api-key", "a", "b"]).api_key == ["a", "b"]
    here = os.path.dirname(os.path.abspath(__file__))  # NOTE: `serve --api-key KEY MODEL`: the model is no key
    for model in (here, "Org/Some-Model", "x.gguf"):
        flags_first = parse_args(["--api-key", "a", model])
        assert (flags_first.api_key, flags_first.model) == (["a"], [model])
    assert parse_args(["m", "--api-key", "a", "Org/Some-Model"]).api_key == ["a", "Org/Some-Model"]
    assert vllm_env_warning() is None
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert "--api-key (or VLLM_API_KEY) is empty" in check_args(parse_args(["m"]))
    monkeypatch.delenv("VLLM_API_KEY")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    assert "VLLM_CPU_KVCACHE_SPACE (vLLM's environment) is not read by this server" in vllm_env_warning()
    args = parse_args(["m", "--served-model-name", "old", "--served-model-name", "new", "x"])
    assert args.served_model_name == ["new", "x"]
    for flag in ("--data-parallel-size", "-dp"):
        assert parse_args(["m", flag, "2"]).data_parallel == 2
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    one = parse_args(["--model", "m", "-tp", "2"])
    assert check_args(one) is None and engine_kwargs(one)["data_parallel"] == 1
    monkeypatch.setenv("NUMA_RUNTIME_DATA_PARALLEL", "2")
    assert check_args(parse_args(["--model", "m", "-tp", "2"])).startswith(
        "--tensor-parallel-size 2 with NUMA_RUNTIME_DATA_PARALLEL=2 (set by numa-launch --dp or --tp) needs 4 MPI "
        "rank(s), but this job has 2")
    assert check_args(parse_args(["--model", "m", "-tp", "1"])) is None
    monkeypatch.setenv("NUMA_RUNTIME_DATA_PARALLEL", "two")  # NOTE: a traceback before, with -tp
    assert check_args(parse_args(["--model", "m", "-tp", "1"])) == (
        "NUMA_RUNTIME_DATA_PARALLEL must be a positive integer, got 'two'.")


def test_vllm_serve_flags_that_would_not_apply_are_refused(monkeypatch, tmp_path):
    """--load-format against a --models-dir folder's models (it was checked for --model only),
    --revision / --download-dir with no Hub id (ignored before), a --chat-template path with a
    brace in it that does not exist (taken as the template), the host KV tier without the prefix
    cache (it keeps prefix blocks: accepted, then nothing)."""
    from numa_runtime.config import EngineConfig
    from numa_runtime.serve.__main__ import check_args, parse_args, read_chat_template
    for env in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "VLLM_API_KEY"):
        monkeypatch.delenv(env, raising=False)
    (tmp_path / "q.gguf").write_bytes(b"")
    assert check_args(parse_args(["--models-dir", str(tmp_path), "--load-format", "safetensors"])).startswith(
        f"--load-format 'safetensors' does not match {tmp_path / 'q.gguf'}, which is a GGUF file")
    for flag in ("--revision", "--download-dir"):
        assert check_args(parse_args([str(tmp_path), flag, "x"])) == (
            f"{flag} applies to a Hugging Face Hub id (org/name) given as the model, and no model given is one; drop "
            "the flag.")
    with pytest.raises(ValueError, match="is neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "{model}.jinja"))
    assert read_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match=r"The host KV tier \(host_kv_cache_memory\) keeps prefix-cache blocks"):
        EngineConfig(device="cuda", host_kv_cache_memory=1 << 20, enable_prefix_caching=False)


def test_max_model_len_takes_vllms_units(monkeypatch, capsys):
    """--max-model-len as vLLM reads it: k/m/g decimal, K/M/G binary; a fraction of a binary
    unit, or of a token, is refused with the value named."""
    from numa_runtime.serve.__main__ import parse_args
    for env in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(env, raising=False)
    for text, tokens in (("4096", 4096), ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1M", 1 << 20)):
        assert parse_args(["m", "--max-model-len", text]).max_model_len == tokens
    for text, why in (("1.5K", "a binary unit (K) takes a whole number"), ("2.0005k", "is not a whole number"),
                      ("lots", "is no integer")):
        with pytest.raises(SystemExit):
            parse_args(["m", "--max-model-len", text])
        assert why in capsys.readouterr().err


def test_the_server_takes_a_hub_id_at_a_revision_into_a_download_dir(hub_home):
    """--download-dir is the Hub cache and --revision the branch, as vLLM's (HF_HOME unset)."""
    home, _ = hub_home
    srv = ServerProcess(["--model", "test-org/tiny", "--revision", "main", "--download-dir",
                         os.path.join(home, "hub"), "--dtype", "float32", "--max-model-len", "256", "--num-threads",
                         "1", "--trust-remote-code", "--disable-log-requests"],
                        env={"HF_HOME": os.path.join(home, "elsewhere"), "HF_HUB_OFFLINE": "1"})
    try:
        assert [m.id for m in srv.client().models.list().data] == ["test-org/tiny"]
    finally:
        assert srv.stop() == 0, srv.output()
    r = _run("from numa_runtime.hub import local_path\nlocal_path('test-org/tiny', revision='v9')", home)
    assert r.returncode != 0 and "at revision 'v9' while HF_HUB_OFFLINE=1" in r.stderr.strip().splitlines()[-1]


def test_engine_takes_vllms_llm_keywords(hub_home, monkeypatch):
    """vLLM's LLM(model, trust_remote_code=True, tensor_parallel_size=1, enforce_eager=True, ...)
    runs unchanged; keywords that cannot mean the same here are one sentence each (each was
    EngineConfig's 'unexpected keyword argument')."""
    from numa_runtime import Engine
    home, src = hub_home
    for env in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(env, raising=False)
    e = Engine(src, dtype="float32", kv_cache_memory=1 << 22, trust_remote_code=True, tensor_parallel_size=1,
               enforce_eager=True, disable_log_stats=True, enable_chunked_prefill=True, tokenizer=src,
               load_format="auto")
    try:
        assert e.config.cuda_graphs is False and e.generate("Hello")[0].outputs[0].token_ids
    finally:
        e.close()
    for kw, msg in (({"tensor_parallel_size": 2}, "tensor_parallel_size=2 needs 2 MPI rank(s), but this job has 1: "
                                                  "run the script as `mpirun -np 2 python SCRIPT`"),
                    ({"gpu_memory_utilization": 0.9}, "gpu_memory_utilization (vLLM's) sizes a GPU's KV cache"),
                    ({"swap_space": 4}, "swap_space (vLLM's) keeps preempted sequences in host memory"),
                    ({"tokenizer": "/elsewhere"}, "tokenizer (vLLM's) names a tokenizer apart from the model"),
                    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size must be 1"),
                    ({"enable_chunked_prefill": False}, "enable_chunked_prefill=False is not supported")):
        with pytest.raises(ValueError) as err:
            Engine(src, dtype="float32", kv_cache_memory=1 << 22, **kw)
        assert str(err.value).startswith(msg), str(err.value)
    code = ("from numa_runtime import Engine, SamplingParams\n"
            f"e = Engine('test-org/tiny', revision='main', download_dir={os.path.join(home, 'hub')!r}, "
            "dtype='float32', kv_cache_memory=1 << 22)\n"
            "print(len(e.generate('Hello', SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids))")
    r = _run(code, os.path.join(home, "elsewhere"))
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "3", r.stderr[-2000:]


def test_hf_token_goes_to_the_fetch_of_that_engine_only(hub_home, monkeypatch):
    """vLLM's LLM(hf_token=...) and `serve --hf-token` authenticate the model's download: the token
    reaches huggingface_hub's fetch, and a later Engine without it fetches without it (the token was
    set as HF_TOKEN for the whole process)."""
    import huggingface_hub

    from numa_runtime import Engine
    _, src = hub_home
    for env in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "HF_TOKEN"):
        monkeypatch.delenv(env, raising=False)
    seen = []

    def snapshot_download(repo, **kw):
        seen.append((repo, kw.get("token")))
        return src
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    for token in ("hf_secret", None):
        e = Engine("test-org/tiny", dtype="float32", kv_cache_memory=1 << 22,
                   **({} if token is None else {"hf_token": token}))
        e.close()
        assert "HF_TOKEN" not in os.environ
    assert seen == [("test-org/tiny", "hf_secret"), ("test-org/tiny", None)]
    from numa_runtime.serve.__main__ import _hub_paths, check_args, parse_args
    for flags, token in ((["--hf-token", "hf_other"], "hf_other"), (["--hf-token"], True), ([], None)):
        args = parse_args(["--model", "test-org/tiny", *flags])
        assert check_args(args) is None
        _hub_paths(args)
        assert args.model == [src] and seen[-1] == ("test-org/tiny", token)
    with pytest.raises(TypeError, match="^hf_token must be a Hugging Face token"):
        Engine(src, dtype="float32", kv_cache_memory=1 << 22, hf_token=123)
