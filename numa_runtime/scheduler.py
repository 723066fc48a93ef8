"""Token-budget scheduler (vLLM v1 style): no prefill or decode phases.

Every request has `num_computed_tokens` catching up with `num_tokens` (prompt + output). Each
step spends at most `max_num_batched_tokens`: first on running requests in arrival order (a
decode takes 1 token, an unfinished prefill takes what is left, in chunks), then on waiting
requests first-come first-served, after applying their prefix-cache hits. A long prompt is
chunked, so it never stalls the decodes beside it. When the pool runs dry the newest running
request is preempted: it gives back its blocks and is recomputed later from scratch (prompt +
the tokens it already generated), so nothing is lost and no step over-commits the pool.

The scheduler decides *what* runs; the engine decides when a request stops (eos, length,
stop strings) and then calls `finish_request`.
"""
from __future__ import annotations

import time

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .kv_cache import BlockManager
from .plan import StepPlan
from .request import Request, RequestStatus


def _prompt_rows(req: Request, n: int) -> bool:
    """Whether the n rows a step takes of req are prompt rows (a prefill, or the recompute of a
    preempted sequence), not a decode row (one generated token of a running sequence)."""
    return n > 1 or req.num_computed_tokens < req.num_prompt_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256               # running requests at most
    max_num_batched_tokens: int = 2048    # new tokens per step at most
    max_model_len: int = 4096             # prompt + output tokens of one request at most
    long_prefill_token_threshold: int = 0  # > 0: cap on one request's prefill chunk per step
    sliding_window: int = 0               # > 0: every layer's window; older KV blocks are released

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError(f"sliding_window must be a non-negative integer, got {self.sliding_window!r}.")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be a non-negative integer, "
                             f"got {self.long_prefill_token_threshold!r}.")


@dataclass
class SchedulerOutput:
    plan: StepPlan
    scheduled: list[Request] = field(default_factory=list)     # in plan order
    num_scheduled_tokens: list[int] = field(default_factory=list)  # aligned with scheduled
    sampling: list[Request] = field(default_factory=list)      # aligned with plan.logits_indices
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def check_context(num_prompt: int, max_tokens: int | None, max_model_len: int) -> None:
    """ValueError (one sentence) for a prompt that leaves no room for an output token, or that
    max_tokens takes past the context (the one prompt-length check; the server runs it before
    work such a request would waste)."""
    if num_prompt > max_model_len:
        raise ValueError(f"The prompt has {num_prompt} tokens, more than the context holds (max_model_len="
                         f"{max_model_len}); shorten the prompt or raise max_model_len.")
    if num_prompt == max_model_len:
        raise ValueError(f"The prompt has {num_prompt} tokens, as many as the context holds (max_model_len="
                         f"{max_model_len}), which leaves no room for an output token; shorten the prompt or "
                         "raise max_model_len.")
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise ValueError(f"The prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds "
                         f"max_model_len ({max_model_len}); lower max_tokens or shorten the prompt.")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []        # oldest admission first
        self.num_steps = 0
        self.memory_bound = False  # the last schedule() left requests waiting for KV room
        self.num_preemptions = 0

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request; raise ValueError if it could never run."""
        self._check_fits(req)
        self.requests[req.request_id] = req
        req.status = RequestStatus.WAITING
        # NOTE: by arrival: a request that waited outside the scheduler (a prompt_logprobs request
        # waiting for KV room) goes ahead of those added after it, first come first served
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].arrival_time > req.arrival_time:
            i -= 1
        self.waiting.insert(i, req)

    def _check_fits(self, req: Request) -> None:
        cfg, bm = self.config, self.block_manager
        num_prompt, max_tokens = req.num_prompt_tokens, req.sampling_params.max_tokens
        if req.request_id in self.requests:
            raise ValueError(f"Request id {req.request_id!r} is already in use; give each request a unique id.")
        if num_prompt == 0:
            raise ValueError("The prompt is empty; give at least one token.")
        check_context(num_prompt, max_tokens, cfg.max_model_len)
        longest = cfg.max_model_len if max_tokens is None else num_prompt + max_tokens
        need = bm.num_blocks_for(longest)
        if cfg.sliding_window:  # blocks older than the window are released as it moves on
            # NOTE: a step holds a chunk of the prompt (at most all of it) and the window before it,
            # or one new token and the window; +1: the window need not start on a block boundary
            chunk = min(cfg.max_num_batched_tokens, num_prompt, self._window_chunk_cap(cfg.sliding_window - 1))
            need = min(need, max(bm.num_blocks_for(min(num_prompt, cfg.sliding_window - 1 + chunk)),
                                 bm.num_blocks_for(cfg.sliding_window)) + 1)
        if need > bm.num_blocks:
            window = bm.num_blocks_for(cfg.sliding_window) + 1 if cfg.sliding_window else 0
            if window > bm.num_blocks:
                raise ValueError(f"The model's sliding window of {cfg.sliding_window} tokens needs {window} KV "
                                 f"blocks but the cache has only {bm.num_blocks}; enlarge the KV cache.")
            raise ValueError(f"A request of up to {longest} tokens needs {need} KV blocks "
                             f"but the cache has only {bm.num_blocks}; lower max_tokens or enlarge the KV cache.")

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; its blocks are freed. False if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return True

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """The engine decided that req stops (or it was aborted): free its blocks."""
        assert status.is_finished, status
        if self.requests.pop(req.request_id, None) is None:
            return
        req.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = status

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.block_manager.num_uncomputed:  # NOTE: the last step was never updated: it did not run
            self.drop_uncomputed()
        budget = self.config.max_num_batched_tokens
        # NOTE: whether this step left requests waiting for KV room (a preemption, or an admission that did not
        # fit), not for its token budget or seats: the server's queue limit counts those as a backlog
        self.memory_bound = False
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        # 1. running requests, oldest first; the newest give their blocks back if needed
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req.num_tokens - req.num_computed_tokens, budget, req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while not self.block_manager.can_allocate(req, n):
                victim = self.running.pop()  # NOTE: index >= i, so never one already scheduled
                self._preempt(victim)
                preempted.append(victim)
                self.memory_bound = True
                if victim is req:
                    break
            else:
                self.block_manager.allocate(req, n)
                self.block_manager.cache_full_blocks(req, req.num_computed_tokens + n)
                scheduled.append((req, n))
                budget -= n
                i += 1

        # 2. waiting requests, first come first served (none if we just had to preempt); they
        # leave free the blocks reserved for a waiting scratch forward (block_manager.reserved_blocks)
        reserve = self.block_manager.reserved_blocks
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            blocks, num_cached = self.block_manager.get_computed_blocks(req)
            n = self._chunk(req.num_tokens - num_cached, budget, num_cached)
            if not self.block_manager.can_allocate(req, n, blocks, reserve):
                if self.running or scheduled or not blocks or reserve:
                    self.memory_bound = True
                    break
                # NOTE: nothing runs that could free blocks, so the prefix-cache hits are what
                # does not fit (a sliding-window model's prefix longer than the pool): recompute
                # the prefix rather than wait for ever
                blocks, num_cached = [], 0
                n = self._chunk(req.num_tokens, budget, 0)
                if not self.block_manager.can_allocate(req, n, blocks):
                    self.memory_bound = True
                    break
            self.block_manager.allocate(req, n, blocks)
            # NOTE: the full blocks this step computes are cached now, so that a request admitted
            # after this one in the same step hits them: each layer writes the KV of every row of
            # the step before any row's attention reads it (models/llama.py, the fused decode)
            self.block_manager.cache_full_blocks(req, req.num_computed_tokens + n)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

        self.num_steps += 1
        return self._make_output(scheduled, preempted)

    def _chunk(self, remaining: int, budget: int, computed: int) -> int:
        """The tokens a request with `computed` tokens in its KV takes this step."""
        n = min(remaining, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        if self.config.sliding_window:
            n = min(n, self._window_chunk_cap(min(computed, self.config.sliding_window - 1)))
        return n

    def _window_chunk_cap(self, behind: int) -> int:
        """Every layer slides: the largest chunk whose step fits the whole pool beside the `behind`
        tokens of the window before it (+1 block: the window need not start on a block boundary),
        so that a prompt longer than the pool runs in chunks it can hold (it was refused whenever
        max_num_batched_tokens was larger); a prompt the pool holds stays one chunk."""
        return max(1, (self.block_manager.num_blocks - 1) * self.block_manager.block_size - behind)

    def _preempt(self, req: Request, for_room: bool = True) -> None:
        """Back to the head of the waiting queue, its blocks freed; `for_room`: the pool was full
        (a preemption, counted: vllm:num_preemptions says the KV cache is too small), else it
        starts over for another reason (a cached block it used failed its check)."""
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        if for_room:
            req.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _make_output(self, scheduled: list[tuple[Request, int]], preempted: list[Request]) -> SchedulerOutput:
        """Lay the step out as StepPlan arrays (docs/structures.md): the decode rows first, then
        the prompt rows (StepPlan.num_prompt_rows), each kind in the order scheduled."""
        # NOTE: a mixed step runs its decode rows as a decode step would and its prompt rows as a
        # prompt step would (models/llama.py _rows_apart), each kind one run of rows
        decode, prompt = [], []
        for x in scheduled:
            (prompt if _prompt_rows(*x) else decode).append(x)
        scheduled = decode + prompt
        # NOTE: prompt rows keep their activations exact however few they are, so a prompt's KV
        # and logits do not switch path when the prefix cache held most of it (LlamaModel.forward,
        # qgemm's _decode_rows)
        prompt_rows = sum(n for _, n in prompt)
        bs = self.block_manager.block_size
        num_seqs = len(scheduled)
        num_tokens = sum(n for _, n in scheduled)
        max_blocks = max((len(r.block_ids) for r, _ in scheduled), default=0)
        token_ids = np.empty(num_tokens, np.int64)           # [T]
        positions = np.empty(num_tokens, np.int64)           # [T]
        slot_mapping = np.empty(num_tokens, np.int64)        # [T]
        query_start = np.zeros(num_seqs + 1, np.int32)       # [S+1]
        context_lens = np.empty(num_seqs, np.int32)          # [S]
        block_tables = np.zeros((num_seqs, max_blocks), np.int32)  # [S, max_blocks]
        logits_indices, sampling = [], []
        t = 0
        for s, (req, n) in enumerate(scheduled):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            row = block_tables[s, :len(req.block_ids)]
            row[:] = req.block_ids
            if n == 1:  # NOTE: a decode row, without the numpy temporaries of a chunk
                token_ids[t] = _token_slice(req, start, end)[0]
                positions[t] = start
                slot_mapping[t] = req.block_ids[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, end, dtype=np.int64)
                token_ids[t:t + n] = _token_slice(req, start, end)
                positions[t:t + n] = pos
                slot_mapping[t:t + n] = row.astype(np.int64)[pos // bs] * bs + pos % bs
            # NOTE: released blocks (outside the window) read as block 0; attention never reads them
            np.maximum(row, 0, out=row)
            context_lens[s] = end
            t += n
            query_start[s + 1] = t
            if end == req.num_tokens:  # its last token is in this step: it samples
                logits_indices.append(t - 1)
                sampling.append(req)
        tier = self.block_manager.tier
        plan = StepPlan(token_ids, positions, slot_mapping, query_start, context_lens, block_tables,
                        np.asarray(logits_indices, dtype=np.int64), step_id=self.num_steps,
                        tier_ops=tier.take_ops() if tier is not None else None, num_prompt_rows=prompt_rows)
        return SchedulerOutput(plan, [r for r, _ in scheduled], [n for _, n in scheduled], sampling, preempted)

    def extend_decode(self, out: SchedulerOutput, steps: int) -> bool:
        """Give each request of a step of decode rows blocks for `steps` tokens and widen the
        plan's block tables to them, for a burst of that many decode steps (the engine then calls
        update once a step). False, with nothing changed, when the pool lacks the blocks."""
        bm = self.block_manager
        if sum(bm._num_new_blocks(r, steps, ()) for r in out.scheduled) > bm.num_free_blocks:
            return False
        for r in out.scheduled:
            bm.allocate(r, steps)
        bt = np.zeros((len(out.scheduled), max(len(r.block_ids) for r in out.scheduled)), np.int32)
        for s, r in enumerate(out.scheduled):
            bt[s, :len(r.block_ids)] = r.block_ids
        np.maximum(bt, 0, out=bt)  # NOTE: released blocks (outside the window) read as block 0
        out.plan.block_tables = bt
        return True

    def update(self, out: SchedulerOutput, sampled_token_ids) -> None:
        """After the model ran `out.plan`: advance what was computed, cache newly full blocks,
        append one sampled token to each request in `out.sampling`."""
        assert len(sampled_token_ids) == len(out.sampling), "one sampled token per sampling request"
        self.block_manager.commit_computed()
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            if req.is_finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += n
            self.block_manager.cache_full_blocks(req)
            if self.config.sliding_window:
                # the next query (position num_computed_tokens) sees keys from here on
                self.block_manager.release_before(req, req.num_computed_tokens - self.config.sliding_window + 1)
        for req, token_id in zip(out.sampling, sampled_token_ids):
            if not req.is_finished:
                req.append_output_token(int(token_id))

    def redo_without(self, out: SchedulerOutput, bad_hashes: set[int]) -> None:
        """`out.plan` did not run: a block it loaded from a cache tier failed its check on some
        rank. Those blocks leave the cache; the requests that used them start over (like a
        preemption); the other scheduled requests simply run again next step."""
        bm = self.block_manager
        for req in out.scheduled:
            if not req.is_finished and bad_hashes.intersection(req.block_hashes[:len(req.block_ids)]):
                self.running.remove(req)
                self._preempt(req, for_room=False)
                if req.num_output_tokens == 0:  # NOTE: it never ran: its next admission is its first
                    bm.uncount(req)
        for h in bad_hashes:
            bm.uncache(h)
        # NOTE: loads that failed were no tier hits (counted as they were queued)
        bm.tier_hit_blocks = max(0, bm.tier_hit_blocks - len(bad_hashes))
        self.drop_uncomputed()

    def drop_uncomputed(self) -> None:
        """The step scheduled last did not run (no update came): the blocks schedule() cached
        ahead of their KV leave the prefix cache, and a running request that took one of them as
        a prefix hit starts over (like a preemption); the others simply run again next step."""
        bm = self.block_manager
        gone = bm.uncache_uncomputed()
        if not gone:
            return
        bs = bm.block_size
        # NOTE: the newest first, so that the waiting queue keeps their order
        hit = [r for r in reversed(self.running) if not gone.isdisjoint(r.block_ids[:r.num_computed_tokens // bs])]
        for req in hit:
            self.running.remove(req)
            self._preempt(req, for_room=False)
            if req.num_output_tokens == 0:  # NOTE: it never ran: its next admission is its first
                bm.uncount(req)

    # ---- stats ---------------------------------------------------------------------------
    @property
    def prefix_cache_hits(self) -> int:
        """Tokens served by the prefix cache since start."""
        return self.block_manager.hit_tokens

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache since start (one lookup per admission)."""
        return self.block_manager.query_tokens

    def stats(self) -> dict:
        bm = self.block_manager
        return {"num_running": self.num_running, "num_waiting": self.num_waiting,
                "kv_usage": bm.usage, "prefix_cache_hits": bm.hit_tokens,
                "prefix_cache_queries": bm.query_tokens, "prefix_cache_hit_rate": bm.hit_rate,
                "num_preemptions": self.num_preemptions, "num_evictions": bm.num_evictions,
                "disk_tier_hit_blocks": bm.tier_hit_blocks}


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    """req.all_token_ids[start:end] without copying the whole sequence (decodes take 1)."""
    p = req.num_prompt_tokens
    if start >= p:
        return req.output_token_ids[start - p:end - p]
    if end <= p:
        return req.prompt_token_ids[start:end]
    return req.prompt_token_ids[start:] + req.output_token_ids[:end - p]
