"""Tensor-parallel shards: which heads, MLP columns and vocabulary rows each rank holds.

Plain integers, no MPI and no weights: every rank computes the same layouts from the model
config, so rank 0 can log every rank's share and tests can assert exact ranges.

- Attention: a rank takes whole kv heads together with the query heads that read them
  (9 heads / 3 kv heads on 2 ranks: 6 + 3). With more ranks than kv heads, each kv head is
  replicated on a group of ranks that split its query heads. Inside a rank, query head i
  reads local kv head i // (local q heads / local kv heads), as the attention kernel expects.
- MLP: the intermediate columns are split so that every rank holds about the same number of
  weight bytes (a rank with fewer heads takes more columns): decode streams every byte of a
  rank's weights each step, and the slowest rank sets the pace of each all-reduce. Chunks are
  multiples of `mlp_align` (quantized weights split on group boundaries).
- Mixture of experts: every expert's intermediate columns (and a shared expert's) are split
  over the ranks in near-equal chunks of `moe_align`, so each rank holds a slice of every
  expert and a token's top-k experts cost every rank alike (tensor parallel, as vLLM's
  fused MoE); the router is replicated.
- Vocabulary: equal chunks of ceil(vocab / ranks) rows (the last ones shorter), padded to the
  chunk so that the logits all-gather has equal parts.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

from .config import ModelConfig, UnsupportedModelError


@dataclass(frozen=True)
class ShardLayout:
    """Which slice of every tensor one rank holds (global indices)."""

    rank: int
    world: int
    q_heads: slice        # query heads; q_proj rows / o_proj columns = heads * head_dim
    kv_heads: slice       # kv heads; k_proj, v_proj rows = heads * head_dim
    inter: slice          # rows of gate/up, columns of down
    vocab: slice          # rows of embedding / lm_head
    vocab_chunk: int      # padded rows per rank (equal on every rank, for all-gather)
    # every routed expert's rows of gate/up, columns of down; the shared expert's (Qwen2-MoE)
    experts: slice = dataclasses.field(default_factory=lambda: slice(0, 0))
    shared: slice = dataclasses.field(default_factory=lambda: slice(0, 0))

    @classmethod
    def build(cls, cfg: ModelConfig, rank: int, world: int, mlp_align: int = 1,
              moe_align: tuple = (1, 1)) -> "ShardLayout":
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world} ranks.")
        return shard_layouts(cfg, world, mlp_align, moe_align)[rank]

    @property
    def num_q_heads(self) -> int:
        return self.q_heads.stop - self.q_heads.start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.stop - self.kv_heads.start

    @property
    def num_inter(self) -> int:
        return self.inter.stop - self.inter.start

    def describe(self) -> str:
        """One log line: this rank's share."""
        moe = "" if self.experts.stop == 0 else ", expert columns %s%s" % (
            _fmt(self.experts), "" if self.shared.stop == 0 else ", shared expert columns " + _fmt(self.shared))
        return ("rank %d/%d holds q heads %s, kv heads %s, MLP columns %s%s, vocabulary rows %s"
                % (self.rank, self.world, _fmt(self.q_heads), _fmt(self.kv_heads),
                   _fmt(self.inter), moe, _fmt(self.vocab)))


def _fmt(s: slice) -> str:
    n = s.stop - s.start
    return "%d-%d (%d)" % (s.start, s.stop - 1, n) if n else "none"


def split_range(n: int, parts: int, index: int) -> slice:
    """The index-th of `parts` near-equal contiguous chunks of range(n) (earlier chunks larger)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))


def split_heads(num_heads: int, num_kv_heads: int, world: int) -> list[tuple[slice, slice]]:
    """(query heads, kv heads) of every rank; see the module docstring."""
    if not 1 <= world <= num_heads:
        raise UnsupportedModelError(
            f"Cannot split {num_heads} attention heads over {world} ranks; use "
            + ("1 rank" if num_heads == 1 else f"1 to {num_heads} ranks")
            + " per model replica (data parallel replicas can use the remaining ranks).")
    group = num_heads // num_kv_heads
    if world <= num_kv_heads:
        kvs = [split_range(num_kv_heads, world, r) for r in range(world)]
        return [(slice(kv.start * group, kv.stop * group), kv) for kv in kvs]
    out = []
    for k in range(num_kv_heads):
        ranks = split_range(world, num_kv_heads, k)  # the ranks that hold kv head k
        sharing = ranks.stop - ranks.start
        for j in range(sharing):
            q = split_range(group, sharing, j)
            out.append((slice(k * group + q.start, k * group + q.stop), slice(k, k + 1)))
    return out


def balanced_split(n: int, base_loads: list[int], unit_cost: int, align: int = 1,
                   what: str = "MLP columns") -> list[slice]:
    """Split range(n) into len(base_loads) contiguous chunks so that base_loads[r] +
    unit_cost * len(chunk r) is as even as possible. Chunk lengths are multiples of `align`
    (the chunk holding n's end may be shorter); every chunk gets at least one unit."""
    parts = len(base_loads)
    units = -(-n // align)
    if units < parts:
        raise UnsupportedModelError(
            f"Cannot split {n} {what} over {parts} ranks in groups of {align}; use at most "
            f"{units} rank{'s' if units > 1 else ''} per model replica (fewer ranks, or model replicas: "
            "data_parallel, --data-parallel or numa-launch --dp).")
    counts = [1] * parts
    heap = [(load + unit_cost * align, r) for r, load in enumerate(base_loads)]
    heapq.heapify(heap)
    for _ in range(units - parts):  # NOTE: each unit goes to the least loaded rank
        load, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (load + unit_cost * align, r))
    out, start = [], 0
    for c in counts:
        stop = min(n, start + c * align)
        out.append(slice(start, stop))
        start = stop
    return out


def shard_layouts(cfg: ModelConfig, world: int, mlp_align: int = 1, moe_align: tuple = (1, 1)) -> list[ShardLayout]:
    """The layout of every rank of a tensor-parallel group of `world` ranks (moe_align: what the
    routed and the shared experts' columns come in multiples of)."""
    heads = split_heads(cfg.num_heads, cfg.num_kv_heads, world)
    # weight elements per rank, in units of hidden_size: q + o rows per query head, k + v per
    # kv head; one MLP column is a row of gate, of up, and a column of down
    attn = [2 * cfg.head_dim * ((q.stop - q.start) + (kv.stop - kv.start)) for q, kv in heads]
    none = [slice(0, 0)] * world
    inter = balanced_split(cfg.intermediate_size, attn, 3, mlp_align) if cfg.has_dense_mlp else none
    experts = balanced_split(cfg.moe_intermediate_size, [0] * world, 1, moe_align[0], "expert columns") \
        if cfg.num_experts else none
    shared = balanced_split(cfg.shared_expert_intermediate_size, [0] * world, 1, moe_align[1],
                            "shared expert columns") if cfg.shared_expert_intermediate_size else none
    chunk = -(-cfg.vocab_size // world)
    layouts = []
    for r, ((q, kv), cols) in enumerate(zip(heads, inter)):
        vocab = slice(min(r * chunk, cfg.vocab_size), min((r + 1) * chunk, cfg.vocab_size))
        layouts.append(ShardLayout(r, world, q, kv, cols, vocab, chunk, experts[r], shared[r]))
    return layouts
