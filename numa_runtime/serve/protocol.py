"""OpenAI request bodies (pydantic, so /openapi.json describes them) and their SamplingParams.

Types are checked here, strictly (a bool or a string is not a number); value ranges are checked
once, by SamplingParams (its ValueError is the client's 400). OpenAI fields this server does not
implement are refused by name when set (`refuse_unsupported`), and so are vLLM's; other unknown
fields are ignored with a log line, as vLLM does (a message's own extra keys silently, as vLLM's
message dicts; clients send their own). No field names a file.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from ..sampling_params import SamplingParams, StructuredOutputsParams, as_structured_outputs, json_schema_of
from ..structured import strict_schema
from ..tokenizer import HF_RENDER_ARGS, check_text

log = logging.getLogger("numa_runtime.serve")
MAX_CHOICES = 128  # n times the number of prompts, per request


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    _warn_ignored: ClassVar[bool] = False  # a request body: its unknown fields are logged (as vLLM)
    _refused_extra: ClassVar[frozenset] = frozenset()  # unknown fields it refuses instead (not logged)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """`null` for a field with a default means that default (OpenAI marks `n`, `stream`,
        `logprobs`, `echo`... "or null"; the openai client sends None as null)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            ignored = [k for k in data if k not in fields and k not in cls._refused_extra] if cls._warn_ignored else []
            if ignored:
                log.warning("the request's fields %s are not used by this server and were ignored",
                            ", ".join(repr(k) for k in sorted(map(str, ignored))[:20]))
            data = {k: v for k, v in data.items()
                    if not (v is None and k in fields and not fields[k].is_required())}
        return data


def only_keys(obj: dict, where: str, keys: tuple) -> None:
    """ValueError naming the first key of obj that is not one of `keys`."""
    bad = next((k for k in obj if k not in keys), None)
    if bad is not None:
        raise ValueError(f"{where} cannot hold {bad!r}: its fields are {', '.join(keys)}.")


def _refuse(body: BaseModel, defaults: dict) -> None:
    """ValueError naming the first field set to something other than its no-op value."""
    for name, ok in defaults.items():
        value = getattr(body, name)
        if value is not None and value not in ok:
            # NOTE: a field refused only for some values names the value and the ones taken ("service_tier
            # is not supported ...; remove it" read as if the field itself were, though "auto" is taken)
            if any(v not in ([], {}) for v in ok):  # NOTE: where the only value taken is empty: remove it
                shown = json.dumps(value, default=str)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                taken = " or ".join(json.dumps(v) for v in ok)
                e = ValueError(f"{name} {shown} is not supported by this server; it takes {taken} "
                               "(or leave it out).")
                e.param = name  # NOTE: the sentence opens with the field's spelling, kept lower-case
                raise e
            raise ValueError(f"{name} is not supported by this server; remove it from the request.")


class StreamOptions(_Body):
    # NOTE: a misspelt include_usage dropped the usage without a word: unknown keys are refused
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    include_obfuscation: bool = Field(False, description="OpenAI's; this server adds no obfuscation.")
    continuous_usage_stats: bool = Field(False, description="With include_usage, every chunk carries the usage "
                                                            "so far (vLLM's extension).")


class _SamplingRequest(_Body):
    _warn_ignored: ClassVar[bool] = True
    model: Optional[str] = Field(None, description="The served model name; omit for the only model served.")
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, description="0 is greedy; default 1.")
    top_p: Optional[float] = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, description="Accepted and ignored.")
    # extensions (vLLM names)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: Optional[dict[str, float]] = Field(None, description="Token id (as a string) -> bias in "
                                                                      "[-100, 100] added to its logit.")
    stop_token_ids: Optional[list[int]] = Field(None, description="Token ids that end a choice, as EOS does.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string or stop token in the text.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    response_format: Optional[dict[str, Any]] = Field(None, description="text, json_object or json_schema "
                                                                        "(constrains sampling)")
    guided_json: Union[dict[str, Any], str, None] = Field(
        None, description="vLLM's older name for a JSON schema the output follows (response_format on chat).")
    # vLLM extensions this server does not implement: refused by name when set (see _VLLM_REFUSED)
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    prompt_logprobs: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None
    allowed_token_ids: Optional[list[Any]] = Field(None, description="Only these token ids may be sampled.")
    bad_words: Optional[list[Any]] = Field(None, description="Words the output must not contain (vLLM's rule).")
    guided_regex: Optional[Any] = Field(None, description="A regular expression the whole output matches.")
    guided_choice: Optional[Any] = Field(None, description="The output is exactly one of these strings.")
    guided_grammar: Optional[Any] = Field(None, description="A grammar the output follows (Lark, or llama.cpp's "
                                                            "GBNF).")
    structured_outputs: Optional[Any] = Field(None, description="vLLM's {json | regex | choice | grammar | "
                                                                "json_object: ...}, one of them.")
    spaces_between_special_tokens: Optional[bool] = None
    return_tokens_as_token_ids: Optional[bool] = None
    priority: Optional[int] = None
    guided_whitespace_pattern: Optional[Any] = None
    guided_decoding_backend: Optional[Any] = None
    logits_processors: Optional[Any] = None
    return_token_ids: Optional[bool] = None
    detokenize: Optional[bool] = None
    cache_salt: Optional[Any] = None
    vllm_xargs: Optional[Any] = None
    structural_tag: Optional[Any] = None
    truncation_side: Optional[Any] = Field(None, description="'left' only: truncate_prompt_tokens keeps the last "
                                                             "tokens.")
    logprob_token_ids: Optional[Any] = None
    request_id: Optional[str] = Field(None, description="The response's id after its prefix (cmpl-, chatcmpl-), "
                                                        "as vLLM names it; default: a random one.")
    prompt_embeds: Optional[Any] = None
    thinking_token_budget: Optional[Any] = None
    repetition_detection: Optional[Any] = None
    watermarking: Optional[Any] = None
    stream_interval: Optional[Any] = None
    return_prompt_text: Optional[Any] = None
    session_id: Optional[Any] = None
    mm_processor_kwargs: Optional[Any] = None
    media_io_kwargs: Optional[Any] = None
    kv_transfer_params: Optional[Any] = None

    def response_id(self, kind: str) -> str:
        """`kind`-<request_id>, or `kind`-<a random hex id>."""
        import uuid
        return f"{kind}-{uuid.uuid4().hex if self.request_id is None else self.request_id}"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        json_schema: dict | None = None, defaults: dict | None = None) -> SamplingParams:
        """SamplingParams for this request; ValueError (one sentence) if a value is out of range.
        `defaults` (the model's generation_config.json values) fill the sampling fields it leaves
        unset or null, as vLLM's --generation-config auto."""
        given = {**(defaults or {})}
        most = given.pop("max_tokens", None)  # NOTE: max_new_tokens: as vLLM, a cap on every request
        if most is not None:
            max_tokens = most if max_tokens is None else min(max_tokens, most)
        given |= {k: v for k, v in {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
        }.items() if v is not None}
        # NOTE: any integer is a valid OpenAI seed; the sampler's generator wants a non-negative one.
        # -1 is vLLM's "no seed" (it was the fixed seed 2**64 - 1: three such requests gave one text)
        seed = None if self.seed is None or self.seed == -1 else self.seed % (1 << 64)
        for s in [self.stop] if isinstance(self.stop, str) else self.stop or []:
            check_text("stop", s)
        _refuse(self, self._refused())
        if self.request_id is not None:
            check_text("request_id", self.request_id)
            if not 1 <= len(self.request_id) <= 256:
                raise ValueError("request_id must hold 1 to 256 characters.")
        if self.stream_options is not None and not self.stream:  # NOTE: as vLLM: never ignored
            raise ValueError("stream_options requires stream: true.")
        if self.guided_json is not None:
            if json_schema is not None:
                raise ValueError("Give the JSON schema once: response_format or guided_json, not both.")
            json_schema = self._guided_json()
        structured = self._structured_outputs(json_schema is not None)
        for name in ("allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list):
                raise ValueError(f"{name} must be a list, got {value!r}.")
        return SamplingParams(n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=seed,
                              stop=self.stop, ignore_eos=self.ignore_eos, logprobs=logprobs,
                              logit_bias=self._logit_bias(), json_schema=json_schema,
                              structured_outputs=structured, allowed_token_ids=self.allowed_token_ids,
                              bad_words=self.bad_words or None,
                              stop_token_ids=self.stop_token_ids,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens,
                              **{k: v for k, v in given.items() if v is not None})

    def _refused(self) -> dict:
        """The vLLM fields this request kind refuses (see _VLLM_REFUSED)."""
        return _VLLM_REFUSED

    def constraint_field(self) -> str | None:
        """The request field that constrains the output beyond response_format: guided_json,
        guided_regex, guided_choice, guided_grammar or structured_outputs; None if none does."""
        given = [f for f in _CONSTRAINTS if getattr(self, f) is not None]
        return given[0] if given else None

    def _structured_outputs(self, has_schema: bool) -> StructuredOutputsParams | None:
        """The guided_regex / guided_choice / guided_grammar / structured_outputs constraint, checked;
        ValueError (one sentence, naming the field) if more than one constraint is given."""
        given = [f for f in _CONSTRAINTS[1:] if getattr(self, f) is not None]  # NOTE: guided_json is has_schema
        if has_schema and given == ["structured_outputs"] and isinstance(self.structured_outputs, dict):
            out = as_structured_outputs(self.structured_outputs)
            if not out.kinds():  # NOTE: as vLLM: options alone (disable_any_whitespace) beside a schema are its
                out.check_options()
                return out
        if len(given) + has_schema > 1:
            schema = "guided_json" if self.guided_json is not None else "response_format"
            named = ([schema] if has_schema else []) + given
            raise ValueError(f"Give one output constraint, not {' and '.join(named)}.")
        if not given:
            return None
        field = given[0]
        value = getattr(self, field)
        if field == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError("structured_outputs must be an object holding one of json, regex, choice, grammar "
                                 "or json_object.")
            out = as_structured_outputs(value)
            out.constraint()
            return out
        kind = field.removeprefix("guided_")
        out = StructuredOutputsParams(**{kind: value})
        try:
            out.constraint()
        except ValueError as e:
            raise ValueError(str(e).replace(f"structured_outputs' {kind}", field)) from None
        return out

    def json_schema(self) -> dict | None:
        """The JSON schema that response_format asks the output to follow, or None."""
        fmt = self.response_format
        if fmt is None:
            return None
        if "type" not in fmt:  # NOTE: as OpenAI and vLLM (a schema without it was dropped unread)
            raise ValueError("response_format needs a 'type': 'text', 'json_object' or 'json_schema'.")
        # NOTE: a misspelt key (strcit) changed the output without a word; another type has its own words
        if fmt.get("type") in (None, "text", "json_object", "json_schema"):
            only_keys(fmt, "response_format", ("type", "json_schema", "schema"))
            if isinstance(fmt.get("json_schema"), dict):
                only_keys(fmt["json_schema"], "response_format.json_schema", ("name", "description", "schema",
                                                                              "strict"))
        kind = fmt.get("type")
        # NOTE: a schema beside a type that reads none was ignored without a word (OpenAI refuses it)
        for key in ("json_schema", "schema") if kind in (None, "text") else ("json_schema",) if kind == "json_object" else ():
            if fmt.get(key) is not None:
                raise ValueError(f"response_format of type {kind or 'text'!r} takes no {key!r}; use type 'json_schema' "
                                 "to constrain the output to a schema.")
        if kind in (None, "text"):  # NOTE: null: the default, "text"
            return None
        top = fmt.get("schema")  # NOTE: llama.cpp's server reads a schema beside the type
        if top is not None and not isinstance(top, dict):
            raise ValueError("response_format's 'schema' must be a JSON schema object.")
        if kind == "json_object":
            return top if top is not None else {"type": "object"}
        spec = fmt.get("json_schema")
        if kind == "json_schema" and spec is None and top is not None:
            return top
        if kind == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
            schema = spec.get("schema", {})
            return strict_schema(schema) if spec.get("strict") is True else schema
        if kind == "json_schema":
            raise ValueError("response_format must hold 'json_schema': {'name': ..., 'schema': {...}}.")
        raise ValueError(f"response_format of type {kind!r} is not supported; use 'text', 'json_object' "
                         "or 'json_schema'.")

    def _guided_json(self) -> dict:
        schema = json_schema_of(self.guided_json)
        if schema is None:
            raise ValueError("guided_json must be a JSON schema: an object, or a string holding one.")
        return schema

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bad = next((k for k in self.logit_bias if not re.fullmatch(r"-?[0-9]+", k)), None)
        if bad is not None:
            raise ValueError(f"logit_bias keys must be token ids written as decimal strings, got {bad!r}.")
        # NOTE: a number, but no token id: said as the engine says ids past the vocabulary ("-1" and
        # 19 digits were said not to be decimal strings); int() of thousands of digits CPython refuses
        long = next((k for k in self.logit_bias if len(k.lstrip("-")) > 20), None)
        if long is not None:
            raise ValueError(f"logit_bias names a token id of {len(long.lstrip('-'))} digits, outside the "
                             "vocabulary.")
        return {int(k): v for k, v in self.logit_bias.items()}


# the request fields that constrain the output besides response_format
_CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")

# vLLM request fields with no counterpart here, and the values that change nothing
_VLLM_REFUSED = {"use_beam_search": (False,), "length_penalty": (1.0,), "prompt_logprobs": (),
                 "spaces_between_special_tokens": (True,), "return_tokens_as_token_ids": (False,),
                 "priority": (0,), "guided_whitespace_pattern": (),
                 # NOTE: the one backend here is llguidance, vLLM's "guidance" (as StructuredOutputsParams.backend)
                 "guided_decoding_backend": ("auto", "guidance", "llguidance"),
                 "logits_processors": ([],), "return_token_ids": (False,), "detokenize": (True,),
                 "cache_salt": (), "vllm_xargs": (), "structural_tag": (), "truncation_side": ("left",),
                 "logprob_token_ids": ([],), "prompt_embeds": (), "thinking_token_budget": (),
                 "repetition_detection": (), "watermarking": (), "stream_interval": (1,),
                 "return_prompt_text": (False,), "session_id": (), "mm_processor_kwargs": ({},),
                 "media_io_kwargs": ({},), "kv_transfer_params": ()}


# Chat Completions fields that /v1/completions refuses, and what to do instead; _CHAT_NO_OP: their values
# that ask for nothing there (taken, as vLLM takes them)
_CHAT_NO_OP = {"tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
               "parallel_tool_calls": (True, False), "include_reasoning": (True, False),
               "add_generation_prompt": (True, False), "continue_final_message": (False,), "documents": ([],),
               "chat_template_kwargs": ({},), "modalities": (["text"],)}
_CHAT_ONLY = {"messages": "send the chat to /v1/chat/completions, or its text as prompt.",
              "max_completion_tokens": "give max_tokens.", "top_logprobs": "give logprobs (a number of tokens).",
              **{k: "send the request to /v1/chat/completions." for k in (
                  "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "chat_template",
                  "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents",
                  "reasoning_effort", "include_reasoning", "audio", "modalities", "prediction",
                  "web_search_options")}}


def _chat_only(data: dict) -> str | None:
    """The first Chat Completions field of a completions body set to something that asks for it."""
    no_op = {**_CHAT_NO_OP, "max_completion_tokens": (data.get("max_tokens"),)}  # NOTE: both given, equal
    return next((k for k in _CHAT_ONLY if data.get(k) is not None and
                 not any(type(data[k]) is type(v) and data[k] == v for v in no_op.get(k, ()))), None)


class CompletionRequest(_SamplingRequest):
    _refused_extra: ClassVar[frozenset] = frozenset(_CHAT_ONLY)
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="A string, a list of strings, a list of token ids, or a list of token id lists.")
    logprobs: Optional[int] = Field(None, ge=0, le=20,  # NOTE: OpenAI's 5; vLLM's max_logprobs 20
                                    description="Number of most likely tokens to return per position (0-20).")
    echo: bool = Field(False, description="The prompt before the completion in the text (and its tokens' "
                                          "logprobs, the first null, with logprobs).")
    suffix: Optional[str] = Field(None, description="Not supported; must be absent or empty.")
    best_of: Optional[int] = Field(None, description="Not supported beyond best_of = n.")
    add_special_tokens: bool = Field(True, description="Add the tokenizer's special tokens (BOS) to text "
                                                       "prompts (vLLM's name).")
    # NOTE: `"max_tokens": null` sent (null is otherwise read as the field's default, 16 here):
    # vLLM runs such a completion to the context's end
    _max_tokens_null: bool = PrivateAttr(False)

    # NOTE: Chat Completions fields sent here were ignored with a log line, as vLLM's (tools without a
    # call, max_completion_tokens giving 16 tokens): each is refused naming it, as /v1/responses does
    _chat_only: Optional[str] = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _note_max_tokens_null(cls, data, handler):
        chat_only = _chat_only(data) if isinstance(data, dict) else None
        if chat_only is not None and "prompt" not in data:
            data = {**data, "prompt": ""}  # NOTE: a chat body sent here: refused naming its field, not "prompt"
        body = handler(data)
        body._max_tokens_null = isinstance(data, dict) and "max_tokens" in data and data["max_tokens"] is None
        body._chat_only = chat_only
        return body

    @property
    def max_tokens_to_the_end(self) -> bool:
        """max_tokens was sent as null (vLLM: up to the context's end; omitted, OpenAI's 16)."""
        return self._max_tokens_null

    def _refused(self) -> dict:
        return {k: v for k, v in _VLLM_REFUSED.items() if k != "prompt_logprobs"}

    def refuse_unsupported(self) -> None:
        if self._chat_only is not None:
            key = self._chat_only
            e = ValueError(f"{key} is a Chat Completions field, not taken by /v1/completions; "
                           + _CHAT_ONLY[key])
            e.param = key
            raise e
        _refuse(self, {"suffix": ("",), "best_of": (self.n,)})
        if self.prompt_logprobs is not None:
            if isinstance(self.prompt_logprobs, bool) or not 0 <= self.prompt_logprobs <= 20:
                raise ValueError(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}.")
            if self.stream:
                raise ValueError("prompt_logprobs is not supported with stream: true; leave one out.")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list; ValueError if there are none."""
        self.refuse_unsupported()
        p = self.prompt
        if isinstance(p, str):
            out = [p]
        elif p and all(isinstance(t, int) for t in p):
            out = [p]
        else:
            out = list(p)
        if not out:
            raise ValueError("prompt must not be empty.")
        if any(len(x) == 0 for x in out):
            raise ValueError("Every prompt must contain at least one character or token.")
        if len(out) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(out)} prompts times n={self.n} exceeds {MAX_CHOICES} completions per request.")
        for x in out:
            if isinstance(x, str):
                check_text("prompt", x)
        return out


class ContentPart(_Body):
    type: str = Field(..., description="Only 'text' is supported (and an assistant's 'refusal', as its text).")
    text: Optional[str] = None
    refusal: Optional[str] = None


class FunctionCall(_Body):
    name: str
    arguments: Union[str, dict[str, Any], None] = Field(None, description="A JSON object, as a string or not.")


class ToolCall(_Body):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_dict(self) -> dict:
        """The call as templates read it (as vLLM hands it): `arguments` a dict, parsed from its
        JSON string; empty, invalid or not an object: {} (history the model wrote stays usable)."""
        from ..tokenizer import template_call  # NOTE: the rule Engine.chat's messages take too
        args = template_call({"function": {"name": self.function.name,
                                           "arguments": self.function.arguments}})["function"]["arguments"]
        if not isinstance(args, dict):  # NOTE: arguments given as an object already
            args = {}
        check_text("messages", json.dumps([self.id, self.function.name, args], ensure_ascii=False))
        call = {"type": "function", "function": {"name": self.function.name, "arguments": args}}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(_Body):
    # NOTE: as vLLM, any role the template takes (Llama 3's "ipython", the legacy "function"): the
    # template refuses one it does not know
    role: str = Field(..., min_length=1)
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="Assistant messages: the calls it made.")
    tool_call_id: Optional[str] = Field(None, description="Tool messages: the call answered.")
    reasoning: Optional[str] = Field(None, description="Assistant messages: their reasoning (vLLM's name).")
    reasoning_content: Optional[str] = Field(None, description="The same, under its older name.")

    def as_template_dict(self) -> dict:
        """The message as vLLM hands it to the chat template: content a string (None is "") or
        its parts (Tokenizer.apply_chat_template refuses all but text parts, and joins them or
        not, as the template reads content), tool calls with parsed arguments, reasoning under
        both names."""
        content = self.content
        if isinstance(content, list):
            # NOTE: an OpenAI assistant's refusal part, replayed, reaches the template as its text (vLLM)
            content = [{"type": "text", "text": part.refusal} if part.type == "refusal" and part.refusal is not None
                       else {"type": part.type, "text": part.text} for part in content]
        msg = {"role": self.role, "content": content if content is not None else ""}
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if self.role == "assistant" and self.tool_calls:
            msg["tool_calls"] = [call.as_template_dict() for call in self.tool_calls]
        if self.role == "assistant" and reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        if self.role == "tool" and self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            msg["name"] = self.name
        for key in ("name", "reasoning", "tool_call_id"):
            check_text("messages", msg.get(key) or "")
        for part in [msg["content"]] if isinstance(msg["content"], str) else msg["content"]:
            check_text("messages", part if isinstance(part, str) else part["text"] or "")
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, description="Takes precedence over max_tokens.")
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20, description="0-20; requires logprobs=true.")
    # refused unless absent or a no-op (see refuse_unsupported)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    modalities: Optional[list[Any]] = Field(None, description="['text'] only.")
    service_tier: Optional[Any] = Field(None, description="auto or default only.")
    verbosity: Optional[Any] = Field(None, description="medium only.")
    store: Optional[bool] = Field(None, description="false only: this server stores no chat completions.")
    metadata: Optional[dict[str, Any]] = Field(None, description="Accepted (nothing is stored).")
    prompt_cache_key: Optional[str] = Field(None, description="Accepted: the prefix cache needs no key.")
    safety_identifier: Optional[str] = Field(None, description="Accepted and ignored, as user.")
    reasoning_effort: Optional[str] = Field(
        None, max_length=32, description="Passed to the chat template as reasoning_effort (as vLLM does; the "
                                         "template reads its value); chat_template_kwargs may set it too.")
    # extensions (vLLM names)
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="Extra variables for the chat template, e.g. {'enable_thinking': false}.")
    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant's turn opening.")
    continue_final_message: bool = Field(False, description="Continue the last (assistant) message instead "
                                                            "of starting a new turn.")
    add_special_tokens: bool = Field(False, description="Add the tokenizer's special tokens (BOS) to the "
                                                        "rendered template (it usually writes them itself).")
    echo: bool = Field(False, description="Not supported; must be false.")
    best_of: Optional[int] = Field(None, description="Not supported beyond best_of = n.")
    chat_template: Optional[str] = Field(None, description="Not supported; must be absent.")
    documents: Optional[list[Any]] = Field(None, description="Not supported; must be absent.")
    include_reasoning: bool = Field(True, description="With --reasoning-parser: false leaves the reasoning out "
                                                      "(vLLM's).")

    def tool_plan(self, parser: str | None):
        """How tools shape this request (tools.py); ValueError for tools it cannot run."""
        from .tools import plan
        p = plan(self.tools, self.tool_choice, parser)
        if self.parallel_tool_calls is False:  # NOTE: as vLLM: the first call only
            import dataclasses
            p = dataclasses.replace(p, single=True, schema={**p.schema, "maxItems": 1} if p.mode == "required"
                                    else p.schema)
        return p

    def refuse_unsupported(self) -> None:
        _refuse(self, {"functions": ([],), "function_call": ("none",),
                       "audio": (), "prediction": (), "web_search_options": (), "echo": (False,),
                       "chat_template": (), "documents": ([],), "best_of": (self.n,), "modalities": (["text"],),
                       "service_tier": ("auto", "default"), "verbosity": ("medium",), "store": (False,)})
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message cannot be true together with add_generation_prompt=true.")

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true.")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict:
        return _template_kwargs(self)


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the model's template."""
    _warn_ignored: ClassVar[bool] = True
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[Any]] = Field(None, description="Tools the chat template renders (with messages).")
    add_special_tokens: Optional[bool] = Field(None, description="Default: true for a prompt, false for messages.")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = Field(False, description="Also each token's text.")
    chat_template: Optional[str] = Field(None, description="Not supported; must be absent (as on chat "
                                                           "completions: the server's template renders).")
    documents: Optional[list[Any]] = Field(None, description="Not supported; must be absent (as on chat "
                                                             "completions).")
    reasoning_effort: Optional[str] = Field(
        None, max_length=32, description="As on chat completions: the chat template's reasoning_effort.")

    def checked(self) -> "TokenizeRequest":
        _refuse(self, {"chat_template": (), "documents": ([],)})  # NOTE: it was ignored: token counts of a template never used
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Give either prompt or messages to tokenize.")
        if self.prompt is not None:
            check_text("prompt", self.prompt)
        if self.messages is not None and not self.messages:
            raise ValueError("messages must hold at least one message.")
        return self

    def template_kwargs(self) -> dict:
        return _template_kwargs(self)


class DetokenizeRequest(_Body):
    _warn_ignored: ClassVar[bool] = True
    model: Optional[str] = None
    tokens: list[int]


def _template_kwargs(body) -> dict:
    """Keyword arguments of Tokenizer.apply_chat_template: chat_template_kwargs may set any
    template variable (add_generation_prompt too, as in vLLM), but not the messages."""
    extra = body.chat_template_kwargs or {}
    if "messages" in extra:
        raise ValueError("chat_template_kwargs cannot set 'messages'; send them as messages.")
    # NOTE: the renderer's own arguments are not template variables: a template given in a request
    # runs as code on the server (vLLM's CVE-2025-61620 refuses it so), and tools/documents have
    # their own fields
    for key in ("chat_template", "tools", "documents", *HF_RENDER_ARGS):
        if key in extra:
            raise ValueError(f"chat_template_kwargs cannot set {key!r}"
                             + ("; the server renders with the model's template (or --chat-template)."
                                if key == "chat_template" else "; it is not a template variable."))
    add = body.add_generation_prompt and not body.continue_final_message
    # NOTE: as vLLM, reasoning_effort reaches the template (gpt-oss and others read it); chat_template_kwargs wins
    effort = {} if body.reasoning_effort is None else {"reasoning_effort": body.reasoning_effort}
    return {"add_generation_prompt": add, "continue_final_message": body.continue_final_message, **effort, **extra}
