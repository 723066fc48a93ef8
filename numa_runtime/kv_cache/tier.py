"""The interface between the block manager and a lower KV cache tier (disk, pinned host memory).

The block manager stays plain Python over integers: it only tells a tier which block ids and
chained block hashes move, and the tier turns that into ops the ranks carry out before the
next step runs (the StepPlan's `tier_ops`; the model runner or the GPU executor moves the
bytes). One op is one row `(op, block_id, hash_lo, hash_hi)` of an int64 array.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

OP_SAVE, OP_LOAD, OP_DELETE = 1, 2, 3  # block -> tier, tier -> block, forget a hash


class KVTier(Protocol):
    def offload(self, block_id: int, block_hash: int) -> None:
        """Cached block `block_id` (hash `block_hash`) is about to be evicted from the pool:
        keep a copy if the tier wants it. Its bytes must be saved before the block is reused."""

    def lookup(self, block_hash: int) -> bool:
        """Whether the block can come back from this tier (and coming back beats recomputing)."""

    def load(self, block_hash: int, block_id: int) -> None:
        """Bring `block_hash` into pool block `block_id` before the next step reads it."""

    def drop(self, block_hash: int) -> None:
        """Forget `block_hash` (its copy failed a check on some rank)."""

    def take_ops(self) -> np.ndarray:
        """[K, 4] int64: the ops queued since the last call, in order, for the next plan."""


def split_hash(h: int) -> tuple[int, int]:
    """A 128-bit block hash as two int64 words (two's complement) for a plan row."""
    lo, hi = h & 0xFFFF_FFFF_FFFF_FFFF, h >> 64
    return tuple(int(x) for x in np.array([lo, hi], np.uint64).view(np.int64))


def join_hash(lo: int, hi: int) -> int:
    """The inverse of split_hash."""
    lo_u, hi_u = (int(x) for x in np.array([lo, hi], np.int64).view(np.uint64))
    return lo_u | (hi_u << 64)


def ops_array(rows: list[tuple[int, int, int]]) -> np.ndarray:
    """[(op, block_id, hash)] -> [K, 4] int64 plan rows."""
    out = np.zeros((len(rows), 4), np.int64)  # [K, 4]
    for i, (op, block_id, h) in enumerate(rows):
        out[i] = (op, block_id, *split_hash(h))
    return out
