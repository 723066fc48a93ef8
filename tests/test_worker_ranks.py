"""Worker ranks under real mpirun: Engine() returns on every rank; what runs where afterwards
is what the README's "Worker ranks" section says."""
import os
import shutil
import subprocess
import sys

import pytest

from models import build_model
from procs import next_line

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


def run(model_dir, mode, **extra_env):
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env)
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


def test_a_second_engine_after_the_workers_exited_is_refused(model_dir):
    """A plain script that builds a second Engine under mpirun: the workers exited after the first
    one's driving call, and rank 0 waited for ever in the new Engine's collectives. It is refused
    in one sentence; with the workers serving (explicit mode) both engines run."""
    marks, p = run(model_dir, "plain-twice")
    assert marks[:3] == ["MARK after-engine rank 0", "MARK after-engine rank 1", "MARK after-generate rank 0"]
    assert marks[3].startswith("MARK refused rank 0 The worker ranks of this job exited when the last Engine "
                               "closed"), marks
    marks, p = run(model_dir, "driver-only-twice")  # NOTE: the worker's engine closed at its exit
    assert len(marks) == 2 and marks[1].startswith("MARK refused rank 0 The worker ranks"), marks
    marks, p = run(model_dir, "explicit-twice")
    assert marks.count("MARK driving rank 0") == 2 and marks.count("MARK after-with rank 1") == 2, marks


def test_vllm_habits_before_the_first_driving_call_run_on_every_rank(model_dir):
    """get_default_sampling_params(), summary(), has_unfinished_requests() and abort_request()
    before the first generate(), as a vLLM script does: an AttributeError on the worker ended the
    job; now every rank runs them (the KV pool's size is rank 0's to know)."""
    marks, p = run(model_dir, "vllm-habits")
    assert marks == ["MARK after-generate rank 0", "MARK before rank 0 kv_blocks True busy False",
                     "MARK before rank 1 kv_blocks False busy False"], marks


def test_driving_a_second_live_engine_is_refused_not_hung(model_dir):
    """Two Engines alive under mpirun: the workers run the first one driven until it closes; the
    second one's plans went to them and both ranks waited for the collective timeout (300 s).
    Rank 0 is told at once, and after the first closes (the workers exited with it) too."""
    marks, p = run(model_dir, "two-live")
    assert marks[:2] == ["MARK after-engines rank 0", "MARK after-engines rank 1"], marks
    assert marks[2].startswith("MARK refused rank 0 generate(): the worker ranks run the steps of another Engine"), marks
    assert marks[3].startswith("MARK refused-after-close rank 0 generate(): The worker ranks of this job exited"), marks
    assert len(marks) == 4


def test_a_new_engine_while_the_workers_serve_another_is_refused_not_hung(model_dir):
    """Engine() on rank 0 while the workers ran the first engine's loop (vLLM's `del llm` habit
    leaves it open too): its start-up collectives waited for them for ever, with no message, and
    one Ctrl-C did not end it. Rank 0 is told at once; the first engine runs on."""
    marks, p = run(model_dir, "new-while-served")
    assert len(marks) == 2 and marks[0].startswith(
        "MARK refused rank 0 Engine(): the worker ranks run the steps of another Engine"), marks
    assert "call its close() first, even after `del`" in marks[0] and marks[1] == "MARK same rank 0 True", marks


def test_closing_an_engine_never_driven_leaves_the_served_one_running(model_dir):
    """b.close() while the workers ran a's steps sent them a shutdown: they left a's loop and a's
    next generate failed. b's shutdown waits until a closes (the workers serve b after a)."""
    marks, p = run(model_dir, "close-the-other")
    assert marks == ["MARK again rank 0 same True"], marks + [p.stderr[-2000:]]


BROKEN_STEP = """
import sys
from numa_runtime import Engine, SamplingParams
eng = Engine(sys.argv[1], dtype="float32", kv_cache_memory=1 << 20, max_model_len=64)
sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
if eng.comm.is_driver:
    forward, calls = eng.runner.model.forward, []

    def failing(plan):
        calls.append(1)
        if len(calls) == 2:  # NOTE: the worker has this step's plan: it runs it, rank 0 does not
            raise MemoryError("no memory for this step")
        return forward(plan)
    eng.runner.model.forward = failing
    try:
        eng.generate([[5, 6, 7]], sp)
    except MemoryError as e:
        print("FIRST", e, flush=True)
    try:
        eng.generate([[5, 6, 7]], sp)
        print("SECOND RAN", flush=True)
    except RuntimeError as e:
        print("SECOND", e, flush=True)
eng.close()
"""


def test_a_step_that_fails_on_rank_0_mid_way_ends_the_job(model_dir):
    """Rank 0 fails a step the worker has started: the engine refuses every later call (it went on
    with the ranks out of step: other tokens, then a hang in close()), and close() ends the MPI job
    with the reason."""
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(["mpirun", "-np", "2", sys.executable, "-c", BROKEN_STEP, model_dir], capture_output=True,
                       text=True, timeout=120, env=env, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "FIRST no memory for this step" in p.stdout, out[-3000:]
    assert "SECOND generate(): a step failed on rank 0 (MemoryError: no memory for this step)" in p.stdout, out[-3000:]
    assert "SECOND RAN" not in p.stdout and "the ranks are out of step; restart the job" in p.stderr, out[-3000:]


def test_ctrl_c_ends_a_generating_job_at_once(model_dir):
    """mpiexec forwards a Ctrl-C to every rank. The worker took it inside a step and left rank 0
    waiting in the step's collective until NUMA_RUNTIME_COLLECTIVE_TIMEOUT (300 s) blamed a dead
    rank; the workers now leave it to rank 0, which ends the job between steps."""
    import signal
    import time
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL="funneled", OMP_NUM_THREADS="1",
               NUMA_RUNTIME_COLLECTIVE_TIMEOUT="120", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = ["mpirun", "-np", "2", sys.executable, os.path.join(HERE, "mpi", "worker_ranks.py"), model_dir, "ctrl-c"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert next_line(p).startswith("MARK generating rank 0")
        time.sleep(1)  # NOTE: well into the generation loop, where nearly all time is in steps
        start = time.monotonic()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=110)
        assert time.monotonic() - start < 30, err[-3000:]
        assert p.returncode != 0 and "rank 0 failed: interrupted" in err, err[-3000:]
        assert "did not join" not in err, err[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_a_ctrl_c_in_a_profiling_report_or_in_close_keeps_the_ranks_in_step(model_dir):
    """A profiling report and close() each send the workers a plan and then gather from them. A
    Ctrl-C on rank 0 between the two left the workers in the gather: the next step's plan paired
    with it, or after close() the workers waited for the collective timeout and the job aborted.
    Both now run whole, and the Ctrl-C raises after them."""
    marks, p = run(model_dir, "ctrl-c-in-report-and-close", AS_PROFILE="ON", NUMA_RUNTIME_COLLECTIVE_TIMEOUT="60")
    assert marks == ["MARK close-interrupted rank 0", "MARK closed rank 0", "MARK report-interrupted rank 0",
                     "MARK same-tokens rank 0 True", "MARK served rank 1"], p.stdout[-2000:] + p.stderr[-3000:]
