"""Backends: modules exporting the op set specified by backend/reference.py.

    ops = get_backend("cpu")        # Cython + oneDNN kernels
    ops = get_backend("reference")  # the numpy specification (slow; for tests)
"""
from __future__ import annotations

from types import ModuleType

BACKENDS = ("cpu", "reference")


def get_backend(name: str = "cpu") -> ModuleType:
    """The module implementing every op for backend `name` ("cpu" or "reference")."""
    if name == "cpu":
        from . import cpu
        return cpu
    if name == "reference":
        from . import reference
        if not hasattr(reference, "set_num_threads"):
            # NOTE: numpy ops have no thread knob; the engine calls this on every backend.
            reference.set_num_threads = lambda n: None
        return reference
    raise ValueError("unknown backend %r: choose one of %s (a CUDA backend is not available "
                     "yet)" % (name, ", ".join(BACKENDS)))
