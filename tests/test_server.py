"""The OpenAI-compatible server, as a real subprocess on 127.0.0.1, driven by the official client."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOAT = dict(temperature=0)


# ------------------------------------------------------------------------------ helpers
def tiny_model_dir(tmp_path_factory) -> str:
    """A random Llama with a locally trained tokenizer and chat template (built once per session)."""
    path = tmp_path_factory.getbasetemp() / "tiny-llama"
    if not (path / "tokenizer_config.json").exists():
        from models import build_model
        build_model(str(path), arch="llama", dtype="float32", max_position_embeddings=512)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m numa_runtime.serve ARGS` (optionally under a launcher) on a free local port."""

    def __init__(self, args: list[str], launcher: list[str] = (), env: dict | None = None, timeout: float = 180):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [*launcher, sys.executable, "-m", "numa_runtime.serve", "--port", str(self.port), *args]
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"numa-serve-{self.port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not come up in {timeout:.0f} s:\n{self.output()}")

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def metric(base: str, name: str, headers=None) -> float:
    """The sum of the series of `name` ('family_total' or 'family_total{label="v"}') whose labels
    include those given (a series may carry more, such as model_name)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(base + "/metrics", headers=headers).text
    m = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", name)
    want = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == m.group(1) and want.items() <= s.labels.items())


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(["--model", model_dir, "--dtype", "float32", "--max-model-len", "256",
                         "--served-model-name", "tiny", "--num-threads", "1", "--max-request-bytes", str(4 << 20)])
    yield srv
    code = srv.stop(signal.SIGINT)
    assert code == 0, f"the server did not shut down cleanly on SIGINT (exit {code}):\n{srv.output()}"


@pytest.fixture(scope="module")
def client(server):
    return server.client()


# ------------------------------------------------------------------------------ the happy paths
def test_models(client, server, model_dir):
    """vLLM's model card: root (the model as --model gave it), parent, permission; /ping answers
    as /health (vLLM's, SageMaker's health check)."""
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    card = models.data[0].model_dump()
    assert card["root"] == model_dir and card["parent"] is None and card["permission"] == []
    assert card["max_model_len"] == 256 and card["owned_by"] == "numa_runtime"
    assert client.models.retrieve("tiny").model_dump() == card  # it was a 404 "no such endpoint"
    with pytest.raises(openai.NotFoundError, match="'Org/other' does not exist"):
        client.models.retrieve("Org/other")
    for method in ("GET", "POST"):
        r = httpx.request(method, server.base + "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    # NOTE: every operation of the OpenAPI document has its own id (/ping's two methods shared one)
    ops = [op["operationId"] for path in httpx.get(server.base + "/openapi.json").json()["paths"].values()
           for op in path.values()]
    assert len(ops) == len(set(ops)) and len(ops) > 10


def test_metrics_under_vllm_names_too(client, server):
    """vLLM's metric names (vllm:num_requests_waiting, vllm:generation_tokens_total, ...) carry our
    values, so vLLM's dashboards and autoscaling rules read this server (they found nothing)."""
    gen, done = metric(server.base, "vllm:generation_tokens_total"), metric(
        server.base, 'vllm:request_success_total{finished_reason="length"}')
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    assert metric(server.base, "vllm:generation_tokens_total") == gen + 5
    assert metric(server.base, 'vllm:request_success_total{finished_reason="length"}') == done + 1
    assert metric(server.base, 'vllm:request_generation_tokens_bucket{le="5.0"}') >= 1
    # NOTE: one sample a sequence, as vLLM's (2 prompts x n=2: one sample of 20 tokens before)
    seqs = metric(server.base, "vllm:request_generation_tokens_count")
    # NOTE: so do the request counter and the latency histograms (they counted the API request once,
    # with choice 0's finish reason for all)
    e2e, ttft = metric(server.base, "vllm:e2e_request_latency_seconds_count"), metric(
        server.base, "vllm:time_to_first_token_seconds_count")
    done = metric(server.base, 'vllm:request_success_total{finished_reason="length"}')
    client.completions.create(model="tiny", prompt=["Hello", "The quick brown fox"], n=2, max_tokens=5,
                              extra_body={"ignore_eos": True})
    assert metric(server.base, "vllm:request_generation_tokens_count") == seqs + 4
    assert metric(server.base, 'vllm:request_success_total{finished_reason="length"}') == done + 4
    assert metric(server.base, "vllm:e2e_request_latency_seconds_count") == e2e + 4
    assert metric(server.base, "vllm:time_to_first_token_seconds_count") == ttft + 4
    assert metric(server.base, "vllm:request_generation_tokens_sum") == metric(
        server.base, "numa_runtime_generation_tokens_total")
    # NOTE: vLLM's phases of each engine request (2 prompts: 2 more samples each)
    text = httpx.get(server.base + "/metrics").text
    for phase in ("queue", "prefill", "decode", "inference"):
        assert re.search(rf'^vllm:request_{phase}_time_seconds_count{{model_name="tiny"}} ', text, re.M), phase
    count = metric(server.base, "vllm:request_decode_time_seconds_count")
    client.completions.create(model="tiny", prompt=["Hello", "Hi"], max_tokens=3, extra_body={"ignore_eos": True})
    assert metric(server.base, "vllm:request_decode_time_seconds_count") == count + 2
    client.completions.create(model="tiny", prompt="Hi", n=3, max_tokens=3, extra_body={"ignore_eos": True})
    assert metric(server.base, "vllm:request_decode_time_seconds_count") == count + 5  # NOTE: each of n too
    # NOTE: one clock for arrival, scheduling and tokens (time.time beside time.monotonic gave ~1.7e9 s)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert 0 <= metric(server.base, f"vllm:request_{phase}_time_seconds_sum") < 600, phase
    assert metric(server.base, "vllm:request_prefill_time_seconds_sum") > 0
    # NOTE: vLLM's prefix-cache counters, in tokens (only a hit-rate gauge since the start was served)
    q0, h0 = metric(server.base, "vllm:prefix_cache_queries_total"), metric(server.base, "vllm:prefix_cache_hits_total")
    long = " ".join(f"w{i}" for i in range(60))
    first = client.completions.create(model="tiny", prompt=long, max_tokens=1)
    q1, h1 = metric(server.base, "vllm:prefix_cache_queries_total"), metric(server.base, "vllm:prefix_cache_hits_total")
    again = client.completions.create(model="tiny", prompt=long, max_tokens=1)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert q1 == q0 + first.usage.prompt_tokens and h1 == h0 + first.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and metric(server.base, "vllm:prefix_cache_hits_total") == h1 + cached
    assert metric(server.base, "vllm:prefix_cache_queries_total") == q1 + again.usage.prompt_tokens
    assert metric(server.base, "numa_runtime_prefix_cache_hits_total") == h1 + cached
    for ours, theirs in (("numa_runtime_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("numa_runtime_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("numa_runtime_e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
                         ("numa_runtime_time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
                         ("numa_runtime_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
                         ("numa_runtime_num_requests_waiting", "vllm:num_requests_waiting"),
                         ("numa_runtime_request_generation_tokens_sum", "vllm:request_generation_tokens_sum"),
                         ("numa_runtime_request_prompt_tokens_count", "vllm:request_prompt_tokens_count")):
        assert metric(server.base, ours) == metric(server.base, theirs), theirs
    text = httpx.get(server.base + "/metrics").text
    assert not re.search(r"^vllm:\S*_created", text, re.M)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):  # NOTE: as vLLM labels them
        assert re.search(rf'^vllm:{gauge}{{model_name="tiny"}} ', text, re.M), gauge


def test_completion(client):
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, **FLOAT)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].text
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_unknown_fields_are_answered_and_logged_as_ignored(client, server):
    """As vLLM: a field this server does not know is ignored, with a warning that names it (a
    message's own extra keys are not the request's)."""
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello", "x_note": 1}], max_tokens=2,
        extra_body={"frobnicate_level": 3}, **FLOAT)
    assert r.choices[0].message.content is not None
    client.completions.create(model="tiny", prompt="Hi", max_tokens=2, **FLOAT)
    log = server.output()
    assert log.count("the request's fields 'frobnicate_level' are not used by this server and were ignored") == 1
    assert "x_note" not in log


def test_chat_with_text_parts(client):
    as_string = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=6, **FLOAT)
    as_parts = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                {"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        max_completion_tokens=6, **FLOAT)
    assert as_string.choices[0].message.role == "assistant"
    assert as_string.choices[0].message.content == as_parts.choices[0].message.content
    assert as_string.usage.completion_tokens <= 6


def test_prompt_forms(client):
    ids = [1, 17, 42, 99, 5]
    one = client.completions.create(model="tiny", prompt=ids, max_tokens=4, **FLOAT)
    many = client.completions.create(model="tiny", prompt=[ids, [1, 200]], max_tokens=4, **FLOAT)
    texts = client.completions.create(model="tiny", prompt=["Hello", "world"], max_tokens=4, **FLOAT)
    assert one.usage.prompt_tokens == 5
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == one.choices[0].text
    assert many.usage.prompt_tokens == 7
    assert len(texts.choices) == 2


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stream_joins_to_the_greedy_text(client, kind):
    if kind == "completions":
        full = client.completions.create(model="tiny", prompt="Hello world", max_tokens=24, **FLOAT)
        chunks = list(client.completions.create(model="tiny", prompt="Hello world", max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}, **FLOAT))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        want = full.choices[0].text
    else:
        msgs = [{"role": "user", "content": "Bonjour"}]
        full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, **FLOAT)
        chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, stream=True,
                                                     stream_options={"include_usage": True}, **FLOAT))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        want = full.choices[0].message.content
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, kind):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the
    usage so far, growing by each chunk's tokens. It was accepted and ignored (usage null)."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "completions":
        full = client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, **FLOAT)
        chunks = list(client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, stream=True,
                                                stream_options=opts, **FLOAT))
    else:
        msgs = [{"role": "user", "content": "Bonjour"}]
        full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, **FLOAT)
        chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, stream=True,
                                                     stream_options=opts, **FLOAT))
    assert all(c.usage is not None and c.usage.prompt_tokens == full.usage.prompt_tokens for c in chunks), chunks
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == full.usage.completion_tokens == 6
    assert done[0] == (0 if kind == "chat" else 1)  # NOTE: the chat's role chunk: nothing generated yet
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    two = list(client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, n=2, stream=True,
                                         stream_options=opts, temperature=1.0, seed=1))
    for i in (0, 1):  # NOTE: as vLLM, each chunk carries its own choice's tokens, not the sum
        mine = [c.usage.completion_tokens for c in two if c.choices and c.choices[0].index == i]
        assert mine == sorted(mine) and mine[-1] == 6, two
    assert two[-1].usage.completion_tokens == 12
    plain = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}, **FLOAT))
    assert [c.usage for c in plain[:-1]] == [None] * (len(plain) - 1)


def test_stream_ends_with_done(server):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_n2(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                       max_tokens=8, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(isinstance(c.message.content, str) for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 16
    streamed = list(client.completions.create(model="tiny", prompt="Hi", n=2, max_tokens=8, stream=True,
                                              temperature=1.0, seed=7))
    assert {c.choices[0].index for c in streamed} == {0, 1}


def test_stop_string_cuts_the_text(client):
    no_eos = {"extra_body": {"ignore_eos": True}}
    base = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=32, **no_eos, **FLOAT
                                     ).choices[0].text
    stop = next((base[i:i + 2] for i in range(3, len(base) - 2) if base[i:i + 2].strip()), None)
    assert stop, f"greedy text too short to pick a stop string: {base!r}"
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=32, stop=[stop, "@@@"],
                                  **no_eos, **FLOAT)
    assert r.choices[0].text == base[:base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=32, stop=stop,
                                         stream=True, **no_eos, **FLOAT)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_seed_reproducible(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c
    # -1 is vLLM's "no seed" (it was one fixed seed: every such request gave the same text)
    assert len({sample(-1) for _ in range(4)}) > 1


def test_penalties_and_extensions(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0.7, top_p=0.9, seed=1,
                                  presence_penalty=0.5, frequency_penalty=0.5,
                                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2,
                                              "min_tokens": 8, "ignore_eos": True}, user="someone")
    assert r.usage.completion_tokens == 8


def test_logprobs(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, logprobs=2, **FLOAT)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(len(t) == 2 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       logprobs=True, top_logprobs=3, **FLOAT)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5 for t in content)


def test_vllm_extras_are_applied(client, model_dir):
    """stop_token_ids, include_stop_str_in_output, skip_special_tokens and continue_final_message do
    what they do in vLLM (they used to be dropped without a word)."""
    from numa_runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=12, logprobs=0, **FLOAT)
    base = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0]
    by_text: dict[str, list[int]] = {}
    for i in range(len(tok)):
        by_text.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
    ids = [by_text[t][0] if len(by_text.get(t, ())) == 1 else None for t in base.logprobs.tokens]
    # NOTE: a token whose text names it, at its first occurrence
    k = next(i for i in range(2, 12) if ids[i] is not None and base.logprobs.tokens[i] not in base.logprobs.tokens[:i])
    r = client.completions.create(extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]]}, **kw).choices[0]
    assert (r.text, r.finish_reason) == ("".join(base.logprobs.tokens[:k]), "stop")
    assert r.model_extra["stop_reason"] == ids[k] and base.model_extra["stop_reason"] is None  # vLLM's field
    last = [c.choices[0] for c in client.completions.create(
        stream=True, extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]]}, **kw) if c.choices][-1]
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", ids[k])
    r = client.completions.create(extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]],
                                              "include_stop_str_in_output": True}, **kw).choices[0]
    assert r.text == "".join(base.logprobs.tokens[:k + 1])
    stop = base.text[base.text.index(base.logprobs.tokens[k]):][:2]
    r = client.completions.create(stop=stop, extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
                                  **kw).choices[0]
    assert r.text.endswith(stop) and base.text.startswith(r.text) and r.finish_reason == "stop"
    assert r.model_extra["stop_reason"] == stop
    # a special token forced by logit_bias: dropped from the text by default, kept on request
    pad = {"0": 100}
    kept = client.completions.create(model="tiny", prompt="x", max_tokens=3, logit_bias=pad,
                                     extra_body={"skip_special_tokens": False}, **FLOAT).choices[0].text
    dropped = client.completions.create(model="tiny", prompt="x", max_tokens=3, logit_bias=pad, **FLOAT)
    assert kept == "<pad>" * 3 and dropped.choices[0].text == "" and dropped.usage.completion_tokens == 3
    # continue_final_message: the prompt ends with the assistant's text, not with a new turn
    messages = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Once upon a"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, **FLOAT,
                                          extra_body={"continue_final_message": True, "ignore_eos": True,
                                                      "add_generation_prompt": False})
    rendered = tok.render_chat(messages, add_generation_prompt=False)
    prompt = tok.encode(rendered[:rendered.rindex("Once upon a") + len("Once upon a")], add_special_tokens=False)
    same = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True},
                                     **FLOAT)
    assert chat.usage.prompt_tokens == len(prompt) and chat.choices[0].message.content == same.choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"use_beam_search": True}, "use_beam_search"), ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"logits_processors": ["x"]}, "logits_processors"), ({"cache_salt": "a"}, "cache_salt"),
    ({"detokenize": False}, "detokenize"), ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_vllm_extras_not_implemented_are_refused_by_name(server, body, param):
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    taken = {"use_beam_search": "false", "spaces_between_special_tokens": "true", "detokenize": "true",
             "guided_decoding_backend": '"auto" or "guidance" or "llguidance"'}
    if param in taken:  # NOTE: refused for this value only: the sentence names it and those taken
        said = f"{param} {json.dumps(body[param])} is not supported by this server; it takes {taken[param]} " \
               "(or leave it out)."
    else:
        said = f"{param} is not supported by this server; remove it from the request."
    assert r.json()["error"]["message"] == said


def test_the_guidance_backend_by_name_is_the_one_that_runs(server):
    """guided_decoding_backend "guidance" (or "auto") names the backend that runs here, llguidance, as the
    Python API's StructuredOutputsParams(backend="guidance") does: it was refused over HTTP only."""
    for backend in ("guidance", "auto"):
        r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "guided_regex": "[0-9]+",
                                                               "guided_decoding_backend": backend}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].isdigit(), r.text


def test_echo_logprobs_score_the_prompt_as_lm_eval_asks(client, server, model_dir):
    """lm-eval-harness's local-completions scores a continuation with echo, logprobs 1 and
    max_tokens 1 over token ids (echo was refused): the prompt's tokens' logprobs are
    transformers' (float32), the first null; vLLM's prompt_logprobs and truncate_prompt_tokens too."""
    import torch
    from transformers import AutoModelForCausalLM
    from numa_runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor([ids])).logits[0]
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]].numpy()
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0)
    c = r.choices[0]
    assert c.text.startswith(tok.decode(ids, skip_special_tokens=False)) and len(c.logprobs.tokens) == len(ids) + 1
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs[1:len(ids)], want)) < 1e-4
    greedy = [max(top.values()) for top in c.logprobs.top_logprobs[1:len(ids)]]
    assert all(g >= t - 1e-6 for g, t in zip(greedy, c.logprobs.token_logprobs[1:len(ids)]))
    assert c.logprobs.text_offset[0] == 0 and r.usage.prompt_tokens == len(ids)
    text = "Hello world"
    r = client.completions.create(model="tiny", prompt=text, max_tokens=3, echo=True, temperature=0)
    plain = client.completions.create(model="tiny", prompt=text, max_tokens=3, temperature=0)
    assert r.choices[0].text == text + plain.choices[0].text and r.choices[0].logprobs is None
    chunks = list(client.completions.create(model="tiny", prompt=text, max_tokens=3, echo=True, temperature=0,
                                            stream=True, logprobs=0))
    assert chunks[0].choices[0].text == text and "".join(ch.choices[0].text for ch in chunks if ch.choices) == \
        r.choices[0].text
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.text_offset]
    assert streamed == sorted(streamed) and streamed[0] == 0
    # echo with max_tokens 0 (OpenAI's and vLLM's): the prompt alone, scored, nothing generated
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == tok.decode(ids, skip_special_tokens=False) and len(c.logprobs.tokens) == len(ids)
    assert c.logprobs.token_logprobs[0] is None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs[1:], want)) < 1e-4
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    # vLLM's prompt_logprobs: per prompt token a dict holding it first, the first token None
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for t, d, w in zip(ids[1:], pl[1:], want):
        assert next(iter(d)) == str(t) and abs(d[str(t)]["logprob"] - w) < 1e-4 and len(d) <= 3
        assert d[str(t)]["decoded_token"] == tok.decode([t], skip_special_tokens=False)
    # vLLM's truncate_prompt_tokens: the last k tokens
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi " * 50}], max_tokens=1,
                                       extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    for path, body, match in (("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True},
                               "prompt_logprobs is not supported with stream"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                        "prompt_logprobs": 1}, "prompt_logprobs is not supported"),
                              ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs must be"),
                              ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens must be"),
                              ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True,
                                                   "guided_json": {"type": "bogus"}}, "guided_json constrains")):
        res = httpx.post(server.base + path, json={"max_tokens": 1, **body}, timeout=60)
        assert res.status_code == 400 and match in res.json()["error"]["message"], res.text
    res = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": 0}, timeout=60)
    err = res.json()["error"]
    assert err["code"] == "invalid_value" and err["param"] == "truncate_prompt_tokens"


def test_echo_of_a_token_prompt_cut_inside_a_character_sends_it_once(client, server, model_dir):
    """Token ids that end inside a character: the output's first text completes it and carries
    all of it, so the echo leaves that tail out (it showed U+FFFD there and the output then
    repeated the bytes); echoed alone (max_tokens 0) the prompt is all of it."""
    from numa_runtime.tokenizer import Tokenizer, open_tail
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode("Emoji: 😀😀", add_special_tokens=False)
    cut = next(ids[:n] for n in range(len(ids) - 1, 0, -1) if open_tail(tok, ids[:n]))
    tail = open_tail(tok, cut)
    for stream in (False, True):
        kw = dict(model="tiny", prompt=cut, max_tokens=4, temperature=0, stream=stream)
        plain, echo = (client.completions.create(**kw), client.completions.create(echo=True, **kw))
        if stream:
            plain, echo = ("".join(c.choices[0].text for c in x if c.choices) for x in (plain, echo))
        else:
            plain, echo = plain.choices[0].text, echo.choices[0].text
        assert echo == tok.decode(cut[:len(cut) - tail]) + plain, (echo, plain)
    alone = client.completions.create(model="tiny", prompt=cut, max_tokens=0, echo=True).choices[0].text
    assert alone == tok.decode(cut) and alone.endswith("\ufffd")
    # text_offset indexes the text: the output's offsets are the echo's, less its prompt text
    # (without echo they left out the open tail's text, which the output's text begins with)
    head = len(tok.decode(cut[:len(cut) - tail]))
    for stream in (False, True):
        kw = dict(model="tiny", prompt=cut, max_tokens=4, temperature=0, logprobs=1, stream=stream)
        got = []
        for echo in (False, True):
            r = client.completions.create(echo=echo, **kw)
            chunks = [c.choices[0] for c in r if c.choices] if stream else [r.choices[0]]
            got.append([o for c in chunks if c.logprobs for o in c.logprobs.text_offset])
        plain, echoed = got
        assert len(plain) == 4 and plain == [o - head for o in echoed[len(cut):]], (plain, echoed, head)


def test_echo_checks_its_prompt_and_streams_usage_only_when_asked(client, server):
    """echo over token ids checks them as any prompt is checked (a 400 naming the id, the
    echo-only request included, which runs no generation); an echo-only prompt past the context
    is refused; streamed, its usage comes only with include_usage, once, in the last event; and
    /metrics counts echo-only requests as any other."""
    for bad in (-3, 384, 2 ** 63):
        for extra in ({"max_tokens": 0}, {"max_tokens": 2}, {"max_tokens": 0, "stream": True},
                      {"max_tokens": 2, "stream": True}, {"max_tokens": 0, "logprobs": 1}):
            r = httpx.post(server.base + "/v1/completions", json={"prompt": [5, bad, 6], "echo": True, **extra},
                           timeout=60)
            assert r.status_code == 400, (bad, extra, r.text)
            assert f"Token id {bad} is outside the vocabulary" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="The prompt has 300 tokens, but the context holds max_model_len"):
        client.completions.create(model="tiny", prompt=[7] * 300, max_tokens=0, echo=True)
    before = metric(server.base, "numa_runtime_requests_total")
    prompt_before = metric(server.base, "numa_runtime_prompt_tokens_total")
    chunks = list(client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=0, echo=True, n=2,
                                            stream=True))
    assert len(chunks) == 2 and all(ch.usage is None for ch in chunks), chunks
    chunks = list(client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=0, echo=True, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert [ch.usage is not None for ch in chunks] == [False, False, True] and not chunks[-1].choices
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.total_tokens) == (4, 4)
    assert metric(server.base, "numa_runtime_requests_total") == before + 4  # NOTE: a sequence each, n=2 twice
    assert metric(server.base, "numa_runtime_prompt_tokens_total") == prompt_before + 8
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}


def test_latency_histograms_take_each_sequences_own_times():
    """n=2, one sequence of 2 tokens ending at 0.2 s, one of 200 ending at 10 s: each gets its own
    end-to-end time and time per token (each got the request's: 10 s and 9.9 s a token for 2 tokens)."""
    from prometheus_client.parser import text_string_to_metric_families
    from numa_runtime.serve.async_engine import EngineStats
    from numa_runtime.serve.metrics import ServerMetrics
    m = ServerMetrics(lambda: EngineStats())
    m.observe_request("tiny", [("stop", 10, 2, 100.1, 100.2, 100.2), ("length", 10, 200, 100.1, 109.9, 110.0),
                               ("abort", None, 0, None, None, None)], 20, 202, 100.0)
    samples = {(s.name, s.labels.get("status")): s.value for f in text_string_to_metric_families(m.render().decode())
               for s in f.samples}
    assert samples[("numa_runtime_e2e_request_latency_seconds_sum", None)] == pytest.approx(0.2 + 10.0)
    assert samples[("numa_runtime_time_per_output_token_seconds_sum", None)] == pytest.approx(0.1 + 9.8 / 199)
    assert samples[("numa_runtime_time_to_first_token_seconds_count", None)] == 2
    assert [samples[("numa_runtime_requests_total", k)] for k in ("stop", "length", "abort")] == [1, 1, 1]


def test_usage_says_what_the_prefix_cache_served(client):
    """OpenAI's usage.prompt_tokens_details.cached_tokens (and /v1/responses' input_tokens_details):
    the prompt tokens the prefix cache held (always 0: nothing wrote it)."""
    ids = list(range(5, 105))
    first = client.completions.create(model="tiny", prompt=ids, max_tokens=1)
    again = client.completions.create(model="tiny", prompt=ids, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 96  # NOTE: its whole 16-token blocks, not the last
    msgs = [{"role": "user", "content": "word " * 60}]
    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 48
    client.responses.create(model="tiny", input="word " * 60, max_output_tokens=1)
    r = client.responses.create(model="tiny", input="word " * 60, max_output_tokens=1)
    details = r.usage.input_tokens_details.model_dump()
    assert details["cached_tokens"] >= 48 and details["cached_tokens"] + details["cache_write_tokens"] == \
        r.usage.input_tokens, details


@pytest.mark.parametrize("headers", [{}, {"Content-Type": "text/plain"}])
def test_a_body_not_sent_as_json_says_so(server, headers):
    """A body without 'Content-Type: application/json' (httpx's or requests' data=) is told so;
    without the header it got pydantic's 'Input should be a valid dictionary'."""
    r = httpx.post(server.base + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("The request body must be a JSON object sent with "
                                            "'Content-Type: application/json'.")


def test_a_json_schema_no_value_completes_is_an_error_not_a_stop(client):
    """The schema's grammar fails mid-way (an object that must hold itself): a 400 that says so,
    or an error event in a stream; it used to end as "stop" with '{"x": '."""
    schema = {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}, "required": ["x"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="The JSON schema could not be followed"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0,
                                       response_format=fmt)
    with pytest.raises(openai.APIError, match="The JSON schema could not be followed"):
        for _ in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0,
                                                response_format=fmt, stream=True):
            pass
    with pytest.raises(openai.BadRequestError, match="nests more than"):
        deep = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} if i < 2999 else {"type": "integer"}
                          for i in range(3000)}, "$ref": "#/$defs/d0"}
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": deep}})
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text is not None


def test_response_format_on_completions_constrains_them(client):
    """vLLM applies response_format on /v1/completions too (it was accepted and ignored)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = client.completions.create(model="tiny", prompt="JSON:", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": schema}}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text)["a"], int), r.choices[0].text
    else:
        assert r.choices[0].text.lstrip().startswith("{"), r.choices[0].text
    with pytest.raises(openai.BadRequestError, match=r"best_of 3 is not supported by this server; it takes 1 \(or leave it out\)\."):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"best_of": 3})


def test_response_format_forms_and_strict(client):
    """A response_format without "type" is refused (its schema was dropped unread); llama.cpp's
    schema beside the type is used (json_object + schema was unconstrained); OpenAI's strict: true
    allows no undeclared property (the model filled max_tokens with made-up keys)."""
    from numa_runtime.serve.protocol import strict_schema
    ask = lambda fmt, **kw: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON"}], max_tokens=kw.get("n", 40), temperature=0,
        response_format=fmt)
    with pytest.raises(openai.BadRequestError, match=r"response_format needs a 'type'") as e:
        ask({"json_schema": {"name": "a", "schema": {"type": "integer"}}})
    assert e.value.body["param"] == "response_format"
    for fmt in ({"type": "json_object", "schema": {"enum": ["yes", "no"]}},
                {"type": "json_schema", "schema": {"enum": ["yes", "no"]}}):
        out = ask(fmt).choices[0]
        assert out.finish_reason == "stop" and out.message.content in ('"yes"', '"no"'), (fmt, out)
    loose = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    out = ask({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": loose}}, n=60).choices[0]
    assert out.finish_reason == "stop" and list(json.loads(out.message.content)) == ["a"], out
    nested = {"type": "object", "properties": {"b": {"type": "array", "items": {"$ref": "#/$defs/P"}}},
              "$defs": {"P": {"properties": {"c": {"type": "string"}}}},
              "anyOf": [{"properties": {"d": {}}}, {"type": "object", "patternProperties": {"^x": {}}}]}
    got = strict_schema(nested)
    assert got["$defs"]["P"]["additionalProperties"] is False
    # NOTE: properties beside anyOf branches are a base with variants: closing the base and each
    # branch would forbid every variant's own properties; all stay open
    assert "additionalProperties" not in got and "additionalProperties" not in got["anyOf"][0]
    assert strict_schema({"anyOf": nested["anyOf"]})["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in nested  # NOTE: a copy: the request's own schema is untouched
    # NOTE: parts that declare properties together stay open (closing each made "Base + extra" unsatisfiable)
    both = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                      {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    beside = {"$defs": {"B": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
              "$ref": "#/$defs/B", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    assert strict_schema(both) == both
    assert "additionalProperties" not in strict_schema(beside)
    for schema in (both, beside):
        out = ask({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}},
                  n=80).choices[0]
        assert out.finish_reason in ("stop", "length") and out.message.content.lstrip().startswith("{"), out
    assert ask({"type": None}, n=2).choices[0].finish_reason == "length"  # NOTE: null is "text", as before
    arr = strict_schema({"type": "array", "additionalItems": {"properties": {"x": {}}}})
    assert arr["additionalItems"]["additionalProperties"] is False


def test_a_schema_the_grammar_library_cannot_use_says_why():
    """llguidance's first line alone was "regex parse error:" or "NoExtensionBias"."""
    from numa_runtime.structured import _first_line
    assert _first_line("regex parse error:\n    (?=a)b\n    ^^^\nerror: look-around, including look-ahead "
                       "and look-behind, is not supported\n") == \
        "regex parse error: look-around, including look-ahead and look-behind, is not supported"
    assert _first_line("NoExtensionBias\n") == "a $ref that refers only to itself (no JSON value satisfies it)"
    assert _first_line("oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate oneOf "
                       "with anyOf.") == "oneOf constraints are not supported"


def test_null_means_the_default(client):
    """OpenAI marks n, stream, logprobs, echo... "or null"; the client sends None as null."""
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, n=None, stream=None, echo=None,
                                  logprobs=None, stream_options=None, **FLOAT,
                                  extra_body={"min_tokens": None, "ignore_eos": None})
    assert r.usage.completion_tokens == 3 and r.choices[0].logprobs is None
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       n=None, stream=None, logprobs=None, **FLOAT)
    assert len(c.choices) == 1 and c.choices[0].logprobs is None
    streamed = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=3, stream=True, **FLOAT,
                                              stream_options={"include_usage": None}))
    assert all(chunk.usage is None for chunk in streamed)


def test_errors_keep_the_spelling_of_the_field_they_name(client, server):
    """A message that opens with a request field keeps its spelling and names it as `param`
    ("Min_tokens (5) must not exceed ..." and "Logit_bias names token ..." before); stream_options
    on a body that does not stream is refused, as vLLM does (it was ignored); an embedding's
    encoding_format null is the default, as every other field's null."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=4, extra_body={"min_tokens": 5})
    assert e.value.body["message"].startswith("min_tokens (5)") and e.value.body["param"] == "min_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, logit_bias={"99999999": 5})
    assert e.value.body["message"].startswith("logit_bias names token") and e.value.body["param"] == "logit_bias"
    for create in (lambda **k: client.completions.create(prompt="Hi", **k),
                   lambda **k: client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **k)):
        with pytest.raises(openai.BadRequestError) as e:
            create(model="tiny", max_tokens=2, stream_options={"include_usage": True})
        assert e.value.body["param"] == "stream_options" and "stream: true" in e.value.body["message"]
    r = httpx.post(f"{server.base}/v1/embeddings", json={"input": "hi", "encoding_format": None}, timeout=60)
    assert r.status_code == 200 and isinstance(r.json()["data"][0]["embedding"], list), r.text
    # a schema no value satisfies, sent as guided_json: the error names guided_json (response_format before)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=5,
                                  extra_body={"guided_json": {"type": "integer", "minimum": 5, "maximum": 2}})
    assert e.value.body["param"] == "guided_json", e.value.body


def test_max_completion_tokens_errors_name_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=0)
    assert e.value.body["param"] == "max_completion_tokens" and "max_tokens" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=100000)
    assert "max_completion_tokens" in e.value.body["message"] and "max_tokens" not in e.value.body["message"]


# ------------------------------------------------------------------------------ disconnects
def test_logprobs_of_streams_and_partial_characters(client, model_dir):
    """text_offset runs on over a stream's chunks as in one body. A token that holds part of a
    character (the byte 0xC3 of the byte-level alphabet, forced by logit_bias) shows as
    "bytes:\\xc3" with its byte, and its U+FFFD counts at its own offset; legacy top_logprobs
    keep one key per token."""
    from numa_runtime.tokenizer import Tokenizer
    kw = dict(model="tiny", prompt="Hello world", max_tokens=12, logprobs=2, **FLOAT)
    full = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == full.logprobs.text_offset and len(offsets) == 12
    assert offsets == sorted(offsets) and offsets[-1] < len(full.text) and offsets[1] > 0
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == full.logprobs.tokens
    c3 = Tokenizer.from_dir(model_dir)._backend.token_to_id("\u00c3")
    bias = {str(c3): 100}
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          logprobs=True, top_logprobs=3, logit_bias=bias, **FLOAT)
    content = chat.choices[0].logprobs.content
    assert [(t.token, t.bytes) for t in content] == [("bytes:\\xc3", [0xC3])] * 3
    for t in content:
        assert len({e.token for e in t.top_logprobs}) == 3
        assert all(e.bytes == list(e.token.encode()) or e.token.startswith("bytes:") for e in t.top_logprobs)
    legacy = client.completions.create(model="tiny", prompt="x", max_tokens=3, logprobs=5, logit_bias=bias, **FLOAT)
    lp = legacy.choices[0].logprobs
    # NOTE: the sampled token (forced: its raw logprob need not be among the 5 best) is always one
    assert lp.tokens == ["bytes:\\xc3"] * 3
    # NOTE: each lone lead byte is a U+FFFD of its own token's (the next token's start counted it)
    assert legacy.choices[0].text == "\ufffd" * 3 and lp.text_offset == [0, 1, 2], lp.text_offset
    assert all(len(t) in (5, 6) and "bytes:\\xc3" in t for t in lp.top_logprobs), lp.top_logprobs


def test_text_offsets_skip_the_special_tokens_the_text_leaves_out(client):
    """A special token that skip_special_tokens (the default) leaves out of the text takes none of
    its characters: every <pad> here was counted as 5, and the offsets ran past the text."""
    kw = dict(model="tiny", prompt="Hello", max_tokens=4, logprobs=0, logit_bias={"0": 100}, **FLOAT)
    body = client.completions.create(**kw).choices[0]
    assert body.text == "" and body.logprobs.tokens == ["<pad>"] * 4 and body.logprobs.text_offset == [0] * 4
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == [0] * 4
    kept = client.completions.create(**kw, extra_body={"skip_special_tokens": False}).choices[0]
    assert kept.text == "<pad>" * 4 and kept.logprobs.text_offset == [0, 5, 10, 15]
    # an echoed prompt's special tokens are in its text: counted there, not after it
    echo = client.completions.create(**{**kw, "prompt": "<pad>Hi", "max_tokens": 2}, echo=True).choices[0]
    assert echo.text == "<pad>Hi" and echo.logprobs.tokens[0] == "<pad>"
    n = len(echo.logprobs.tokens)
    assert echo.logprobs.text_offset[0] == 0 and echo.logprobs.text_offset[n - 2:] == [7, 7]


def test_legacy_top_logprobs_always_hold_the_sampled_token(client):
    """OpenAI's legacy completions and vLLM: top_logprobs holds the `logprobs` most likely tokens
    and the sampled one (logprobs + 1 entries when it is not among them; logprobs=0: only it)."""
    kw = dict(model="tiny", prompt="Hello world", max_tokens=16, temperature=1.5, seed=7,
              extra_body={"ignore_eos": True})
    for k in (0, 1, 3):
        lp = client.completions.create(logprobs=k, **kw).choices[0].logprobs
        for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[tok] == chosen and len(top) in (k, k + 1) and len(top) >= 1, (k, tok, top)
        if k == 0:
            assert all(len(t) == 1 for t in lp.top_logprobs)


def test_disconnect_mid_stream_aborts(server, client):
    aborted = metric(server.base, 'numa_runtime_requests_total{status="abort"}')
    # NOTE: n=32: enough work (7680 tokens) that the stream is still running when the client goes,
    # on a busy host too (n=4 finished first there once)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True, "n": 32}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
    assert got[0].startswith("data: ")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (metric(server.base, 'numa_runtime_requests_total{status="abort"}') == aborted + 32
                and metric(server.base, "numa_runtime_num_requests_running") == 0):
            break
        time.sleep(0.1)
    assert metric(server.base, 'numa_runtime_requests_total{status="abort"}') == aborted + 32  # a sequence each
    assert metric(server.base, "numa_runtime_num_requests_running") == 0
    assert metric(server.base, "numa_runtime_kv_cache_usage_ratio") == 0
    after = client.completions.create(model="tiny", prompt="Still there?", max_tokens=2, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 2


def test_disconnect_non_streaming_aborts(server):
    aborted = metric(server.base, 'numa_runtime_requests_total{status="abort"}')
    # NOTE: 64 sequences with logprobs run ~1.6 s on the tiny model (n=4 ended in 90 ms, before a loaded
    # machine's server saw the client go)
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "n": 64,
                       "logprobs": 20})
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:  # NOTE: the client goes once its request runs
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and metric(server.base, "numa_runtime_num_requests_running") == 0:
            time.sleep(0.02)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and metric(server.base, "numa_runtime_num_requests_running") > 0:
        time.sleep(0.1)
    assert metric(server.base, "numa_runtime_num_requests_running") == 0
    assert metric(server.base, 'numa_runtime_requests_total{status="abort"}') == aborted + 64  # a sequence each


# ------------------------------------------------------------------------------ bad input
def _post(server, path, content, headers=None):
    h = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.base + path, content=content, headers=h, timeout=30)


BAD = {
    "malformed json": ("/v1/completions", b'{"prompt": "x",', 400, None),
    "not an object": ("/v1/completions", b'[1, 2]', 400, None),
    "missing prompt": ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
    "missing messages": ("/v1/chat/completions", b'{"model": "tiny"}', 400, "messages"),
    "wrong type": ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    # NOTE: any role the template takes is taken, as vLLM (ipython, function); an empty one is no role
    "wrong role": ("/v1/chat/completions", b'{"messages": [{"role": "", "content": "x"}]}', 400,
                   "messages.0.role"),
    "image part": ("/v1/chat/completions",
                   b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}', 400, None),
    "temperature": ("/v1/completions", b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
    "top_p": ("/v1/completions", b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
    "max_tokens 0": ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    "nan": ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    "n 0": ("/v1/completions", b'{"prompt": "x", "n": 0}', 400, "n"),
    "empty prompt": ("/v1/completions", b'{"prompt": []}', 400, None),
    "bad token id": ("/v1/completions", b'{"prompt": [1, 99999]}', 400, None),
    "empty stop": ("/v1/completions", b'{"prompt": "x", "stop": [""]}', 400, "stop"),
    "top_logprobs alone": ("/v1/chat/completions",
                           b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', 400, "top_logprobs"),
    "unknown model": ("/v1/completions", b'{"model": "gpt-9", "prompt": "x"}', 404, "model"),
    "too long": ("/v1/completions", json.dumps({"prompt": list(range(3, 300))}).encode(), 400, None),
    "too long with max_tokens": ("/v1/completions", json.dumps({"prompt": list(range(3, 200)),
                                                                 "max_tokens": 100}).encode(), 400, None),
    "over the body limit": ("/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413, None),
    "no such endpoint": ("/v1/moderations", b'{}', 404, None),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_an_openai_error(server, case):
    path, body, status, param = BAD[case]
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"].endswith(".") and err["message"].count(". ") == 0, err["message"]
    if param is not None:
        assert err["param"] == param
    assert httpx.get(server.base + "/health").status_code == 200


def test_a_body_over_the_limit_gets_one_answer_chunked_or_not(server):
    """A chunked body (no Content-Length) past the limit is found as it is read: the same 413 and
    code as a declared one (its code was "413")."""
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    codes = []
    for content in (big, iter([big[i:i + 65536] for i in range(0, len(big), 65536)])):
        r = httpx.post(server.base + "/v1/completions", content=content, timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        codes.append(r.json()["error"]["code"])
    assert codes == ["request_too_large"] * 2


def test_bad_input_through_the_client(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=7000)
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_model_len|context"):
        client.completions.create(model="tiny", prompt=list(range(3, 300)))
    with pytest.raises(openai.BadRequestError) as e:  # NOTE: the sentence names the field: so does param
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=300)
    assert e.value.body["param"] == "max_completion_tokens" and e.value.body["code"] == "context_length_exceeded"
    for extra in ({"echo": True, "logprobs": 1}, {"extra_body": {"prompt_logprobs": 1}}):  # NOTE: before a forward
        with pytest.raises(openai.BadRequestError, match=r"plus max_tokens \(250\) exceeds max_model_len") as e:
            client.completions.create(model="tiny", prompt=list(range(3, 20)), max_tokens=250, **extra)
        assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match=r"max_tokens must be at least 1 \(0 only with echo: true"):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)


def test_context_limits_as_vllm(client):
    """As vLLM: an explicit `"max_tokens": null` on /v1/completions runs to the context's end (it
    was 16, OpenAI's default for an omitted one, which stays); a prompt longer than the context
    says so (it said the context left no room for an output token)."""
    prompt = list(range(3, 3 + 250))
    r = client.completions.create(model="tiny", prompt=prompt, temperature=0,
                                  extra_body={"ignore_eos": True, "max_tokens": None})  # NOTE: sent as null
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError, match=r"The prompt has 300 tokens, more than the context holds "
                                                     r"\(max_model_len=256\)") as e:
        client.completions.create(model="tiny", prompt=list(range(3, 303)), extra_body={"max_tokens": None})
    assert e.value.body["code"] == "context_length_exceeded"


def test_a_chat_is_judged_by_its_rendered_prompt(model_dir, tmp_path):
    """A template that renders the last message only: a chat with a long earlier turn is answered,
    as vLLM judges the rendered prompt (its messages' characters were refused before the template
    ran), and a long last turn is refused. --max-model-len takes vLLM's units (0.256k = 256)."""
    template = tmp_path / "last.jinja"
    template.write_text("{{ messages[-1]['content'] }}")
    srv = ServerProcess(["--model", model_dir, "--dtype", "float32", "--max-model-len", "0.256k", "--num-threads", "1",
                         "--chat-template", str(template)])
    try:
        client = srv.client()
        assert client.models.list().data[0].model_extra["max_model_len"] == 256
        long_turn = "words and more words " * 1200  # about 25,000 characters: more than 256 tokens can hold
        r = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=3, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": long_turn}, {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": "hello"}])
        assert r.usage.prompt_tokens < 10 and r.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError, match="context") as e:
            client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=3,
                                           messages=[{"role": "user", "content": long_turn}])
        assert e.value.body["code"] == "context_length_exceeded"
    finally:
        assert srv.stop() == 0, srv.output()


def test_openapi_and_profile(server):
    schema = httpx.get(server.base + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
    assert "CompletionRequest" in schema["components"]["schemas"]
    r = httpx.get(server.base + "/debug/profile")  # AS_PROFILE is off here
    assert r.status_code == 404 and "AS_PROFILE" in r.json()["error"]["message"]
    # a model it does not serve: the 404 a request naming it gets (it answered the served model's)
    r = httpx.get(server.base + "/debug/profile?model=nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ------------------------------------------------------------------------------ api key, queue limit
@pytest.fixture(scope="module")
def strict_server(model_dir):
    srv = ServerProcess(["--model", model_dir, "--dtype", "float32", "--max-model-len", "512", "--api-key", "s3cret",
                         "2nd-key", "--max-num-seqs", "1", "--max-queue", "1", "--num-threads", "1"])
    yield srv
    assert srv.stop() == 0, srv.output()


def test_api_key(strict_server):
    base = strict_server.base
    assert httpx.get(base + "/health").status_code == 200 and httpx.get(base + "/ping").status_code == 200
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        r = httpx.get(base + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(base + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        strict_server.client(api_key="wrong").completions.create(model="tiny-llama", prompt="x", max_tokens=2)
    r = strict_server.client(api_key="s3cret").completions.create(model="tiny-llama", prompt="x", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    # NOTE: several keys (vLLM's --api-key K1 K2): any of them; the second was read as a model
    r = strict_server.client(api_key="2nd-key").completions.create(model="tiny-llama", prompt="x", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        strict_server.client(api_key="s3cret 2nd-key").models.list()


def test_cors_as_vllm_answers_browser_pages(strict_server, model_dir):
    """vLLM's CORS defaults: any origin, method and header; a preflight (OPTIONS) is answered
    without the API key, and answers carry Access-Control-Allow-Origin. --allowed-origins
    narrows the origins; a flag that is not a JSON list is one sentence."""
    base, page = strict_server.base, "https://chat.example"
    pre = httpx.options(base + "/v1/chat/completions", headers={
        "Origin": page, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] in ("*", page)
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   headers={"Origin": page, "Authorization": "Bearer s3cret"}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.get(base + "/v1/models", headers={"Origin": page})  # NOTE: the key is still asked for
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
    srv = ServerProcess(["--model", model_dir, "--dtype", "float32", "--max-model-len", "256", "--num-threads", "1",
                         "--allowed-origins", json.dumps([page])])
    try:
        for origin, allowed in ((page, True), ("https://evil.example", False)):
            pre = httpx.options(srv.base + "/v1/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})
            assert (pre.status_code == 200) == allowed, pre.text
            r = httpx.get(srv.base + "/v1/models", headers={"Origin": origin})
            assert r.headers.get("access-control-allow-origin") == (page if allowed else None)
    finally:
        assert srv.stop() == 0, srv.output()
    bad = subprocess.run([sys.executable, "-m", "numa_runtime.serve", "--allowed-origins", "*"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--allowed-origins takes a JSON list of strings" in bad.stderr, bad.stderr


def test_queue_limit_gives_429(strict_server):
    """max_num_seqs 1: one sequence of an n=8 request runs, seven wait; with max_queue 1 the
    next request is refused until they are gone."""
    import threading
    auth = {"Authorization": "Bearer s3cret"}
    body = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "n": 8}
    busy = {}
    # NOTE: the busy request runs in a thread and is read whole, so nothing depends on how a
    # client that stops reading a stream is treated.
    worker = threading.Thread(target=lambda: busy.update(r=httpx.post(
        strict_server.base + "/v1/completions", json=body, headers=auth, timeout=120)))
    worker.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not metric(strict_server.base, "numa_runtime_num_requests_waiting", auth):
        time.sleep(0.02)
    with httpx.Client(base_url=strict_server.base, headers=auth, timeout=60) as h:
        refused = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        worker.join(timeout=120)
        assert busy["r"].status_code == 200 and len(busy["r"].json()["choices"]) == 8
        assert h.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------------------ multi-rank and the real model
def test_under_mpirun_two_ranks(model_dir):
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    srv = ServerProcess(["--model", model_dir, "--dtype", "float32", "--max-model-len", "256",
                         "--kv-cache-memory", str(1 << 24), "--num-threads", "1"],
                        launcher=[mpirun if os.path.exists(mpirun) else "mpirun", "-np", "2"],
                        env={"MPI4PY_RC_THREAD_LEVEL": "funneled"})
    try:
        r = srv.client().completions.create(model="tiny-llama", prompt=[1, 17, 42, 99, 5], max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8
        assert "2 rank(s)" in srv.output() and re.search(r"rank 0 on node \S+, cpus \S+", srv.output())
        # NOTE: as vLLM, the --model string as given names the model too (a 404 before)
        assert srv.client().completions.create(model=model_dir, prompt="Hi", max_tokens=2).usage.completion_tokens
        assert [m.id for m in srv.client().models.list().data][0] == "tiny-llama"
    finally:
        code = srv.stop()
    assert code == 0, srv.output()


def test_flag_errors_and_help_under_mpirun_print_once():
    """Under mpirun a bad flag and --help print once (rank 0), not once a rank."""
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled")
    for module, flags, code, text in (
            ("numa_runtime.serve", ["--bogus"], 2, "numa-serve: error: unrecognized arguments: --bogus"),
            ("numa_runtime.serve", ["--help"], 0, "usage: numa-serve"),
            ("numa_runtime", ["--bogus"], 2, "error: unrecognized arguments: --bogus"),
            ("numa_runtime", ["--help"], 0, "usage: python -m numa_runtime")):
        p = subprocess.run([mpirun if os.path.exists(mpirun) else "mpirun", "-np", "2", sys.executable, "-m",
                            module, *flags], capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == code, p.stdout + p.stderr
        assert (p.stdout + p.stderr).count(text) == 1, p.stdout + p.stderr


def test_default_model_answers_a_chat_question():
    srv = ServerProcess([], timeout=600)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 40}},
              "required": ["capital"], "additionalProperties": False}
    try:
        client = srv.client()
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, max_tokens=32,
                                           temperature=0)
        structured = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=question, max_tokens=64, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
        free_form = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=128, temperature=0, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": 'Return a JSON object with the key "capital" for France.'}])
    finally:
        srv.stop()
    answer = r.choices[0].message.content
    print(f"\nSmolLM2 says: {answer!r}, {structured.choices[0].message.content!r}, "
          f"{free_form.choices[0].message.content!r}")
    assert "Paris" in answer
    assert "Paris" in json.loads(structured.choices[0].message.content)["capital"]
    assert structured.choices[0].finish_reason == "stop"
    assert "Paris" in json.loads(free_form.choices[0].message.content)["capital"]
    assert free_form.choices[0].finish_reason == "stop"


def test_the_models_generation_config_gives_the_sampling_defaults(model_dir, tmp_path):
    """As vLLM's --generation-config auto: generation_config.json's sampling values are the
    defaults of requests that leave them unset (here top_k 1: greedy whatever the temperature);
    a request's own value wins, and --generation-config vllm ignores the file. They were ignored."""
    import json
    import shutil
    d = str(tmp_path / "m")
    shutil.copytree(model_dir, d)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "top_k": 1, "temperature": 0.9,
                   "max_new_tokens": 20}, f)
    kw = dict(model="m", prompt="Hello", max_tokens=12, extra_body={"ignore_eos": True})
    srv = ServerProcess(["--model", d, "--dtype", "float32", "--served-model-name", "m", "--num-threads", "1"])
    try:
        c = srv.client()
        greedy = c.completions.create(temperature=0, **kw).choices[0].text
        assert all(c.completions.create(seed=s, **kw).choices[0].text == greedy for s in (1, 2, 3))
        own = {c.completions.create(seed=s, extra_body={"ignore_eos": True, "top_k": -1},
                                    **{k: v for k, v in kw.items() if k != "extra_body"}).choices[0].text
               for s in (1, 2, 3)}
        assert len(own) > 1  # the request's top_k (-1: all) replaced the model's
        # max_new_tokens caps every request, as vLLM's: a chat without max_tokens, and one asking more
        chat = dict(model="m", messages=[{"role": "user", "content": "Hi"}], extra_body={"ignore_eos": True})
        assert c.chat.completions.create(**chat).usage.completion_tokens == 20
        assert c.chat.completions.create(max_tokens=50, **chat).usage.completion_tokens == 20
        assert c.completions.create(**{**kw, "max_tokens": 7}).usage.completion_tokens == 7
    finally:
        assert srv.stop() == 0, srv.output()
    srv = ServerProcess(["--model", d, "--dtype", "float32", "--served-model-name", "m", "--num-threads", "1",
                         "--generation-config", "vllm"])
    try:
        c = srv.client()
        assert len({c.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}) > 1
    finally:
        assert srv.stop() == 0, srv.output()


def test_chat_template_flag_replaces_the_models_template(model_dir, tmp_path):
    """vLLM's --chat-template (a file, or the template itself): chats render with it."""
    import httpx
    from numa_runtime.tokenizer import Tokenizer
    template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    msgs = [{"role": "user", "content": "Hello there"}]
    want = Tokenizer.from_dir(model_dir).encode("[user] Hello there\n>", add_special_tokens=False)
    for flag in (str(path), template):
        srv = ServerProcess(["--model", model_dir, "--dtype", "float32", "--served-model-name", "m",
                             "--num-threads", "1", "--chat-template", flag])
        try:
            assert httpx.post(srv.base + "/tokenize", json={"messages": msgs}, timeout=30).json()["tokens"] == want
            r = srv.client().chat.completions.create(model="m", messages=msgs, max_tokens=2)
            assert r.usage.prompt_tokens == len(want)
        finally:
            assert srv.stop() == 0, srv.output()


def test_a_server_side_failure_is_a_json_500(model_dir, tmp_path):
    """A model whose tokenizer holds more tokens than its vocabulary: structured output cannot run
    on it. That is the server's fault: a 500 with an OpenAI error body that says why (it was a
    400 blaming the request); any unexpected failure is a JSON 500, never a bare text one."""
    import json
    import shutil
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    with open(d / "tokenizer.json") as f:
        tj = json.load(f)
    n = len(tj["model"]["vocab"])
    tj["added_tokens"] += [{"id": n + i, "content": f"<extra_{i}>", "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False, "special": True} for i in range(8)]
    with open(d / "tokenizer.json", "w") as f:
        json.dump(tj, f)
    srv = ServerProcess(["--model", str(d), "--dtype", "float32", "--served-model-name", "m", "--num-threads", "1"])
    try:
        r = httpx.post(srv.base + "/v1/completions", timeout=60, json={
            "model": "m", "prompt": "Hi", "max_tokens": 4, "response_format": {"type": "json_object"}})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and "Structured output cannot run on this model" in err["message"]
        assert srv.client().completions.create(model="m", prompt="Hi", max_tokens=2).choices[0].text is not None
    finally:
        srv.stop()


def test_tokenize_refuses_a_chat_template_it_would_not_use(server):
    """vLLM's /tokenize field chat_template was ignored (token counts of a template never used);
    refused as chat completions refuse it."""
    r = httpx.post(server.base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "chat_template": "XX"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


def test_tokenize_detokenize_and_version(server, model_dir):
    """vLLM's /tokenize (a prompt, or messages through the chat template), /detokenize and /version."""
    from numa_runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    r = httpx.post(server.base + "/tokenize", json={"model": "tiny", "prompt": "Hello world",
                                                    "return_token_strs": True}, timeout=30).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    # NOTE: as vLLM, the vocabulary's strings (convert_ids_to_tokens); they were decoded text
    assert r["token_strs"] == [tok._backend.id_to_token(t) for t in r["tokens"]]
    assert r["token_strs"][-1].startswith("Ġ") and "".join(r["token_strs"]).replace("Ġ", " ").endswith("Hello world")
    msgs = [{"role": "user", "content": "Hi"}]
    r = httpx.post(server.base + "/tokenize", json={"messages": msgs}, timeout=30).json()
    assert r["tokens"] == tok.encode(tok.render_chat(msgs), add_special_tokens=False)
    assert r["token_strs"] is None
    r = httpx.post(server.base + "/detokenize", json={"tokens": tok.encode("Hello world", add_special_tokens=False)},
                   timeout=30)
    assert r.json() == {"prompt": "Hello world"}
    # a chat prompt's tokens come back with their template's special tokens (as vLLM; they were dropped)
    ids = httpx.post(server.base + "/tokenize", json={"messages": msgs}, timeout=30).json()["tokens"]
    r = httpx.post(server.base + "/detokenize", json={"tokens": ids}, timeout=30)
    assert r.json()["prompt"] == tok.decode(ids, skip_special_tokens=False) == tok.render_chat(msgs)
    for path, body, msg in (("/tokenize", {}, "Give either prompt or messages"),
                            ("/tokenize", {"prompt": "x", "messages": msgs}, "Give either prompt or messages"),
                            ("/detokenize", {"tokens": [10 ** 9]}, "is not a token id"),
                            ("/tokenize", {"model": "other", "prompt": "x"}, "does not exist")):
        r = httpx.post(server.base + path, json=body, timeout=30)
        assert r.status_code in (400, 404) and msg in r.json()["error"]["message"], r.text
    err = httpx.post(server.base + "/detokenize", json={"tokens": [1, -1]}, timeout=30).json()["error"]
    assert err["message"].startswith("tokens holds -1,") and err["param"] == "tokens", err
    assert httpx.get(server.base + "/version", timeout=30).json()["version"]


def test_a_request_line_with_an_absolute_url_is_routed_by_its_path(server):
    """RFC 9112: a server must accept `POST http://host/v1/completions HTTP/1.1` (proxies and some
    clients send it); it was a 404 "no such endpoint", through the HTTP front and without it."""
    import socket
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode()
    for target in (f"http://127.0.0.1:{server.port}/v1/completions", "HTTP://x/v1/completions"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            s.sendall(f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), answer[:500]
        assert json.loads(payload)["usage"]["completion_tokens"] == 2
