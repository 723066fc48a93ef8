"""Rank 0 sampling: penalties, then temperature / top-k / top-p / min-p with per-request RNGs."""
from __future__ import annotations

import numpy as np

from .recorder import FORWARD, NULL_RECORDER
from .request import Request


_INT32_MAX = (1 << 31) - 1


def top_logprobs(row: np.ndarray, k: int) -> dict[int, float]:
    """The k most likely tokens of a log-probability row [V], most likely first: {token: logprob}."""
    if not k:
        return {}
    cand = np.argpartition(-row, k - 1)[:k]
    cand = cand[np.argsort(-row[cand], kind="stable")]
    return {int(t): float(row[t]) for t in cand}


def bad_word_bans(words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens bad_words forbid next (vLLM's rule): a one-token word always, a longer word's
    last token when the output ends with the rest of it."""
    out = []
    for w in words:
        if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:] == w[:-1]):
            out.append(w[-1])
    return out


def rank_of(row: np.ndarray, token: int) -> int:
    """A token's rank in a log-probability row (vLLM's Logprob.rank): the tokens at least as
    likely, itself included (vLLM counts ties so)."""
    return int(np.count_nonzero(row >= row[token]))


def _exhausted_sentence(sp, min_tokens_ban: bool) -> str:
    """The error of a request whose filters leave no token it may sample next."""
    what = [w for w, on in (("allowed_token_ids", sp.allowed_token_ids is not None), ("bad_words", bool(sp.bad_words)),
                            ("min_tokens (which bans EOS and stop_token_ids until then)", min_tokens_ban)) if on]
    return f"The request's {' and '.join(what)} leave no token it may sample next, so it ends here."


class Sampler:
    """Turns logits rows into one token per request. A request with a seed draws from its
    own generator, so its tokens do not depend on what else is in the batch. Order per row:
    the structured-output mask, logprobs (of that distribution: raw unless constrained, as vLLM),
    logit_bias, penalties, min_tokens bans, allowed_token_ids, bad_words, then sampling."""

    def __init__(self, ops, vocab_size: int, seed: int = 0, recorder=NULL_RECORDER, grammars=None):
        self.ops, self.recorder = ops, recorder
        self.grammars = grammars  # structured.Grammars: masks of requests with an output constraint
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self._rngs: dict[str, np.random.Generator] = {}
        # requests whose filters left no token to sample this step: {request id: the sentence}
        # (their row's token is no answer; the engine ends them with that error)
        self.exhausted: dict[str, str] = {}

    def forget(self, request_id: str) -> None:
        self._rngs.pop(request_id, None)
        self.exhausted.pop(request_id, None)

    def __call__(self, logits: np.ndarray, reqs: list[Request], eos_ids: set[int], argmax=None):
        """(token ids [N], per request None or (logprob of its token, {top token: logprob})).
        argmax: None, or [N] each row's argmax as the model computed it with the logits (greedy
        rows whose logits nothing changes take it instead of a pass over the row)."""
        with self.recorder.span(FORWARD, "sample"):
            return self._sample(logits, reqs, eos_ids, argmax)

    def _sample(self, logits: np.ndarray, reqs: list[Request], eos_ids: set[int], argmax=None):
        # logits: [N, V] f32, rows align with reqs; this step's own buffer, changed in place
        n = len(reqs)
        if n == 0:
            return np.zeros(0, np.int64), []
        # NOTE: as vLLM V1, the output constraint's mask comes first (its model runner applies the
        # grammar bitmask before the sampler): logprobs are of the tokens the constraint allows
        changed = False  # whether a row's logits were changed (argmax no longer holds)
        for i, r in enumerate(reqs):
            if r.constraint is not None and self.grammars is not None:
                self.grammars.mask(r.request_id, logits[i])
                changed = True
        logprobs = self._logprobs(logits, reqs)  # else of the raw distribution, before penalties
        for i, r in enumerate(reqs):
            sp = r.sampling_params
            if sp.logit_bias:
                ids, bias = zip(*sp.logit_bias.items())
                logits[i, list(ids)] += np.asarray(bias, np.float32)
                changed = True
            if sp.has_penalties:
                self._apply_penalties(logits[i], r)
                changed = True
            if r.num_output_tokens < sp.min_tokens:  # NOTE: as vLLM, EOS too when ignore_eos
                ban = list(sp.stop_token_ids) + list(eos_ids)
                logits[i, [t for t in ban if t < logits.shape[1]]] = -np.inf
                changed = True
            if sp.allowed_token_ids is not None:
                keep = np.zeros(logits.shape[1], bool)
                keep[sp.allowed_token_ids] = True
                logits[i, ~keep] = -np.inf
                changed = True
            if r.bad_words_ids:
                banned = [t for t in bad_word_bans(r.bad_words_ids, r.output_token_ids) if t < logits.shape[1]]
                if banned:
                    logits[i, banned] = -np.inf
                    changed = True
            # NOTE: a constrained request's grammar says so itself (its mask came first)
            if changed and r.constraint is None and (sp.allowed_token_ids is not None or r.bad_words_ids
                                                     or sp.min_tokens) and np.isneginf(logits[i]).all():
                self.exhausted[r.request_id] = _exhausted_sentence(sp, r.num_output_tokens < sp.min_tokens)
        ids = np.empty(n, np.int64)
        greedy = [r.sampling_params.is_greedy for r in reqs]
        # NOTE: argmax takes the lowest index on ties, as the sampling kernel does; an
        # all-greedy batch (the common case) is reduced in place, without a [N, V] copy.
        if all(greedy):
            ids[:] = logits.argmax(axis=1) if argmax is None or changed else argmax
            return ids, self._chosen_logprobs(logprobs, ids, n)
        greedy = np.array(greedy)
        if greedy.any():
            for i in np.flatnonzero(greedy):
                ids[i] = np.argmax(logits[i])
        rows = np.flatnonzero(~greedy)
        if rows.size:
            sps = [reqs[i].sampling_params for i in rows]
            ids[rows] = self.ops.sample(
                np.ascontiguousarray(logits[rows]),
                np.array([sp.temperature for sp in sps], np.float32),
                np.array([min(sp.top_k, _INT32_MAX) for sp in sps], np.int32),  # NOTE: >= the vocabulary: off
                np.array([sp.top_p for sp in sps], np.float32),
                np.array([sp.min_p for sp in sps], np.float32),
                np.array([self._rng_for(reqs[i]).random() for i in rows], np.float64))
        return ids, self._chosen_logprobs(logprobs, ids, n)

    @staticmethod
    def _chosen_logprobs(logprobs, ids: np.ndarray, n: int) -> list:
        """Per row: None, or (logprob of the chosen token, {top token: logprob}, its rank: 1 + the
        tokens more likely than it, as vLLM's Logprob.rank)."""
        if logprobs is None:
            return [None] * n
        out = []
        for i, x in enumerate(logprobs):
            if x is None:
                out.append(None)
                continue
            out.append((float(x[0][ids[i]]), x[1], rank_of(x[0], int(ids[i]))))
        return out

    def _logprobs(self, logits: np.ndarray, reqs: list[Request]):
        """Per row: None, or (log-probabilities [V], {top token: logprob}) when asked for."""
        want = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        if not want:
            return None
        lp = np.empty((len(want), logits.shape[1]), np.float32)
        self.ops.log_softmax(np.ascontiguousarray(logits[want], dtype=np.float32), lp)
        out = [None] * len(reqs)
        for row, i in enumerate(want):
            out[i] = (lp[row], top_logprobs(lp[row], reqs[i].sampling_params.logprobs))
        return out

    def _rng_for(self, r: Request) -> np.random.Generator:
        seed = r.sampling_params.seed
        if seed is None:
            return self.rng
        g = self._rngs.get(r.request_id)
        if g is None:
            g = self._rngs[r.request_id] = np.random.default_rng(seed)
        return g

    @staticmethod
    def _apply_penalties(row: np.ndarray, r: Request) -> None:
        # row: [V]; repetition over prompt + output (as HF / vLLM), presence and frequency over output
        sp, V = r.sampling_params, row.shape[0]
        if sp.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(r.all_token_ids, np.int64))
            seen = seen[seen < V]
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
        if (sp.presence_penalty or sp.frequency_penalty) and r.output_token_ids:
            ids, counts = np.unique(np.asarray(r.output_token_ids, np.int64), return_counts=True)
            keep = ids < V
            ids, counts = ids[keep], counts[keep]
            row[ids] -= sp.frequency_penalty * counts + sp.presence_penalty
