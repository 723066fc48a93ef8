"""Timing hooks: what a component calls to be profiled, and the recorder that does nothing.

Rank 0's Engine, Sampler and BlockManager, and every rank's ModelRunner, hold a recorder and
call it at their timing points:

    rec.begin_step()                      # a new engine step starts
    with rec.span(RESHAPE, "schedule"):   # time this block under (section, op name)
        ...
    rec.answer(action)                    # a worker's reply to a PROFILE plan (plan.py)

NULL_RECORDER, the default, does nothing. With AS_PROFILE=ON the Engine passes a
profiler.Profiler instead (same methods), which also times the backend ops and collectives.
"""
from __future__ import annotations

from contextlib import nullcontext

from .plan import PROFILE_RESET

RESHAPE, ALLOC, FORWARD = "reshape", "alloc", "forward"  # the report's sections
SECTIONS = (RESHAPE, ALLOC, FORWARD)

_NO_SPAN = nullcontext()


class NullRecorder:
    """Profiling off: every hook returns at once."""

    enabled = False
    trace_path = None

    def begin_step(self) -> None:
        pass

    def span(self, section: str, name: str):
        return _NO_SPAN

    def trace_due(self, closing: bool = False) -> bool:
        return False

    def answer(self, action: int):
        """The data this rank sends for a PROFILE plan (None: it sends nothing)."""
        return None if action == PROFILE_RESET else []


NULL_RECORDER = NullRecorder()
