"""The server under hostile and concurrent use: strict types, refused fields, oversize prompts that
freeze nothing, an honest /health, graceful shutdown, limits that follow the KV cache, many clients."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from test_server import ROOT, ServerProcess, metric, tiny_model_dir

TINY = ["--dtype", "float32", "--max-model-len", "256", "--num-threads", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(["--model", model_dir, *TINY, "--served-model-name", "tiny", "--max-queue", "1024"])
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.output()


def wait_for(condition, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen in {timeout:.0f} s")


# ------------------------------------------------------------------------------ strict types, refusals
CHAT = [{"role": "user", "content": "Hi"}]
REFUSED = {
    "max_tokens true": ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    "max_tokens string": ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    "n true": ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    "temperature string": ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
    "seed true": ("/v1/completions", {"prompt": "x", "seed": True}, "seed"),
    "stop number": ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    "stream string": ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    "prompt of bools": ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    "logprobs 21": ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    "logprobs -1": ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    "top_logprobs 21": ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
                        "top_logprobs"),
    "suffix": ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix"),
    "best_of": ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    # NOTE: tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice (tests/test_tools.py)
    "tools auto": ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {}}}]}, "tool_choice"),
    "tools malformed": ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}],
                                                 "tool_choice": "none"}, "tools"),
    "tool_choice": ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "auto"}, "tool_choice"),
    "functions": ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    "function_call": ("/v1/chat/completions", {"messages": CHAT, "function_call": "auto"}, "function_call"),
    "response_format xml": ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}},
                            "response_format"),
    "response_format no schema": ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema"}}, "response_format"),
    # NOTE: a schema beside a type that reads none was ignored (unconstrained output, 200)
    "response_format text with schema": ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "text", "schema": {"type": "integer"}}}, "response_format"),
    "response_format text with json_schema": ("/v1/completions", {"prompt": "x", "response_format": {
        "type": "text", "json_schema": {"name": "x", "schema": {"type": "integer"}}}}, "response_format"),
    "response_format json_object with json_schema": ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_object", "json_schema": {"name": "x", "schema": {"type": "integer"}}}}, "response_format"),
    "response_format bad schema": ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
    "logit_bias key": ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    "logit_bias value": ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 200}}, "logit_bias"),
    "logit_bias outside vocab": ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, None),
    # NOTE: numbers that are no token id were said not to be decimal strings
    "logit_bias negative": ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    "logit_bias 19 digits": ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {str(2**63 - 1): 1}},
                             "logit_bias"),
    "logit_bias 5000 digits": ("/v1/completions", {"prompt": "x", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    "completions functions": ("/v1/completions", {"prompt": "x", "functions": [{"name": "f"}]}, "functions"),
    "completions max_completion_tokens": ("/v1/completions", {"prompt": "x", "max_completion_tokens": 5},
                                          "max_completion_tokens"),
    "surrogate prompt": ("/v1/completions", {"prompt": "ab\ud800cd"}, "prompt"),
    "surrogate message": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
    "surrogate stop": ("/v1/completions", {"prompt": "x", "stop": ["\ud83d"]}, "stop"),
    "surrogate embedding input": ("/v1/embeddings", {"input": ["ok", "a\ud800"]}, "input"),
    "embedding input of floats": ("/v1/embeddings", {"input": [1.5, 2]}, "input"),
    "embedding input of booleans": ("/v1/embeddings", {"input": [[True, False]]}, "input"),
    "embedding input object": ("/v1/embeddings", {"input": {"text": "x"}}, "input"),
    "embedding token outside vocab": ("/v1/embeddings", {"input": [5, -1]}, None),
    "embedding priority": ("/v1/embeddings", {"input": "x", "priority": 1}, "priority"),
    "embedding dimensions": ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    "embedding truncation": ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": -2},
                             "truncate_prompt_tokens"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_with_one_sentence_naming_the_field(server, case):
    path, body, param = REFUSED[case]
    raw = json.dumps(body).encode()  # NOTE: ensure_ascii writes lone surrogates as \ud800 escapes
    r = httpx.post(server.base + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].endswith(".") and err["message"].count(". ") == 0, err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert "tokenizer" not in err["message"].lower() and "TextEncodeInput" not in err["message"]
    if case.startswith("logit_bias") and case not in ("logit_bias key", "logit_bias value"):
        assert ("non-negative integer token ids" if case == "logit_bias negative" else "outside the vocabulary") \
            in err["message"], err


@pytest.mark.parametrize("body", [
    {"prompt": "x", "best_of": 1, "suffix": "", "max_tokens": 2},
    {"messages": CHAT, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "max_tokens": 2},
])
def test_no_op_values_of_refused_fields_are_accepted(server, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_logit_bias_is_applied(server):
    client = server.client()

    def tokens(bias):
        r = client.completions.create(model="tiny", prompt=[1, 17, 42], max_tokens=4, temperature=0, logprobs=1,
                                      logit_bias=bias, extra_body={"ignore_eos": True})
        return r.choices[0].logprobs.tokens
    plain = tokens({})
    forced = tokens({"77": 100})
    assert len(set(forced)) == 1 and forced != plain
    assert tokens({"78": 100}) != forced


# ------------------------------------------------------------------------------ oversize input
class StreamWatch:
    """Streams read one after another in a thread until stopped; records when each chunk arrived."""

    def __init__(self, base: str):
        self.times: list[float] = []
        self.stopped = False
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(base, body), daemon=True)
        self.thread.start()

    def _read(self, base, body):
        while not self.stopped:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.times.append(time.monotonic())

    def stop(self) -> None:
        self.stopped = True
        self.thread.join(timeout=120)


def test_oversize_prompt_is_refused_beside_a_stream(server, model_dir):
    """A ~3.9 MB prompt is refused with a clear 400 on both endpoints while a stream runs
    beside it, and the stream goes on delivering chunks afterwards. (How long the stream
    waited is timing, so it belongs in bench/, not here; the length bound before tokenizing
    is what keeps that wait short.)"""
    text = "The quick brown fox jumps over the lazy dog. " * 87_000
    big = {"completions": ("/v1/completions", {"prompt": text, "max_tokens": 2}),
           "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2})}
    watch = StreamWatch(server.base)
    try:  # NOTE: a failed test's stream ran on against the shared server, and later tests wait for it idle
        wait_for(lambda: len(watch.times) >= 3, what="the stream's first chunks")
        for path, body in big.values():
            r = httpx.post(server.base + path, json=body, timeout=120)
            assert r.status_code == 400 and "shorten" in r.json()["error"]["message"], r.text[:300]
            seen = len(watch.times)
            wait_for(lambda: len(watch.times) > seen, what="the stream's next chunk after the refusal")
    finally:
        watch.stop()


def test_a_reader_that_pauses_loses_nothing(server):
    """A client that stops reading (without hanging up) until the engine has finished its
    request, then reads on, gets every chunk: a slow reader is not taken for a gone one."""
    aborted = metric(server.base, 'numa_runtime_requests_total{status="abort"}')
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "n": 8, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        first = next(lines)
        # NOTE: ~500 KB of chunks wait in the server while nobody reads
        wait_for(lambda: metric(server.base, "numa_runtime_num_requests_running") == 0
                 and metric(server.base, "numa_runtime_num_requests_waiting") == 0, what="the request finishing")
        events = [first] + [line for line in lines if line]
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert events[-1] == "data: [DONE]"
    reasons = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
               if c["choices"][0]["finish_reason"]}
    assert reasons == {i: "length" for i in range(8)}
    assert metric(server.base, 'numa_runtime_requests_total{status="abort"}') == aborted


def test_clients_that_hang_up_mid_burst_leave_no_log_flood(server):
    """A multi-step burst (--num-scheduler-steps, 8 by default) wrote its chunks without letting the
    event loop see the hang-up: asyncio logged "socket.send() raised exception." for each write
    past the fifth (29-97 lines for 10 cut streams)."""
    aborted = metric(server.base, 'numa_runtime_requests_total{status="abort"}')
    for i in range(10):
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
    wait_for(lambda: metric(server.base, 'numa_runtime_requests_total{status="abort"}') >= aborted + 10,
             what="the ten streams aborted")
    wait_for(lambda: metric(server.base, "numa_runtime_num_requests_running") == 0, what="nothing running")
    assert "socket.send() raised exception" not in server.output()


# ------------------------------------------------------------------------------ many clients
def test_256_concurrent_streams_some_disconnecting(server):
    """256 streaming clients at once, every fourth hanging up after its first chunk: no error,
    every full stream ends with [DONE], and the KV pool is empty afterwards."""
    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": "tiny", "prompt": f"Client {i} says", "max_tokens": 12, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            last = None
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = line
                    if i % 4 == 0:
                        return "hung up"
                    if '"error"' in line:
                        return line
            return "done" if last == "data: [DONE]" else f"ended with {last}"

    async def run():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base, limits=limits, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(256)))
    results = asyncio.run(run())
    bad = [r for r in results if r not in ("done", "hung up")]
    assert not bad, bad[:5]
    assert results.count("done") == 192
    # every KV block comes back once the engine is idle (a leaked block never would)
    wait_for(lambda: metric(server.base, "numa_runtime_num_requests_running") == 0
             and metric(server.base, "numa_runtime_num_requests_waiting") == 0
             and metric(server.base, "numa_runtime_kv_cache_usage_ratio") == 0,
             what="the engine going idle with every KV block free")
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}


# ------------------------------------------------------------------------------ threads
def test_thread_count_holds_on_the_thread_that_steps(server):
    assert metric(server.base, "numa_runtime_engine_threads") == 1


def test_async_engine_sets_threads_on_its_own_thread(model_dir):
    from numa_runtime import Engine
    from numa_runtime.serve import AsyncEngine
    eng = Engine(model_dir, dtype="float32", max_model_len=128, kv_cache_memory=1 << 22, num_threads=1)
    before = eng.ops.get_num_threads()
    aengine = AsyncEngine(eng)
    aengine.start()
    try:
        threads = asyncio.run(aengine.call(lambda e: e.ops.get_num_threads()))
    finally:
        aengine.stop()
    assert before == threads == 1


# ------------------------------------------------------------------------------ small KV cache, warnings
def test_context_follows_a_small_kv_cache_and_public_bind_warns(model_dir):
    # 20 blocks of 16 tokens (8 KiB each in float32): 320 tokens, below the model's 512 positions.
    # An asked --max-model-len 512 is refused, as in vLLM; the default context follows the pool.
    with pytest.raises(RuntimeError, match="(?s)server exited with 2:.*\nnuma-serve: error: max_model_len=512 is "
                                           "larger than the KV cache holds \\(20 blocks of 16 tokens: 320 tokens\\)"):
        ServerProcess(["--model", model_dir, "--dtype", "float32", "--max-model-len", "512", "--num-threads", "1",
                       "--kv-cache-memory", str(20 * 8192)])
    srv = ServerProcess(["--model", model_dir, "--dtype", "float32", "--num-threads", "1",
                         "--kv-cache-memory", str(20 * 8192), "--host", "0.0.0.0"])
    try:
        card = httpx.get(srv.base + "/v1/models").json()["data"][0]
        assert card["max_model_len"] == 320
        r = srv.client().chat.completions.create(model="tiny-llama", messages=CHAT, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.total_tokens <= 320
    finally:
        code = srv.stop()
    assert code == 0, srv.output()
    assert "without --api-key" in srv.output()


# ------------------------------------------------------------------------------ shutdown
def test_sigint_during_a_stream_ends_it_cleanly(model_dir):
    srv = ServerProcess(["--model", model_dir, *TINY, "--shutdown-grace", "0"])
    events = []
    # NOTE: 32 choices of 240 tokens: one took 0.1 s, and ended before the signal came in a quarter of runs
    body = {"prompt": "Hello", "max_tokens": 240, "n": 32, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.base + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                events.append(line)
                if len(events) == 3:  # NOTE: once: a second signal means "exit now"
                    srv.proc.send_signal(signal.SIGINT)
    code = srv.proc.wait(timeout=60)
    srv.stop()
    log = srv.output()
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][len("data: "):])
    assert "shutting down" in err["error"]["message"]
    assert code == 0, log
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_a_second_sigint_exits_now_without_a_traceback(model_dir):
    """A request stuck mid-body holds uvicorn's graceful shutdown open for the whole grace; a
    second SIGINT exits at once, and cleanly."""
    import socket
    srv = ServerProcess(["--model", model_dir, *TINY, "--shutdown-grace", "600"])
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        srv.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the first signal closes the listening socket
            try:
                socket.create_connection(("127.0.0.1", srv.port), timeout=5).close()
            except ConnectionRefusedError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the server still accepts connections after SIGINT:\n" + srv.output())
        assert srv.proc.poll() is None, "the first signal must wait for the stuck request"
        srv.proc.send_signal(signal.SIGINT)
        code = srv.proc.wait(timeout=60)  # NOTE: the grace was 600 s
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    finally:
        sock.close()
        srv.stop()
    log = srv.output()
    assert code == 0, log
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert answer.startswith(b"HTTP/1.1 503") and b"shutting down" in answer, answer


def test_a_connection_rank0_never_accepted_is_answered_when_it_stops(capfd):
    """The front may open its connection to rank 0 just as the shutdown begins, and uvicorn never
    accepts it. Rank 0's exit still ends it: the client gets its 503 then, and the front exits
    cleanly (it waited 10 s, then cut the client off with a CancelledError traceback)."""
    import select
    import socket
    from numa_runtime.serve.__main__ import HttpFront
    public = socket.create_server(("127.0.0.1", 0))
    port = public.getsockname()[1]
    front = HttpFront(public)
    public.close()  # NOTE: the front process holds it now, as in numa-serve
    client = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        front.tell("ready")
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        # NOTE: a listening socket reads as ready when a connection waits in its queue
        assert select.select([front.sock], [], [], 60)[0], "the front never connected to rank 0's socket"
        front.tell("stopping")
        front.close()
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    finally:
        client.close()
        if front.proc.poll() is None:
            front.proc.kill()
    err = capfd.readouterr().err
    assert front.proc.returncode == 0, err
    assert answer.startswith(b"HTTP/1.1 503") and b"shutting down" in answer, (answer, err)
    assert "Traceback" not in err and "still open" not in err, err


def test_rank_0_lifts_its_file_limit(model_dir):
    """Rank 0 holds one descriptor a client connection: a soft limit of 256 open files (1024 is
    common) is raised to the hard one, as vLLM's server raises its own."""
    import resource
    import shutil
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= 256 or not shutil.which("prlimit"):
        pytest.skip(f"SKIPPED: needs prlimit and a hard limit of open files above 256 (it is {hard})")
    srv = ServerProcess(["--model", model_dir, *TINY], launcher=["prlimit", f"--nofile=256:{hard}", "--"])
    try:
        with open(f"/proc/{srv.proc.pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max open files"))
        assert line.split()[3:5] == [str(hard)] * 2, line
    finally:
        srv.stop()


def test_a_cleaned_temp_dir_does_not_stop_the_server(model_dir, tmp_path):
    """A /tmp cleaner (systemd-tmpfiles, after 10 days) may remove whatever the server put in its
    temp dir; it keeps answering (its front found no socket file and took the engine for dead)."""
    import shutil
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    srv = ServerProcess(["--model", model_dir, *TINY], env={"TMPDIR": str(tmp)})
    try:
        client = srv.client()
        assert client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=2).usage
        for entry in tmp.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        with httpx.Client(base_url=srv.base) as fresh:  # NOTE: a new connection to the front
            r = fresh.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ a stuck rank
def _mpirun(ranks: int = 2) -> list[str]:
    """mpirun -np `ranks`: the one beside this interpreter (the mpich wheel's) if there is one."""
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return [mpirun if os.path.exists(mpirun) else "mpirun", "-np", str(ranks)]


def _mpi_server(model: str, *flags: str) -> ServerProcess:
    return ServerProcess(["--model", model, *TINY, "--kv-cache-memory", str(1 << 24), *flags], launcher=_mpirun(),
                         env={"MPI4PY_RC_THREAD_LEVEL": "funneled"})


def _post_in_background(srv: ServerProcess, body: dict, done: dict) -> threading.Thread:
    """A thread (not started) that posts a completion and leaves the response in done["r"]."""
    return threading.Thread(target=lambda: done.update(r=httpx.post(srv.base + "/v1/completions", json=body,
                                                                     timeout=300)))


def test_one_sigterm_under_mpirun_lets_requests_finish_within_the_grace(tmp_path):
    """One SIGTERM to a 2-rank server with a request in flight: it finishes (the signal watcher
    and the handler both starting the shutdown made one signal count as two: an exit at once, the
    request cut)."""
    from models import build_model
    # NOTE: 240 tokens (within the server's 256) stay in flight for a few polls of /metrics: 100 were
    # once never seen running in a clean-clone CI
    d = str(tmp_path / "mid")
    build_model(d, arch="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2)
    srv = _mpi_server(d, "--shutdown-grace", "30", "--num-scheduler-steps", "1")
    try:
        done = {}
        body = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True}
        t = _post_in_background(srv, body, done)
        t.start()
        wait_for(lambda: metric(srv.base, "numa_runtime_num_requests_running") == 1, what="the request running")
        srv.proc.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        assert srv.proc.wait(timeout=120) == 0, srv.output()
        assert done["r"].status_code == 200 and done["r"].json()["usage"]["completion_tokens"] == 240, done
    finally:
        srv.stop()


def test_one_sigterm_to_every_process_of_the_job_is_one_signal(tmp_path):
    """systemctl stop and pkill -f send SIGTERM to mpirun and each rank at once: rank 0 gets it,
    then mpiexec's forwarded copy milliseconds later. That is one signal: the request in flight
    finishes within the grace (it counted as a second signal: every request cut at once)."""
    from models import build_model
    d = str(tmp_path / "mid")
    build_model(d, arch="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    srv = _mpi_server(d, "--shutdown-grace", "30", "--num-scheduler-steps", "1", "--max-model-len", "2048")
    try:
        procs = [psutil.Process(srv.proc.pid), _rank_process(srv.proc.pid, 0), _rank_process(srv.proc.pid, 1)]
        done = {}
        # NOTE: 600 tokens take 3-5 s (seconds past the 0.2 s below), well inside the 30 s grace on a loaded machine
        t = _post_in_background(srv, {"prompt": "Hello", "max_tokens": 600, "ignore_eos": True}, done)
        t.start()
        wait_for(lambda: metric(srv.base, "numa_runtime_num_requests_running") == 1, what="the request running")
        # NOTE: rank 0's own copy first, mpiexec's forwarded one a moment later (a fixed gap: the
        # stimulus, a pkill reaching the processes in this order, not a wait for a condition)
        procs[1].send_signal(signal.SIGTERM)
        time.sleep(0.2)
        for p in (procs[0], procs[2]):
            p.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        assert srv.proc.wait(timeout=120) == 0, srv.output()
        assert done["r"].status_code == 200 and done["r"].json()["usage"]["completion_tokens"] == 600, done
    finally:
        srv.stop()


def _stall_on_stopped_rank(srv, worker):
    """Stop `worker` (SIGSTOP), send a 200-token request, and wait until its step stalls on the
    stopped rank; (the request's thread, its result dict)."""
    done = {}
    t = _post_in_background(srv, {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}, done)
    worker.suspend()
    t.start()
    wait_for(lambda: metric(srv.base, "numa_runtime_engine_busy_seconds") > 1, timeout=120,
             what="the request's step stalling on the stopped rank")
    return t, done


def test_sigterm_ends_the_job_while_a_worker_rank_is_stopped(model_dir):
    """Rank 1 is stopped (SIGSTOP) in the middle of a request and the server is told to stop:
    rank 0's main thread waits in MPI for rank 1, so no Python signal handler can run there; a
    thread that watches the signals ends the job once the grace and 15 s have passed, and the
    front answers the request in flight. The job ignored SIGTERM and SIGINT for ever before."""
    import time
    srv = _mpi_server(model_dir, "--shutdown-grace", "1")
    worker = None
    try:
        worker = _rank_process(srv.proc.pid, 1)
        t, done = _stall_on_stopped_rank(srv, worker)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=120)
        t.join(timeout=60)
        assert time.monotonic() - start < 60, srv.output()
        assert done["r"].status_code == 503 and "shutting down" in done["r"].json()["error"]["message"], done
        assert "an engine step has not ended 16 s after the shutdown began" in srv.output()
    finally:
        if worker is not None and worker.is_running():
            worker.kill()
        srv.stop()


def test_a_second_sigterm_ends_the_job_soon_while_a_worker_rank_is_stopped(model_dir):
    """A long grace (60 s) and a step stalled on a stopped rank: a second signal means exit now,
    as in one process; the job ends once the step has run --stall-timeout (it waited out the grace
    and 15 s more, however many signals came), and the front answers the request in flight."""
    import time
    srv = _mpi_server(model_dir, "--shutdown-grace", "60", "--stall-timeout", "5")
    worker = None
    try:
        worker = _rank_process(srv.proc.pid, 1)
        t, done = _stall_on_stopped_rank(srv, worker)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        # NOTE: the shutdown has begun (the front turns new requests away), so the second signal is
        # not merged with the first on its way
        def turned_away():
            try:
                return httpx.get(srv.base + "/health", timeout=5).status_code == 503
            except httpx.ConnectError:
                return True
        wait_for(turned_away, what="the shutdown begun")
        # NOTE: and not as mpiexec's forwarded copy of the first (one within 1 s of it counts as it)
        from numa_runtime.serve.__main__ import _SAME_SIGNAL_S
        wait_for(lambda: time.monotonic() - start > _SAME_SIGNAL_S, what="a second past the first signal")
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=120)
        t.join(timeout=60)
        assert time.monotonic() - start < 40, srv.output()
        assert re.search(r"a second signal, and an engine step has run \d+ s \(a rank is stopped or stuck\)",
                         srv.output()), srv.output()
        assert done["r"].status_code == 503, done
    finally:
        if worker is not None and worker.is_running():
            worker.kill()
        srv.stop()


def test_sigterm_ends_the_job_while_an_idle_worker_rank_is_stopped(model_dir):
    """Rank 1 is stopped (SIGSTOP) while nothing runs, then the server is told to stop: the engine
    loop ends at once and rank 0 waits in close() for rank 1 to take the shutdown plan, where no
    signal handler runs. The job ends 15 s later with a one-line error; it waited for ever before."""
    import time
    srv = _mpi_server(model_dir, "--shutdown-grace", "1")
    worker = None
    try:
        worker = _rank_process(srv.proc.pid, 1)
        worker.suspend()
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=120)
        assert time.monotonic() - start < 60, srv.output()
        assert srv.proc.returncode != 0, srv.output()
        assert "the shutdown has not ended 15 s after the engine loop did" in srv.output()
    finally:
        if worker is not None and worker.is_running():
            worker.kill()
        srv.stop()


def test_health_reports_a_stopped_worker_rank(model_dir):
    """Under mpirun -np 2: SIGSTOP rank 1, then a request arrives; /health turns 503 (its step
    never ends), then 200 again after SIGCONT, and the request completes."""
    srv = _mpi_server(model_dir, "--stall-timeout", "2")
    worker = None
    try:
        worker = _rank_process(srv.proc.pid, 1)
        done = {}
        body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
        t = _post_in_background(srv, body, done)
        # NOTE: rank 1 stops before the request arrives, so the request's first step is the one
        # that stalls (200 tokens of this tiny model can finish between two polls of a metric)
        assert httpx.get(srv.base + "/health", timeout=10).status_code == 200
        worker.suspend()
        t.start()
        status = wait_for(lambda: httpx.get(srv.base + "/health", timeout=10).status_code == 503, timeout=120,
                          what="/health turning 503")
        assert status and metric(srv.base, "numa_runtime_engine_busy_seconds") > 2
        worker.resume()
        wait_for(lambda: httpx.get(srv.base + "/health", timeout=10).status_code == 200, timeout=120,
                 what="/health turning 200 again")
        t.join(timeout=300)
        assert done["r"].status_code == 200 and done["r"].json()["usage"]["completion_tokens"] == 200
    finally:
        if worker is not None and worker.is_running():
            worker.resume()
        code = srv.stop()
    assert code == 0, srv.output()


def _rank_process(launcher_pid: int, rank: int) -> psutil.Process:
    """The python process of `rank` below the mpirun process (by its PMI_RANK / OMPI rank)."""
    def find():
        for p in psutil.Process(launcher_pid).children(recursive=True):
            try:
                e = p.environ()
            except psutil.Error:
                continue
            if "python" in p.name() and str(rank) in (e.get("PMI_RANK"), e.get("OMPI_COMM_WORLD_RANK")):
                return p
        return None
    return wait_for(find, timeout=30, what=f"rank {rank}'s process")


# ------------------------------------------------------------------------------ streaming cost
def test_choice_tracker_reads_only_what_an_output_adds():
    """The server turns an output into a chunk from its deltas alone: an output without the whole
    text, token list or logprob list still gives every piece, and 2,000 of them cost O(2,000)."""
    from numa_runtime.serve.responses import ChoiceTracker

    class DeltaOnly:  # what the tracker may read; reading anything else raises AttributeError
        __slots__ = ("index", "delta", "new_token_ids", "new_logprobs", "finish_reason")

        def __init__(self, i):
            self.index, self.delta, self.new_token_ids = 0, f"t{i} ", [i]
            self.new_logprobs = [(-0.5, {i: -0.5})]
            self.finish_reason = "length" if i == 1999 else None

    class Out:
        def __init__(self, i):
            self.request_id, self.outputs, self.finished = "r", [DeltaOnly(i)], i == 1999
    tracker = ChoiceTracker(n=1)
    pieces = [p for i in range(2000) for p in tracker.update(0, Out(i))]
    assert [p.token_ids for p in pieces] == [[i] for i in range(2000)]
    assert "".join(p.text for p in pieces) == "".join(f"t{i} " for i in range(2000))
    assert pieces[-1].finish_reason == "length" and tracker.finished == {0: "length"}


def test_vllm_serve_command_lines_parse():
    """`vllm serve MODEL --dtype auto` as a vLLM user types it: the positional model is --model's
    first, auto is bfloat16; half is one sentence; a bracketed IPv6 host prints once bracketed."""
    from numa_runtime.serve.__main__ import parse_args
    args = parse_args(["/models/a", "--dtype", "auto", "--model", "/models/b"])
    assert args.model == ["/models/a", "/models/b"] and args.dtype == "bfloat16"
    assert parse_args(["--dtype", "float"]).dtype == "float32" and parse_args([]).model is None
    p = subprocess.run([sys.executable, "-m", "numa_runtime.serve", "--dtype", "float16"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "'float16' is not a compute dtype here" in p.stderr and "Traceback" not in p.stderr


def test_vllm_deployment_spellings_parse_as_vllm_reads_them(tmp_path):
    """Command lines copied from vLLM deployments: `--served-model-name NAME MODEL` and `--hf-token
    MODEL` swallowed the model (the built-in one was served under its name, without a word);
    underscore flag names (`--max_num_seqs=256`), `1T`, `auto` / -1 and `2k` batched tokens were
    refused; a model given both ways became two models of one name."""
    from numa_runtime.serve.__main__ import parse_args
    model = str(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    args = parse_args(["--served-model-name", "foo", "bar", model])
    assert args.model == [model] and args.served_model_name == ["foo", "bar"]
    assert parse_args(["--served-model-name", "org/name"]).model is None  # NOTE: a Hub-like served name stays one
    args = parse_args(["--hf-token", model])
    assert args.model == [model] and args.hf_token is True
    assert parse_args(["--hf-token", "hf_abc", model]).hf_token == "hf_abc"
    args = parse_args(["--max_num_seqs=7", "--max_model_len", "1T", "--max_num_batched_tokens", "2k", model])
    assert (args.max_num_seqs, args.max_model_len, args.max_num_batched_tokens) == (7, 1 << 40, 2000)
    assert parse_args(["--max-model-len", "auto"]).max_model_len is None
    assert parse_args(["--max-model-len", "-1"]).max_model_len is None
    assert parse_args([model, "--model", model]).model == [model]
    assert parse_args(["--model", model, "--model", model + "/."]).model == [model]  # NOTE: one path, two spellings
    # only a model folder (config.json) or a .gguf file is taken for the model: a name that is a folder stays one
    os.makedirs(tmp_path / "named")
    args = parse_args(["--served-model-name", "a", str(tmp_path / "named")])
    assert args.model is None and args.served_model_name == ["a", str(tmp_path / "named")]
    assert parse_args(["--", "--x_y"]).model == ["--x_y"]  # NOTE: after --, names are left as they are


def test_a_port_a_loading_server_holds_is_busy():
    """The socket a server binds before its model loads listens at once: a second server on that
    port fails at once (two SO_REUSEADDR sockets that only bound shared it: the second loaded
    its model, printed its address, then died in a traceback)."""
    from numa_runtime.serve.__main__ import listen
    first = listen("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError, match=f"^cannot listen on 127.0.0.1:{port}: Address already in use.$"):
            listen("127.0.0.1", port).close()
    finally:
        first.close()


@pytest.mark.parametrize("flags,message", [
    (["--port", "70000"], "--port must be in 0..65535 (0: any free port), got 70000."),
    (["--logprobs-mode", "processed_logprobs"], "--logprobs-mode processed_logprobs (vLLM's) is not supported: "
                                                "log-probabilities here are the model's own distribution"),
    (["--max-logprobs", "-1"], "--max-logprobs must be 0 to 20 (the log-probabilities a request may ask for), got -1 "
                               "(no limit, vLLM's -1, is not offered)."),
    (["--max-queue", "0"], "max_queue must be >= 1 (requests are refused once that many wait), got 0."),
    (["--load-timeout", "-1", "--model", "a", "--model", "b"],
     "--load-timeout must be a positive number of seconds, got -1.0."),
    (["--served-model-name", "x", "--model", "a", "--model", "b"], "--served-model-name names a single model;"),
    (["--model", __file__], "is a file, not a model directory;"),
    (["--port", "BUSY"], "cannot listen on 127.0.0.1:BUSY: Address already in use."),
    # flags that would be accepted and then do nothing
    (["--memory-budget", "8G"], "--memory-budget applies to several models"),
    (["--load-timeout", "5"], "--load-timeout applies to several models"),
    (["--memory-budget", "abc", "--model", "a", "--model", "b"], "--memory-budget: Cannot read 'abc' as a size"),
    (["--data-parallel", "2", "--model", "a", "--model", "b"], "applies to one model"),
    (["ENV", "NUMA_RUNTIME_DATA_PARALLEL=2", "--model", "a", "--model", "b"], "NUMA_RUNTIME_DATA_PARALLEL) applies "
     "to one model"),  # NOTE: numa-launch --dp sets it; several models ignored it
    # several models took 0 and -1 (one model refused them)
    (["--data-parallel", "0", "--model", "a", "--model", "b"], "--data-parallel must be a positive integer, got 0."),
    # the flag silently won over the launcher's replica count
    (["ENV", "NUMA_RUNTIME_DATA_PARALLEL=1", "--data-parallel", "2"], "--data-parallel 2 and "
     "NUMA_RUNTIME_DATA_PARALLEL=1 (set by numa-launch --dp or --tp) disagree; drop --data-parallel or launch with "
     "numa-launch --dp 2."),
    # each names the setting that asked (both said data_parallel=2)
    (["--data-parallel", "2"], "--data-parallel 2 does not divide the 1 MPI rank(s)"),
    (["ENV", "NUMA_RUNTIME_DATA_PARALLEL=2"], "NUMA_RUNTIME_DATA_PARALLEL=2 (set by numa-launch --dp or --tp) does "
     "not divide the 1 MPI rank(s)"),
    (["--shutdown-grace", "nan"], "--shutdown-grace must be >= 0, got nan."),  # it skipped the grace
    (["--request-timeout", "0"], "--request-timeout must be a positive number of seconds, got 0.0."),
    (["--kv-cache-memory", "16X"], "argument --kv-cache-memory: Cannot read '16X' as a size"),
    (["--kv-cache-disk-bytes", "1000"], "--kv-cache-disk-bytes applies to the disk tier; give --kv-cache-dir"),
    (["--kv-cache-disk-load", "always"], "--kv-cache-disk-load applies to the disk tier"),
    (["--kv-cache-memory", "-5"], "--kv-cache-memory must be a positive number of bytes, got -5."),
    (["--api-key", ""], "--api-key (or VLLM_API_KEY) is empty (an unset variable?)"),
    (["--kv-cache-dir", "/proc/nope"], "--kv-cache-dir '/proc/nope' cannot be created"),
    (["--served-model-name", " "], "--served-model-name is empty"),
    (["--chat-template", "nofile.jinja"], "--chat-template 'nofile.jinja' is neither a file nor a Jinja template."),
    (["--chat-template", "{% if %}"], "--chat-template is not a valid Jinja template ("),
    (["--chat-template", "{{ x }}", "--model", "a", "--model", "b"], "--chat-template applies to one model"),
])
def test_bad_flags_fail_in_one_sentence_before_the_model_loads(flags, message):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        flags, message = [port if f == "BUSY" else f for f in flags], message.replace("BUSY", port)
        env = dict(os.environ)
        if flags[0] == "ENV":
            key, _, value = flags[1].partition("=")
            env[key], flags = value, flags[2:]
        p = subprocess.run([sys.executable, "-m", "numa_runtime.serve", *flags], capture_output=True, text=True,
                           timeout=120, cwd=ROOT, env=env)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("numa-serve: error: ") and message in p.stderr, p.stderr
    assert "KV cache" not in p.stderr + p.stdout  # the model never loaded


@pytest.mark.parametrize("front", [[], ["--no-http-front"]])
def test_port_0_prints_the_port_it_listens_on(model_dir, front):
    """--port 0 takes any free port; the address printed is the one bound, and it serves (through
    the HTTP front, or from rank 0 itself)."""
    p = subprocess.Popen([sys.executable, "-m", "numa_runtime.serve", "--model", model_dir, *TINY, "--port", "0",
                          "--served-model-name", "tiny", *front],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        for line in p.stdout:  # NOTE: ends if the server exits
            m = re.search(r"serving at (http://127\.0\.0\.1:(\d+)/v1)", line)
            if m:
                url = m.group(1)
                break
        assert url is not None and int(m.group(2)) > 0
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 60
        while True:  # NOTE: the address prints as the HTTP thread starts; wait until it answers
            try:
                r = client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert r.usage.completion_tokens == 2
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0


# ------------------------------------------------------------------------------ a killed rank
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_killed_rank_ends_what_is_in_flight_with_one_sentence(model_dir, ranks):
    """SIGKILL (the out-of-memory killer's signal) of the server's process, or of rank 1, which makes
    mpirun kill rank 0 too: the HTTP front, outside the MPI job, ends the stream under way with an
    error event the openai client raises, answers the request that was waiting with a 503 that the
    client is told not to retry, then frees the port and exits."""
    import socket
    launcher = _mpirun() if ranks == 2 else []
    srv = ServerProcess(["--model", model_dir, *TINY, "--served-model-name", "tiny"], launcher=launcher,
                        env={"MPI4PY_RC_THREAD_LEVEL": "funneled"})
    raw = None
    try:
        rank0 = _rank_process(srv.proc.pid, 0) if ranks == 2 else psutil.Process(srv.proc.pid)
        victim = _rank_process(srv.proc.pid, 1) if ranks == 2 else rank0
        front = wait_for(lambda: [c for c in rank0.children() if "front.py" in " ".join(c.cmdline())],
                         what="the HTTP front process")[0]
        cmd = front.cmdline()
        backend = cmd[cmd.index("--backend") + 1]
        assert backend.startswith("@")  # NOTE: an abstract socket: nothing on disk to leave behind
        with open("/proc/net/unix") as f:
            assert backend in f.read()
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=2, timeout=60)
        # NOTE: 32 choices of 240 tokens: one alone could end before the suspend below
        stream = iter(client.completions.create(model="tiny", prompt="Hello", max_tokens=240, n=32, stream=True,
                                                extra_body={"ignore_eos": True}))
        first = [next(stream) for _ in range(3)]
        victim.suspend()  # NOTE: no token more; the next request waits for the engine
        raw = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 5}).encode()
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        victim.kill()
        with pytest.raises(openai.APIError, match=r"^The engine stopped before this request finished"):
            for chunk in stream:
                first.append(chunk)
        assert 3 <= len(first) < 240 * 32
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"x-should-retry: false" in head.lower(), answer
        error = json.loads(payload)["error"]
        assert error["code"] == "engine_stopped" and error["message"].startswith("The engine stopped"), error
        gone, alive = psutil.wait_procs([front], timeout=30)
        assert not alive, "the front outlived the engine"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        with open("/proc/net/unix") as f:
            assert backend not in f.read(), "rank 0's socket outlived the job"
    finally:
        if raw is not None:
            raw.close()
        srv.stop()


def test_a_fault_in_the_engine_process_is_in_the_log(model_dir):
    """A process killed by a fault (here SIGSEGV, as native code's crash) left the log with the
    front's line only, though the clients' 503 points there: it now holds the fault and every
    thread's Python stack."""
    srv = ServerProcess(["--model", model_dir, *TINY, "--served-model-name", "tiny"])
    try:
        os.kill(srv.proc.pid, signal.SIGSEGV)
        srv.proc.wait(timeout=60)
        out = srv.output()
        assert srv.proc.returncode == -signal.SIGSEGV
        assert "Fatal Python error: Segmentation fault" in out and "most recent call first" in out, out
    finally:
        srv.stop()


def test_a_dead_front_shuts_the_server_down_in_one_sentence(model_dir):
    """Nothing reaches the server once the front process has gone: it says so and exits."""
    srv = ServerProcess(["--model", model_dir, *TINY])
    try:
        front = wait_for(lambda: [c for c in psutil.Process(srv.proc.pid).children()
                                  if "front.py" in " ".join(c.cmdline())], what="the HTTP front process")[0]
        front.kill()
        code = srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    assert code == 1, srv.output()
    assert "numa-serve: error: the HTTP front process exited (code -9)" in srv.output(), srv.output()


def test_log_level_quiets_the_runtime_too(model_dir):
    """--log-level warning leaves out the runtime's start-up INFO lines (it used to govern only
    the HTTP server's log); the default shows them."""
    quiet = ServerProcess(["--model", model_dir, *TINY, "--log-level", "warning"])
    quiet.stop(signal.SIGINT)
    loud = ServerProcess(["--model", model_dir, *TINY])
    loud.stop(signal.SIGINT)
    assert "numa_runtime INFO" in loud.output() and "numa_runtime INFO" not in quiet.output(), quiet.output()
    assert "serving at http://" in quiet.output()


def test_the_access_log_names_the_client_behind_the_front(model_dir):
    """--log-level debug logs each request as uvicorn does, with the client's address (behind the
    HTTP front uvicorn saw only the front's Unix socket: '- "GET ..."'), once."""
    import httpx
    srv = ServerProcess(["--model", model_dir, *TINY, "--log-level", "debug"])
    try:
        with httpx.Client() as c:
            assert c.get(srv.base + "/v1/models").status_code == 200
            assert c.get(srv.base + "/nosuch").status_code == 404
            wait_for(lambda: '"GET /nosuch HTTP/1.1" 404' in srv.output(), what="the access log line")
    finally:
        srv.stop(signal.SIGINT)
    out = srv.output()
    line = [ln for ln in out.splitlines() if '"GET /v1/models HTTP/1.1" 200' in ln]
    assert len(line) == 1 and re.search(r"127\.0\.0\.1:\d+ - \"GET /v1/models HTTP/1\.1\" 200 OK", line[0]), out[-2000:]


def test_start_up_errors_under_mpirun_end_the_job_in_one_sentence():
    """A busy --port on rank 0 ends every rank (the worker spun for ever, deaf to SIGTERM); a bad
    flag or model is said once, by rank 0, not once per rank."""
    import socket
    import subprocess
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        for args, msg in ((["--port", str(busy.getsockname()[1])], "Address already in use"),
                          (["--model", "/nonexistent", "--port", "0"], "does not exist"),
                          (["--port", "0", "--tool-call-parser", "hermes"], "needs --enable-auto-tool-choice")):
            p = subprocess.run(["mpirun", "-np", "2", sys.executable, "-m", "numa_runtime.serve", *args],
                               capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
            assert p.returncode == 2 and p.stderr.count("numa-serve: error:") == 1, p.stderr[-2000:]
            assert msg in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    finally:
        busy.close()


def test_vllm_scheduler_flags_reach_the_engine():
    """--max-num-batched-tokens, --block-size, --seed and --no-enable-prefix-caching (vLLM's
    flags) were unknown arguments."""
    from numa_runtime.serve.__main__ import engine_kwargs, parse_args
    kw = engine_kwargs(parse_args(["--max-num-batched-tokens", "512", "--block-size", "32", "--seed", "7",
                                   "--no-enable-prefix-caching"]))
    assert (kw["max_num_batched_tokens"], kw["block_size"], kw["seed"], kw["enable_prefix_caching"]) == \
        (512, 32, 7, False)
    kw = engine_kwargs(parse_args([]))
    assert not {"max_num_batched_tokens", "block_size", "seed", "enable_prefix_caching"} & set(kw)


def test_preemptions_are_counted_and_prefix_caching_can_be_off(model_dir):
    """A KV cache of 20 blocks and eight requests that each grow to about 12: the newest give their
    blocks back (preemption), which /metrics counts (it showed nothing). With
    --no-enable-prefix-caching a repeated prompt is never a hit."""
    from concurrent.futures import ThreadPoolExecutor
    srv = ServerProcess(["--model", model_dir, *TINY, "--kv-cache-memory", str(20 * 8192),
                         "--no-enable-prefix-caching", "--max-num-batched-tokens", "64"])
    try:
        client = srv.client()
        prompt = "one two three four five six seven eight nine ten"

        def one(i):
            return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=180, temperature=0,
                                             extra_body={"ignore_eos": True}).usage.completion_tokens
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(8))) == [180] * 8
        assert metric(srv.base, "numa_runtime_num_preemptions_total") > 0
        assert metric(srv.base, "numa_runtime_prefix_cache_hit_rate") == 0
    finally:
        code = srv.stop()
    assert code == 0, srv.output()


def test_environment_variables_with_unusable_values_are_named(model_dir, monkeypatch):
    """A collective timeout of 0 was accepted and ended the job at the first step ("abc": a float
    error naming nothing); a bad log level crashed every import with a traceback; an
    AS_PROFILE_TRACE path in a missing folder failed the request whose step wrote the trace."""
    from numa_runtime import env
    for value in ("0", "-3", "nan", "abc"):
        monkeypatch.setenv("NUMA_RUNTIME_COLLECTIVE_TIMEOUT", value)
        with pytest.raises(ValueError, match=f"NUMA_RUNTIME_COLLECTIVE_TIMEOUT must be a positive number of "
                                             f"seconds, got '{value}'"):
            env.collective_timeout()
    monkeypatch.setenv("NUMA_RUNTIME_COLLECTIVE_TIMEOUT", "12.5")
    assert env.collective_timeout() == 12.5
    p = subprocess.run([sys.executable, "-m", "numa_runtime.serve", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "NUMA_RUNTIME_LOG_LEVEL": "bogus"})
    assert p.returncode == 0 and "Traceback" not in p.stderr and "NUMA_RUNTIME_LOG_LEVEL='bogus'" in p.stderr
    from numa_runtime import Engine
    monkeypatch.setenv("AS_PROFILE_TRACE", "/nonexistent-folder/trace.json")
    with pytest.raises(ValueError, match="AS_PROFILE_TRACE='/nonexistent-folder/trace.json' names a file in a "
                                         "folder that does not exist"):
        Engine(model_dir, dtype="float32", kv_cache_memory=1 << 22, max_model_len=64)


def test_served_model_name_aliases(model_dir):
    """vLLM's --served-model-name a b: requests may name either; answers and the first card carry
    the first ("b" was an unrecognized argument)."""
    srv = ServerProcess(["--model", model_dir, *TINY, "--served-model-name", "main", "alias"])
    try:
        client = srv.client()
        assert [m.id for m in client.models.list().data] == ["main", "alias"]
        r = client.completions.create(model="alias", prompt="Hi", max_tokens=2)
        assert r.model == "main"
        with pytest.raises(openai.NotFoundError, match="serves 'main', 'alias'"):
            client.completions.create(model="other", prompt="Hi", max_tokens=2)
    finally:
        code = srv.stop()
    assert code == 0, srv.output()


def test_a_stop_signal_just_after_the_load_stops_the_server_cleanly(model_dir):
    """systemctl stop as the model finished loading: the signal is kept and served as a graceful
    stop once the server's handlers are in. Its replay told the HTTP front "stopping" before
    "ready", and the front started a server on the socket it had just closed (the front died and
    numa-serve exited 1)."""
    code = ("import os, signal, sys\n"
            "import numa_runtime.serve.__main__ as M\n"
            "warn = M.vllm_env_warning\n"
            "def kill_then_warn(*a, **k):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return warn(*a, **k)\n"
            "M.vllm_env_warning = kill_then_warn\n"
            f"sys.exit(M.main(['--model', {model_dir!r}, *{TINY!r}, '--port', '0', '--host', '127.0.0.1']))\n")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "front process exited" not in r.stderr, r.stderr[-3000:]
    assert "serving at http://127.0.0.1:" in r.stdout, r.stdout[-2000:]


def test_a_server_whose_tokenizing_thread_never_returns_still_exits(model_dir, tmp_path):
    """A chat template that loops for ever over a request's list (range() is bounded; a list is not)
    holds its tokenizing thread. The server stops on a signal anyway: the exit waited for that thread
    for ever, and further signals reached no handler (only SIGKILL ended it)."""
    template = tmp_path / "loop.jinja"
    template.write_text("{% for a in xs %}{% for b in xs %}{% for c in xs %}{% endfor %}{% endfor %}{% endfor %}"
                        "{{ messages[0]['content'] }}")
    srv = ServerProcess(["--model", model_dir, *TINY, "--served-model-name", "tiny", "--shutdown-grace", "1",
                         "--chat-template", str(template)])
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                "chat_template_kwargs": {"xs": list(range(5000))}}
        with pytest.raises(httpx.ReadTimeout):  # NOTE: 1.25e11 steps: it never answers
            httpx.post(srv.base + "/v1/chat/completions", json=body, timeout=2)
        assert httpx.get(srv.base + "/health", timeout=10).status_code == 200
    finally:
        started = time.monotonic()
        rc = srv.stop(signal.SIGTERM)
    assert rc == 0 and time.monotonic() - started < 25, srv.output()
    assert "thread(s) still running" in srv.output()


def test_the_request_body_limit_is_a_flag():
    """A body of up to 64 MiB is taken by default (4 MiB, fixed and not in the README, refused large
    embedding batches); --max-request-bytes sets it."""
    from numa_runtime.serve.__main__ import check_args, parse_args, serve_config
    assert serve_config(parse_args([]), "m").max_body_bytes == 64 << 20
    assert serve_config(parse_args(["--max-request-bytes", "5000"]), "m").max_body_bytes == 5000
    assert serve_config(parse_args(["--max-request-bytes", "1G"]), "m").max_body_bytes == 1 << 30
    assert check_args(parse_args(["--max-request-bytes", "10"])).startswith("--max-request-bytes must be at least")


def test_vllm_logprobs_flags_reach_the_engine():
    """--max-logprobs lowers what a request may ask for (there was no such flag), and
    --logprobs-mode raw_logprobs, vLLM's default and what runs here, is taken."""
    from numa_runtime.serve.__main__ import check_args, engine_kwargs, parse_args
    args = parse_args(["--max-logprobs", "3", "--logprobs-mode", "raw_logprobs"])
    assert check_args(args) is None and engine_kwargs(args)["max_logprobs"] == 3
    assert "max_logprobs" not in engine_kwargs(parse_args([]))


def test_max_logprobs_bounds_every_path_that_scores_a_prompt(model_dir):
    """--max-logprobs 2: logprobs=5 with echo and max_tokens 0, and prompt_logprobs=5, computed
    the prompt's log-probabilities past the cap (200, six entries each); they are 400s now."""
    p = subprocess.Popen([sys.executable, "-m", "numa_runtime.serve", "--model", model_dir, *TINY, "--port", "0",
                          "--served-model-name", "tiny", "--max-logprobs", "2"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = next((m.group(1) for line in p.stdout
                    for m in [re.search(r"serving at (http://127\.0\.0\.1:\d+/v1)", line)] if m), None)
        assert url is not None
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 60
        while True:  # NOTE: the address prints as the HTTP thread starts; wait until it answers
            try:
                ok = client.completions.create(model="tiny", prompt="Hello world", max_tokens=0, echo=True, logprobs=2)
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert all(len(t) <= 3 for t in ok.choices[0].logprobs.top_logprobs[1:])
        for extra in ({"echo": True, "max_tokens": 0, "logprobs": 5}, {"echo": True, "max_tokens": 2, "logprobs": 5},
                      {"max_tokens": 2, "extra_body": {"prompt_logprobs": 5}}):
            with pytest.raises(openai.BadRequestError, match=r"asks for 5 log-probabilities, more than this "
                                                             r"engine's max_logprobs \(2\)"):
                client.completions.create(model="tiny", prompt="Hello world", **extra)
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0
