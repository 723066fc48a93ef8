"""The Cython kernels. They are built for x86-64-v3 (AVX2, FMA, F16C: setup.py), with AVX-512 and
AMX paths chosen at run time; on a CPU below that floor, loading them would stop the process
with SIGILL, so this package refuses first, in one sentence."""
import platform


def _missing_x86_64_v3() -> list:
    """The x86-64-v3 flags /proc/cpuinfo does not list ([] where it cannot be read)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    # NOTE: -march=x86-64-v3 uses BMI1/2, LZCNT ("abm") and MOVBE too (shlx, andn, lzcnt, ...)
                    return [x for x in ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe") if x not in have]
    except OSError:
        pass
    return []


_missing = _missing_x86_64_v3()
if _missing:
    raise ImportError(f"numa_runtime's kernels need an x86-64-v3 CPU (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE: "
                      f"Intel Haswell, AMD Zen or newer); this CPU lacks {', '.join(_missing)}.")
