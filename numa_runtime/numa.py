"""Self-binding of an MPI rank to a NUMA node when numa-launch did not bind it.

`numa-launch` wraps every rank in `numactl` and sets NUMA_RUNTIME_BOUND=1. A rank started by a
plain `mpirun -np N` binds itself here instead: cpu affinity with `sched_setaffinity`, memory
with the `set_mempolicy` syscall (no libnuma needed), and the OpenMP thread count.
Bind before allocating weights or the KV cache: pages land on the node that first touches them.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass

from .launch.topology import Topology, format_cpulist, nodes_phrase, read_topology

from . import env

log = logging.getLogger(__name__)

MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE = 1, 2, 3
MPOL_NAMES = {0: "default", 1: "preferred", 2: "bind", 3: "interleave", 4: "local",
              5: "preferred_many", 6: "weighted_interleave"}
_MPOL_MODE_FLAGS = (1 << 15) | (1 << 14) | (1 << 13)  # static/relative nodes, numa balancing
# syscall numbers: (set_mempolicy, get_mempolicy, move_pages)
_SYSCALLS = {"x86_64": (238, 239, 279), "aarch64": (237, 236, 239), "ppc64le": (261, 260, 301),
             "s390x": (270, 269, 310)}
_MAX_NODES = 1024


@dataclass(frozen=True)
class Placement:
    node: int               # NUMA node id (-1 when unknown)
    cpus: tuple[int, ...]   # cpus this rank may run on
    num_threads: int        # OpenMP threads to use
    how: str                # "launcher" (numactl), "self" (bound here) or "none"
    memory_bound: bool = False  # the memory policy binds allocations to `memory_node`
    mem_node: int | None = None  # where its memory is bound when not `node` (a node without memory)
    user_threads: bool = False  # num_threads is the user's OMP_NUM_THREADS (no core is reserved then)
    nodes: tuple[int, ...] = ()      # a rank over a group of nodes: all of them (`node` is the first)
    mem_nodes: tuple[int, ...] = ()  # more than one: its memory is interleaved over them

    @property
    def memory_node(self) -> int:
        return self.node if self.mem_node is None else self.mem_node

    @property
    def memory_nodes(self) -> tuple[int, ...]:
        """The nodes its memory is bound (one) or interleaved (several) over."""
        return self.mem_nodes if len(self.mem_nodes) > 1 else (self.memory_node,)

    def describe(self) -> str:
        """One phrase for logs: 'node 0, cpus 0-7, memory on node 0 (bound by numactl)'."""
        from .launch.topology import format_cpulist
        where = nodes_phrase(self.nodes or (self.node,)) if self.node >= 0 else "node unknown"
        mems = self.memory_nodes
        memory = ("" if not self.memory_bound else
                  ", memory %s %s" % ("interleaved over" if len(mems) > 1 else "on", nodes_phrase(mems)))
        how = {"launcher": "bound by the launcher", "self": "bound here", "none": "not bound"}.get(self.how, self.how)
        return f"{where}, cpus {format_cpulist(self.cpus)}{memory} ({how})"


_placement: Placement | None = None  # NOTE: binding is per process; repeated calls return it


def node_of_rank(local_rank: int, local_size: int, topo: Topology):
    """The launch.cli.RankPlacement of one of `local_size` ranks on this host, by numa-launch's
    rules (launch.cli.plan_ranks): ranks = nodes: a node each, socket by socket; fewer: each a group
    of whole nodes within a socket; more: ranks spread over the nodes as their cpus allow, each node's
    physical cores (with their SMT siblings) split among its ranks. ValueError when the ranks
    outnumber the cpus."""
    from .launch.cli import plan_ranks
    return plan_ranks(topo, local_size)[local_rank]


def job_cpus() -> list[int]:
    """The cpus of this rank's parent (the MPI launcher's proxy, or a wrapper in the rank's
    command) within this process's cgroup where they are more than its own, else its own: a
    launcher that binds each rank (Open MPI's default --bind-to core) narrows the rank's own
    affinity, a taskset around the whole job the proxy's too."""
    own = set(os.sched_getaffinity(0))
    try:
        parent = set(os.sched_getaffinity(os.getppid()))
    except OSError:
        return sorted(own)
    return sorted(parent & _cgroup_cpus()) if parent > own else sorted(own)


def _cgroup_cpus(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> set[int]:
    """The cpus of this process's cgroup cpuset, cgroup v2 (cpuset.cpus.effective) or v1 (the
    cpuset controller's cpuset.effective_cpus, else cpuset.cpus); every cpu when it cannot be read."""
    from .launch.topology import parse_cpulist
    try:
        with open(proc_cgroup) as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        lines = []
    candidates = []
    for _, controllers, path in lines:
        rel = path.lstrip("/")
        if controllers == "":  # NOTE: v2's unified line "0::/path"
            candidates.append(os.path.join(root, rel, "cpuset.cpus.effective"))
        elif "cpuset" in controllers.split(","):  # NOTE: v1: "N:cpuset:/path" (docker on older hosts)
            for name in ("cpuset.effective_cpus", "cpuset.cpus"):
                candidates += [os.path.join(root, "cpuset", rel, name), os.path.join(root, controllers, rel, name)]
    for file in candidates:
        try:
            with open(file) as f:
                cpus = parse_cpulist(f.read())
        except (OSError, ValueError):
            continue
        if cpus:
            return set(cpus)
    return set(range(os.cpu_count() or 1))


def set_mempolicy(node, mode: int = MPOL_BIND) -> str | None:
    """Bind (or prefer, or interleave) this thread's future allocations to `node` (a node id, or
    several). Returns None on success, else why it failed (no libnuma: the raw syscall through
    ctypes)."""
    nrs = _SYSCALLS.get(platform.machine())
    if nrs is None:
        return "set_mempolicy syscall number unknown on %s" % platform.machine()
    nr = nrs[0]
    nodes = [node] if isinstance(node, int) else list(node)
    nbits = 64 * (max(nodes) // 64 + 1)
    mask = (ctypes.c_ulong * (nbits // 64))()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    # NOTE: the kernel reads maxnode - 1 bits (libnuma passes nbits + 1 too).
    if libc.syscall(ctypes.c_long(nr), ctypes.c_int(mode), mask, ctypes.c_ulong(nbits + 1)) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def _get_mempolicy_call():
    """The get_mempolicy syscall for this thread: (errno, 0 on success; mode; node mask), or None
    where its number is unknown."""
    nrs = _SYSCALLS.get(platform.machine())
    if nrs is None:
        return None
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * (_MAX_NODES // 64))()
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(nrs[1]), ctypes.byref(mode), mask, ctypes.c_ulong(_MAX_NODES),
                      ctypes.c_void_p(0), ctypes.c_ulong(0))
    return (ctypes.get_errno() if rc != 0 else 0), mode.value, mask


def get_mempolicy() -> tuple[str, tuple[int, ...]]:
    """This thread's memory policy: (mode name, nodes of its node mask); ("unknown", ())
    where the syscall is unavailable."""
    call = _get_mempolicy_call()
    if call is None or call[0]:
        return "unknown", ()
    _, mode, mask = call
    nodes = tuple(i for i in range(_MAX_NODES) if mask[i // 64] >> (i % 64) & 1)
    m = mode & ~_MPOL_MODE_FLAGS
    return MPOL_NAMES.get(m, "mode %d" % m), nodes


def mempolicy_denied() -> str | None:
    """Why this process may not read its memory policy (seccomp, as Docker's default profile
    without CAP_SYS_NICE: EPERM; a kernel without NUMA: ENOSYS), or None when it may."""
    call = _get_mempolicy_call()
    if call is None or call[0] not in (1, 38):  # EPERM, ENOSYS
        return None
    return "get_mempolicy: %s" % os.strerror(call[0])


def page_nodes(addresses: list[int]) -> list[int]:
    """The NUMA node of the page holding each address (move_pages with nodes=NULL moves
    nothing, it only reports); a negative errno for a page that is not there (-2: never
    touched). Empty when the syscall is unavailable."""
    nrs = _SYSCALLS.get(platform.machine())
    if nrs is None or not addresses:
        return []
    n = len(addresses)
    pages = (ctypes.c_void_p * n)(*addresses)
    status = (ctypes.c_int * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(nrs[2]), ctypes.c_int(0), ctypes.c_ulong(n), pages,
                    ctypes.c_void_p(0), status, ctypes.c_int(0)) != 0:
        return []
    return list(status)


def memory_report(buffers: list[tuple[int, int]], per_buffer: int = 4) -> dict:
    """Where this process's memory goes: its memory policy, and the node of `per_buffer` pages
    spread over each (address, nbytes) buffer (a rank passes its weights).

    {"policy": "bind", "policy_nodes": [0], "sampled": 64, "page_nodes": {0: 64}} (page_nodes
    keys are node ids, or negative errnos for pages not present)."""
    mode, nodes = get_mempolicy()
    page = os.sysconf("SC_PAGE_SIZE")
    addrs = []
    for addr, nbytes in buffers:
        if addr and nbytes > 0:
            k = max(1, min(per_buffer, nbytes // page))
            addrs += [(addr + i * nbytes // k) // page * page for i in range(k)]
    counts: dict[int, int] = {}
    for node in page_nodes(addrs):
        counts[node] = counts.get(node, 0) + 1
    return {"policy": mode, "policy_nodes": list(nodes), "sampled": sum(counts.values()),
            "page_nodes": counts}


def binding_problem(report: dict, node, check_policy: bool = True) -> str | None:
    """Why `report` (memory_report) shows memory not bound to `node` (or interleaved over
    several nodes); None when it is."""
    nodes = sorted([node] if isinstance(node, int) else set(node))
    where = nodes_phrase(nodes)
    want = "bind" if len(nodes) == 1 else "interleave"
    if check_policy and (report["policy"] != want or report["policy_nodes"] != nodes):
        return "memory policy is %s %s, not %s %s" % (
            report["policy"], report["policy_nodes"], "bound to" if want == "bind" else "interleaved over", where)
    away = sum(c for n, c in report["page_nodes"].items() if n not in nodes)
    if away:
        return "%d of %d sampled weight pages are not on %s (%s)" % (
            away, report["sampled"], where, report["page_nodes"])
    return None


def check_binding(rank: int, placement: Placement | None, buffers: list[tuple[int, int]]) -> dict:
    """This rank's memory_report over `buffers` (its weights); a warning when a rank placed on
    a node has its policy or sampled pages elsewhere. (A failed set_mempolicy was already
    reported at binding: then only the pages are checked.)"""
    report = memory_report(buffers)
    if placement is not None and placement.how != "none" and placement.node >= 0:
        why = binding_problem(report, placement.memory_nodes, check_policy=placement.memory_bound)
        if why is not None:
            log.warning("rank %d: %s; its weights may be read across nodes", rank, why)
    return report


def set_omp_threads(n: int) -> None:
    """OpenMP thread count for this process: the ICV of an already loaded libgomp, and
    OMP_NUM_THREADS for a runtime that initialises later or a child process."""
    os.environ["OMP_NUM_THREADS"] = str(n)  # NOTE: written, not read: env.py covers reads
    try:
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(ctypes.c_int(n))
    except (OSError, AttributeError):
        pass


def _set_affinity_all_threads(cpus) -> None:
    """sched_setaffinity(0) moves only the calling thread: move every thread that exists
    (BLAS or MPI helper threads started at import); threads started later inherit it."""
    os.sched_setaffinity(0, cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # the thread exited meanwhile


def _node_of_cpus(cpus, topo: Topology) -> int:
    for node in topo.nodes:
        if set(cpus) <= set(node.cpus):
            return node.node_id
    return -1


def _span(cpus, topo: Topology) -> tuple[list, list[int]]:
    """The nodes `cpus` touch, and the nodes with memory that stand for them (sorted)."""
    covering = [n for n in topo.nodes if set(n.cpus) & set(cpus)]
    return covering, sorted({n.mem_node for n in covering if n.mem_node is not None})


def _set_policy(nodes) -> str | None:
    """This thread's memory bound to one node, or interleaved over several (set_mempolicy)."""
    nodes = list(nodes)
    return set_mempolicy(nodes, MPOL_INTERLEAVE if len(nodes) > 1 else MPOL_BIND)


def _alone(rank: int, cpus: list[int], topo: Topology) -> Placement:
    """A process alone on its host (no mpirun, or one rank a host): its cpus as they are; where they
    span several nodes with memory and no memory policy is set (a user's numactl stands), its memory
    is interleaved over those nodes, as numa-launch --ranks 1 does: by first touch a model's pages
    went where the loading thread ran, and every thread of the other sockets read them across."""
    global _placement
    covering, mems = _span(cpus, topo)
    threads = env.omp_num_threads() or len(cpus)
    if len(mems) < 2 or not topo.from_sysfs or get_mempolicy()[0] != "default":
        return Placement(_node_of_cpus(cpus, topo), tuple(cpus), threads, "none")
    nodes = tuple(n.node_id for n in covering)
    err = _set_policy(mems)
    if err is not None:
        log.warning("rank %d: could not interleave its memory over %s (%s); pages land where they are "
                    "first touched", rank, nodes_phrase(mems), err)
        _placement = Placement(nodes[0], tuple(cpus), threads, "none", nodes=nodes)  # NOTE: said once
        return _placement
    log.info("rank %d, alone on its host over %s: memory interleaved over %s", rank, nodes_phrase(nodes),
             nodes_phrase(mems))
    _placement = Placement(nodes[0], tuple(cpus), threads, "self", True, None if mems[0] == nodes[0] else mems[0],
                           env.omp_num_threads() is not None, nodes=nodes, mem_nodes=tuple(mems))
    return _placement


def place_alone(topo: Topology | None = None) -> Placement | None:
    """A single process (world size 1): its memory interleaved over the nodes its cpus span
    (_alone), or None where that does nothing (one node, a policy already set, numa-launch's
    numactl): such a process keeps its cpus and threads as they are. A placement is kept for
    the process only where a policy was set, so nothing else is carried from one Engine to the next."""
    if env.numa_bound():
        return None
    if _placement is not None:
        return bind_this_rank(0, 0, 1) if _placement.how == "self" else None  # NOTE: this thread's policy
    p = _alone(0, sorted(os.sched_getaffinity(0)), topo or read_topology())
    return p if p.how == "self" else None


def bind_this_rank(rank: int, local_rank: int, local_size: int,
                   topo: Topology | None = None) -> Placement:
    """Bind this rank to its node unless numa-launch did, or it is alone on the host.

    Returns where the rank runs. Logs one line when it binds. A failed memory policy is
    logged and ignored (cpu binding still helps); a failed cpu binding raises.
    """
    global _placement
    if _placement is not None:
        if _placement.how == "self" and _placement.memory_bound and get_mempolicy()[0] == "default":
            # NOTE: a memory policy is a thread's: an Engine built on a thread that was started before
            # the binding (a server's engine thread is started after it) takes it again
            _set_policy(_placement.memory_nodes)
        return _placement
    user_threads = env.omp_num_threads()  # NOTE: read before this writes its own
    cpus = sorted(os.sched_getaffinity(0))
    if topo is None and not env.numa_bound() and local_size > 1:
        # NOTE: said, not widened: a launcher that binds each rank (Open MPI's default --bind-to core)
        # and a taskset in the rank's own command look alike from here, and widening the second
        # moved ranks onto cpus their user had kept for something else
        shared = job_cpus()
        if shared != cpus:
            log.warning("rank %d may use cpus %s, fewer than its launcher's %s (the MPI launcher bound it, or a "
                        "taskset/numactl in its command); it places itself within them. To give each rank its "
                        "NUMA node, start the job with numa-launch, or with Open MPI's mpirun --bind-to none",
                        rank, format_cpulist(cpus), format_cpulist(shared))
    topo = topo or read_topology()
    if env.numa_bound():
        # NOTE: numa-launch gives a rank one node, or a group of nodes with its memory interleaved
        covering, mems = _span(cpus, topo)
        node = _node_of_cpus(cpus, topo) if len(covering) <= 1 else covering[0].node_id
        mem = mems[0] if len(covering) > 1 and mems else next((n.mem_node for n in topo.nodes if n.node_id == node),
                                                            node)
        mode, nodes = get_mempolicy()
        want = ("interleave", mems) if len(mems) > 1 else ("bind", [mem])
        bound = (mode, list(nodes)) == want
        if not bound and topo.from_sysfs and mem is not None:
            log.warning("rank %d: numa-launch bound it to %s, but its memory policy is %s %s; pages may land "
                        "on other nodes", rank, nodes_phrase(want[1]), mode, list(nodes))
        _placement = Placement(node, tuple(cpus), env.omp_num_threads() or len(cpus), "launcher",
                               bound, None if mem == node else mem,
                               nodes=tuple(n.node_id for n in covering) if len(covering) > 1 else (),
                               mem_nodes=tuple(mems) if len(mems) > 1 else ())
        return _placement
    if local_size <= 1:
        return _alone(rank, cpus, topo)
    try:
        p = node_of_rank(local_rank, local_size, topo)
    except ValueError as e:  # more ranks than cpus: oversubscribed, binding would only hurt
        log.warning("rank %d: not binding (%s)", rank, e)
        _placement = Placement(-1, tuple(cpus), max(1, len(cpus) // local_size), "none")  # NOTE: said once
        return _placement
    node, mem, cpus = p.node, p.mem_node, list(p.cpus)
    interleave = len(p.mem_nodes) > 1
    where = nodes_phrase(p.mem_nodes if interleave else [node if mem is None else mem])
    _set_affinity_all_threads(cpus)
    # NOTE: a node with cpus but no memory takes the nearest node's (a bind to itself fails)
    err = ("no NUMA information in sysfs" if not topo.from_sysfs else
           "node %d has no memory and no distance information" % node if mem is None else
           _set_policy(p.mem_nodes if interleave else [mem]))
    if err is not None:
        log.warning("rank %d: could not bind memory to %s (%s); pages may land on "
                    "other nodes", rank, where, err)
    threads = p.num_threads  # NOTE: one OpenMP thread a physical core, as numa-launch
    threads = user_threads or threads  # NOTE: the user's OMP_NUM_THREADS overrides, as the README says
    set_omp_threads(threads)
    _placement = Placement(node, tuple(cpus), threads, "self", err is None, None if mem == node else mem,
                           user_threads is not None, nodes=p.nodes, mem_nodes=p.mem_nodes if interleave else ())
    log.info("rank %d (local %d/%d): bound itself to %s, cpus %s, %d OpenMP threads%s%s",
             rank, local_rank, local_size,
             nodes_phrase(p.all_nodes), format_cpulist(cpus), threads,
             ", memory interleaved over %s" % where if interleave else
             "" if mem in (None, node) else ", memory on node %d (node %d has none)" % (mem, node),
             "" if err is None else ", memory unbound")
    return _placement
