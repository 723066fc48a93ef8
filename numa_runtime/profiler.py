"""Operator profiler (AS_PROFILE=ON). Without it, ops are returned untouched: zero cost.

With AS_PROFILE=ON every rank times, with time.perf_counter_ns, three sections:

    reshape  per-step preparation: `Schedule` (rank 0: scheduling + StepPlan building) and
             `PreProcessId` (the plan broadcast; on a worker this includes waiting for rank 0)
    alloc    the paged KV block manager (rank 0): `Allocate`, `Free`, `GetComputedBlocks`
    forward  the ops: `Gemm` (every Linear.forward, lm_head included), `Attention`,
             `Embedding`, `RMSNorm`, `Rotary`, `Binary` (add_, silu_and_mul),
             `ReshapeAndCache`, `AllReduce`, `AllGather`, and on rank 0 `Sample` (penalties
             and sampling) and `PostProcessId` (updating requests, detokenization, stops)

Times are exclusive: a timed call nested in another (Allocate inside Schedule, Sample inside
PostProcessId) is subtracted from its parent, so every nanosecond is counted once.

How it is wired: `wrap_ops` returns a proxy whose functions time the backend's, `wrap_comm`
a communicator timing the collectives (the model and the runner use it), and `attach` wraps
the rank 0 scheduler, block manager, sampler and update. Rank 0 reads the other ranks' tables
with a StepPlan of kind PROFILE, which workers answer in ModelRunner.worker_loop
(`serve_worker`) with comm.gather_object. Call the report functions between steps, from the
thread that steps the engine.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import deque

from . import env
from .plan import EXECUTE, StepPlan

RESHAPE, ALLOC, FORWARD = "reshape", "alloc", "forward"
SECTIONS = (RESHAPE, ALLOC, FORWARD)
COLUMNS = ("rank", "opname", "count", "min_ms", "max_ms", "ave_ms", "total_ms", "percentage")

# NOTE: a StepPlan kind next to plan.EXECUTE (1) and plan.SHUTDOWN (2); step_id holds the action.
PROFILE = 3
_GATHER, _RESET, _TRACE = 1, 2, 3

# backend function -> op name (functions not listed, e.g. sample, pass through untimed)
_FORWARD_OPS = {"embedding": "Embedding", "rms_norm": "RMSNorm", "add_rms_norm": "RMSNorm",
                "rotary": "Rotary", "add_": "Binary", "silu_and_mul": "Binary",
                "reshape_and_cache": "ReshapeAndCache", "paged_attention": "Attention"}
_ALLOC_OPS = {"allocate": "Allocate", "free": "Free", "get_computed_blocks": "GetComputedBlocks"}


class Profiler:
    """One rank's timings: per (section, opname) count / total / min / max of exclusive
    nanoseconds, and the calls of the last `trace_steps` steps for a timeline."""

    def __init__(self, rank: int, trace_steps: int = 32):
        self.rank = rank
        self._stack: list[int] = []   # child nanoseconds of each open timed call
        self._steps: deque[list] = deque(maxlen=trace_steps)
        self._events: list | None = None  # calls of the current step: (key, start_ns, dur_ns)
        self.num_steps = 0
        self.reset()

    def reset(self) -> None:
        """Start a new window: forget every timing and trace."""
        self._records: dict[tuple[str, str], list[int]] = {}  # key -> [count, total, min, max]
        self._steps.clear()
        self._events = None
        self.num_steps = 0
        self.window_start_ns = time.perf_counter_ns()

    def begin_step(self) -> None:
        self._events = []
        self._steps.append(self._events)
        self.num_steps += 1

    def timed(self, section: str, name: str, fn):
        """fn, timed under (section, name)."""
        key, stack, clock, record = (section, name), self._stack, time.perf_counter_ns, self._record

        def timed_call(*args, **kwargs):
            stack.append(0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                record(key, t0, dt, dt - stack.pop())
        timed_call.__wrapped__ = fn
        return timed_call

    def _record(self, key: tuple[str, str], t0: int, dt: int, self_ns: int) -> None:
        if self._stack:
            self._stack[-1] += dt
        r = self._records.get(key)
        if r is None:
            self._records[key] = [1, self_ns, self_ns, self_ns]
        else:
            r[0] += 1
            r[1] += self_ns
            if self_ns < r[2]:
                r[2] = self_ns
            if self_ns > r[3]:
                r[3] = self_ns
        if self._events is not None:
            self._events.append((key, t0, dt))

    def snapshot(self) -> list[tuple]:
        """Plain data for gather_object: [(section, opname, count, total_ns, min_ns, max_ns)]."""
        return [(s, n, c, tot, lo, hi) for (s, n), (c, tot, lo, hi) in self._records.items()]

    def trace(self) -> list[list[tuple]]:
        """Kept steps, oldest first; each a list of (section, opname, start_ns, dur_ns)."""
        return [[(k[0], k[1], t0, dt) for k, t0, dt in step] for step in self._steps]


# ----------------------------------------------------------------------------- wrappers
class ProfiledOps:
    """The backend module's ops, timed; `Linear` builds linears whose forward is timed."""

    def __init__(self, ops, profiler: Profiler):
        self._ops, self.profiler = ops, profiler
        for fn_name, op in _FORWARD_OPS.items():
            if hasattr(ops, fn_name):
                setattr(self, fn_name, profiler.timed(FORWARD, op, getattr(ops, fn_name)))

    def Linear(self, *args, **kwargs):  # noqa: N802 - the backend's name
        return _TimedLinear(self._ops.Linear(*args, **kwargs), self.profiler)

    def __getattr__(self, name):
        return getattr(self._ops, name)


class _TimedLinear:
    def __init__(self, linear, profiler: Profiler):
        self._linear = linear
        self.forward = profiler.timed(FORWARD, "Gemm", linear.forward)

    def __getattr__(self, name):
        return getattr(self._linear, name)


class ProfiledComm:
    """A communicator whose all_reduce_ / all_gather / plan broadcast are timed."""

    def __init__(self, comm, profiler: Profiler):
        self._comm, self.profiler = comm, profiler
        self.all_reduce_ = profiler.timed(FORWARD, "AllReduce", comm.all_reduce_)
        self.all_gather = profiler.timed(FORWARD, "AllGather", comm.all_gather)

    def broadcast_plan(self, plan):
        prof = self.profiler
        t0 = time.perf_counter_ns()
        plan = self._comm.broadcast_plan(plan)
        dt = time.perf_counter_ns() - t0
        if plan.kind == EXECUTE:  # profiler and shutdown messages are not steps
            if not self._comm.is_driver:
                prof.begin_step()  # rank 0 begins its steps in Schedule
            prof._record((RESHAPE, "PreProcessId"), t0, dt, dt)
        return plan

    def __getattr__(self, name):
        return getattr(self._comm, name)


class _TimedSampler:
    def __init__(self, sampler, profiler: Profiler):
        self._sampler = sampler
        self._call = profiler.timed(FORWARD, "Sample", sampler.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sampler, name)


def wrap_ops(ops, comm):
    """Return the ops module to use: `ops` itself unless profiling is on (AS_PROFILE=ON, or
    AS_PROFILE_TRACE set), else a ProfiledOps whose `.profiler` holds this rank's timings."""
    if not (env.profile_enabled() or env.profile_trace_path()):
        return ops
    return ProfiledOps(ops, Profiler(comm.rank, env.profile_trace_steps()))


def wrap_comm(comm, ops):
    """The communicator the model runner should use: `comm`, timed when `ops` is profiled."""
    prof = getattr(ops, "profiler", None)
    return comm if prof is None else ProfiledComm(comm, prof)


def attach(engine) -> Profiler | None:
    """Rank 0: time the engine's scheduling, block manager, sampler and update. Returns the
    profiler (None when profiling is off: nothing is wrapped)."""
    prof = getattr(engine.ops, "profiler", None)
    if prof is None:
        return None
    bm, sched = engine.block_manager, engine.scheduler
    for fn_name, op in _ALLOC_OPS.items():
        setattr(bm, fn_name, prof.timed(ALLOC, op, getattr(bm, fn_name)))
    schedule = prof.timed(RESHAPE, "Schedule", sched.schedule)

    def begin_and_schedule():
        prof.begin_step()
        return schedule()
    sched.schedule = begin_and_schedule
    engine.sampler = _TimedSampler(engine.sampler, prof)
    update = prof.timed(FORWARD, "PostProcessId", engine._update)
    path = env.profile_trace_path()
    if path:
        written = []

        def update_and_trace(*args):
            outs = update(*args)
            if not written and prof.num_steps >= prof._steps.maxlen:
                written.append(export_chrome_trace(engine, path))
            return outs
        engine._update = update_and_trace
    else:
        engine._update = update
    return prof


# ----------------------------------------------------------------------------- collectives
def _profile_plan(action: int) -> StepPlan:
    return dataclasses.replace(StepPlan.shutdown(), kind=PROFILE, step_id=action)


def _collect(engine, action: int) -> list | None:
    """Rank 0: run `action` on every rank; for _GATHER / _TRACE, every rank's data by rank."""
    prof = engine.profiler
    if prof is None:
        raise RuntimeError("Operator profiling is off: set AS_PROFILE=ON in the environment "
                           "before the Engine starts.")
    comm = engine.runner.comm
    if comm.world_size > 1:
        comm.broadcast_plan(_profile_plan(action))
    if action == _RESET:
        prof.reset()
        return None
    return comm.gather_object(prof.snapshot() if action == _GATHER else prof.trace())


def serve_worker(plan: StepPlan, comm, ops) -> None:
    """A worker's half of a PROFILE plan (called from ModelRunner.worker_loop)."""
    prof = getattr(ops, "profiler", None)
    if plan.step_id == _RESET:
        if prof is not None:
            prof.reset()
    elif plan.step_id == _GATHER:
        comm.gather_object(prof.snapshot() if prof is not None else [])
    elif plan.step_id == _TRACE:
        comm.gather_object(prof.trace() if prof is not None else [])


# ----------------------------------------------------------------------------- Engine methods
def get_op_profiling_stats(engine) -> list[dict]:
    """Every rank's table as rows {rank, section, opname, count, min_ms, max_ms, ave_ms,
    total_ms, percentage}: by rank, then section (reshape, alloc, forward), then total time
    descending; percentage is of the section's total on that rank."""
    rows = []
    for rank, snap in enumerate(_collect(engine, _GATHER)):
        for section in SECTIONS:
            recs = sorted((r for r in snap if r[0] == section), key=lambda r: (-r[3], r[1]))
            section_ns = sum(r[3] for r in recs) or 1
            for _, name, count, total, lo, hi in recs:
                rows.append({"rank": rank, "section": section, "opname": name, "count": count,
                             "min_ms": lo / 1e6, "max_ms": hi / 1e6, "ave_ms": total / count / 1e6,
                             "total_ms": total / 1e6, "percentage": 100.0 * total / section_ns})
    return rows


def get_op_profiling_info(engine, model_name: str | None = None) -> str:
    """The report: sections `*** reshape ***`, `*** alloc ***`, `*** forward ***`, each a
    table of every rank's ops sorted by total time."""
    rows = get_op_profiling_stats(engine)
    name = model_name or os.path.basename(os.path.normpath(engine.model_config.model_dir))
    window = (time.perf_counter_ns() - engine.profiler.window_start_ns) / 1e9
    lines = [f"operator profile: model {name}, {engine.comm.world_size} rank(s), "
             f"{engine.profiler.num_steps} steps in {window:.3f} s (exclusive times)"]
    head = f"{'rank':>4} {'opname':<18} {'count':>8} {'min_ms':>10} {'max_ms':>10} " \
           f"{'ave_ms':>10} {'total_ms':>12} {'percentage':>10}"
    for section in SECTIONS:
        lines += ["", f"*** {section} ***", head]
        for r in rows:
            if r["section"] == section:
                lines.append(f"{r['rank']:>4} {r['opname']:<18} {r['count']:>8} {r['min_ms']:>10.4f} "
                             f"{r['max_ms']:>10.4f} {r['ave_ms']:>10.4f} {r['total_ms']:>12.3f} "
                             f"{r['percentage']:>10.2f}")
    return "\n".join(lines) + "\n"


def reset_op_profiling(engine) -> None:
    """Start a new profiling window on every rank."""
    _collect(engine, _RESET)


def export_chrome_trace(engine, path: str, steps: int | None = None) -> str:
    """Write the last `steps` steps (at most AS_PROFILE_TRACE_STEPS, default 32, are kept) of
    every rank as Chrome trace JSON (chrome://tracing, ui.perfetto.dev): one process per rank.
    Returns path. Timestamps share the host's monotonic clock (ranks on one host line up)."""
    per_rank = _collect(engine, _TRACE)
    if steps is not None:
        per_rank = [rank_steps[-steps:] if steps > 0 else [] for rank_steps in per_rank]
    calls = [(rank, *c) for rank, rank_steps in enumerate(per_rank) for step in rank_steps for c in step]
    origin = min((c[3] for c in calls), default=0)
    events = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
              for rank in range(len(per_rank))]
    events += [{"name": name, "cat": section, "ph": "X", "pid": rank, "tid": 0,
                "ts": (t0 - origin) / 1e3, "dur": dt / 1e3} for rank, section, name, t0, dt in calls]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path
