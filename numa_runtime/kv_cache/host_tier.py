"""HostKVTier: the second tier of the prefix cache (device KV blocks -> a host memory pool).

Plain Python over integers, like the BlockManager that calls it. The BlockManager tells the
tier when it evicts a cached block and asks it, on a lookup miss, whether a block with that
hash sits in host memory; the tier owns the host slots and the list of copies the model
runner performs before the next step's forward (`drain`):

    on_evict(block_id, h)   a cached device block is about to be reused: copy it to a host
                            slot (the least recently stored slot is dropped when none is free)
    lookup(h)               the host slot holding hash h, or None
    take(h)                 hash h leaves the tier (its slot is read back this step)
    copy_back(slot, block)  ... into device block `block`
    drain()                 (swap_out [(block, slot)], swap_in [(slot, block)]) since the last
                            drain, in the order the runner must issue them: all swap-outs first

A claimed slot is freed only at the next drain, so a slot being read back is never
overwritten by a swap-out of the same step.

Whether copying a block back beats recomputing it is the cost model's call (CopyCosts, from
speeds the runner measured at start-up): recomputing block i costs its tokens' prefill time,
which grows with their position (attention reads every earlier key); copying it costs its
bytes over the host link. Blocks are taken in prefix order while copying is cheaper.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class CopyCosts:
    """Seconds: to copy one block back (`copy_block_s`), and to recompute one token at
    position p: `token_s + token_ctx_s * p`."""

    copy_block_s: float
    token_s: float
    token_ctx_s: float = 0.0

    def __post_init__(self):
        if min(self.copy_block_s, self.token_s, self.token_ctx_s) < 0:
            raise ValueError(f"copy and recompute costs must be non-negative, got {self}.")

    def recompute_block_s(self, index: int, block_size: int) -> float:
        mid = (index + 0.5) * block_size
        return block_size * (self.token_s + self.token_ctx_s * mid)

    def copy_is_cheaper(self, index: int, block_size: int) -> bool:
        return self.copy_block_s < self.recompute_block_s(index, block_size)


class HostKVTier:
    def __init__(self, num_slots: int, costs: CopyCosts):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"The host KV pool must hold at least one block, got {num_slots!r}; "
                             "raise host_kv_cache_memory or set it to 0 to turn the tier off.")
        self.num_slots = num_slots
        self.costs = costs
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # hash -> slot, oldest stored first
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._claimed: list[int] = []
        self.num_stored = self.num_dropped = self.num_restored = 0

    def __len__(self) -> int:
        """Blocks held in host memory."""
        return len(self.slot_of)

    def on_evict(self, block_id: int, block_hash: int) -> None:
        if block_hash in self.slot_of:  # already held (recomputed on the device meanwhile)
            self.slot_of.move_to_end(block_hash)
            return
        if not self.free_slots:
            if not self.slot_of:  # every slot is being read back this step
                self.num_dropped += 1
                return
            _, slot = self.slot_of.popitem(last=False)
            self.free_slots.append(slot)
            self.num_dropped += 1
        slot = self.free_slots.pop()
        self.slot_of[block_hash] = slot
        self._swap_out.append((block_id, slot))
        self.num_stored += 1

    def lookup(self, block_hash: int) -> int | None:
        return self.slot_of.get(block_hash)

    def worth_copying(self, index: int, block_size: int) -> bool:
        """Whether the block at position `index` of a sequence is cheaper to copy back than to
        recompute."""
        return self.costs.copy_is_cheaper(index, block_size)

    def take(self, block_hash: int) -> int:
        """Remove hash `block_hash` from the tier; returns its slot, which stays reserved until
        the next drain (take every hit before taking device blocks: their evictions may need
        slots)."""
        slot = self.slot_of.pop(block_hash)
        self._claimed.append(slot)
        return slot

    def copy_back(self, slot: int, block_id: int) -> None:
        self._swap_in.append((slot, block_id))
        self.num_restored += 1

    def drain(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        out, back = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        self.free_slots.extend(self._claimed)
        self._claimed = []
        return out, back

    @property
    def has_pending(self) -> bool:
        return bool(self._swap_out or self._swap_in)
