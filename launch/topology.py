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
    cpus: tuple[int, ...]   # logical cpu ids, sorted
    mem_total_kb: int       # 0 when unknown
    mem_free_kb: int

    @property
    def num_cpus(self) -> int:
        return len(self.cpus)


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]  # only nodes with at least one usable cpu, by node id
    from_sysfs: bool             # False: the one-node fallback built from sched_getaffinity

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)


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


def _fallback() -> Topology:
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    return Topology((NumaNode(0, cpus, 0, 0),), from_sysfs=False)


def read_topology(sysfs_dir: str = SYSFS_NODE_DIR, allowed_cpus=None) -> Topology:
    """Nodes with their cpus and memory, read from `sysfs_dir` (a fake dir in tests).

    `allowed_cpus`: keep only these cpus (default: this process's affinity when reading the
    real sysfs, everything when reading another dir), so a container limited to some cpus
    never gets a rank bound to cpus it may not use. Nodes left without cpus (memory-only
    nodes, or nodes outside the allowed set) are dropped. Without a readable sysfs: one node
    holding the cpus of `os.sched_getaffinity`.
    """
    if allowed_cpus is None and sysfs_dir == SYSFS_NODE_DIR:
        allowed_cpus = os.sched_getaffinity(0)
    allowed = None if allowed_cpus is None else set(allowed_cpus)
    try:
        names = os.listdir(sysfs_dir)
    except OSError:
        return _fallback()
    nodes = []
    for name in names:
        m = re.fullmatch(r"node(\d+)", name)
        if not m:
            continue
        try:
            with open(os.path.join(sysfs_dir, name, "cpulist")) as f:
                cpus = parse_cpulist(f.read())
        except OSError:
            continue
        if allowed is not None:
            cpus = [c for c in cpus if c in allowed]
        if not cpus:
            continue
        total, free = _read_meminfo(os.path.join(sysfs_dir, name, "meminfo"))
        nodes.append(NumaNode(int(m.group(1)), tuple(cpus), total, free))
    if not nodes:
        return _fallback()
    return Topology(tuple(sorted(nodes, key=lambda n: n.node_id)), from_sysfs=True)
