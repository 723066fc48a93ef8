"""HostKVPool: pinned host memory behind the device KV cache, and the copies between them.

The bookkeeping (which block goes to which slot, and when) is the host tier's
(numa_runtime.kv_cache.host_tier); this class only moves bytes:

- swap-outs (device block -> host slot) go on the compute stream before the step's forward,
  so they read a block before this step's new tokens overwrite it;
- swap-ins (host slot -> device block) go on a side stream, one layer at a time, each layer
  followed by an event; layer i of the forward waits for its event only, so the copies of
  later layers overlap the compute of earlier ones.
"""
from __future__ import annotations

import time

import torch


class HostKVPool:
    def __init__(self, kv_cache: torch.Tensor, num_slots: int):
        # kv_cache: [L, 2, NB, BS, Hk, D] on the device; host: [num_slots, L, 2, BS, Hk, D] pinned
        self.kv = kv_cache
        self.num_layers = kv_cache.shape[0]
        shape = (num_slots, self.num_layers, 2) + tuple(kv_cache.shape[3:])
        on_gpu = kv_cache.device.type == "cuda"
        self.host = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=on_gpu)
        self.stream = torch.cuda.Stream(kv_cache.device) if on_gpu else None

    def copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]):
        """Issue the copies; returns layer_ready(i) for the forward (None without swap-ins)."""
        for block, slot in swap_out:
            self.host[slot].copy_(self.kv[:, :, block], non_blocking=True)
        if not swap_in:
            return None
        if self.stream is None:  # CPU tensors (Triton's interpreter): plain copies
            for slot, block in swap_in:
                self.kv[:, :, block].copy_(self.host[slot])
            return None
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)  # NOTE: after this step's swap-outs (a slot or block may be reused)
        events = []
        with torch.cuda.stream(self.stream):
            for layer in range(self.num_layers):
                for slot, block in swap_in:
                    self.kv[layer, :, block].copy_(self.host[slot, layer], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                events.append(ev)
        return lambda i: compute.wait_event(events[i])

    def measure_copy_block_s(self, num_blocks: int = 8, repeats: int = 3) -> float:
        """Seconds to copy one block back into the device, measured with this pool's own copy
        path (blocks 0..num_blocks-1 are overwritten: call before serving)."""
        n = min(num_blocks, self.host.shape[0], self.kv.shape[2])
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
