"""HostKVPool: pinned host memory behind the device KV cache, and the copies between them.

The bookkeeping (which block goes to which slot, and when) is the host tier's
(numa_runtime.kv_cache.host_tier); this class only moves bytes:

- swap-outs (device block -> host slot) go on the compute stream before the step's forward,
  so they read a block before this step's new tokens overwrite it;
- swap-ins (host slot -> device block) go on a side stream in a few groups of layers, each
  group followed by an event; layer i of the forward waits for its group's event only, so
  the copies of later layers overlap the compute of earlier ones.
"""
from __future__ import annotations

import time

import torch


class HostKVPool:
    def __init__(self, kv_cache: torch.Tensor, num_slots: int, num_groups: int = 4):
        # kv_cache: [NB, L, 2, BS, Hk, D] on the device; host: [num_slots, L, 2, BS, Hk, D] pinned.
        # A block (all layers) is contiguous on both sides: a swap-out is one copy per block.
        self.kv = kv_cache
        self.num_layers = kv_cache.shape[1]
        on_gpu = kv_cache.device.type == "cuda"
        self.host = torch.zeros((num_slots,) + tuple(kv_cache.shape[1:]), dtype=kv_cache.dtype, pin_memory=on_gpu)
        self.stream = torch.cuda.Stream(kv_cache.device) if on_gpu else None
        # swap-ins go in layer groups (one copy per block and group): layer i waits for its group
        g = max(1, min(num_groups, self.num_layers))
        bounds = [self.num_layers * j // g for j in range(g + 1)]
        self.groups = [(bounds[j], bounds[j + 1]) for j in range(g)]
        self.group_of = [j for j, (a, b) in enumerate(self.groups) for _ in range(a, b)]

    def copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]):
        """Issue the copies; returns layer_ready(i) for the forward (None without swap-ins)."""
        for block, slot in swap_out:
            self.host[slot].copy_(self.kv[block], non_blocking=True)
        if not swap_in:
            return None
        if self.stream is None:  # CPU tensors (Triton's interpreter): plain copies
            for slot, block in swap_in:
                self.kv[block].copy_(self.host[slot])
            return None
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)  # NOTE: after this step's swap-outs (a slot or block may be reused)
        events = []
        with torch.cuda.stream(self.stream):
            for a, b in self.groups:
                for slot, block in swap_in:
                    self.kv[block, a:b].copy_(self.host[slot, a:b], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                events.append(ev)
        return lambda i: compute.wait_event(events[self.group_of[i]])

    def measure_copy_block_s(self, num_blocks: int = 32, repeats: int = 3) -> float:
        """Seconds to copy one block back into the device, measured with this pool's own copy
        path (blocks 0..num_blocks-1 are overwritten: call before serving)."""
        n = min(num_blocks, self.host.shape[0], self.kv.shape[0])
        pairs = [(i, i) for i in range(n)]
        best = float("inf")
        for _ in range(repeats):
            _sync(self.kv)
            t0 = time.perf_counter()
            ready = self.copy([], pairs)
            if ready is not None:
                for i in range(self.num_layers):
                    ready(i)
            _sync(self.kv)
            best = min(best, (time.perf_counter() - t0) / n)
        return best


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
