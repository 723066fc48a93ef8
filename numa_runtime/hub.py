"""Models named by their Hugging Face Hub id, as vLLM takes them: `Engine("Qwen/Qwen2.5-0.5B-Instruct")`,
`serve --model ORG/NAME`, or one GGUF file of a repository, `ORG/NAME/FILE.gguf`.

A name that is no local path but has the shape of a repository id is fetched with huggingface_hub
into its usual cache (HF_HOME, HF_HUB_CACHE; HF_TOKEN for gated models; HF_HUB_OFFLINE=1 reads
the cache only), and only what the runtime reads: configs, safetensors weights, tokenizer files and
chat templates (not .bin/.pth/.gguf/ONNX copies of the same weights).
"""
from __future__ import annotations

import os
import re

__all__ = ["is_repo_id", "local_path", "served_name"]

# NOTE: ORG/NAME (the Hub's characters), optionally /PATH/FILE.gguf inside the repository
_REPO = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<file>[^\s]+\.gguf))?", re.IGNORECASE)
_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.tiktoken", "*.txt"]


def is_repo_id(name) -> bool:
    """Whether `name` is no local path and reads as a Hub repository id (or ORG/NAME/FILE.gguf)."""
    if not isinstance(name, str) or name.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(name)):
        return False
    return _REPO.fullmatch(name) is not None


def served_name(name) -> str | None:
    """The name a model given as `name` is served under when that is a Hub repository id (as
    vLLM serves ORG/NAME); None for a local path or a Hub GGUF file (named by its stem)."""
    return name if is_repo_id(name) and not name.lower().endswith(".gguf") else None


def local_path(name: str, revision: str | None = None, cache_dir: str | None = None,
               token: str | bool | None = None) -> str:
    """`name` itself, or for a Hub id the local directory (or .gguf file) it names, fetched on
    first use (at `revision`, into `cache_dir`: default HF_HUB_CACHE; with `token`, else HF_TOKEN
    or the saved login). FileNotFoundError in one sentence when it cannot be had."""
    if not is_repo_id(name):
        return name
    m = _REPO.fullmatch(name)
    repo, file = m["repo"], m["file"]
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
    except ImportError:
        raise FileNotFoundError(f"{name!r} is no local path, and huggingface_hub (which fetches models from the "
                                "Hugging Face Hub) is not installed; pip install huggingface_hub, or pass a local "
                                "model directory.") from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    cache = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    try:
        if file is not None:
            # NOTE: a file of a split model (gguf-split's NAME-0000i-of-0000N.gguf) comes with its siblings
            # (only the named one came: the load then missed the others)
            from .gguf_model import shard_names
            names = shard_names(file)
            paths = {n: hf_hub_download(repo, n, revision=revision, cache_dir=cache, local_files_only=offline,
                                        token=token)
                     for n in names}
            return paths.get(file) or paths[names[0]]
        path = snapshot_download(repo, allow_patterns=_PATTERNS, revision=revision, cache_dir=cache,
                                 local_files_only=offline, token=token)
    except Exception as e:  # noqa: BLE001 - network, authentication, a missing repository or file: one sentence
        if offline:  # NOTE: huggingface_hub's own advice (local_files_only=False) is no option of ours
            at = "" if revision is None else f" at revision {revision!r}"
            raise FileNotFoundError(f"{name!r} is no local path, and it is not in the Hugging Face Hub cache "
                                    f"({cache or _hub_cache()}){at} while HF_HUB_OFFLINE=1: fetch it first, or unset "
                                    "HF_HUB_OFFLINE.") from None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(f"{name!r} is no local path, and fetching it from the Hugging Face Hub failed "
                                f"({type(e).__name__}: {reason.rstrip('.')}); pass a local model directory or "
                                f".gguf file{'' if offline else ', or set HF_TOKEN for a gated model'}.") from None
    found = [f for _, _, files in os.walk(path) for f in files]
    if not any(f.endswith(".safetensors") for f in found):
        pickled = " (pickled .bin checkpoints are never loaded: convert them to safetensors)" if any(
            f.endswith((".bin", ".pt", ".pth")) for f in found) else ""
        raise FileNotFoundError(f"{repo} on the Hugging Face Hub holds no safetensors weights{pickled}; for a "
                                f"repository of GGUF files name one of them ({repo}/FILE.gguf).")
    return path


def _hub_cache() -> str:
    """The Hub cache folder huggingface_hub reads (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/...)."""
    try:
        from huggingface_hub import constants
        return str(constants.HF_HUB_CACHE)
    except (ImportError, AttributeError):
        return "HF_HOME/hub"
