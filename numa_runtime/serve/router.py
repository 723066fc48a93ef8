"""Several models in one server on one set of ranks, inside one memory budget.

`ModelRouter` looks like one Engine to AsyncEngine (add_request / step / abort_request /
has_unfinished_requests), so the one engine thread drives every model: each request goes to
the Engine of the model it names (`route[request_id]`, set by the HTTP side before it queues
the request), and `step()` steps every loaded model that has work.

Memory rule (logged at start-up): a model's footprint per rank is its weights (parameters x
dtype bytes / ranks; after loading, what it really holds) plus its KV pool, which is
`kv_cache_memory` if given, else a quarter of the budget split evenly over the models. A model
is loaded on its first request; if its footprint does not fit beside the loaded ones, loaded
models without unfinished requests are unloaded, least recently used first. If that is not
enough (the others are busy), the request fails with ModelUnavailableError (503, Retry-After).

Ranks: every model spans all ranks, split as one model would be (no data-parallel replicas).
Workers sit in
`worker_main()`; rank 0 tells them to build (LOAD i) or drop (UNLOAD i) model i (every rank
parsed the same model list) and to enter model i's plan loop (ENTER i); a SHUTDOWN plan sent by
model i's runner brings them back (`_activate`).
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from ..config import ModelConfig, context_in_pool, kv_pool_blocks, supported_len
from ..plan import StepPlan
from ..profiler import label_trace
from ..weights import trim_heap

log = logging.getLogger("numa_runtime.serve")

LOAD, UNLOAD, ENTER, EXIT = 11, 12, 13, 14  # control plans, outside plan.py's kinds
KV_SHARE = 0.25  # of the budget, split over the models, when kv_cache_memory is not given


class ModelUnavailableError(RuntimeError):
    """The model cannot be loaded now: the others fill the budget and are busy."""


class ModelLoadError(RuntimeError):
    """The model failed to load (on every rank; the others keep serving)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_dir: str
    given: str | None = None  # the --model string as typed, where it is not the name: also served under it


@dataclass(frozen=True)
class RouterConfig:
    models: tuple[ModelSpec, ...]
    memory_budget: int                      # bytes per rank for every model's weights and KV
    engine_kwargs: dict = field(default_factory=dict)  # dtype, max_model_len, ... for every Engine

    def __post_init__(self):
        if not self.models:
            raise ValueError("Give at least one model (--model DIR or --models-dir DIR).")
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            name = sorted(dup)[0]
            where = " and ".join(m.model_dir for m in self.models if m.name == name)
            raise ValueError(f"Two models are named {name!r} ({where}): a model is named by the last part of "
                             f"its directory or file, so give them distinct names (a symlink will do).")
        if not isinstance(self.memory_budget, int) or self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {self.memory_budget!r}.")


def models_in_dir(path: str) -> list[ModelSpec]:
    """Every subdirectory of `path` holding a config.json, named by the subdirectory, and every
    .gguf file in it, named by its stem (a split GGUF by its first file)."""
    paths = model_paths_in_dir(path)
    if not paths:
        raise FileNotFoundError(f"--models-dir {path!r} holds no model (a subdirectory with config.json, or a "
                                f".gguf file).")
    return [model_spec(p) for p in paths]


def model_paths_in_dir(path: str) -> list[str]:
    """The paths models_in_dir serves (nothing read but the folder's listing)."""
    path = os.path.expanduser(path)  # NOTE: as --model's (`--models-dir=~/models` reaches us unexpanded)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--models-dir {path!r} is not a directory.")
    from ..gguf_model import _SHARD
    paths, names = [], sorted(os.listdir(path))
    for n in names:
        p = os.path.join(path, n)
        shard = _SHARD.match(n)  # NOTE: a model split by gguf-split counts once, by its first file
        if n.startswith("."):  # NOTE: hidden entries (.cache, .git) are no models
            continue
        if os.path.isfile(os.path.join(p, "config.json")) or (
                os.path.isfile(p) and n.lower().endswith(".gguf") and (shard is None or shard["no"] == "00001")):
            paths.append(p)
        elif n.lower().endswith(".gguf") and not os.path.isfile(p):  # NOTE: it was left out without a word
            log.warning("--models-dir: %s is not a readable file (a broken link?); it is not served.", p)
        elif shard is not None and f"{shard['stem']}-00001-of-{shard['count']}.gguf" not in names:
            log.warning("--models-dir: %s is part %d of a split GGUF model whose first file is missing; it is "
                        "not served.", p, int(shard["no"]))
    return paths


def model_spec(path: str, name: str | None = None) -> ModelSpec:
    """A model directory, or a GGUF file as the directory describing it (gguf_model_dir, made
    on first use), named `name` or by that directory's last part: a GGUF by its stem (a split
    model's without its shard suffix), a Hugging Face Hub id (fetched) by itself, as in vLLM."""
    from ..gguf_model import model_dir_of
    from ..hub import served_name
    name = name or served_name(path)
    path = model_dir_of(path)
    return ModelSpec(name or os.path.basename(os.path.normpath(path)), path)


def model_tokenizer(name: str, model_dir: str):
    """The model's tokenizer; ValueError naming the model where its files cannot be read (the
    tokenizers library's own error named neither)."""
    from ..tokenizer import Tokenizer
    try:
        return Tokenizer.from_dir(model_dir)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception for a bad file
        if isinstance(e, (ValueError, OSError)) and (name in str(e) or model_dir in str(e)):
            raise
        raise ValueError(f"Model {name!r}: cannot read its tokenizer in {model_dir} ({e}).") from None


def parse_bytes(text: str) -> int:
    """'8G', '512M', '1.5T', '1000000' -> bytes (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, KeyError, OverflowError):
        raise ValueError(f"Cannot read {text!r} as a size; write e.g. 16G, 512M or a number of bytes.") from None


class ModelRouter:
    """The engine thread's view of every model (see the module docstring)."""

    def __init__(self, config: RouterConfig, comm_world: int = 1, is_driver: bool = True,
                 tokenizers: dict | None = None):
        """`tokenizers`: name -> tokenizer already read (rank 0), for the models it holds."""
        if comm_world > 1 and config.engine_kwargs.get("device") == "cuda":
            # NOTE: each model would open its own NCCL group, and switching models closed it
            raise ValueError("Several models on the CUDA backend run on one rank (one GPU); start one "
                             "server per model to spread them over GPUs.")
        self.config = config
        self.world = comm_world
        self.specs = {m.name: m for m in config.models}
        self.index = {m.name: i for i, m in enumerate(config.models)}
        self.model_configs = {m.name: ModelConfig.from_dir(os.path.expanduser(m.model_dir)) for m in config.models}
        if comm_world > 1:  # NOTE: collective: every rank builds its router at start-up
            from ..distributed import init_distributed
            self._control_comm = init_distributed()
            # NOTE: a rank sized its default budget from its own memory limit (another host, a
            # cgroup): the smallest binds every rank, so that the checks below and each model's KV
            # pool come out alike on all of them (one rank refusing alone left the others waiting)
            budget = min(self._control_comm.all_gather_object(config.memory_budget))
            if budget != config.memory_budget:
                self.config = config = replace(config, memory_budget=budget)
        self.footprint = {n: self._estimate(n) for n in self.specs}  # bytes per rank
        self.engines: OrderedDict[str, object] = OrderedDict()  # loaded, least recently used first
        # NOTE: /metrics counts over the server's life: what unloaded engines had counted, per
        # model (preemptions, prefix-cache hit tokens, prompt tokens looked up)
        self._past: dict[str, list[int]] = {n: [0, 0, 0] for n in self.specs}
        self._context: dict[str, int] = {}  # name -> its max_model_len when it was last loaded
        # name -> (its files' stamp, the error, when) of its last failed load: weights that cannot
        # be opened (when: None) are refused until their files change; after a load that failed
        # otherwise (memory, a rank's node) its requests fail at once for env.load_retry_seconds()
        # (else each retry unloaded the idle models again for a load that failed again: every
        # such request cost the others a reload)
        self._failed: dict[str, tuple] = {}
        self._loads: dict[str, int] = {}  # times each model was loaded (its AS_PROFILE_TRACE file's name)
        self.route: dict[str, str] = {}   # request id -> model name (set by the HTTP side)
        self.since: dict[str, float] = {}  # request id -> when it first asked (time.monotonic(), HTTP side)
        # HTTP side: a token of each request that waits for room busy models hold -> (its model, since)
        self.waiters: dict[object, tuple[str, float]] = {}
        self.owner: dict[str, str] = {}   # request id -> model name, while it runs
        self._active: str | None = None   # the model whose plan loop the workers are in
        # NOTE: every model spans all ranks as one tensor-parallel model (no replicas), with the
        # KV pool the budget's rule gives it (else each engine would size its own from the host)
        self._engine_kwargs = {**config.engine_kwargs, "data_parallel": 1, "kv_cache_memory": self._kv_bytes()}
        self.load_seconds: dict[str, float] = {}
        self.unload_seconds: dict[str, float] = {}
        self._check()  # NOTE: on every rank, from what every rank holds alike (files, arguments, the budget)
        if is_driver:
            given = tokenizers or {}
            self.tokenizers = {n: given[n] if n in given else model_tokenizer(n, c.model_dir)
                               for n, c in self.model_configs.items()}
            self._log()

    # ------------------------------------------------------------------ memory
    def _kv_bytes(self) -> int:
        given = self.config.engine_kwargs.get("kv_cache_memory")
        return int(given) if given is not None else int(self.config.memory_budget * KV_SHARE / len(self.specs))

    def _estimate(self, name: str) -> int:
        dtype = self.config.engine_kwargs.get("dtype", "bfloat16")
        item = 4 if dtype in ("float32", "fp32", "float") else 2
        return self.model_configs[name].num_params * item // self.world + self._kv_bytes()

    def context_len(self, name: str) -> int:
        """The max_model_len `name` has, or will have once loaded: its Engine's, or the same rule
        over the KV pool the budget gives it (no more tokens than the pool holds)."""
        eng = self.engines.get(name)
        if eng is not None:
            return eng.max_model_len
        if name in self._context:
            return self._context[name]
        from ..config import EngineConfig
        from ..engine import resolve_max_len
        from ..models.llama import ShardLayout, kv_block_bytes
        mcfg = self.model_configs[name]
        asked = resolve_max_len(mcfg, self.config.engine_kwargs.get("max_model_len"))
        ecfg = EngineConfig(**{k: v for k, v in self._engine_kwargs.items() if k in EngineConfig.__dataclass_fields__})
        heads = max(ShardLayout.build(mcfg, r, self.world).num_kv_heads for r in range(self.world))
        block = kv_block_bytes(mcfg, heads, ecfg.block_size, ecfg.kv_dtype)
        # NOTE: each model's engine is given its KV bytes (kv_cache_memory): no cap, as there
        blocks = kv_pool_blocks(self._kv_bytes(), block, ecfg.max_num_seqs, asked, ecfg.block_size, cap=False)
        return context_in_pool(asked, blocks, ecfg.block_size, mcfg.min_window)

    @property
    def used_bytes(self) -> int:
        return sum(self.footprint[n] for n in self.engines)

    def _check(self) -> None:
        """ValueError (one sentence) for a model no request could ever load: at start-up."""
        asked, mib, budget = self.config.engine_kwargs.get("max_model_len"), 1 << 20, self.config.memory_budget
        for n, mcfg in self.model_configs.items():
            if mcfg.num_heads < self.world:  # NOTE: each model runs on every rank: no replicas to fall back on
                raise ValueError(f"Model {n!r} has {mcfg.num_heads} attention heads, too few to split over "
                                 f"{self.world} ranks, and a server of several models runs each model on every "
                                 f"rank; start it on at most {mcfg.num_heads} ranks or serve that model alone.")
            if asked is not None and asked > supported_len(mcfg):
                raise ValueError(f"max_model_len={asked} exceeds what model {n!r} supports "
                                 f"({supported_len(mcfg)} tokens); lower --max-model-len.")
            held = None if asked is None else self.context_len(n)
            if held is not None and held < asked:  # NOTE: as Engine's check at load
                raise ValueError(f"max_model_len={asked} is larger than the KV cache of model {n!r} holds "
                                 f"({held} tokens); raise --kv-cache-memory or lower --max-model-len.")
            if self.footprint[n] > budget:
                raise ValueError(f"Model {n!r} needs about {self.footprint[n] / mib:.0f} MiB per rank, more than "
                                 f"the memory budget ({budget / mib:.0f} MiB); raise --memory-budget or lower "
                                 "--kv-cache-memory.")

    def _log(self) -> None:
        mib, budget = 1 << 20, self.config.memory_budget
        log.info("memory budget %.0f MiB per rank; rule: weights + a KV pool of %.0f MiB per model "
                    "(%s); least recently used idle models are unloaded to make room",
                    budget / mib, self._kv_bytes() / mib,
                    "--kv-cache-memory" if "kv_cache_memory" in self.config.engine_kwargs
                    else f"{KV_SHARE:.0%} of the budget / {len(self.specs)} models")
        for n, b in self.footprint.items():
            log.info("model %s: %.0f MiB per rank (weights %.0f + KV %.0f)", n, b / mib,
                        (b - self._kv_bytes()) / mib, self._kv_bytes() / mib)

    # ------------------------------------------------------------------ loading
    def get(self, name: str, since: float | None = None):
        """The loaded Engine of `name`, loading it (and unloading idle ones) if needed. A request
        that first asked at `since` waits (ModelUnavailableError) behind an unloaded model that
        has waited for room since before it, as Ollama's queue does: else new requests to the busy
        models, or another model's load, kept it out until its load timeout."""
        ahead = sorted((t, w) for w, t in tuple(self.waiters.values())
                       if since is not None and t < since and w != name and w not in self.engines)
        if ahead:  # NOTE: a loaded model's new requests, and a later model's load, both wait
            raise ModelUnavailableError(
                f"The model {name!r} takes this request once {ahead[0][1]!r}, which asked first, has "
                "loaded in the room the busy models hold; retry shortly.")
        if name in self.engines:
            self.engines.move_to_end(name)
            return self.engines[name]
        failed = self._failed.get(name)
        if failed is not None and failed[0] == _stamp(self.specs[name].model_dir):
            # NOTE: a model that failed to load fails again without unloading the others for it
            _, message, when = failed
            if when is None:
                raise ModelLoadError(message)
            from .. import env
            left = when + env.load_retry_seconds() - time.monotonic()
            if left > 0:
                raise ModelLoadError(f"{message.rstrip('.')} (a request loads it again {left:.0f} s from now).")
        self._check_files(name)  # NOTE: before anything is unloaded for it
        need = self.footprint[name]
        for victim in list(self.engines):
            if self.used_bytes + need <= self.config.memory_budget:
                break
            # NOTE: an abort's last output may wait; a prompt_logprobs request waiting for KV room may not
            if not self.engines[victim].has_work():
                self._unload(victim)
        if self.used_bytes + need > self.config.memory_budget:
            raise ModelUnavailableError(
                f"The model {name!r} does not fit in the memory budget beside the busy models "
                f"{list(self.engines)}; retry when their requests finish.")
        return self._load(name)

    def _check_files(self, name: str) -> None:
        """ModelLoadError (remembered) if the model's weights cannot even be opened (missing or
        truncated files): found before idle models are unloaded to make room for it."""
        import json
        from ..gguf_model import open_checkpoint
        cfg = self.model_configs[name]
        try:
            for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
                path = os.path.join(cfg.model_dir, f)
                if os.path.exists(path):
                    try:
                        with open(path, "rb") as fh:
                            json.load(fh)
                    except ValueError as e:
                        raise ValueError(f"{path} is not valid JSON ({e})") from None
            ckpt = open_checkpoint(cfg)
            whole = getattr(getattr(ckpt, "ckpt", ckpt), "check_whole", None)  # NOTE: AWQ/GPTQ wrap theirs
            if whole is not None:  # NOTE: a GGUF file is checked whole when opened
                whole()
        except Exception as e:  # noqa: BLE001 - as a load failure
            self._fail(name, e, remember=True)

    def _fail(self, name: str, e: BaseException, remember: bool = False):
        """A load failure; `remember`: the files are at fault, so it fails alike until they change
        (a failure of the load itself may pass: memory, a worker's node; it is tried again after
        env.load_retry_seconds())."""
        log.error("model %s failed to load: %s", name, e)
        message = f"The model {name!r} failed to load: {e}"
        self._failed[name] = (_stamp(self.specs[name].model_dir), message, None if remember else time.monotonic())
        raise ModelLoadError(message) from None

    def _load(self, name: str):
        from ..engine import Engine
        t0 = time.perf_counter()
        self._send(LOAD, name)
        try:
            eng = Engine(self.specs[name].model_dir, **self._engine_kwargs)
            eng._keeps_workers = True  # NOTE: the workers go back to worker_main when it closes
            self._loads[name] = self._loads.get(name, 0) + 1
            label_trace(eng.recorder, name, self._loads[name])  # NOTE: every model's trace went to one file
        except Exception as e:  # noqa: BLE001 - every rank failed alike; the other models go on
            self._fail(name, e)
        self._failed.pop(name, None)
        self._active = None  # the workers are back in worker_main
        self.engines[name] = eng
        r = eng.runner
        self.footprint[name] = r.model.weight_bytes + r.kv_cache_bytes
        self.load_seconds[name] = time.perf_counter() - t0
        self._context[name] = eng.max_model_len
        log.info("loaded model %s in %.2f s (%.0f MiB per rank)", name, self.load_seconds[name],
                    self.footprint[name] / (1 << 20))
        return eng

    def _unload(self, name: str) -> None:
        t0 = time.perf_counter()
        self._activate(name)
        eng = self.engines.pop(name)
        past = self._past[name]
        past[0] += eng.scheduler.num_preemptions
        past[1] += eng.block_manager.hit_tokens
        past[2] += eng.block_manager.query_tokens
        eng.close()  # flushes its disk tier; its SHUTDOWN plan returns the workers to worker_main
        self._active = None
        self._send(UNLOAD, name)
        eng.close_comms()  # NOTE: collective (frees the shared-memory windows): every rank does it here
        del eng
        release_memory()
        self.footprint[name] = self._estimate(name)
        self.unload_seconds[name] = time.perf_counter() - t0
        log.info("unloaded model %s in %.2f s", name, self.unload_seconds[name])

    def _activate(self, name: str) -> None:
        """Make the workers run `name`'s plans (no-op on one rank)."""
        if self.world == 1 or self._active == name:
            return
        if self._active is not None:
            self.engines[self._active].runner.shutdown_workers()
        self._send(ENTER, name)
        self._active = name

    def _send(self, kind: int, name: str | None) -> None:
        if self.world > 1:
            if self._active is not None and kind != ENTER:
                self.engines[self._active].runner.shutdown_workers()
                self._active = None
            self._control_comm.broadcast_plan(_control(kind, -1 if name is None else self.index[name]))

    # ------------------------------------------------------------------ Engine-like surface
    def add_request(self, prompt, params=None, request_id: str | None = None, *, cap_max_tokens: bool = True) -> str:
        name = self.route.pop(str(request_id), None)
        since = self.since.pop(str(request_id), None)
        if name is None:
            raise ValueError(f"Request {request_id!r} names no model.")
        eng = self.get(name, since)
        self._activate(name)
        rid = eng.add_request(prompt, params, request_id=request_id, cap_max_tokens=cap_max_tokens)
        self.owner[rid] = name
        return rid

    def abort_request(self, request_id: str) -> None:
        self.route.pop(request_id, None)
        self.since.pop(request_id, None)
        name = self.owner.pop(request_id, None)
        if name in self.engines:
            self.engines[name].abort_request(request_id)

    @property
    def last_progress(self) -> float:
        """When a forward of any loaded model last ended (the server's stall clock)."""
        return max((getattr(e, "last_progress", 0.0) for e in self.engines.values()), default=0.0)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines.values())

    # NOTE: what AsyncEngine's gauges and queue limit read from an engine's scheduler and block
    # manager, summed over the loaded models
    @property
    def num_running(self) -> int:
        return sum(e.scheduler.num_running for e in self.engines.values())

    @property
    def num_waiting(self) -> int:
        return sum(e.scheduler.num_waiting for e in self.engines.values())

    def _lifetime(self, name: str) -> tuple[int, int, int]:
        """(preemptions, prefix-cache hit tokens, prompt tokens looked up) of model `name` over
        the server's life: its unloaded engines' and its live one's."""
        pre, hits, queries = self._past[name]
        e = self.engines.get(name)
        if e is not None:
            pre += e.scheduler.num_preemptions
            hits, queries = hits + e.block_manager.hit_tokens, queries + e.block_manager.query_tokens
        return pre, hits, queries

    @property
    def num_preemptions(self) -> int:
        return sum(self._lifetime(n)[0] for n in self._past)

    @property
    def usage(self) -> float:
        blocks = [(e.block_manager.num_blocks, e.block_manager.usage) for e in self.engines.values()]
        total = sum(n for n, _ in blocks)
        return sum(n * u for n, u in blocks) / total if total else 0.0

    @property
    def hit_rate(self) -> float:
        """Over every model's life, unloaded ones too (it counted the loaded models only)."""
        totals = [self._lifetime(n) for n in self._past]
        hits, queries = sum(t[1] for t in totals), sum(t[2] for t in totals)
        return hits / queries if queries else 0.0

    def model_stats(self) -> list[tuple]:
        """Per model, for /metrics' engine gauges under vLLM's model_name label: (name, running,
        waiting, KV usage, prefix-cache hit rate over its life, preemptions over its life, prompt
        tokens looked up in its prefix cache and those served from it over its life); an unloaded
        model runs nothing and holds no KV."""
        out = []
        for name in self._past:
            e = self.engines.get(name)
            pre, hits, queries = self._lifetime(name)
            out.append((name, e.scheduler.num_running if e else 0, e.scheduler.num_waiting if e else 0,
                        float(e.block_manager.usage) if e else 0.0, hits / queries if queries else 0.0, pre,
                        queries, hits))
        return out

    @property
    def ops(self):
        """The backend of every model (AsyncEngine sets its thread count)."""
        return next(iter(self.engines.values())).ops

    @property
    def num_threads(self) -> int:
        return next(iter(self.engines.values())).num_threads

    def step(self) -> list:
        outs = []
        for name, eng in list(self.engines.items()):
            if eng.has_unfinished_requests():
                if eng.has_work():  # NOTE: else step() only hands over what an abort left
                    self._activate(name)
                for o in eng.step():
                    if o.finished:
                        self.owner.pop(o.request_id, None)
                    outs.append(o)
        return outs

    def call(self, name: str, fn, since: float | None = None):
        """fn(engine of `name`) on the engine thread, loading it if needed (`since`: see get)."""
        eng = self.get(name, since)
        self._activate(name)
        return fn(eng)

    def close(self) -> None:
        for name in list(self.engines):
            self._unload(name)
        self._send(EXIT, None)

    # ------------------------------------------------------------------ workers
    def worker_main(self) -> None:
        """Worker ranks: build, drop and run models as rank 0 says, until EXIT."""
        from ..engine import Engine
        comm, engines = self._control_comm, {}
        names = list(self.specs)
        while True:
            plan = comm.broadcast_plan(None)
            name = names[plan.step_id] if plan.step_id >= 0 else None
            if plan.kind == LOAD:
                try:
                    engines[name] = Engine(self.specs[name].model_dir, **self._engine_kwargs)
                    engines[name]._keeps_workers = True
                    label_trace(engines[name].recorder, name)  # NOTE: rank 0 writes the trace
                except Exception:  # noqa: BLE001 - rank 0 failed alike and reports it; serve on
                    pass
            elif plan.kind == ENTER:
                engines[name].runner.worker_loop()
            elif plan.kind == UNLOAD:
                eng = engines.pop(name)
                atexit.unregister(eng._close_at_exit)  # NOTE: it would wait for plans that never come
                eng.close_comms()  # NOTE: collective (frees the shared-memory windows): every rank does it here
                eng._close_disk()  # NOTE: its KV folder's lock, for the model's next load
                del eng
                release_memory()
            elif plan.kind == EXIT:
                return


def _control(kind: int, index: int) -> StepPlan:
    plan = StepPlan.empty()
    plan.kind, plan.step_id = kind, index
    return plan


def _stamp(path: str) -> tuple:
    """What changes when a model's files do: the names, sizes and modification times of a
    directory's entries (or of a .gguf file)."""
    path = os.path.expanduser(path)
    try:
        if not os.path.isdir(path):
            st = os.stat(path)
            return ((path, st.st_size, st.st_mtime_ns),)
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path)))
    except OSError:
        return ()


def release_memory() -> None:
    """Free an unloaded model's memory and give it back to the OS.

    NOTE: glibc keeps freed heap pages (a 0.5B model left ~380 MiB of RSS after its unload);
    malloc_trim returns them, so the next model and other processes can use them."""
    gc.collect()
    torch = sys.modules.get("torch")  # NOTE: the CUDA backend's freed tensors stay in torch's cache
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim_heap()
