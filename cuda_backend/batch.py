"""Batch: a StepPlan's arrays on the device, sent in one host-to-device copy.

Every index array travels as int64 inside one packed buffer (the kernels read any integer
width), so a step costs one copy however many fields the plan has.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from numa_runtime.plan import StepPlan


@dataclass
class Batch:
    token_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    slot_mapping: torch.Tensor    # [T] int64, < 0: not written
    query_start: torch.Tensor     # [S+1] int64
    context_lens: torch.Tensor    # [S] int64
    block_tables: torch.Tensor    # [S, max_blocks] int64
    logits_indices: torch.Tensor  # [S'] int64
    max_query_len: int            # the most new tokens of one sequence (1 for decode)


def pack(plan: StepPlan) -> np.ndarray:
    """[ids T | positions T | slots T | query_start S+1 | context_lens S | block_tables S*MB | logits_indices S']"""
    return np.concatenate([plan.token_ids, plan.positions, plan.slot_mapping, plan.query_start,
                           plan.context_lens, plan.block_tables.reshape(-1), plan.logits_indices]).astype(np.int64)


def unpack(buf: torch.Tensor, num_tokens: int, num_seqs: int, max_blocks: int, num_logits: int,
           max_query_len: int) -> Batch:
    """Views into `buf` (laid out by `pack`)."""
    t, s = num_tokens, num_seqs
    sizes = [t, t, t, s + 1, s, s * max_blocks, num_logits]
    parts = list(torch.split(buf[:sum(sizes)], sizes))
    parts[5] = parts[5].view(s, max_blocks)
    return Batch(*parts, max_query_len=max_query_len)


class Uploader:
    """Sends plans to the device through one pinned staging buffer (grown on demand)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._dev = torch.empty(0, dtype=torch.int64, device=device)

    def _ensure(self, n: int) -> None:
        if self._host.numel() < n:
            cap = max(n, 2 * self._host.numel(), 4096)
            self._host = torch.empty(cap, dtype=torch.int64, pin_memory=self.pinned)
            self._dev = torch.empty(cap, dtype=torch.int64, device=self.device)

    def send(self, packed: np.ndarray, dst: torch.Tensor | None = None) -> torch.Tensor:
        """Copy `packed` to the device (into `dst` when given); returns the device tensor.
        NOTE: the staging buffer is reused by the next call; the engine synchronises on every
        step's logits, so the previous copy has completed by then."""
        n = packed.shape[0]
        self._ensure(n)
        self._host[:n].numpy()[...] = packed
        out = self._dev[:n] if dst is None else dst[:n]
        out.copy_(self._host[:n], non_blocking=self.pinned)
        return out

    def upload(self, plan: StepPlan) -> Batch:
        qs = plan.query_start
        max_q = int(np.max(np.diff(qs))) if plan.num_seqs else 0
        bt = plan.block_tables
        buf = self.send(pack(plan))
        return unpack(buf, plan.num_tokens, plan.num_seqs, bt.shape[1] if bt.ndim == 2 else 0,
                      plan.logits_indices.shape[0], max(max_q, 1))
