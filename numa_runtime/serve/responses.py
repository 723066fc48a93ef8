"""OpenAI response and stream-chunk bodies built from RequestOutputs (plain dicts, no I/O)."""
from __future__ import annotations

import codecs
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Callable

from ..outputs import RequestOutput

TokenBytes = Callable[[int], bytes]  # Tokenizer.token_bytes: a token's UTF-8 bytes, whole or partial


def token_text(raw: bytes) -> str:
    """A token as logprobs show it: its text, or where its bytes are part of a character,
    OpenAI's "bytes:\\xNN..." (so that distinct partial tokens stay distinct)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# NOTE: JSON leaves U+0085, U+2028 and U+2029 unescaped, but clients that split the event stream
# with str.splitlines (httpx, and so the openai client) cut a data line there: escape them.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict | str) -> str:
    """One server-sent event; its data stays on one line for any line splitter."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {text}\n\n"


@dataclass
class Piece:
    """What one choice gained since the last chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None            # per new token: (logprob, {token_id: logprob})
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's field)


@dataclass
class ChoiceTracker:
    """Follows the RequestOutputs of the engine requests behind one API request (one per
    prompt, each with n completions) and reports per-choice pieces and the final totals.
    An update reads only what the output adds (its deltas), never the whole sequence."""

    n: int
    finished: dict[int, str] = field(default_factory=dict)      # choice index -> finish reason
    latest: dict[int, RequestOutput] = field(default_factory=dict)  # prompt index -> last output

    def update(self, prompt_index: int, out: RequestOutput) -> list[Piece]:
        self.latest[prompt_index] = out
        pieces = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index in self.finished:
                continue
            reason = c.finish_reason if c.finish_reason in ("stop", "length") else None
            if reason:
                self.finished[index] = reason
            if c.delta or c.new_token_ids or reason:
                stop = getattr(c, "stop_reason", None) if reason == "stop" else None
                pieces.append(Piece(index, c.delta, c.new_token_ids, c.new_logprobs, reason, stop))
        return pieces

    def usage(self) -> dict:
        """OpenAI's usage; prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache
        served (OpenAI's field; /v1/responses reports it as input_tokens_details)."""
        prompt = sum(len(o.prompt_token_ids) for o in self.latest.values())
        completion = sum(len(c.token_ids) for o in self.latest.values() for c in o.outputs)
        cached = sum(o.num_cached_tokens or 0 for o in self.latest.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def usage_of(self, index: int, opening: bool = False) -> dict:
        """The usage so far of choice `index` alone (vLLM's continuous usage stats: its prompt's
        tokens and its own completion tokens; none yet in the `opening` role chunk)."""
        out = self.latest.get(index // self.n)
        prompt = len(out.prompt_token_ids) if out is not None else 0
        done = 0 if out is None or opening else next(
            (len(c.token_ids) for c in out.outputs if c.index == index % self.n), 0)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def choices(self) -> list[tuple[int, "object"]]:
        """(choice index, CompletionOutput) of every finished choice, in index order."""
        out = [(p * self.n + c.index, c) for p, o in self.latest.items() for c in o.outputs]
        return sorted(out, key=lambda x: x[0])


# ---------------------------------------------------------------------------- logprobs
def completion_logprobs(token_ids: list[int], logprobs: list | None, decode: TokenBytes,
                        offset: "TextOffset | None" = None, skipped: frozenset = frozenset(),
                        start: int = 0) -> dict | None:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset (the
    character of the completion's text where each token starts; `offset` carries it over the
    chunks of a stream). `skipped`: the ids the text leaves out (special tokens, under
    skip_special_tokens), from the `start`-th token on (an echoed prompt's are in its text):
    they take no characters (their text was counted, and later offsets ran past the text)."""
    if logprobs is None:
        return None
    offset = offset if offset is not None else TextOffset()
    tokens, offsets = [], []
    for i, tid in enumerate(token_ids[:len(logprobs)]):
        raw = decode(tid)
        tokens.append(token_text(raw))
        offsets.append(offset.add(b"" if i >= start and tid in skipped else raw))
    # NOTE: as OpenAI's legacy format and vLLM: the sampled token is always among the top
    # logprobs (logprobs + 1 entries when it is not one of the most likely)
    tops = []
    for tid, x in zip(token_ids, logprobs):
        if x is None:  # NOTE: an echoed prompt's first token: nothing before it to predict it
            tops.append(None)
            continue
        lp, top = x[0], x[1]
        entry = {token_text(decode(t)): finite(v) for t, v in top.items()}
        entry.setdefault(token_text(decode(tid)), finite(lp))
        tops.append(entry)
    return {"tokens": tokens, "token_logprobs": [None if x is None else finite(x[0]) for x in logprobs],
            "top_logprobs": tops, "text_offset": offsets}


def finite(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (a token an output constraint forbade) is -9999.0, as
    vLLM's server writes it."""
    return max(logprob, -9999.0)


class TextOffset:
    """Characters of text so far, counted from token bytes (a character split over tokens
    counts once, where it completes; an unfinished one, where the next token shows it never
    will: with the token that began it)."""

    def __init__(self, tail: bytes = b""):
        """`tail`: the bytes of a prompt's last tokens that leave a character open (tokenizer.
        open_tail): the completion's text begins with them, carried by the token that completes
        the character."""
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        if tail:
            self.chars = len(self._utf8.decode(tail))

    def add(self, raw: bytes) -> int:
        """The offset where a token of these bytes starts; moves past it."""
        pending = self._utf8.getstate()[0]
        start = self.chars
        if pending and raw and not 0x80 <= raw[0] < 0xC0:
            # NOTE: no continuation byte: the bytes the last token left become U+FFFD, its text
            start += len(pending.decode("utf-8", "replace"))
        self.chars += len(self._utf8.decode(raw))
        return start


def chat_logprobs(token_ids: list[int], logprobs: list | None, decode: TokenBytes) -> dict | None:
    if logprobs is None:
        return None

    def entry(tid, lp):
        raw = decode(tid)
        return {"token": token_text(raw), "logprob": finite(lp), "bytes": list(raw)}
    content = []
    for tid, (lp, top, *_) in zip(token_ids, logprobs):
        content.append({**entry(tid, lp), "top_logprobs": [entry(t, v) for t, v in top.items()]})
    return {"content": content}


# ---------------------------------------------------------------------------- bodies
def completion_body(rid: str, model: str, tracker: ChoiceTracker, decode: TokenBytes, echo=None, scores=None,
                    token_name: Callable[[int], str] | None = None, tails: list[bytes] | None = None,
                    skipped: frozenset = frozenset()) -> dict:
    """`echo`: per prompt (its text, ids, logprob pairs or None): the text and logprobs begin with
    the prompt's (the first token's logprob null, as OpenAI's); `scores`: per prompt (ids, pairs)
    of vLLM's prompt_logprobs (per prompt token a {token id: Logprob} dict, the first null);
    `tails`: per prompt the bytes it leaves open (TextOffset), without echo; `skipped`:
    completion_logprobs'."""
    choices = []
    for i, c in tracker.choices():
        text, ids, pairs = c.text, list(c.token_ids), c.logprob_pairs
        offset = TextOffset(tails[i // tracker.n]) if tails and echo is None else None
        start = 0
        if echo is not None:
            ptext, pids, ppairs = echo[i // tracker.n]
            text, ids, start = ptext + text, list(pids) + ids, len(pids)
            pairs = None if pairs is None or ppairs is None else [None, *ppairs, *pairs]
        choice = {"index": i, "text": text, "finish_reason": _reason(c.finish_reason), "stop_reason": _stop(c),
                  "logprobs": completion_logprobs(ids, pairs, decode, offset, skipped, start)}
        if scores is not None:
            choice["prompt_logprobs"] = prompt_logprobs_body(*scores[i // tracker.n], token_name)
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": tracker.usage()}


def echo_body(rid: str, model: str, echo: list, scores, n: int, decode: TokenBytes, token_name) -> dict:
    """echo with max_tokens 0 (OpenAI's and vLLM's): each prompt, n times, as the whole choice
    (its logprobs, the first null, with logprobs), nothing generated."""
    choices = []
    for p, (text, ids, pairs) in enumerate(echo):
        for k in range(n):
            choice = {"index": p * n + k, "text": text, "finish_reason": "length", "stop_reason": None,
                      "logprobs": None if pairs is None else completion_logprobs(list(ids), [None, *pairs], decode)}
            if scores is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(*scores[p], token_name)
            choices.append(choice)
    prompt = sum(len(ids) for _, ids, _ in echo)  # NOTE: as OpenAI's usage: each prompt once, whatever n
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}}


def prompt_logprobs_body(ids: list[int], pairs: list[tuple], token_name) -> list:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank,
    decoded_token}} holding the prompt's token first and the most likely ones."""
    from ..outputs import logprob_dict
    return [None] + [{str(t): dataclasses.asdict(v) for t, v in logprob_dict(tid, lp, rank, top, token_name).items()}
                     for tid, (lp, top, rank) in zip(ids[1:], pairs)]


def chat_body(rid: str, model: str, tracker: ChoiceTracker, decode: TokenBytes, tool_plan=None,
              reasoning_parser: str | None = None, include_reasoning: bool = True) -> dict:
    """`reasoning_parser`: the reply's <think> part goes to reasoning_content (and reasoning),
    the rest is the content (the tools' calls are read from that)."""
    choices = []
    for i, c in tracker.choices():
        text, thought = c.text, {}
        if reasoning_parser is not None:
            from .reasoning import split
            reasoning, text = split(reasoning_parser, text)
            reasoning = reasoning if include_reasoning else None
            thought = {"reasoning_content": reasoning, "reasoning": reasoning}
        message, reason, stop = {"role": "assistant", "content": text, **thought}, _reason(c.finish_reason), _stop(c)
        if tool_plan is not None and tool_plan.parses and text is not None:
            from .tools import parse
            content, calls = parse(tool_plan, text, ended_whole(c.finish_reason, getattr(c, "stop_reason", None)))
            if calls:
                message = {"role": "assistant", "content": content, **thought, "tool_calls": calls}
                # NOTE: stop_reason stays, as vLLM's: a call cut by a stop string says so
                reason = calls_finish_reason(reason, tool_plan.mode)
        choices.append({"index": i, "message": message, "finish_reason": reason, "stop_reason": stop,
                        "logprobs": chat_logprobs(c.token_ids, c.logprob_pairs, decode)})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": chat_usage(tracker, reasoning_parser, decode)}


def chat_usage(tracker: "ChoiceTracker", reasoning_parser: str | None, decode: TokenBytes) -> dict:
    """The usage of a chat answer; with a reasoning parser, its completion_tokens_details'
    reasoning_tokens too (OpenAI's field, which /v1/responses reports)."""
    usage = tracker.usage()
    if reasoning_parser is not None:
        from .reasoning import reasoning_tokens
        n = sum(reasoning_tokens(reasoning_parser, c.token_ids, decode) for _, c in tracker.choices())
        usage["completion_tokens_details"] = {"reasoning_tokens": n}
    return usage


def calls_finish_reason(finish_reason, mode: str) -> str:
    """The finish_reason of a choice that holds tool calls, as vLLM's: "length" where max_tokens cut
    it, whatever the mode (a required list whose last call was cut said "tool_calls", as if whole);
    "stop" for a named function's call; "tool_calls" otherwise."""
    return "length" if finish_reason == "length" else "stop" if mode == "named" else "tool_calls"


def ended_whole(finish_reason, stop_reason) -> bool:
    """The output ended by itself (EOS or a stop token), not cut by max_tokens or a stop string."""
    return finish_reason == "stop" and not isinstance(stop_reason, str)


def tool_calls_chunk(rid: str, model: str, created: int, index: int, calls: list[dict], include_usage: bool) -> dict:
    """The calls of choice `index`, whole, in one chunk (each with its index among the calls)."""
    delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    return _chunk(rid, "chat.completion.chunk", model, created, [choice], include_usage)


def completion_chunk(rid: str, model: str, created: int, piece: Piece, decode: TokenBytes,
                     include_usage: bool, offsets: dict[int, TextOffset], tail: bytes = b"",
                     skipped: frozenset = frozenset()) -> dict:
    """`offsets`: the text offset of each choice of the stream so far (updated); `tail`: the bytes
    the choice's prompt leaves open (TextOffset); `skipped`: completion_logprobs' (none for an
    echoed prompt's piece)."""
    if piece.index not in offsets:
        offsets[piece.index] = TextOffset(tail)
    offset = offsets[piece.index]
    choice = {"index": piece.index, "text": piece.text, "finish_reason": piece.finish_reason,
              "stop_reason": piece.stop_reason,
              "logprobs": completion_logprobs(piece.token_ids, piece.logprobs, decode, offset, skipped)}
    return _chunk(rid, "text_completion", model, created, [choice], include_usage)


def chat_chunk(rid: str, model: str, created: int, piece: Piece | None, index: int, decode: TokenBytes,
               include_usage: bool) -> dict:
    """A content chunk for `piece`, or (piece None) the opening chunk of choice `index`."""
    if piece is None:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
    else:
        choice = {"index": piece.index, "delta": {"content": piece.text} if piece.text else {},
                  "logprobs": chat_logprobs(piece.token_ids, piece.logprobs, decode),
                  "finish_reason": piece.finish_reason, "stop_reason": piece.stop_reason}
    return _chunk(rid, "chat.completion.chunk", model, created, [choice], include_usage)


def reasoning_chunk(rid: str, model: str, created: int, index: int, reasoning: str, include_usage: bool,
                    logprobs: dict | None = None) -> dict:
    """A delta of choice `index`'s reasoning (vLLM's reasoning_content, and reasoning, its newer name)."""
    choice = {"index": index, "delta": {"reasoning_content": reasoning, "reasoning": reasoning}, "logprobs": logprobs,
              "finish_reason": None}
    return _chunk(rid, "chat.completion.chunk", model, created, [choice], include_usage)


def usage_chunk(rid: str, object_: str, model: str, created: int, usage: dict) -> dict:
    return {"id": rid, "object": object_, "created": created, "model": model, "choices": [], "usage": usage}


def _chunk(rid, object_, model, created, choices, include_usage) -> dict:
    body = {"id": rid, "object": object_, "created": created, "model": model, "choices": choices}
    if include_usage:
        body["usage"] = None
    return body


def _reason(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length", "tool_calls") else None


def _stop(c) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the choice (an EOS id other
    than the tokenizer's counts as one); None for the tokenizer's EOS, a length limit, or a choice
    still running."""
    return getattr(c, "stop_reason", None) if c.finish_reason == "stop" else None
