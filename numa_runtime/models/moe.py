"""The sparse mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE and Mixtral, tensor parallel.

Every rank holds the router (replicated, f32) and a slice of every expert's intermediate
columns (sharding.py: ShardLayout.experts), so a token's top-k experts cost every rank alike
and the block's output is a partial sum that the layer's all-reduce completes, as the dense
MLP's is. Routing follows transformers: softmax of the router logits in f32, the top k
experts, their weights renormalized to sum 1 where the model says so (norm_topk_prob;
Mixtral always); each expert's SwiGLU output is scaled by its weight and added in expert
order; Qwen2-MoE adds its shared expert under a sigmoid gate last.

A step's rows are grouped by expert, so an expert's weights are streamed once a step for all
the rows that chose it (one linear call per expert hit: gate/up fused, then down). A few decode
rows (up to 64) of int8-activation experts (a bf16 engine's quantized ones) run all their (row,
expert) pairs, grouped by expert, in one OpenMP region instead (backend ops.moe_experts:
qgemm_moe.h), not ~3 calls an expert hit.
"""
from __future__ import annotations

import numpy as np

from .. import env
from ..config import ModelConfig, UnsupportedModelError
from ..sharding import ShardLayout
from ..weights import MIXTRAL_EXPERT_NAMES

# transformers' per-expert tensor names under model.layers.N.mlp (Mixtral's are renamed to
# these when the checkpoint is opened: weights.Checkpoint.rename_mixtral)
EXPERT = "mlp.experts.%d.%s_proj.weight"


class MoEBlock:
    def __init__(self, linear, cfg: ModelConfig, lay: ShardLayout, ckpt, i: int):
        p = f"model.layers.{i}."
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        # NOTE: f32 [E, H] as stored (transformers' softmax is in f32; a GGUF's router is F32), run
        # by the backend's threads (numpy's one thread read it at a quarter of the kernels' speed);
        # rank_invariant: the same bits whatever a rank's thread count, so that every rank of a
        # tensor-parallel group picks the same experts for a token (a near tie between the k-th
        # and the next expert flipped between 15 and 16 threads)
        self.router_weight = np.ascontiguousarray(ckpt.load(p + "mlp.gate.weight", "float32"))
        self.router = linear.ops.Linear(self.router_weight)
        self.router.rank_invariant = True
        cols = lay.experts
        self.experts = []
        for j in range(cfg.num_experts):
            gate, up, down = (p + EXPERT % (j, n) for n in ("gate", "up", "down"))
            self.experts.append((linear([(gate, cols, None), (up, cols, None)]), linear([(down, None, cols)])))
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            s = p + "mlp.shared_expert."
            cols = lay.shared
            self.shared = (linear([(s + "gate_proj.weight", cols, None), (s + "up_proj.weight", cols, None)]),
                           linear([(s + "down_proj.weight", None, cols)]))
            gate = ckpt.load(p + "mlp.shared_expert_gate.weight", "float32").reshape(1, -1)  # [1, H]
            self.shared_gate = linear.ops.Linear(gate)
            self.shared_gate.rank_invariant = True
        make = getattr(linear.ops, "moe_experts", None)
        # NOTE: NUMA_RUNTIME_FUSED_DECODE=0 runs the experts op by op too (benchmarks, tests)
        self.fused = None if make is None or not env.fused_decode() else \
            make([g for g, _ in self.experts], [d for _, d in self.experts])

    def linears(self) -> list:
        pairs = self.experts + ([self.shared] if self.shared is not None else [])
        return [lin for pair in pairs for lin in pair]

    def route(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """h: [T, H] -> (experts [T, k] int64, weights [T, k] f32), each row's chosen experts in
        descending probability."""
        logits = self.router.forward(h)                                  # [T, E] f32
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        # NOTE: a stable sort of -p: equal probabilities keep the lower expert first
        top = np.argsort(-probs, axis=1, kind="stable")[:, :self.top_k]
        w = np.take_along_axis(probs, top, axis=1)
        if self.norm_topk_prob:
            w /= w.sum(axis=1, keepdims=True)
        return top, w.astype(np.float32)

    def forward(self, ops, h: np.ndarray, out: np.ndarray) -> np.ndarray:
        """h: [T, H] normed input -> out: [T, H] this rank's partial sum of the block."""
        top, w = self.route(h)
        T = h.shape[0]
        if self.fused is not None and self.fused.usable(T):
            self.fused.forward(h, top, w, out)
            return self._add_shared(ops, h, out)
        out[...] = 0.0
        flat = top.reshape(-1)
        order = np.argsort(flat, kind="stable")                          # (row, slot) pairs by expert
        counts = np.bincount(flat, minlength=len(self.experts))
        # NOTE: an expert's rows take the path of the step's rows, as a dense MLP's do: in a step
        # of prompt rows only, bf16 however few chose it, so that a prompt's logits do not depend
        # on which other prompts share its step or on how much of it the prefix cache held (a
        # path that followed each expert's row count, exact f32 below 32 rows, reached a short
        # prompt's first token sooner, most without AMX, where every expert a prompt touches is
        # dequantized whole into bf16 panels)
        start = 0
        for e in np.flatnonzero(counts):
            pick = order[start:start + counts[e]]
            start += counts[e]
            rows = pick // self.top_k
            y = swiglu(ops, *self.experts[e], h[rows])                    # [n, H]
            y *= w.reshape(-1)[pick][:, None]
            out[rows] += y                                               # NOTE: rows are distinct per expert
        return self._add_shared(ops, h, out)

    def _add_shared(self, ops, h: np.ndarray, out: np.ndarray) -> np.ndarray:
        if self.shared is not None:
            y = swiglu(ops, *self.shared, h)
            g = self.shared_gate.forward(h)                              # [T, 1]
            y *= (1.0 / (1.0 + np.exp(-g))).astype(np.float32)
            out += y
        return out


def swiglu(ops, gate_up, down, x: np.ndarray, out=None, gu=None, act=None) -> np.ndarray:
    """down(silu(gate) * up) of x [T, H] C-contiguous (gate_up's rows: gate's, then up's): a
    dense layer's MLP or an expert's, into out [T, H] where given; gu [T, 2 I] and act [T, I]
    are scratch where given. Where down's kernel computes silu_and_mul itself (fuses_silu), act
    is never written."""
    gu = gate_up.forward(x, gu)
    fuses = getattr(down, "fuses_silu", None)
    if fuses is not None and fuses(x.shape[0]):
        return down.forward_silu(gu, out)
    if act is None:
        act = np.empty((x.shape[0], gu.shape[1] // 2), np.float32)
    ops.silu_and_mul(gu, act)
    return down.forward(act, out)


def check_moe_tensors(cfg: ModelConfig, ckpt) -> None:
    """UnsupportedModelError if a sparse layer's router, an expert or the shared expert is missing
    or of another shape than config.json implies."""
    h, mi, si, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.num_experts
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        p = f"model.layers.{i}."
        want = {p + "mlp.gate.weight": (E, h)}
        for j in range(E):
            want.update({p + EXPERT % (j, "gate"): (mi, h), p + EXPERT % (j, "up"): (mi, h),
                         p + EXPERT % (j, "down"): (h, mi)})
        if si:
            s = p + "mlp.shared_expert."
            want.update({s + "gate_proj.weight": (si, h), s + "up_proj.weight": (si, h),
                         s + "down_proj.weight": (h, si), p + "mlp.shared_expert_gate.weight": (1, h)})
        mixtral = cfg.architecture == "MixtralForCausalLM"
        source, key = _size_keys(ckpt, mixtral)
        stray = p + "mlp.shared_expert.gate_proj.weight"
        # NOTE: a size of 0 left a stored shared expert out without a word (transformers writes 0 rows there)
        if not si and stray in ckpt and ckpt.raw(stray).shape[0] != 0:
            raise UnsupportedModelError(f"the checkpoint holds a shared expert ({_stored_name(ckpt, stray)}), but "
                                        f"{source}'s {key['shared']} is 0: it does not describe these weights.")
        for name, shape in want.items():
            if name not in ckpt:
                shared = " and a shared expert" if si else ""
                raise UnsupportedModelError(f"the checkpoint lacks {_as_stored(name, mixtral)}, which {source} "
                                            f"implies ({E} experts{shared} in layer {i}).")
            got = tuple(ckpt.raw(name).shape)
            if got != shape and not (name.endswith("shared_expert_gate.weight") and got == (h,)):
                width = f"{key['shared']} {si}" if ".shared_expert" in name else f"{key['expert']} {mi}"
                raise UnsupportedModelError(
                    f"{_stored_name(ckpt, name)} has shape {got}, but {source} implies {shape} ({key['hidden']} {h}, "
                    f"{width}, {key['experts']} {E}): it does not describe these weights.")


def _size_keys(ckpt, mixtral: bool) -> tuple[str, dict]:
    """Where the model's sizes came from (config.json, or a GGUF's metadata) and its keys' names."""
    from ..gguf_checkpoint import GGUFCheckpoint
    arch = ckpt.arch if isinstance(ckpt, GGUFCheckpoint) else None
    if arch is not None:
        a = arch + "."
        return "the GGUF metadata", {"hidden": a + "embedding_length", "experts": a + "expert_count",
                                     "expert": a + ("feed_forward_length" if arch in ("llama", "mistral")
                                                    else "expert_feed_forward_length"),
                                     "shared": a + "expert_shared_feed_forward_length"}
    return "config.json", {"hidden": "hidden_size", "experts": "num_local_experts" if mixtral else "num_experts",
                           "expert": "intermediate_size" if mixtral else "moe_intermediate_size",
                           "shared": "shared_expert_intermediate_size"}


def _as_stored(name: str, mixtral: bool) -> str:
    """A Qwen-MoE name as a Mixtral checkpoint spells it (block_sparse_moe, w1/w3/w2)."""
    if not mixtral:
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    for theirs, ours in MIXTRAL_EXPERT_NAMES.items():
        name = name.replace(f".{ours}.", f".{theirs}.")
    return name


def _stored_name(ckpt, name: str) -> str:
    """The name the file gives a tensor we read as `name` (a Mixtral's block_sparse_moe names, a
    GGUF's blk.N.ffn_*_exps.weight[j]); a checkpoint without stored_name (a test's) says `name`."""
    stored_name = getattr(ckpt, "stored_name", None)
    return name if stored_name is None else stored_name(name)
