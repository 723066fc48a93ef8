"""Every environment variable numa_runtime reads, declared in one place.

Read them through these functions (not at import time), so a test or a launcher that sets a
variable after import still takes effect. No other module calls `os.environ` directly.
"""
import argparse
import os
import sys

__all__ = ["cache_dir"]


def cache_dir() -> str:
    """NUMA_RUNTIME_CACHE: where converted models and other derived files live.

    Default `~/.cache/numa_runtime`. The directory is not created here.
    """
    path = os.environ.get("NUMA_RUNTIME_CACHE") or os.path.join("~", ".cache", "numa_runtime")
    return os.path.abspath(os.path.expanduser(path))


# ----------------------------------------------------------------------------- MPI and NUMA
# Read by numa_runtime.distributed and numa_runtime.numa.
__all__ += ["numa_bound", "reserved_core", "mpi_world", "mpi_local", "mpi_thread_level", "collective_timeout",
            "omp_num_threads"]


def _int_pair(a: str, b: str) -> tuple[int, int] | None:
    x, y = os.environ.get(a), os.environ.get(b)
    if x is None or y is None:
        return None
    try:
        return int(x), int(y)
    except ValueError:
        return None


def numa_bound() -> bool:
    """NUMA_RUNTIME_BOUND=1: numa-launch already bound this rank with numactl."""
    return os.environ.get("NUMA_RUNTIME_BOUND", "") not in ("", "0")


def reserved_core() -> bool:
    """NUMA_RUNTIME_RESERVED_CORE=1: numa-launch --reserve-server-core already gave rank 0 one
    OpenMP thread fewer than its cpus."""
    return os.environ.get("NUMA_RUNTIME_RESERVED_CORE", "") not in ("", "0")


def mpi_world() -> tuple[int, int] | None:
    """(rank, size) when started by mpirun: PMI_RANK/PMI_SIZE (MPICH hydra) or
    OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (Open MPI); None otherwise."""
    return (_int_pair("PMI_RANK", "PMI_SIZE")
            or _int_pair("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))


class RankZeroParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors and help print from rank 0 only under mpirun (each rank
    parses the same flags; N copies of one message said nothing more)."""

    def _print_message(self, message, file=None):
        rank = mpi_world()
        if rank is None or rank[0] == 0:
            super()._print_message(message, file)


def mpi_local() -> tuple[int, int] | None:
    """(local_rank, local_size) on this host: MPI_LOCALRANKID/MPI_LOCALNRANKS (hydra) or
    OMPI_COMM_WORLD_LOCAL_RANK/OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI); None otherwise."""
    return (_int_pair("MPI_LOCALRANKID", "MPI_LOCALNRANKS")
            or _int_pair("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"))


def mpi_thread_level() -> str:
    """MPI4PY_RC_THREAD_LEVEL, default "funneled" (the default "multiple" made small
    allreduces ~3x slower)."""
    return os.environ.get("MPI4PY_RC_THREAD_LEVEL") or "funneled"


def abort_job(code: int) -> None:
    """End every rank of the MPI job (a rank 0 that cannot go on while the others wait for it in
    a collective, or before they joined one)."""
    os.environ.setdefault("MPI4PY_RC_THREAD_LEVEL", "funneled")
    import mpi4py
    mpi4py.rc.thread_level = mpi_thread_level()
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(code)


def load_failed(e: BaseException, prog: str) -> int:
    """An entry point's model load raised `e`: rank 0 (or a lone process) prints one sentence;
    returns the exit code, 2. Under mpirun, a failure the ranks did not learn of together (outside
    Engine's agreement) ends the job, as the others would wait for this rank for ever."""
    world = mpi_world()
    # NOTE: input errors (a bad path, setting or file) are raised alike on every rank, before the
    # load's collectives or through its agreement
    agreed = getattr(e, "agreed", False) or isinstance(e, (ValueError, OSError, TypeError))
    if world is None or world[0] == 0 or not agreed:
        print(f"{prog}error: {load_error(e)}", file=sys.stderr, flush=True)
    if world is not None and world[1] > 1 and not agreed:
        import time
        time.sleep(0.5)  # NOTE: mpirun drops output still in flight when the job is aborted
        abort_job(2)
    return 2


def load_error(e: BaseException) -> str:
    """A model load's failure as the one sentence the entry points print: a ValueError/OSError
    (the input's fault) or another rank's report as it is; anything else named by its type (an
    out-of-memory error said "Unable to allocate 1.2 GiB ...")."""
    from .engine import RankLoadError
    if isinstance(e, (ValueError, OSError, RankLoadError)):
        return str(e)
    return f"could not load the model ({type(e).__name__}: {e})".rstrip() + ("" if str(e).endswith(".") else ".")


def collective_timeout() -> float:
    """NUMA_RUNTIME_COLLECTIVE_TIMEOUT: seconds a rank waits for its peers inside one
    shared-memory collective before it aborts the job (default 300)."""
    raw = os.environ.get("NUMA_RUNTIME_COLLECTIVE_TIMEOUT") or "300"
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:  # NOTE: nan, 0 and negatives; a value that kills the first step is no setting
        raise ValueError(f"NUMA_RUNTIME_COLLECTIVE_TIMEOUT must be a positive number of seconds, got {raw!r}.")
    return value


def omp_num_threads() -> int | None:
    """OMP_NUM_THREADS as an int (the first entry of a nested list), None when unset."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


# ----------------------------------------------------------------------------- profiling
# Read by numa_runtime.profiler when the Engine starts.
__all__ += ["profile_enabled", "profile_trace_path", "profile_trace_steps"]


def _profile_switch() -> bool | None:
    """AS_PROFILE as on (True), off (False) or unset (None); any other value is an error."""
    raw = os.environ.get("AS_PROFILE", "").strip().lower()
    if raw == "":
        return None
    if raw in ("on", "1", "true", "yes"):
        return True
    if raw in ("off", "0", "false", "no"):
        return False
    raise ValueError(f"AS_PROFILE={os.environ['AS_PROFILE']!r} is neither on nor off; set it to ON (also 1, true, "
                     "yes) or OFF (also 0, false, no), or unset it.")


def profile_enabled() -> bool:
    """Operator profiling on: AS_PROFILE=ON (also 1/true/yes, any case), or AS_PROFILE_TRACE set
    while AS_PROFILE is unset. AS_PROFILE=OFF with AS_PROFILE_TRACE set is an error (the two
    contradict each other), as is any other value of AS_PROFILE."""
    switch = _profile_switch()
    if switch is False and profile_trace_path() is not None:
        raise ValueError("AS_PROFILE=OFF and AS_PROFILE_TRACE (a trace needs profiling on) contradict each other; "
                         "unset one of them.")
    return bool(switch) or (switch is None and profile_trace_path() is not None)


def profile_trace_path() -> str | None:
    """AS_PROFILE_TRACE=path: write a Chrome trace (chrome://tracing, Perfetto) of the first
    profile_trace_steps() engine steps to path (or of the steps run, when the engine closes
    before that many); it turns profiling on by itself."""
    return os.environ.get("AS_PROFILE_TRACE") or None


def profile_trace_steps() -> int:
    """AS_PROFILE_TRACE_STEPS: how many recent steps each rank keeps for a trace (default 32)."""
    raw = os.environ.get("AS_PROFILE_TRACE_STEPS", "").strip()
    if raw == "":
        return 32
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"AS_PROFILE_TRACE_STEPS={raw!r} is not a positive whole number of steps.")
    return int(raw)


__all__ += ["log_level"]


def log_level() -> str:
    """NUMA_RUNTIME_LOG_LEVEL: the package logger's level (default INFO; WARNING quiets start-up)."""
    raw = os.environ.get("NUMA_RUNTIME_LOG_LEVEL", "INFO").strip().upper()
    if raw in ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL"):
        return raw
    import logging
    logging.getLogger("numa_runtime").warning("NUMA_RUNTIME_LOG_LEVEL=%r is no log level (debug, info, warning, "
                                              "error); using INFO", raw.lower())
    return "INFO"


__all__ += ["show_progress"]


def show_progress() -> bool:
    """NUMA_RUNTIME_PROGRESS=1 forces the weight-loading progress bar (default: only on a tty)."""
    return os.environ.get("NUMA_RUNTIME_PROGRESS", "").lower() in ("1", "on", "true", "yes")


# ----------------------------------------------------------------------------- CUDA backend
__all__ += ["triton_interpret"]


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 (Triton's own variable, read here only): Triton kernels run in its
    interpreter on CPU tensors, so the CUDA backend's kernels and model can be checked
    without a GPU (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"

__all__ += ["data_parallel"]


def data_parallel() -> int | None:
    """NUMA_RUNTIME_DATA_PARALLEL: model replicas over the MPI ranks when the Engine is not
    told (numa-launch --dp/--tp sets it); unset: the default rule (config.ParallelConfig)."""
    value = os.environ.get("NUMA_RUNTIME_DATA_PARALLEL", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"NUMA_RUNTIME_DATA_PARALLEL must be a positive integer, got {value!r}.")
    return int(value)


# ----------------------------------------------------------------------------- kernels
__all__ += ["fused_decode"]


def fused_decode() -> bool:
    """NUMA_RUNTIME_FUSED_DECODE=0 runs quantized decode steps op by op instead of in one OpenMP
    region per step (models/llama.py; same values either way). Read when the KV cache is
    allocated. Default on."""
    return os.environ.get("NUMA_RUNTIME_FUSED_DECODE", "1").strip().lower() not in ("0", "off", "false", "no")


# ----------------------------------------------------------------------------- several models
__all__ += ["load_retry_seconds"]


def load_retry_seconds() -> float:
    """NUMA_RUNTIME_LOAD_RETRY_S: after a model's load failed for a reason other than its files
    (memory, a rank's node), its requests fail at once for this many seconds (default 30) rather
    than unload the idle models again for a load that may fail again."""
    try:
        return max(0.0, float(os.environ.get("NUMA_RUNTIME_LOAD_RETRY_S", "30")))
    except ValueError:
        return 30.0


def memory_limit_bytes(total: int) -> int:
    """The memory this process may use: the host's `total`, or less where the cgroup
    (memory.max, v2; memory.limit_in_bytes, v1) or the address-space rlimit (ulimit -v) caps it."""
    import resource
    limit = total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft > 0:
        limit = min(limit, soft)
    return limit
