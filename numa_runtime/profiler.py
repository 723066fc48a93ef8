"""Operator profiler (AS_PROFILE=ON): the recorder that times, and the reports.

Components call the hooks of recorder.py; by default they go to NULL_RECORDER and cost
nothing. With AS_PROFILE=ON (or AS_PROFILE_TRACE set) `make_recorder` returns a Profiler,
and every rank times, with time.perf_counter_ns, three sections:

    reshape  per-step preparation: `schedule` (rank 0: Scheduler.schedule, the StepPlan
             included) and `broadcast_plan` (on a worker this includes waiting for rank 0)
    alloc    rank 0's BlockManager: `allocate`, `free`, `get_computed_blocks`
    forward  the backend ops under their own names (`Linear` for every Linear.forward,
             lm_head included; `embedding`, `rms_norm`, `add_rms_norm`, `rotary`, `add_`,
             `silu_and_mul`, `reshape_and_cache`, `paged_attention`), the collectives
             `all_reduce_` and `all_gather`, and on rank 0 `sample` (the Sampler: penalties
             and sampling) and `update` (Engine._update: requests, detokenization, stops)

Times are exclusive: a timed call nested in another (allocate inside schedule, sample inside
update) is subtracted from its parent, so every nanosecond is counted once.

The ops and the communicator have no hooks of their own: with profiling on, the Engine hands
the model `timed_ops(ops, profiler)` and `timed_comm(comm, profiler)` instead of the backend
module and the communicator themselves. Rank 0 reads the other ranks' tables with a StepPlan
of kind PROFILE, which workers answer in ModelRunner.worker_loop through `Profiler.answer`.
Call the report functions between steps, from the thread that steps the engine.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import deque

from . import env
from .plan import EMBED, EXECUTE, PROFILE_GATHER, PROFILE_RESET, PROFILE_TRACE, StepPlan
from .recorder import FORWARD, NULL_RECORDER, RESHAPE, SECTIONS

COLUMNS = ("rank", "opname", "count", "min_ms", "max_ms", "ave_ms", "total_ms", "percentage")

# backend functions timed under their own names (the others, e.g. sample, pass through)
_FORWARD_OPS = ("embedding", "rms_norm", "add_rms_norm", "rotary", "add_", "silu_and_mul",
                "reshape_and_cache", "paged_attention")


class Profiler:
    """One rank's timings: per (section, opname) count / total / min / max of exclusive
    nanoseconds, and the calls of the last `trace_steps` steps for a timeline. Implements
    the hooks of recorder.NullRecorder."""

    enabled = True

    def __init__(self, rank: int, trace_steps: int = 32, trace_path: str | None = None):
        self.rank = rank
        self.trace_path = trace_path  # AS_PROFILE_TRACE: written once trace_steps were kept
        self.trace_label = ""  # the model's name in the trace's process names (a server of several models)
        self._trace_written = False
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

    # ---- the hooks ------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._events = []
        self._steps.append(self._events)
        self.num_steps += 1

    def span(self, section: str, name: str) -> "_Span":
        return _Span(self, (section, name))

    def trace_due(self, closing: bool = False) -> bool:
        """True once, when AS_PROFILE_TRACE is set and its number of steps has been kept, or
        (`closing`: the engine closes sooner) at least one: the trace then holds the steps that ran."""
        ready = bool(self._steps) if closing else self.num_steps >= self._steps.maxlen
        if self.trace_path is None or self._trace_written or not ready:
            return False
        self._trace_written = True
        return True

    def answer(self, action: int):
        if action == PROFILE_RESET:
            self.reset()
            return None
        return self.snapshot() if action == PROFILE_GATHER else self.trace()

    # ---- timing -----------------------------------------------------------------------------
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


class _Span:
    """`with profiler.span(section, name):` times its block like Profiler.timed."""
    __slots__ = ("_prof", "_key", "_t0")

    def __init__(self, prof: Profiler, key: tuple[str, str]):
        self._prof, self._key = prof, key

    def __enter__(self):
        self._prof._stack.append(0)
        self._t0 = time.perf_counter_ns()

    def __exit__(self, *exc):
        dt = time.perf_counter_ns() - self._t0
        self._prof._record(self._key, self._t0, dt, dt - self._prof._stack.pop())


def profiling_enabled() -> bool:
    """AS_PROFILE=ON, or AS_PROFILE_TRACE set (env.profile_enabled)."""
    return env.profile_enabled()


def label_trace(recorder, model: str, load: int = 1) -> None:
    """One of several models served: its AS_PROFILE_TRACE file is the path with the model's name
    before the extension (trace.json -> trace.NAME.json; its `load`-th load from the second on:
    trace.NAME.LOAD.json), and its ranks are named after it."""
    if recorder.trace_path is None:
        return
    root, ext = os.path.splitext(recorder.trace_path)
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in model)
    again = f".{load}" if load > 1 else ""
    recorder.trace_path = f"{root}.{safe}{again}{ext}"
    recorder.trace_label = f" ({model}{f', load {load}' if load > 1 else ''})"


def make_recorder(rank: int):
    """NULL_RECORDER unless profiling is on (profiling_enabled)."""
    path = env.profile_trace_path()
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"AS_PROFILE_TRACE={path!r} names a file in a folder that does not exist or is not "
                             "writable; point it at a writable folder.")
        if os.path.isdir(path):  # NOTE: it was found out at the end, after the whole run was profiled
            raise ValueError(f"AS_PROFILE_TRACE={path!r} is a directory; name the trace file to write, e.g. "
                             f"{os.path.join(path, 'trace.json')!r}.")
    steps = env.profile_trace_steps()  # NOTE: a bad value is an error whether profiling is on or not
    if not profiling_enabled():
        if os.environ.get("AS_PROFILE_TRACE_STEPS", "").strip() and rank == 0:
            logging.getLogger("numa_runtime").warning(
                "AS_PROFILE_TRACE_STEPS applies to operator profiling, which is off; set AS_PROFILE=ON or "
                "AS_PROFILE_TRACE too, or unset it.")
        return NULL_RECORDER
    return Profiler(rank, steps, path)


# ----------------------------------------------------------------------------- timed ops / comm
def timed_ops(ops, recorder):
    """The ops the model should call: the backend module itself unless `recorder` profiles."""
    return TimedOps(ops, recorder) if recorder.enabled else ops


def timed_comm(comm, recorder):
    """The communicator the model runner should use: `comm` itself unless `recorder` profiles."""
    return TimedComm(comm, recorder) if recorder.enabled else comm


class TimedOps:
    """The backend module's ops, timed; `Linear` builds linears whose forward is timed."""

    def __init__(self, ops, profiler: Profiler):
        self._ops, self.profiler = ops, profiler
        for fn_name in _FORWARD_OPS:
            if hasattr(ops, fn_name):
                setattr(self, fn_name, profiler.timed(FORWARD, fn_name, getattr(ops, fn_name)))

    def Linear(self, *args, **kwargs):  # noqa: N802 - the backend's name
        return _TimedLinear(self._ops.Linear(*args, **kwargs), self.profiler)

    def QLinear(self, *args, **kwargs):  # noqa: N802 - the backend's name (quantized weights)
        return _TimedLinear(self._ops.QLinear(*args, **kwargs), self.profiler)

    def __getattr__(self, name):
        return getattr(self._ops, name)


class _TimedLinear:
    """A linear whose forward is timed; every other attribute is the linear's own, written
    ones included (the loader's path flags such as act8 must reach the kernel object)."""
    _OWN = ("_linear", "forward", "forward_silu")

    def __init__(self, linear, profiler: Profiler):
        object.__setattr__(self, "_linear", linear)
        object.__setattr__(self, "forward", profiler.timed(FORWARD, "Linear", linear.forward))
        if hasattr(linear, "forward_silu"):  # QLinear: silu_and_mul fused into the down projection
            object.__setattr__(self, "forward_silu",
                               profiler.timed(FORWARD, "Linear", linear.forward_silu))

    def __getattr__(self, name):
        return getattr(self._linear, name)

    def __setattr__(self, name, value):
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._linear, name, value)


class TimedComm:
    """A communicator whose all_reduce_ / all_gather / plan broadcast are timed."""

    def __init__(self, comm, profiler: Profiler):
        self._comm, self.profiler = comm, profiler
        self.all_reduce_ = profiler.timed(FORWARD, "all_reduce_", comm.all_reduce_)
        self.all_gather = profiler.timed(FORWARD, "all_gather", comm.all_gather)

    def broadcast_plan(self, plan):
        prof = self.profiler
        t0 = time.perf_counter_ns()
        plan = self._comm.broadcast_plan(plan)
        dt = time.perf_counter_ns() - t0
        if plan.kind in (EXECUTE, EMBED):  # profiler and shutdown messages are not steps
            if not self._comm.is_driver:
                prof.begin_step()  # rank 0 begins its steps in Engine._step and _prefill_chunks
            prof._record((RESHAPE, "broadcast_plan"), t0, dt, dt)
        return plan

    def __getattr__(self, name):
        return getattr(self._comm, name)


# ----------------------------------------------------------------------------- reports (rank 0)
class ProfileReports:
    """Rank 0's view of every rank's profile: the Engine's get_op_profiling_* methods."""

    def __init__(self, recorder, comm, model_name: str):
        self.recorder, self.comm, self.model_name = recorder, comm, model_name

    def _collect(self, action: int) -> list | None:
        """Run `action` on every rank; for GATHER / TRACE, every rank's data by rank."""
        if not self.recorder.enabled:
            raise RuntimeError("Operator profiling is off: set AS_PROFILE=ON in the environment "
                               "before the Engine starts.")
        if self.comm.world_size > 1:
            self.comm.broadcast_plan(StepPlan.profile(action))
        data = self.recorder.answer(action)
        return None if action == PROFILE_RESET else self.comm.gather_object(data)

    def stats(self) -> list[dict]:
        """Every rank's table as rows {rank, section, opname, count, min_ms, max_ms, ave_ms,
        total_ms, percentage}: by rank, then section (reshape, alloc, forward), then total
        time descending; percentage is of the section's total on that rank."""
        rows = []
        for rank, snap in enumerate(self._collect(PROFILE_GATHER)):
            for section in SECTIONS:
                recs = sorted((r for r in snap if r[0] == section), key=lambda r: (-r[3], r[1]))
                section_ns = sum(r[3] for r in recs) or 1
                for _, name, count, total, lo, hi in recs:
                    rows.append({"rank": rank, "section": section, "opname": name, "count": count,
                                 "min_ms": lo / 1e6, "max_ms": hi / 1e6, "ave_ms": total / count / 1e6,
                                 "total_ms": total / 1e6, "percentage": 100.0 * total / section_ns})
        return rows

    def report(self, model_name: str | None = None) -> str:
        """Sections `*** reshape ***`, `*** alloc ***`, `*** forward ***`, each a table of
        every rank's ops sorted by total time."""
        rows = self.stats()
        prof = self.recorder
        window = (time.perf_counter_ns() - prof.window_start_ns) / 1e9
        lines = [f"operator profile: model {model_name or self.model_name}, {self.comm.world_size} "
                 f"rank(s), {prof.num_steps} steps in {window:.3f} s (exclusive times)"]
        head = f"{'rank':>4} {'opname':<19} {'count':>8} {'min_ms':>10} {'max_ms':>10} " \
               f"{'ave_ms':>10} {'total_ms':>12} {'percentage':>10}"
        for section in SECTIONS:
            lines += ["", f"*** {section} ***", head]
            for r in rows:
                if r["section"] == section:
                    lines.append(f"{r['rank']:>4} {r['opname']:<19} {r['count']:>8} "
                                 f"{r['min_ms']:>10.4f} {r['max_ms']:>10.4f} {r['ave_ms']:>10.4f} "
                                 f"{r['total_ms']:>12.3f} {r['percentage']:>10.2f}")
        return "\n".join(lines) + "\n"

    def reset(self) -> None:
        """Start a new profiling window on every rank."""
        self._collect(PROFILE_RESET)

    def chrome_trace(self, path: str, steps: int | None = None) -> str:
        """Write the last `steps` steps (at most AS_PROFILE_TRACE_STEPS, default 32, are kept)
        of every rank as Chrome trace JSON (chrome://tracing, ui.perfetto.dev): one process
        per rank. Returns path. Timestamps share the host's monotonic clock."""
        per_rank = self._collect(PROFILE_TRACE)
        if steps is not None:
            per_rank = [rank_steps[-steps:] if steps > 0 else [] for rank_steps in per_rank]
        calls = [(rank, *c) for rank, rank_steps in enumerate(per_rank) for step in rank_steps for c in step]
        origin = min((c[3] for c in calls), default=0)
        events = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                   "args": {"name": f"rank {rank}{self.recorder.trace_label}"}} for rank in range(len(per_rank))]
        events += [{"name": name, "cat": section, "ph": "X", "pid": rank, "tid": 0,
                    "ts": (t0 - origin) / 1e3, "dur": dt / 1e3} for rank, section, name, t0, dt in calls]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return path
