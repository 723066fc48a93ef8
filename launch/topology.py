"""NUMA topology from sysfs (`/sys/devices/system/node`), with a one-node fallback.

No dependency beyond the standard library: the launcher imports this before numpy or MPI
exist in the process, and `numa_runtime.numa` reuses it for self-binding.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

SYSFS_NODE_DIR = "/sys/devices/system/node"


@dataclass(frozen=True)
class NumaNode:
    node_id: int
    cpus: tuple[int, ...]   # logical cpu ids this process may use, sorted
    mem_total_kb: int       # 0 when unknown
    mem_free_kb: int
    all_cpus: tuple[int, ...] = ()  # the node's whole cpulist, allowed or not; () when it is `cpus`
    cores: tuple[tuple[int, ...], ...] = ()  # `cpus` by physical core (SMT siblings); () when unknown
    has_memory: bool = True
    nearest_memory: int | None = None  # without memory: the nearest node with memory (None: unknown)
    package: int | None = None  # physical package (socket) of its cpus; None when sysfs does not say

    @property
    def num_cpus(self) -> int:
        return len(self.cpus)

    @property
    def mem_node(self) -> int | None:
        """The node this node's ranks take memory from: itself, or when it has none the nearest
        node that has (None: no distance information, so no node to bind to)."""
        return self.node_id if self.has_memory else self.nearest_memory

    def is_whole(self, cpus) -> bool:
        """Whether `cpus` are every cpu of the node, not just the ones this process may use."""
        return set(cpus) == set(self.all_cpus or self.cpus)

    def num_cores(self, cpus) -> int:
        """Physical cores that `cpus` (some of this node's) touch; len(cpus) without SMT information."""
        if not self.cores:
            return len(set(cpus))
        cpus = set(cpus)
        return sum(1 for core in self.cores if cpus.intersection(core))

    def split(self, ranks: int) -> list[list[int]]:
        """This node's cpus split among `ranks` ranks: whole physical cores with their SMT
        siblings when there is a core per rank, else single cpus (ranks then share cores)."""
        if self.cores and len(self.cores) >= ranks:
            return [sorted(c for core in group for c in core) for group in split_cpus(self.cores, ranks)]
        # NOTE: more ranks than cores: cpus in core order, so that siblings numbered apart (c and
        # c + N) go to one rank where they can; in number order every core was shared by two ranks
        return [sorted(g) for g in split_cpus([c for core in self.cores for c in core] if self.cores else self.cpus,
                                              ranks)]


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]  # only nodes with at least one usable cpu, by node id
    from_sysfs: bool             # False: the one-node fallback built from sched_getaffinity

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)


def nodes_phrase(nodes) -> str:
    """(3,) -> "node 3"; (0, 1) -> "nodes 0,1": NUMA nodes as messages name them."""
    nodes = list(nodes)
    return "node %d" % nodes[0] if len(nodes) == 1 else "nodes %s" % ",".join(map(str, nodes))


def parse_cpulist(text: str) -> list[int]:
    """"0-3,8-11" -> [0, 1, 2, 3, 8, 9, 10, 11]; "" -> []. Also accepts strides "0-7:2"."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        rng, _, stride = part.partition(":")
        lo, _, hi = rng.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1, int(stride or 1)))
    return sorted(set(cpus))


def format_cpulist(cpus) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8" (the form numactl --physcpubind accepts)."""
    cpus = sorted(set(cpus))
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else "%d-%d" % (cpus[i], cpus[j]))
        i = j + 1
    return ",".join(parts)


def split_cpus(cpus, ranks: int) -> list[list[int]]:
    """Split `cpus` into `ranks` contiguous groups whose sizes differ by at most one.

    The first `len(cpus) % ranks` groups get the extra cpu. Raises when there are fewer cpus
    than ranks (a rank with no cpu cannot run).
    """
    cpus = list(cpus)
    if ranks < 1:
        raise ValueError("ranks must be >= 1, got %d" % ranks)
    if len(cpus) < ranks:
        raise ValueError("cannot split %d cpus among %d ranks: use at most %d ranks"
                         % (len(cpus), ranks, len(cpus)))
    base, extra = divmod(len(cpus), ranks)
    groups, start = [], 0
    for r in range(ranks):
        n = base + (1 if r < extra else 0)
        groups.append(cpus[start:start + n])
        start += n
    return groups


def group_nodes(nodes, ranks: int) -> list[list[NumaNode]]:
    """`nodes` in `ranks` groups of whole nodes (ranks <= nodes), one group a rank. A group stays
    within one package (socket) where there are at least as many ranks as packages: each package
    gets a rank, the others go in proportion to the packages' cpus, and each package's nodes are
    split evenly among its ranks (2 ranks on 2 sockets of 2 nodes each, Intel SNC2: a socket each).
    Fewer ranks than packages: each rank takes whole packages. Without package ids, the nodes in id
    order."""
    nodes = list(nodes)
    if not 1 <= ranks <= len(nodes):
        raise ValueError("cannot group %d nodes into %d ranks" % (len(nodes), ranks))
    packages: dict = {}
    for n in nodes:
        packages.setdefault(n.package, []).append(n)
    pkgs = [nodes] if None in packages else list(packages.values())
    if ranks <= len(pkgs):
        return [[n for pkg in group for n in pkg] for group in split_cpus(pkgs, ranks)]
    # NOTE: a rank for every package first (by share alone, a package of one node beside one of four
    # got none, and its cpus sat idle), then the rest by highest averages (D'Hondt) over the packages'
    # cpus, a rank a node at most
    counts = [1] * len(pkgs)
    cpus = [sum(len(n.cpus) for n in pkg) for pkg in pkgs]
    for _ in range(ranks - len(pkgs)):
        i = max((i for i in range(len(pkgs)) if counts[i] < len(pkgs[i])),
                key=lambda i: (cpus[i] / (counts[i] + 1), -i))
        counts[i] += 1
    return [group for pkg, k in zip(pkgs, counts) for group in split_cpus(pkg, k)]


def _read_meminfo(path: str) -> tuple[int, int]:
    """nodeN/meminfo lines look like "Node 0 MemTotal:  5597400 kB"."""
    total = free = 0
    try:
        with open(path) as f:
            for line in f:
                m = re.match(r"Node\s+\d+\s+(MemTotal|MemFree):\s+(\d+)", line)
                if m and m.group(1) == "MemTotal":
                    total = int(m.group(2))
                elif m:
                    free = int(m.group(2))
    except OSError:
        pass
    return total, free


def _read_cores(node_dir: str, cpus) -> tuple[tuple[int, ...], ...]:
    """`cpus` grouped by physical core from cpuN/topology/thread_siblings_list (nodeN/cpuN
    links to the cpu's sysfs dir); () when any cpu lacks it."""
    cpus, cores = set(cpus), set()
    for cpu in cpus:
        try:
            with open(os.path.join(node_dir, "cpu%d" % cpu, "topology", "thread_siblings_list")) as f:
                siblings = parse_cpulist(f.read())
        except (OSError, ValueError):
            return ()
        cores.add(tuple(c for c in siblings if c in cpus) or (cpu,))
    return tuple(sorted(cores))


def _read_package(node_dir: str, cpus) -> int | None:
    """The physical package (socket) of the node's first cpu (cpuN/topology/physical_package_id);
    None when sysfs does not have it."""
    for cpu in list(cpus)[:1]:
        try:
            with open(os.path.join(node_dir, "cpu%d" % cpu, "topology", "physical_package_id")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None
    return None


def _memory_nodes(sysfs_dir: str, node_ids: list[int]) -> set[int]:
    """Nodes with memory: the `has_memory` list, else every node but those whose meminfo
    says MemTotal 0 (a node nothing is known of keeps its --membind)."""
    try:
        with open(os.path.join(sysfs_dir, "has_memory")) as f:
            return set(parse_cpulist(f.read()))
    except (OSError, ValueError):
        pass
    with_memory = set()
    for i in node_ids:
        try:
            with open(os.path.join(sysfs_dir, "node%d" % i, "meminfo")) as f:
                m = re.search(r"MemTotal:\s+(\d+)", f.read())
        except OSError:
            m = None
        if m is None or int(m.group(1)) > 0:
            with_memory.add(i)
    return with_memory


def _nearest(sysfs_dir: str, node_id: int, node_ids: list[int], candidates: set[int]) -> int | None:
    """The candidate nearest to `node_id` by nodeN/distance (one distance per online node, in
    node id order; ties: the lower id); None without a usable distance file."""
    try:
        with open(os.path.join(sysfs_dir, "node%d" % node_id, "distance")) as f:
            dist = [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None
    candidates = [i for i in candidates if i in node_ids]
    if len(dist) != len(node_ids) or not candidates:
        return None
    return min(candidates, key=lambda i: (dist[node_ids.index(i)], i))


def _fallback() -> Topology:
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    return Topology((NumaNode(0, cpus, 0, 0),), from_sysfs=False)


def allowed_memory_nodes() -> set[int] | None:
    """The nodes this process may allocate from (/proc/self/status Mems_allowed_list: a cpuset's
    cpuset.mems, a container's --cpuset-mems); None when it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Mems_allowed_list:"):
                    return set(parse_cpulist(line.split(":", 1)[1]))
    except (OSError, ValueError):
        pass
    return None


def read_topology(sysfs_dir: str = SYSFS_NODE_DIR, allowed_cpus=None, allowed_mems=None) -> Topology:
    """Nodes with their cpus and memory, read from `sysfs_dir` (a fake dir in tests).

    `allowed_cpus`: keep only these cpus (default: this process's affinity when reading the
    real sysfs, everything when reading another dir), so a container limited to some cpus
    never gets a rank bound to cpus it may not use. Nodes left without cpus (memory-only
    nodes, or nodes outside the allowed set) are dropped; a node with cpus but no memory
    records the nearest node with memory. Without a readable sysfs: one node holding the
    cpus of `os.sched_getaffinity`.
    """
    if allowed_cpus is None and sysfs_dir == SYSFS_NODE_DIR:
        allowed_cpus = os.sched_getaffinity(0)
    if allowed_mems is None and sysfs_dir == SYSFS_NODE_DIR:
        allowed_mems = allowed_memory_nodes()
    allowed = None if allowed_cpus is None else set(allowed_cpus)
    try:
        names = os.listdir(sysfs_dir)
    except OSError:
        return _fallback()
    node_ids = sorted(int(m.group(1)) for m in map(re.compile(r"node(\d+)").fullmatch, names) if m)
    with_memory = _memory_nodes(sysfs_dir, node_ids)
    if allowed_mems is not None and with_memory & set(allowed_mems):
        # NOTE: a node whose memory this process may not use (a cpuset's mems) is as one without: a
        # --membind to it stopped the rank (set_mempolicy: Invalid argument); its ranks take the nearest allowed
        with_memory &= set(allowed_mems)
    nodes = []
    for i in node_ids:
        node_dir = os.path.join(sysfs_dir, "node%d" % i)
        try:
            with open(os.path.join(node_dir, "cpulist")) as f:
                all_cpus = parse_cpulist(f.read())
        except OSError:
            continue
        cpus = all_cpus if allowed is None else [c for c in all_cpus if c in allowed]
        if not cpus:
            continue
        total, free = _read_meminfo(os.path.join(node_dir, "meminfo"))
        nearest = None if i in with_memory else _nearest(sysfs_dir, i, node_ids, with_memory)
        nodes.append(NumaNode(i, tuple(cpus), total, free, tuple(all_cpus), _read_cores(node_dir, cpus),
                              i in with_memory, nearest, _read_package(node_dir, cpus)))
    if not nodes:
        return _fallback()
    return Topology(tuple(nodes), from_sysfs=True)
