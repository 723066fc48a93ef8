r"""`numa-launch`: start one MPI rank per NUMA node, each bound to its node with numactl.

    numa-launch [--ranks N] [--tp T] [--dp D] [--reserve-server-core] [--dry-run] [--mpirun PATH] \
        -- python -m numa_runtime.serve ...

--dp D runs D model replicas, each tensor parallel over --tp T consecutive ranks (D x T ranks;
give one, the other follows from --ranks or the node count): `--dp 2` on a two-node machine is
one replica per node. Every rank gets NUMA_RUNTIME_DATA_PARALLEL=D (the Engine reads it).

The command is MPMD, one block per rank, in the syntax of MPICH's mpirun (hydra):

    mpirun -np 1 -env OMP_NUM_THREADS 8 ... numactl --physcpubind=0-7 --membind=0 CMD \
         : -np 1 -env OMP_NUM_THREADS 8 ... numactl --physcpubind=8-15 --membind=1 CMD

With fewer ranks than nodes (`--ranks 2` on two sockets of two nodes each, Intel SNC2 or AMD
NPS2) each rank takes a group of whole nodes within one socket, its memory interleaved over them
(`numactl --physcpubind=<the group's cpus> --interleave=0,1`): every core and memory channel works.
With more ranks than nodes (e.g. `--ranks 2` on a one-node machine) each node's physical cores
(with their SMT siblings) are split evenly and ranks are pinned with `numactl --physcpubind=...
--membind=N`; so is a rank left with only part of its node (`taskset`, a container's cpuset).
OMP_NUM_THREADS is the rank's number of physical cores. A node without memory binds to the
nearest node with memory (or, with no distances in sysfs, not at all).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import sys
from dataclasses import dataclass

from .topology import (SYSFS_NODE_DIR, Topology, format_cpulist, group_nodes, nodes_phrase, read_topology,
                       split_cpus)

# Environment every rank gets. NUMA_RUNTIME_BOUND tells numa_runtime.numa not to re-bind;
# funneled MPI threading measured ~3x faster on small allreduces than the default.
RANK_ENV = (("MPI4PY_RC_THREAD_LEVEL", "funneled"), ("NUMA_RUNTIME_BOUND", "1"))


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node: int               # NUMA node id the rank's cpus are on
    cpus: tuple[int, ...]   # cpus the rank may run on
    whole_node: bool        # every cpu of the node (not only those this process may use)
    num_threads: int        # OMP_NUM_THREADS: one per physical core
    mem_node: int | None    # node whose memory the rank binds to (--membind); None: no binding
    nodes: tuple[int, ...] = ()      # fewer ranks than nodes: the rank's group of nodes (`node` is the first)
    mem_nodes: tuple[int, ...] = ()  # more than one: its memory is interleaved over them (--interleave)

    @property
    def all_nodes(self) -> tuple[int, ...]:
        return self.nodes or (self.node,)

    def numactl_args(self, with_membind: bool = True) -> list[str]:
        # NOTE: cpus by their list, a whole node's too: numactl checks --cpunodebind's node against the
        # nodes with memory, so a node of cpus and no memory (AMD NPS4, CXL) stopped the rank
        cpu = "--physcpubind=%s" % format_cpulist(self.cpus)
        if not with_membind:
            return [cpu]
        if len(self.mem_nodes) > 1:
            return [cpu, "--interleave=%s" % ",".join(map(str, self.mem_nodes))]
        return [cpu] + (["--membind=%d" % self.mem_node] if self.mem_node is not None else [])


def plan_ranks(topo: Topology, ranks: int | None = None,
               reserve_server_core: bool = False) -> list[RankPlacement]:
    """Where each rank runs. Default: one rank per node. Fewer ranks than nodes: each rank a
    group of whole nodes within one socket where it can (topology.group_nodes), its memory
    interleaved over the group's nodes with memory. More: ranks are spread evenly over nodes and
    each node's physical cores are split evenly among its ranks (NumaNode.split). A rank gets one
    OpenMP thread per physical core. `reserve_server_core` leaves one of rank 0's cores to the
    HTTP server (its OpenMP pool gets one thread fewer, never fewer than one)."""
    ranks = topo.num_nodes if ranks is None else ranks
    if ranks < 1:
        raise ValueError("--ranks must be at least 1, got %d" % ranks)
    placements = []
    if ranks <= topo.num_nodes:
        # NOTE: the first `ranks` nodes left the others idle: `mpirun -np 2` on two sockets of two
        # nodes each (SNC2, NPS2) ran both ranks on socket 0
        for group in group_nodes(topo.nodes, ranks):
            mems = tuple(sorted({n.mem_node for n in group if n.mem_node is not None}))
            several = len(group) > 1  # NOTE: nodes and mem_nodes tell a group; a node alone has neither
            placements.append(RankPlacement(
                len(placements), group[0].node_id, tuple(sorted(c for n in group for c in n.cpus)),
                whole_node=all(n.is_whole(n.cpus) for n in group),
                num_threads=sum(n.num_cores(n.cpus) for n in group), mem_node=mems[0] if mems else None,
                nodes=tuple(n.node_id for n in group) if several else (), mem_nodes=mems if several else ()))
    per_node = [] if placements else [(node, node.split(n)) for node, n in zip(topo.nodes,
                                                                              _ranks_per_node(topo, ranks))]
    for node, groups in per_node:
        for cpus in groups:
            # NOTE: whole_node only when the rank has every cpu of the node (a taskset/cpuset-limited
            # rank has only some)
            placements.append(RankPlacement(len(placements), node.node_id, tuple(cpus),
                                            whole_node=node.is_whole(cpus),
                                            num_threads=node.num_cores(cpus), mem_node=node.mem_node))
    if reserve_server_core:
        placements[0] = dataclasses.replace(placements[0], num_threads=max(1, placements[0].num_threads - 1))
    return placements


def memory_policy_denied() -> str | None:
    """Why this process may not set memory policies (numa.mempolicy_denied), or None."""
    from ..numa import mempolicy_denied
    return mempolicy_denied()


def memory_notes(placements: list[RankPlacement]) -> list[str]:
    """One line per rank whose node has no memory, saying where its memory goes instead."""
    notes = []
    for p in placements:
        if len(p.all_nodes) > 1:
            if p.mem_node is None:
                notes.append("%s have no memory this job may use and sysfs gives no distances to find "
                             "the nearest node that has: rank %d runs without a memory policy"
                             % (nodes_phrase(p.all_nodes), p.rank))
        elif p.mem_node is None:
            notes.append("node %d has no memory this job may use and sysfs gives no distances to find the "
                         "nearest node that has: rank %d runs without --membind" % (p.node, p.rank))
        elif p.mem_node != p.node:
            notes.append("node %d has no memory this job may use: rank %d binds its memory to node %d, the "
                         "nearest with memory" % (p.node, p.rank, p.mem_node))
    return notes


def _ranks_per_node(topo: Topology, ranks: int) -> list[int]:
    """More ranks than nodes: as even a count per node as the nodes' cpus allow (each rank
    needs a cpu), the first nodes taking the extra ones."""
    total = sum(len(n.cpus) for n in topo.nodes)
    if ranks > total:
        raise ValueError("cannot place %d ranks on %d cpus: use at most %d ranks" % (ranks, total, total))
    counts = [len(g) for g in split_cpus(range(ranks), topo.num_nodes)]
    spare = 0
    for i, node in enumerate(topo.nodes):  # NOTE: a node with fewer cpus hands its excess on
        over = counts[i] - len(node.cpus)
        if over > 0:
            counts[i] -= over
            spare += over
    for i, node in enumerate(topo.nodes):
        room = min(spare, len(node.cpus) - counts[i])
        counts[i] += room
        spare -= room
    return counts


def replica_shape(ranks: int | None, tp: int | None, dp: int | None, num_nodes: int
                  ) -> tuple[int | None, int | None]:
    """(ranks, data-parallel replicas) from --ranks/--tp/--dp: ranks = dp x tp; a missing one
    follows from the others (ranks default: one per node). (ranks, None) without --tp/--dp."""
    for name, v in (("--ranks", ranks), ("--tp", tp), ("--dp", dp)):
        if v is not None and v < 1:
            raise ValueError("%s must be at least 1, got %d" % (name, v))
    if tp is None and dp is None:
        return ranks, None
    if tp is not None and dp is not None:
        if ranks is not None and ranks != tp * dp:
            raise ValueError("--ranks %d is not --dp %d x --tp %d" % (ranks, dp, tp))
        return tp * dp, dp
    given, name = (tp, "--tp") if tp is not None else (dp, "--dp")
    # NOTE: ranks default to one per node; fewer nodes than --tp/--dp asks for (`--tp 2` on a
    # one-node machine) start that many ranks, which split the nodes' cores, as --ranks would
    total = ranks if ranks is not None else (num_nodes if num_nodes >= given else given)
    if total % given:
        raise ValueError("%s %d does not divide the %d ranks; pass --ranks as a multiple of it"
                         % (name, given, total))
    return total, dp if dp is not None else total // tp


def build_command(placements: list[RankPlacement], cmd: list[str], mpirun: str = "mpirun",
                  numactl: str = "numactl", with_membind: bool = True,
                  data_parallel: int | None = None, reserved_core: bool = False,
                  flavour: str = "hydra") -> list[str]:
    """The full mpirun argv: one `-np 1 -env ... numactl ... cmd` block per rank.
    `reserved_core`: the placements already leave rank 0's server a cpu, which
    NUMA_RUNTIME_RESERVED_CORE=1 tells the Engine (it would reserve one itself for a server).
    `flavour` "openmpi" (mpirun_flavour): Open MPI's mpirun, which has no -env: each block's
    variables go through `env NAME=VALUE`, `--bind-to none` keeps its own binding (a core per
    rank) from narrowing numactl's, and `--oversubscribe` lets ranks outnumber cores."""
    argv = [mpirun]
    env = list(RANK_ENV) + ([("NUMA_RUNTIME_DATA_PARALLEL", str(data_parallel))]
                            if data_parallel is not None else [])
    env += [("NUMA_RUNTIME_RESERVED_CORE", "1")] if reserved_core else []
    if flavour == "openmpi":
        # NOTE: --oversubscribe: Open MPI counts a slot a core, and refused more ranks than cores (SMT
        # siblings as ranks), which numactl places anyway
        argv += ["--bind-to", "none", "--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    for p in placements:
        if p.rank > 0:
            argv.append(":")
        rank_env = [("OMP_NUM_THREADS", str(p.num_threads))] + env
        if flavour == "openmpi":
            argv += ["-np", "1", "env"] + ["%s=%s" % kv for kv in rank_env]
        else:
            argv += ["-np", "1"]
            for key, value in rank_env:
                argv += ["-env", key, value]
        argv += [numactl] + p.numactl_args(with_membind) + list(cmd)
    return argv


def mpirun_flavour(mpirun: str) -> str:
    """"openmpi" when `mpirun --version` says Open MPI, else "hydra" (MPICH's, Intel MPI's: -env)."""
    import subprocess
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "hydra"
    text = out.stdout + out.stderr
    return "openmpi" if ("Open MPI" in text or "OpenRTE" in text or "Open RTE" in text) else "hydra"


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="numa-launch", usage="numa-launch [options] -- COMMAND ...",
        description="Run COMMAND as one MPI rank per NUMA node, each bound with numactl.")
    parser.add_argument("--ranks", type=int, default=None,
                        help="number of ranks (default: one per NUMA node)")
    parser.add_argument("--tp", type=int, default=None,
                        help="ranks per model replica (tensor parallel); default: all ranks")
    parser.add_argument("--dp", type=int, default=None,
                        help="model replicas (data parallel); default: the engine's rule")
    parser.add_argument("--reserve-server-core", action="store_true",
                        help="rank 0 runs one OpenMP thread fewer, leaving a core to the server "
                             "(numa_runtime.serve does this by itself from 8 cpus on; this "
                             "forces it for any command and any cpu count)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command instead of running it")
    parser.add_argument("--mpirun", default=None, help="mpirun executable (default: the one beside this Python, the one mpi4py's MPI "
                             "library came with, else PATH's)")
    parser.add_argument("--sysfs", default=SYSFS_NODE_DIR, help=argparse.SUPPRESS)
    if "--" in argv:
        i = argv.index("--")
        own, cmd = argv[:i], argv[i + 1:]
    else:
        own, cmd = argv, []
    args, extra = parser.parse_known_args(own)
    if extra and extra[0].split("=")[0] in ("-np", "-n"):
        parser.error("%s is mpirun's option: give the number of ranks as --ranks N%s"
                     % (extra[0].split("=")[0], "" if "--" in argv else ", and the command after `--`"))
    if extra and "--" not in argv:
        parser.error("unrecognized arguments: %s: put the command after `--`, "
                     "e.g. numa-launch [options] -- %s" % (shlex.join(extra), shlex.join(extra)))
    if extra:
        parser.error("unrecognized arguments: %s" % shlex.join(extra))
    if not cmd:
        parser.error("no command given: put it after `--`, e.g. "
                     "numa-launch -- python -m numa_runtime.serve --model DIR")
    return args, cmd


def _mpirun_path(mpirun_opt: str | None) -> str | None:
    """The mpirun a run starts: --mpirun's, else the mpich wheel's beside this Python (which need
    not be on PATH), else PATH's; None when there is none. NOTE: the one beside Python comes first:
    it starts the MPI library mpi4py loads here (another on PATH, a cluster's Open MPI, started each
    rank as a world of its own)."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if mpirun_opt is None and os.access(beside, os.X_OK):
        return beside
    return shutil.which(mpirun_opt or "mpirun")


def _find_tools(mpirun_opt: str | None) -> tuple[str, str]:
    numactl = shutil.which("numactl")
    if numactl is None:
        raise SystemExit("numa-launch: numactl is not installed: install it with "
                         "`apt-get install -y numactl`.")
    mpirun = _mpirun_path(mpirun_opt)
    if mpirun is None:
        raise SystemExit("numa-launch: %s not found: install MPICH and mpi4py with "
                         "`pip install mpich mpi4py`." % (mpirun_opt or "mpirun"))
    return mpirun, numactl


def main(argv: list[str] | None = None) -> int:
    args, cmd = _parse(sys.argv[1:] if argv is None else argv)
    topo = read_topology(args.sysfs)
    try:
        ranks, dp = replica_shape(args.ranks, args.tp, args.dp, topo.num_nodes)
        placements = plan_ranks(topo, ranks, args.reserve_server_core)
    except ValueError as e:
        raise SystemExit("numa-launch: %s." % str(e).rstrip("."))
    # NOTE: without a readable sysfs there is no node to bind memory to; bind cpus only.
    with_membind = topo.from_sysfs
    for note in memory_notes(placements) if with_membind else []:
        print("numa-launch: %s." % note, file=sys.stderr)
    denied = memory_policy_denied() if with_membind and args.sysfs == SYSFS_NODE_DIR else None
    if denied is not None:  # NOTE: Docker's default seccomp profile: numactl --membind then stops every rank
        print("numa-launch: memory policies are not permitted here (%s: a container without CAP_SYS_NICE?); "
              "ranks are bound to their cpus only, and their pages land where they first touch them." % denied,
              file=sys.stderr)
        with_membind = False
    if args.dry_run:  # NOTE: the mpirun that would run (the one beside this Python, off PATH, too)
        found = _mpirun_path(args.mpirun)
        shown = found or args.mpirun or "mpirun"
        on_path = shutil.which(args.mpirun or "mpirun")
        if found is not None and on_path is not None and os.path.samefile(on_path, found):
            shown = args.mpirun or "mpirun"  # NOTE: as given, where PATH finds the one that runs
        print(shlex.join(build_command(placements, cmd, shown,
                                       with_membind=with_membind, data_parallel=dp,
                                       reserved_core=args.reserve_server_core,
                                       flavour=mpirun_flavour(found) if found else "hydra")))
        return 0
    mpirun, numactl = _find_tools(args.mpirun)
    # NOTE: `-- python ...` (or numa-serve) runs this environment's, as scripts in it expect, though
    # it need not be on PATH (mpirun passes the environment on to every rank)
    here = os.path.dirname(sys.executable)
    os.environ["PATH"] = os.pathsep.join([here] + [p for p in os.environ.get("PATH", "").split(os.pathsep)
                                                   if p and p != here])
    full = build_command(placements, cmd, mpirun, numactl, with_membind, dp,
                         args.reserve_server_core, mpirun_flavour(mpirun))
    sys.stdout.flush()
    sys.stderr.flush()
    # exec: mpirun's exit status and signal handling become ours, nothing to forward.
    os.execv(mpirun, full)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
