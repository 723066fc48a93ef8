"""Multi-NUMA scaling: the same cores split among 1, 2, 4 (and 8) tensor-parallel ranks.

    python bench/numa_scaling.py                       # random Qwen2.5-0.5B shape, bf16
    python bench/numa_scaling.py --quick --ranks 1 2   # tiny model, few tokens (smoke run)
    python bench/numa_scaling.py --shape llama3.2-1b   # 32 heads / 8 kv heads: even splits
    python bench/numa_scaling.py --model DIR --out /tmp/numa_scaling
    python bench/numa_scaling.py --modes tp dp --concurrency 1 4 16 64   # the DP/TP crossover

Every configuration uses all cpus of this process's affinity, split evenly among its ranks
exactly as `numa-launch --ranks N` does (launch/cli.py: one `mpirun -np 1 ... numactl` block
per rank, --physcpubind + --membind). Fewer ranks than NUMA nodes: each rank takes a group of
whole nodes, its memory interleaved over them (numactl --interleave), as numa-launch does; one
rank spans every node, the "one process over all sockets" baseline. Per configuration
(one mpirun each, bench/_scaling_child.py):

    decode tok/s        one sequence (16-token prompt), after its first token, best of repeats
    decode % of limit   decode / (DRAM read GB/s / weight bytes read per token); the DRAM read
                        bandwidth is bench/limits.py's, measured in this run with every cpu of
                        each node (nodes one after the other, summed)
    concN tok/s         output tokens/s of N sequences generated together (prefill included),
                        for each --concurrency level
    mode                tp: one model over the ranks; dp: one replica per rank (--modes tp dp);
                        the report gives, per rank count, the lowest level where dp >= tp (the
                        crossover that config.DP_CROSSOVER_CONCURRENCY should follow)
    comm share          rank 0's time in all_reduce_ + all_gather over the phase's wall time
                        (it includes waiting for slower ranks); plan broadcast reported apart
    RSS per rank        MiB after loading (psutil), gathered with comm.gather_object; in
                        brackets without file-backed pages (the mmapped checkpoint)

More ranks than attention heads (or than cpus) are skipped; any other count runs, with uneven
shards where the heads do not divide (numa_runtime/sharding.py: 14 heads on 4 ranks: 4+3+4+3).
Writes OUT.json, OUT.md and OUT.png (matplotlib: installed by scripts/install.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import (ROOT, add_model_args, find_mpirun, resolve_model,  # noqa: E402
                          weights_bytes_per_token, write_report)
from numa_runtime.launch.cli import RANK_ENV, build_command, plan_ranks  # noqa: E402
from numa_runtime.launch.topology import format_cpulist, nodes_phrase, read_topology  # noqa: E402

CHILD = os.path.join(ROOT, "bench", "_scaling_child.py")


# ----------------------------------------------------------------------------- launching
def launch_argv(ranks: int, cmd: list[str], mpirun: str, topo) -> tuple[list[str], str]:
    """The mpirun argv for `ranks` ranks over every cpu of `topo`, and how it binds."""
    numactl = shutil.which("numactl")
    if numactl is None:  # the engine binds each rank itself (numa.bind_this_rank)
        env = [x for k, v in RANK_ENV if k != "NUMA_RUNTIME_BOUND" for x in ("-env", k, v)]
        return [mpirun, "-np", str(ranks)] + env + cmd, "self-bound (numactl not installed)"
    placements = plan_ranks(topo, ranks)
    # NOTE: fewer ranks than nodes: each rank spans a group of whole nodes (1 rank: all of them), its
    # memory interleaved over them, as numa-launch places them
    how = "; ".join(f"rank {p.rank}: {nodes_phrase(p.all_nodes)}" if len(p.all_nodes) > 1 else
                    f"rank {p.rank}: node {p.node} cpus {format_cpulist(p.cpus)}" for p in placements)
    if any(len(p.mem_nodes) > 1 for p in placements):
        how += ", memory interleaved over each rank's nodes"
    return build_command(placements, cmd, mpirun, numactl, with_membind=topo.from_sysfs), how


def dram_read_gbps_all_cores(topo, quick: bool) -> tuple[float, list[float]]:
    """bench/limits.py dram_read_gbps on each node, bound to it with all its cpus; summed."""
    code = ("import sys; sys.path.insert(0, %r); from bench.limits import dram_read_gbps; "
            "print(dram_read_gbps(num_threads=%%d, gib=%s, repeats=%d))"
            % (ROOT, 0.25 if quick else 1.0, 3 if quick else 5))
    numactl = shutil.which("numactl")
    per_node = []
    for node in topo.nodes:
        mem = [f"--membind={node.mem_node}"] if node.mem_node is not None else []
        # NOTE: cpus by list: numactl refuses --cpunodebind of a node without memory, and a cpuset may
        # hold only some of the node's cpus
        bind = [numactl, "--physcpubind=" + format_cpulist(node.cpus)] + mem if numactl and topo.from_sysfs else []
        p = subprocess.run(bind + [sys.executable, "-c", code % node.num_cpus], capture_output=True,
                           text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS=str(node.num_cpus)))
        if p.returncode != 0:
            raise SystemExit("numa_scaling: measuring DRAM bandwidth failed:\n" + p.stderr[-2000:])
        per_node.append(float(p.stdout.split()[-1]))
    return sum(per_node), per_node


def run_config(ranks: int, mode: str, a, topo, mpirun: str) -> dict:
    child_cfg = {"model": a.model, "dtype": a.dtype, "max_model_len": a.max_model_len,
                 "kv_cache_memory": a.kv_cache_memory, "concurrency": a.concurrency,
                 "data_parallel": ranks if mode == "dp" else 1,
                 "max_batched_tokens": 2048, "decode_prompt": 16, "decode_tokens": a.decode_tokens,
                 "repeats": a.repeats, "conc_prompt": a.conc_prompt, "conc_tokens": a.conc_tokens}
    argv, how = launch_argv(ranks, [sys.executable, CHILD, json.dumps(child_cfg)], mpirun, topo)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MPI4PY_RC_THREAD_LEVEL="funneled")
    env.pop("AS_PROFILE", None)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"ranks": ranks, "mode": mode, "error": f"timed out after {a.timeout} s", "binding": how}
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr + p.stdout).strip().splitlines()[-5:]
        return {"ranks": ranks, "mode": mode, "error": f"exit {p.returncode}: " + " | ".join(tail),
                "binding": how}
    res = json.loads(lines[-1][len("RESULT "):])
    res.update(mode=mode, binding=how, wall_s=time.perf_counter() - t0)
    return res


def model_and_bytes(model: str, dtype: str):
    """(ModelConfig, weight bytes one decode step reads) of a model directory or a GGUF file
    (its file's bytes: the tensors as stored); SystemExit in one sentence for a bad one."""
    from numa_runtime.config import ModelConfig, UnsupportedModelError
    try:
        from numa_runtime.gguf_model import gguf_shards, model_dir_of
        mcfg = ModelConfig.from_dir(model_dir_of(model))
        if model.lower().endswith(".gguf"):
            return mcfg, sum(os.path.getsize(f) for f in gguf_shards(model))
    except (OSError, ValueError, UnsupportedModelError) as e:
        raise SystemExit(f"numa_scaling: --model {model}: {str(e).rstrip('.')}.") from None
    return mcfg, weights_bytes_per_token(mcfg, dtype)


def why_skipped(ranks: int, mode: str, a, num_cpus: int) -> str | None:
    from numa_runtime.config import UnsupportedModelError
    from numa_runtime.sharding import ShardLayout
    if ranks > num_cpus:
        return f"{ranks} ranks need at least {ranks} cpus, this process may use {num_cpus}"
    try:
        ShardLayout.build(a.model_config, 0, ranks if mode == "tp" else 1)
    except UnsupportedModelError as e:
        return str(e)
    return None


def crossover(configs: list[dict]) -> list[dict]:
    """Per rank count run in both modes: tok/s by concurrency level, and the lowest level from
    which the replicas (dp) are at least as fast as one tensor-parallel model (tp) at every
    higher level (None: never)."""
    out = []
    for n in sorted({c["ranks"] for c in configs}):
        by_mode = {c["mode"]: c["conc_tps_by_level"] for c in configs
                   if c["ranks"] == n and "conc_tps_by_level" in c}
        if set(by_mode) != {"tp", "dp"}:
            continue
        levels = sorted(by_mode["tp"], key=int)
        wins = [by_mode["dp"][k] >= by_mode["tp"][k] for k in levels]
        first = next((int(k) for i, k in enumerate(levels) if all(wins[i:])), None)
        out.append({"ranks": n, "tp": by_mode["tp"], "dp": by_mode["dp"], "dp_wins_from": first})
    return out


# ----------------------------------------------------------------------------- report
def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"model `{r['model']}` ({r['dtype']}), {m['cpus']} cpus on {m['numa_nodes']} NUMA node(s); "
             f"DRAM read {m['dram_read_gbps']:.1f} GB/s, weights read per token "
             f"{r['weight_bytes_per_token'] / 1e6:.3g} MB, decode limit {r['decode_limit_tps']:.1f} tok/s"
             + (" (--quick: noisy)" if r["quick"] else ""), "",
             f"| ranks | mode | threads/rank | decode tok/s | decode % of limit | conc{r['concurrency']} tok/s | "
             "comm share decode | comm share conc | RSS MB per rank (anon) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    for c in r["configs"]:
        if "skipped" in c or "error" in c:
            lines.append(f"| {c['ranks']} | {c['mode']} | - | - | - | - | - | - | "
                         f"{'skipped' if 'skipped' in c else 'error'} |")
            notes.append(f"- {c['ranks']} ranks ({c['mode']}): {c.get('skipped') or c.get('error')}")
            continue
        rss = " / ".join(f"{x:.0f} ({y:.0f})" for x, y in zip(c["rss_mb_per_rank"], c["rss_anon_mb_per_rank"]))
        lines.append(f"| {c['ranks']} | {c['mode']} | {c['threads_per_rank']} | {c['decode_tps']:.1f} | "
                     f"{c['decode_fraction_of_limit']:.0%} | {c['conc_tps']:.1f} | "
                     f"{c['decode_comm_share']:.1%} | {c['conc_comm_share']:.1%} | {rss} |")
    for x in r.get("crossover", []):
        tps = ", ".join(f"c{k}: tp {x['tp'][k]:.1f} / dp {x['dp'][k]:.1f}" for k in sorted(x["tp"], key=int))
        notes.append(f"- {x['ranks']} ranks, output tok/s by concurrency: {tps}; replicas win from "
                     + (f"concurrency {x['dp_wins_from']}" if x["dp_wins_from"] is not None else "no level measured"))
    notes += [f"- {r['plot']}"] if r.get("plot") else []
    return "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def plot(r: dict, path: str) -> str:
    """OUT.png: decode and conc tok/s against ranks, decode % of limit on a second axis."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (scripts/install.sh installs it; or pip install matplotlib)"
    ok = [c for c in r["configs"] if "decode_tps" in c]
    if not ok:
        return "no plot: no configuration ran"
    xs = sorted({c["ranks"] for c in ok})
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("tp", "dp"):  # the 1-rank run belongs to both lines
        run = [c for c in ok if c["mode"] == mode or c["ranks"] == 1]
        if not any(c["mode"] == mode for c in run):
            continue
        ax.plot([c["ranks"] for c in run], [c["decode_tps"] for c in run], "o-", label=f"{mode}: decode, batch 1")
        ax.plot([c["ranks"] for c in run], [c["conc_tps"] for c in run], "s-",
                label=f"{mode}: concurrency {r['concurrency']}")
    ax.axhline(r["decode_limit_tps"], ls="--", c="gray", label="decode limit (DRAM)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(f"ranks ({r['machine']['cpus']} cpus split evenly)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(os.path.basename(r["model"].rstrip("/")) + " " + r["dtype"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16],
                    help="concurrency levels of the throughput runs (the largest gives the table's column)")
    ap.add_argument("--modes", nargs="+", choices=["tp", "dp"], default=["tp"],
                    help="tp: one model over the ranks; dp: one replica per rank (the data-parallel side)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few tokens, small probes")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    ap.add_argument("--out", default="/tmp/numa_scaling", help="writes OUT.json, OUT.md, OUT.png")
    a = ap.parse_args()
    a.concurrency = sorted(set(a.concurrency))
    if min(a.ranks) < 1 or min(a.concurrency, default=1) < 1:
        ap.error("--ranks and --concurrency take positive numbers")
    a.decode_tokens, a.repeats = (16, 2) if a.quick else (128, 3)
    a.conc_prompt, a.conc_tokens = (16, 8) if a.quick else (128, 64)
    a.max_model_len = max(a.conc_prompt, 16) + max(a.conc_tokens, a.decode_tokens) + 16
    a.kv_cache_memory = (32 if a.quick else 512) << 20
    a.model = resolve_model(a.model, a.shape or ("tiny" if a.quick else "qwen0.5b"))
    mpirun = find_mpirun()
    if mpirun is None:
        raise SystemExit("numa_scaling: mpirun not found: pip install mpich mpi4py.")
    a.model_config, wbytes = model_and_bytes(a.model, a.dtype)  # NOTE: a bad model fails before the probe
    topo = read_topology()
    cpus = sum(n.num_cpus for n in topo.nodes)
    gbps, per_node = dram_read_gbps_all_cores(topo, a.quick)
    limit = gbps * 1e9 / wbytes
    print(f"{cpus} cpus, {topo.num_nodes} node(s), DRAM read {gbps:.1f} GB/s, "
          f"decode limit {limit:.1f} tok/s", flush=True)
    configs = []
    for n in a.ranks:
        for mode in (["tp"] if n == 1 else a.modes):  # NOTE: one rank is both modes
            skip = why_skipped(n, mode, a, cpus)
            res = {"ranks": n, "mode": mode, "skipped": skip} if skip else run_config(n, mode, a, topo, mpirun)
            if "decode_tps" in res:
                res["decode_fraction_of_limit"] = res["decode_tps"] / limit
            configs.append(res)
            print(f"  {n} ranks ({mode}): " + json.dumps({k: v for k, v in res.items() if k != "binding"}),
                  flush=True)
    report = {"quick": a.quick, "model": a.model, "dtype": a.dtype, "concurrency": a.concurrency[-1],
              "concurrency_levels": a.concurrency, "crossover": crossover(configs),
              "machine": {"cpus": cpus, "numa_nodes": topo.num_nodes, "dram_read_gbps": gbps,
                          "dram_read_gbps_per_node": per_node},
              "weight_bytes_per_token": wbytes, "decode_limit_tps": limit,
              "settings": {k: getattr(a, k) for k in ("decode_tokens", "repeats", "conc_prompt",
                                                      "conc_tokens", "max_model_len", "kv_cache_memory")},
              "configs": configs}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)  # NOTE: the plot is written first
    report["plot"] = plot(report, a.out + ".png")
    md = markdown(report)
    paths = write_report(a.out, report, md)
    print("\n" + md + "\nwrote " + ", ".join(paths))


if __name__ == "__main__":
    main()
