"""Reasoning output (vLLM's `--reasoning-parser`): the `<think>...</think>` part of a chat reply
goes to `reasoning_content` (and `reasoning`, vLLM's newer name), the rest to `content`.

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, Qwen3 thinking-2507): the chat template
  opens `<think>` in the prompt, so the reply is reasoning up to `</think>` whether or not it
  writes `<think>` itself (a `<think>` it writes is dropped, after other text too: vLLM drops
  that text as well in a body, not in a stream); a reply without `</think>` (cut by max_tokens) is
  all reasoning.
- `qwen3` (Qwen3 hybrid models): the reply reasons only when it opens with `<think>` (with
  `enable_thinking: false` the template writes an empty think block and the reply has none).

A stream and a body split the same text alike: `split` is a `ReasoningStream` fed the whole text.
Requests whose output structured output constrains (response_format, guided_json/regex/choice/
grammar, a tool_choice that calls a function) are not split: the constraint leaves no room to reason.
"""
from __future__ import annotations

import codecs

PARSERS = ("deepseek_r1", "qwen3")
_START, _END = "<think>", "</think>"


class ReasoningStream:
    """One choice's text as it arrives: feed(delta) -> (reasoning, content) to send now; finish()
    -> what was held back. Held back: a beginning of `<think>` at the start, a beginning of
    `</think>` at the end of the reasoning so far."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}.")
        self.parser, self.buf, self.state = parser, "", "start"   # start | reasoning | content
        self.opened = False  # a reasoning part began (the reply wrote <think>, or deepseek_r1's implied one)
        self.saw_start = False  # the reply wrote <think> (a later one in deepseek_r1's reasoning is dropped)

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(_START):
                self.buf, self.state, self.saw_start = head[len(_START):], "reasoning", True
            elif not head or _START.startswith(head):
                return "", ""  # NOTE: it may still open <think>
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
            self.opened = self.state == "reasoning"
        if self.state == "reasoning":
            i = self.buf.find(_END)
            if not self.saw_start:  # NOTE: deepseek_r1 after other text: the tag was kept in reasoning_content
                j = self.buf.find(_START)
                if j >= 0 and (i < 0 or j < i):
                    self.buf, self.saw_start = self.buf[:j] + self.buf[j + len(_START):], True
                    i = self.buf.find(_END)
            if i < 0:
                keep = max(_partial_suffix(self.buf, _END), 0 if self.saw_start else _partial_suffix(self.buf, _START))
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:i], self.buf[i + len(_END):], "content"
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is left: at the start, text that only began like `<think>` (content for qwen3,
        reasoning for deepseek_r1); in the reasoning, what began like `</think>`."""
        rest, self.buf = self.buf, ""
        if self.state == "content" or (self.state == "start" and self.parser == "qwen3"):
            return "", rest
        return rest, ""


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; None for an empty part, as vLLM returns them."""
    rs = ReasoningStream(parser)
    r1, c1 = rs.feed(text)
    r2, c2 = rs.finish()
    return (r1 + r2) or None, (c1 + c2) or None


def reasoning_tokens(parser: str, token_ids, token_bytes) -> int:
    """How many of a reply's tokens are its reasoning (the usage's reasoning_tokens, as vLLM
    counts them): those up to the one that completes `</think>`; all when the reply reasons and
    never closes it; none when it does not reason. `token_bytes`: a token's UTF-8 bytes."""
    rs, utf8 = ReasoningStream(parser), codecs.getincrementaldecoder("utf-8")(errors="replace")
    for k, t in enumerate(token_ids):
        rs.feed(utf8.decode(token_bytes(int(t))))
        if rs.state == "content":
            return k + 1 if rs.opened else 0
    # NOTE: never closed: all reasoning once opened (deepseek_r1's template opens it in the prompt)
    return len(token_ids) if rs.opened or (rs.state == "start" and parser == "deepseek_r1") else 0
