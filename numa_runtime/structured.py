"""Structured output: a JSON schema enforced while sampling (rank 0).

llguidance (a maintained grammar engine) reads the model's own tokenizer.json and, for each
request with `SamplingParams.json_schema`, keeps a matcher that says which tokens may come
next. The sampler masks the others out; the engine feeds each sampled token back and ends the
request when the schema is complete.
"""
from __future__ import annotations

import threading

import numpy as np


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - the bitmask helpers
    except ImportError:
        raise ValueError("json_schema needs the llguidance package; install it with "
                         "`pip install llguidance`.") from None
    return llguidance


# NOTE: json.dumps' layout; flexible whitespace would let a model spend its tokens on newlines.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """The grammar matchers of the requests that have a json_schema, by request id."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self._tokenizer, self._vocab, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._matchers: dict = {}

    def prepare(self):
        """Build llguidance's view of the tokenizer (about a second for 50k tokens; once)."""
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _llguidance()
                self._ll_tokenizer = llg.LLTokenizer(self._tokenizer.to_json(), n_vocab=self._vocab,
                                                     eos_token=self._eos)
        return self._ll_tokenizer

    def add(self, request_id: str, schema: dict) -> None:
        """Start a matcher for the request; ValueError if the schema cannot be used."""
        llg = _llguidance()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=_LAYOUT)
        except (ValueError, TypeError) as e:
            raise ValueError(f"json_schema cannot be used: {e}.") from None
        matcher = llg.LLMatcher(self.prepare(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"json_schema cannot be used: {matcher.get_error().rstrip('.')}.")
        self._matchers[request_id] = matcher

    def mask(self, request_id: str, row: np.ndarray) -> None:
        """Set the logits of tokens the schema forbids next to -inf. row: [V] f32, in place."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask
        bits = allocate_token_bitmask(1, self._vocab)  # [1, ceil(V / 32)] int32
        fill_next_token_bitmask(matcher, bits)
        apply_token_bitmask_inplace(row[None, :], bits)

    def advance(self, request_id: str, token_id: int) -> bool:
        """Feed the sampled token; True when the request must end (the schema is complete, or
        the token broke it, which only a ban on every allowed token can cause)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        return not matcher.consume_token(int(token_id)) or matcher.is_stopped()

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
