"""`python -m numa_runtime`: how it ends (a load that fails on one rank, Ctrl-C and SIGTERM under
mpirun, a reader that goes away, a model without a chat template), each in one sentence."""
import os
import shutil
import signal
import subprocess
import sys

import pytest

from models import build_model
from procs import next_line

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1",
           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="SKIPPED: mpirun is not installed "
                                  "(install MPICH: scripts/install.sh)")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from gguf_helpers import write_gguf
    d = tmp_path_factory.mktemp("cli")
    build_model(str(d / "hf"), arch="llama", num_hidden_layers=1)
    write_gguf(str(d / "hf"), str(d / "m.gguf"), "F32", chat_template=None)
    return str(d / "m.gguf")


def cli(*args) -> list[str]:
    return [sys.executable, "-u", "-m", "numa_runtime", *args]


@needs_mpirun
def test_a_load_that_fails_on_one_rank_is_one_sentence_on_every_rank(gguf, tmp_path):
    """Rank 1 alone cannot write its cache: every rank exits 2 and rank 0 says why in one line
    (rank 0 printed a RankLoadError traceback and the job was aborted)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["--model", gguf, "--max-tokens", "3", "--raw", "hi"]
    p = subprocess.run(["mpirun", "-np", "1", *cli(*args), ":", "-np", "1", "-env", "NUMA_RUNTIME_CACHE",
                        str(blocker / "x"), *cli(*args)], capture_output=True, text=True, timeout=300, env=ENV,
                       cwd=ROOT)
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(
        "error: Rank 1 failed to load the model (OSError: the GGUF file's tokenizer and config are written to the "
        "cache directory"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "BAD TERMINATION" not in p.stdout + p.stderr


def rank0_pid(marker: str, job: int) -> int:
    """Rank 0 of the mpirun job `job` (a process of another job with the same command line, left
    by an earlier run or running beside this one, was taken for it)."""
    import psutil
    for proc in psutil.Process(job).children(recursive=True):
        try:
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in cmd and b"PMI_RANK=0" in environ:
            return proc.pid
    raise AssertionError("rank 0 is not running")


@needs_mpirun
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_to_rank_0_ends_the_job_as_ctrl_c(sig):
    """SIGTERM (systemd, timeout) or SIGINT to rank 0 alone while the answer streams: the answer
    so far stays and every rank exits (SIGTERM killed rank 0: mpirun's BAD TERMINATION banner)."""
    marker = f"Count from 1 to 1000 ({sig.name}):"
    p = subprocess.Popen(["mpirun", "-np", "2", *cli(marker, "--raw", "--max-tokens", "2000")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert next_line(p).startswith(">>> Count")  # NOTE: loaded on every rank; the answer streams
        os.kill(rank0_pid(marker, p.pid), sig)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130, err[-3000:]
    assert "BAD TERMINATION" not in out + err and "Traceback" not in err, err[-3000:]


def test_ctrl_c_while_loading_ends_every_rank(monkeypatch, capsys):
    """Ctrl-C on rank 0 while the model loads: the other ranks wait in the load's collectives, so
    rank 0 ends the MPI job (it returned 130 and the job hung for ever, a worker spinning). A load
    failure the ranks did not learn of together ends it too; one they did (Engine's agreement)
    lets each rank exit 2, rank 0 saying why."""
    import numa_runtime
    from numa_runtime import __main__ as cli_main, env
    from numa_runtime.engine import RankLoadError
    aborted = []
    monkeypatch.setattr(env, "abort_job", aborted.append)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # NOTE: this process keeps its handlers
    for rank, raised, code, abort, said in (
            (0, KeyboardInterrupt(), 130, [130], "interrupted while loading the model."),
            (0, MemoryError("Unable to allocate 1.00 GiB"), 2, [2],
             "error: could not load the model (MemoryError: Unable to allocate 1.00 GiB)."),
            (1, MemoryError("Unable to allocate 1.00 GiB"), 2, [2], "error: could not load the model"),
            (1, _agreed(MemoryError("Unable to allocate 1.00 GiB")), 2, [], ""),
            # NOTE: an input error (a bad path or setting) is raised alike on every rank: rank 0 says it
            (0, FileNotFoundError("GGUF file 'x.gguf' does not exist."), 2, [], "error: GGUF file 'x.gguf' does not"),
            (1, FileNotFoundError("GGUF file 'x.gguf' does not exist."), 2, [], ""),
            (0, _agreed(RankLoadError("Rank 1 failed to load the model (MemoryError: x).")), 2, [],
             "error: Rank 1 failed to load the model (MemoryError: x).")):
        aborted.clear()
        monkeypatch.setenv("PMI_RANK", str(rank))
        monkeypatch.setenv("PMI_SIZE", "2")

        def fail(*a, raised=raised, **k):
            raise raised
        monkeypatch.setattr(numa_runtime, "Engine", fail)
        assert cli_main.main(["hi"]) == code
        assert aborted == abort, (rank, raised)
        err = capsys.readouterr().err.strip()
        assert err.startswith(said) and (said or not err), (rank, raised, err)


def _agreed(e):
    e.agreed = True
    return e


def test_a_reader_that_goes_away_and_a_model_without_a_chat_template(gguf):
    """`... | head`: the CLI ends quietly when its reader closes the pipe (a BrokenPipeError
    traceback, exit 1); a model without a chat template says to pass --raw."""
    p = subprocess.Popen(cli("Count from 1 to 1000:", "--raw", "--max-tokens", "2000"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=ENV, cwd=ROOT)
    try:
        assert next_line(p).startswith(b">>> Count")
        p.stdout.close()  # NOTE: the reader is gone; the next delta meets a broken pipe
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 0, err[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
    p = subprocess.run(cli("--model", gguf, "--max-tokens", "3", "hi"), capture_output=True, text=True,
                       timeout=300, env=ENV, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.strip().endswith(
        "error: this model has no chat template; pass --raw to complete the prompt as it is."), p.stderr[-3000:]
    p = subprocess.run(cli("--model", gguf, "--max-tokens", "3", "--raw", "hi"), capture_output=True, text=True,
                       timeout=300, env=ENV, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.startswith(">>> hi"), p.stderr[-3000:]
