"""--reasoning-parser: a chat reply's <think> part as reasoning_content (vLLM's deepseek_r1 and
qwen3 parsers), in bodies and streams alike; tools read the content only."""
import asyncio
import json
import random

import pytest

from numa_runtime.serve.reasoning import ReasoningStream, split

CASES = [
    # (parser, reply, reasoning, content)
    ("deepseek_r1", "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.", "\nLet me see: 2+2.\n", "\n\nIt is 4."),
    ("deepseek_r1", "Let me see.</think>It is 4.", "Let me see.", "It is 4."),  # <think> was in the prompt
    ("deepseek_r1", "Still thinking when cut", "Still thinking when cut", None),
    ("deepseek_r1", "  <think>x</think>", "x", None),
    ("deepseek_r1", "<thi", "<thi", None),
    # NOTE: a <think> written after other text is dropped (it stayed in reasoning_content, tag and all)
    ("deepseek_r1", "pre <think>A</think>B", "pre A", "B"),
    ("deepseek_r1", "pre <think>cut", "pre cut", None),
    ("qwen3", "<think>\nHmm.\n</think>\n\nHello!", "\nHmm.\n", "\n\nHello!"),
    ("qwen3", "Hello! No thinking here.", None, "Hello! No thinking here."),  # enable_thinking: false
    ("qwen3", "<think>cut off", "cut off", None),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "a </think> b", None, "a </think> b"),  # NOTE: no opening tag: all content
    ("qwen3", "<think></think>Hi", None, "Hi"),
]


@pytest.mark.parametrize("parser,reply,reasoning,content", CASES)
def test_a_reply_splits_alike_in_a_body_and_a_stream(parser, reply, reasoning, content):
    assert split(parser, reply) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(40):  # NOTE: any cut into deltas: a tag split over them included
        rs, got_r, got_c, i = ReasoningStream(parser), "", "", 0
        while i < len(reply):
            j = min(len(reply), i + rng.randint(1, 5))
            r, c = rs.feed(reply[i:j])
            got_r, got_c, i = got_r + r, got_c + c, j
        r, c = rs.finish()
        assert (got_r + r or None, got_c + c or None) == (reasoning, content)


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning parser must be one of deepseek_r1, qwen3"):
        ReasoningStream("r1")


# ------------------------------------------------------------------ through the app
class _Scripted:
    """The AsyncEngine surface the app uses, answering every request with one scripted reply in
    small deltas (a random model never writes <think>)."""

    def __init__(self, engine, reply: str):
        self.engine, self.reply, self.is_alive, self.num_waiting = engine, reply, True, 0
        self.busy_seconds = self.seconds_since_last_step = 0.0
        self.stats = None

    async def add(self, request_id, prompt, params, sink):
        from numa_runtime.outputs import CompletionOutput, RequestOutput
        text, ids, step = "", [], 3
        for k in range(0, len(self.reply), step):
            d = self.reply[k:k + step]
            text, ids = text + d, ids + [5]
            last = k + step >= len(self.reply)
            lps = None if params.logprobs is None else [(-0.5, {5: -0.5}, 1)] * len(ids)
            outs = [CompletionOutput(i, text, list(ids), "stop" if last else None, None, lps, d, [5],
                                     None if lps is None else lps[-1:]) for i in range(params.n)]
            sink.put_nowait(RequestOutput(request_id, None, list(prompt), outs, last))
            await asyncio.sleep(0)

    def abort(self, request_id):
        pass


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from models import build_model
    from numa_runtime import Engine
    d = str(tmp_path_factory.mktemp("reasoning"))
    build_model(d, arch="qwen2")
    eng = Engine(d, dtype="float32", kv_cache_memory=1 << 22, max_model_len=256, num_threads=1)
    yield eng
    eng.close()


def _client(engine, reply, parser, tool_parser=None):
    import openai
    from fastapi.testclient import TestClient
    from numa_runtime.serve.app import ServeConfig, build_app
    app = build_app(_Scripted(engine, reply), ServeConfig(served_model_name="m", reasoning_parser=parser,
                                                          tool_call_parser=tool_parser))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=TestClient(app))


MSGS = [{"role": "user", "content": "2+2?"}]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_official_client_reads_reasoning_content_in_bodies_and_streams(engine, parser):
    reply = "<think>\nAdd them.\n</think>\n\nIt is 4."
    c = _client(engine, reply, parser)
    msg = c.chat.completions.create(model="m", messages=MSGS).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("\nAdd them.\n", "\n\nIt is 4.")
    assert msg.model_extra["reasoning"] == msg.reasoning_content  # NOTE: vLLM's newer name too
    chunks = list(c.chat.completions.create(model="m", messages=MSGS, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "\nAdd them.\n"
    assert "".join(d.content or "" for d in deltas) == "\n\nIt is 4."
    kinds = [k for d in deltas for k in (["r"] if getattr(d, "reasoning_content", None) else [])
             + (["c"] if d.content else [])]
    assert kinds == sorted(kinds, reverse=True)  # NOTE: all reasoning before any content
    # NOTE: logprobs ride with the reasoning they wrote: no empty chunk carries them (one per token)
    chunks = list(c.chat.completions.create(model="m", messages=MSGS, stream=True, logprobs=True))
    deltas = [(ch.choices[0].delta, ch.choices[0].logprobs, ch.choices[0].finish_reason) for ch in chunks if ch.choices]
    assert not [d for d, lp, fin in deltas if lp and not (d.content or getattr(d, "reasoning_content", None))]
    assert sum(len(lp.content) for _, lp, _ in deltas if lp) == -(-len(reply) // 3)
    plain = c.chat.completions.create(model="m", messages=MSGS, extra_body={"include_reasoning": False})
    assert plain.choices[0].message.reasoning_content is None and plain.choices[0].message.content == "\n\nIt is 4."
    # NOTE: a JSON schema leaves no room to reason: the output is all content
    forced = c.chat.completions.create(model="m", messages=MSGS, response_format={"type": "json_object"})
    assert forced.choices[0].message.content == reply


def test_tool_calls_are_read_from_the_content_after_the_reasoning(engine):
    reply = ('<think>I need the weather tool; <tool_call> is how I call it.</think>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    c = _client(engine, reply, "deepseek_r1", tool_parser="hermes")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    r = c.chat.completions.create(model="m", messages=MSGS, tools=tools).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.reasoning_content.startswith("I need the weather tool")
    assert json.loads(r.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    chunks = list(c.chat.completions.create(model="m", messages=MSGS, tools=tools, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == r.message.reasoning_content
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [t.function.name for t in calls] == ["get_weather"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_a_real_server_splits_what_the_model_writes(engine):
    """With a real model and server: deepseek_r1 takes a reply without </think> as all reasoning
    (its template opened <think>); the raw text is what /v1/completions gives for the same tokens."""
    import httpx
    from test_server import ServerProcess
    srv = ServerProcess(["--model", engine.model_config.model_dir, "--dtype", "float32", "--served-model-name", "m",
                         "--num-threads", "1", "--reasoning-parser", "deepseek_r1"])
    try:
        c = srv.client()
        ids = httpx.post(srv.base + "/tokenize", json={"messages": MSGS}, timeout=30).json()["tokens"]
        raw = c.completions.create(model="m", prompt=ids, max_tokens=12, temperature=0).choices[0].text
        msg = c.chat.completions.create(model="m", messages=MSGS, max_tokens=12, temperature=0).choices[0].message
        assert (msg.reasoning_content, msg.content) == split("deepseek_r1", raw) == (raw, None)
        # NOTE: the usage counts the reasoning's tokens (all 12 here), chat's and /v1/responses' (it said 0)
        usage = c.chat.completions.create(model="m", messages=MSGS, max_tokens=12, temperature=0).usage
        assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == 12
        r = c.responses.create(model="m", input="2+2?", max_output_tokens=12, temperature=0)
        assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12
        streamed = list(c.responses.create(model="m", input="2+2?", max_output_tokens=12, temperature=0, stream=True))
        assert streamed[-1].response.usage.output_tokens_details.reasoning_tokens == 12
    finally:
        assert srv.stop() == 0, srv.output()


def test_reasoning_tokens_are_counted_as_vllm_counts_them():
    """The tokens up to the one that completes </think> (a marker split over tokens, a character
    split over bytes); all of an unclosed reply that reasons; none of one that does not."""
    from numa_runtime.serve.reasoning import reasoning_tokens
    pieces = [b"<think>", b"\nAdd", b" them \xc3", b"\xa9.\n</", b"think>", b"\n\nIt", b" is 4."]
    ids = list(range(len(pieces)))
    for parser in ("deepseek_r1", "qwen3"):
        assert reasoning_tokens(parser, ids, pieces.__getitem__) == 5
        assert reasoning_tokens(parser, ids[:3], pieces.__getitem__) == 3  # NOTE: cut while reasoning
    plain = [b"It", b" is", b" 4."]
    assert reasoning_tokens("qwen3", [0, 1, 2], plain.__getitem__) == 0
    assert reasoning_tokens("deepseek_r1", [0, 1, 2], plain.__getitem__) == 3  # NOTE: its template opened <think>
    closed = [b"Add.", b"</think>", b"4"]
    assert reasoning_tokens("deepseek_r1", [0, 1, 2], closed.__getitem__) == 2
    assert reasoning_tokens("qwen3", [], plain.__getitem__) == 0
