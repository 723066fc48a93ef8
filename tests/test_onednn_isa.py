"""The kernel tests once more with oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), as on a
Haswell or Zen 1-3 server: every matmul oneDNN cannot do well there must fall to our kernels.

The cap is read when oneDNN initialises, so it needs a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_TESTS = ["tests/test_kernel_gemm.py", "tests/test_quant_kernels.py",
                "tests/test_attention_bf16.py", "tests/test_kernels.py"]


def _capped(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_cap_reaches_onednn():
    """oneDNN has no bf16 matmul below AVX-512, so under the cap the bf16 oneDNN path is off
    (on this CPU too, whatever it has): proof that the variable took effect."""
    res = _capped(["-c", "from numa_runtime._kernels import gemm; print(gemm._dnnl_usable(True))"],
                  120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1] == "False"


def test_kernel_tests_pass_with_onednn_capped_at_avx2():
    res = _capped(["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS], 1200)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert " passed" in res.stdout.splitlines()[-1]
