"""CudaModelRunner: ModelRunner's contract (numa_runtime/model_runner.py) with the shard on a GPU.

It executes the same StepPlans: rank 0 broadcasts each plan to the worker ranks over MPI, as
on the CPU path; the model's collectives go over NCCL. Decode steps replay CUDA graphs
(graphs.py); with a host KV tier, the runner owns the pinned pool and performs the copies
the tier lists before each step's forward.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from numa_runtime.config import EngineConfig, ModelConfig, kv_pool_blocks
from numa_runtime.kv_cache.host_tier import CopyCosts, HostKVTier
from numa_runtime.plan import EMBED, PROFILE, SHUTDOWN, StepPlan
from numa_runtime.recorder import NULL_RECORDER

from .batch import Uploader
from .graphs import DecodeGraphs
from .host_pool import HostKVPool
from .model import CudaLlama

log = logging.getLogger("numa_runtime")

# NOTE: what the KV cache may not take of the free device memory after the weights:
# activations, cuBLAS workspaces and captured graphs live there.
RESERVE_FRACTION, RESERVE_MIN = 0.1, 1 << 30


def pick_device(gpu_index: int) -> torch.device:
    """GPU `gpu_index` of this host (the rank's local rank); CPU under Triton's interpreter."""
    from numa_runtime import env
    if env.triton_interpret():
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if gpu_index >= n:
        raise ValueError(f"This rank wants GPU {gpu_index} but the host has {n}; start one rank per GPU.")
    dev = torch.device("cuda", gpu_index)
    torch.cuda.set_device(dev)
    return dev


class CudaModelRunner:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, comm, max_model_len: int,
                 progress=None, gpu_index: int = 0, recorder=None):
        self.comm, self.engine_cfg = comm, engine_cfg
        self.recorder = recorder or NULL_RECORDER  # NOTE: AS_PROFILE=ON: answers rank 0's PROFILE plans
        self.device = pick_device(gpu_index)
        self.tp = None
        if comm.world_size > 1:
            from .tp import NcclGroup
            self.tp = NcclGroup(comm, self.device)
        self.model = CudaLlama(model_cfg, comm.rank, comm.world_size, engine_cfg.dtype, max_model_len,
                               self.device, self.tp, progress)
        self.block_size = bs = engine_cfg.block_size
        self.bytes_per_block = self.model.kv_bytes_per_block(bs)
        self.num_blocks = self._num_kv_blocks(max_model_len)
        self.model.allocate_kv_cache(self.num_blocks, bs)
        self.uploader = Uploader(self.device)
        self._pinned = torch.empty(0, dtype=torch.float32)
        self.graphs = None
        if self.device.type == "cuda" and engine_cfg.cuda_graphs:
            self.graphs = DecodeGraphs(self.model, self.uploader, engine_cfg.max_num_seqs, -(-max_model_len // bs))
            self.graphs.capture_all()
        self.pool = self.host_tier = None
        if engine_cfg.host_kv_cache_memory:
            self._start_host_tier(engine_cfg.host_kv_cache_memory, max_model_len)

    # ---- sizes ---------------------------------------------------------------------------
    def _num_kv_blocks(self, max_model_len: int) -> int:
        cfg = self.engine_cfg
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            budget = int(free - max(RESERVE_MIN, RESERVE_FRACTION * free))
        else:
            budget = 1 << 26
        n = kv_pool_blocks(budget, self.bytes_per_block, cfg.max_num_seqs, max_model_len, self.block_size)
        if self.comm.world_size > 1:  # every rank must hold the same block ids: the smallest pool
            mine = np.zeros(self.comm.world_size, np.float32)
            mine[self.comm.rank] = n
            n = int(self.comm.all_reduce_(mine).min())
        if n < 2:
            raise ValueError(f"The GPU KV cache budget ({budget} bytes) holds fewer than 2 blocks of "
                             f"{self.bytes_per_block} bytes; free GPU memory or raise kv_cache_memory.")
        return int(n)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    # ---- host tier -----------------------------------------------------------------------
    def _start_host_tier(self, nbytes: int, max_model_len: int) -> None:
        slots = nbytes // self.bytes_per_block
        if slots < 1:
            raise ValueError(f"host_kv_cache_memory ({nbytes} bytes) holds no KV block of "
                             f"{self.bytes_per_block} bytes; raise it or set it to 0.")
        self.pool = HostKVPool(self.model.kv_cache, int(slots))
        # NOTE: every rank measures (the prefill runs collectives); rank 0's numbers decide
        costs = CopyCosts(self.pool.measure_copy_block_s(), *self._measure_prefill(max_model_len))
        if self.comm.is_driver:
            log.info("host KV tier: %d blocks; copy back %.1f us/block, recompute %.2f us/token + %.4f us/token "
                     "per earlier token", slots, costs.copy_block_s * 1e6, costs.token_s * 1e6, costs.token_ctx_s * 1e6)
            self.host_tier = HostKVTier(int(slots), costs)

    def _measure_prefill(self, max_model_len: int) -> tuple[float, float]:
        """(seconds per token at position 0, extra seconds per token per earlier position), from
        timing one prefill chunk at two depths. Writes no KV (slot -1); reads block 0 only."""
        n = min(self.engine_cfg.max_num_batched_tokens, 512, max_model_len // 2)
        deep = min(max_model_len, 8 * n)
        t = []
        for ctx in (n, deep):
            plan = StepPlan(np.zeros(n, np.int64), np.arange(ctx - n, ctx, dtype=np.int64), np.full(n, -1, np.int64),
                            np.array([0, n], np.int32), np.array([ctx], np.int32),
                            np.zeros((1, -(-ctx // self.block_size)), np.int32), np.array([n - 1], np.int64))
            t.append(min(self._timed(plan) for _ in range(3)) / n)
        # per-token time ~ a + b * mean position: mean positions n/2 and deep - n/2
        b = max(t[1] - t[0], 0.0) / max(deep - n, 1)
        return max(t[0] - b * n / 2, 1e-9), b

    def _timed(self, plan: StepPlan) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self._forward(plan)
        return time.perf_counter() - t0

    def _host_copies(self):
        """This step's tier copies: rank 0 drains the tier; under TP every rank gets the lists."""
        if self.pool is None:
            return None
        out, back = self.host_tier.drain() if self.host_tier is not None else ([], [])
        if self.tp is not None:
            n = torch.tensor([len(out), len(back)], dtype=torch.int64, device=self.device)
            self.tp.broadcast_(n)
            flat = torch.tensor(out + back, dtype=torch.int64, device=self.device).reshape(-1, 2) \
                if self.comm.is_driver else torch.empty((int(n.sum()), 2), dtype=torch.int64, device=self.device)
            self.tp.broadcast_(flat)
            pairs = [tuple(p) for p in flat.tolist()]
            out, back = pairs[:int(n[0])], pairs[int(n[0]):]
        return self.pool.copy(out, back) if out or back else None

    def _copies_only(self) -> None:
        """A step without tokens still performs (and waits for) the tier's copies, on every rank."""
        ready = self._host_copies()
        if ready is not None:
            for i in range(self.model.cfg.num_layers):
                ready(i)

    # ---- steps ---------------------------------------------------------------------------
    def _forward(self, plan: StepPlan) -> np.ndarray:
        ready = self._host_copies()
        if plan.kind == EMBED:  # NOTE: the final normed hidden states (embeddings), never a graph
            return self._to_host(self.model.forward(self.uploader.upload(plan), ready, hidden=True))
        if self.graphs is not None and ready is None and self.graphs.accepts(plan):
            logits = self.graphs.run(plan)
        else:
            logits = self.model.forward(self.uploader.upload(plan), ready)
        return self._to_host(logits)

    def _to_host(self, logits: torch.Tensor) -> np.ndarray:
        """logits [S', V] -> numpy through a pinned buffer. NOTE: the array is a view of that
        buffer, valid until the next step (the sampler consumes it within the step)."""
        if self.device.type != "cuda":
            return logits.numpy()
        n = logits.numel()
        if self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 2 * self._pinned.numel()), dtype=torch.float32, pin_memory=True)
        out = self._pinned[:n].view(logits.shape)
        out.copy_(logits, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return out.numpy()

    def execute(self, plan: StepPlan) -> np.ndarray:
        """Run one step on every rank; returns logits [len(plan.logits_indices), vocab] f32."""
        if self.comm.world_size > 1:
            self.comm.broadcast_plan(plan)
        if plan.num_tokens == 0:
            self._copies_only()
            return np.zeros((0, self.model.cfg.vocab_size), np.float32)
        return self._forward(plan)

    def shutdown_workers(self) -> None:
        if self.comm.world_size > 1:
            self.comm.broadcast_plan(StepPlan.shutdown())

    def release(self) -> None:
        """Rank 0's Engine.close, after the workers stopped: close NCCL and give the GPU memory
        back (weights, KV cache, graphs, pinned pool), so that an engine started next in this
        process (the model router's next model) finds it free; torch's caching allocator would
        otherwise keep it."""
        if self.tp is not None:
            self.tp.close()
        self.model = self.graphs = self.pool = self.uploader = None
        self._pinned = torch.empty(0, dtype=torch.float32)
        if self.device.type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()

    def worker_loop(self) -> None:
        """Execute plans from rank 0 until a shutdown plan arrives."""
        while True:
            plan = self.comm.broadcast_plan(None)
            if plan.kind == SHUTDOWN:
                if self.tp is not None:
                    self.tp.close()
                return
            if plan.kind == PROFILE:  # AS_PROFILE=ON: rank 0 gathers or resets the tables
                reply = self.recorder.answer(plan.step_id)
                if reply is not None:
                    self.comm.gather_object(reply)
                continue
            if plan.num_tokens:
                self._forward(plan)
            else:
                self._copies_only()
