"""Model registry: architecture name -> model class."""
from ..config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from .llama import LlamaModel

_REGISTRY = {arch: LlamaModel for arch in SUPPORTED_ARCHITECTURES}


def get_model_class(cfg: ModelConfig):
    try:
        return _REGISTRY[cfg.architecture]
    except KeyError:
        raise UnsupportedModelError(f"Unsupported architecture {cfg.architecture!r}.") from None
