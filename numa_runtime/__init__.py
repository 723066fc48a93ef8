"""numa_runtime: CPU-first LLM inference, one MPI rank per NUMA node.

    from numa_runtime import Engine, SamplingParams

`LLM` is the same class under vLLM's name (`from numa_runtime import LLM, SamplingParams`).
"""
from .engine import Engine
from .inputs import TextPrompt, TokensPrompt
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

LLM = Engine  # vLLM's name for its offline engine: a script ports by its import line

__all__ = ["Engine", "LLM", "TextPrompt", "TokensPrompt", "SamplingParams", "StructuredOutputsParams",
           "GuidedDecodingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
