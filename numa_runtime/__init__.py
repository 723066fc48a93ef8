"""numa_runtime: CPU-first LLM inference, one MPI rank per NUMA node.

    from numa_runtime import Engine, SamplingParams
"""
from .engine import Engine
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
