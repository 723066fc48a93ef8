"""The torch device the CUDA backend's tests run on, or a loud skip (tests only).

"cuda" when torch sees a GPU and Triton is installed; "cpu" when TRITON_INTERPRET=1 (Triton's
interpreter runs the kernels on CPU tensors: slow, for checking kernels without a GPU);
otherwise every CUDA test skips and says why, so CPU-only CI stays green.
"""
from __future__ import annotations

import pytest

from numa_runtime import env


def _reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install .[cuda])"
    if not env.triton_interpret() and not torch.cuda.is_available():
        return "no CUDA GPU on this machine (with Triton installed, TRITON_INTERPRET=1 runs them on CPU)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (it comes with CUDA builds of torch)"
    return None


SKIP_REASON = _reason()
requires_cuda = pytest.mark.skipif(SKIP_REASON is not None,
                                   reason=f"CUDA backend tests SKIPPED: {SKIP_REASON}")


def device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() and not env.triton_interpret() else "cpu"


def on_gpu() -> bool:
    return SKIP_REASON is None and device() == "cuda"
