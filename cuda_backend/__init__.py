"""The CUDA backend: the engine's model shard on a GPU (optional; imported only for device="cuda").

`Engine(..., device="cuda")` keeps the CPU engine's scheduler, block manager, prefix cache,
sampler and API, and swaps the model runner for `CudaModelRunner` (runner.py), which holds
the weights as torch tensors, a paged KV cache in GPU memory indexed by the block manager's
block ids, and runs Triton kernels (kernels.py) plus torch matmuls for the linears.

    kernels.py    RMSNorm (+ residual), SiLU-and-mul, q/k norm + rotary + KV write, paged attention
    model.py      the Llama-family decoder over those kernels (the CPU model's shard layout)
    batch.py      a StepPlan's arrays on the device in one copy
    graphs.py     CUDA graphs of decode steps per batch-size bucket
    host_pool.py  pinned host memory behind the KV cache (the host tier's copies)
    tp.py         tensor parallel over NCCL, one rank per GPU
    runner.py     CudaModelRunner: ModelRunner's contract on a GPU
"""
from __future__ import annotations


class CudaUnavailableError(ValueError):
    """device="cuda" was asked for on a machine that cannot run it."""


def check_available() -> None:
    """Raise CudaUnavailableError (one sentence saying what to do) unless torch, Triton and a
    GPU are here (or Triton's interpreter was asked for with TRITON_INTERPRET=1)."""
    from numa_runtime import env
    try:
        import torch
    except ImportError:
        raise CudaUnavailableError("device='cuda' needs torch, which is not installed: install the CUDA "
                                   "extra with `pip install numa_runtime[cuda]`, or use device='cpu'.") from None
    if not env.triton_interpret() and not torch.cuda.is_available():
        raise CudaUnavailableError("device='cuda' was asked for, but torch finds no CUDA GPU on this "
                                   "machine; use device='cpu'.")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise CudaUnavailableError("device='cuda' needs Triton, which is not installed: install a CUDA build "
                                   "of torch (it brings Triton), or use device='cpu'.") from None


def make_runner(model_cfg, engine_cfg, comm, max_model_len: int, progress=None, gpu_index: int = 0,
                recorder=None):
    """A CudaModelRunner for this rank (on GPU `gpu_index` of its host: its local rank), after
    checking that the machine can run one."""
    check_available()
    from .runner import CudaModelRunner
    return CudaModelRunner(model_cfg, engine_cfg, comm, max_model_len, progress, gpu_index, recorder)
