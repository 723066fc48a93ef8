"""numa-launch: topology parsing, rank placement, the exact mpirun command, real launches."""
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from numa_runtime.launch.cli import build_command, plan_ranks
from numa_runtime.launch.topology import format_cpulist, parse_cpulist, read_topology, split_cpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_ENV = "-env MPI4PY_RC_THREAD_LEVEL funneled -env NUMA_RUNTIME_BOUND 1"
CMD = "python -m numa_runtime.serve --model 'my dir'"


def launch(*args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "NUMA_RUNTIME_BOUND"))}
    base["PYTHONPATH"] = ROOT
    return subprocess.run([sys.executable, "-m", "numa_runtime.launch.cli", *args], cwd=ROOT,
                          env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def write_sysfs(root, nodes, smt: bool = False, distances=None, has_memory=None, packages=None) -> str:
    """A fake /sys/devices/system/node under `root`: `nodes` is (node, cpulist, MemTotal, MemFree)
    rows; `smt`: cpu c and c + 8 are hyperthread siblings (nodeN/cpuC/topology, as sysfs links
    it); `distances`: one nodeN/distance row per node; `has_memory`: that file's text;
    `packages`: {node: the physical_package_id of its cpus}."""
    for node, cpus, total, free in nodes:
        for c in parse_cpulist(cpus) if packages is not None else []:
            (root / ("node%d" % node) / ("cpu%d" % c) / "topology").mkdir(parents=True)
            (root / ("node%d" % node) / ("cpu%d" % c) / "topology" / "physical_package_id").write_text(
                "%d\n" % packages[node])
        d = root / ("node%d" % node)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text("Node %d MemTotal:  %d kB\nNode %d MemFree:   %d kB\n"
                                   "Node %d MemUsed:   1 kB\n" % (node, total, node, free, node))
        if distances is not None:
            (d / "distance").write_text(" ".join(map(str, distances[node])) + "\n")
        for c in parse_cpulist(cpus) if smt else []:
            (d / ("cpu%d" % c) / "topology").mkdir(parents=True)
            (d / ("cpu%d" % c) / "topology" / "thread_siblings_list").write_text("%d,%d\n" % (c % 8, c % 8 + 8))
    (root / "possible").write_text("0-%d\n" % (len(nodes) - 1))
    if has_memory is not None:
        (root / "has_memory").write_text(has_memory + "\n")
    return str(root)


TWO_NODES = ((0, "0-3,8-11", 1000, 600), (1, "4-7,12-15", 2000, 1500), (2, "", 4000, 4000))


@pytest.fixture
def fake_sysfs(tmp_path):
    """Two 8-cpu nodes with hyperthread siblings far apart (not told by sysfs), and a memory-only node."""
    return write_sysfs(tmp_path, TWO_NODES)


@pytest.fixture
def smt_sysfs(tmp_path):
    """fake_sysfs where sysfs tells the siblings: 4 physical cores per node, cpus c and c + 8 on one."""
    return write_sysfs(tmp_path, TWO_NODES, smt=True)


# ----------------------------------------------------------------------------- topology
def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8-11\n") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert parse_cpulist("5") == [5] and parse_cpulist("") == [] and parse_cpulist("0-6:3") == [0, 3, 6]
    assert format_cpulist([11, 0, 1, 2, 3, 8, 9, 10, 5]) == "0-3,5,8-11"


def test_split_cpus_evenly():
    assert split_cpus(range(8), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_cpus([0, 1, 2, 3, 8, 9, 10], 3) == [[0, 1, 2], [3, 8], [9, 10]]
    with pytest.raises(ValueError):
        split_cpus([0, 1], 3)


def test_read_fake_topology(fake_sysfs):
    topo = read_topology(fake_sysfs)
    assert topo.from_sysfs and [n.node_id for n in topo.nodes] == [0, 1]  # node2: no cpus
    assert topo.nodes[0].cpus == (0, 1, 2, 3, 8, 9, 10, 11)
    assert (topo.nodes[1].mem_total_kb, topo.nodes[1].mem_free_kb) == (2000, 1500)
    assert read_topology(fake_sysfs, allowed_cpus=range(4)).nodes[0].cpus == (0, 1, 2, 3)


def test_missing_sysfs_falls_back_to_affinity(tmp_path):
    topo = read_topology(str(tmp_path / "absent"))
    assert not topo.from_sysfs and topo.num_nodes == 1
    assert topo.nodes[0].cpus == tuple(sorted(os.sched_getaffinity(0)))


def test_this_machine_topology():
    topo = read_topology()
    assert topo.num_nodes >= 1
    assert set().union(*(n.cpus for n in topo.nodes)) <= os.sched_getaffinity(0)


# ----------------------------------------------------------------------------- placement
def test_plan_more_ranks_than_nodes_splits_nodes(fake_sysfs):
    p = plan_ranks(read_topology(fake_sysfs), ranks=4, reserve_server_core=True)
    assert [(x.node, x.cpus, x.num_threads) for x in p] == [
        (0, (0, 1, 2, 3), 3), (0, (8, 9, 10, 11), 4), (1, (4, 5, 6, 7), 4), (1, (12, 13, 14, 15), 4)]
    assert not any(x.whole_node for x in p)
    assert build_command(p[:1], ["cmd"]) == [
        "mpirun", "-np", "1", "-env", "OMP_NUM_THREADS", "3", "-env", "MPI4PY_RC_THREAD_LEVEL",
        "funneled", "-env", "NUMA_RUNTIME_BOUND", "1", "numactl", "--physcpubind=0-3",
        "--membind=0", "cmd"]


def test_rank_on_part_of_its_node_binds_only_its_cpus(fake_sysfs):
    """taskset -c 1: node 0 is the rank's alone but only cpu 1 is allowed; --cpunodebind=0 would
    widen it to the whole node."""
    p = plan_ranks(read_topology(fake_sysfs, allowed_cpus=[1]))
    assert [(x.node, x.cpus, x.whole_node, x.num_threads) for x in p] == [(0, (1,), False, 1)]
    assert p[0].numactl_args() == ["--physcpubind=1", "--membind=0"]
    p = plan_ranks(read_topology(fake_sysfs, allowed_cpus=range(13)))
    assert [x.numactl_args() for x in p] == [["--physcpubind=0-3,8-11", "--membind=0"],
                                             ["--physcpubind=4-7,12", "--membind=1"]]


def test_smt_siblings_stay_together_and_count_as_one_thread(smt_sysfs):
    topo = read_topology(smt_sysfs)
    assert topo.nodes[0].cores == ((0, 8), (1, 9), (2, 10), (3, 11))
    p = plan_ranks(topo)  # OMP_NUM_THREADS: the node's physical cores
    assert [(x.cpus, x.whole_node, x.num_threads) for x in p] == [
        ((0, 1, 2, 3, 8, 9, 10, 11), True, 4), ((4, 5, 6, 7, 12, 13, 14, 15), True, 4)]
    p = plan_ranks(topo, ranks=4, reserve_server_core=True)
    assert [(x.node, format_cpulist(x.cpus), x.num_threads) for x in p] == [
        (0, "0-1,8-9", 1), (0, "2-3,10-11", 2), (1, "4-5,12-13", 2), (1, "6-7,14-15", 2)]
    assert [x.cpus for x in plan_ranks(topo, ranks=8)][:2] == [(0, 8), (1, 9)]
    # more ranks than cores: single cpus, in core order: siblings numbered apart (c, c + 8) go to one
    # rank where they can (in number order every core was shared by two ranks)
    assert [(x.cpus, x.num_threads) for x in plan_ranks(topo, ranks=16)][:2] == [((0,), 1), ((8,), 1)]
    assert [x.cpus for x in plan_ranks(topo, ranks=12)][:6] == [(0, 8), (1, 9), (2,), (10,), (3,), (11,)]
    p = plan_ranks(read_topology(smt_sysfs, allowed_cpus=[0, 8, 1]))
    assert [(x.cpus, x.whole_node, x.num_threads) for x in p] == [((0, 1, 8), False, 2)]


def test_node_without_memory_binds_to_the_nearest_node_with_memory(tmp_path):
    """numactl refuses --membind to a node without memory; a CPU-less memory node gets no rank."""
    nodes = ((0, "0-1", 1000, 600), (1, "2-3", 0, 0), (2, "", 4000, 4000))
    dist = {0: [10, 21, 30], 1: [21, 10, 30], 2: [30, 30, 10]}
    topo = read_topology(write_sysfs(tmp_path / "a", nodes, distances=dist))
    # NOTE: cpus by their list: numactl checks a --cpunodebind node against the nodes with memory
    assert [x.numactl_args() for x in plan_ranks(topo)] == [["--physcpubind=0-1", "--membind=0"],
                                                           ["--physcpubind=2-3", "--membind=0"]]
    # has_memory rules over meminfo; the nearest node with memory may be a CPU-less one
    nodes = ((0, "0-1", 1000, 600), (1, "2-3", 1000, 600), (2, "", 4000, 4000))
    dist[1] = [21, 10, 14]
    topo = read_topology(write_sysfs(tmp_path / "b", nodes, distances=dist, has_memory="0,2"))
    assert [x.mem_node for x in plan_ranks(topo)] == [0, 2]
    # no distances: no node to pick, so no --membind for that rank
    topo = read_topology(write_sysfs(tmp_path / "c", nodes, has_memory="0,2"))
    assert [x.numactl_args() for x in plan_ranks(topo)] == [["--physcpubind=0-1", "--membind=0"],
                                                           ["--physcpubind=2-3"]]


def test_nodes_whose_memory_the_job_may_not_use_bind_to_the_nearest_allowed(tmp_path):
    """A cpuset limits the memory nodes too (cpuset.mems, docker --cpuset-mems): numactl --membind to a
    node outside them stops the rank (set_mempolicy: Invalid argument). Such a node is taken as one
    without memory: its rank binds to the nearest node the job may use."""
    from numa_runtime.launch.topology import allowed_memory_nodes
    nodes = ((0, "0-1", 1000, 600), (1, "2-3", 1000, 600), (2, "4-5", 1000, 600))
    dist = {0: [10, 20, 30], 1: [20, 10, 20], 2: [30, 20, 10]}
    sysfs = write_sysfs(tmp_path, nodes, distances=dist)
    assert [x.numactl_args()[1] for x in plan_ranks(read_topology(sysfs))] == ["--membind=0", "--membind=1",
                                                                              "--membind=2"]
    topo = read_topology(sysfs, allowed_mems={0, 2})
    assert [x.numactl_args()[1] for x in plan_ranks(topo)] == ["--membind=0", "--membind=0", "--membind=2"]
    assert [x.mem_nodes for x in plan_ranks(topo, 1)] == [(0, 2)]
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith("Mems_allowed_list:"))
    assert allowed_memory_nodes() == set(parse_cpulist(line.split(":")[1]))


def test_dry_run_says_where_a_node_without_memory_binds(tmp_path):
    nodes = ((0, "0-1", 1000, 600), (1, "2-3", 0, 0))
    sysfs = write_sysfs(tmp_path / "a", nodes, distances={0: [10, 20], 1: [20, 10]})
    out = launch("--sysfs", sysfs, "--dry-run", "--", "serve")
    assert out.returncode == 0, out.stderr
    assert "numactl --physcpubind=2-3 --membind=0 serve" in out.stdout
    assert "numa-launch: node 1 has no memory this job may use: rank 1 binds its memory to node 0" in out.stderr
    out = launch("--sysfs", write_sysfs(tmp_path / "b", nodes), "--dry-run", "--", "serve")
    assert out.stdout.strip().endswith("numactl --physcpubind=2-3 serve")
    assert "rank 1 runs without --membind" in out.stderr


# ----------------------------------------------------------------------------- fewer ranks than nodes
def _nodes(n: int, cpus: int = 4):
    return tuple((i, "%d-%d" % (cpus * i, cpus * i + cpus - 1), 1000, 600) for i in range(n))


def test_fewer_ranks_than_nodes_take_whole_nodes_within_a_socket(tmp_path):
    """`mpirun -np 2` on two sockets of two nodes each (Intel SNC2, AMD NPS2) ran both ranks on
    the first two nodes, socket 0, leaving socket 1 idle; each rank now takes a socket's nodes,
    its memory interleaved over them."""
    snc2 = read_topology(write_sysfs(tmp_path / "a", _nodes(4), packages={0: 0, 1: 0, 2: 1, 3: 1}))
    assert [n.package for n in snc2.nodes] == [0, 0, 1, 1]
    p = plan_ranks(snc2, 2)
    assert [(x.node, x.nodes, x.cpus, x.num_threads, x.mem_nodes, x.whole_node) for x in p] == [
        (0, (0, 1), tuple(range(8)), 8, (0, 1), True), (2, (2, 3), tuple(range(8, 16)), 8, (2, 3), True)]
    assert [x.numactl_args() for x in p] == [["--physcpubind=0-7", "--interleave=0,1"],
                                              ["--physcpubind=8-15", "--interleave=2,3"]]
    assert p[0].numactl_args(with_membind=False) == ["--physcpubind=0-7"]
    # a node id order that alternates sockets: groups follow the sockets, not the ids
    alt = read_topology(write_sysfs(tmp_path / "b", _nodes(4), packages={0: 0, 1: 1, 2: 0, 3: 1}))
    assert [x.nodes for x in plan_ranks(alt, 2)] == [(0, 2), (1, 3)]
    # 3 ranks on 2 x 2 nodes: a node each on socket 0, socket 1's two nodes for the third
    assert [x.all_nodes for x in plan_ranks(snc2, 3)] == [(0,), (1,), (2, 3)]
    assert plan_ranks(snc2, 3)[0].numactl_args() == ["--physcpubind=0-3", "--membind=0"]
    # one rank: every node; 4 ranks: a node each, as before
    assert plan_ranks(snc2, 1)[0].numactl_args() == ["--physcpubind=0-15", "--interleave=0,1,2,3"]
    assert [x.all_nodes for x in plan_ranks(snc2, 4)] == [(0,), (1,), (2,), (3,)]
    # AMD NPS4 on two sockets (8 nodes), 2 and 4 ranks; Intel SNC3 (6 nodes), 4 ranks
    nps4 = read_topology(write_sysfs(tmp_path / "c", _nodes(8), packages={i: i // 4 for i in range(8)}))
    assert [x.nodes for x in plan_ranks(nps4, 2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [x.nodes for x in plan_ranks(nps4, 4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    snc3 = read_topology(write_sysfs(tmp_path / "d", _nodes(6), packages={i: i // 3 for i in range(6)}))
    assert [x.all_nodes for x in plan_ranks(snc3, 4)] == [(0, 1), (2,), (3, 4), (5,)]
    # a container's cpuset over all of socket 0 (4 nodes) and one node of socket 1: every socket gets a rank
    # (by node share alone socket 1 got none, and its cpus sat idle)
    cut = read_topology(write_sysfs(tmp_path / "f", _nodes(5), packages={0: 0, 1: 0, 2: 0, 3: 0, 4: 1}))
    for ranks, groups in ((2, [(0, 1, 2, 3), (4,)]), (3, [(0, 1), (2, 3), (4,)]), (4, [(0, 1), (2,), (3,), (4,)])):
        p = plan_ranks(cut, ranks)
        assert [x.all_nodes for x in p] == groups
        assert sorted(c for x in p for c in x.cpus) == list(range(20))
    # without package ids: the nodes in id order; a node without memory interleaves its nearest's
    plain = read_topology(write_sysfs(tmp_path / "e", _nodes(4), has_memory="0,2-3",
                                      distances=[[10, 11, 20, 20], [11, 10, 20, 20], [20, 20, 10, 11],
                                                 [20, 20, 11, 10]]))
    p = plan_ranks(plain, 2)
    assert [(x.nodes, x.mem_nodes, x.mem_node) for x in p] == [((0, 1), (0,), 0), ((2, 3), (2, 3), 2)]
    assert p[0].numactl_args() == ["--physcpubind=0-7", "--membind=0"]


def test_dry_run_fewer_ranks_than_nodes(tmp_path):
    """numa-launch --ranks 2 on 2 x SNC2: the full command, a socket a rank."""
    sysfs = write_sysfs(tmp_path, _nodes(4), packages={0: 0, 1: 0, 2: 1, 3: 1})
    out = launch("--sysfs", sysfs, "--ranks", "2", "--dry-run", "--", "serve")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "mpirun -np 1 -env OMP_NUM_THREADS 8 %s numactl --physcpubind=0-7 --interleave=0,1 serve"
        " : -np 1 -env OMP_NUM_THREADS 8 %s numactl --physcpubind=8-15 --interleave=2,3 serve" % (RANK_ENV, RANK_ENV))


# ----------------------------------------------------------------------------- dry run
def test_dry_run_fake_topology_one_rank_per_node(fake_sysfs):
    out = launch("--sysfs", fake_sysfs, "--dry-run", "--", *shlex.split(CMD))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "mpirun -np 1 -env OMP_NUM_THREADS 8 %s numactl --physcpubind=0-3,8-11 --membind=0 %s"
        " : -np 1 -env OMP_NUM_THREADS 8 %s numactl --physcpubind=4-7,12-15 --membind=1 %s"
        % (RANK_ENV, CMD, RANK_ENV, CMD))


def test_dry_run_fake_topology_reserve_core_and_mpirun_path(fake_sysfs):
    out = launch("--sysfs", fake_sysfs, "--ranks", "1", "--reserve-server-core",
                 "--mpirun", "/opt/mpich/bin/mpirun", "--dry-run", "--", "serve")
    # NOTE: one rank on two nodes spans both (it took node 0 alone), its memory interleaved
    assert out.stdout.strip() == ("/opt/mpich/bin/mpirun -np 1 -env OMP_NUM_THREADS 15 %s "
                                  "-env NUMA_RUNTIME_RESERVED_CORE 1 "
                                  "numactl --physcpubind=0-15 --interleave=0,1 serve" % RANK_ENV)


@pytest.mark.parametrize("ranks", [1, 2])
def test_dry_run_this_machine(ranks):
    topo = read_topology()
    node = topo.nodes[0]
    if topo.num_nodes > 1 or node.num_cpus < ranks:
        pytest.skip("SKIPPED: this check of splitting one node's cpus among %d ranks needs a one-node "
                    "machine with >= %d cpus" % (ranks, ranks))
    out = launch("--ranks", str(ranks), "--dry-run", "--", *shlex.split(CMD))
    assert out.returncode == 0, out.stderr
    blocks = []
    for cpus in node.split(ranks):
        bind = "--physcpubind=%s" % format_cpulist(cpus)
        blocks.append("-np 1 -env OMP_NUM_THREADS %d %s numactl %s --membind=%d %s"
                      % (node.num_cores(cpus), RANK_ENV, bind, node.mem_node, CMD))
    assert out.stdout.strip() == "mpirun " + " : ".join(blocks)


@pytest.mark.skipif(shutil.which("taskset") is None, reason="SKIPPED: needs taskset (util-linux)")
def test_dry_run_under_taskset_keeps_the_restriction():
    cpu = min(os.sched_getaffinity(0))
    node = [n for n in read_topology(allowed_cpus=range(1 << 16)).nodes if cpu in n.cpus][0]
    if node.num_cpus < 2:
        pytest.skip("SKIPPED: limiting a rank to part of its node needs a node with >= 2 cpus")
    out = subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-m", "numa_runtime.launch", "--dry-run",
                          "--", "serve"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("mpirun -np 1 -env OMP_NUM_THREADS 1 %s numactl --physcpubind=%d --membind=%d serve"
                                  % (RANK_ENV, cpu, node.mem_node))


def test_usage_errors(fake_sysfs):
    out = launch("--dry-run")
    assert out.returncode != 0 and "no command given" in out.stderr
    out = launch("--dry-run", "python", "-m", "numa_runtime.serve")
    assert out.returncode != 0 and out.stderr.strip().endswith(
        "error: unrecognized arguments: python -m numa_runtime.serve: put the command after `--`, "
        "e.g. numa-launch [options] -- python -m numa_runtime.serve")
    out = launch("-np", "2", "--", "serve")
    assert out.returncode != 0 and out.stderr.strip().endswith(
        "error: -np is mpirun's option: give the number of ranks as --ranks N")
    out = launch("-n", "2", "serve")
    assert out.returncode != 0 and "as --ranks N, and the command after `--`" in out.stderr
    out = launch("--sysfs", fake_sysfs, "--ranks", "17", "--dry-run", "--", "x")
    assert out.returncode != 0 and "cannot place 17 ranks on 16 cpus: use at most 16 ranks" in out.stderr


def test_missing_tools_say_how_to_install(tmp_path):
    out = launch("--", "true", env={"PATH": str(tmp_path)})
    assert out.returncode != 0 and "apt-get install -y numactl" in out.stderr
    numactl = shutil.which("numactl")
    if numactl is None:
        pytest.skip("SKIPPED: numactl is not installed, so its binding is not checked (apt-get install numactl)")
    os.symlink(numactl, tmp_path / "numactl")
    out = launch("--mpirun", "no-such-mpirun", "--", "true", env={"PATH": str(tmp_path)})
    assert out.returncode != 0 and "pip install mpich mpi4py" in out.stderr


def test_mpirun_beside_python_is_found_off_path(fake_sysfs):
    """The mpich wheel's mpirun sits beside the venv's python, which need not be on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if shutil.which("numactl") is None or not os.access(beside, os.X_OK):
        pytest.skip("SKIPPED: needs numactl and the mpich wheel's mpirun beside this python")
    from numa_runtime.launch.cli import _find_tools
    old = os.environ["PATH"]
    os.environ["PATH"] = os.path.dirname(shutil.which("numactl"))
    try:
        assert _find_tools(None)[0] == beside
    finally:
        os.environ["PATH"] = old


def _fake_open_mpi(tmp_path) -> str:
    fake = tmp_path / "bin" / "mpirun"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.6'\n")
    fake.chmod(0o755)
    return str(fake)


def test_open_mpis_mpirun_gets_its_own_syntax_and_the_environments_mpirun_comes_first(tmp_path, fake_sysfs):
    """numa-launch wrote MPICH's `-env NAME VALUE`, which Open MPI's mpirun refuses, and it took the first
    mpirun on PATH: a cluster's Open MPI before this environment's mpich wheel, whose MPI mpi4py loads
    (Open MPI then started each rank as a world of its own). --mpirun naming Open MPI's gets `env NAME=VALUE`
    per rank and --bind-to none (its default binds each rank to one core, under numactl's cpus)."""
    fake = _fake_open_mpi(tmp_path)
    out = launch("--sysfs", fake_sysfs, "--mpirun", fake, "--dry-run", "--", "serve")
    assert out.returncode == 0, out.stderr
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    env = "MPI4PY_RC_THREAD_LEVEL=funneled NUMA_RUNTIME_BOUND=1"
    assert out.stdout.split() == [fake, "--bind-to", "none", "--oversubscribe", *root] + (
        "-np 1 env OMP_NUM_THREADS=8 %s numactl --physcpubind=0-3,8-11 --membind=0 serve : "
        "-np 1 env OMP_NUM_THREADS=8 %s numactl --physcpubind=4-7,12-15 --membind=1 serve" % (env, env)).split()
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.access(beside, os.X_OK):
        pytest.skip("SKIPPED: no mpich wheel's mpirun beside this python")
    out = launch("--sysfs", fake_sysfs, "--dry-run", "--", "serve",
                 env={"PATH": os.path.dirname(fake) + os.pathsep + os.environ["PATH"]})
    assert out.stdout.startswith(beside + " -np 1 -env OMP_NUM_THREADS 8 "), out.stdout


def test_ranks_follow_each_nodes_cpus():
    """More ranks than nodes: as even as the nodes' cpus allow (3 + 4 cpus take 7 ranks), and
    past every cpu one sentence with the real bound."""
    from numa_runtime.launch.topology import NumaNode, Topology
    topo = Topology((NumaNode(0, (0, 1, 2), 0, 0), NumaNode(1, (3, 4, 5, 6), 0, 0)), True)
    assert [p.cpus for p in plan_ranks(topo, 7)] == [(c,) for c in range(7)]
    four = Topology(tuple(NumaNode(i, tuple(range(4 * i, 4 * i + 4)), 0, 0) for i in range(4)), True)
    assert len(plan_ranks(four, 16)) == 16
    with pytest.raises(ValueError, match="cannot place 20 ranks on 16 cpus: use at most 16 ranks"):
        plan_ranks(four, 20)


# ----------------------------------------------------------------------------- real launches
needs_tools = pytest.mark.skipif(not (shutil.which("mpirun") and shutil.which("numactl")),
                                 reason="SKIPPED: real numa-launch runs need mpirun and numactl "
                                        "(scripts/install.sh installs both)")


@needs_tools
def test_launch_binds_ranks_and_propagates_exit_code():
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2 or read_topology().num_nodes > 1:
        pytest.skip("SKIPPED: this launch splits one node's cpus in two, so it needs a one-node machine "
                    "with >= 2 cpus")
    code = ("import os, sys; r = int(os.environ['PMI_RANK']);"
            # NOTE: one write per rank: print() writes its parts apart and ranks interleave
            "os.write(1, ('rank %d %s %s %s %s\\n' % (r, sorted(os.sched_getaffinity(0)),"
            " os.environ['OMP_NUM_THREADS'], os.environ['NUMA_RUNTIME_BOUND'],"
            " os.environ['MPI4PY_RC_THREAD_LEVEL'])).encode());"
            "sys.exit(3 if r == 1 else 0)")
    out = launch("--ranks", "2", "--", sys.executable, "-c", code)
    assert out.returncode == 3, out.stderr
    node = read_topology().nodes[0]
    for r, cpus in enumerate(node.split(2)):
        assert "rank %d %s %d 1 funneled" % (r, cpus, node.num_cores(cpus)) in out.stdout


@needs_tools
def test_python_in_the_command_is_the_launchers_own():
    """`numa-launch -- python ...` runs the python of numa-launch's environment, on PATH or not
    (a bare `python` found another interpreter, without numa_runtime)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED: launching two bound ranks needs 2 cpus")
    tools = {os.path.dirname(shutil.which(t)) for t in ("mpirun", "numactl")} - {os.path.dirname(sys.executable)}
    path = os.pathsep.join(sorted(tools) + ["/usr/bin", "/bin"])
    # NOTE: one write per rank: print() writes its parts apart and the ranks' lines interleave
    out = launch("--ranks", "2", "--", "python", "-c",
                 "import os, sys, numa_runtime; os.write(1, (sys.executable + '\\n').encode())", env={"PATH": path})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [os.path.join(os.path.dirname(sys.executable), "python")] * 2, out.stdout


@needs_tools
def test_launched_ranks_do_not_rebind():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED: launching two bound ranks needs 2 cpus")
    out = launch("--ranks", "2", "--", sys.executable, os.path.join(ROOT, "tests/mpi/self_bind.py"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("how launcher") == 2 and "bound itself" not in out.stderr


@needs_tools
def test_launched_ranks_report_their_memory_binding(tmp_path):
    if len(os.sched_getaffinity(0)) < 2 or not read_topology().from_sysfs:
        pytest.skip("SKIPPED: showing launched ranks' memory binding needs 2 cpus and NUMA information in "
                    "sysfs (numactl --membind)")
    import json
    from models import build_model
    build_model(str(tmp_path), arch="llama", num_attention_heads=4, num_key_value_heads=2)
    out = launch("--ranks", "2", "--", sys.executable, os.path.join(ROOT, "tests/mpi/engine_generate.py"),
                 str(tmp_path), "float32", "1", "[[1, 2, 3]]", timeout=180)
    assert out.returncode == 0, out.stderr
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    for r in json.loads(line[0][len("RESULT "):])["per_rank"]:
        m = r["memory"]  # numactl --membind: the policy binds to the rank's node, pages are there
        assert m["policy"] == "bind" and m["policy_nodes"] == [r["node"]], r
        assert m["page_nodes"] == {str(r["node"]): m["sampled"]} and m["sampled"] > 0, r
    assert "WARNING" not in out.stderr


# ----------------------------------------------------------------------------- --tp / --dp
def test_dry_run_data_parallel_replicas(fake_sysfs):
    dp_env = " -env NUMA_RUNTIME_DATA_PARALLEL 2"
    out = launch("--sysfs", fake_sysfs, "--dp", "2", "--dry-run", "--", "serve")
    assert out.returncode == 0, out.stderr  # one replica per node
    assert out.stdout.strip() == (
        "mpirun -np 1 -env OMP_NUM_THREADS 8 %s%s numactl --physcpubind=0-3,8-11 --membind=0 serve"
        " : -np 1 -env OMP_NUM_THREADS 8 %s%s numactl --physcpubind=4-7,12-15 --membind=1 serve"
        % (RANK_ENV, dp_env, RANK_ENV, dp_env))
    out = launch("--sysfs", fake_sysfs, "--dp", "2", "--tp", "2", "--dry-run", "--", "serve")
    assert out.stdout.count("-np 1 ") == 4 and out.stdout.count(dp_env) == 4  # 2 x 2 ranks
    out = launch("--sysfs", fake_sysfs, "--tp", "2", "--ranks", "4", "--dry-run", "--", "serve")
    assert out.stdout.count("-np 1 ") == 4 and out.stdout.count(dp_env) == 4
    out = launch("--sysfs", fake_sysfs, "--tp", "2", "--dry-run", "--", "serve")
    assert out.stdout.count("-np 1 ") == 2 and "NUMA_RUNTIME_DATA_PARALLEL 1" in out.stdout
    # NOTE: more than the nodes: that many ranks (a node's cores split), as with --ranks
    out = launch("--sysfs", fake_sysfs, "--tp", "4", "--dry-run", "--", "serve")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("-np 1 ") == 4 and "NUMA_RUNTIME_DATA_PARALLEL 1" in out.stdout
    assert out.stdout.count("--physcpubind=") == 4, out.stdout
    out = launch("--sysfs", fake_sysfs, "--dp", "3", "--dry-run", "--", "serve")
    assert out.returncode == 0 and out.stdout.count("-np 1 ") == 3
    assert out.stdout.count("NUMA_RUNTIME_DATA_PARALLEL 3") == 3


@pytest.mark.parametrize("args,error", [
    (["--tp", "3", "--ranks", "2"], "--tp 3 does not divide the 2 ranks"),
    (["--dp", "2", "--ranks", "3"], "--dp 2 does not divide the 3 ranks"),
    (["--ranks", "4", "--dp", "2", "--tp", "3"], "--ranks 4 is not --dp 2 x --tp 3"),
    (["--dp", "0"], "--dp must be at least 1"),
])
def test_replica_shape_errors(fake_sysfs, args, error):
    out = launch("--sysfs", fake_sysfs, *args, "--dry-run", "--", "serve")
    assert out.returncode != 0 and "numa-launch: " + error in out.stderr


@needs_tools
def test_launch_with_data_parallel_replicas(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED: launching two data-parallel replicas needs 2 cpus")
    import json
    from models import build_model
    build_model(str(tmp_path), arch="llama", num_attention_heads=4, num_key_value_heads=2)
    prompts = "[[1, 2, 3], [4, 5, 6, 7]]"
    script = [sys.executable, os.path.join(ROOT, "tests/mpi/engine_generate.py"), str(tmp_path),
              "float32", "6", prompts]
    results = []
    for args in (["--ranks", "2", "--dp", "2"], ["--ranks", "1"]):
        out = launch(*args, "--", *script, timeout=180)
        assert out.returncode == 0, out.stderr
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        results.append(json.loads(line[0][len("RESULT "):]))
    replicas, single = results
    assert replicas["data_parallel"] == 2 and replicas["routed"] == [1, 1]
    assert replicas["tokens"] == single["tokens"]


def test_scaling_bench_gives_fewer_ranks_than_nodes_their_share_of_nodes():
    """bench/numa_scaling.py --ranks 2 on 4 nodes: two ranks of two nodes each (it launched one)."""
    if shutil.which("numactl") is None:
        pytest.skip("SKIPPED: numactl is not installed (the bench then lets ranks bind themselves)")
    sys.path.insert(0, ROOT)
    from bench.numa_scaling import launch_argv
    from numa_runtime.launch.topology import NumaNode, Topology
    four = Topology(tuple(NumaNode(i, tuple(range(4 * i, 4 * i + 4)), 0, 0) for i in range(4)), True)
    argv, how = launch_argv(2, ["python", "x.py"], "mpirun", four)
    assert argv.count("-np") == 2 and "--physcpubind=0-7" in argv and "--physcpubind=8-15" in argv
    assert "--interleave=0,1" in argv and "--interleave=2,3" in argv and "rank 1: nodes 2,3" in how
    argv, _ = launch_argv(1, ["python", "x.py"], "mpirun", four)
    assert argv.count("-np") == 1 and "--physcpubind=0-15" in argv


def test_python_dash_m_runs_the_launcher():
    """`python -m numa_runtime.launch` is numa-launch, as `python -m numa_runtime.serve` is numa-serve."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "numa_runtime.launch", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("usage: numa-launch"), p.stderr[-1000:]


@pytest.mark.skipif(shutil.which("numactl") is None, reason="numactl is not installed (scripts/install.sh installs it)")
def test_dry_run_prints_the_mpirun_that_would_run():
    """With mpirun only beside this Python (the mpich wheel, PATH without it), --dry-run printed a
    bare `mpirun` that did not run as printed; a real run finds the one beside Python."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.access(beside, os.X_OK):
        pytest.skip("no mpirun beside this Python")
    out = launch("--dry-run", "--", "python", "-c", "1", env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(beside + " -np 1 "), out.stdout



# ----------------------------------------------------------------------------- self-binding (plain mpirun)
def test_self_binding_places_ranks_as_numa_launch_does(tmp_path):
    """A cpuset of 0-17 on two 16-cpu nodes, 6 ranks: self-binding spread them 3 and 3, so node 1's
    2 cpus could not take 3 ranks and those ran unbound over cpus other ranks used; numa-launch's
    rules (4 and 2, disjoint cpus) now decide both."""
    from numa_runtime.numa import node_of_rank
    topo = read_topology(write_sysfs(tmp_path, ((0, "0-15", 1000, 600), (1, "16-31", 1000, 600))),
                         allowed_cpus=range(18))
    plan = plan_ranks(topo, 6)
    got = [node_of_rank(r, 6, topo) for r in range(6)]
    assert got == plan
    assert [p.node for p in got] == [0, 0, 0, 0, 1, 1]
    cpus = [c for p in got for c in p.cpus]
    assert len(cpus) == len(set(cpus)) == 18


def _as_rank(code: str, env=None, affinity=None) -> subprocess.CompletedProcess:
    """`code` in a fresh Python (numa_runtime from this checkout), on `affinity` cpus if given."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMA_RUNTIME_BOUND")}
    return subprocess.run([sys.executable, "-c", code], env={**base, "PYTHONPATH": ROOT, **(env or {})}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          preexec_fn=(lambda: os.sched_setaffinity(0, affinity)) if affinity else None)


def test_self_binding_takes_the_users_omp_num_threads():
    """Under plain mpirun a rank wrote OMP_NUM_THREADS itself, so a user's value was lost and the
    Engine took the written one for the user's (rank 0 then left no core to the HTTP server); the
    user's value now sets the threads, and the placement says whose it is."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SKIPPED: with fewer than 2 cpus ranks do not bind")
    code = ("import os; from numa_runtime.launch.topology import NumaNode, Topology; from numa_runtime import numa;"
            "cpus = tuple(sorted(os.sched_getaffinity(0)));"
            "p = numa.bind_this_rank(0, 0, 2, Topology((NumaNode(0, cpus, 0, 0),), True));"
            "print(p.num_threads, p.user_threads)")
    assert _as_rank(code).stdout.split() == ["1", "False"]
    assert _as_rank(code, {"OMP_NUM_THREADS": "3"}).stdout.split() == ["3", "True"]


def test_a_rank_narrowed_below_its_launchers_cpus_says_so_and_stays_within_them():
    """Open MPI binds each rank to a core by default, so a self-binding rank saw a one-core machine
    and said nothing; a taskset in the rank's own command looks the same from here, so the rank
    keeps its cpus (widening them moved ranks onto cpus their user had kept free) and says how to
    give each rank its node. job_cpus() is the parent's cpus where they are more."""
    here = sorted(os.sched_getaffinity(0))
    if len(here) < 2:
        pytest.skip("SKIPPED: needs 2 cpus to narrow a rank to one")
    code = ("import logging, os; logging.basicConfig(level=logging.INFO); from numa_runtime import numa;"
            "print(numa.job_cpus()); p = numa.bind_this_rank(1, 0, 2); print(sorted(os.sched_getaffinity(0)))")
    out = _as_rank(code, affinity={here[0]})
    assert out.stdout.split("\n")[:2] == [str(here), str([here[0]])], out.stdout + out.stderr
    assert ("rank 1 may use cpus %d, fewer than its launcher's %s (the MPI launcher bound it, or a taskset/numactl "
            "in its command)" % (here[0], format_cpulist(here))) in out.stderr
    assert "mpirun --bind-to none" in out.stderr
    narrow = "import os; os.sched_setaffinity(0, {%d}); " % here[0]
    job = "from numa_runtime import numa; print(numa.job_cpus())"
    assert _as_rank(narrow + "import subprocess, sys; print(subprocess.run([sys.executable, '-c', %r], "
                    "capture_output=True, text=True).stdout.strip())" % job).stdout.strip() == str([here[0]])


def test_cgroup_cpus_of_v1_and_v2_hierarchies(tmp_path):
    """job_cpus() caps a launcher's cpus by the cgroup's cpuset: only cgroup v2 was read, so on a
    cgroup v1 host (older Docker, hybrid systemd) a rank could be told of cpus its container lacks."""
    from numa_runtime.numa import _cgroup_cpus
    root = tmp_path / "cg"
    (root / "cpuset" / "docker" / "abc").mkdir(parents=True)
    (root / "cpuset" / "docker" / "abc" / "cpuset.effective_cpus").write_text("2-3\n")
    (root / "job").mkdir()
    (root / "job" / "cpuset.cpus.effective").write_text("0,5\n")
    v1 = tmp_path / "v1"
    v1.write_text("4:memory:/docker/abc\n3:cpuset:/docker/abc\n0::/\n")
    v2 = tmp_path / "v2"
    v2.write_text("0::/job\n")
    assert _cgroup_cpus(str(v1), str(root)) == {2, 3}
    assert _cgroup_cpus(str(v2), str(root)) == {0, 5}
    (root / "cpuset" / "docker" / "abc" / "cpuset.effective_cpus").unlink()
    (root / "cpuset" / "docker" / "abc" / "cpuset.cpus").write_text("1\n")  # NOTE: kernels without effective_cpus
    assert _cgroup_cpus(str(v1), str(root)) == {1}
    assert _cgroup_cpus(str(tmp_path / "none"), str(root)) == set(range(os.cpu_count()))


def test_launch_binds_cpus_only_where_memory_policies_are_denied(monkeypatch, capsys):
    """Docker's default seccomp profile denies get/set_mempolicy without CAP_SYS_NICE: numactl
    --membind then stopped every rank; the ranks are bound to their cpus only, and it says so."""
    from numa_runtime.launch import cli
    monkeypatch.setattr(cli, "memory_policy_denied", lambda: "get_mempolicy: Operation not permitted")
    if not read_topology().from_sysfs:
        pytest.skip("SKIPPED: this machine has no NUMA sysfs (nothing is --membind-ed anyway)")
    assert cli.main(["--dry-run", "--", "serve"]) == 0
    out = capsys.readouterr()
    assert "--membind" not in out.out and "--physcpubind=" in out.out
    assert "memory policies are not permitted here (get_mempolicy: Operation not permitted" in out.err
    monkeypatch.undo()
    assert cli.memory_policy_denied() is None  # NOTE: this machine permits them
