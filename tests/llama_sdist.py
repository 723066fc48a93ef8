"""llama-cpp-python's source distribution on PyPI, downloaded once per test run (tests only):
llama.cpp keeps real models' vocabulary test files and chat templates in its vendor/llama.cpp/models."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import pytest

SDIST = "llama-cpp-python==0.3.36"
_archive: dict = {}  # NOTE: one download per pytest process, shared by the test modules


def extract(tmp_path_factory, keep) -> str:
    """A fresh folder with the sdist's files whose path below its top folder passes `keep`, each
    under its base name; skips the test when PyPI cannot be reached."""
    if "path" not in _archive:
        dl = tmp_path_factory.mktemp("sdist")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            SDIST, "-d", str(dl)], capture_output=True, text=True, timeout=600)
        archives = [f for f in os.listdir(dl) if f.endswith(".tar.gz")]
        if r.returncode != 0 or not archives:
            pytest.skip(f"could not download {SDIST} from PyPI: {r.stderr.strip()[-300:]}")
        _archive["path"] = str(dl / archives[0])
    out = tmp_path_factory.mktemp("llama_sdist")
    with tarfile.open(_archive["path"]) as tar:
        for m in tar.getmembers():
            rel = m.name.split("/", 1)[-1]
            if m.isfile() and keep(rel):
                m.name = os.path.basename(rel)
                tar.extract(m, out, filter="data")
    return str(out)
