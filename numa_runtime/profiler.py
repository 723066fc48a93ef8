"""Operator profiler (AS_PROFILE=ON). Without it, ops are returned untouched: zero cost."""
from __future__ import annotations


def wrap_ops(ops, comm):
    """Return the ops module to use: `ops` itself unless profiling is on."""
    return ops
