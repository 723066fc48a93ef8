"""Worker ranks under real mpirun: Engine() returns on every rank; what runs where afterwards
is what the README's "Worker ranks" section says."""
import os
import shutil
import subprocess
import sys

import pytest

from models import build_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None,
                                reason="SKIPPED: mpirun is not installed, so worker ranks cannot be "
                                       "tested (install MPICH: scripts/install.sh)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    build_model(path, arch="llama", num_hidden_layers=1)
    return path


def run(model_dir, mode):
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = ["mpirun", "-np", "2", sys.executable, os.path.join(HERE, "mpi", "worker_ranks.py"), model_dir, mode]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    marks = sorted(line.split(" tokens")[0] for line in p.stdout.splitlines() if line.startswith("MARK "))
    return marks, p


def test_plain_script_runs_unchanged(model_dir):
    marks, p = run(model_dir, "plain")
    # before the first driving call every rank runs the script; the worker serves rank 0 in
    # generate() and then exits, and says so
    assert marks == ["MARK after-engine rank 0", "MARK after-engine rank 1", "MARK after-generate rank 0"]
    assert "rank 1 is a worker rank: at its first driving call (generate)" in p.stderr
    assert "rest of the script runs on rank 0 only" in p.stderr


def test_explicit_with_block_continues_on_every_rank(model_dir):
    marks, p = run(model_dir, "explicit")
    assert marks == ["MARK after-with rank 0", "MARK after-with rank 1", "MARK driving rank 0",
                     "MARK in-with rank 0", "MARK in-with rank 1"]
    assert "is a worker" not in p.stderr  # nothing ended a rank early
