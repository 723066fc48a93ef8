"""CUDA graphs of decode steps, one per batch-size bucket, captured at start-up.

A decode step (one new token per sequence, every sequence samples) of n sequences runs as
the graph of the smallest bucket >= n; the rows past n are padding that writes no KV (slot
-1) and reads none (context 0). Any other step (prefill, mixed, larger than every bucket)
runs eagerly. Every bucket's graph reads its inputs from its own device buffer, refilled by
one copy per step.
"""
from __future__ import annotations

import numpy as np
import torch

from numa_runtime.plan import StepPlan

from .batch import Uploader, unpack

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, buf: torch.Tensor, logits: torch.Tensor):
        self.graph, self.buf, self.logits = graph, buf, logits  # logits: [bucket, vocab] f32


class DecodeGraphs:
    def __init__(self, model, uploader: Uploader, max_num_seqs: int, max_blocks: int):
        self.model, self.uploader, self.max_blocks = model, uploader, max_blocks
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Captured] = {}
        self.num_replays = 0

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (smaller graphs reuse its memory pool), so
        that no request waits for a capture while serving."""
        for size in reversed(self.buckets):
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)

    def accepts(self, plan: StepPlan) -> bool:
        n = plan.num_seqs
        return (0 < n <= self.buckets[-1] and plan.num_tokens == n and plan.logits_indices.shape[0] == n
                and plan.block_tables.shape[1] <= self.max_blocks)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _pack(self, plan: StepPlan | None, size: int) -> np.ndarray:
        """The pack() layout for `size` rows: the plan's n sequences, then padding rows."""
        n = 0 if plan is None else plan.num_seqs
        ids, pos = np.zeros(size, np.int64), np.zeros(size, np.int64)
        slots, ctx = np.full(size, -1, np.int64), np.zeros(size, np.int64)
        bt = np.zeros((size, self.max_blocks), np.int64)
        if n:
            ids[:n], pos[:n], slots[:n], ctx[:n] = plan.token_ids, plan.positions, plan.slot_mapping, plan.context_lens
            bt[:n, :plan.block_tables.shape[1]] = plan.block_tables
        qs = np.arange(size + 1, dtype=np.int64)
        return np.concatenate([ids, pos, slots, qs, ctx, bt.reshape(-1), np.arange(size, dtype=np.int64)])

    def _capture(self, size: int) -> _Captured:
        packed = self._pack(None, size)
        buf = torch.zeros(packed.shape[0], dtype=torch.int64, device=self.model.device)
        buf.copy_(torch.from_numpy(packed))
        batch = unpack(buf, size, size, self.max_blocks, size, 1)
        # NOTE: one eager run first, on a side stream, compiles every Triton kernel for these
        # shapes; nothing may compile while the graph is being captured.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.forward(batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(batch)
        return _Captured(graph, buf, logits)

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits [n, vocab] f32 of decode plan `plan` (accepts(plan) must hold)."""
        size = self.bucket(plan.num_seqs)
        cap = self.graphs.get(size)
        if cap is None:
            cap = self.graphs[size] = self._capture(size)
        self.uploader.send(self._pack(plan, size), dst=cap.buf)
        cap.graph.replay()
        self.num_replays += 1
        return cap.logits[:plan.num_seqs]
