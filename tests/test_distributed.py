"""Communicators and the reduce kernel. Multi-rank tests run the scripts in tests/mpi/
under the real `mpirun`, each with a timeout so a hang fails instead of blocking."""
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from numa_runtime.backend import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI_DIR = os.path.join(ROOT, "tests", "mpi")
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="SKIPPED: mpirun is not installed, so no multi-rank collective is "
                                         "tested (pip install mpich mpi4py, or scripts/install.sh)")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "MPI_LOCAL", "NUMA_RUNTIME_BOUND"))}
    env.update(PYTHONPATH=ROOT, MPI4PY_RC_THREAD_LEVEL="funneled", **extra)
    return env


def mpirun_args(script: str, np_: int = 2, *args: str) -> list[str]:
    return ["mpirun", "-np", str(np_), sys.executable, os.path.join(MPI_DIR, script), *args]


def run_mpi(script: str, np_: int = 2, *args: str, timeout: float = 120, **env):
    return subprocess.run(mpirun_args(script, np_, *args), env=_env(**env), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- kernel
@pytest.mark.parametrize("n", [1, 7, 1023, 1025, 4095, 300001])
@pytest.mark.parametrize("nsrc", [1, 2, 3])
def test_reduce_sum_matches_reference(n, nsrc):
    from numa_runtime._kernels.reduce import reduce_sum
    rng = np.random.default_rng(n * 10 + nsrc)
    srcs = [rng.standard_normal(n).astype(np.float32) * 100 for _ in range(nsrc)]
    got = reduce_sum(np.empty(n, np.float32), srcs)
    assert np.array_equal(got, ref.reduce_sum(np.empty(n, np.float32), srcs))
    bsrcs = [ref.f32_to_bf16(s) for s in srcs]
    got = reduce_sum(np.empty(n, np.uint16), bsrcs)
    assert np.array_equal(got, ref.reduce_sum(np.empty(n, np.uint16), bsrcs))


def test_reduce_sum_in_place_and_special_values():
    from numa_runtime._kernels.reduce import reduce_sum
    x = np.array([np.nan, np.inf, -np.inf, 3e38, -0.0, 1.0], np.float32)
    b = ref.f32_to_bf16(x)
    with np.errstate(over="ignore"):  # 3e38 + 3e38 overflows to inf in both
        assert np.array_equal(reduce_sum(np.empty_like(b), [b, b]),
                              ref.reduce_sum(np.empty_like(b), [b, b]))
    a, c = np.arange(5, dtype=np.float32), np.ones(5, np.float32)
    reduce_sum(a, [a, c])  # dst is one of the sources
    assert np.array_equal(a, np.arange(5, dtype=np.float32) + 1)
    with pytest.raises(TypeError):
        reduce_sum(np.empty(3, np.float64), [np.ones(3)])
    with pytest.raises(ValueError):
        reduce_sum(np.empty(3, np.float32), [np.ones(4, np.float32)])


# ----------------------------------------------------------------------------- single process
def test_single_process_without_mpirun_never_imports_mpi4py():
    code = ("import sys; from numa_runtime.distributed import init_distributed, SingleProcessComm;"
            "c = init_distributed(); assert isinstance(c, SingleProcessComm), c;"
            "import numpy as np; x = np.ones(3, np.float32); assert c.all_reduce_(x) is x;"
            "assert c.all_gather(x).shape == (3,) and c.is_driver and c.world_size == 1;"
            "print('mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- MPI
@needs_mpirun
@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_shared_memory(np_):
    out = run_mpi("collectives.py", np_)
    assert out.returncode == 0, out.stderr
    assert "collectives ok: %d ranks, shm=True" % np_ in out.stdout


@needs_mpirun
def test_collectives_mpi_fallback():
    out = run_mpi("collectives.py", 2, "--no-shm")
    assert out.returncode == 0, out.stderr
    assert "collectives ok: 2 ranks, shm=False" in out.stdout


@needs_mpirun
def test_failing_rank_stops_the_job():
    out = run_mpi("rank_fails.py", 2, timeout=60)  # a hung job raises TimeoutExpired here
    assert out.returncode != 0
    assert "rank 1 failed: RuntimeError: injected failure" in out.stderr
    assert "unreachable" not in out.stdout


def _orphan_shm() -> set[str]:
    """MPICH's files in /dev/shm that no process maps (what a job that ended left behind)."""
    import glob
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped |= {line.split()[-1] for line in f if "/dev/shm/mpich" in line}
        except OSError:
            pass
    return {p for p in glob.glob("/dev/shm/mpich*") if p not in mapped}


@needs_mpirun
def test_a_job_that_aborts_leaves_no_shared_memory_file():
    """MPI_Abort (a rank that fails, the fault hook) ended MPICH without its unlink: a 2 MiB file
    in /dev/shm for ever, each time; the names are unlinked once every rank has mapped them."""
    before = _orphan_shm()
    out = run_mpi("rank_fails.py", 2, timeout=60)
    assert out.returncode != 0 and "rank 1 failed" in out.stderr
    assert _orphan_shm() - before == set()
    assert run_mpi("collectives.py", 2, timeout=240).returncode == 0  # a clean end: MPICH's unlink finds none
    assert _orphan_shm() - before == set()


@needs_mpirun
def test_two_jobs_on_one_host_do_not_collide():
    procs = [subprocess.Popen(mpirun_args("collectives.py", 2), env=_env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr
        assert "collectives ok" in stdout


@needs_mpirun
def test_plain_mpirun_ranks_bind_themselves():
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("SKIPPED: this machine has fewer than 2 cpus, so two ranks cannot each bind one")
    out = run_mpi("self_bind.py", 2)
    assert out.returncode == 0, out.stderr
    lines = sorted(l for l in out.stdout.splitlines() if l.startswith("rank "))
    assert len(lines) == 2
    cpus = [set(map(int, l.split()[3].split(","))) for l in lines]
    assert not cpus[0] & cpus[1] and cpus[0] | cpus[1] <= set(allowed)
    for line, c in zip(lines, cpus):
        assert "how self" in line and "threads %d" % len(c) in line and "omp %d" % len(c) in line
    assert out.stderr.count("bound itself to node") == 2
    bound = run_mpi("self_bind.py", 2, NUMA_RUNTIME_BOUND="1")  # as numa-launch sets it
    assert bound.returncode == 0, bound.stderr
    assert bound.stdout.count("how launcher") == 2 and "bound itself" not in bound.stderr


@needs_mpirun
def test_ranks_failing_together_all_report():
    out = run_mpi("rank_fails.py", 2, "--all", timeout=60)
    assert out.returncode != 0
    assert "rank 0 failed: RuntimeError" in out.stderr or "rank 1 failed: RuntimeError" in out.stderr


# ----------------------------------------------------------------------------- memory binding
def _engine_result(stdout: str) -> dict:
    import json
    line = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
    assert len(line) == 1, stdout[-2000:]
    return json.loads(line[0][len("RESULT "):])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from models import build_model
    path = str(tmp_path_factory.mktemp("tiny"))
    build_model(path, arch="llama", num_attention_heads=4, num_key_value_heads=2)
    return path


@needs_mpirun
def test_ranks_report_memory_policy_and_weight_page_nodes(tiny_model):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED: with fewer than 2 cpus ranks do not bind, so a failed set_mempolicy cannot be shown")
    out = run_mpi("engine_generate.py", 2, tiny_model, "float32", "1", "[[1, 2, 3]]")
    assert out.returncode == 0, out.stderr
    ranks = _engine_result(out.stdout)["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        m = r["memory"]
        # bound by set_mempolicy, and the packed weights' pages really are on the node
        assert m["policy"] == "bind" and m["policy_nodes"] == [r["node"]], r
        assert m["sampled"] >= 4 * 2 + 1 and m["page_nodes"] == {str(r["node"]): m["sampled"]}, r
    assert "sampled weight pages by node {%d: " % ranks[1]["node"] in out.stderr
    assert "WARNING" not in out.stderr


def test_a_process_alone_on_several_nodes_interleaves_its_memory_unless_a_policy_is_set():
    """No mpirun (or one rank a host) on a host of several nodes: the process ran unbound, every page of
    the model on the node where the loading thread first touched it; its memory is now interleaved over
    the nodes its cpus span, as numa-launch --ranks 1 does. A policy the user set (numactl) stands, and
    one node changes nothing."""
    from numa_runtime.numa import mempolicy_denied
    if len(os.sched_getaffinity(0)) < 2 or mempolicy_denied():
        pytest.skip("SKIPPED: two nodes of this machine's cpus need 2 cpus, and memory policies permitted")
    code = ("import logging, os; logging.basicConfig(level=logging.INFO);"
            "from numa_runtime.launch.topology import NumaNode, Topology; from numa_runtime import numa;"
            "cpus = sorted(os.sched_getaffinity(0)); %s"
            "two = Topology((NumaNode(0, tuple(cpus[:1]), 0, 0), NumaNode(63, tuple(cpus[1:]), 0, 0)), True);"
            "one = Topology((NumaNode(0, tuple(cpus), 0, 0),), True);"
            "p = numa.bind_this_rank(0, 0, 1, %s); m = numa.get_mempolicy();"
            "print(p.how, p.nodes, p.mem_nodes, p.memory_bound, m[0], list(m[1]))")
    out = _run_code(code % ("", "two"))
    # NOTE: the kernel interleaves over the nodes that exist of those asked (63 does not)
    assert out.stdout.split("\n")[0] == "self (0, 63) (0, 63) True interleave [0]", out.stdout + out.stderr
    assert "rank 0, alone on its host over nodes 0,63: memory interleaved over nodes 0,63" in out.stderr
    # NOTE: a policy is a thread's: an Engine built on a thread started before the binding takes it again
    later = ("import threading; go = threading.Event(); seen = [];"
             "th = threading.Thread(target=lambda: (go.wait(), seen.append(numa.get_mempolicy()),"
             " numa.bind_this_rank(0, 0, 1, two), seen.append(numa.get_mempolicy()))); th.start();")
    out = _run_code(code.replace("print(p.how", "go.set(); th.join(); print(seen); print(p.how") % (later, "two"))
    assert out.stdout.split("\n")[0] == "[('default', ()), ('interleave', (0,))]", out.stdout
    out = _run_code(code % ("numa.set_mempolicy(0, numa.MPOL_BIND);", "two"))
    assert out.stdout.split("\n")[0] == "none () () False bind [0]", out.stdout
    out = _run_code(code % ("", "one"))
    assert out.stdout.split("\n")[0] == "none () () False default []", out.stdout


@needs_mpirun
def test_ranks_on_uneven_thread_counts_are_named(tiny_model):
    """Ranks of one model on 1 and 3 threads (a cpuset covering little of one node): every step waits
    for the slow one, and nothing said so; rank 0 now warns, naming the slow rank."""
    script = [sys.executable, os.path.join(MPI_DIR, "engine_generate.py"), tiny_model, "float32", "1", "[[1, 2, 3]]"]
    argv = ["mpirun", "-np", "1", "-env", "OMP_NUM_THREADS", "3", *script, ":",
            "-np", "1", "-env", "OMP_NUM_THREADS", "1", *script]
    out = subprocess.run(argv, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert [r["threads"] for r in _engine_result(out.stdout)["per_rank"]] == [3, 1]
    assert ("ranks 0,1 compute on 1 to 3 threads: each tensor-parallel step waits for the slowest (rank 1, "
            "on 1)") in out.stderr
    even = run_mpi("engine_generate.py", 2, tiny_model, "float32", "1", "[[1, 2, 3]]", OMP_NUM_THREADS="1")
    assert even.returncode == 0 and "tensor-parallel step waits" not in even.stderr, even.stderr


def _run_code(code: str, **env) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", code], env=_env(**env), cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def _bind_as_rank_1(node: str, printed: str) -> subprocess.CompletedProcess:
    """In a fresh process: rank 1 of 2 binds itself on a one-node topology whose node is `node`
    (Python over this process's `cpus`), then checks the pages of 4 MiB of weights; prints
    `printed` (over the placement p and the report r)."""
    code = ("import logging, os, numpy as np; logging.basicConfig(level=logging.INFO);"
            "from numa_runtime.launch.topology import NumaNode, Topology; from numa_runtime import numa;"
            f"cpus = tuple(sorted(os.sched_getaffinity(0))); node = {node};"
            "p = numa.bind_this_rank(1, 0, 2, Topology((node,), True));"
            "w = np.ones(1 << 20, np.float32);"
            "r = numa.check_binding(1, p, [(w.ctypes.data, w.nbytes)]);"
            f"print({printed})")
    return _run_code(code)


def test_failed_set_mempolicy_warns():
    # a node that does not exist: set_mempolicy fails with EINVAL; the rank says so, then the
    # check of its weight pages (on the real node, not on 63) says so too
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED: with fewer than 2 cpus ranks do not bind, so a failed set_mempolicy cannot be shown")
    out = _bind_as_rank_1("NumaNode(63, cpus, 0, 0)", "p.how, p.memory_bound, r['policy'], r['sampled']")
    assert out.stdout.split() == ["self", "False", "default", "4"]
    assert "rank 1: could not bind memory to node 63 (Invalid argument)" in out.stderr
    assert "rank 1: 4 of 4 sampled weight pages are not on node 63" in out.stderr


def test_a_rank_on_a_node_without_memory_binds_to_the_nearest_with_memory():
    """Under plain mpirun a rank binds itself; on a node with cpus but no memory (some AMD NPS
    modes, VMs) set_mempolicy to that node fails, so it binds to the nearest node with memory,
    as numa-launch does, and the check of its weight pages expects them there."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED: with fewer than 2 cpus ranks do not bind")
    out = _bind_as_rank_1("NumaNode(1, cpus, 0, 0, has_memory=False, nearest_memory=0)",
                          "p.node, p.memory_node, p.memory_bound, r['policy'], r['policy_nodes']")
    assert out.stdout.split() == ["1", "0", "True", "bind", "[0]"], out.stdout
    assert "memory on node 0 (node 1 has none)" in out.stderr and "WARNING" not in out.stderr


def test_a_rank_over_several_nodes_interleaves_its_memory_over_them():
    """Fewer ranks than nodes: a rank takes a group of nodes (launch.cli.plan_ranks) and its memory
    is interleaved over them. The syscall: an interleave policy set is read back as one. A rank
    binding itself over nodes 62 and 63 (neither exists: the call fails with EINVAL) asks for
    both and says so, and so does the check of its weight pages; a rank that numa-launch placed
    over two nodes expects their interleave."""
    out = _run_code("import numpy as np; from numa_runtime import numa;"
                    "print(numa.set_mempolicy([0], numa.MPOL_INTERLEAVE), numa.get_mempolicy());"
                    "w = np.ones(1 << 20, np.float32); r = numa.memory_report([(w.ctypes.data, w.nbytes)]);"
                    "print(r['policy'], r['policy_nodes'], r['page_nodes']);"
                    "print(numa.binding_problem(r, (0, 1)))")
    lines = out.stdout.splitlines()
    if not lines[0].startswith("None"):  # NOTE: EPERM in a container without CAP_SYS_NICE
        pytest.skip("SKIPPED: memory policies are not permitted here (%s)" % lines[0])
    assert lines[:2] == ["None ('interleave', (0,))", "interleave [0] {0: 4}"], out.stdout
    assert lines[2] == "memory policy is interleave [0], not interleaved over nodes 0,1"
    code = ("import logging, numpy as np; logging.basicConfig(level=logging.INFO);"
            "from numa_runtime.launch.topology import NumaNode, Topology; from numa_runtime import numa;"
            "moved = []; numa._set_affinity_all_threads = moved.append;"
            "topo = Topology((NumaNode(62, (900, 901), 0, 0), NumaNode(63, (902,), 0, 0), NumaNode(64, (903,), 0, 0)),"
            " True);"
            "p = numa.bind_this_rank(0, 0, 2, topo);"
            "print(moved, p.node, p.nodes, p.memory_nodes, p.memory_bound, p.num_threads);"
            "w = np.ones(1 << 20, np.float32); numa.check_binding(0, p, [(w.ctypes.data, w.nbytes)])")
    out = _run_code(code)
    assert out.stdout.split("\n")[0] == "[[900, 901, 902]] 62 (62, 63) (62, 63) False 3", out.stdout
    assert "rank 0: could not bind memory to nodes 62,63 (Invalid argument)" in out.stderr
    assert ("bound itself to nodes 62,63, cpus 900-902, 3 OpenMP threads, memory interleaved over nodes 62,63"
            in out.stderr)
    assert "rank 0: 4 of 4 sampled weight pages are not on nodes 62,63" in out.stderr
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED: a rank over two nodes of this machine's cpus needs 2 cpus")
    code = ("import os; from numa_runtime.launch.topology import NumaNode, Topology; from numa_runtime import numa;"
            "%s cpus = sorted(os.sched_getaffinity(0));"
            "p = numa.bind_this_rank(0, 0, 2, Topology((NumaNode(0, tuple(cpus[:1]), 0, 0),"
            " NumaNode(1, tuple(cpus[1:]), 0, 0)), True)); print(p.describe())")
    told = "numa.get_mempolicy = lambda: ('interleave', (0, 1));"
    out = _run_code(code % told, NUMA_RUNTIME_BOUND="1")
    assert "nodes 0,1, cpus " in out.stdout
    assert "memory interleaved over nodes 0,1 (bound by the launcher)" in out.stdout
    assert "WARNING" not in out.stderr
    out = _run_code(code % "", NUMA_RUNTIME_BOUND="1")
    assert "rank 0: numa-launch bound it to nodes 0,1, but its memory policy is " in out.stderr
    assert "memory interleaved" not in out.stdout


@needs_mpirun
def test_idle_workers_sleep(tiny_model):
    # Before: an idle worker spun in MPI_Bcast at 100% of a core (cpu/wall ~1 per worker).
    out = run_mpi("idle_workers.py", 2, tiny_model, "3", timeout=180)
    assert out.returncode == 0, out.stderr
    r = _engine_result(out.stdout)
    assert r["world"] == 2 and r["workers"] == 1
    assert r["cpu_s"] / (r["wall_s"] * r["workers"]) < 0.1, r
    assert r["after"] == r["before"] and len(r["before"]) == 8  # and they wake up to work


@needs_mpirun
def test_engines_made_and_closed_in_one_job_are_freed(tiny_model):
    """Each Engine of a job made its own shared-memory window, which close() never freed (every
    engine grew each rank by it), and a worker's closed Engine stayed alive (its atexit handler
    held it: weights, KV cache, the open checkpoint)."""
    out = run_mpi("engine_cycles.py", 2, tiny_model, "6", timeout=240)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in rows) == [0, 1], out.stdout
    for r in rows:
        assert r["alive"] == 0, r
        assert r["seen"]["5"] == r["seen"]["1"], r  # NOTE: mappings and open files after engine 1 and 5


@needs_mpirun
def test_ranks_with_smaller_kv_pools_bound_the_pool_rank_0_schedules(tiny_model):
    """Rank 1 under a lower memory limit (a smaller host or cgroup, here ulimit -v) sizes a
    smaller default pool than rank 0: rank 0 scheduled blocks past it, and rank 1 failed
    mid-run ("slot_mapping ... is past the cache's slots"); it schedules the smallest pool now."""
    script = os.path.join(MPI_DIR, "uneven_pools.py")
    cmd = ["mpirun", "-np", "1", sys.executable, script, tiny_model, ":", "-np", "1", "bash", "-c",
           f'ulimit -v 1200000 && exec "{sys.executable}" "{script}" "{tiny_model}"']
    out = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["rank"]: r for r in (json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines()
                                   if line.startswith("RESULT "))}
    small, big = rows[1]["kv_blocks"], rows[0]["kv_blocks"]
    assert small < big and rows[0]["ranks"] == [big, small], rows
    assert rows[0]["used"] == small and small * 16 < 16 * 408, rows  # NOTE: the prompts outgrow the pool
    assert rows[0]["tokens"] == [8] * 16


def _stop_a_rank(np_: int, model: str, *args: str, what: str) -> tuple[str, str]:
    """tests/mpi/stuck_worker.py under mpirun with a 3 s collective timeout: (stdout, stderr) of a
    job that must end on its own, with a failing status (a hang fails the test, naming `what`)."""
    p = subprocess.Popen(mpirun_args("stuck_worker.py", np_, model, *args),
                         env=_env(NUMA_RUNTIME_COLLECTIVE_TIMEOUT="3"),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the job hung after {what} stopped:\n{out}\n{err[-2000:]}")
    assert p.returncode != 0, out + err[-2000:]
    return out, err


@needs_mpirun
@pytest.mark.parametrize("action,says", [
    # NOTE: the step's plan may reach MPI's buffers with the worker stopped (small plans do): then its first
    # all-reduce names the rank
    ("generate", ("did not take part within 3 s", "rank 1 did not join within 3 s")),
    ("close", ("did not take part within 3 s",))])
def test_a_stopped_worker_stops_the_job_with_a_reason(tiny_model, action, says):
    """A hung worker (SIGSTOP: mpiexec sees no death) while rank 0 sends a step or closes the
    engine: rank 0 waited in MPI for ever; it stops the job after the collective timeout."""
    out, err = _stop_a_rank(2, tiny_model, action, what="a worker")
    assert "stopped rank 1" in out and "NOT STOPPED" not in out, out + err[-2000:]
    assert any(f"{x} (NUMA_RUNTIME_COLLECTIVE_TIMEOUT); it is stuck or dead, stopping the job." in err
               for x in says), err[-3000:]


@needs_mpirun
@pytest.mark.parametrize("np_,stop,action,says", [
    (2, 1, "generate", "replica 1 (rank 1) completed none of its 1 queued step(s) within 3 s"),
    (2, 1, "close", "replica 1 (rank 1) completed none of its 1 queued step(s) within 3 s"),
    # NOTE: the stopped leader of a replica of 2 ranks: rank 0 names the replica (its other rank waits in
    # the leader's broadcast untimed: that wait is idle)
    (4, 2, "generate", "replica 1 (ranks 2-3) completed none of its 1 queued step(s) within 3 s")])
def test_a_stopped_data_parallel_replica_stops_the_job_with_a_reason(tiny_model, np_, stop, action, says):
    """Under data parallel rank 0 waited for a replica's plans and logits without a deadline: a
    stopped replica of one rank (no collective of its own to time out) hung the job's steps for
    ever. Now each leader acknowledges its plans and rank 0 stops the job when a replica with
    plans queued completes none within the collective timeout."""
    out, err = _stop_a_rank(np_, tiny_model, action, "2", str(stop), what="a replica")
    assert f"stopped rank {stop}" in out and "NOT STOPPED" not in out, out + err[-2000:]
    assert f"rank 0: data parallel {says} (NUMA_RUNTIME_COLLECTIVE_TIMEOUT); it is stuck or dead, stopping the " \
           "job." in err, err[-3000:]


@needs_mpirun
def test_a_slow_data_parallel_replica_is_not_taken_for_a_stuck_one(tmp_path):
    """Rank 0 sends a replica a prompt's chunks ahead (here 63 while the other replica idles),
    so one wait for its logits spans all of them: a replica that completes each chunk within
    the collective timeout finishes its prompt though that wait lasts several timeouts."""
    from models import build_model
    build_model(str(tmp_path), arch="llama", max_position_embeddings=4096, hidden_size=512,
                intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8)
    timeout = 0.5
    out = run_mpi("slow_replica.py", 2, str(tmp_path), "4000", "64", timeout=300,
                  NUMA_RUNTIME_COLLECTIVE_TIMEOUT=str(timeout))
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert row["routed"] == [1, 1], row
    assert [len(t) for t in row["tokens"]] == [1, 2], row
    assert row["seconds"] > 2 * timeout, row  # NOTE: the wait spanned several timeouts, else this shows nothing


@needs_mpirun
def test_engines_of_data_parallel_replicas_free_their_groups(tiny_model):
    """2 replicas of 2 ranks: each engine's replica groups have their own communicator and
    shared-memory window, which close() left behind (each engine grew every rank by one)."""
    out = run_mpi("engine_cycles.py", 4, tiny_model, "4", "2", timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3], out.stdout
    for r in rows:
        assert r["alive"] == 0, r
        assert r["seen"]["3"] == r["seen"]["1"], r


@needs_mpirun
@pytest.mark.parametrize("profile", [{"AS_PROFILE": "ON"}, {"AS_PROFILE_TRACE": "trace.json"}])
def test_data_parallel_replicas_refuse_operator_profiling(tiny_model, tmp_path, profile):
    """AS_PROFILE_TRACE alone turns profiling on too: it got past the refusal, and the report
    and trace held replica 0 alone."""
    profile = {k: str(tmp_path / v) if k == "AS_PROFILE_TRACE" else v for k, v in profile.items()}
    out = run_mpi("engine_generate.py", 2, tiny_model, "float32", "1", "[[1, 2, 3]]", "2", timeout=180, **profile)
    assert out.returncode != 0 and "RESULT" not in out.stdout
    assert ("Operator profiling (AS_PROFILE=ON or AS_PROFILE_TRACE) profiles one tensor-parallel model; run it "
            "without data parallel replicas." in out.stdout + out.stderr), out.stderr[-3000:]


@needs_mpirun
def test_serve_with_data_parallel_replicas(tiny_model):
    """One server and one API over two replicas: concurrent greedy completions equal one
    process's, and the job stops cleanly."""
    from concurrent.futures import ThreadPoolExecutor

    from numa_runtime import Engine, SamplingParams
    from test_server import ServerProcess
    prompts = [[1, 17, 42, 99, 5], [3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    args = ["--model", tiny_model, "--dtype", "float32", "--max-model-len", "128",
            "--kv-cache-memory", str(1 << 24), "--log-level", "info"]
    srv = ServerProcess(args + ["--data-parallel", "2"], launcher=["mpirun", "-np", "2"], env=_env())
    try:
        client = srv.client()
        ask = lambda p: client.completions.create(model=os.path.basename(tiny_model), prompt=p, max_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(ask, prompts))
        log = srv.output()
    finally:
        code = srv.stop()
    assert code == 0, srv.output()
    assert "parallel: 2 replica(s) x 1 tensor-parallel rank(s) (asked for)" in log
    with Engine(tiny_model, dtype="float32", kv_cache_memory=1 << 24, max_model_len=128) as eng:
        want = [o.outputs[0].text for o in eng.generate(
            prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
        one = eng.summary()
    assert texts == want
    # NOTE: the banner counts both replicas' pools (it gave replica 0's alone)
    tokens = 2 * one["max_concurrent_tokens"]
    assert f"{2 * one['kv_blocks']} blocks x 16 tokens = {tokens} tokens over 2 replicas" in log, log


def test_closed_communicators_are_freed():
    """Each model load of a server of several models makes an MPIComm; closing it freed the
    shared window but not its host communicator, and after about 2040 loads no model could
    load again ("Too many communicators")."""
    p = run_mpi("comm_cycles.py", 2, "2100", timeout=300)
    assert p.returncode == 0 and "comm cycles ok" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]


@needs_mpirun
def test_an_asked_max_model_len_one_ranks_pool_cannot_hold_fails_on_every_rank(tiny_model, tmp_path):
    """The check runs on every rank as its pool is made: rank 1's smaller pool (8 blocks of 16
    tokens: 4 KiB a block, its one kv head of 2 layers x 16 x 16 x 2 x 4 bytes) fails the load on
    both ranks, rank 0 naming rank 1, instead of rank 0 alone finding it after the workers left."""
    out = run_mpi("asked_len.py", 2, tiny_model, str(8 * 4096), str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted((tmp_path / f"rank{r}.txt").read_text() for r in range(2))
    why = ("max_model_len=256 is larger than the KV cache on rank 1 holds (8 blocks of 16 tokens: 128 tokens); "
           "raise kv_cache_memory (--kv-cache-memory) or lower max_model_len.")
    assert lines == [f"ERROR rank 0 RankLoadError: Rank 1 failed to load the model (ValueError: {why}).",
                     f"ERROR rank 1 ValueError: {why}"], out.stdout[-3000:]


@needs_mpirun
def test_a_multi_model_router_takes_the_smallest_ranks_budget(tiny_model, tmp_path):
    """Ranks with other default budgets (their own memory limits) built routers that disagreed: an
    asked max_model_len that rank 1's KV share could not hold stopped rank 1 alone, and rank 0 waited
    for it for ever. The smallest budget binds every rank now, so both refuse alike, or both serve."""
    from numa_runtime.config import ModelConfig
    weights = ModelConfig.from_dir(tiny_model).num_params * 4 // 2  # NOTE: float32, over 2 ranks
    small = 2 * weights  # NOTE: its KV share (a quarter) holds fewer than 512 tokens of 4 KiB blocks of 16
    assert small // 4 // 4096 * 16 < 512
    for asked, ok in ((512, False), (128, True)):
        for r in range(2):
            (tmp_path / f"rank{r}.json").unlink(missing_ok=True)
        out = run_mpi("router_budget.py", 2, tiny_model, str(small), str(asked), str(tmp_path), timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        if ok:
            assert [(r["budget"], r["context"]) for r in rows] == [(small, asked)] * 2, rows
        else:
            assert rows[0]["error"] == rows[1]["error"], rows
            assert rows[0]["error"].startswith("max_model_len=512 is larger than the KV cache of model 'alpha' holds")
