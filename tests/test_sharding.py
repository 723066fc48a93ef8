"""Tensor-parallel layouts (sharding.py): plain integers, checked for every head layout and
every rank count from 1 to the head count."""
import pytest

from numa_runtime.config import ModelConfig, RopeConfig, UnsupportedModelError
from numa_runtime.sharding import balanced_split, shard_layouts, split_heads

# (heads, kv heads, hidden, head_dim, intermediate, vocab): the default model (SmolLM2-135M),
# Qwen2.5-0.5B, SmolLM2-360M, Llama-3.2-1B, MHA and MQA
SHAPES = [(9, 3, 576, 64, 1536, 49152), (14, 2, 896, 64, 4864, 151936),
          (15, 5, 960, 64, 2560, 49152), (32, 8, 2048, 64, 8192, 128256),
          (8, 8, 64, 8, 90, 383), (6, 1, 48, 8, 100, 7)]


def _cfg(hq, hk, hidden, head_dim, inter, vocab) -> ModelConfig:
    return ModelConfig("", "LlamaForCausalLM", vocab, hidden, inter, 2, hq, hk, head_dim, 1e-5,
                       RopeConfig(), 512, False, False, False, False, False, "float32")


def _covers(slices, n) -> bool:
    """Contiguous, in rank order, no gap, no overlap, ending at n."""
    return slices[0].start == 0 and slices[-1].stop == n and all(
        a.stop == b.start for a, b in zip(slices, slices[1:]))


def test_default_model_on_two_ranks_takes_whole_kv_heads():
    a, b = split_heads(9, 3, 2)
    assert (a, b) == ((slice(0, 6), slice(0, 2)), (slice(6, 9), slice(2, 3)))


def test_more_ranks_than_kv_heads_replicate_them():
    # 14 heads / 2 kv heads on 3 ranks: kv head 0 on two ranks (4 + 3 of its 7 query heads)
    assert split_heads(14, 2, 3) == [(slice(0, 4), slice(0, 1)), (slice(4, 7), slice(0, 1)),
                                     (slice(7, 14), slice(1, 2))]
    assert split_heads(4, 1, 4) == [(slice(i, i + 1), slice(0, 1)) for i in range(4)]  # MQA


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "%dh%dkv" % s[:2])
def test_every_rank_count_gives_a_valid_layout(shape):
    hq, hk, _, head_dim, inter, vocab = shape
    group = hq // hk
    for world in range(1, hq + 1):
        lays = shard_layouts(_cfg(*shape), world)
        assert [l.rank for l in lays] == list(range(world)) and {l.world for l in lays} == {world}
        assert _covers([l.q_heads for l in lays], hq)
        assert _covers([l.inter for l in lays], inter)
        assert all(l.num_inter > 0 and l.num_q_heads > 0 for l in lays)
        for l in lays:
            # every query head of the rank reads a kv head the rank holds, in the kernel's
            # uniform local mapping: local head i -> local kv head i // (local q / local kv)
            local_group = l.num_q_heads // l.num_kv_heads
            assert l.num_q_heads % l.num_kv_heads == 0
            for i, h in enumerate(range(l.q_heads.start, l.q_heads.stop)):
                assert h // group == l.kv_heads.start + i // local_group
            assert l.vocab_chunk * world >= vocab
            assert l.vocab == slice(min(l.rank * l.vocab_chunk, vocab),
                                    min((l.rank + 1) * l.vocab_chunk, vocab))
        if world <= hk:  # kv heads are never replicated while there are enough of them
            assert _covers([l.kv_heads for l in lays], hk)
        # weight elements (in rows of `hidden`): a rank that got more than its one mandatory
        # MLP column was, before its last one, the least loaded
        loads = [2 * head_dim * (l.num_q_heads + l.num_kv_heads) + 3 * l.num_inter for l in lays]
        assert all(load - 3 <= min(loads) for load, l in zip(loads, lays) if l.num_inter > 1)

def test_too_many_ranks_is_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="Cannot split 9 attention heads over 10 ranks; use 1 to 9"):
        shard_layouts(_cfg(*SHAPES[0]), 10)
    with pytest.raises(UnsupportedModelError, match=r"^Cannot split 1 attention heads over 2 ranks; use 1 rank per "
                                                    r"model replica \("):
        split_heads(1, 1, 2)


def test_mlp_split_respects_the_alignment():
    parts = balanced_split(1000, [0, 500, 0], 3, align=64)
    assert _covers(parts, 1000)
    assert all(p.start % 64 == 0 for p in parts)
    assert [p.stop - p.start for p in parts][:2] == [384, 256]  # the last chunk holds the tail
    with pytest.raises(UnsupportedModelError, match="Cannot split 90 MLP columns over 4 ranks in groups of 32"):
        balanced_split(90, [0] * 4, 3, align=32)


def test_even_heads_split_the_mlp_evenly():
    assert [p.stop - p.start for p in balanced_split(90, [10] * 4, 3)] == [23, 23, 22, 22]
