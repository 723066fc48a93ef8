"""Every environment variable numa_runtime reads, declared in one place.

Read them through these functions (not at import time), so a test or a launcher that sets a
variable after import still takes effect. No other module calls `os.environ` directly.
"""
import os

__all__ = ["cache_dir"]


def cache_dir() -> str:
    """NUMA_RUNTIME_CACHE: where converted models and other derived files live.

    Default `~/.cache/numa_runtime`. The directory is not created here.
    """
    path = os.environ.get("NUMA_RUNTIME_CACHE") or os.path.join("~", ".cache", "numa_runtime")
    return os.path.abspath(os.path.expanduser(path))
