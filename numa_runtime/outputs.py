"""What the engine returns, and the per-request text state that produces it (detokenization,
stop strings, streaming deltas that never split a character or leak a stop string).

An output costs O(what it adds), not O(length): `delta`, `new_token_ids` and `new_logprobs`
are what it adds to the previous output of its request; `text`, `token_ids` and `logprobs`
(everything so far) are views over the request's append-only lists, built when read.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

from .request import Request, RequestStatus


class Prefix(Sequence):
    """The first `n` items of an append-only list, without copying them (a read-only list)."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None):
        self._items, self._n = items, len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._items[:self._n][i]
        if not -self._n <= i < self._n:
            raise IndexError("index out of range")
        return self._items[i % self._n]

    def __iter__(self):
        return iter(self._items[:self._n])

    def __eq__(self, other):
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))

    def copy(self) -> list:
        """The items as a new list (list.copy's name: what a script keeps or serializes)."""
        return list(self)

    def __add__(self, other):  # NOTE: as a list: prefix + [ids] is a new list
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)

    __hash__ = None  # as a list's


@dataclass
class Logprob:
    """vLLM's: a token's log-probability, its rank in the vocabulary (1: the most likely) and its
    text on its own."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_dict(token: int, logprob: float, rank: int | None, top: dict, name) -> dict[int, "Logprob"]:
    """vLLM's per-position dict: `token` (sampled, or the prompt's) first with its rank, then the
    most likely tokens ranked 1.. (a token in both keeps its first place, as vLLM V1's)."""
    d = {token: Logprob(logprob, rank, name(token))}
    for r, (t, v) in enumerate(top.items(), 1):
        d.setdefault(t, Logprob(v, r, name(t)))
    return d


class CompletionOutput:
    """One sequence of a request, as of one output. `logprobs` (when asked for) is vLLM's: per
    token a dict {token id: Logprob} of the most likely tokens and the sampled one;
    `logprob_pairs` the same as (sampled logprob, {token id: logprob}, sampled rank) tuples."""

    def __init__(self, index: int, text: str | Callable[[], str], token_ids: Sequence[int],
                 finish_reason: str | None = None, stop_reason: str | int | None = None,
                 logprobs: Sequence | None = None, delta: str = "", new_token_ids: list[int] | None = None,
                 new_logprobs: list | None = None, token_text: Callable[[int], str] | None = None):
        self.index = index
        self._text = text                # str, or a function that builds it (once, when read)
        self.token_ids = token_ids       # every output token so far
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.logprob_pairs = logprobs    # per token: (logprob, {token_id: logprob}, rank); None unless asked
        self.delta = delta               # text added since the previous output of this request
        self.new_token_ids = list(token_ids) if new_token_ids is None else new_token_ids
        self.new_logprobs = new_logprobs if new_logprobs is not None or logprobs is None else list(logprobs)
        self._token_text = token_text    # a token id's text (Logprob.decoded_token)
        self._logprobs = None
        # this sequence's own (first token, latest token, end) on time.monotonic's clock, None until each
        # happens (the server's per-sequence metrics; RequestOutput.metrics gives the request's)
        self.times: tuple = (None, None, None)

    @property
    def text(self) -> str:
        if not isinstance(self._text, str):
            self._text = self._text()
        return self._text

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        """vLLM's per-token dicts (built once, when read); None unless logprobs were asked for."""
        pairs = self.logprob_pairs
        if pairs is None:
            return None
        if self._logprobs is None or len(self._logprobs) != len(pairs):
            name = self._token_text or (lambda t: None)
            self._logprobs = [logprob_dict(tid, lp, rank[0] if rank else None, top, name)
                              for tid, (lp, top, *rank) in zip(self.token_ids, pairs)]
        return self._logprobs

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' log-probabilities (vLLM's); None unless logprobs were asked for."""
        pairs = self.logprob_pairs
        return None if pairs is None else float(sum(x[0] for x in pairs))

    def finished(self) -> bool:
        """vLLM's: whether this sequence has ended (it has a finish_reason)."""
        return self.finish_reason is not None

    def __getstate__(self) -> dict:
        """Pickled with its text built (the builder is a closure) and its logprobs' texts."""
        _ = self.logprobs
        return {**self.__dict__, "_text": self.text, "_token_text": None}

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids!r}, "
                f"finish_reason={self.finish_reason!r})")


class RequestMetrics(dict):
    """RequestOutput.metrics: the request's times on time.monotonic's clock (arrival_time,
    last_token_time, first_scheduled_time, first_token_time, finished_time, each None until it
    happens) and time_in_queue (seconds from arrival to first scheduled), read as vLLM's
    RequestMetrics attributes or as a dict."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"RequestMetrics has no {name!r}") from None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=RequestMetrics)
    prompt_logprobs: list | None = None  # vLLM's: None, then per prompt token {token id: Logprob}

    # NOTE: n=1 is the common case; these read the first completion.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> Sequence[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self):
        return self.outputs[0].logprobs

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob


class TextState:
    """Text of one sequence as tokens arrive: decides stops and the next streamable delta.

    The text is `sent` (deltas handed out, append-only) + `unsent` (at most the stop-string
    hold-back plus the newest piece), so no step touches the whole text.
    """

    def __init__(self, req: Request, detokenizer, group, eos_ids: set[int], primary_eos: int | None):
        self.req = req
        self.group = group  # the user request (n sequences) this one belongs to
        self.detok = detokenizer
        sp = req.sampling_params
        self.stop = sp.stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
        self.primary_eos = primary_eos
        self.sent: list[str] = []   # deltas handed out
        self.unsent = ""            # text not handed out yet (stop string already cut)
        self.num_sent_tokens = 0    # tokens handed out in outputs

    def add_token(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """Account for the token just appended to req; return a finished status or None."""
        req, sp = self.req, self.req.sampling_params
        checks = req.num_output_tokens >= sp.min_tokens  # NOTE: as vLLM, no stop before min_tokens
        # NOTE: as vLLM's detokenizer, a stop string counts only after min_tokens tokens (a stop token
        # may be the min_tokens-th: the sampler bans them before)
        strings = req.num_output_tokens > sp.min_tokens
        if token_id in self.stop_ids and checks:
            # NOTE: as vLLM: the EOS the tokenizer config names stops with no reason; another EOS id (a
            # generation config's list, which vLLM turns into stop_token_ids) and a stop token id name
            # themselves (every EOS where the tokenizer config names none)
            req.stop_reason = token_id if token_id in sp.stop_token_ids or token_id != self.primary_eos else None
            prev_len = len(self.unsent)
            self.unsent += self.detok.add(token_id) if sp.include_stop_str_in_output else ""
            self.unsent += self.detok.flush()
            self._cut_at_stop(prev_len)  # NOTE: released text is checked too (a stop string never shows)
            return RequestStatus.FINISHED_STOPPED
        prev_len = len(self.unsent)  # NOTE: unsent holds at least the last `hold` characters
        self.unsent += self.detok.add(token_id)
        if strings and self._cut_at_stop(prev_len):
            return RequestStatus.FINISHED_STOPPED
        if (sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens) or req.num_tokens >= max_model_len:
            prev_len = len(self.unsent)
            self.unsent += self.detok.flush()
            return RequestStatus.FINISHED_STOPPED if strings and self._cut_at_stop(prev_len) \
                else RequestStatus.FINISHED_LENGTH
        return None

    def _cut_at_stop(self, prev_len: int) -> bool:
        """Cut the text at the earliest stop string that ends in what came after unsent[:prev_len]
        (the first to end of those that start there); True if one did. A stop whole in older text
        (shown before min_tokens) does not count. NOTE: the earliest, as OpenAI and llama.cpp: vLLM
        takes the first in the list's order, and when a token completed two, ["oke", " to"] on
        " toke" cut inside " to" (and with include_stop_str_in_output the text held " to")."""
        sp = self.req.sampling_params
        best = None
        for s in self.stop:
            j = self.unsent.find(s, max(0, prev_len - len(s) + 1))
            if j >= 0 and (best is None or (j, j + len(s)) < (best[0], best[0] + len(best[1]))):
                best = (j, s)
        if best is None:
            return False
        j, s = best
        self.unsent = self.unsent[:j + (len(s) if sp.include_stop_str_in_output else 0)]
        self.req.stop_reason = s
        return True

    def finish(self, status: RequestStatus, cut_at_stop: bool = True) -> RequestStatus:
        """The engine ends the sequence for its own reason: release the held-back text (cut at a
        stop string it completes, unless not `cut_at_stop`)."""
        prev_len = len(self.unsent)
        self.unsent += self.detok.flush()
        if cut_at_stop and self.req.num_output_tokens > self.req.sampling_params.min_tokens:
            self._cut_at_stop(prev_len)
        return status

    def take_delta(self, finished: bool) -> str:
        # NOTE: while running, hold back the characters that could start a stop string.
        end = len(self.unsent) if finished or not self.stop else max(0, len(self.unsent) - self.hold)
        delta, self.unsent = self.unsent[:end], self.unsent[end:]
        if delta:
            self.sent.append(delta)
        return delta

    def output(self, index: int) -> CompletionOutput:
        """The next output of this sequence: O(new tokens), whatever its length."""
        req = self.req
        delta = self.take_delta(req.is_finished)
        n, start = req.num_output_tokens, self.num_sent_tokens
        self.num_sent_tokens = n
        lps = req.logprobs if req.sampling_params.logprobs is not None else None
        sent, k = self.sent, len(self.sent)
        # NOTE: a request's last output carries plain lists (one O(L) copy, once), so what users
        # keep is an ordinary list; outputs along the way are O(1) views.
        view = (lambda items: list(items[:n])) if req.is_finished else (lambda items: Prefix(items, n))
        # NOTE: `text` is what was sent: while running, the characters held back for a stop string
        # are not in it (vLLM's running text); they were shown, then cut when the stop completed
        out = CompletionOutput(index, lambda: "".join(sent[:k]), view(req.output_token_ids),
                               req.finish_reason, req.stop_reason, None if lps is None else view(lps),
                               delta, req.output_token_ids[start:n], None if lps is None else lps[start:n],
                               self.detok.tokenizer.decoded_token if lps is not None else None)
        out.times = (req.first_token_time, req.last_token_time, req.finished_time)
        return out
