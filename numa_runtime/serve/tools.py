"""Tool calling on /v1/chat/completions, as vLLM's OpenAI server does it.

- `tools` reach the chat template (the model's own tool prompt); `tool_choice` says what to do:
  - "none": the model answers in text;
  - a named function (`{"type": "function", "function": {"name": ...}}`): the output is
    constrained to that function's `parameters` schema and returned as its one call;
  - "required": the output is constrained to a JSON list of one or more {"name", "parameters"}
    calls of the given tools, returned as calls;
  - "auto" (the default with tools): the model decides; its text is parsed for calls in the
    model family's format, which the server names with `--tool-call-parser` (with
    `--enable-auto-tool-choice`, vLLM's flags): `hermes` (`<tool_call>{"name": ..., "arguments":
    ...}</tool_call>`: Qwen2.5/3, Hermes) or `llama3_json` (a JSON object {"name", "parameters"},
    optionally after `<|python_tag|>`, several separated by ";": Llama 3.1-3.3).
- Calls come back as `message.tool_calls` (`finish_reason` "tool_calls", but for a named
  function "stop", or "length" where max_tokens cut its arguments, as vLLM); text the model
  wrote before its calls is the `content`. A stream sends the text as it comes, holds back
  what may open a call, and sends the calls whole at the end.
"""
from __future__ import annotations

import decimal
import json
import math
import re
import uuid
from dataclasses import dataclass

from ..tokenizer import SURROGATE  # NOTE: the pattern check_text uses

PARSERS = ("hermes", "llama3_json")


class ToolError(ValueError):
    """A request's tools or tool_choice cannot run (the client's 400, naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    mode: str                       # "none" | "auto" | "required" | "named"
    tools: list | None              # for the chat template
    schema: dict | None = None      # the output's JSON schema (required, named)
    name: str | None = None         # named: the function
    parser: str | None = None       # auto: the call format
    single: bool = False            # parallel_tool_calls false: only the first call

    @property
    def parses(self) -> bool:
        return self.mode in ("auto", "required", "named")


# JSON schema keywords that say nothing of a value (a schema of them alone declares no arguments)
_ANNOTATIONS = frozenset(("title", "description", "$schema", "$id", "$comment", "examples", "default", "$defs",
                          "definitions"))


def _schema_type(schema: dict):
    """The `type` a tool's parameters schema gives its value, following a top-level local $ref
    (#/$defs/X, #/definitions/X); None where it names none."""
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")) and "type" not in schema:
        where, _, name = ref[2:].partition("/")
        target = (schema.get(where) or {}).get(name)
        return _schema_type(target) if isinstance(target, dict) and target is not schema else None
    return schema.get("type")

def plan(tools, tool_choice, parser: str | None) -> ToolPlan:
    """The plan of one request; ValueError (one sentence) for tools or a tool_choice it cannot run.
    `parser`: the server's --tool-call-parser when --enable-auto-tool-choice is on, else None."""
    if tools is not None and not isinstance(tools, list):
        raise ToolError("tools must be a list of {'type': 'function', 'function': {...}} objects.", "tools")
    if tools and SURROGATE.search(json.dumps(tools, ensure_ascii=False)):
        raise ToolError("tools must be valid Unicode text, but they hold a lone surrogate.", "tools")
    tools = tools or None
    functions = {}
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                            f"'parameters': {{...}}}}}}.", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"tools[{i}].function.name must be a non-empty string.", "tools")
        if name in functions:  # NOTE: the later schema replaced the earlier one unseen
            raise ToolError(f"tools[{i}] is a second function named {name!r}; give each tool its own name.", "tools")
        params = fn.get("parameters")
        if params is None or params == {}:  # NOTE: absent, null or {} (as vLLM reads them): no arguments
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
        kind = _schema_type(params)
        if kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise ToolError(f"tools[{i}].function.parameters must describe a JSON object (a function's arguments "
                            f"are one), but it is of type {kind!r}.", "tools")
        if "type" not in params:
            # NOTE: arguments are an object: a schema that names no type let a constrained call write any JSON
            # value ({} gave arguments '12345678903', and LangChain failed on them), combinators beside
            # properties too ("at least one of": anyOf of required lists); one of annotations alone
            # ({"title": ...}) takes no arguments, as {} does (one that says anything of the members,
            # {"required": ["a"]}, stays open as its "type": "object" form)
            params = {"type": "object", **({"properties": {}} if set(params) <= _ANNOTATIONS else {}), **params}
        if fn.get("strict") is True:  # NOTE: as response_format's strict: no undeclared property
            from .protocol import strict_schema
            params = strict_schema(params)
        functions[name] = params
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                            "'function': {'name': ...}}.", "tool_choice")
        if name not in functions:
            raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools.",
                            "tool_choice")
        return ToolPlan("named", tools, functions[name], name)
    if choice not in ("none", "auto", "required"):
        raise ToolError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                        "'function': {'name': ...}}.", "tool_choice")
    if choice != "none" and not tools:
        raise ToolError(f"tool_choice {choice!r} needs tools.", "tool_choice")
    if choice == "required":
        # NOTE: as vLLM, each tool's $defs (and draft-07's definitions) move to the root, where its
        # "#/$defs/..." refs point (pydantic writes nested models so: openai.pydantic_function_tool);
        # its other local refs ("#/properties/x", zod's) follow it to where it now sits
        roots, calls = {"$defs": {}, "definitions": {}}, []
        for i, (n, p) in enumerate(functions.items()):
            p = _moved_refs(dict(p), f"#/items/anyOf/{i}/properties/parameters")
            for kind, defs in roots.items():
                for key, value in (p.pop(kind, None) or {}).items():
                    if key in defs and defs[key] != value:
                        raise ToolError(f"Two tools define '{kind}/{key}' differently; the calls of tool_choice "
                                        "'required' share one schema: rename one.", "tools")
                    defs[key] = value
            calls.append({"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return ToolPlan("required", tools, {**schema, **{k: v for k, v in roots.items() if v}})
    if choice == "auto":
        if parser is None:
            raise ToolError('tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                            '--tool-call-parser (hermes or llama3_json, as the model writes its calls); '
                            'name a function in tool_choice, or use "required" or "none".', "tool_choice")
        return ToolPlan("auto", tools, parser=parser)
    return ToolPlan("none", tools)


def _moved_refs(node, base: str):
    """`node` (a tool's parameters schema) with its local $refs rewritten for its new place at
    `base` in the schema of tool_choice 'required': "#" and "#/x/..." point under base, but those
    into $defs/definitions, which move to the root with it."""
    if isinstance(node, list):
        return [_moved_refs(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _moved_refs(v, base) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) \
            and not ref.startswith(("#/$defs/", "#/definitions/")):
        out["$ref"] = base + ref[1:]
    return out


def _call(name, arguments, raw: bool = False) -> dict:
    """A call of `name` (a non-empty string, else KeyError: the text is no call); `arguments` as
    JSON text (as vLLM: any value is dumped, a string too); `raw`: they are the text already."""
    if not isinstance(name, str) or not name or SURROGATE.search(name):
        raise KeyError("name")
    args = arguments if raw else json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    if SURROGATE.search(args):  # NOTE: a decoded lone "\\ud83d" (half a pair) stays escaped: UTF-8 cannot hold it
        args = json.dumps(arguments, allow_nan=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": args}}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse(p: ToolPlan, text: str, finished_whole: bool = True) -> tuple[str | None, list[dict]]:
    """(content, calls) of a finished choice's text. Text that does not hold well-formed calls is
    all content, as vLLM returns it. `finished_whole`: the output ended by itself (not cut by
    max_tokens): a required list of calls cut short gives its whole calls (as vLLM's stream gives
    them), or stays text when none is whole; a named function's call is its call however it
    ended (arguments cut by max_tokens included, finish_reason "length"), as vLLM and OpenAI
    return a forced call."""
    if p.mode == "named":
        return None, [_call(p.name, text, raw=True)]
    if p.mode == "required":
        try:
            items = _loads_exact(text)
            calls = [_call(c["name"], _dumps_exact(c["parameters"]), raw=True) for c in items]
        except _NOT_A_CALL:
            calls = [] if finished_whole else _whole_calls(text)
            return (None, calls) if calls else (text, [])
        return None, calls
    if p.mode != "auto":
        return text, []
    try:
        if p.parser == "hermes":
            start = text.find("<tool_call>")
            if start < 0:
                return text, []
            calls = []
            for body in _HERMES.findall(text[start:]):
                obj = _loads(body)
                calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
            return text[:start] or None, calls[:1] if p.single else calls  # NOTE: the text before, as vLLM
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_json_objects(body):
            obj = _loads(part)
            # NOTE: as vLLM, a call names its arguments: {"name": "Bob", "age": 3} is an answer
            args = obj["parameters"] if "parameters" in obj else obj["arguments"]
            calls.append(_call(obj["name"], args))
        return None, calls[:1] if p.single else calls
    except _NOT_A_CALL:
        return text, []


# NOTE: what model text that is no well-formed call raises on its way to a call; RecursionError:
# nesting deeper than json reads (a small model repeating "[[" until max_tokens)
_NOT_A_CALL = (ValueError, TypeError, KeyError, AttributeError, RecursionError)


def _finite(text: str) -> float:
    x = float(text)
    if math.isinf(x):
        raise ValueError(f"{text} is beyond a float's range")
    return x


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _loads(text: str):
    """JSON as the standard reads it: NaN and Infinity (which json accepts) and numbers beyond a
    float's range (which it reads as infinity) are no JSON, so that arguments dumped back stay JSON."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite)


def _loads_exact(text: str):
    """JSON whose non-integer numbers keep their digits (Decimal): the list of calls that
    tool_choice "required" constrains may hold a number beyond a float's range, which is JSON
    still (it was read as no call, and the whole list came back as content)."""
    return json.loads(text, parse_constant=_not_json, parse_float=decimal.Decimal)


def _dumps_exact(value, ensure_ascii: bool = False) -> str:
    """json.dumps's text of what _loads_exact read, each Decimal as its digits (valid JSON)."""
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dict):
        text = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=ensure_ascii)}: {_dumps_exact(v, ensure_ascii)}"
                               for k, v in value.items()) + "}"
    elif isinstance(value, list):
        text = "[" + ", ".join(_dumps_exact(v, ensure_ascii) for v in value) + "]"
    else:
        text = json.dumps(value, ensure_ascii=ensure_ascii, allow_nan=False)
    if not ensure_ascii and SURROGATE.search(text):  # NOTE: as _call: half a pair stays escaped
        return _dumps_exact(value, ensure_ascii=True)
    return text


def _whole_calls(text: str) -> list[dict]:
    """The calls a JSON list of {"name", "parameters"} objects cut short holds whole."""
    dec, calls = json.JSONDecoder(parse_constant=_not_json, parse_float=decimal.Decimal), []
    s = text.lstrip()
    if not s.startswith("["):
        return []
    i = 1
    try:
        while True:
            while i < len(s) and s[i].isspace():
                i += 1
            obj, i = dec.raw_decode(s, i)
            calls.append(_call(obj["name"], _dumps_exact(obj["parameters"]), raw=True))
            while i < len(s) and s[i].isspace():
                i += 1
            if i >= len(s) or s[i] != ",":
                return calls
            i += 1
    except _NOT_A_CALL:
        return calls


def _split_json_objects(text: str) -> list[str]:
    """'{...}; {...}' -> the objects' texts (";" or whitespace between them)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        _, end = dec.raw_decode(text, i)
        out.append(text[i:end])
        i = end
        while i < len(text) and text[i] in "; \n\t":
            i += 1
    return out


class ToolStream:
    """One choice of a stream: passes text on, holding back from where a call may begin; at the
    end, (text still to send, calls)."""

    def __init__(self, p: ToolPlan):
        self.plan, self.text, self.sent = p, "", 0

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.plan.mode in ("named", "required"):
            return ""
        if self.plan.mode != "auto":
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        hold = self._hold_from()
        out, self.sent = self.text[self.sent:hold], max(self.sent, hold)
        return out

    def _hold_from(self) -> int:
        t = self.text
        if self.plan.parser == "llama3_json":
            s = t.lstrip()
            if not s or s.startswith("{") or "<|python_tag|>".startswith(s[:14]) or s.startswith("<|python_tag|>"):
                return 0  # NOTE: a call from the first character on: nothing is sent until the end
            return len(t)
        marker = "<tool_call>"
        i = t.find(marker)
        if i >= 0:
            return i
        for k in range(min(len(marker) - 1, len(t)), 0, -1):  # a marker's beginning at the end
            if t.endswith(marker[:k]):
                return len(t) - k
        return len(t)

    def finish(self, finished_whole: bool) -> tuple[str, list[dict]]:
        content, calls = parse(self.plan, self.text, finished_whole)
        if not calls:
            return self.text[self.sent:], []
        # NOTE: what was sent is a beginning of the content (the text before the calls)
        return (content or "")[self.sent:], calls
