"""The CPU backend: reference.py's ops over the Cython kernels in numa_runtime._kernels.

Same names, signatures and semantics as numa_runtime.backend.reference (the specification).
What the kernels add to the reference's contract:
- inputs may be strided views where it helps the model: every array must be contiguous in
  its last axis, but rows (and heads of q/k/v/out in rotary, reshape_and_cache and
  paged_attention) may have any stride, so q/k/v slices of a fused qkv buffer need no copy;
- KV caches must be C-contiguous; rms_norm weights must be f32 (convert bf16 once at load);
- every kernel runs on the OpenMP threads set by `set_num_threads`.
"""
from __future__ import annotations

_BUILD_HINT = ("the Cython kernels are not built: run `python setup.py build_ext --inplace` "
               "in the numa_runtime checkout (or `pip install -e .`)")

try:
    from numa_runtime._kernels.attention import paged_attention, reshape_and_cache
    from numa_runtime._kernels.ops import (add_, add_rms_norm, bf16_to_f32, embedding,
                                           f32_to_bf16, get_num_threads, rms_norm, rotary,
                                           set_num_threads, silu_and_mul)
    from numa_runtime._kernels.sampling import log_softmax, sample
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError("numa_runtime.backend.cpu: %s (%s)" % (_BUILD_HINT, e)) from e

try:
    from numa_runtime._kernels.reduce import reduce_sum
except ImportError:  # the shm-collective kernels are optional for one process
    from numa_runtime.backend.reference import reduce_sum

__all__ = ["Linear", "QLinear", "embedding", "rms_norm", "add_rms_norm", "silu_and_mul", "add_", "rotary",
           "reshape_and_cache", "paged_attention", "sample", "log_softmax", "reduce_sum",
           "f32_to_bf16", "bf16_to_f32", "set_num_threads", "get_num_threads", "set_decode_step",
           "fused_decoder", "moe_experts", "prefill_int8_wins", "prefill_path", "kernel_summary"]


def set_decode_step(mode: int) -> int:
    """Before a step, on the thread that runs it: 1 when every row is a decode row, so a decode
    batch of quantized linears takes int8 activations; 2 when every row is a prompt row, and
    they keep exact activations; 0 for a mixed step and after the step (qgemm.set_decode_step)."""
    from numa_runtime._kernels import qgemm
    return qgemm.set_decode_step(int(mode))


def prefill_path() -> str:
    """What quantized linears' prefill rows run on here (prefill_activations="bf16"), for the
    start-up log: AMX-BF16 tiles, oneDNN's bf16 panels (AVX-512 BF16), or the exact f32 kernels."""
    from numa_runtime._kernels import qgemm
    if qgemm.has_amx_bf16() and qgemm._panel_usable():
        return "bf16 weights on AMX-BF16 tiles"
    if qgemm._panel_usable():
        return "bf16 weights on oneDNN panels"
    return "the f32 kernels (this CPU has no AVX-512 BF16 for bf16 panels)"


def kernel_summary() -> str:
    """The kernel paths this CPU runs, for the start-up log."""
    from numa_runtime._kernels import attention, gemm, qgemm
    names = {2: "AVX-512 BF16", 1: "AVX-512", 0: "AVX2"}
    qnames = {2: "AVX-512 VNNI", 1: "AVX-512", 0: "AVX2"}
    amx = [n for n, on in (("AMX-INT8", qgemm.has_amx()), ("AMX-BF16", qgemm.has_amx_bf16())) if on]
    return (f"kernels: bf16/f32 GEMV {names[gemm.cpu_level()]}, int8/int4 {qnames[qgemm.cpu_level()]}, "
            f"attention {names[attention._force_paths()[0]]}; " + (" and ".join(amx) if amx else "no AMX"))


def prefill_int8_wins() -> bool:
    """Whether prefill_activations="int8" runs faster than "bf16" on this CPU (qgemm.prefill_int8_wins)."""
    from numa_runtime._kernels import qgemm
    return qgemm.prefill_int8_wins()


def _gemm():
    try:
        from numa_runtime._kernels import gemm
    except ImportError as e:
        raise ImportError("numa_runtime.backend.cpu.Linear: the oneDNN GEMM extension "
                          "numa_runtime._kernels.gemm is missing; %s (%s)" % (_BUILD_HINT, e)) from e
    return gemm


def __getattr__(name):
    # NOTE: Linear is imported lazily so the other ops work while gemm is (re)built.
    if name == "Linear":
        return _gemm().Linear
    if name == "QLinear":
        from numa_runtime._kernels.qgemm import QLinear
        return QLinear
    if name == "fused_decoder":
        from numa_runtime._kernels.qgemm import fused_decoder
        return fused_decoder
    if name == "moe_experts":
        from numa_runtime._kernels.qgemm import moe_experts
        return moe_experts
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
