"""Run under mpirun on one host: rank 0 generates, stays idle for INTERVAL seconds while it
measures the cpu time of the worker ranks (its sibling processes), then generates again.

usage: mpirun -np N python tests/mpi/idle_workers.py MODEL_DIR INTERVAL
prints "RESULT {json}" with the workers' cpu seconds over the idle interval and the tokens."""
import json
import sys
import time

import psutil

from numa_runtime import Engine, SamplingParams

model, interval = sys.argv[1], float(sys.argv[2])
eng = Engine(model, dtype="float32", kv_cache_memory=1 << 24, max_model_len=128)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
before = eng.generate([[1, 2, 3]], params)[0].token_ids
me = psutil.Process()
workers = [p for p in me.parent().children() if p.pid != me.pid]  # mpirun's proxy starts the ranks


def cpu_seconds() -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in workers)


c0, t0 = cpu_seconds(), time.monotonic()
time.sleep(interval)  # NOTE: the observation window itself (rank 0 idle), not a wait for a condition
c1, t1 = cpu_seconds(), time.monotonic()
after = eng.generate([[1, 2, 3]], params)[0].token_ids
print("RESULT " + json.dumps({"world": eng.comm.world_size, "workers": len(workers),
                              "cpu_s": c1 - c0, "wall_s": t1 - t0, "before": before, "after": after}),
      flush=True)
eng.close()
