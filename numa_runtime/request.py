"""Request: rank 0's state of one sequence as it moves through the scheduler."""
from __future__ import annotations

import enum
import time

from .sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASON = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                 RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


class Request:
    """One sequence. Its tokens are prompt + output; `num_computed_tokens` of them have their
    K/V in the cache. Scheduling is catching `num_computed_tokens` up with `num_tokens`."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks
        self.num_preemptions = 0
        self.prefix_counted = False  # its prefix-cache lookup is in the block manager's counters
        self.first_scheduled_time: float | None = None  # when its first chunk was scheduled (time.monotonic)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None  # when its latest output token came
        self.finished_time: float | None = None  # when it stopped (finished, aborted or failed)
        self.stop_reason: str | int | None = None
        self.logprobs: list = []  # per output token: (logprob, {token_id: logprob})
        self.bad_words_ids: list[list[int]] = []  # SamplingParams.bad_words as token sequences
        self.constraint = None  # SamplingParams.constraint as it was when the request was added

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASON.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.output_token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")
