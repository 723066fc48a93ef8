"""Helpers for tests that drive a subprocess."""
from __future__ import annotations

import subprocess
import threading


def next_line(p: subprocess.Popen, timeout: float = 300):
    """The next line of `p`'s stdout. A process that prints none within `timeout` seconds is killed
    and the test fails (a bare readline() of a hung job held the whole test run)."""
    got: list = []
    reader = threading.Thread(target=lambda: got.append(p.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        p.kill()
        raise AssertionError(f"{' '.join(map(str, p.args[:4]))} ... printed no line within {timeout:.0f} s")
    return got[0]
