"""Tool calling on /v1/chat/completions (serve/tools.py): the plan a request's tools and
tool_choice make, the parsers of the models' call formats, the stream's hold-back, and the
server through the official openai client."""
import functools
import json
import os
import random

import httpx
import openai
import pytest

from models import build_model
from numa_runtime.serve.tools import ToolError, ToolStream, parse, plan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


def test_the_plan_of_tools_and_tool_choice():
    assert plan(None, None, None).mode == "none"
    assert plan([WEATHER], None, "hermes").mode == "auto"  # OpenAI's default with tools
    named = plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.mode == "named" and named.schema == TIME["function"]["parameters"]
    req = plan([WEATHER, TIME], "required", None)
    assert req.schema["type"] == "array" and len(req.schema["items"]["anyOf"]) == 2
    for tools, choice, parser, msg in (
            ([WEATHER], None, None, 'tool_choice "auto" needs a server started with --enable-auto-tool-choice'),
            ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "not among the tools"),
            (None, "required", None, "tool_choice 'required' needs tools"),
            ([{"type": "function", "function": {}}], "none", None, r"tools\[0\].function.name"),
            ([{"type": "retrieval"}], "none", None, r"tools\[0\] must be"),
            ([WEATHER], "sometimes", None, "tool_choice must be"),
            ([WEATHER], {"type": "function", "function": "get_weather"}, None, "tool_choice must be"),
            ([{"type": "function", "function": {"name": "a\ud800"}}], "none", None, "lone surrogate")):
        with pytest.raises(ValueError, match=msg) as e:
            plan(tools, choice, parser)
        assert e.value.param == ("tools" if msg.startswith(("tools", "lone")) else "tool_choice")
    # "parameters": null is a function without arguments (OpenAI and vLLM take it)
    assert plan([{"type": "function", "function": {"name": "now", "parameters": None}}], "required", None).schema
    # ... and {} (MCP servers declare no arguments so), and a schema naming no type is an object's: a
    # constrained call wrote any JSON value there ('12345678903', null), and LangChain failed on it
    ping = {"type": "function", "function": {"name": "ping", "parameters": {}}}
    assert plan([ping], {"type": "function", "function": {"name": "ping"}}, None).schema == {
        "type": "object", "properties": {}}
    untyped = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}}}
    assert plan([untyped], {"type": "function", "function": {"name": "f"}}, None).schema == {
        "type": "object", "properties": {"a": {"type": "integer"}}}
    # ... combinators beside properties too ("at least one of"), and one that declares nothing takes no arguments
    one_of = {"properties": {"a": {"type": "string"}, "b": {"type": "string"}},
              "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
    either = {"type": "function", "function": {"name": "g", "parameters": one_of}}
    assert plan([either], {"type": "function", "function": {"name": "g"}}, None).schema == {"type": "object", **one_of}
    titled = {"type": "function", "function": {"name": "h", "parameters": {"title": "NoArgs"}}}
    assert plan([titled], {"type": "function", "function": {"name": "h"}}, None).schema == {
        "type": "object", "properties": {}, "title": "NoArgs"}
    # ... but one that says anything of its members stays open, as its "type": "object" form (closed, a
    # required member made it unsatisfiable, and "required" silently never called it)
    needs_a = {"type": "function", "function": {"name": "n", "parameters": {"required": ["a"]}}}
    assert plan([needs_a], {"type": "function", "function": {"name": "n"}}, None).schema == {
        "type": "object", "required": ["a"]}
    # parameters that are no object, directly or through a $ref, are refused as OpenAI refuses them
    for params in ({"type": "string"}, {"$ref": "#/$defs/S", "$defs": {"S": {"type": "string"}}}):
        with pytest.raises(ToolError, match=r"^tools\[0\].function.parameters must describe a JSON object \(a "
                                            r"function's arguments are one\), but it is of type 'string'\.$"):
            plan([{"type": "function", "function": {"name": "s", "parameters": params}}], "required", None)
    # a tool's $defs (pydantic's nested models) move to the root of the "required" schema
    nested = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}}}}}}
    req = plan([nested, WEATHER], "required", None)
    assert req.schema["$defs"] == {"Loc": nested["function"]["parameters"]["$defs"]["Loc"]}
    assert "$defs" not in req.schema["items"]["anyOf"][0]["properties"]["parameters"]
    # two functions of one name: refused (the later schema replaced the earlier one, unseen)
    with pytest.raises(ToolError, match=r"^tools\[1\] is a second function named 'get_weather'; give each tool"):
        plan([WEATHER, WEATHER], "required", None)


def test_parsers_read_the_models_call_formats():
    hermes = plan([WEATHER, TIME], "auto", "hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "C"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    content, calls = parse(hermes, text)
    assert content == "Let me check.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"unit": "C"}), ("get_time", {"zone": "UTC"})]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse(hermes, "No tools needed.") == ("No tools needed.", [])
    assert parse(hermes, "<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    llama = plan([WEATHER, TIME], "auto", "llama3_json")
    content, calls = parse(llama, '<|python_tag|>{"name": "get_weather", "parameters": {"unit": "F"}}; '
                                  '{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert parse(llama, "Hello {there}") == ("Hello {there}", [])
    # an answer that happens to hold a "name" is no call (vLLM: a call names its arguments)
    assert parse(llama, '{"name": "Bob", "age": 3}') == ('{"name": "Bob", "age": 3}', [])
    # as vLLM: any arguments value is dumped as JSON; a call without a name string is text
    odd = '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>'
    assert parse(hermes, odd)[1][0]["function"]["arguments"] == '"Paris"'
    nameless = '<tool_call>{"name": null, "arguments": {}}</tool_call>'
    assert parse(hermes, nameless) == (nameless, [])
    # parallel_tool_calls false: the first call only
    import dataclasses
    assert len(parse(dataclasses.replace(hermes, single=True), text)[1]) == 1
    req = plan([WEATHER], "required", None)
    content, calls = parse(req, '[{"name": "get_weather", "parameters": {"unit": "C"}}]')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"unit": "C"}
    named = plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert parse(named, '{"unit": "C"}')[1][0]["function"]["arguments"] == '{"unit": "C"}'
    cut = parse(named, '{"unit": ', finished_whole=False)  # cut by max_tokens: still the call, as vLLM
    assert cut[0] is None and cut[1][0]["function"] == {"name": "get_weather", "arguments": '{"unit": '}
    assert parse(req, '[{"name": "get_weather", ', finished_whole=False) == ('[{"name": "get_weather", ', [])
    # a required list cut by max_tokens gives its whole calls, as vLLM's stream has sent them (it was all text)
    two = '[{"name": "get_weather", "parameters": {"unit": "C"}}, {"name": "get_weather", "parameters": {"un'
    content, calls = parse(req, two, finished_whole=False)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"unit": "C"}]
    assert parse(req, two, finished_whole=True) == (two, [])  # NOTE: ended by itself: malformed, text
    from numa_runtime.serve.responses import ended_whole
    assert ended_whole("stop", None) and ended_whole("stop", 2)  # EOS, a stop token
    assert not ended_whole("stop", "UTC") and not ended_whole("length", None)  # a stop string, max_tokens


def test_model_text_that_json_cannot_round_trip_is_text_or_valid_arguments():
    """What json reads but cannot write back as JSON in UTF-8: nesting past its recursion limit
    (a RecursionError: a 500), a lone surrogate escape (a UnicodeEncodeError of the reply: a 500,
    a stream cut without [DONE]), NaN/Infinity and 1e999 (arguments "NaN"/"Infinity", which no
    strict parser reads). Now: text, or arguments that stay JSON and UTF-8."""
    hermes, llama = plan([WEATHER], "auto", "hermes"), plan([WEATHER], "auto", "llama3_json")
    req = plan([WEATHER], "required", None)
    deep = "[" * 3000
    for p, text in ((hermes, '<tool_call>{"name": "get_weather", "arguments": ' + deep),
                    (llama, '{"name": "get_weather", "parameters": ' + deep),
                    (req, '[{"name": "get_weather", "parameters": {"a": ' + deep)):
        assert parse(p, text) == (text, [])
    content, calls = parse(hermes, '<tool_call>{"name": "get_weather", "arguments": {"x": "\\ud83d"}}</tool_call>')
    args = calls[0]["function"]["arguments"]
    args.encode()  # NOTE: UTF-8: it raised UnicodeEncodeError
    assert json.loads(args) == {"x": "\ud83d"}
    for value in ("NaN", "Infinity", "-Infinity", "1e999"):
        text = '<tool_call>{"name": "get_weather", "arguments": {"x": %s}}</tool_call>' % value
        assert parse(hermes, text) == (text, [])
    bad_name = '<tool_call>{"name": "get_\\udc00weather", "arguments": {}}</tool_call>'
    assert parse(hermes, bad_name) == (bad_name, [])
    # NOTE: tool_choice "required" constrains the list itself: a number beyond a float's range is
    # JSON there and keeps its digits (one such number turned every call of the list into content),
    # whole and cut short; a lone surrogate escape stays escaped
    for text, whole in (('[{"name": "get_weather", "parameters": {"x": 123456789e347873, "y": 2.50}}]', True),
                        ('[{"name": "get_weather", "parameters": {"x": 123456789e347873, "y": 2.50}}, {"na', False)):
        content, calls = parse(req, text, finished_whole=whole)
        assert content is None and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
        args = calls[0]["function"]["arguments"]
        assert args == '{"x": 1.23456789E+347881, "y": 2.50}'
        assert json.loads(args, parse_float=str) == {"x": "1.23456789E+347881", "y": "2.50"}
    _, calls = parse(req, '[{"name": "get_weather", "parameters": {"x": "\\ud83d", "y": "café"}}]')
    assert calls[0]["function"]["arguments"] == '{"x": "\\ud83d", "y": "café"}'


@pytest.mark.parametrize("parser,text", [
    ("hermes", 'Sure, <tool_ca> is not a call. <tool_call>{"name": "get_weather", "arguments": {"unit": "C"}}'
               '</tool_call>'),
    ("hermes", "Just text, ending in <tool_"),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    ("llama3_json", "Plain words {with braces}"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"x": "\\ud83d"}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": ' + "[" * 3000),
])
def test_a_stream_sends_what_the_body_holds(parser, text):
    """However the text is cut into deltas, the stream's content is the body's content (nothing of
    a call leaks out as text) and its calls are the body's."""
    p = plan([WEATHER, TIME], "auto", parser)
    want_content, want_calls = parse(p, text)
    rng = random.Random(0)
    for _ in range(50):
        ts, sent, i = ToolStream(p), "", 0
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 6))
            sent += ts.feed(text[i:j])
            i = j
        rest, calls = ts.finish(True)
        assert sent + rest == (want_content or ""), (sent, rest)
        strip = lambda cs: [(c["function"]["name"], c["function"]["arguments"]) for c in cs]  # noqa: E731
        assert strip(calls) == strip(want_calls)


# ------------------------------------------------------------------ the server
TEMPLATE = ("{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tools"))
    build_model(d, arch="qwen2")
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TEMPLATE
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def _server(model_dir, *extra):
    from test_server import ServerProcess
    return ServerProcess(["--model", model_dir, "--dtype", "float32", "--served-model-name", "m",
                          "--num-threads", "1", *extra])


MSGS = [{"role": "user", "content": "Weather?"}]
KW = dict(model="m", messages=MSGS, max_tokens=120, temperature=0)


def test_named_and_required_tool_choice_return_calls(model_dir):
    srv = _server(model_dir)
    try:
        c = srv.client()
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = c.chat.completions.create(tools=[WEATHER, TIME], tool_choice=named, **KW).choices[0]
        assert r.finish_reason == "stop" and r.message.content is None
        call = r.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] in ("C", "F")
        # the stream sends the same call, whole
        chunks = list(c.chat.completions.create(tools=[WEATHER, TIME], tool_choice=named, stream=True, **KW))
        deltas = [d.choices[0].delta for d in chunks if d.choices and d.choices[0].delta.tool_calls]
        assert len(deltas) == 1 and deltas[0].tool_calls[0].function.arguments == call.function.arguments
        # NOTE: no empty chunks while the call is written (one a token went out)
        assert all(d.choices[0].delta.content or d.choices[0].delta.tool_calls or d.choices[0].finish_reason
                   or d.choices[0].delta.role for d in chunks if d.choices), chunks
        assert [d.choices[0].finish_reason for d in chunks if d.choices][-1] == "stop"
        assert not "".join(d.choices[0].delta.content or "" for d in chunks if d.choices)
        # arguments cut by max_tokens are still the forced call's, finish_reason "length" (as vLLM and
        # OpenAI; they came back as content, with no call)
        cut = c.chat.completions.create(tools=[WEATHER], tool_choice=named, **{**KW, "max_tokens": 3}).choices[0]
        assert cut.finish_reason == "length" and cut.message.content is None
        assert call.function.arguments.startswith(cut.message.tool_calls[0].function.arguments)
        chunks = list(c.chat.completions.create(tools=[WEATHER], tool_choice=named, stream=True,
                                                **{**KW, "max_tokens": 3}))
        deltas = [d.choices[0].delta for d in chunks if d.choices and d.choices[0].delta.tool_calls]
        assert deltas[0].tool_calls[0].function.arguments == cut.message.tool_calls[0].function.arguments
        assert [d.choices[0].finish_reason for d in chunks if d.choices][-1] == "length"
        # arguments cut by a stop string keep the string as stop_reason (vLLM's field), body and stream
        # (it was dropped: a client could not tell the call was cut)
        cut = c.chat.completions.create(tools=[WEATHER], tool_choice=named, stop=["unit"], **KW).choices[0]
        assert (cut.finish_reason, cut.model_extra["stop_reason"]) == ("stop", "unit")
        assert call.function.arguments.startswith(cut.message.tool_calls[0].function.arguments) and \
            "unit" not in cut.message.tool_calls[0].function.arguments
        last = [d.choices[0] for d in c.chat.completions.create(tools=[WEATHER], tool_choice=named, stop=["unit"],
                                                               stream=True, **KW) if d.choices][-1]
        assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", "unit")
        ping = {"type": "function", "function": {"name": "ping", "parameters": {}}}
        for choice in ("required", {"type": "function", "function": {"name": "ping"}}):
            got = c.chat.completions.create(tools=[ping], tool_choice=choice, **KW).choices[0].message.tool_calls
            assert [json.loads(t.function.arguments) for t in got] == [{}] * len(got) and got, got
        from test_server import metric
        status = 'numa_runtime_requests_total{status="%s"}'
        before = {k: metric(srv.base, status % k) for k in ("tool_calls", "stop")}
        r = c.chat.completions.create(tools=[WEATHER, TIME], tool_choice="required", **KW).choices[0]
        assert r.finish_reason == "tool_calls" and r.message.tool_calls
        chunks = list(c.chat.completions.create(tools=[WEATHER, TIME], tool_choice="required", stream=True, **KW))
        assert [d.choices[0].finish_reason for d in chunks if d.choices][-1] == "tool_calls"
        # NOTE: /metrics counts a request by the finish_reason its client saw (it counted these as "stop")
        assert {k: metric(srv.base, status % k) - v for k, v in before.items()} == {"tool_calls": 2, "stop": 0}
        assert {t.function.name for t in r.message.tool_calls} <= {"get_weather", "get_time"}
        r = c.chat.completions.create(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                      **KW).choices[0]
        assert len(r.message.tool_calls) == 1
        # a tool made by openai.pydantic_function_tool with a nested model ($defs) works with "required"
        nested = {"type": "function", "function": {"name": "where", "parameters": {
            "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
            "additionalProperties": False, "$defs": {"Loc": {"type": "object", "properties": {
                "city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False}}}}}
        r = c.chat.completions.create(tools=[nested], tool_choice="required", parallel_tool_calls=False,
                                      **KW).choices[0]
        assert r.message.tool_calls, (r.finish_reason, r.message.content)
        assert json.loads(r.message.tool_calls[0].function.arguments)["loc"]["city"] in ("Paris", "Rome")
        # draft-07's definitions and zod's refs into the tool's own properties (a 400: "Pointer ... does
        # not exist", where the tool now sits in the shared schema)
        legacy = {"type": "function", "function": {"name": "where", "parameters": {
            "type": "object", "properties": {"loc": {"$ref": "#/definitions/Loc"}}, "required": ["loc"],
            "definitions": {"Loc": nested["function"]["parameters"]["$defs"]["Loc"]}}}}
        zod = {"type": "function", "function": {"name": "trip", "parameters": {
            "type": "object", "properties": {"a": {"enum": ["Paris", "Rome"]}, "b": {"$ref": "#/properties/a"}},
            "required": ["a", "b"]}}}
        for tool in (legacy, zod):
            r = c.chat.completions.create(tools=[tool, WEATHER], tool_choice="required", parallel_tool_calls=False,
                                          **KW).choices[0]
            assert r.finish_reason == "tool_calls" and r.message.tool_calls, (tool, r)
            args = json.loads(r.message.tool_calls[0].function.arguments)
            if r.message.tool_calls[0].function.name == "trip":
                assert {args["a"], args["b"]} <= {"Paris", "Rome"}
        # a required list cut by max_tokens says "length" (it said "tool_calls", as if whole): its whole
        # calls come back, the cut one does not
        whole = c.chat.completions.create(tools=[WEATHER, TIME], tool_choice="required", **KW)
        assert whole.choices[0].finish_reason == "tool_calls"
        n = whole.usage.completion_tokens
        cut = next(r for m in range(n - 1, 0, -1) for r in [c.chat.completions.create(
            tools=[WEATHER, TIME], tool_choice="required", **{**KW, "max_tokens": m})]
            if r.choices[0].message.tool_calls)
        assert cut.choices[0].finish_reason == "length", cut
        chunks = list(c.chat.completions.create(tools=[WEATHER, TIME], tool_choice="required", stream=True,
                                                **{**KW, "max_tokens": cut.usage.completion_tokens}))
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
        # the renderer's own arguments are no template variables: a template sent in chat_template_kwargs
        # would run as code on the server (vLLM's CVE-2025-61620)
        for key in ("chat_template", "tools", "tokenize"):
            with pytest.raises(openai.BadRequestError, match=f"chat_template_kwargs cannot set '{key}'"):
                c.chat.completions.create(**KW, extra_body={"chat_template_kwargs": {key: "{{ 1 }}"}})
        # any role the template takes (Llama 3's ipython, the legacy function role), as vLLM
        r = c.chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": "x"}, {"role": "ipython", "content": "42"}])
        assert r.usage.prompt_tokens > 0
        import httpx
        count = [httpx.post(srv.base + "/tokenize", json={"messages": MSGS, **extra}, timeout=30).json()["count"]
                 for extra in ({}, {"tools": [WEATHER, TIME]})]
        assert count[1] > count[0]  # /tokenize renders the tools too, checked as chat checks them
        r = httpx.post(srv.base + "/tokenize", json={"messages": MSGS, "tools": [{"type": "function"}]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        # the template saw the tools
        plain = c.chat.completions.create(**{**KW, "max_tokens": 1})
        with_tools = c.chat.completions.create(tools=[WEATHER, TIME], tool_choice="none", **{**KW, "max_tokens": 1})
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="needs a server started with --enable-auto-tool-choice"):
            c.chat.completions.create(tools=[WEATHER], **KW)
        with pytest.raises(openai.BadRequestError, match=r"^Error code: 400 - .*guided_json cannot be combined with a "
                                                          "tool_choice that calls a function"):
            c.chat.completions.create(tools=[WEATHER], tool_choice={"type": "function", "function": {
                "name": "get_weather"}}, extra_body={"guided_json": {"type": "object"}}, **KW)
        with pytest.raises(openai.BadRequestError, match="not among the tools"):
            c.chat.completions.create(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}},
                                      **KW)
        # NOTE: an unusable tool schema names tools, the field it came from (the sentence said json_schema)
        bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "objekt"}}}}}
        with pytest.raises(openai.BadRequestError, match="tools cannot be used: Invalid type") as e:
            c.chat.completions.create(tools=[bad], tool_choice={"type": "function", "function": {"name": "f"}}, **KW)
        assert e.value.param == "tools"
        # NOTE: parameters that are no object are said so before the grammar (OpenAI refuses them too)
        bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
        with pytest.raises(openai.BadRequestError, match="must describe a JSON object .* of type 'objekt'") as e:
            c.chat.completions.create(tools=[bad], tool_choice={"type": "function", "function": {"name": "f"}}, **KW)
        assert e.value.param == "tools"
    finally:
        assert srv.stop() == 0, srv.output()


def test_auto_tool_choice_with_a_parser(model_dir):
    """With --enable-auto-tool-choice the model may answer in text (a random model does): the text
    is the content, streamed as in the body."""
    srv = _server(model_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        c = srv.client()
        kw = dict(tools=[WEATHER], **{**KW, "max_tokens": 24}, extra_body={"ignore_eos": True})
        body = c.chat.completions.create(**kw).choices[0]
        assert body.finish_reason == "length" and body.message.tool_calls is None and body.message.content
        streamed = "".join(d.choices[0].delta.content or "" for d in c.chat.completions.create(stream=True, **kw)
                           if d.choices)
        assert streamed == body.message.content
    finally:
        assert srv.stop() == 0, srv.output()


def test_tool_flags_are_checked_before_loading():
    import subprocess
    import sys
    for flags, msg in ((["--enable-auto-tool-choice"], "needs --tool-call-parser"),
                       (["--tool-call-parser", "hermes"], "needs --enable-auto-tool-choice")):
        p = subprocess.run([sys.executable, "-m", "numa_runtime.serve", "--model", "/nonexistent", *flags],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and msg in p.stderr, p.stderr[-2000:]


def test_strict_function_allows_no_undeclared_argument():
    """OpenAI's function.strict: the arguments follow the schema exactly (as response_format's
    strict): a named or "required" tool_choice constrains with additionalProperties false; a
    weak model filled max_tokens with made-up keys."""
    params = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}
    tools = [{"type": "function", "function": {"name": "get_time", "strict": True, "parameters": params}},
             {"type": "function", "function": {"name": "loose", "parameters": params}}]
    named = plan(tools, {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.schema["additionalProperties"] is False and "additionalProperties" not in params
    assert "additionalProperties" not in plan(tools, {"type": "function", "function": {"name": "loose"}}, None).schema
    calls = plan(tools, "required", None).schema["items"]["anyOf"]
    assert [c["properties"]["parameters"].get("additionalProperties") for c in calls] == [False, None]



def test_responses_api_over_the_chat_path(model_dir):
    """POST /v1/responses (OpenAI's Responses API, which vLLM serves) through the openai client:
    the answer is the chat path's (same text, usage, finish as status), streamed as Responses
    events whose text joins to it; a named function tool gives a function_call item; the tool's
    output sent back as input items renders as chat's tool messages; what the server cannot do
    (conversations, background, non-function tools, image parts) is one sentence. It was a bare 404."""
    srv = _server(model_dir)
    try:
        c = srv.client()
        chat = c.chat.completions.create(model="m", messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hello"}],
                                         max_tokens=12, temperature=0)
        r = c.responses.create(model="m", instructions="Be brief.", input="Hello", max_output_tokens=12,
                               temperature=0)
        assert r.object == "response" and r.output_text == chat.choices[0].message.content
        assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
        assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
        assert r.output[0].type == "message" and r.output[0].role == "assistant"
        # the same as a message list of text parts
        r2 = c.responses.create(model="m", input=[
            {"role": "system", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
            max_output_tokens=12, temperature=0)
        assert r2.output_text == r.output_text
        # an OpenAI output's refusal part, replayed as input, is its text, here and on chat (both were 400s)
        said = [{"role": "user", "content": "Hello"}]
        as_text = said + [{"role": "assistant", "content": [{"type": "output_text", "text": "No."}]}]
        refused = said + [{"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}]
        kw = dict(model="m", max_output_tokens=4, temperature=0)
        assert c.responses.create(input=refused, **kw).output_text == c.responses.create(input=as_text, **kw).output_text
        chat_kw = dict(model="m", max_tokens=4, temperature=0)
        assert c.chat.completions.create(messages=said + [{"role": "assistant", "content": [
            {"type": "refusal", "refusal": "No."}]}], **chat_kw).usage.prompt_tokens == c.chat.completions.create(
            messages=said + [{"role": "assistant", "content": [{"type": "text", "text": "No."}]}],
            **chat_kw).usage.prompt_tokens
        # streamed: the events in order, the deltas joining to the text, the final response whole
        events = list(c.responses.create(model="m", instructions="Be brief.", input="Hello", max_output_tokens=12,
                                         temperature=0, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-1] == ("response.incomplete" if r.status == "incomplete" else "response.completed")
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].response.output_text == r.output_text and events[-1].response.usage.output_tokens == \
            r.usage.output_tokens
        # NOTE: the client's stream helper rebuilds the response from the events (it checks their order
        # and identities); the tiny model runs to max_output_tokens: response.incomplete, as OpenAI's
        with c.responses.stream(model="m", input="Hello", max_output_tokens=8, temperature=0) as s:
            last = list(s)[-1]
        plain = c.responses.create(model="m", input="Hello", max_output_tokens=8, temperature=0)
        assert last.type == f"response.{plain.status}" and last.response.output_text == plain.output_text
        # NOTE: tool_choice "auto" is the Responses API's default, and agent loops send it with no tools
        # (it was a 400 "needs tools"); "required" without tools stays one
        auto = c.responses.create(model="m", input="Hello", max_output_tokens=8, temperature=0, tool_choice="auto",
                                  tools=[])
        assert auto.output_text == plain.output_text and auto.tool_choice == "auto"
        with pytest.raises(openai.BadRequestError, match="tool_choice 'required' needs tools"):
            c.responses.create(model="m", input="Hello", max_output_tokens=8, tool_choice="required")
        # a function tool: a function_call item, then its output back as input items
        tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": WEATHER["function"]["parameters"]}
        fc = c.responses.create(model="m", input="Weather?", tools=[tool], max_output_tokens=120, temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"})
        call = [o for o in fc.output if o.type == "function_call"][0]
        assert call.name == "get_weather" and json.loads(call.arguments)["unit"] in ("C", "F")
        streamed = list(c.responses.create(model="m", input="Weather?", tools=[tool], max_output_tokens=120,
                                           temperature=0, stream=True,
                                           tool_choice={"type": "function", "name": "get_weather"}))
        done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].arguments == call.arguments
        follow = c.responses.create(model="m", tools=[tool], tool_choice="none", max_output_tokens=4, temperature=0,
                                    input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "20C"}])
        back = c.chat.completions.create(model="m", tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0,
                                         messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                     "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "20C"}])
        assert follow.usage.input_tokens == back.usage.prompt_tokens
        assert follow.output_text == (back.choices[0].message.content or "")
        for kw, match in (({"conversation": "conv_1"}, "conversation is not supported"),
                          ({"background": True}, "Background responses"),
                          ({"tools": [{"type": "web_search"}]}, "Only function tools are supported"),
                          ({"tools": [tool, WEATHER]}, r"[Tt]ools\[1\] has the Chat Completions shape"),
                          ({"tools": [{"type": "function", "name": ""}]}, r"[Tt]ools\[0\]\.name must be a non-empty"),
                          ({"max_output_tokens": 0}, "max_output_tokens must be an integer of at least 1"),
                          ({"max_output_tokens": "5"}, "'max_output_tokens'"),
                          ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectt"}}}},
                           "text.format cannot be used"),
                          ({"max_output_tokens": 100000}, r"plus max_output_tokens \(100000\) exceeds"),
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                           "only text parts")):
            with pytest.raises(openai.BadRequestError, match=match):
                c.responses.create(**{"model": "m", "input": "Hello", **kw})
        # NOTE: the error's param is the Responses request's field (it was chat's, or null)
        for kw, param in (({"max_output_tokens": 100000}, "max_output_tokens"), ({"metadata": {"a": 5}}, "metadata"),
                          ({"text": {"format": "json_object"}}, "text.format")):
            res = httpx.post(srv.base + "/v1/responses", json={"model": "m", "input": "Hello", **kw}, timeout=60)
            assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text
        schema = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
        for stream in (False, True):
            res = httpx.post(srv.base + "/v1/responses", json={"model": "m", "input": "Hello", "stream": stream,
                                                               "text": {"format": {"type": "json_schema", "name": "s",
                                                                                   "schema": schema}}}, timeout=60)
            assert '"param": "text.format"' in res.text.replace('":"', '": "'), res.text
    finally:
        assert srv.stop() == 0, srv.output()


def test_a_stored_turn_of_text_and_calls_is_one_assistant_message():
    """A response whose output is a message and a function call goes back into the next turn as
    one assistant message with both (it became two assistant turns the model never wrote), and
    its input items are stored as OpenAI's items (typed messages of text parts, with a status)."""
    from numa_runtime.serve import responses_api as RA
    st = RA.ResponseStore()
    raw = {"input": [{"role": "user", "content": "Weather in Paris?"},
                     {"type": "message", "role": "assistant", "content": "Earlier answer."}]}
    st.keep(raw, {"id": "resp_1", "output": [
        {"type": "message", "id": "m", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "id": "fc", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"}]})
    msgs = RA.chat_request({"model": "m", "previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}, st)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "assistant", "tool"]
    turn = msgs[2]
    assert turn["content"] == [{"type": "text", "text": "Let me check."}]
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["get_weather"]
    # NOTE: a reasoning item before a call stays with it: that call starts its own assistant message
    msgs = RA.chat_request({"model": "m", "input": [
        {"role": "user", "content": "weather?"}, {"type": "message", "role": "assistant", "content": "Let me look."},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "need get_weather"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "assistant", "tool"]
    assert msgs[2]["reasoning"] == "need get_weather" and msgs[2]["tool_calls"][0]["id"] == "c1"
    assert "reasoning" not in msgs[1] and "tool_calls" not in msgs[1]
    # NOTE: the key the server keeps a request's previous response under is its own: a client that sends it
    # stores nothing odd (a later continuation of that response was a 500)
    sent = {"model": "m", "input": "hi", RA._PARENT: "gotcha"}
    RA.chat_request(sent, st)
    assert RA._PARENT not in sent
    st.keep(sent, {"id": "resp_2", "output": []})
    assert st.get("resp_2").parent is None
    assert RA.chat_request({"model": "m", "previous_response_id": "resp_2", "input": "more"}, st)["messages"]
    items = st.get("resp_1").items
    assert items == [{"type": "message", "role": "user", "status": "completed",
                      "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                     {"type": "message", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": "Earlier answer."}]}]


def test_a_stored_chain_outlives_its_earlier_responses_in_the_store():
    """The store keeps the newest `limit` responses, one used as a previous response counting as
    new again; a response pushed out (or deleted) stays readable through the responses that
    continued it (a chain whose first turn was pushed out was a 404 naming an id the client never
    sent)."""
    from numa_runtime.serve import responses_api as RA
    msg = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]
    st = RA.ResponseStore(limit=3)
    st.keep({"input": "one"}, {"id": "r1", "output": msg})
    req = {"model": "m", "previous_response_id": "r1", "input": "two"}
    RA.chat_request(req, st)
    st.keep(req, {"id": "r2", "output": msg})
    st.keep({"input": "x"}, {"id": "x0", "output": msg})
    RA.chat_request({"model": "m", "previous_response_id": "r2", "input": "three"}, st)  # NOTE: r2 used: newest
    st.keep({"input": "y"}, {"id": "x1", "output": msg})
    with pytest.raises(RA.NotStored):
        st.get("r1")  # NOTE: pushed out, but r2 still holds it
    messages = RA.chat_request({"model": "m", "previous_response_id": "r2", "input": "three"}, st)["messages"]
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", [{"type": "text", "text": "one"}]), ("assistant", [{"type": "text", "text": "ok"}]),
        ("user", [{"type": "text", "text": "two"}]), ("assistant", [{"type": "text", "text": "ok"}]),
        ("user", [{"type": "text", "text": "three"}])]


def test_stored_responses_continue_a_conversation(model_dir):
    """OpenAI's default store: a response is kept, so previous_response_id continues its
    conversation (the chain's input and output before the new input, the old instructions not
    carried over: the chat of those messages), retrieve/delete/input_items read it, store=false
    keeps none, and an id the server does not hold is a 404 naming it (both were refused)."""
    srv = _server(model_dir)
    try:
        c = srv.client()
        kw = dict(model="m", max_output_tokens=6, temperature=0)
        r1 = c.responses.create(instructions="Be brief.", input="Hello", **kw)
        assert r1.store is True and r1.previous_response_id is None
        r2 = c.responses.create(previous_response_id=r1.id, input="And again?", **kw)
        assert r2.previous_response_id == r1.id
        turns = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": r1.output_text},
                 {"role": "user", "content": "And again?"}]
        chat = c.chat.completions.create(model="m", messages=turns, max_tokens=6, temperature=0)
        assert r2.output_text == chat.choices[0].message.content
        assert r2.usage.input_tokens == chat.usage.prompt_tokens
        # streamed, two links back: the final response is stored too
        events = list(c.responses.create(previous_response_id=r2.id, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Once more."}]}], stream=True, **kw))
        last = events[-1].response
        chat3 = c.chat.completions.create(model="m", max_tokens=6, temperature=0, messages=turns + [
            {"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "Once more."}])
        assert last.output_text == chat3.choices[0].message.content
        assert last.usage.input_tokens == chat3.usage.prompt_tokens
        assert c.responses.retrieve(last.id).output_text == last.output_text
        assert c.responses.retrieve(r1.id).model_dump() == r1.model_dump()
        items = c.responses.input_items.list(r2.id)
        assert [i.content[0].text for i in items.data] == ["And again?"] and not items.has_more
        assert items.data[0].type == "message" and items.data[0].status == "completed"
        assert not c.responses.input_items.list(r2.id, after=items.data[0].id).data
        with pytest.raises(openai.BadRequestError, match="after names no input item of response"):
            c.responses.input_items.list(r2.id, after="item_nope")  # NOTE: it gave the first page again
        assert r1.usage.input_tokens_details.cache_write_tokens == (
            r1.usage.input_tokens - r1.usage.input_tokens_details.cached_tokens)
        assert c.responses.delete(r1.id) is None
        with pytest.raises(openai.NotFoundError, match=f"Response '{r1.id}' is not stored"):
            c.responses.retrieve(r1.id)
        # NOTE: r2 goes on without r1 in the store: its chain is kept whole (a 404 named r1 before)
        after = c.responses.create(previous_response_id=r2.id, input="Hi", **kw)
        whole = c.chat.completions.create(model="m", max_tokens=6, temperature=0, messages=turns + [
            {"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "Hi"}])
        assert after.usage.input_tokens == whole.usage.prompt_tokens
        gone = c.responses.create(input="Hello", store=False, **kw)
        assert gone.store is False
        with pytest.raises(openai.NotFoundError, match="is not stored"):
            c.responses.retrieve(gone.id)
        with pytest.raises(openai.NotFoundError, match="'resp_nope' is not stored"):
            c.responses.create(previous_response_id="resp_nope", input="Hi", **kw)
    finally:
        assert srv.stop() == 0, srv.output()


def _responses_events(chunks, raw=None):
    """The Responses events (as parsed dicts) of chat chunks, through responses_api.events."""
    import asyncio
    from numa_runtime.serve import responses_api as RA

    async def chat_stream():
        for c in chunks:
            yield "data: " + json.dumps(c) + "\n\n"
        yield "data: [DONE]\n\n"

    async def collect():
        return [e async for e in RA.events(raw or {"input": "x"}, "m", chat_stream())]
    out = []
    for e in asyncio.run(collect()):
        assert not {"\u2028", "\u2029", "\x85"} & set(e)  # NOTE: splitlines readers would cut the line there
        head, data = e.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ") and e.endswith("\n\n")
        out.append(json.loads(data[len("data: "):]))
        assert out[-1]["type"] == head[len("event: "):]
    return out


def test_responses_events_of_reasoning_text_and_calls_rebuild_in_the_openai_client():
    """A chat stream of reasoning, then text, then two tool calls (one in two argument pieces) and
    its usage becomes Responses events that the official client's stream state (the
    `responses.stream()` helper's) rebuilds into the response we send last: items in order,
    sequence numbers 0.., each item added before its deltas and done after them."""
    from openai._models import construct_type_unchecked
    from openai._types import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent
    chunk = lambda delta, finish=None: {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # noqa: E731
    chunks = [chunk({"role": "assistant"}), chunk({"reasoning_content": "Let me "}),
              chunk({"reasoning_content": "think."}), chunk({"content": "It is "}), chunk({"content": "sunny."}),
              chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"unit": '}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"C"}'}}]}),
              chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                     "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}),
              chunk({}, "tool_calls"),
              {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 11, "total_tokens": 18}}]
    events = _responses_events(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=e))
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["status"] == "completed"
    rebuilt = state._completed_response
    assert [o.type for o in rebuilt.output] == ["reasoning", "message", "function_call", "function_call"]
    assert rebuilt.output_text == "It is sunny." and rebuilt.output[1].content[0].text == "It is sunny."
    assert rebuilt.output[0].content[0].text == "Let me think."
    assert [(o.call_id, o.name, o.arguments) for o in rebuilt.output[2:]] == [
        ("call_a", "get_weather", '{"unit": "C"}'), ("call_b", "get_time", '{"zone": "UTC"}')]
    assert rebuilt.usage.input_tokens == 7 and rebuilt.usage.output_tokens == 11 and rebuilt.usage.total_tokens == 18
    kinds = [e["type"] for e in events]
    spans = []
    for item in final["response"]["output"]:
        mine = [i for i, e in enumerate(events) if e.get("item_id") == item["id"] or
                (e.get("item") or {}).get("id") == item["id"]]
        assert kinds[mine[0]] == "response.output_item.added" and kinds[mine[-1]] == "response.output_item.done"
        spans.append((mine[0], mine[-1]))
    # NOTE: one item at a time, as OpenAI streams them (the second call was added before the first was done)
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), spans
    odd = _responses_events([chunk({"content": "a\u2028b\u2029c\x85d"}), chunk({}, "stop")])
    assert odd[-1]["response"]["output"][0]["content"][0]["text"] == "a\u2028b\u2029c\x85d"
    # cut by max_output_tokens: response.incomplete, the message item incomplete
    cut = _responses_events([chunk({"content": "It is"}), chunk({}, "length")])
    assert cut[-1]["type"] == "response.incomplete" and cut[-1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"}
    assert cut[-1]["response"]["output"][0]["status"] == "incomplete"
    # a call cut by max_output_tokens is the item left incomplete (its arguments are no whole JSON)
    cut_call = _responses_events([chunk({"content": "Sure."}), chunk({"tool_calls": [
        {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}]}),
        chunk({}, "length")])
    assert [o["status"] for o in cut_call[-1]["response"]["output"]] == ["completed", "incomplete"]
    # an error event of the chat stream: the Responses error event, then response.failed
    failed = _responses_events([chunk({"content": "It"}), {"error": {"message": "The server is shutting down.",
                                                                     "code": "shutting_down"}}])
    assert [e["type"] for e in failed[-2:]] == ["error", "response.failed"]
    assert failed[-1]["response"]["error"]["message"] == "The server is shutting down."


def test_a_streamed_response_is_stored_from_its_announcement():
    """A streamed response is stored as response.created announces it (in_progress, its output
    growing): it can be read, continuing it is refused until it ends, and a DELETE in between
    holds (it was stored at the end only: a 404 until then, and stored after the DELETE). A stream
    the client leaves is stored cancelled; a failed one, failed."""
    import asyncio

    from numa_runtime.serve import responses_api as RA
    chunk = lambda delta, finish=None: {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # noqa: E731

    def run(raw, chunks, until=None, delete=False, st=None, meanwhile=None):
        """Store `raw`'s streamed response; read `until` events, then (delete it and) end or leave;
        `meanwhile(store, id)` runs there too. A chunk that is an exception is raised."""
        st = st or RA.ResponseStore()

        async def chat_stream():
            for c in chunks:
                if isinstance(c, Exception):
                    raise c
                yield "data: " + json.dumps(c) + "\n\n"

        async def go():
            gen = RA.events(raw, "m", chat_stream(), functools.partial(st.keep, raw), None,
                            functools.partial(st.begin, raw))
            seen = []
            try:
                async for e in gen:
                    seen.append(json.loads(e.split("data: ", 1)[1]))
                    if len(seen) != until:
                        continue
                    rid = seen[0]["response"]["id"]
                    mid = st.get(rid).resp
                    assert mid["status"] == "in_progress" and mid["output"][0]["content"][0]["text"] == "It "
                    with pytest.raises(ValueError, match=f"previous_response_id '{rid}' is still in progress"):
                        RA.chat_request({"model": "m", "previous_response_id": rid, "input": "x"}, st)
                    if delete:
                        st.delete(rid)
                    if meanwhile is not None:
                        meanwhile(st, rid)
                    if not delete and meanwhile is None:
                        await gen.aclose()  # NOTE: the client went away
                        break
            except KeyError:
                pass  # NOTE: the chat stream's own failure, raised on
            return seen
        return st, asyncio.run(go())
    text = [chunk({"content": "It "}), chunk({"content": "is "}), chunk({"content": "sunny."}), chunk({}, "stop")]
    st, seen = run({"input": "x"}, text, until=4, delete=True)
    assert seen[-1]["type"] == "response.completed"
    with pytest.raises(RA.NotStored):
        st.get(seen[0]["response"]["id"])
    st, seen = run({"input": "x"}, text, until=4)
    left = st.get(seen[0]["response"]["id"]).resp
    assert left["status"] == "cancelled" and left["output"][0]["status"] == "incomplete"
    st, seen = run({"input": "x"}, [chunk({"content": "It "}), {"error": {"message": "gone", "code": "x"}}])
    assert st.get(seen[0]["response"]["id"]).resp["status"] == "failed"
    st, seen = run({"input": "x"}, text)
    assert st.get(seen[0]["response"]["id"]).resp["status"] == "completed"
    # a chat stream that raises: failed, not cancelled (the client did not leave)
    st, seen = run({"input": "x"}, [chunk({"content": "It "}), KeyError("boom")])
    assert st.get(seen[0]["response"]["id"]).resp["status"] == "failed"
    # a new response under a deleted stream's id is stored, and the stream's end does not bring it back
    fresh = {"id": "resp_x", "output": [], "status": "completed"}
    st, seen = run({"input": "x", "request_id": "x"}, text, until=4, delete=True,
                   meanwhile=lambda store, rid: store.keep({"input": "new"}, fresh))
    assert st.get("resp_x").resp is fresh
    # pushed out of the store while in progress: stored at its end all the same, as the newest
    small = RA.ResponseStore(limit=2)
    st, seen = run({"input": "x"}, text, until=4, st=small, meanwhile=lambda store, rid: [
        store.keep({"input": "y"}, {"id": f"r{i}", "output": []}) for i in range(2)])
    assert small.get(seen[0]["response"]["id"]).resp["status"] == "completed"
    # an id reserved by a request under way is refused to a second one until it ends
    assert small.reserve("resp_q") and not small.reserve("resp_q") and not small.reserve("r1")
    small.keep({"input": "q"}, {"id": "resp_q", "output": []})
    assert not small.reserve("resp_q")  # NOTE: now stored
    small.release("resp_z")


def test_responses_errors_name_their_field_and_reads_take_no_options(model_dir):
    """A Responses field's error kept the field's spelling and named it as param (Input[0].content,
    param null); store must be a boolean (0 was stored as true); a request_id already naming a
    stored response is refused (it replaced it); GET takes no stream (the client's empty stream)."""
    srv = _server(model_dir)
    try:
        c = srv.client()
        kw = dict(model="m", max_output_tokens=2, temperature=0)
        for kwargs, message, param in (
                (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                 "input[0].content: only text parts", "input[0].content"),
                # NOTE: a known part with a bad value said its type was not supported
                (dict(input=[{"role": "assistant", "content": [{"type": "refusal", "refusal": None}]}]),
                 "input[0].content: a refusal part needs its 'refusal' as a string, got None.", "input[0].content"),
                (dict(input="x", tools=[{"type": "function", "function": {"name": "f"}}]),
                 "tools[0] has the Chat Completions shape", "tools[0]"),
                (dict(input="x", store=0), "store must be true or false.", "store")):
            with pytest.raises(openai.BadRequestError) as e:
                c.responses.create(**kw, **kwargs)
            assert e.value.body["message"].startswith(message) and e.value.body["param"] == param, e.value.body
        first = c.responses.create(input="Hi", extra_body={"request_id": "twice"}, **kw)
        with pytest.raises(openai.BadRequestError, match="request_id 'twice' is the id of a stored response"):
            c.responses.create(input="Hi again", extra_body={"request_id": "twice"}, **kw)
        assert c.responses.retrieve("resp_twice").output_text == first.output_text
        with pytest.raises(openai.BadRequestError, match="stream=true is not supported when reading a stored "
                                                         "response"):
            list(c.responses.retrieve("resp_twice", stream=True))
        assert c.responses.retrieve("resp_twice", stream=False).id == "resp_twice"  # NOTE: the default, asked
    finally:
        assert srv.stop() == 0, srv.output()


def test_responses_body_of_a_chat_answer():
    """A non-streamed chat answer with reasoning, text and a call: reasoning, message and
    function_call items in that order; finish 'length' is status incomplete."""
    from numa_runtime.serve import responses_api as RA
    call = {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat = {"model": "m", "created": 5, "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "Sure.", "reasoning_content": "Hmm.", "tool_calls": [call]}}]}
    r = RA.response_body({"input": "x", "metadata": {"k": "v"}}, chat)
    assert [o["type"] for o in r["output"]] == ["reasoning", "message", "function_call"]
    assert r["output"][0]["content"][0]["text"] == "Hmm." and r["output"][1]["content"][0]["text"] == "Sure."
    assert (r["output"][2]["call_id"], r["output"][2]["name"]) == ("call_a", "f")
    assert r["status"] == "completed" and r["metadata"] == {"k": "v"} and r["usage"]["total_tokens"] == 7
    chat["choices"][0]["finish_reason"] = "length"
    assert RA.response_body({"input": "x"}, chat)["incomplete_details"] == {"reason": "max_output_tokens"}
    # the reasoning effort and the sampling values as used echo back (null each, as if ignored)
    r = RA.response_body({"input": "x", "reasoning": {"effort": "high"}, "top_p": 0.5}, chat, {"temperature": 0.7})
    assert (r["reasoning"], r["temperature"], r["top_p"]) == ({"effort": "high", "summary": None}, 0.7, 0.5)
    assert (r := RA.response_body({"input": "x"}, chat))["reasoning"] is None and r["temperature"] == r["top_p"] == 1.0
    # input items: a reasoning item goes with the assistant turn after it; function calls group
    body = RA.chat_request({"input": [
        {"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"}], "instructions": "be brief"})
    msgs = body["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert msgs[2]["reasoning"] == "think" and [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    for bad, match in (({"input": [{"type": "item_reference", "id": "x"}]}, "items of type 'item_reference'"),
                       ({"input": "x", "n": 2}, "n must be 1"),
                       ({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary is not"),
                       ({"input": "x", "reasoning": "low"}, "reasoning must be an object"),
                       ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type must be"),
                       ({}, "input is required"),
                       ({"input": 5}, "input must be a string or a list, got int"),
                       ({"input": [{"role": "user", "content": 5}]}, r"input\[0\].content must be a string or a list"),
                       ({"input": "x", "tools": {}}, "tools must be a list, got dict"),
                       # NOTE: each of these was a 500, accepted, or a schema dropped for "any JSON"
                       ({"input": "x", "text": {"format": "json_object"}}, "^text.format must be an object"),
                       ({"input": "x", "text": {"format": {"type": "json_schema", "json_schema": {
                           "name": "a", "schema": {}}}}}, r"^text.format.schema is required: .* not under json_schema"),
                       ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
                        r"^text.format.name must be a string \(required"),
                       ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
                        "^text.format.schema must be a JSON schema object"),
                       ({"input": "x", "metadata": "x"}, "^metadata must be an object of at most 16"),
                       ({"input": "x", "metadata": {"a": 5}}, "^metadata values must be strings"),
                       ({"input": "x", "metadata": {"k" * 65: "v"}}, "^metadata values must be strings"),
                       ({"input": "x", "metadata": {"a": "\udc00"}}, "^metadata must be valid Unicode text"),
                       ({"input": "x", "user": "\udc00"}, "^user must be valid Unicode text"),
                       ({"input": [{"role": "user", "content": "x", "id": "\udc00"}]}, "^input must be valid Unicode"),
                       ({"input": [{"role": "user"}]}, r"^input\[0\].content is required"),
                       ({"input": [{"type": "function_call_output", "output": "1"}]},
                        r"^input\[0\].call_id is required"),
                       ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
                        r"^input\[0\].call_id is required"),
                       ({"input": [{"type": "reasoning", "content": 5}, {"role": "user", "content": "x"}]},
                        r"^input\[0\].content must be a list")):
        with pytest.raises(ValueError, match=match):
            RA.chat_request(bad)
    assert RA.chat_request({"input": "x", "reasoning": {"effort": None, "summary": None}})["messages"]  # no options
    # a reasoning item with no assistant turn right after it (a turn cut while reasoning) is an assistant turn
    # of its own (it was dropped: a chain went on with two user turns in a row, which alternating templates refuse)
    think = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}]}
    msgs = RA.chat_request({"input": [
        {"role": "user", "content": "q"}, think,
        {"role": "user", "content": "never mind"}, {"role": "assistant", "content": "Hi!"}]})["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"] and "reasoning" not in msgs[3]
    assert msgs[1] == {"role": "assistant", "content": "", "reasoning": "t"}
    for tail in ([think], [think, {"type": "function_call_output", "call_id": "c", "output": "1"}]):
        msgs = RA.chat_request({"input": [{"role": "user", "content": "q"}, *tail]})["messages"]
        assert msgs[1] == {"role": "assistant", "content": "", "reasoning": "t"}, msgs
