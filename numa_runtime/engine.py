"""Engine: add requests, step (schedule -> execute -> update), generate, stream, chat.

Worker ranks. Under mpirun every rank constructs the Engine, and the constructor returns on
every rank. Rank 0 (`engine.is_driver`) schedules, samples and drives; a worker rank only
executes the step plans rank 0 broadcasts, which it does in exactly these places:

- `engine.serve_workers()`: serve until rank 0 closes the engine, then return;
- `engine.close()`, and so the end of a `with engine:` block and interpreter exit: the same;
- the first driving call (generate, stream, chat, step, add_request): the same, and then the
  process exits with status 0, because that call has no result to return on a worker. This
  keeps a script written for one process running unchanged under mpirun; the worker logs that
  the rest of the script runs on rank 0 only.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import numbers
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
import typing
from typing import Iterable, Iterator

import numpy as np

from .config import LOGPROBS_MODES, POOLING_VALUES, RUNNER_VALUES, EngineConfig, ModelConfig, UnsupportedModelError, generation_defaults
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, TextState
from .recorder import FORWARD, RESHAPE
from .request import Request, RequestStatus
from .sampling_params import SamplingParams, _is_int
from .tokenizer import HF_RENDER_ARGS, IncrementalDetokenizer, check_text

from . import env
from .logger import init_logger

log = init_logger()
_workers_exited = False  # rank 0: a closed Engine's worker ranks have exited (no new Engine can start)
_served = None  # rank 0: weakref to the Engine whose steps the worker ranks run (one at a time)
_deferred: list = []  # rank 0: engines closed while the workers ran another's steps (shut down after it)
_serials = itertools.count()  # the order engines are made in (a worker's atexit serves the newest first)
_WORKERS_EXITED = ("The worker ranks of this job exited when the last Engine closed (a worker rank exits after its "
                   "first driving call); call engine.serve_workers() on the worker ranks to run several engines in "
                   "one job.")

# NOTE: EngineConfig.reserve_server_core leaves a cpu to the HTTP server from this many cpus on;
# with fewer, a compute thread is worth more than the server's wake-ups cost
RESERVE_MIN_CPUS = 8
# NOTE: a decode burst (EngineConfig.num_scheduler_steps) lasts about this long at most, so that
# streamed tokens arrive at least this often and a new request waits at most this long to start
BURST_SECONDS = 0.025


def _live_served():
    """Rank 0: the Engine whose steps the worker ranks run, if it is still open; else None."""
    other = _served() if _served is not None else None
    return other if other is not None and not other._closed else None


def _served_elsewhere(call: str, other) -> str:
    """The sentence that refuses `call` while the worker ranks run `other`'s steps."""
    return (f"{call}(): the worker ranks run the steps of another Engine ({other.model_config.model_dir}) until it "
            "is closed; call its close() first, even after `del` (under mpirun one Engine runs at a time).")


class Engine:
    """A model loaded on every rank, scheduled and sampled on rank 0."""

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", max_model_len: int | None = None,
                 num_threads: int | None = None, **kwargs):
        try:
            self._init(model, dtype, max_model_len, num_threads, **kwargs)
        except BaseException:
            # NOTE: a start-up that fails after the runner opened the KV disk tier gives its folder lock back
            # now (a traceback kept by a REPL kept the runner, and a corrected retry was "in use")
            self._close_disk()
            raise

    def _close_disk(self) -> None:
        """Give back the KV disk tier's folder lock of this rank, where it has one (the runner may be
        half-built, another backend's, or gone)."""
        disk = getattr(getattr(self, "runner", None), "disk", None)
        if disk is not None:
            disk.close()

    def _init(self, model, dtype, max_model_len, num_threads, **kwargs):
        from . import backend, data_parallel, distributed, profiler
        from .default_model import default_model_path
        from .gguf_model import model_dir_of
        from .kv_cache.block_manager import BlockManager
        from .sampler import Sampler
        from .router import ReplicaRouter
        from .structured import Grammars
        from .scheduler import Scheduler, SchedulerConfig
        from .tokenizer import Tokenizer

        hub = _take_vllm_kwargs(model, kwargs)
        self._pooling_default = kwargs.pop("_pooling", None)
        self._max_logprobs = kwargs.pop("_max_logprobs", 20)  # NOTE: vLLM's max_logprobs: what a request may ask
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:  # NOTE: one sentence, not the dataclass's TypeError
            raise TypeError(f"{unknown[0]!r} is not an Engine setting, nor one of vLLM's LLM arguments it takes "
                            "(README: Python).")
        self.config = EngineConfig(dtype=dtype, max_model_len=max_model_len, num_threads=num_threads, **kwargs)
        # NOTE: one thread at a time changes the engine's state (a step, an add, an abort): callers
        # on several threads are served in turn (they hung, two threads stepping one scheduler)
        self._use = threading.RLock()
        self._stepping = False  # NOTE: a step runs (_step): an abort that comes in it waits for its end
        self._deferred_aborts: deque[str] = deque()  # NOTE: applied as the outermost change ends (_atomic)
        self._depth = 0  # NOTE: _atomic's nesting on the thread that holds _use
        self._broken: str | None = None  # why the ranks are out of step (_execute), for good
        self._keeps_workers = False  # a server of several models: its worker ranks outlive each engine
        self._serial = next(_serials)
        world = env.mpi_world()
        if _workers_exited and world is not None and world[1] > 1:
            raise RuntimeError(_WORKERS_EXITED)
        other = _live_served()
        if other is not None and world is not None and world[0] == 0 and world[1] > 1:
            # NOTE: the worker ranks run that engine's loop: this one's start-up collectives waited for
            # them for ever, unseen, and one Ctrl-C did not end it (a dropped engine stays open too:
            # atexit closes it at the end of the script)
            raise RuntimeError(_served_elsewhere("Engine", other))
        self.comm = distributed.init_distributed()
        ops = backend.get_backend(self.config.backend)
        placement = self._bind_and_set_threads(ops)
        # NOTE: what can fail on one rank alone (a file, this node's memory) runs between
        # collectives and ends in _agree, so every rank fails alike instead of some waiting for ever
        with _agree(self.comm):
            # NOTE: a GGUF's weights stay in the file, blocks as they are
            model_dir = model_dir_of(str(model if model is not None else default_model_path()) if hub is None
                                     else hub())
            self.model_config = mcfg = ModelConfig.from_dir(os.path.expanduser(str(model_dir)))
            self.max_model_len = resolve_max_len(mcfg, self.config.max_model_len)
            # NOTE: fail on a missing tokenizer before reading any weight; every rank has one, so
            # that a script's tokenizer calls run unchanged on worker ranks too
            self.tokenizer = Tokenizer.from_dir(mcfg.model_dir)
            self.tokenizer.lowercase = mcfg.lowercase
        self.parallel, tp_comm, self._link = data_parallel.setup(self.comm, self.config, mcfg)
        self._tp_comm = tp_comm if tp_comm is not self.comm else None  # NOTE: a replica group's, freed at close
        if self.config.kv_cache_dir is not None and self.parallel.data_parallel > 1:
            why = "" if self.parallel.reason == "asked for" else (
                f" (the ranks run {self.parallel.data_parallel} replicas because {self.parallel.reason})")
            raise ValueError(f"The KV disk tier (kv_cache_dir) works with one tensor-parallel model{why}; run it "
                             "on a rank count that one model splits over, without data-parallel replicas.")
        if self.config.kv_cache_dir is not None and self.config.device != "cpu":
            raise ValueError("The KV disk tier (kv_cache_dir) runs on the CPU backend only; on a GPU use "
                             "host_kv_cache_memory.")
        self.recorder = profiler.make_recorder(self.comm.rank)  # a no-op unless AS_PROFILE=ON
        self.ops = profiler.timed_ops(ops, self.recorder)
        with _agree(self.comm):
            self.runner = _make_runner(mcfg, self.config, profiler.timed_comm(tp_comm, self.recorder), self.ops,
                                       self.max_model_len, _Progress() if self.comm.is_driver else None,
                                       self.recorder, gpu_index=self.comm.local_rank)
            self._check_asked_len_fits(mcfg)
        self.ranks = self.comm.gather_object(self._rank_info(placement))  # rank 0: one dict per rank
        disk_hashes = self.comm.gather_object(getattr(self.runner, "disk_hashes", []))  # rank 0: per rank
        self.placement = placement
        self.default_sampling = generation_defaults(mcfg.model_dir) if self.config.generation_config == "auto" else {}
        if not self.comm.is_driver:  # a worker serves rank 0 where the module docstring says
            self._closed = False
            atexit.register(self._close_at_exit)
            return
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(mcfg.eos_token_ids)
        _warn_uneven_threads(self.ranks)
        replica_blocks = data_parallel.replica_blocks(self.parallel, self.ranks)
        self.max_model_len = self._fit_max_len_to_cache(mcfg, min(replica_blocks))
        # NOTE: where vLLM scripts read it (llm.llm_engine.model_config.max_model_len, to cut prompts): an
        # attribute beside the dataclass's fields, so the config's equality and hash stay its file's
        object.__setattr__(mcfg, "max_model_len", self.max_model_len)
        schedulers = [Scheduler(SchedulerConfig(max_num_seqs=self.config.max_num_seqs,
                                                max_num_batched_tokens=self.config.max_num_batched_tokens,
                                                max_model_len=self.max_model_len, sliding_window=mcfg.min_window),
                                BlockManager(n, self.config.block_size,
                                             enable_prefix_caching=self.config.enable_prefix_caching,
                                             eviction=self.config.eviction, recorder=self.recorder,
                                             host_tier=self._host_tier(), tier=self._disk_tier(disk_hashes),
                                             sliding_window=mcfg.min_window))
                      for n in replica_blocks]
        # NOTE: with data-parallel replicas, one scheduler (and KV pool) per replica behind a router
        self.scheduler = schedulers[0] if len(schedulers) == 1 else ReplicaRouter(schedulers)
        self.block_manager = self.scheduler.block_manager
        self.runner = data_parallel.driver_runner(self.runner, self._link, mcfg.vocab_size)
        self.grammars = Grammars(self.tokenizer, mcfg.vocab_size, self.eos_ids)
        self.sampler = Sampler(self.ops, mcfg.vocab_size, self.config.seed, recorder=self.recorder,
                               grammars=self.grammars)
        self._profile = profiler.ProfileReports(self.recorder, self.runner.comm,
                                                os.path.basename(os.path.normpath(mcfg.model_dir)))
        self._groups: dict[str, _Group] = {}
        self._texts: dict[str, TextState] = {}
        self._step_outbox: deque[RequestOutput] = deque()  # outputs of add_request's requests
        self.last_progress = time.monotonic()  # when a forward (a step, a scratch prefill chunk) last ended
        # add_request's prompt_logprobs requests waiting for KV room for their prefill (step()
        # adds them in order once running requests free the blocks, as vLLM queues them)
        self._pending: deque[_Pending] = deque()
        self._admit_error: BaseException | None = None  # admitting one, from generate()/stream(): step() raises it
        # decode bursts (_burst_len): the runner's row bound and the last decode step's seconds
        burst_rows = getattr(self.runner, "burst_rows", None)
        self._burst_rows = burst_rows() if burst_rows is not None else 0
        self._decode_step_s = float("inf")
        self._ids = itertools.count()
        self._closed = False
        if self.comm.world_size == 1:
            # NOTE: weak: an engine dropped without close() (vLLM's `del llm`) frees its weights and KV
            # pool; one that is still alive closes at exit
            atexit.register(_close_if_alive, weakref.ref(self))
        else:  # NOTE: the worker ranks wait on it: it closes at exit whatever holds it
            atexit.register(self.close)
        self._log_start()

    # ------------------------------------------------------------------ set-up helpers
    def _bind_and_set_threads(self, ops):
        from . import numa
        # NOTE: init_distributed bound a rank; this reads it back. A single process on a host of several
        # nodes interleaves its memory over them here (else no placement: its cpus and threads as they are)
        placement = (numa.bind_this_rank(self.comm.rank, self.comm.local_rank, self.comm.local_size)
                     if self.comm.world_size > 1 else numa.place_alone())
        # NOTE: one rank reads OMP_NUM_THREADS too (numa-launch --ranks 1 sets it)
        omp = env.omp_num_threads()
        threads = self.config.num_threads or (placement.num_threads if placement else
                                              omp or len(os.sched_getaffinity(0)))
        # NOTE: under numa-launch OMP_NUM_THREADS is the launcher's (all of the rank's cpus, or
        # one fewer with --reserve-server-core), not a user's choice: reserve as under mpirun
        # NOTE: a rank that bound itself wrote OMP_NUM_THREADS: the placement says whether it was the user's
        user_threads = (placement.user_threads if placement is not None and placement.how == "self"
                        else omp is not None and not env.numa_bound())
        if (self.config.reserve_server_core and self.config.num_threads is None and self.comm.rank == 0
                and not user_threads and not env.reserved_core() and threads >= RESERVE_MIN_CPUS):
            # NOTE: with every cpu in the OpenMP team, the HTTP thread preempts a team thread
            # and every barrier of the step waits for it: on SPR-16 a streamed batch-1 request
            # decoded at 90 tok/s on 16 threads and 143 on 15 (llama-server: 137)
            threads -= 1
            log.info("rank 0: %d compute threads, one cpu left to the HTTP server "
                     "(--num-threads overrides)", threads)
        cpus = len(os.sched_getaffinity(0))
        if threads > cpus:  # NOTE: honoured, as llama.cpp's -t, but said: it is rarely what anyone wants
            log.warning("rank %d: %d compute threads on %d cpus: OpenMP threads will share cpus and each "
                        "step waits for the slowest, many times slower; give at most %d", self.comm.rank, threads,
                        cpus, cpus)
        ops.set_num_threads(threads)
        self.num_threads = threads
        return placement

    def _disk_tier(self, per_rank: list[list[int]]):
        """Rank 0's DiskTier over the blocks whose files are valid on every rank, or None."""
        cfg = self.config.disk_tier
        if cfg is None:
            return None
        from .kv_cache.disk_tier import DiskTier, worth_loading
        r, world = self.runner, self.comm.world_size
        valid = set.intersection(*(set(p) for p in per_rank))
        stale = set().union(*(set(p) for p in per_rank)) - valid  # on some ranks only: deleted
        load = cfg.load_policy == "always" or worth_loading(r.bytes_per_block / r.block_size,
                                                            self.model_config.num_params / world)
        tier = DiskTier(cfg.capacity_bytes // r.disk.file_bytes, load,
                        [h for h in per_rank[0] if h in valid], sorted(stale))
        log.info("KV disk tier %s: %d blocks found, room for %d; hits %s", r.disk.dir, len(tier),
                 tier.capacity_blocks, "are loaded" if load else "are recomputed (reading is not faster)")
        return tier

    def _rank_info(self, placement) -> dict:
        import psutil
        from . import numa
        return {"rank": self.comm.rank, "node": getattr(placement, "node", None),
                "nodes": list(getattr(placement, "nodes", ()) or ()),  # NOTE: a rank over a group of nodes
                "cpus": len(getattr(placement, "cpus", ()) or os.sched_getaffinity(0)),
                "threads": self.num_threads, "rss_bytes": psutil.Process().memory_info().rss,
                "weight_bytes": self.runner.model.weight_bytes, "kv_cache_bytes": self.runner.kv_cache_bytes,
                "kv_blocks": self.runner.num_blocks, "replica": self.parallel.replica_of(self.comm.rank),
                "memory": numa.check_binding(self.comm.rank, placement, self.runner.model.weight_buffers())}

    def _host_tier(self):
        """The CUDA runner's host KV tier (host_kv_cache_memory), else None."""
        tier = getattr(self.runner, "host_tier", None)
        if tier is not None and self.parallel.data_parallel > 1:
            raise ValueError("host_kv_cache_memory serves one model replica; set data_parallel=1 or turn it off.")
        return tier

    def _check_asked_len_fits(self, mcfg: ModelConfig) -> None:
        """Every rank, as its KV pool is made: a max_model_len the user asked for that this rank's
        pool (so its replica's) cannot hold one request of is an error, as in vLLM; the default
        one is lowered to fit (_fit_max_len_to_cache)."""
        from .config import context_in_pool
        asked, blocks, bs = self.config.max_model_len, self.runner.num_blocks, self.config.block_size
        if asked is not None and context_in_pool(asked, blocks, bs, mcfg.min_window) < asked:
            where = f" on rank {self.comm.rank}" if self.comm.world_size > 1 else ""
            w = mcfg.min_window
            enough = (f" (every layer slides a window of {w} tokens: {-(-w // bs) + 1} blocks hold any length)"
                      if w else "")
            raise ValueError(f"max_model_len={asked} is larger than the KV cache{where} holds ({blocks} blocks of "
                             f"{bs} tokens: {blocks * bs} tokens){enough}; raise kv_cache_memory (--kv-cache-memory) "
                             "or lower max_model_len.")

    def _fit_max_len_to_cache(self, mcfg: ModelConfig, num_blocks: int) -> int:
        """The context one request can really use: no more tokens than the KV cache holds (unless
        every layer slides a window, and old blocks are released)."""
        from .config import context_in_pool
        # NOTE: num_blocks: of the smallest replica's pool
        fits = context_in_pool(self.max_model_len, num_blocks, self.config.block_size, mcfg.min_window)
        if fits < self.max_model_len:  # NOTE: the default length only (_check_asked_len_fits)
            log.warning("max_model_len %d lowered to %d: the KV cache holds %d tokens; enlarge it "
                        "(kv_cache_memory) for longer requests", self.max_model_len, fits, fits)
        return fits

    def _log_start(self) -> None:
        s = self.summary()
        mib = 1 << 20
        log.info("model %s (%s) in %s on %d rank(s) x %d thread(s); max_model_len %d",
                 os.path.basename(s["model"]), s["architecture"], s["dtype"], s["ranks"],
                 s["threads_per_rank"], s["max_model_len"])
        log.info("KV cache (%s): %d blocks of %d tokens, %.0f MiB per rank, %d tokens at once%s",
                 s["kv_cache_dtype"], s["kv_blocks"], s["block_size"], s["kv_cache_bytes"] / mib,
                 s["max_concurrent_tokens"],
                 f" over {s['data_parallel']} replicas" if s["data_parallel"] > 1 else "")
        summary = getattr(self.ops, "kernel_summary", None)
        if summary is not None:
            log.info("%s", summary())
        if self.default_sampling:
            log.info("default sampling from the model's generation_config.json: %s (a request's own values "
                     "win; generation_config='vllm' ignores the file)", self.default_sampling)
        from .launch.topology import nodes_phrase
        for r in s["per_rank"] or []:
            m = r["memory"]
            where = nodes_phrase(r["nodes"]) if r.get("nodes") else "node %s" % r["node"]
            log.info("rank %d: %s, %d cpus, weights %.0f MiB, RSS %.0f MiB; memory policy %s %s, "
                     "sampled weight pages by node %s", r["rank"], where, r["cpus"], r["weight_bytes"] / mib,
                     r["rss_bytes"] / mib, m["policy"], m["policy_nodes"], m["page_nodes"])

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams samples with (vLLM's name): SamplingParams'
        defaults, with the model's generation_config.json values (`default_sampling`) unless the
        engine was made with generation_config="vllm"."""
        return SamplingParams(**self.default_sampling)

    def summary(self) -> dict:
        """What runs where. kv_blocks and max_concurrent_tokens count every replica's pool (under
        data parallel replica 0's alone was given); kv_cache_bytes is per rank."""
        c = self.model_config
        # NOTE: on a worker rank (a script's lines before its first driving call run on every rank)
        # the KV pool's size is rank 0's to know: None there
        blocks = self.block_manager.num_blocks if self.comm.is_driver else None
        return {"model": c.model_dir, "architecture": c.architecture, "dtype": self.config.dtype,
                "ranks": self.comm.world_size, "threads_per_rank": self.num_threads,
                "data_parallel": self.parallel.data_parallel, "tensor_parallel": self.parallel.tensor_parallel,
                "max_model_len": self.max_model_len, "kv_blocks": blocks,
                "block_size": self.config.block_size, "kv_cache_bytes": self.runner.kv_cache_bytes,
                "kv_cache_dtype": self.config.kv_dtype,
                "max_concurrent_tokens": None if blocks is None else blocks * self.config.block_size,
                "per_rank": self.ranks}

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, cap_max_tokens: bool = True) -> str:
        """Queue a prompt (text or token ids); returns its request id. Its outputs come back from
        step(), also those made while generate() or stream() stepped the engine. vLLM's order,
        add_request(request_id, prompt, params), works too. A max_tokens past the context ends
        the request there with finish_reason "length", as vLLM's LLM (cap_max_tokens=False: a
        ValueError, as vLLM's server)."""
        self._driver_only("add_request")
        if isinstance(request_id, SamplingParams) and not isinstance(params, SamplingParams):
            request_id, prompt, params = prompt, params, request_id  # NOTE: vLLM's LLMEngine order
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"add_request takes (prompt, params, request_id) or vLLM's (request_id, prompt, params); "
                            f"params must be a SamplingParams, got {type(params).__name__}.")
        if params is not None and params.prompt_logprobs is not None:
            # NOTE: checked now, queued behind those already waiting, or waiting itself for KV room
            with self._atomic():
                return self._add_locked(prompt, params, request_id, self._step_outbox, cap_max_tokens,
                                        defer="always" if self._pending else "if_busy")
        return self._add(prompt, params, request_id, self._step_outbox, cap_max_tokens)

    def _free_id(self, n: int) -> str:
        """A new automatic request id that no request (running or pending) holds."""
        rid = str(next(self._ids))
        while self._id_taken(rid, n):
            rid = str(next(self._ids))
        return rid

    def _admit_pending(self) -> None:
        """Queue the waiting prompt_logprobs requests whose prefill now finds KV room, in order.
        One that cannot wait (nothing runs to free blocks) or fails is dropped and its error
        raised."""
        bm = self._scratch_pool()
        try:
            while self._pending:
                if self._pending_blocks() > bm.num_free_blocks and self.scheduler.has_unfinished():
                    return  # NOTE: no room yet: not checked and tokenized again every step
                entry = self._pending.popleft()
                try:
                    self._add(entry.prompt, entry.params, entry.request_id, self._step_outbox, entry.cap_max_tokens,
                              arrival_time=entry.arrival_time)
                except KVCacheBusyError:
                    if self.scheduler.has_unfinished():
                        self._pending.appendleft(entry)
                        return
                    raise
        finally:
            self._reserve_for_pending()

    def _step_for_all(self) -> None:
        """One step from a loop other than step()'s (generate(), stream() and their adds), for every
        consumer: the waiting prompt_logprobs requests are admitted too (their reservation held
        back the loop's own requests, which then waited for ever); an error admitting one goes to
        their owner, raised by its next step(). Under _atomic."""
        try:
            self._admit_pending()
        except Exception as e:  # noqa: BLE001 - add_request's owner gets it from step(), as it would have
            self._admit_error = e
        if self.scheduler.has_unfinished():
            self._step()

    def has_work(self) -> bool:
        """Whether a step would run the model: a request runs or waits in the scheduler, or a
        prompt_logprobs request waits for KV room (its admission runs its prefill). The
        multi-model router keeps such an engine loaded and active."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    def _reserve_for_pending(self) -> None:
        """Keep the blocks of the first waiting prompt_logprobs request free of new admissions
        (requests added after it took every block that a finishing one freed, first come first
        served no more); none once nothing waits."""
        self._scratch_pool().reserve("prompt_logprobs", self._pending_blocks() if self._pending else 0)

    def _pending_blocks(self) -> int:
        """The scratch KV blocks the prompt logprobs of the first waiting request take (its prompt
        but the last token; a sliding-window model's ring of blocks, which fits the pool)."""
        return self._scratch_plan(self._pending[0].num_tokens - 1, self._prompt_logprobs_step())[2]

    def _add(self, prompt, params: SamplingParams | None, request_id: str | None, outbox: deque,
             cap_max_tokens: bool = True, added: list | None = None, arrival_time: float | None = None) -> str:
        """Queue a request whose outputs are appended to `outbox` (its owner reads them there). Its id
        goes to `added` too, inside the change: a Ctrl-C held during the add raises when the add is
        whole, before the caller has the returned id to abort. `arrival_time`: when it was first
        added (one that waited in _pending queues ahead of those added after it)."""
        with self._atomic():
            rid = self._add_locked(prompt, params, request_id, outbox, cap_max_tokens, arrival_time=arrival_time)
            if added is not None:
                added.append(rid)
            return rid

    def _add_locked(self, prompt, params: SamplingParams | None, request_id: str | None, outbox: deque,
                    cap_max_tokens: bool = True, defer: str = "no", arrival_time: float | None = None) -> str:
        """`defer` (add_request's prompt_logprobs requests, once checked whole): "always" waits in
        _pending behind those there; "if_busy" waits there when running requests hold the blocks
        its prompt's prefill needs; "no" raises KVCacheBusyError then."""
        if isinstance(params, SamplingParams):  # NOTE: as vLLM's clone: a later change to the caller's object
            params = dataclasses.replace(params)  # changes no request already added
        original = params
        if self.model_config.is_embedding_model:
            what = ("an embedding checkpoint (it declares a pooling: sentence-transformers' 1_Pooling or a "
                    "GGUF's pooling_type)" if self.model_config.pooling else "an embedding model without an LM head")
            raise ValueError(f"{self.model_config.architecture} is {what}: it does not generate text; use "
                             "Engine.embed (or /v1/embeddings).")
        params = params or self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams.")
        for field in ("logprobs", "prompt_logprobs"):
            self.check_logprobs(field, getattr(params, field))
        rid = self._free_id(params.n) if request_id is None else str(request_id)  # NOTE: a caller's id may hold it
        if rid in self._groups or self._is_pending(rid):
            raise ValueError(f"Request id {rid!r} is already in use.")
        # NOTE: as vLLM: logit_bias within the model's rows, allowed_token_ids within the tokenizer's
        # (a model may have more rows than tokens: Qwen2.5's 151936 for 151665)
        for field, ids, size in (("logit_bias", params.logit_bias, self.model_config.vocab_size),
                                 # NOTE: an id no logit row has never ends a choice: it did nothing
                                 ("stop_token_ids", params.stop_token_ids or (), self.model_config.vocab_size),
                                 ("allowed_token_ids", params.allowed_token_ids or (),
                                  min(self.model_config.vocab_size, len(self.tokenizer)))):
            bad = [t for t in ids if not 0 <= t < size]
            if bad:
                raise ValueError(f"{field} names token {bad[0]}, outside the vocabulary (size {size}).")
        if params.allowed_token_ids is not None and not params.allowed_token_ids:  # NOTE: emptied after checks
            raise ValueError("allowed_token_ids must be a non-empty list of token ids, got [].")
        constraint = params.request_constraint()  # NOTE: as set now (fields set after construction count)
        keep = prompt_truncation(params.truncate_prompt_tokens, self.max_model_len)
        text, ids = self._tokenize(prompt, keep)
        room = self.max_model_len - len(ids)
        if cap_max_tokens and params.max_tokens is not None and 0 < room < params.max_tokens:
            # NOTE: as vLLM's LLM: the request ends with "length" where the context does
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        bad_words = self._bad_words_ids(params.bad_words)
        group = _Group(rid, text, ids, params, outbox)
        arrival = time.monotonic() if arrival_time is None else arrival_time

        def undo():  # NOTE: all or none of the n sequences are queued
            for req in group.children:
                self.scheduler.abort_request(req.request_id)
                self.grammars.forget(req.request_id)
        try:
            for i in range(params.n):
                sp = params if params.n == 1 else _child_params(params, i)
                req = Request(rid if params.n == 1 else f"{rid}#{i}", ids, sp, arrival_time=arrival)
                req.bad_words_ids, req.constraint = bad_words, constraint
                self.scheduler.add_request(req)  # raises ValueError if it can never fit
                group.children.append(req)
            for req in group.children:
                if req.constraint is not None:
                    self.grammars.add(req.request_id, *req.constraint)
            if params.prompt_logprobs is not None:  # NOTE: a prefill of its own (nothing of it is stepped yet)
                if defer == "always":
                    raise KVCacheBusyError("behind the prompt_logprobs requests waiting for KV room")
                pairs = self.prompt_logprob_pairs(ids, params.prompt_logprobs)
                group.prompt_logprobs = self._vllm_prompt_logprobs(ids, pairs)
        except KVCacheBusyError:
            undo()
            if defer == "no" or (defer == "if_busy" and not self.scheduler.has_unfinished()):
                raise
            self._pending.append(_Pending(prompt, original, rid, cap_max_tokens, text, ids, arrival))
            return rid
        except BaseException:
            undo()
            raise
        self._groups[rid] = group
        for req in group.children:
            detok = IncrementalDetokenizer(self.tokenizer, ids, req.sampling_params.skip_special_tokens)
            self._texts[req.request_id] = TextState(req, detok, group, self.eos_ids, self.tokenizer.named_eos_token_id)
        return rid

    def _bad_words_ids(self, words: list[str] | None) -> list[list[int]]:
        """The token sequences SamplingParams.bad_words ban, vLLM's rule: each word as it starts a
        text, and after a space where that makes a new first token of as many tokens."""
        out: list[list[int]] = []
        for word in words or ():
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (plain, spaced) if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain) \
                    else (plain,):
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _tokenize(self, prompt, keep: int | None = None, add_special_tokens: bool = True
                  ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt; `keep`: only its last `keep` tokens (then any
        length of text is tokenized)."""
        # NOTE: vLLM's TokensPrompt may carry its text too ("prompt"): the output's prompt, as vLLM's
        given = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" in prompt else None
        if given is not None and not isinstance(given, str):
            raise TypeError(f"A prompt dict's 'prompt' must be its text, got {type(given).__name__}.")
        prompt = _prompt_of(prompt)
        if isinstance(prompt, str):
            check_text("The prompt", prompt)
            ids = (self.tokenizer.encode_last(prompt, keep, add_special_tokens=add_special_tokens) if keep is not None
                   else self.tokenizer.encode_within(prompt, self.max_model_len, add_special_tokens=add_special_tokens))
            text = prompt
        elif _is_token_ids(prompt):
            ids, text = [int(t) for t in prompt], given
            if keep is not None:
                ids = ids[-keep:]
        else:
            raise TypeError("A prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                            "'prompt_token_ids'.")
        self.check_prompt_ids(ids)  # NOTE: empty, or an id outside the vocabulary
        return text, ids

    def check_prompt_ids(self, ids: list[int]) -> None:
        """ValueError (one sentence) for a prompt of no tokens or a token id outside the vocabulary."""
        check_prompt_ids(ids, self.model_config.vocab_size)

    def get_tokenizer(self):
        """vLLM's LLM.get_tokenizer(): the model's tokenizer (encode, decode, apply_chat_template)."""
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        """vLLM's LLMEngine count: requests added and not finished (0 on a worker rank)."""
        if not self.comm.is_driver:
            return 0
        with self._atomic():
            return len(self._groups) + len(self._pending)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prompt block (later prompts compute theirs again; a disk
        tier keeps its copies). False, and nothing changes, while requests run."""
        self._driver_only("reset_prefix_cache")
        with self._atomic():
            if self.scheduler.has_unfinished() or self._pending:
                return False
            for sched in getattr(self.scheduler, "replicas", [self.scheduler]):
                bm = sched.block_manager
                for h in list(bm.hash_to_block):
                    bm.uncache(h, tier=False)
            return True

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop a request, or each of a list of them (vLLM's form); its owner gets a last output
        with finish_reason "abort". Idempotent."""
        items = [request_id] if isinstance(request_id, (str, int)) else (
            list(request_id) if isinstance(request_id, Iterable) else [None])
        if any(not isinstance(r, (str, int)) or isinstance(r, bool) for r in items):
            raise TypeError(f"abort_request takes a request id or a list of them, got {request_id!r}.")
        ids = [str(r) for r in items]
        if not self.comm.is_driver:  # NOTE: a worker rank holds no requests
            return
        with self._atomic():
            if self._stepping:
                # NOTE: this thread, inside a step (a stream() generator that the garbage collector
                # finalized there): the step's update still reads the request's state
                self._deferred_aborts.extend(ids)
                return
            dropped = [p for p in self._pending if p.request_id in ids]
            if dropped:  # NOTE: not queued yet: nothing ran, so the last output holds no tokens
                self._pending = deque(p for p in self._pending if p.request_id not in ids)
                self._reserve_for_pending()
                self._step_outbox.extend(_aborted_before_it_ran(p) for p in dropped)
            for rid in ids:
                group = self._groups.pop(rid, None)
                if group is None:
                    continue
                for req in group.children:
                    if not req.is_finished:
                        self.scheduler.abort_request(req.request_id)
                group.outbox.append(self._output(group))

    def has_unfinished_requests(self) -> bool:
        """Whether a request runs, or an output step() has yet to hand over (vLLM's loop
        `while engine.has_unfinished_requests(): engine.step()` collects every last output). False
        on a worker rank, which holds no requests."""
        if not self.comm.is_driver:
            return False
        return bool(self._groups) or bool(self._step_outbox) or bool(self._pending)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule -> execute -> update. Returns the outputs of the
        requests queued with add_request since the last call, in order (outputs of generate()
        and stream() requests go to those calls, never here)."""
        self._driver_only("step")
        with self._atomic():
            if self._admit_error is not None:
                error, self._admit_error = self._admit_error, None
                raise error
            self._admit_pending()
            if self.scheduler.has_unfinished():
                self._step()
        # NOTE: taken once the step is whole and a held Ctrl-C has raised: taken inside, the outputs
        # (a finished request's last one) were lost with the return value
        with self._use:
            return _take_all(self._step_outbox)

    @contextlib.contextmanager
    def _atomic(self):
        """A change of the engine's state (a step, an add, an abort) by one thread at a time, not
        cut by Ctrl-C: on the main thread a SIGINT is held until the change is whole, then handled
        as it would have been (KeyboardInterrupt). A step cut half-way left other consumers'
        requests with lost tokens, or waiting for ever."""
        with self._use:
            # NOTE: any Python handler is held (asyncio.run's raises KeyboardInterrupt at a second
            # Ctrl-C), and SIG_DFL; one marked `numa_runtime_unheld` (numa-serve's sets flags and dates
            # the signals) runs when the signal comes. Nested calls find the holder and leave it. A
            # SIGINT pending at a swap runs the handler it finds inside signal.signal: the caller's
            # before the swap, or the holder at the restore.
            held = _HeldSignals()
            old = None
            current = signal.getsignal(signal.SIGINT)
            if (threading.current_thread() is threading.main_thread() and not isinstance(current, _HeldSignals)
                    and (callable(current) or current == signal.SIG_DFL)
                    and not getattr(current, "numa_runtime_unheld", False)):
                try:
                    old = signal.signal(signal.SIGINT, held)
                except ValueError:  # NOTE: not the main interpreter's main thread after all
                    old = None
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._deferred_aborts and not self._stepping:
                    ids = []
                    while self._deferred_aborts:  # NOTE: popped one by one: another thread may append
                        ids.append(self._deferred_aborts.popleft())
                    self.abort_request(ids)
                if old is not None:
                    signal.signal(signal.SIGINT, old)
                    if held.frames and callable(old):
                        for frame in held.frames:  # NOTE: each, in order (asyncio's: cancel, then raise)
                            old(signal.SIGINT, frame)
                    elif held.frames and old == signal.SIG_DFL:
                        signal.raise_signal(signal.SIGINT)

    def _step(self) -> None:
        rec = self.recorder  # times the three under AS_PROFILE=ON; otherwise does nothing
        rec.begin_step()
        self._stepping = True
        try:
            with rec.span(RESHAPE, "schedule"):
                out = self.scheduler.schedule()
            self._run_step(out)
        except BaseException:
            # NOTE: a step that failed before its update wrote no KV into the blocks schedule()
            # cached ahead of it: no later request may take them as prefix hits
            self.scheduler.drop_uncomputed()
            raise
        finally:
            self._stepping = False  # NOTE: aborts that came in it are applied as its _atomic ends
        self._trace_if_due()

    def _run_step(self, out) -> None:
        """Execute the scheduled step (or a burst of decode steps from it) and update."""
        rec = self.recorder
        steps = self._burst_len(out)
        t0 = time.perf_counter()
        if steps > 1 and self.scheduler.extend_decode(out, steps):
            # NOTE: the burst's blocks may have evicted cached ones: their saves to a KV tier
            # must run before the burst writes into them (else a file holds the burst's KV
            # under the evicted block's hash, with a valid checksum)
            self._run_tier_ops()
            tokens = self._execute(self.runner.execute_burst, out.plan, steps)
            self._decode_step_s = (time.perf_counter() - t0) / steps
            with rec.span(FORWARD, "update"):
                self._update_burst(out, tokens)
            return
        logits = self._execute(self.runner.execute, out.plan)
        if logits is None:  # a block read back from disk failed its check: redo without it
            self.scheduler.redo_without(out, self.runner.failed_loads)
            return
        if self._burst_rows and out.plan.decode_only:  # decode rows: a burst's step
            self._decode_step_s = time.perf_counter() - t0
        with rec.span(FORWARD, "update"):
            self._update(out, logits)

    def _trace_if_due(self) -> None:
        """AS_PROFILE_TRACE: written once, right after the forward that makes its number of steps
        (each forward is a step: an engine step's, or an embedding's or prompt logprobs' own)."""
        if self.recorder.trace_due():
            self._write_trace()

    def _write_trace(self) -> None:
        rec = self.recorder
        try:
            self.export_chrome_trace(rec.trace_path)
        except OSError as e:  # NOTE: the step's tokens are whole: never fail requests for a trace
            log.warning("numa_runtime: AS_PROFILE_TRACE %r could not be written (%s)", rec.trace_path, e)

    def _burst_len(self, out) -> int:
        """How many greedy decode steps this step's plan runs in one go (1: just itself).
        NOTE: only where a burst changes nothing but timing: up to burst_rows sequences, each
        on its last token and greedy with nothing that changes its logits (bias, penalties,
        min_tokens, a schema) and no logprobs, no request waiting (it would wait for the burst),
        no cache tier ops; at most num_scheduler_steps steps, about BURST_SECONDS of decode at
        the last measured step time, and the fewest tokens any of the sequences has left. A
        sequence that stops inside the burst (eos, stop strings) keeps only its tokens up to
        the stop; what it computed after is dropped with it."""
        cap = min(self.config.num_scheduler_steps, int(BURST_SECONDS / max(self._decode_step_s, 1e-6)))
        reqs, plan = out.sampling, out.plan
        if (cap < 2 or not reqs or len(reqs) > self._burst_rows or plan.num_tokens != len(reqs)
                or not plan.decode_only or len(out.scheduled) != len(reqs) or out.preempted
                or self.scheduler.num_waiting or len(plan.tier_ops)):
            return 1
        for r in reqs:
            sp = r.sampling_params
            if (not sp.is_greedy or sp.logit_bias or sp.has_penalties or sp.logprobs is not None
                    or r.constraint is not None or sp.allowed_token_ids is not None or sp.bad_words
                    or r.num_output_tokens < sp.min_tokens):
                return 1
            left = self.max_model_len - r.num_tokens  # tokens it may still append
            if sp.max_tokens is not None:
                left = min(left, sp.max_tokens - r.num_output_tokens)
            cap = min(cap, left)
        return max(cap, 1)

    def _update_burst(self, out, tokens) -> None:
        """Step j of a burst's tokens [steps, S] as _update takes one step's samples: the
        requests still running each get their token; one that stopped gets no more."""
        for j in range(tokens.shape[0]):
            live = [i for i, r in enumerate(out.sampling) if not r.is_finished]
            if not live:
                return
            sub = out if len(live) == len(out.sampling) else type(out)(
                out.plan, [out.scheduled[i] for i in live], [1] * len(live), [out.sampling[i] for i in live])
            self._apply(sub, tokens[j, live], [None] * len(live))

    def _update(self, out, logits) -> None:
        """Sample, append tokens, decide stops, and hand each changed request's output to its owner."""
        ids, logprobs = self.sampler(logits, out.sampling, self.eos_ids, getattr(self.runner, "greedy_ids", None))
        self._apply(out, ids, logprobs)

    def _apply(self, out, ids, logprobs) -> None:
        self.scheduler.update(out, ids)
        changed = {}
        for req, lp in zip(out.sampling, logprobs):
            # NOTE: the filters left no token to sample (min_tokens banning all of allowed_token_ids):
            # the row's token is none the model chose, so it is no part of the output
            failed = self.sampler.exhausted.pop(req.request_id, None)
            if failed is not None:
                req.output_token_ids.pop()
            elif lp is not None:
                req.logprobs.append(lp)
            text = self._texts[req.request_id]
            token = req.output_token_ids[-1] if req.output_token_ids else None
            # NOTE: a grammar fails computing a mask (then EOS was all it allowed) or consuming a token
            failed = failed or self.grammars.error(req.request_id)
            status = None
            if failed is None:
                status = text.add_token(token, self.max_model_len)
                # NOTE: every token goes through the grammar, an end-of-sequence one too: where the
                # mask and allowed_token_ids leave no token, greedy took token 0 (an EOS for some
                # tokenizers), which ended the request as a normal stop with text the grammar refuses
                if self.grammars.advance(req.request_id, token):
                    failed = self.grammars.error(req.request_id)
                    sp = req.sampling_params
                    if failed is not None and (sp.allowed_token_ids or sp.bad_words):
                        failed = (f"{failed[:-1]} (allowed_token_ids or bad_words may exclude every token it "
                                  "allows next).")
                    if failed is None and status is None:
                        status = text.finish(RequestStatus.FINISHED_STOPPED)
            if failed is not None:
                log.warning("request %s: %s", req.request_id, failed)
                status = text.finish(RequestStatus.FINISHED_ERROR, cut_at_stop=False)
                req.stop_reason = failed
            if status is not None:
                self.scheduler.finish_request(req, status)
            changed[text.group.request_id] = text.group
        for group in changed.values():
            group.outbox.append(self._output(group))

    def _output(self, group: "_Group") -> RequestOutput:
        outs = [self._texts[req.request_id].output(i) for i, req in enumerate(group.children)]
        finished = all(r.is_finished for r in group.children)
        first = group.children[0]
        ro = RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished,
                           num_cached_tokens=first.num_cached_tokens, prompt_logprobs=group.prompt_logprobs,
                           metrics=request_metrics(group.children))
        if finished:
            self._groups.pop(group.request_id, None)
            for req in group.children:
                self._forget(req)
        return ro

    def _forget(self, req: Request) -> None:
        self._texts.pop(req.request_id, None)
        self.sampler.forget(req.request_id)
        self.grammars.forget(req.request_id)

    # ------------------------------------------------------------------ conveniences
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 sampling_params=None, use_tqdm: bool = False, lora_request=None, priority=None,
                 prompt_adapter_request=None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. A prompt is a string, a list of token
        ids, or a dict as vLLM's TextPrompt/TokensPrompt ({"prompt": ...} or {"prompt_token_ids":
        ...}); `params` one SamplingParams for all or a sequence of one per prompt (vLLM's name
        `sampling_params` works too); `use_tqdm`: a progress bar over the finished prompts.
        vLLM's lora_request, priority and prompt_adapter_request are taken at None only."""
        for name, value in (("lora_request", lora_request), ("priority", priority),
                            ("prompt_adapter_request", prompt_adapter_request)):
            if not _no_op(name, value):
                raise TypeError(f"Engine.generate() does not support {name} (LoRA adapters and priority scheduling "
                                "are not built here).")
        self._driver_only("generate")
        params = _one_of(params, sampling_params)
        plist, _ = _prompt_list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(plist):
                raise ValueError(f"Got {len(params)} SamplingParams for {len(plist)} prompts.")
        elif params is None or isinstance(params, SamplingParams):
            params = [params or self.get_default_sampling_params()] * len(plist)
        else:
            raise TypeError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}.")
        bar = None
        if use_tqdm:  # NOTE: as vLLM, a callable is the progress bar's class (tqdm or a subclass of it)
            from tqdm import tqdm
            bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=len(plist), desc="generating", unit="prompt",
                                                            file=sys.stderr)
        outbox: deque[RequestOutput] = deque()
        rids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for p, sp in zip(plist, params):
                self._add_when_room(p, sp, outbox, rids)
            while len(final) < len(rids):
                self._wait(outbox)
                for o in _take_all(outbox):
                    if o.finished:
                        final[o.request_id] = o
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.abort_request(rids)  # NOTE: at once: a second Ctrl-C between aborts left the rest running
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[r] for r in rids]

    def _add_when_room(self, prompt, params, outbox: deque, added: list) -> str:
        """_add, stepping the engine while running requests hold the KV blocks a prompt_logprobs
        prefill needs (vLLM queues such a request; a blocking call never asks its caller to retry)."""
        while True:
            try:
                return self._add(prompt, params, None, outbox, added=added)
            except KVCacheBusyError:
                with self._atomic():
                    if not self.scheduler.has_unfinished():
                        raise
                    self._step_for_all()

    def _id_taken(self, rid: str, n: int) -> bool:
        """Whether an automatic id (or one of its n children's) is a request's already."""
        live = getattr(self.scheduler, "requests", None)
        names = [rid] if n == 1 else [f"{rid}#{i}" for i in range(n)]
        return rid in self._groups or self._is_pending(rid) or (live is not None and any(x in live for x in names))

    def _is_pending(self, rid: str) -> bool:
        return any(p.request_id == rid for p in self._pending)

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request; they join to the final text. Other streams,
        generate() and step() may run between reads: each gets only its own outputs. The
        request is added at the first read; wrong params are refused at the call."""
        self._driver_only("stream")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}.")
        if params is not None and params.n != 1:
            raise ValueError(f"stream() yields the text of one completion, not n={params.n}; use "
                             f"generate() or add_request() for several.")
        if params is not None and (params.logprobs is not None or params.prompt_logprobs is not None):
            raise ValueError("stream() yields text only, so it cannot return logprobs or prompt_logprobs; use "
                             "generate(), or add_request() and step().")
        return self._stream(prompt, params)

    def _stream(self, prompt, params: SamplingParams | None) -> Iterator[str]:
        outbox: deque[RequestOutput] = deque()
        added: list[str] = []
        done = False
        try:
            self._add(prompt, params, None, outbox, added=added)
            while not done:
                self._wait(outbox)
                while outbox and not done:
                    o = outbox.popleft()
                    done = o.finished
                    if o.outputs[0].delta:
                        yield o.outputs[0].delta
        finally:
            if not done and added:
                self._abort_soon(added[0])

    def _abort_soon(self, rid: str) -> None:
        """abort_request, or where another thread holds the engine, queued for that thread to apply
        as its change ends: a stream the garbage collector finalizes may run on a thread the lock's
        holder waits for (the grammar compiler's), and waiting for the lock there hung both."""
        self._deferred_aborts.append(rid)
        if self._use.acquire(blocking=False):
            try:
                with self._atomic():
                    pass  # NOTE: its end applies the queued aborts (at once, unless this thread is mid-change)
            finally:
                self._use.release()

    def _wait(self, outbox: deque) -> None:
        """Step until `outbox` (of unfinished requests) holds an output (another thread's steps
        may fill it too)."""
        while True:
            with self._atomic():
                if outbox:
                    return
                if self._closed:  # NOTE: a stream read after close(): its workers stopped listening
                    raise RuntimeError("The engine was closed while this request ran; make a new Engine to run "
                                       "more.")
                if not self.scheduler.has_unfinished():  # NOTE: an unfinished request is always scheduled
                    raise RuntimeError("The engine has no request left to run but an output is missing; "
                                       "this is a bug in numa_runtime, please report it.")
                self._step_for_all()

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool | None = None,
             continue_final_message: bool = False, tools: list | None = None, *,
             sampling_params=None, chat_template_kwargs: dict | None = None, documents: list | None = None,
             mm_processor_kwargs=None, **template_kwargs):
        """Render messages with the model's chat template (or `chat_template`, a Jinja source)
        and generate the reply, as vLLM's LLM.chat: `continue_final_message=True` goes on with
        the last (assistant) message instead of opening a new turn; `tools`, `documents`,
        `chat_template_kwargs` and other keyword arguments (`enable_thinking`, ...: refused where the
        template never reads them) reach the template; `chat_template` may name a file. One
        conversation (a list of message dicts) gives one RequestOutput; a list of conversations a
        list of them, run as one batch. vLLM's lora_request, chat_template_content_format and
        mm_processor_kwargs are taken at their defaults only; a keyword that is a SamplingParams
        field, or a near miss of one of chat()'s own, is refused rather than handed to the template."""
        self._driver_only("chat")
        for name, value, default in (("lora_request", lora_request, None), ("mm_processor_kwargs", mm_processor_kwargs,
                                                                             None),
                                     ("chat_template_content_format", chat_template_content_format, "auto")):
            if not (_no_op(name, value) if name == "lora_request" else value == default):
                raise TypeError(f"Engine.chat() does not support {name} (only {default!r}, vLLM's default).")
        # NOTE: vLLM's LLM.chat keywords, at their no-op values as generate() takes them (priority=0 was refused)
        refused = sorted(k for k in set(template_kwargs) & _VLLM_CHAT_UNSUPPORTED if not _no_op(k, template_kwargs[k]))
        if refused:
            raise TypeError(f"Engine.chat() does not support {refused[0]}.")
        for k in _VLLM_CHAT_UNSUPPORTED:
            template_kwargs.pop(k, None)
        _check_template_kwargs(template_kwargs)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError("chat_template_kwargs must be a dict.")
        for name in [*template_kwargs, *(chat_template_kwargs or {})]:
            if name in _NOT_TEMPLATE_VARIABLES:  # NOTE: the renderer's own, or the conversation: never variables
                raise TypeError(f"Engine.chat() cannot pass {name!r} to the chat template: it is "
                                + ("the messages argument." if name == "messages" else "not a template variable."))
        chosen = _one_of(params, sampling_params)
        # NOTE: a truncated prompt may be any length: the character bound before encoding is not checked
        truncating = any(isinstance(p, SamplingParams) and p.truncate_prompt_tokens is not None
                         for p in (chosen if isinstance(chosen, (list, tuple)) else [chosen]))
        # NOTE: as vLLM, chat_template_kwargs win over the named arguments (and the other keywords)
        render_kwargs = {"add_generation_prompt": add_generation_prompt,
                         "continue_final_message": continue_final_message, "chat_template": chat_template,
                         "tools": tools, "documents": documents, **template_kwargs, **(chat_template_kwargs or {})}
        # NOTE: the template that renders (chat_template_kwargs may name it, or bring the tools that pick it)
        render_kwargs["chat_template"] = self.tokenizer.resolve_template(render_kwargs["chat_template"])
        if template_kwargs:  # NOTE: vLLM's LLM.chat takes no such keywords: one the template never reads did nothing
            unread = self.tokenizer.unread_variables(list(template_kwargs), render_kwargs["chat_template"],
                                                     render_kwargs["tools"])
            if unread:
                raise TypeError(f"Engine.chat() got {unread[0]}=, which the chat template never reads; pass "
                                "template variables it uses (or chat_template_kwargs, as vLLM).")
        batch = isinstance(messages, (list, tuple)) and len(messages) > 0 and all(
            isinstance(c, (list, tuple)) for c in messages)
        conversations = list(messages) if batch else [messages]
        prompts, ids = [], []
        for conv in conversations:
            if not isinstance(conv, (list, tuple)) or not all(isinstance(m, dict) for m in conv):
                raise TypeError("messages must be a list of message dicts ({'role': ..., 'content': ...}), or a "
                                "list of such lists.")
            if not conv:
                raise ValueError("A conversation needs at least one message.")
            # NOTE: as vLLM's parser, which reads each message's role (a message without one was
            # rendered as the template made of it)
            bad = next((i for i, m in enumerate(conv) if not isinstance(m.get("role"), str)), None)
            if bad is not None:
                raise ValueError(f"Message {bad} has no 'role' (a string such as 'user' or 'assistant').")
            prompt = self.tokenizer.render_chat(conv, **render_kwargs)
            prompts.append(prompt)
            ids.append(self.tokenizer.encode(prompt, add_special_tokens=False) if truncating else
                       self.tokenizer.encode_within(prompt, self.max_model_len, add_special_tokens=False))
        outs = self.generate(ids, chosen, use_tqdm=use_tqdm)
        for out, prompt in zip(outs, prompts):
            out.prompt = prompt  # NOTE: as vLLM's LLM.chat: the rendered template
        return outs if batch else _OneOutput(outs)

    @property
    def llm_engine(self) -> "Engine":
        """vLLM's LLM.llm_engine, whose add_request / step / has_unfinished_requests / abort_request
        loop scripts drive: this engine, which has them."""
        return self

    def _not_built(self, what: str, instead: str):
        raise NotImplementedError(f"Engine.{what} (vLLM's) is not built here; {instead}.")

    def encode(self, *args, **kwargs):
        """vLLM's generic pooling call: refused in one sentence (embed() gives embeddings)."""
        self._not_built("encode", "use Engine.embed for embeddings")

    def score(self, *args, **kwargs):
        """vLLM's cross-encoder scores: refused in one sentence."""
        self._not_built("score", "compare Engine.embed vectors for similarity")

    def classify(self, *args, **kwargs):
        """vLLM's sequence classification: refused in one sentence."""
        self._not_built("classify", "no classification heads are loaded")

    def reward(self, *args, **kwargs):
        """vLLM's reward models: refused in one sentence."""
        self._not_built("reward", "no reward heads are loaded")

    def beam_search(self, *args, **kwargs):
        """vLLM's beam search: refused in one sentence."""
        self._not_built("beam_search", "use n > 1 with sampling, or greedy decoding")

    def start_profile(self, *args, **kwargs):
        """vLLM's torch profiler: refused in one sentence naming this runtime's profiler."""
        self._not_built("start_profile", _PROFILE_INSTEAD)

    def stop_profile(self, *args, **kwargs):
        """The end of vLLM's torch profiler run: refused as start_profile."""
        self._not_built("stop_profile", _PROFILE_INSTEAD)

    def get_metrics(self, *args, **kwargs):
        """vLLM's in-process Prometheus metrics: refused in one sentence."""
        self._not_built("get_metrics", "the server's /metrics gives vLLM's metric names; in Python, each "
                        "RequestOutput.metrics holds its request's times")

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's LLM.get_world_size: the ranks of the job, or (include_dp=False) of one replica."""
        return self.comm.world_size if include_dp else self.parallel.tensor_parallel

    # ------------------------------------------------------------------ embeddings
    def embed(self, inputs, pooling: str | None = None, *, normalize: bool | None = None, dimensions: int | None = None,
              truncate_prompt_tokens: int | None = None, add_special_tokens: bool = True, use_tqdm: bool = False,
              pooling_params=None):
        """Embeddings [len(inputs), hidden] float32 of a string, token ids or a prompt dict (as
        generate takes them), or a list of them: the final normed hidden states pooled by "mean"
        (over the tokens), "last" (the last token) or "cls" (the first). Default: the pooling a
        sentence-transformers checkpoint declares (Qwen3-Embedding: last), "last" for another base
        model without an LM head, "mean" otherwise. As vLLM's pooling parameters: `normalize`
        (unit length; default: yes, but for a sentence-transformers checkpoint without a Normalize
        module), `dimensions` (the first ones of a Matryoshka model, normalized after),
        `truncate_prompt_tokens` (keep the last k tokens; -1: the context's length); vLLM's
        `pooling_params` (an object or dict with those fields) and `use_tqdm` (a progress bar). A
        model made with vLLM's runner="pooling" (task/convert "embed") pools the last token by
        default, as vLLM does."""
        self._driver_only("embed")
        if isinstance(pooling_params, dict) and "use_activation" in pooling_params:  # NOTE: normalize's newer name
            pooling_params = dict(pooling_params)
            act = pooling_params.pop("use_activation")
            if pooling_params.get("normalize") is None:
                pooling_params["normalize"] = act
        if isinstance(pooling_params, dict):
            unknown = sorted(set(pooling_params) - {"normalize", "dimensions", "truncate_prompt_tokens"})
            if unknown:
                raise ValueError(f"pooling_params takes normalize, dimensions and truncate_prompt_tokens; "
                                 f"{unknown[0]!r} is not supported.")
        if pooling_params is not None and not isinstance(pooling_params, dict):
            # NOTE: vLLM's PoolingParams or the like: its fields read by name; use_activation is normalize
            if not any(hasattr(pooling_params, k) for k in ("normalize", "dimensions", "truncate_prompt_tokens",
                                                                "use_activation")):
                raise TypeError(f"pooling_params must be a dict or a PoolingParams, got {type(pooling_params).__name__}.")
            act = getattr(pooling_params, "use_activation", None)
            if act is not None and getattr(pooling_params, "normalize", None) is None:
                pooling_params = {"normalize": act, "dimensions": getattr(pooling_params, "dimensions", None),
                                  "truncate_prompt_tokens": getattr(pooling_params, "truncate_prompt_tokens", None)}
        if pooling_params is not None:
            get = pooling_params.get if isinstance(pooling_params, dict) else (
                lambda k, d=None: getattr(pooling_params, k, d))
            normalize = get("normalize", None) if normalize is None else normalize
            dimensions = get("dimensions", None) if dimensions is None else dimensions
            truncate_prompt_tokens = get("truncate_prompt_tokens", None) if truncate_prompt_tokens is None \
                else truncate_prompt_tokens
        cfg = self.model_config
        pooling = pooling or cfg.pooling or self._pooling_default or ("last" if cfg.is_embedding_model else "mean")
        if pooling not in ("mean", "last", "cls"):
            raise ValueError(f"pooling must be 'mean', 'last' or 'cls', got {pooling!r}.")
        normalize = cfg.embed_normalize if normalize is None else normalize
        if not isinstance(normalize, bool) or not isinstance(add_special_tokens, bool):
            raise TypeError("normalize and add_special_tokens must be True or False.")
        size = embedding_size(cfg, dimensions)
        keep = prompt_truncation(truncate_prompt_tokens, self.max_model_len)
        items, _ = _prompt_list(inputs, "inputs")
        if not items:
            raise ValueError("Give at least one input to embed.")
        all_ids = []
        for i, item in enumerate(items):
            try:
                _, ids = self._tokenize(item, keep, add_special_tokens)
            except (ValueError, TypeError) as e:  # NOTE: name the input, as the length check does
                if len(items) == 1:
                    raise
                raise type(e)(f"Input {i}: {str(e)[:1].lower()}{str(e)[1:]}") from None
            check_input_length(i, len(ids), self.max_model_len)
            all_ids.append(ids)
        # NOTE: the inputs run one after another in scratch blocks: check room for the longest
        # first, so that a call waiting for room (AsyncEngine retries it) computes nothing; a
        # window model's input longer than the pool runs in chunks over the window's ring of blocks
        # (as its prompt logprobs do: the engine generates from such a prompt, so it embeds it too)
        step, bm = self.config.max_num_batched_tokens, self._scratch_pool()
        need = max((self._scratch_plan(n, step)[2] if self._embeds_in_chunks(n) else bm.num_blocks_for(n), n)
                   for n in set(map(len, all_ids)))
        self._scratch_room(need[1], need[0])
        out = np.empty((len(items), size), np.float32)  # [N, size]
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=len(all_ids), desc="Embedding", unit="input")
        for i, ids in enumerate(all_ids):
            if self._embeds_in_chunks(len(ids)):
                v = self._pooled_in_chunks(ids, pooling, step)[:size]
            else:
                rows = {"mean": np.arange(len(ids)), "last": [len(ids) - 1], "cls": [0]}[pooling]
                h = self._final_hidden(ids, rows)  # [n or 1, hidden]
                v = (h.mean(axis=0) if pooling == "mean" else h[0])[:size]
            out[i] = v / max(float(np.linalg.norm(v)), 1e-12) if normalize else v
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return out.view(Embeddings)

    def _embeds_in_chunks(self, n: int) -> bool:
        """Whether an input of n tokens is embedded in chunks over a window's ring of blocks: a
        sliding-window model's input that the pool cannot hold whole."""
        bm = self._scratch_pool()
        return bool(self.model_config.min_window) and bm.num_blocks_for(n) > bm.num_blocks

    def _pooled_in_chunks(self, ids: list[int], pooling: str, step: int):
        """The pooled final hidden state of `ids` (mean, last or cls) from a prefill in chunks of
        at most `step` tokens (_prefill_chunks: the ring of a window model)."""
        from .plan import EMBED
        total = first = last = None
        with self._atomic(), contextlib.closing(self._prefill_chunks(ids, step, EMBED)) as chunks:
            for a, h in chunks:
                h = np.asarray(h, np.float32)
                if pooling == "mean":
                    part = h.sum(axis=0, dtype=np.float64)
                    total = part if total is None else total + part
                if a == 0:
                    first = h[0].copy()
                last = h[-1].copy()
        return {"mean": None if total is None else (total / len(ids)).astype(np.float32),
                "cls": first, "last": last}[pooling]

    def _final_hidden(self, ids: list[int], rows):
        """Normed final hidden states [len(rows), hidden] at positions `rows` of `ids`."""
        import numpy as np
        from .plan import EMBED
        return self._forward_once(ids, np.asarray(rows, dtype=np.int64), EMBED)

    # ------------------------------------------------------------------ scoring
    def prompt_logprobs(self, prompt):
        """Log-probabilities [n - 1] float32 of tokens 1 .. n-1 of `prompt` (a string or token
        ids), each given the tokens before it, from one forward pass: a perplexity is
        exp(-mean) of them. The prompt must fit the context (max_model_len)."""
        import numpy as np
        from .plan import EXECUTE
        self._driver_only("prompt_logprobs")
        _, ids = self._tokenize(prompt)
        n = len(ids)
        if not 2 <= n <= self.max_model_len:
            raise ValueError(f"prompt_logprobs needs 2 to {self.max_model_len} tokens (the context), got {n}.")
        bm = self.block_manager
        if self.model_config.min_window and -(-n // bm.block_size) > bm.num_blocks:
            # NOTE: a window model's prompt longer than the pool: prompt_logprob_pairs' chunks over a
            # ring of blocks that holds the window (one pass would need every block at once)
            return np.array([lp for lp, _, _ in self.prompt_logprob_pairs(ids, 0)], np.float32)
        logits = self._forward_once(ids, np.arange(n - 1, dtype=np.int64), EXECUTE)   # [n - 1, vocab]
        lp = np.empty(logits.shape, np.float32)
        self.ops.log_softmax(np.ascontiguousarray(logits, dtype=np.float32), lp)
        return lp[np.arange(n - 1), ids[1:]]

    def check_logprobs(self, field: str, asked) -> None:
        """`asked` log-probabilities of a request's `field` within max_logprobs (vLLM's), or one sentence."""
        if asked is not None and asked > self._max_logprobs:
            raise ValueError(f"{field} asks for {asked} log-probabilities, more than this engine's max_logprobs "
                             f"({self._max_logprobs}).")

    def prompt_logprob_pairs(self, prompt, num_logprobs: int = 0) -> list[tuple]:
        """Per token 1 .. n-1 of `prompt` (its ids as given: no special tokens added to ids):
        (its logprob, {the `num_logprobs` most likely tokens: logprob}, its rank), as generated
        tokens' logprob_pairs: what echo and prompt_logprobs return. One prefill in scratch KV
        blocks, in chunks of at most max_num_batched_tokens rows and PROMPT_LOGITS_BYTES of logits
        (a long prompt's whole [n, vocab] would not fit)."""
        self._driver_only("prompt_logprob_pairs")
        if not _is_int(num_logprobs) or not 0 <= num_logprobs <= 20:
            raise ValueError(f"num_logprobs must be an integer in [0, 20], got {num_logprobs!r}.")
        self.check_logprobs("num_logprobs", num_logprobs)  # NOTE: echo and prompt_logprobs ran past it
        _, ids = self._tokenize(prompt)
        n = len(ids)
        if n > self.max_model_len:
            raise ValueError(f"The prompt has {n} tokens, but the context holds {self.max_model_len}.")
        if n < 2:
            return []
        step = self._prompt_logprobs_step()
        out = []
        # NOTE: position p predicts token p + 1; closing() returns the scratch blocks inside the lock
        with self._atomic(), contextlib.closing(self._prefill_chunks(ids[:-1], step)) as chunks:
            for a, logits in chunks:
                self._pairs_of(logits, ids[a + 1:a + 1 + len(logits)], num_logprobs, out)
        return out

    def _prompt_logprobs_step(self) -> int:
        """Rows of one chunk of prompt_logprob_pairs' prefill: max_num_batched_tokens, and at most
        PROMPT_LOGITS_BYTES of f32 logits."""
        return max(1, min(PROMPT_LOGITS_BYTES // (4 * self.model_config.vocab_size),
                          self.config.max_num_batched_tokens))

    def _scratch_plan(self, n: int, step: int, rows=None) -> tuple[int, int, int]:
        """(rows a chunk, the prompt's blocks, the blocks taken) of a scratch prefill of n tokens
        in chunks of `step` (_prefill_chunks)."""
        bm = self._scratch_pool()
        total, bs, win = bm.num_blocks_for(n), bm.block_size, self.model_config.min_window
        ring = total
        if win and rows is None:
            # NOTE: every layer slides (as the scheduler runs such a prompt): chunks that fit the pool
            # beside the window before them, in a ring of blocks that holds the window and a chunk
            # (+1: the window need not start on a block boundary); it took the whole prompt's blocks,
            # and a prompt the engine generates from failed its prompt logprobs
            step = min(step, max(1, (bm.num_blocks - 1) * bs - (win - 1)))
            ring = min(total, bm.num_blocks_for(win - 1 + step) + 1)
        return step, total, ring

    def _vllm_prompt_logprobs(self, ids: list[int], pairs: list[tuple]) -> list:
        """vLLM's RequestOutput.prompt_logprobs: None, then per prompt token {token id: Logprob}
        holding it first and the most likely tokens."""
        from .outputs import logprob_dict
        name = self.tokenizer.decoded_token
        return [None] + [logprob_dict(tid, lp, rank, top, name) for tid, (lp, top, rank) in zip(ids[1:], pairs)]

    def _prefill_chunks(self, ids: list[int], step: int, kind: int | None = None, rows=None):
        """(first position, output) of each chunk of `step` tokens of one prefill of `ids` in
        scratch KV blocks of replica 0: the model's output (logits, or final hidden states for
        EMBED) at every row of the chunk, or at `rows` (positions; one chunk only). Under _atomic."""
        from .plan import EXECUTE, StepPlan
        kind = EXECUTE if kind is None else kind
        n = len(ids)
        step, total, ring = self._scratch_plan(n, step, rows)
        bs = self._scratch_pool().block_size
        bm = self._scratch_room(n, ring)
        blocks = bm.take_blocks(ring)
        try:
            table = np.asarray(blocks, np.int64)[np.arange(total) % ring]
            run = getattr(self.runner, "local", self.runner).execute  # NOTE: DP: replica 0's
            for a in range(0, n, step):
                b = min(n, a + step)
                pos = np.arange(a, b, dtype=np.int64)
                plan = StepPlan(np.asarray(ids[a:b], np.int64), pos, table[pos // bs] * bs + pos % bs,
                                np.array([0, b - a], np.int32), np.array([b], np.int32),
                                table[None, :].astype(np.int32),
                                np.arange(b - a, dtype=np.int64) if rows is None else np.asarray(rows, np.int64),
                                kind=kind,
                                tier_ops=bm.tier.take_ops() if bm.tier is not None and a == 0 else None,
                                num_prompt_rows=b - a)
                self.recorder.begin_step()  # NOTE: a step on every rank, as the workers count it (TimedComm)
                result = self._execute(run, plan)
                self._trace_if_due()
                yield a, result
        finally:
            bm.return_blocks(blocks)

    def _pairs_of(self, logits, next_ids: list[int], num_logprobs: int, out: list) -> None:
        """Append (logprob of next_ids[r], {top tokens: logprob}, its rank) of each row r of
        `logits` [rows, vocab] to `out`."""
        from .sampler import rank_of, top_logprobs
        lp = np.empty(logits.shape, np.float32)
        self.ops.log_softmax(np.ascontiguousarray(logits, dtype=np.float32), lp)
        for row, tok in zip(lp, next_ids):
            out.append((float(row[tok]), top_logprobs(row, num_logprobs), rank_of(row, tok)))

    def _forward_once(self, ids: list[int], rows, kind: int):
        """One forward over `ids` in scratch KV blocks of replica 0: the model's output (logits,
        or final hidden states for EMBED) at positions `rows`."""
        with self._atomic():
            return self._forward_once_locked(ids, rows, kind)

    def _scratch_pool(self):
        """The block manager scratch forwards take blocks from: replica 0's."""
        return getattr(self.scheduler, "replicas", [self.scheduler])[0].block_manager

    def _scratch_room(self, n: int, need: int | None = None):
        """The block manager whose pool scratch forwards use (replica 0's, with data-parallel
        replicas), once it has room for `n` tokens (in `need` blocks; all of n's by default)
        now: ValueError if it never will, however long one waits, KVCacheBusyError if running
        requests hold the blocks."""
        bm = self._scratch_pool()
        need = bm.num_blocks_for(n) if need is None else need
        if need > bm.num_blocks:
            raise ValueError(f"{n} tokens need {need} KV blocks, but the cache has {bm.num_blocks}; shorten the "
                             "input or enlarge the KV cache (kv_cache_memory).")
        if need > bm.num_free_blocks:
            raise KVCacheBusyError(f"The KV cache has no room for {n} tokens now; retry when requests finish.",
                                   block_manager=bm, num_blocks=need)
        return bm

    def _forward_once_locked(self, ids: list[int], rows, kind: int):
        with contextlib.closing(self._prefill_chunks(ids, len(ids), kind, rows)) as chunks:
            return next(chunks)[1]

    # ------------------------------------------------------------------ operator profiling
    # AS_PROFILE=ON: every rank's op timings (profiler.py); RuntimeError when profiling is off.
    def get_op_profiling_info(self, model_name: str | None = None) -> str:
        """The report: `*** reshape ***`, `*** alloc ***`, `*** forward ***` tables of every rank."""
        return self._reports(lambda p: p.report(model_name))

    def get_op_profiling_stats(self) -> list[dict]:
        """The report's rows as dicts: rank, section, opname, count, min/max/ave/total_ms, percentage."""
        return self._reports(lambda p: p.stats())

    def reset_op_profiling(self) -> None:
        """Start a new profiling window on every rank."""
        self._reports(lambda p: p.reset())

    def export_chrome_trace(self, path: str, steps: int | None = None) -> str:
        """Write the last `steps` kept steps of every rank as a Chrome trace; returns path."""
        return self._reports(lambda p: p.chrome_trace(path, steps))

    def _reports(self, call):
        """`call(profile)`: a plan to every rank and their gather, whole as a step is (a Ctrl-C
        between the two left the workers in the gather, paired with rank 0's next step)."""
        self._driver_only("get_op_profiling")
        with self._atomic():
            return call(self._profile)

    # ------------------------------------------------------------------ ranks
    @property
    def is_driver(self) -> bool:
        """True on rank 0 (and in a single process): the rank that schedules and drives."""
        return self.comm.is_driver

    def _close_at_exit(self) -> None:
        """A worker rank's script ended: serve rank 0 until it closes the engine; this process
        then ends (rank 0 learns so, and refuses a new Engine rather than wait for this rank)."""
        self.serve_workers(_exiting=True)

    def serve_workers(self, _exiting: bool = False) -> None:
        """On a worker rank: execute rank 0's step plans until rank 0 closes the engine, then
        return. On rank 0 (or in a single process): return at once."""
        if self.comm.is_driver or self._closed:
            return
        self._closed = True
        from . import data_parallel
        # NOTE: mpiexec forwards a Ctrl-C to every rank. A worker interrupted inside a step left
        # rank 0 waiting in its collective (NUMA_RUNTIME_COLLECTIVE_TIMEOUT, 300 s); rank 0 takes
        # it between steps and ends the job ("rank 0 failed: interrupted") or closes the engine
        held = (signal.signal(signal.SIGINT, signal.SIG_IGN)
                if threading.current_thread() is threading.main_thread() else None)
        try:
            self.ops.set_num_threads(self.num_threads)  # NOTE: this engine's, whatever engine set it last here
            data_parallel.worker_loop(self.runner, self._link)
        finally:
            if held is not None:
                signal.signal(signal.SIGINT, held)
        if not self._keeps_workers:
            # NOTE: rank 0's close() learns whether this rank exits; timed as rank 0 times it (untimed under data
            # parallel: rank 0 may wait longer than that for another replica's queued plans before it comes)
            self.comm.gather_object(_exiting, timed=self._link is None)
            self.close_comms()  # NOTE: collective, as rank 0's _shutdown: the shared-memory window goes
            self._close_disk()  # NOTE: its folder lock: a later Engine of this script may open it
        atexit.unregister(self._close_at_exit)  # NOTE: it kept every closed engine's weights alive

    def _execute(self, run, *args):
        """A step on every rank. On several ranks a step that fails on rank 0 once the workers
        have its plan leaves them at another point of the step than rank 0 (their next
        collectives would pair with the wrong ones: wrong output, or a hang): the engine is
        then broken for good (every later call says so; close() ends the MPI job)."""
        # NOTE: OpenMP's team size is the calling thread's, and shared by every engine on that
        # thread: another engine made since, or a step driven from another thread, ran this one's
        # steps on another count (its summary still said its own)
        get = getattr(self.ops, "get_num_threads", None)
        if get is not None and get() != self.num_threads:
            self.ops.set_num_threads(self.num_threads)
        try:
            result = run(*args)
            self.last_progress = time.monotonic()  # NOTE: a forward ended (the server's stall clock)
            bad = getattr(self.runner, "failed_saves", None)
            tier = getattr(getattr(self, "block_manager", None), "tier", None)
            if bad and tier is not None:  # NOTE: a file no rank could write (a full disk) is no tier entry
                for h in bad:
                    tier.drop(h)
                self.runner.failed_saves = set()
            return result
        except BaseException as e:
            if self.comm.world_size > 1:
                self._broken = (f"a step failed on rank 0 ({type(e).__name__}: {e}) after the other ranks had "
                                "started it, so the ranks are out of step; restart the job")
            raise

    def _driver_only(self, call: str) -> None:
        """`call` drives the engine: on a worker rank, serve rank 0 and end this process."""
        if self.comm.is_driver:
            if self._closed:  # NOTE: its worker ranks have stopped listening
                raise RuntimeError(f"{call}(): the engine is closed; make a new Engine to run more.")
            if self._broken:
                raise RuntimeError(f"{call}(): {self._broken}.")
            if self.comm.world_size > 1 and not self._keeps_workers:
                # NOTE: the workers run the first engine driven until it closes; the plans of another
                # went to them and they waited in the wrong arena until the collective timeout
                global _served
                if _workers_exited:  # NOTE: an engine made before another one's close ended the workers
                    raise RuntimeError(f"{call}(): {_WORKERS_EXITED}")
                other = self._other_served()
                if other is not None:
                    raise RuntimeError(_served_elsewhere(call, other))
                _served = weakref.ref(self)
            return
        log.info("rank %d is a worker rank: at its first driving call (%s) it serves rank 0's steps until "
                 "rank 0 closes the engine, then this process exits, so the rest of the script runs on "
                 "rank 0 only (engine.serve_workers() serves and returns instead)", self.comm.rank, call)
        self.serve_workers(_exiting=True)
        raise SystemExit(0)

    def close(self) -> None:
        """Rank 0: stop the worker ranks (if any). A worker rank: serve_workers(). Idempotent."""
        if getattr(self, "_closed", True):
            return
        if not self.comm.is_driver:
            self.serve_workers()
            return
        # NOTE: as a step, by one thread at a time and whole: a close beside another thread's step
        # returned while it ran (its KV never reached the disk tier), and a Ctrl-C in the flush or
        # between the workers' shutdown plan and their gather left them waiting
        with self._atomic():
            if not self._closed:
                self._close()

    def _close(self) -> None:
        global _served
        if (self.is_driver and not self._broken and not self._workers_elsewhere()
                and self.recorder.trace_due(closing=True)):  # AS_PROFILE_TRACE: fewer steps ran than it keeps
            self._write_trace()
        self._closed = True
        atexit.unregister(self.close)  # NOTE: else atexit keeps an unloaded model's weights alive
        if self._broken:  # NOTE: no shutdown plan can reach workers out of step
            log.error("numa_runtime: %s; ending the MPI job", self._broken)
            self.comm.abort(f"the engine stopped: {self._broken}.", 1)
            return
        if self._workers_elsewhere():
            # NOTE: the workers run another engine's steps: this engine's shutdown plan would end their
            # loop of it (its next step then failed). The workers serve this one after that one (at
            # their exit, or when their script closes it): its shutdown goes then. Its disk tier is
            # not flushed (a flush runs a step, which the other engine's loop would take).
            _deferred.append(self)
            return
        self._shutdown(flush=True)
        if _served is not None and _served() is self:
            _served = None
            for e in sorted(_deferred, key=lambda e: -e._serial):  # NOTE: as a worker's atexit: newest first
                e._shutdown(flush=False)
            _deferred.clear()

    def _workers_elsewhere(self) -> bool:
        """The worker ranks run another engine's steps now (this one's plans cannot reach them)."""
        return self.comm.world_size > 1 and not self._keeps_workers and self._other_served() is not None

    def close_comms(self) -> None:
        """Collective on every rank, once the workers left this engine's loop: frees its host
        communicator and shared-memory window, and its replica group's under data parallel."""
        close = getattr(self.comm, "close", None)
        if close is not None:
            close()
        tp, self._tp_comm = getattr(self, "_tp_comm", None), None
        if tp is not None:
            from . import data_parallel
            data_parallel.close_group(tp)

    def _other_served(self):
        """Rank 0: the live Engine other than this one whose steps the worker ranks run, or None."""
        other = _live_served()
        return other if other is not self else None

    def _shutdown(self, flush: bool) -> None:
        """Rank 0: end the workers' loop of this engine (and learn whether they exit)."""
        global _workers_exited
        try:
            if flush:
                self._flush_disk_tier()
            self.runner.shutdown_workers()
            self.runner.release()  # NOTE: the CUDA runner's GPU memory
            if self.comm.world_size > 1 and not self._keeps_workers:
                # NOTE: each worker says whether it exits now (its first driving call) or returns
                # from serve_workers(): a later Engine would wait for ever for ranks that are gone
                # NOTE: the gather always runs (an `or` skipped it once the workers had exited, and a
                # worker's gather then waited for rank 0 for ever where it takes part in a barrier)
                # NOTE: timed under data parallel too: shutdown_workers waited for every replica to leave its loop
                exited = any(self.comm.gather_object(False, timed=True)[1:])
                _workers_exited = _workers_exited or exited
                # NOTE: each Engine makes its own communicator and window (a job that makes and
                # closes engines grew by one each); the router closes those of the engines it keeps
                self.close_comms()
        except Exception as e:  # noqa: BLE001 - shutting down anyway
            log.warning("numa_runtime: shutting down workers failed: %s", e)

    def _flush_disk_tier(self) -> None:
        """Write every cached block to the disk tier, so that a restart finds them."""
        if getattr(self.block_manager, "tier", None) is not None:
            self.block_manager.offload_all()
            self._run_tier_ops()

    def _run_tier_ops(self) -> None:
        """Carry out the KV tier's queued ops now, in a step of no tokens."""
        tier = getattr(self.block_manager, "tier", None)  # NOTE: none under data-parallel replicas
        ops = tier.take_ops() if tier is not None else ()
        if len(ops):
            from .plan import StepPlan
            self._execute(self.runner.execute, StepPlan.empty(ops))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # NOTE: one rank: an engine dropped without close() closes as it goes (its disk tier is
        # flushed); with worker ranks atexit holds it, so it never gets here unclosed
        if not getattr(self, "_closed", True) and getattr(getattr(self, "comm", None), "world_size", 0) == 1:
            with contextlib.suppress(Exception):
                self.close()


def check_load_format(fmt, model) -> None:
    """vLLM's load_format: 'auto', or the format the model's files are in (a .gguf file, or
    safetensors in a directory or on the Hub; the built-in default model is its GGUF); ValueError
    (one sentence) otherwise: a format that is not the files' would be ignored."""
    if fmt not in ("auto", "safetensors", "gguf"):
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'gguf' (the model's files say which), "
                         f"got {fmt!r}.")
    gguf = model is None or str(model).lower().endswith(".gguf")
    if fmt != "auto" and (fmt == "gguf") != gguf:
        what = "the built-in model" if model is None else str(model)
        raise ValueError(f"load_format {fmt!r} does not match {what}, which is "
                         f"{'a GGUF file' if gguf else 'not a .gguf file'}; leave it 'auto'.")


class _HeldSignals:
    """Engine._atomic's SIGINT handler while a change runs: the frames of the signals it held."""

    def __init__(self):
        self.frames: list = []

    def __call__(self, signum, frame) -> None:
        self.frames.append(frame)


def _close_if_alive(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


class KVCacheBusyError(RuntimeError):
    """embed / prompt_logprobs: running requests hold the blocks the input needs (it fits the
    pool: it can run once some finish; the server's engine loop retries it after each step and
    meanwhile reserves `num_blocks` of `block_manager` against new admissions)."""

    def __init__(self, message: str, block_manager=None, num_blocks: int = 0):
        super().__init__(message)
        self.block_manager, self.num_blocks = block_manager, num_blocks


class RankLoadError(RuntimeError):
    """Another rank failed to load the model (this one raises too, so that none waits)."""


def _take_vllm_kwargs(model, kwargs: dict):
    """vLLM's LLM(...) keyword arguments, taken out of `kwargs` with their meaning here (a
    tensor_parallel_size checked against the MPI job, the ranks beyond it replicas; enforce_eager:
    no CUDA graphs) or refused in one sentence naming this runtime's own setting. Returns None, or
    for a Hub id with revision/download_dir the call that fetches it."""
    for name in ("trust_remote_code", "disable_log_stats", "disable_custom_all_reduce", "compilation_config"):
        kwargs.pop(name, None)  # NOTE: no model code runs here, no stats are logged, MPI sums, nothing compiles
    for name, ok in (("tokenizer_mode", ("auto", "hf")), ("model_impl", ("auto",)),
                     ("distributed_executor_backend", (None, "mp", "uni")), ("enable_lora", (False,)),
                     ("override_generation_config", (None, {})), ("logprobs_mode", LOGPROBS_MODES)):
        if name in kwargs and kwargs.pop(name) not in ok:
            why = (" (log-probabilities are the model's own distribution, before temperature, penalties, "
                   "logit_bias, top-k and top-p, as vLLM's default)" if name == "logprobs_mode" else "")
            raise ValueError(f"{name} (vLLM's) may only be {' or '.join(repr(v) for v in ok)} here{why}.")
    if "max_logprobs" in kwargs:
        top = kwargs.pop("max_logprobs")
        if not _is_int(top) or not 0 <= top <= 20:
            unlimited = " (-1, vLLM's no limit, is not offered: at most 20)" if top == -1 else ""
            raise ValueError(f"max_logprobs (vLLM's) must be 0 to 20 here (the logprobs a request may ask for)"
                             f"{unlimited}, got {top!r}.")
        kwargs["_max_logprobs"] = top
    if "kv_cache_memory_bytes" in kwargs:  # NOTE: vLLM's newer name of the KV cache's size
        if kwargs.get("kv_cache_memory") is not None:
            raise ValueError("kv_cache_memory_bytes (vLLM's) and kv_cache_memory are one setting; give one of them.")
        kwargs["kv_cache_memory"] = kwargs.pop("kv_cache_memory_bytes")
    for name, ok in RUNNER_VALUES.items():  # NOTE: vLLM's "pooling"/"embed": embeddings pool the last token
        value = kwargs.pop(name, None)
        if value is not None and value not in ok:
            raise ValueError(f"{name}={value!r} (vLLM's) is not supported here: it takes {', '.join(map(repr, ok))} "
                             "(this engine generates text and embeds; classify, score and reward models are not run).")
        if value in POOLING_VALUES:
            kwargs["_pooling"] = "last"
    token = kwargs.pop("hf_token", None)
    if token is not None and not isinstance(token, (str, bool)):
        raise TypeError(f"hf_token must be a Hugging Face token (a string) or a bool, got {type(token).__name__}.")
    if kwargs.pop("enforce_eager", False):
        kwargs["cuda_graphs"] = False
    if kwargs.pop("enable_chunked_prefill", True) is False:
        raise ValueError("enable_chunked_prefill=False is not supported: long prompts are always prefilled in chunks "
                         "of max_num_batched_tokens.")
    if kwargs.pop("pipeline_parallel_size", 1) != 1:
        raise ValueError("pipeline_parallel_size must be 1: ranks split each layer (tensor parallel), not the layers.")
    check_load_format(kwargs.pop("load_format", "auto"), model)
    for name, why in (("gpu_memory_utilization", "sizes a GPU's KV cache as a share of its memory; give the KV "
                       "cache's bytes per rank as kv_cache_memory"),
                      ("swap_space", "keeps preempted sequences in host memory; here they are recomputed"),
                      ("tokenizer", "names a tokenizer apart from the model; here it is the model's own")):
        value = kwargs.pop(name, None)
        if value is not None and not (name == "tokenizer" and value == model):
            raise ValueError(f"{name} (vLLM's) {why}.")
    tp = kwargs.pop("tensor_parallel_size", None)
    if tp is not None:
        from .config import replicas_for_tp
        dp = replicas_for_tp(tp, kwargs.get("data_parallel"), (env.mpi_world() or (0, 1))[1],
                             f"tensor_parallel_size={tp}", "run the script as `mpirun -np {n} python SCRIPT`, one "
                             "rank a NUMA node")
        if dp is not None:
            kwargs["data_parallel"] = dp  # NOTE: vLLM's tp x dp
    revision, where = kwargs.pop("revision", None), kwargs.pop("download_dir", None)
    from .hub import is_repo_id, local_path
    hub_id = model is not None and is_repo_id(str(model))
    if revision is None and where is None:
        # NOTE: a token goes to this engine's fetch only (it was set as HF_TOKEN for the whole process);
        # a local model needs none
        return (lambda: local_path(str(model), token=token)) if token is not None and hub_id else None
    if not hub_id:  # NOTE: they did nothing there
        raise ValueError("revision and download_dir choose a Hugging Face Hub model's files; "
                         + ("the built-in default model" if model is None else f"{model!r}") + " is no Hub id.")
    return lambda: local_path(str(model), revision=revision, cache_dir=where, token=token)


@contextlib.contextmanager
def _agree(comm):
    """Every rank: run the block, then learn whether it failed on any rank (one collective).
    A rank where it failed raises its own error; the others raise RankLoadError naming the
    first rank that failed and why."""
    err = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised below, after the ranks agree
        err = e
    if comm.world_size > 1:
        reports = comm.all_gather_object(None if err is None else f"{type(err).__name__}: {err}")
        failed = [(r, m) for r, m in enumerate(reports) if m is not None]
        if failed:
            close = getattr(comm, "close", None)
            if close is not None:
                close()  # NOTE: collective, as the gather: every rank frees its share of the window
        if failed and err is None:
            r, why = failed[0]
            e = RankLoadError(f"Rank {r} failed to load the model ({why}).")
            e.agreed = True
            raise e
    if err is not None:
        err.agreed = True  # NOTE: every rank knows: each may exit, none waits for another (env.load_failed)
        raise err


def _make_runner(mcfg, cfg: EngineConfig, comm, ops, max_model_len: int, progress, recorder, gpu_index: int):
    """The one place where the device picks the model runner (torch is imported only for cuda)."""
    if cfg.device == "cuda":
        if mcfg.num_experts:
            raise UnsupportedModelError(f"{mcfg.model_dir}: a mixture-of-experts model ({mcfg.architecture}) has no "
                                        "CUDA kernels yet; run it on the CPU (drop device='cuda' / --device cuda).")
        from . import cuda_backend
        return cuda_backend.make_runner(mcfg, cfg, comm, max_model_len, progress, gpu_index, recorder)
    from .model_runner import ModelRunner
    return ModelRunner(mcfg, cfg, comm, ops, max_model_len, progress=progress, recorder=recorder)


class _Group:
    """The n sequences of one user request."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 outbox: deque):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.outbox = outbox  # where its outputs go: the queue its owner reads
        self.children: list[Request] = []
        self.prompt_logprobs: list | None = None  # vLLM's, when params.prompt_logprobs asks


def _take_all(outbox: deque) -> list:
    items = list(outbox)
    outbox.clear()
    return items


def _child_params(p: SamplingParams, i: int) -> SamplingParams:
    return dataclasses.replace(p, n=1, seed=None if p.seed is None else (p.seed + i) % (1 << 64))


class _Progress:
    """A tqdm bar over the layers being loaded (rank 0, on a terminal or when asked)."""

    def __init__(self):
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        from . import env
        if not (sys.stderr.isatty() or env.show_progress()):
            return
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="loading weights", unit="layer", file=sys.stderr)
        self.bar.update(done - self.bar.n)
        if done == total:
            self.bar.close()


# NOTE: chat()'s own parameters, for the near misses _check_template_kwargs refuses
_CHAT_OWN = ("messages", "params", "sampling_params", "use_tqdm", "chat_template", "chat_template_kwargs",
             "add_generation_prompt", "continue_final_message", "tools", "documents", "lora_request",
             "chat_template_content_format", "mm_processor_kwargs")
# NOTE: apply_chat_template's own arguments (Hugging Face's) and the conversation: never template variables
_NOT_TEMPLATE_VARIABLES = ("messages", *HF_RENDER_ARGS, "tokenization_kwargs")


def _check_template_kwargs(kwargs: dict) -> None:
    """TypeError (one sentence) for a keyword chat() would otherwise hand its template unused: a
    SamplingParams field, or a near miss of chat()'s own parameters (use_tdqm)."""
    import difflib
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    for name in kwargs:
        if name in fields:
            raise TypeError(f"Engine.chat() got {name}=, a sampling setting: pass "
                            f"sampling_params=SamplingParams({name}=...).")
        near = difflib.get_close_matches(name, _CHAT_OWN, n=1, cutoff=0.75)
        if near and near[0] != name:
            raise TypeError(f"Engine.chat() got an unexpected keyword argument {name!r}; did you mean {near[0]!r}?")


# NOTE: LLM.chat arguments of vLLM with no meaning here (else they would reach the template unread)
_VLLM_CHAT_UNSUPPORTED = {"prompt_adapter_request", "priority"}
# what start_profile / stop_profile (vLLM's torch profiler) say to use instead
_PROFILE_INSTEAD = ("set AS_PROFILE=ON (operator times, Engine.get_op_profiling_info) or AS_PROFILE_TRACE=FILE "
                    "(a Chrome trace) before the engine starts")


def _no_op(name: str, value) -> bool:
    """vLLM's lora_request / priority / prompt_adapter_request at a value that asks for nothing: None,
    priority 0, or a sequence (one a prompt) of those."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return all(v is None or (name == "priority" and isinstance(v, int) and v == 0) for v in values)


def request_metrics(children: list[Request]) -> RequestMetrics:
    """RequestOutput.metrics of a request's sequences (n > 1: its first child's start, its latest
    token, and its end once every child has ended), as vLLM V0's RequestMetrics."""
    first = children[0]
    last = [r.last_token_time for r in children if r.last_token_time is not None]
    ends = [r.finished_time for r in children]
    return RequestMetrics(
        arrival_time=first.arrival_time, last_token_time=max(last) if last else None,
        first_scheduled_time=first.first_scheduled_time, first_token_time=first.first_token_time,
        time_in_queue=(None if first.first_scheduled_time is None
                       else first.first_scheduled_time - first.arrival_time),
        finished_time=None if None in ends else max(ends))


def first_bad_id(ids: list[int], vocab_size: int) -> int | None:
    """The first token id outside the vocabulary, or None."""
    return next((t for t in ids if not 0 <= t < vocab_size), None)


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    """ValueError (one sentence) for a prompt of no tokens or a token id outside the vocabulary."""
    if not ids:
        raise ValueError("The prompt is empty.")
    bad = first_bad_id(ids, vocab_size)
    if bad is not None:
        raise ValueError(f"Token id {bad} is outside the vocabulary (size {vocab_size}).")


_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _prompt_of(prompt):
    """A vLLM TextPrompt/TokensPrompt dict as the text or token ids it holds; any other prompt
    as it is. TypeError for a dict with neither key or with keys it cannot honour."""
    if not isinstance(prompt, dict):
        return prompt
    other = sorted(k for k in prompt if k not in _PROMPT_KEYS)
    if other:
        raise TypeError(f"A prompt dict may hold 'prompt' or 'prompt_token_ids'; {other[0]!r} is not supported.")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not _is_token_ids(ids):  # NOTE: a string there was tokenized as text (HF's apply_chat_template
            # returns ids only with tokenize=True)
            if not isinstance(ids, (list, tuple, np.ndarray)):
                raise TypeError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}.")
            i, bad = next((i, t) for i, t in enumerate(ids) if not _is_token_ids([t]))
            raise TypeError(f"prompt_token_ids must be a list of integer token ids; item {i} is {bad!r} "
                            f"({type(bad).__name__}).")
        return ids
    if "prompt" in prompt:
        return prompt["prompt"]
    raise TypeError("A prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids).")


PROMPT_LOGITS_BYTES = 256 << 20  # prompt_logprob_pairs: logits rows per forward


class _Pending(typing.NamedTuple):
    """An add_request whose prompt_logprobs prefill waits for KV room (Engine._pending)."""
    prompt: object
    params: SamplingParams
    request_id: str
    cap_max_tokens: bool
    prompt_text: str | None
    prompt_ids: list[int]
    arrival_time: float

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


def _aborted_before_it_ran(p: _Pending) -> RequestOutput:
    """The last output of a waiting prompt_logprobs request that was aborted: each of its n
    sequences empty, finish_reason "abort" (as every aborted request's owner gets one)."""
    outs = [CompletionOutput(i, "", [], finish_reason="abort") for i in range(p.params.n)]
    return RequestOutput(p.request_id, p.prompt_text, p.prompt_ids, outs, True,
                         metrics=RequestMetrics(arrival_time=p.arrival_time))


class _OneOutput(list):
    """Engine.chat's answer to one conversation: vLLM's list of one RequestOutput, which also reads
    as that output (`.text`, `.outputs`, ...), as this engine's chat returned it before."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self[0], name)


class _EmbeddingOutput:
    """vLLM's EmbeddingOutput: `embedding` as a list of floats."""

    def __init__(self, embedding: list[float]):
        self.embedding = embedding

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class Embeddings(np.ndarray):
    """What Engine.embed returns: a float32 array [inputs, size], whose rows also read as vLLM's
    LLM.embed outputs (`for o in eng.embed(texts): o.outputs.embedding`, a list of floats)."""

    @property
    def outputs(self) -> _EmbeddingOutput:
        if self.ndim != 1:
            raise AttributeError("outputs is a row's (vLLM's EmbeddingRequestOutput.outputs): take a row, or "
                                 "iterate over them.")
        return _EmbeddingOutput([float(x) for x in self])


def _warn_uneven_threads(ranks: list[dict]) -> None:
    """A warning when the ranks of one replica compute on very different thread counts (a cpuset
    covering most of one node and little of another): each tensor-parallel step waits for the slowest."""
    replicas: dict = {}
    for r in ranks or []:
        replicas.setdefault(r.get("replica", 0), []).append(r)
    for group in replicas.values():
        slow = min(group, key=lambda r: r["threads"])
        most = max(r["threads"] for r in group)
        if len(group) > 1 and most >= 1.5 * slow["threads"]:
            log.warning("ranks %s compute on %d to %d threads: each tensor-parallel step waits for the slowest "
                        "(rank %d, on %d); give every rank as many cores (a rank count that splits every "
                        "socket's NUMA nodes evenly, or a cpuset of whole nodes)",
                        ",".join(str(r["rank"]) for r in group), slow["threads"], most, slow["rank"], slow["threads"])


def resolve_max_len(mcfg: ModelConfig, asked: int | None) -> int:
    """The max_model_len asked, or the model's length up to 32768 tokens when none is (None);
    ValueError past what the model supports."""
    from .config import supported_len
    limit = supported_len(mcfg)
    if asked is None:
        return min(limit, 32768)
    if asked > limit:
        why = {"dynamic": " (its 'dynamic' rope scaling runs within max_position_embeddings only)",
               "longrope": " (its longrope scaling runs with the short factors, within "
                           "original_max_position_embeddings; numa_runtime does not run the long factors)"
               }.get(mcfg.rope.rope_type, "")
        raise ValueError(f"max_model_len={asked} exceeds what the model supports ({limit} tokens){why}.")
    return asked


def check_input_length(i: int, n: int, max_model_len: int) -> None:
    """ValueError naming input `i` when its n tokens exceed the context (embed, /v1/embeddings)."""
    if n > max_model_len:
        raise ValueError(f"Input {i} has {n} tokens, but the context holds {max_model_len}; shorten it, raise "
                         "max_model_len, or set truncate_prompt_tokens.")


def embedding_size(cfg: ModelConfig, dimensions) -> int:
    """An embedding's length: the hidden size, or `dimensions` where the model is Matryoshka."""
    if dimensions is None:
        return cfg.hidden_size
    if not _is_int(dimensions) or not 1 <= dimensions <= cfg.hidden_size:
        raise ValueError(f"dimensions must be an integer from 1 to {cfg.hidden_size} (the hidden size), "
                         f"got {dimensions!r}.")
    if not cfg.is_matryoshka:
        raise ValueError("dimensions is not supported by this model: it was not trained for Matryoshka embeddings "
                         "(config.json sets neither is_matryoshka nor matryoshka_dimensions), so a shorter "
                         "embedding would lose meaning; omit it.")
    if cfg.matryoshka_dimensions and dimensions not in cfg.matryoshka_dimensions:
        raise ValueError(f"dimensions must be one of {list(cfg.matryoshka_dimensions)} for this model, "
                         f"got {dimensions}.")
    return int(dimensions)


def prompt_truncation(truncate_prompt_tokens, max_model_len: int) -> int | None:
    """How many last tokens of an input to keep (None: all), as vLLM's truncate_prompt_tokens."""
    k = truncate_prompt_tokens
    if k is None:
        return None
    if not _is_int(k) or not (k == -1 or 1 <= k <= max_model_len):
        raise ValueError(f"truncate_prompt_tokens must be -1 (all the model's positions) or from 1 to "
                         f"{max_model_len}, got {k!r}.")
    return max_model_len if k == -1 else int(k)


def _prompt_list(prompts, what: str = "prompts") -> tuple[list, bool]:
    """(the prompts as a list, whether `prompts` was one prompt): a string, a prompt dict or
    token ids is one prompt; another iterable (list, tuple, generator, 2-D array) holds several."""
    if isinstance(prompts, (str, dict)) or (_is_token_ids(prompts) and len(prompts) > 0):
        return [prompts], True
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise TypeError(f"{what} must be a string, a list of token ids, a prompt dict or a list of them, got "
                        f"{type(prompts).__name__}.")
    return list(prompts), False


def _one_of(params, sampling_params):
    """`params`, or vLLM's keyword name for it; not both."""
    if sampling_params is None:
        return params
    if params is not None:
        raise TypeError("Pass the sampling parameters once: params or sampling_params, not both.")
    return sampling_params


def _is_token_ids(prompt) -> bool:
    """A list, tuple or 1-D array of integer token ids (numpy integers too, not bools)."""
    return ((isinstance(prompt, (list, tuple)) or (isinstance(prompt, np.ndarray) and prompt.ndim == 1))
            and all(isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_)) for t in prompt))
