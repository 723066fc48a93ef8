"""ModelRunner: one rank's model shard and KV cache; executes StepPlans."""
from __future__ import annotations

import logging

import numpy as np
import psutil

from . import env
from .config import EngineConfig, ModelConfig, kv_pool_blocks
from .models import get_model_class
from .plan import PROFILE, SHUTDOWN, StepPlan
from .recorder import NULL_RECORDER

log = logging.getLogger("numa_runtime")


class ModelRunner:
    """Every rank builds one. Rank 0 calls `execute(plan)`, which broadcasts the plan to the
    workers first; workers sit in `worker_loop()` executing what they receive."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, comm, ops,
                 max_model_len: int, progress=None, recorder=NULL_RECORDER):
        self.comm, self.ops, self.engine_cfg, self.recorder = comm, ops, engine_cfg, recorder
        self.model = get_model_class(model_cfg)(model_cfg, ops, comm, engine_cfg.dtype,
                                                max_model_len, progress=progress,
                                                quantization=engine_cfg.quantization,
                                                lm_head_quantization=engine_cfg.lm_head_quantization,
                                                prefill_activations=engine_cfg.prefill_activations)
        self.block_size = engine_cfg.block_size
        self.kv_dtype = engine_cfg.kv_dtype
        self.bytes_per_block = self.model.kv_bytes_per_block(self.block_size, self.kv_dtype)
        self.num_blocks = self._num_kv_blocks(max_model_len)
        try:
            self.model.allocate_kv_cache(self.num_blocks, self.block_size, self.kv_dtype)
        except MemoryError:
            mib = self.num_blocks * self.bytes_per_block / (1 << 20)
            raise ValueError(f"Cannot allocate a KV cache of {mib:.0f} MiB on rank {self.comm.rank} (not enough "
                             f"memory); lower kv_cache_memory (--kv-cache-memory).") from None
        self.disk = self._open_disk_store(model_cfg)
        try:
            self.disk_hashes = self.disk.scan() if self.disk is not None else []  # valid on this rank
        except BaseException:  # NOTE: a Ctrl-C while a large tier is read: the Engine never got this runner
            self.disk.close()
            raise
        self.failed_loads: set[int] = set()  # rank 0: hashes of the last step's failed loads
        # [S'] int64 or None: the argmax of each row of the logits the last execute returned,
        # when the model's decode region computed it (the sampler's greedy rows take it)
        self.greedy_ids = None

    def _open_disk_store(self, model_cfg: ModelConfig):
        if self.engine_cfg.kv_cache_dir is None:
            return None
        from .kv_cache.disk_tier import DiskStore, model_fingerprint
        # NOTE: quantized weights give other KV values: the weight format is part of the identity;
        # so is the KV dtype (an int8 block's bytes hold its values and their scales)
        kind = f"{self.engine_cfg.dtype}/{self.engine_cfg.quantization}"
        if self.kv_dtype != self.engine_cfg.dtype:
            kind += f"/kv-{self.kv_dtype}"
        if self.engine_cfg.prefill_activations != "bf16":  # NOTE: int8 prefill rows: other KV values
            kind += f"/prefill-{self.engine_cfg.prefill_activations}"
        fp = model_fingerprint(model_cfg.model_dir, kind, self.block_size, self.comm.world_size)
        store = DiskStore(self.engine_cfg.kv_cache_dir, fp, self.comm.rank, self.bytes_per_block)
        cap = self.engine_cfg.kv_cache_disk_bytes
        if 0 < cap < store.file_bytes:  # NOTE: on every rank, inside the load's agreement
            store.close()
            raise ValueError(f"kv_cache_disk_bytes ({cap}) is below one block file ({store.file_bytes} "
                             "bytes); raise it, or drop kv_cache_dir.")
        return store

    def _num_kv_blocks(self, max_model_len: int) -> int:
        cfg = self.engine_cfg
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        else:
            # NOTE: from total (not free) memory so that every rank of a host computes the same
            # number without a collective; shared by the ranks of this host.
            # NOTE: a cgroup's or ulimit -v's cap where it is lower than the host's memory
            total = env.memory_limit_bytes(psutil.virtual_memory().total)
            budget = int(total * cfg.kv_cache_fraction / self.comm.local_size)
        n = kv_pool_blocks(budget, self.bytes_per_block, cfg.max_num_seqs, max_model_len, self.block_size,
                           cap=cfg.kv_cache_memory is None)
        if n < 2:
            raise ValueError(f"The KV cache budget ({budget} bytes) holds fewer than 2 blocks of "
                             f"{self.bytes_per_block} bytes; raise kv_cache_memory.")
        return int(n)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def execute(self, plan: StepPlan) -> np.ndarray | None:
        """Run one step on every rank; returns logits [len(plan.logits_indices), vocab], or
        None when a block loaded from the disk tier failed its check on some rank (nothing ran;
        `failed_loads` names the hashes)."""
        self.greedy_ids = None
        if self.comm.world_size > 1:
            self.comm.broadcast_plan(plan)
        if not self._apply_tier_ops(plan):
            return None
        if plan.num_tokens == 0:
            return np.zeros((0, self.model.cfg.vocab_size), np.float32)
        logits = self.model.forward(plan)
        self.greedy_ids = getattr(self.model, "greedy_ids", None)
        return logits

    def burst_rows(self) -> int:
        """The most sequences a decode burst may have (execute_burst); 0: none."""
        f = getattr(self.model, "burst_rows", None)
        return f() if f is not None and self.comm.world_size == 1 else 0

    def execute_burst(self, plan: StepPlan, steps: int) -> np.ndarray:
        """`steps` greedy decode steps from one plan of decode rows that all sample, without
        tier ops (one rank): each row's token of step j + 1 is its argmax of step j. Returns the
        tokens [steps, S]."""
        self.greedy_ids = None
        if len(plan.tier_ops):
            raise ValueError("execute_burst: the plan has cache tier ops; run it with execute")
        return self.model.decode_burst(plan, steps)

    def _apply_tier_ops(self, plan: StepPlan) -> bool:
        """Every rank: the plan's tier ops on its own shard; False if a load failed anywhere.
        `failed_saves`: the blocks whose file some rank could not write (the tier forgets them)."""
        self.failed_loads, self.failed_saves = set(), set()
        if len(plan.tier_ops) == 0:
            return True
        if self.disk is None:
            raise RuntimeError("The plan moves KV blocks to or from a tier, but this rank has no kv_cache_dir.")
        from .kv_cache.disk_tier import apply_ops
        from .kv_cache.tier import OP_LOAD, OP_SAVE, join_hash
        failed = apply_ops(self.disk, plan.tier_ops, self.model.kv_cache)  # [K] 1.0 where a load or save failed
        if self.comm.world_size > 1 and np.isin(plan.tier_ops[:, 0], (OP_LOAD, OP_SAVE)).any():
            self.comm.all_reduce_(failed)  # NOTE: every rank takes the same path below
        for (op, _, lo, hi), bad in zip(plan.tier_ops.tolist(), failed):
            if bad:
                (self.failed_loads if op == OP_LOAD else self.failed_saves).add(join_hash(lo, hi))
        return not self.failed_loads

    def shutdown_workers(self) -> None:
        if self.comm.world_size > 1:
            self.comm.broadcast_plan(StepPlan.shutdown())

    def release(self) -> None:
        """After the workers stopped (Engine.close): the disk tier's folder lock (the CUDA runner:
        its GPU memory)."""
        if self.disk is not None:
            self.disk.close()

    def worker_loop(self) -> None:
        """Execute plans from rank 0 until a shutdown plan arrives."""
        while True:
            plan = self.comm.broadcast_plan(None)
            if plan.kind == SHUTDOWN:
                return
            if plan.kind == PROFILE:  # AS_PROFILE=ON: rank 0 gathers or resets the tables
                reply = self.recorder.answer(plan.step_id)
                if reply is not None:
                    self.comm.gather_object(reply)
                continue
            if self._apply_tier_ops(plan) and plan.num_tokens:
                self.model.forward(plan)
