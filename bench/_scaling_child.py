"""One configuration of bench/numa_scaling.py; every rank runs this under mpirun.

    mpirun ... python bench/_scaling_child.py '{"model": DIR, "dtype": "bfloat16", ...}'

Every rank: times the communicator's all_reduce_ / all_gather / broadcast_plan (class methods
wrapped before the Engine exists), builds the Engine, and reports its RSS after loading with
comm.gather_object. Rank 0 then measures decode at batch 1 and output throughput at each
concurrency level and prints one line "RESULT {json}". cfg["data_parallel"]: model replicas
(None: the engine's default rule).
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMM_TIME = {"all_reduce": 0.0, "all_gather": 0.0, "broadcast_plan": 0.0}  # seconds, this rank


def _timed(name, fn):
    clock = time.perf_counter

    def call(self, *args, **kwargs):
        t = clock()
        try:
            return fn(self, *args, **kwargs)
        finally:
            COMM_TIME[name] += clock() - t
    return call


def instrument() -> None:
    """Wrap the collectives of every communicator class."""
    from numa_runtime import distributed
    for cls in (distributed.MPIComm, distributed.SingleProcessComm):
        cls.all_reduce_ = _timed("all_reduce", cls.all_reduce_)
        cls.all_gather = _timed("all_gather", cls.all_gather)
        cls.broadcast_plan = _timed("broadcast_plan", cls.broadcast_plan)


def _rss_mb() -> tuple[float, float]:
    """(RSS, RSS less file-backed pages) in MiB: the second leaves out the mmapped checkpoint."""
    import psutil
    m = psutil.Process().memory_info()
    return m.rss / 2**20, (m.rss - getattr(m, "shared", 0)) / 2**20


def timed_steps(eng, fn) -> dict:
    """Run fn() (which steps the engine); returns wall seconds and rank 0's collective seconds."""
    before = dict(COMM_TIME)
    t0 = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t0
    comm = {k: COMM_TIME[k] - before[k] for k in COMM_TIME}
    return {"result": result, "wall_s": wall, "comm_s": comm,
            "comm_share": (comm["all_reduce"] + comm["all_gather"]) / wall if wall > 0 else 0.0,
            "bcast_share": comm["broadcast_plan"] / wall if wall > 0 else 0.0}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    instrument()
    import numpy as np
    from numa_runtime import Engine, SamplingParams
    levels = cfg["concurrency"]  # list of concurrency levels
    eng = Engine(cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
                 kv_cache_memory=cfg["kv_cache_memory"], max_num_seqs=max(levels),
                 max_num_batched_tokens=cfg["max_batched_tokens"], data_parallel=cfg.get("data_parallel"))
    rss = eng.comm.gather_object(_rss_mb())  # every rank: RSS after loading
    if not eng.is_driver:
        eng.serve_workers()  # execute rank 0's steps until it closes the engine
        return
    vocab = eng.model_config.vocab_size
    rng = np.random.default_rng(0)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prompt = lambda n: rng.integers(3, vocab, n).tolist()

    def decode():
        eng.add_request(prompt(cfg["decode_prompt"]), greedy(cfg["decode_tokens"] + 1))
        eng.step()  # prefill and the first token: not decode
        return timed_steps(eng, lambda: [eng.step() for _ in iter(eng.has_unfinished_requests, False)])

    eng.generate([prompt(cfg["decode_prompt"])], greedy(4))  # warm-up
    runs = [decode() for _ in range(cfg["repeats"])]
    best = min(runs, key=lambda r: r["wall_s"])
    by_level = {}
    for n in levels:  # the last (largest) level's run gives the comm shares
        conc_prompts = [prompt(cfg["conc_prompt"]) for _ in range(n)]
        conc = timed_steps(eng, lambda: eng.generate(conc_prompts, greedy(cfg["conc_tokens"])))
        by_level[str(n)] = n * cfg["conc_tokens"] / conc["wall_s"]
    result = {
        "ranks": eng.comm.world_size, "threads_per_rank": eng.num_threads,
        "data_parallel": eng.parallel.data_parallel, "conc_tps_by_level": by_level,
        "placement": None if eng.placement is None else {"node": eng.placement.node, "how": eng.placement.how},
        "decode_tps": cfg["decode_tokens"] / best["wall_s"],
        "decode_comm_share": best["comm_share"], "decode_bcast_share": best["bcast_share"],
        "decode_comm_s": best["comm_s"],
        "conc_tps": by_level[str(levels[-1])],
        "conc_comm_share": conc["comm_share"], "conc_bcast_share": conc["bcast_share"],
        "rss_mb_per_rank": [r[0] for r in rss], "rss_anon_mb_per_rank": [r[1] for r in rss],
    }
    eng.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
