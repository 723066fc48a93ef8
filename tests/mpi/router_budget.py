"""Run under `mpirun -np 2`: each rank builds the multi-model router with its own default memory
budget (as ranks on hosts or cgroups of other sizes compute it), rank 1's the smaller. The
smallest must bind both ranks: the same budget, the same context for an unloaded model, and the
same verdict on an asked max_model_len. Each rank writes its result to OUT_DIR/rank<r>.json (two ranks'
lines on one stdout can interleave).

usage: mpirun -np 2 python tests/mpi/router_budget.py MODEL_DIR RANK_1_BUDGET MAX_MODEL_LEN OUT_DIR"""
import json
import os
import sys

from numa_runtime.serve.router import ModelRouter, ModelSpec, RouterConfig

rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
budget = 1 << 40 if rank == 0 else int(sys.argv[2])
kw = dict(dtype="float32", max_model_len=int(sys.argv[3]), num_threads=1)
out = {"rank": rank}
try:
    r = ModelRouter(RouterConfig((ModelSpec("alpha", sys.argv[1]),), budget, kw), comm_world=2, is_driver=rank == 0)
    out.update(budget=r.config.memory_budget, context=r.context_len("alpha"))
except ValueError as e:
    out["error"] = str(e)
with open(os.path.join(sys.argv[4], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
