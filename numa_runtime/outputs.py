"""What the engine returns, and the per-request text state that produces it (detokenization,
stop strings, streaming deltas that never split a character or leak a stop string)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request, RequestStatus


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list | None = None  # per token: (logprob, {token_id: logprob})
    delta: str = ""               # text added since the previous output of this request


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)

    # NOTE: n=1 is the common case; these read the first completion.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self):
        return self.outputs[0].logprobs


class TextState:
    """Text of one sequence as tokens arrive: decides stops and the next streamable delta."""

    def __init__(self, req: Request, detokenizer, group, eos_ids: set[int]):
        self.req = req
        self.group = group  # the user request (n sequences) this one belongs to
        self.detok = detokenizer
        sp = req.sampling_params
        self.stop = sp.stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
        self.text = ""      # text so far (stop string already cut)
        self.emitted = 0    # characters handed out as deltas

    def add_token(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """Account for the token just appended to req; return a finished status or None."""
        req, sp = self.req, self.req.sampling_params
        if token_id in self.stop_ids and req.num_output_tokens >= sp.min_tokens:
            req.stop_reason = token_id if token_id in sp.stop_token_ids else None
            self.text += self.detok.add(token_id) if sp.include_stop_str_in_output else ""
            self.text += self.detok.flush()
            return RequestStatus.FINISHED_STOPPED
        prev_len = len(self.text)
        self.text += self.detok.add(token_id)
        if self.stop and req.num_output_tokens >= sp.min_tokens:
            start = max(0, prev_len - self.hold)
            for s in self.stop:
                j = self.text.find(s, start)
                if j >= 0:
                    self.text = self.text[:j + (len(s) if sp.include_stop_str_in_output else 0)]
                    req.stop_reason = s
                    return RequestStatus.FINISHED_STOPPED
        if (sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens) or req.num_tokens >= max_model_len:
            self.text += self.detok.flush()
            return RequestStatus.FINISHED_LENGTH
        return None

    def take_delta(self, finished: bool) -> str:
        # NOTE: while running, hold back the characters that could start a stop string.
        end = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
