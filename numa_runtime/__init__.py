"""numa_runtime: CPU-first LLM inference, one MPI rank per NUMA node.

    from numa_runtime import Engine, SamplingParams
"""
from .engine import Engine
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = ["Engine", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
