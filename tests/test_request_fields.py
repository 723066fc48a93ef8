"""Every request field is honoured or refused by name: fields of the OpenAI and vLLM APIs that the
server accepted and then dropped (a log line at most) now do what they say or get a 400. Driven by
the official client against a real server."""
from __future__ import annotations

import base64
import signal

import httpx
import numpy as np
import openai
import pytest

from test_server import ServerProcess, tiny_model_dir

# NOTE: a template that shows whether reasoning_effort reached it
TEMPLATE = ("{% if reasoning_effort is defined %}EFFORT={{ reasoning_effort }}\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MSGS = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "effort.jinja"
    template.write_text(TEMPLATE)
    srv = ServerProcess(["--model", tiny_model_dir(tmp_path_factory), "--dtype", "float32", "--max-model-len", "256",
                         "--served-model-name", "tiny", "--num-threads", "1", "--chat-template", str(template)])
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _bad(fn, match: str):
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    assert e.value.status_code == 400
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    assert match in message or match[:1].upper() + match[1:] in message, message  # NOTE: a sentence's capital
    return message


def _tokens(server, **body) -> list[str]:
    r = httpx.post(server.base + "/tokenize", json={"messages": MSGS, "return_token_strs": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["token_strs"]


def test_reasoning_effort_reaches_the_chat_template(server, client):
    """reasoning_effort (chat, /tokenize) and reasoning.effort (/v1/responses) render in the template, as
    vLLM passes it; chat_template_kwargs wins; a value outside OpenAI's is a 400. It was dropped."""
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, temperature=0)
    low = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, temperature=0,
                                         reasoning_effort="low")
    assert low.usage.prompt_tokens > plain.usage.prompt_tokens
    assert "".join(_tokens(server, reasoning_effort="low")).startswith("EFFORT=low")
    assert "EFFORT" not in "".join(_tokens(server))
    kw = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, temperature=0,
                                        extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
    both = httpx.post(server.base + "/tokenize", json={"messages": MSGS, "return_token_strs": True,
                                                       "reasoning_effort": "high",
                                                       "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert "".join(both.json()["token_strs"]).startswith("EFFORT=low")
    assert kw.usage.prompt_tokens == low.usage.prompt_tokens
    resp = client.responses.create(model="tiny", input="Hello there", max_output_tokens=1, temperature=0,
                                   reasoning={"effort": "low"})
    again = client.responses.create(model="tiny", input="Hello there", max_output_tokens=1, temperature=0)
    assert resp.usage.input_tokens == low.usage.prompt_tokens and again.usage.input_tokens == plain.usage.prompt_tokens
    # NOTE: any short string, as the client's type grows ("xhigh", "max"): the template reads the value
    xhigh = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, temperature=0,
                                           extra_body={"reasoning_effort": "max"})
    assert xhigh.usage.prompt_tokens > plain.usage.prompt_tokens
    _bad(lambda: client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1,
                                                extra_body={"reasoning_effort": "x" * 33}), "reasoning_effort")
    _bad(lambda: client.responses.create(model="tiny", input="x", reasoning={"effort": 5}), "reasoning.effort")
    _bad(lambda: client.responses.create(model="tiny", input="x", reasoning={"effort": "low", "summary": "auto"}),
         "reasoning.summary is not supported")


@pytest.mark.parametrize("field, value, says", [
    ("modalities", ["text", "audio"], 'modalities ["text", "audio"] is not supported by this server; it takes '
                                      '["text"] (or leave it out).'),
    ("service_tier", "flex", 'service_tier "flex" is not supported by this server; it takes "auto" or "default" '
                             "(or leave it out)."),
    ("verbosity", "low", 'verbosity "low" is not supported by this server; it takes "medium" (or leave it out).'),
    ("store", True, "store true is not supported by this server; it takes false (or leave it out).")])
def test_openai_chat_fields_that_would_change_the_answer_are_refused(client, field, value, says):
    """A field refused only for some values names the value and those it takes."""
    assert _bad(lambda: client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1,
                                                       extra_body={field: value}), field) == says


def test_openai_chat_fields_with_nothing_to_do_are_accepted(client):
    """Their no-op values, and the hints that change no answer (metadata with nothing stored,
    prompt_cache_key, safety_identifier), as `user`."""
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0)
    same = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0,
                                          service_tier="auto", store=False, metadata={"k": "v", "headers": {"a": 1}},
                                          extra_body={"modalities": ["text"], "verbosity": "medium",
                                                      "prompt_cache_key": "k", "safety_identifier": "s"})
    assert same.choices[0].message.content == plain.choices[0].message.content
    streamed = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, stream=True,
                                              stream_options={"include_usage": True, "include_obfuscation": False})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain.choices[0].message.content


@pytest.mark.parametrize("field, value", [("structural_tag", "{}"), ("truncation_side", "right"),
                                          ("logprob_token_ids", [5]), ("prompt_embeds", "AAAA"),
                                          ("thinking_token_budget", 10), ("stream_interval", 4),
                                          ("kv_transfer_params", {"a": 1}), ("mm_processor_kwargs", {"a": 1})])
def test_vllm_fields_this_server_does_not_run_are_refused(client, field, value):
    _bad(lambda: client.completions.create(model="tiny", prompt="Hello", max_tokens=1,
                                           extra_body={field: value}),
         {"truncation_side": 'truncation_side "right" is not supported by this server; it takes "left" (or leave it out).',
          "stream_interval": "stream_interval 4 is not supported by this server; it takes 1 (or leave it out)."}.get(
             field, f"{field} is not supported by this server; remove it from the request."))


@pytest.mark.parametrize("field, value, instead", [
    ("functions", [{"name": "f", "parameters": {}}], "send the request to /v1/chat/completions."),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "send the request to /v1/chat/completions."),
    ("max_completion_tokens", 40, "give max_tokens."), ("top_logprobs", 2, "give logprobs (a number of tokens)."),
    ("messages", [{"role": "user", "content": "hi"}], "send the chat to /v1/chat/completions, or its text as prompt.")])
def test_chat_completions_fields_sent_to_completions_are_refused(client, field, value, instead):
    """They were ignored with a log line (vLLM's way): functions with no call, 16 tokens for
    max_completion_tokens 40."""
    message = _bad(lambda: client.completions.create(model="tiny", prompt="Hello", max_tokens=2,
                                                     extra_body={field: value}), field)
    assert message == f"{field} is a Chat Completions field, not taken by /v1/completions; {instead}"
    same = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0,
                                     extra_body={field: None})  # NOTE: null is the field left out
    assert same.usage.completion_tokens == 2


def test_chat_fields_that_ask_for_nothing_are_taken_on_completions(client, server):
    """Values that change nothing on /v1/completions are taken, as vLLM takes them; a whole chat
    body sent there is refused naming `messages` (it was "The field 'prompt' is required.")."""
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    same = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, extra_body={
        "tools": [], "parallel_tool_calls": False, "include_reasoning": True, "add_generation_prompt": True,
        "modalities": ["text"], "tool_choice": "none", "chat_template_kwargs": {}, "max_completion_tokens": 3})
    assert same.choices[0].text == plain.choices[0].text
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", "max_completion_tokens": 5,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "messages is a Chat Completions field, not taken by /v1/completions; send the chat to /v1/chat/completions, "
        "or its text as prompt."), r.text
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "The field 'prompt' is required.", r.text


def test_request_id_names_the_response(client):
    """vLLM's request_id: the response's id after its prefix; two requests may share it."""
    a = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, extra_body={"request_id": "my-42"})
    b = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, extra_body={"request_id": "my-42"})
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, stream=True,
                                       extra_body={"request_id": "my-42"})
    r = client.responses.create(model="tiny", input="Hello", max_output_tokens=2, extra_body={"request_id": "my-42"})
    assert a.id == "cmpl-my-42" and b.id == "chatcmpl-my-42" and r.id == "resp_my-42"
    assert {c.id for c in stream} == {"cmpl-my-42"}
    _bad(lambda: client.completions.create(model="tiny", prompt="Hello", max_tokens=1,
                                           extra_body={"request_id": ""}), "request_id must hold")


def test_misspelt_nested_keys_are_refused(server, client):
    """A misspelt include_usage, strict or text.format key changed the answer without a word."""
    _bad(lambda: client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, stream=True,
                                                stream_options={"include_usgae": True}), "include_usgae")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strcit": True}}
    _bad(lambda: client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, response_format=fmt),
         "response_format.json_schema cannot hold 'strcit'")
    _bad(lambda: client.responses.create(model="tiny", input="x", text={"formta": {"type": "text"}}),
         "text cannot hold 'formta'")
    # NOTE: a type not run here is named as such, not by a key of its own
    _bad(lambda: client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, response_format={
        "type": "structural_tag", "structures": []}), "response_format of type 'structural_tag' is not supported")


@pytest.mark.parametrize("field, value, name", [("max_tokens", 1, "max_output_tokens"),
                                                ("max_completion_tokens", 1, "max_output_tokens"),
                                                ("response_format", {"type": "json_object"}, "text.format"),
                                                ("messages", MSGS, "input"),
                                                ("reasoning_effort", "low", "reasoning.effort")])
def test_chat_fields_on_responses_name_the_responses_field(client, field, value, name):
    """They went on to chat and won over (or lost to) the Responses field beside them without a word."""
    _bad(lambda: client.responses.create(model="tiny", input="x", max_output_tokens=4, extra_body={field: value}),
         f"{field} is not supported on /v1/responses (a Chat Completions field); use {name}.")


def test_responses_logprobs_and_stream_options(client):
    _bad(lambda: client.responses.create(model="tiny", input="x", extra_body={"logprobs": True}),
         "logprobs is not supported on /v1/responses")
    _bad(lambda: client.responses.create(model="tiny", input="x", extra_body={"stream_options": {}}),
         "stream_options requires stream: true")
    events = list(client.responses.create(model="tiny", input="x", max_output_tokens=2, stream=True,
                                          stream_options={"include_obfuscation": False}))
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_tokenize_refuses_documents(server):
    r = httpx.post(server.base + "/tokenize", json={"messages": MSGS, "documents": [{"text": "d"}]})
    assert r.status_code == 400 and "documents is not supported" in r.json()["error"]["message"], r.text


def test_embedding_fields(server):
    """embed_dtype/endianness/truncation_side beyond their no-op values are refused (float16 was
    sent as float32 bytes); use_activation is normalize's newer name."""
    url = server.base + "/v1/embeddings"
    for field, value, why in (("embed_dtype", "float16", "must be float32"), ("endianness", "big", "must be native or"),
                              ("truncation_side", "right", "must be left"), ("additional_data", {"a": 1}, "is not")):
        r = httpx.post(url, json={"input": "hi", field: value})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field} {why}"), r.text
    raw = httpx.post(url, json={"input": "hi", "use_activation": False, "encoding_format": "base64",
                                "embed_dtype": "float32", "endianness": "native"}).json()
    plain = httpx.post(url, json={"input": "hi", "normalize": False}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(vec, np.array(plain["data"][0]["embedding"], np.float32))
    assert abs(np.linalg.norm(vec) - 1) > 1e-3  # NOTE: not normalized: use_activation=false took effect
    r = httpx.post(url, json={"input": "hi", "use_activation": False, "normalize": True})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("use_activation and normalize are one"), \
        r.text
