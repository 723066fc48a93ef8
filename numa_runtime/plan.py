"""StepPlan: the plain-data message rank 0 broadcasts every step; workers see nothing else."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EXECUTE, SHUTDOWN, PROFILE, EMBED = 1, 2, 3, 4  # EMBED: final hidden states, no lm_head
# NOTE: a PROFILE plan carries no step: its step_id is the action every rank takes on its
# operator profile (recorder.py / profiler.py); GATHER and TRACE answer with comm.gather_object.
PROFILE_GATHER, PROFILE_RESET, PROFILE_TRACE = 1, 2, 3
_FIELDS = ("token_ids", "positions", "slot_mapping", "query_start", "context_lens",
           "block_tables", "logits_indices", "tier_ops")
_HEADER = 5  # kind, step_id, num_seqs, max_blocks, num_prompt_rows


@dataclass
class StepPlan:
    token_ids: np.ndarray       # [T] int64
    positions: np.ndarray       # [T] int64
    slot_mapping: np.ndarray    # [T] int64
    query_start: np.ndarray     # [S+1] int32
    context_lens: np.ndarray    # [S] int32
    block_tables: np.ndarray    # [S, max_blocks] int32
    logits_indices: np.ndarray  # [S'] int64
    kind: int = EXECUTE
    step_id: int = 0
    # [K, 4] int64 rows (op, block_id, hash_lo, hash_hi): KV blocks every rank saves to, loads
    # from or deletes in a cache tier before the step runs (kv_cache/disk_tier.py)
    tier_ops: np.ndarray | None = None
    # rows that compute prompt tokens (or recompute a preempted sequence's), as opposed to decode
    # rows (one generated token of a running sequence); the decode rows come first (the
    # scheduler lays them out so), the prompt rows are the last num_prompt_rows; -1: not said
    # (plans built by hand), and then a step of one row per sequence counts as decode rows
    num_prompt_rows: int = -1

    @property
    def decode_only(self) -> bool:
        """Every row is a decode row: the kernels may take int8 activations for the whole batch."""
        if self.num_prompt_rows >= 0:
            return self.num_prompt_rows == 0 and self.num_tokens > 0
        return self.num_tokens == self.num_seqs

    def __post_init__(self):
        if self.tier_ops is None:
            self.tier_ops = np.zeros((0, 4), np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @classmethod
    def empty(cls, tier_ops: np.ndarray | None = None) -> "StepPlan":
        """A step that runs no tokens (only its tier ops)."""
        return cls._empty(EXECUTE, 0, tier_ops)

    @classmethod
    def shutdown(cls) -> "StepPlan":
        return cls._empty(SHUTDOWN, 0)

    @classmethod
    def profile(cls, action: int) -> "StepPlan":
        """Ask every rank to take a profiler action (PROFILE_GATHER / _RESET / _TRACE)."""
        return cls._empty(PROFILE, action)

    @classmethod
    def _empty(cls, kind: int, step_id: int, tier_ops: np.ndarray | None = None) -> "StepPlan":
        e64, e32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
        return cls(e64, e64, e64, np.zeros(1, np.int32), e32, np.zeros((0, 0), np.int32), e64,
                   kind=kind, step_id=step_id, tier_ops=tier_ops)

    def to_buffer(self) -> np.ndarray:
        """Pack into one int64 array: header, field lengths, then the fields."""
        parts = [np.asarray(getattr(self, f)).reshape(-1).astype(np.int64) for f in _FIELDS]
        header = np.array([self.kind, self.step_id, self.num_seqs,
                           self.block_tables.shape[1] if self.block_tables.ndim == 2 else 0, self.num_prompt_rows]
                          + [len(p) for p in parts], dtype=np.int64)
        return np.concatenate([header] + parts)

    @classmethod
    def from_buffer(cls, buf: np.ndarray) -> "StepPlan":
        kind, step_id, num_seqs, max_blocks, num_prompt_rows = (int(x) for x in buf[:_HEADER])
        lens = buf[_HEADER:_HEADER + len(_FIELDS)]
        off = _HEADER + len(_FIELDS)
        arrays = {}
        for name, n in zip(_FIELDS, lens):
            arrays[name] = buf[off:off + n]
            off += int(n)
        for name in ("query_start", "context_lens", "block_tables"):
            arrays[name] = arrays[name].astype(np.int32)
        arrays["block_tables"] = arrays["block_tables"].reshape(num_seqs, max_blocks)
        arrays["tier_ops"] = arrays["tier_ops"].reshape(-1, 4)
        return cls(kind=kind, step_id=step_id, num_prompt_rows=num_prompt_rows,
                   **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
