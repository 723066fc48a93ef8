"""OpenAI's Responses API (POST /v1/responses) over the chat completions path, as vLLM serves it:
the request becomes a chat request (instructions a system message; input a string or a list of
message, function_call, function_call_output and reasoning items; function tools; text.format
a response_format), and the chat answer, or its event stream, becomes a Response object, or
Responses events (response.created ... response.completed).

Responses are kept (store, OpenAI's default true) in memory, the newest MAX_STORED of them, for
previous_response_id (the stored chain's input and output items go before the new input; its
instructions do not carry over, as OpenAI's) and GET/DELETE /v1/responses/{id} (and its
input_items); a server restart forgets them. conversation and background are refused in one
sentence, as are non-function tools, non-text input parts and options that have no meaning here.
Sampling extras a vLLM client sends beside (top_k, seed, stop, chat_template_kwargs...) go to the
chat request, which checks them.
"""
from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, NamedTuple

from .protocol import only_keys
from .responses import sse

# NOTE: fields of a Responses request, each mapped below or refused; others go to the chat request
_REFUSED = {
    "conversation": "this server stores no conversations: send the whole conversation as input",
    "prompt": "reusable prompt templates are not supported: send the instructions and input",
    "max_tool_calls": "the model's calls are not capped",
    "service_tier": None,
}
# NOTE: chat's field names in its error messages -> the Responses request's
RENAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
           "reasoning_effort": "reasoning.effort"}
# NOTE: Chat Completions fields a Responses request might carry: each went on to chat (and won over,
# or lost to, the Responses field beside it without a word); refused, naming the Responses field
_CHAT_NAMES = {**RENAMES, "max_completion_tokens": "max_output_tokens"}
_PASS_KEYS = ("temperature", "top_p", "stream", "parallel_tool_calls", "user", "model")
_IGNORED = ("metadata", "safety_identifier", "prompt_cache_key", "truncation", "store", "background",
            "include", "reasoning", "top_logprobs", "text", "tools", "tool_choice", "instructions", "input",
            "max_output_tokens", "stream_options", "previous_response_id")
MAX_STORED = 4096  # NOTE: responses kept by id; the least recently used go first (a chain keeps its own)


class NotStored(LookupError):
    """A response id this server does not hold (404)."""


class Stored(NamedTuple):
    """A stored response: its Response object, its own input items, and the stored response it
    continued (the object, not its id: a chain stays whole when an earlier response is deleted
    or pushed out of the store)."""
    resp: dict
    items: list
    parent: "Stored | None"

    def history(self) -> list:
        """The input and output items of the chain that ends with this response, oldest first."""
        parts, node = [], self
        while node is not None:
            parts.append(node.items + [dict(x) for x in node.resp["output"]])
            node = node.parent
        return [item for part in reversed(parts) for item in part]


_PARENT = "__previous_stored"  # NOTE: chat_request leaves the previous response it read on the request


class ResponseStore:
    """Stored responses by id, the newest `limit` of them (one used as a previous response
    counts as new again)."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit = limit
        self._items: OrderedDict[str, Stored] = OrderedDict()
        # streamed responses stored in progress (begin), by their Response object's identity: a
        # DELETE of one marks it, so that its end does not store it again (an id alone confused
        # a new request reusing a deleted stream's request_id with it)
        self._pending: dict[int, bool] = {}  # id(resp) -> deleted while in progress
        self._reserved: set[str] = set()  # ids of requests under way that asked for them (request_id)
        self._lock = threading.Lock()

    def put(self, resp: dict, input_items: list, parent: Stored | None) -> None:
        if parent is not None and not isinstance(parent, Stored):
            raise TypeError("a stored response's parent must be a stored response.")
        with self._lock:
            self._items[resp["id"]] = Stored(resp, input_items, parent)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def begin(self, raw: dict, resp: dict) -> None:
        """Store the streamed Response object `resp` of `raw` as announced (in_progress): it can be
        read, and deleted, from its response.created on (it was stored at its end only, so a
        DELETE in between failed and the response was stored after it)."""
        with self._lock:
            self._pending[id(resp)] = False
        self.put(resp, input_items(raw), raw.get(_PARENT))

    def keep(self, raw: dict, resp: dict) -> None:
        """Store the Response object `resp` of the Responses request `raw` as the newest (a
        streamed one deleted while in progress stays deleted; one pushed out meanwhile comes
        back), and free its id's reservation."""
        with self._lock:
            self._reserved.discard(resp["id"])
            if self._pending.pop(id(resp), False):
                return
        self.put(resp, input_items(raw), raw.get(_PARENT))

    def reserve(self, rid: str) -> bool:
        """Take the id `rid` for a request under way (its request_id); False if a stored response
        or another request under way has it (two at once both passed a check and one replaced
        the other)."""
        with self._lock:
            if rid in self._items or rid in self._reserved:
                return False
            self._reserved.add(rid)
            return True

    def release(self, rid: str) -> None:
        with self._lock:
            self._reserved.discard(rid)

    def get(self, rid: str, use: bool = False) -> Stored:
        """The stored response `rid` (NotStored if none); `use`: it continues now (newest again)."""
        with self._lock:
            found = self._items.get(rid)
            if found is not None and use:
                self._items.move_to_end(rid)
        if found is None:
            raise NotStored(f"Response {rid!r} is not stored on this server (it was never stored, was deleted, "
                            f"or is older than the newest {self.limit}).")
        return found

    def delete(self, rid: str) -> None:
        self.get(rid)
        with self._lock:
            gone = self._items.pop(rid, None)
            if gone is not None and id(gone.resp) in self._pending:
                self._pending[id(gone.resp)] = True  # NOTE: its end must not store it again


def input_items(raw: dict) -> list:
    """The request's input as OpenAI's input items (checked by chat_request first): messages
    typed, their content as input_text parts (output_text for an assistant's), each with a status."""
    value = raw.get("input")
    items = [{"role": "user", "content": value}] if isinstance(value, str) else list(value or [])
    out = []
    for item in items:
        item = dict(item)
        if item.get("type", "message") == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            content = item.get("content", "")
            if isinstance(content, str):
                content = [{"type": part, "text": content}]
            item = {"type": "message", **item, "content": content}
        item.setdefault("status", "completed")
        out.append(item)
    return out


def stores(raw: dict) -> bool:
    """Whether the response is kept (OpenAI's default: store true)."""
    return raw.get("store") is not False


_FIELD = re.compile(r"^([a-z_]+(?:\[\d+\])*(?:\.[a-z_]+(?:\[\d+\])*)*)(?![\w\[.])")


def _bad(message: str) -> ValueError:
    """The client's error; one that starts with the request's field (`input[0].content: ...`,
    `tools[1] has ...`) names it as the error's param and keeps its spelling (it was capitalized,
    and param null)."""
    e = ValueError(message)
    field = _FIELD.match(message)
    if field is not None:
        e.param = field.group(1)
    return e


def chat_request(raw: Any, store: ResponseStore | None = None) -> dict:
    """The chat completions body of a Responses request (ValueError: one sentence; NotStored: a
    previous_response_id `store` does not hold)."""
    if not isinstance(raw, dict):
        raise _bad("The request body must be a JSON object.")
    raw.pop(_PARENT, None)  # NOTE: this server's own key: never the client's
    previous = raw.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _bad("previous_response_id must be a string (the id of a stored response).")
    if raw.get("store") is not None and not isinstance(raw.get("store"), bool):  # NOTE: 0 == False passed
        raise _bad("store must be true or false.")
    for key, why in _REFUSED.items():
        value = raw.get(key)
        if value is None or (key == "service_tier" and value in ("auto", "default")):
            continue
        raise _bad(f"{key} is not supported by this server ({why or 'only auto or default'}); remove it.")
    if raw.get("background"):
        raise _bad("Background responses (background: true) are not supported; run the request in the "
                   "foreground.")
    if raw.get("include"):
        raise _bad(f"include {raw['include']!r} is not supported; leave it out.")
    if raw.get("truncation") not in (None, "disabled"):
        raise _bad("truncation must be 'disabled' (a prompt too long for the model is refused, not cut).")
    reasoning = raw.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise _bad("reasoning must be an object such as {'effort': 'low'}.")
    extra = [k for k, v in (reasoning or {}).items() if k != "effort" and v is not None]
    if extra:
        raise _bad(f"reasoning.{extra[0]} is not supported (reasoning.effort is: the chat template's "
                   "reasoning_effort); leave it out.")
    if raw.get("top_logprobs"):
        raise _bad("top_logprobs is not supported on /v1/responses; use /v1/chat/completions.")
    rid = raw.get("request_id")  # NOTE: vLLM's: the Response's id after resp_ (it also reaches chat's check)
    if rid is not None and not (isinstance(rid, str) and 1 <= len(rid) <= 256):
        raise _bad("request_id must be a string of 1 to 256 characters.")
    if raw.get("logprobs") not in (None, False):  # NOTE: chat computed them and the output item dropped them
        raise _bad("logprobs is not supported on /v1/responses; use /v1/chat/completions.")
    for key, name in _CHAT_NAMES.items():
        if raw.get(key) is not None:
            raise _bad(f"{key} is not supported on /v1/responses (a Chat Completions field); use {name}.")
    options = raw.get("stream_options")
    if options is not None:
        if not raw.get("stream"):
            raise _bad("stream_options requires stream: true.")
        if not isinstance(options, dict) or any(k != "include_obfuscation" for k in options):
            raise _bad("stream_options takes only include_obfuscation (this server adds no obfuscation).")
    if raw.get("n") not in (None, 1):
        raise _bad("n must be 1 on /v1/responses (a response has one output).")
    _check_metadata(raw.get("metadata"))
    if raw.get("user") is not None and not isinstance(raw["user"], str):
        raise _bad("user must be a string.")
    # NOTE: the fields a response echoes or stores are text: a lone surrogate failed the answer (a 500,
    # or a stream cut as if the engine had stopped) and, stored, every later read of it
    for key in ("metadata", "user", "text", "instructions", "input"):
        _check_strings(raw.get(key), key)
    body = {k: v for k, v in raw.items() if k not in _REFUSED and k not in _IGNORED and k != "n"}
    for key in _PASS_KEYS:
        if raw.get(key) is not None:
            body[key] = raw[key]
    messages = []
    if raw.get("instructions") is not None:
        if not isinstance(raw["instructions"], str):
            raise _bad("instructions must be a string.")
        messages.append({"role": "system", "content": raw["instructions"]})
    if previous is not None:
        if store is None:
            raise NotStored("previous_response_id: this server keeps no responses.")
        _messages(raw.get("input"))  # NOTE: the new items, checked first (errors index them as sent)
        try:
            parent = store.get(previous, use=True)
        except NotStored as e:
            raise NotStored(f"previous_response_id: {e}") from None
        if parent.resp.get("status") == "in_progress":
            raise _bad(f"previous_response_id {previous!r} is still in progress; continue it once it has ended.")
        raw[_PARENT] = parent
        messages += _messages(parent.history() + input_items(raw))
    else:
        messages += _messages(raw.get("input"))
    body["messages"] = messages
    if raw.get("max_output_tokens") is not None:
        body["max_tokens"] = raw["max_output_tokens"]
    if raw.get("tools") is not None:
        body["tools"] = [_tool(t, i) for i, t in enumerate(_list(raw["tools"], "tools"))]
    if raw.get("tool_choice") is not None:
        body["tool_choice"] = _tool_choice(raw["tool_choice"])
        if body["tool_choice"] == "auto" and not body.get("tools"):
            del body["tool_choice"]  # NOTE: the Responses API's default, sent by agent loops with no tools
    fmt = _text_format(raw.get("text"))
    if fmt is not None:
        body["response_format"] = fmt
    if (reasoning or {}).get("effort") is not None:
        body["reasoning_effort"] = reasoning["effort"]  # NOTE: as chat's reasoning_effort: the template reads it
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return body


def _check_metadata(metadata) -> None:
    """OpenAI's limits: at most 16 pairs, string keys up to 64 characters, string values up to 512."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise _bad("metadata must be an object of at most 16 key-value pairs.")
    for k, v in metadata.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise _bad(f"metadata values must be strings of at most 512 characters under keys of at most 64 "
                       f"(key {k[:64]!r}).")


def _check_strings(value, field: str) -> None:
    """Every string in value (keys too) is valid Unicode text (tokenizer.check_text)."""
    from ..tokenizer import check_text
    if isinstance(value, str):
        check_text(field, value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, field)
            _check_strings(v, field)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v, field)


def _list(value, name: str, alone: str = "") -> list:
    """`value` as a list; `alone`: what else the field may be, for the error ("a string or ")."""
    if not isinstance(value, list):
        raise _bad(f"{name} must be {alone}a list, got {type(value).__name__}.")
    return value


def _text(content, where: str):
    """A message's content as chat takes it: a string, or text parts."""
    if isinstance(content, str):
        return content
    parts = []
    for part in _list(content, f"{where}.content", "a string or "):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})  # NOTE: a replayed output's refusal
        elif kind in ("input_text", "output_text", "text", "refusal"):
            field = "refusal" if kind == "refusal" else "text"
            raise _bad(f"{where}.content: a {kind} part needs its {field!r} as a string, got {part.get(field)!r}.")
        else:
            raise _bad(f"{where}.content: only text parts (input_text, output_text, refusal) are supported, got "
                       f"{kind or type(part).__name__!r}.")
    return parts


def _messages(items) -> list[dict]:
    if items is None:
        raise _bad("input is required: a string or a list of input items.")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning = None  # NOTE: a reasoning item goes with the assistant turn after it
    for i, item in enumerate(_list(items, "input", "a string or ")):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object (a message or an item).")
        kind = item.get("type", "message")
        if kind in ("message", "function_call_output", "reasoning") and item.get("role") != "assistant" \
                and reasoning is not None:
            # NOTE: a reasoning item with no assistant turn after it is a turn of its own (a reply cut while it
            # reasoned): it was dropped, and a chain went on with two user turns in a row
            out.append({"role": "assistant", "content": "", "reasoning": reasoning})
            reasoning = None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r}.")
            if "content" not in item:
                raise _bad(f"{where}.content is required: a string or a list of input_text parts.")
            msg = {"role": role, "content": _text(item["content"], where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise _bad(f"{where}: a function_call needs its name and arguments (a JSON string).")
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}.call_id is required: the id its function_call_output answers.")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                # NOTE: a turn's text and calls: one message (a reasoning item before the call starts its own)
                if not last.get("tool_calls"):
                    last["tool_calls"] = []
                last["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, (str, list)):
                raise _bad(f"{where}: a function_call_output needs its output (a string).")
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}.call_id is required: the call_id of the function_call it answers.")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(output, where)})
        elif kind == "reasoning":
            for key in ("content", "summary"):
                if not isinstance(item.get(key) or [], list):
                    raise _bad(f"{where}.{key} must be a list of text parts.")
            texts = [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)]
            texts = texts or [c.get("text", "") for c in item.get("summary") or [] if isinstance(c, dict)]
            reasoning = "\n".join(t for t in texts if isinstance(t, str)) or None
        else:
            raise _bad(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                       "function_call_output and reasoning are).")
    if reasoning is not None:
        out.append({"role": "assistant", "content": "", "reasoning": reasoning})
    if not out:
        raise _bad("input holds no message.")
    return out


def _tool(tool, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise _bad(f"Only function tools are supported, got {kind!r}.")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        if isinstance(tool.get("function"), dict):  # NOTE: the Chat Completions shape, a common slip
            raise _bad(f"tools[{i}] has the Chat Completions shape; the Responses API takes "
                       "{'type': 'function', 'name': ..., 'parameters': {...}}.")
        raise _bad(f"tools[{i}].name must be a non-empty string.")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad(f"tool_choice must be none, auto, required or {{'type': 'function', 'name': ...}}, got {choice!r}.")


def _text_format(text):
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text must be an object such as {'format': {'type': 'text'}}.")
    if text.get("verbosity") not in (None, "medium"):
        raise _bad("text.verbosity is not supported; leave it out.")
    only_keys(text, "text", ("format", "verbosity"))
    fmt = text.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise _bad("text.format must be an object such as {'type': 'json_schema', 'name': ..., 'schema': {...}}.")
    if fmt is not None and fmt.get("type") in ("text", "json_object", "json_schema") and not (
            "json_schema" in fmt and "schema" not in fmt):  # NOTE: another type, or that one, has its own words
        only_keys(fmt, "text.format", ("type", "name", "schema", "strict", "description")
                  if fmt.get("type") == "json_schema" else ("type",))
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if "json_schema" in fmt and "schema" not in fmt:
            raise _bad("text.format.schema is required: the Responses API takes the name, schema and strict in "
                       "text.format itself, not under json_schema (Chat Completions' response_format).")
        for key, kind, what in (("name", str, "a string"), ("schema", dict, "a JSON schema object")):
            if not isinstance(fmt.get(key), kind):
                raise _bad(f"text.format.{key} must be {what} (required with type json_schema).")
        if fmt.get("strict") not in (None, True, False):
            raise _bad("text.format.strict must be true or false.")
        if not isinstance(fmt.get("description", ""), str):
            raise _bad("text.format.description must be a string.")
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": inner}
    raise _bad(f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}.")


# ------------------------------------------------------------------------------ answers
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def resp_id(raw: dict) -> str:
    """resp_<request_id> (vLLM's request field, checked by chat_request), or a new id."""
    return f"resp_{raw['request_id']}" if raw.get("request_id") is not None else _new_id("resp")


def _skeleton(raw: dict, model: str, rid: str, created: int, defaults: dict | None = None) -> dict:
    """The Response object's fields that echo the request: sampling values as used (`defaults`:
    the model's generation defaults for those the request leaves unset; else OpenAI's 1.0), the
    reasoning effort as given."""
    tools = [{"type": "function", **_tool(t, i)["function"]} for i, t in enumerate(raw.get("tools") or [])]
    fmt = (raw.get("text") or {}).get("format") or {"type": "text"}
    used = {k: raw.get(k) if raw.get(k) is not None else (defaults or {}).get(k, 1.0) for k in ("temperature", "top_p")}
    effort = (raw.get("reasoning") or {}).get("effort") if isinstance(raw.get("reasoning"), dict) else None
    return {"id": rid, "object": "response", "created_at": created, "status": "in_progress", "model": model,
            "output": [], "error": None, "incomplete_details": None, "instructions": raw.get("instructions"),
            "max_output_tokens": raw.get("max_output_tokens"), "metadata": raw.get("metadata") or {},
            "parallel_tool_calls": raw.get("parallel_tool_calls", True),
            "previous_response_id": raw.get("previous_response_id"),
            "reasoning": {"effort": effort, "summary": None} if effort is not None else None, "store": stores(raw),
            "background": False, "temperature": used["temperature"], "top_p": used["top_p"], "text": {"format": fmt}, "tool_choice": raw.get("tool_choice", "auto"),
            "tools": tools, "truncation": "disabled", "user": raw.get("user"), "usage": None}


def _usage(u: dict | None) -> dict | None:
    if not u:
        return None
    cached = ((u.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    # NOTE: cache_write_tokens: the prompt tokens computed now (the prefix cache keeps their whole blocks)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {
                "cached_tokens": cached, "cache_write_tokens": u["prompt_tokens"] - cached},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {
                "reasoning_tokens": (u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _finish(resp: dict, finish_reason: str | None) -> dict:
    if finish_reason == "length":
        resp["status"], resp["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        resp["status"] = "completed"
    return resp


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict, status: str = "completed") -> dict:
    fn = call.get("function") or {}
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call.get("id"), "name": fn.get("name"),
            "arguments": fn.get("arguments") or "", "status": status}


def response_body(raw: dict, chat: dict, defaults: dict | None = None) -> dict:
    """The Response object of a (non-streamed) chat answer (`defaults`: _skeleton's)."""
    resp = _skeleton(raw, chat.get("model"), resp_id(raw), int(chat.get("created") or time.time()), defaults)
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning:
        resp["output"].append(_reasoning_item(reasoning))
    if msg.get("content"):
        resp["output"].append(_message_item(msg["content"]))
    resp["output"] += [_call_item(c) for c in msg.get("tool_calls") or []]
    if choice.get("finish_reason") == "length" and resp["output"]:  # NOTE: the item max_output_tokens cut
        resp["output"][-1]["status"] = "incomplete"
    resp["usage"] = _usage(chat.get("usage"))
    return _finish(resp, choice.get("finish_reason"))


class EventStream:
    """Responses events of a chat completion event stream (chunks as the chat path sends them)."""

    def __init__(self, raw: dict, model: str, defaults: dict | None = None):
        self.resp = _skeleton(raw, model, resp_id(raw), int(time.time()), defaults)
        self.seq = 0
        self.open: dict | None = None   # the reasoning or message item being written
        self.calls: dict[int, dict] = {}  # tool call index -> its function_call item
        self.finish_reason = None

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\n" + sse(data)  # NOTE: sse keeps U+2028 and the like off the line

    def start(self) -> list[str]:
        return [self._event("response.created", response=dict(self.resp)),
                self._event("response.in_progress", response=dict(self.resp))]

    def _index(self, item: dict) -> int:
        return self.resp["output"].index(item)

    def _open(self, item: dict) -> list[str]:
        self.resp["output"].append(item)
        added = dict(item, status="in_progress", **({"content": []} if "content" in item else {}))
        if item["type"] == "function_call":
            added["arguments"] = ""
        out = [self._event("response.output_item.added", output_index=self._index(item), item=added)]
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._index(item),
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _close_open(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        i, part = self._index(item), item["content"][0]
        if item["type"] == "reasoning":
            out = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=part["text"])]
        else:
            out = [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=part["text"], logprobs=[]),
                   self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                               part=part)]
        item["status"] = "incomplete" if self.finish_reason == "length" and item is self.resp["output"][-1] \
            else "completed"
        return out + [self._event("response.output_item.done", output_index=i, item=item)]

    def _text(self, kind: str, delta: str) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close_open()
            self.open = (_reasoning_item if kind == "reasoning" else _message_item)("", "in_progress")
            out += self._open(self.open)
        self.open["content"][0]["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self._event(name, item_id=self.open["id"], output_index=self._index(self.open),
                                  content_index=0, delta=delta, **extra)]

    def chunk(self, data: dict) -> list[str]:
        """The events of one chat chunk."""
        if data.get("usage"):
            self.resp["usage"] = _usage(data["usage"])
        out = []
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                out += self._text("reasoning", reasoning)
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._close_open()
                item = self.calls.get(call.get("index", 0))
                if item is None:
                    # NOTE: items one at a time, as OpenAI streams them: the call before is done first
                    out += self._close_calls()
                    item = self.calls[call.get("index", 0)] = _call_item(call, "in_progress")
                    item["arguments"] = ""
                    out += self._open(item)
                fn = call.get("function") or {}
                if fn.get("arguments"):
                    item["arguments"] += fn["arguments"]
                    out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                           output_index=self._index(item), delta=fn["arguments"]))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _close_calls(self) -> list[str]:
        """The done events of the call items not closed yet."""
        out = []
        for item in self.calls.values():
            if item.get("status") != "in_progress":
                continue
            i = self._index(item)
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                   arguments=item["arguments"]))
            last = self.finish_reason == "length" and item is self.resp["output"][-1]
            item["status"] = "incomplete" if last else "completed"
            out.append(self._event("response.output_item.done", output_index=i, item=item))
        return out

    def end(self) -> list[str]:
        out = self._close_open() + self._close_calls()
        resp = _finish(self.resp, self.finish_reason)
        kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
        return out + [self._event(kind, response=resp)]

    def error(self, err: dict) -> list[str]:
        self.resp["status"], self.resp["error"] = "failed", {"code": err.get("code") or "server_error",
                                                               "message": err.get("message", "")}
        return [self._event("error", code=err.get("code"), message=err.get("message", ""), param=err.get("param")),
                self._event("response.failed", response=self.resp)]


async def events(raw: dict, model: str, chat_stream, done=None, defaults: dict | None = None, begin=None):
    """Responses events (SSE text) of the chat event stream `chat_stream` (an async iterator).
    `begin(response)` is called with the Response object as response.created announces it (it
    is the live object: its output grows as the stream goes), `done(response)` with the final
    one: completed, incomplete, failed, or cancelled (the client went away first)."""
    conv = EventStream(raw, model, defaults)
    if begin is not None:
        begin(conv.resp)
    ended = False
    try:
        for e in conv.start():
            yield e
        try:
            async for piece in chat_stream:
                text = piece.decode() if isinstance(piece, bytes) else piece
                for line in text.splitlines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    if payload == "[DONE]":
                        continue
                    data = json.loads(payload)
                    if "error" in data:
                        for e in conv.error(data["error"]):
                            yield e
                        ended = True
                        return
                    for e in conv.chunk(data):
                        yield e
        finally:
            close = getattr(chat_stream, "aclose", None)
            if close is not None:
                await close()
        for e in conv.end():
            yield e
        ended = True
    except Exception as e:  # NOTE: not the client leaving (GeneratorExit, CancelledError): a failure
        if conv.resp["status"] == "in_progress":
            conv.resp["status"], conv.resp["error"] = "failed", {"code": "server_error", "message": str(e)}
        raise
    finally:
        if not ended and conv.resp["status"] == "in_progress":  # NOTE: the client went away
            conv.resp["status"] = "cancelled"
        if conv.resp["status"] in ("cancelled", "failed") and conv.open is not None:
            conv.open["status"] = "incomplete"
        if done is not None:
            done(conv.resp)
