"""Run under mpirun: every rank builds the Engine; rank 0 generates and prints JSON.

usage: mpirun -np N python tests/mpi/engine_generate.py MODEL_DIR DTYPE MAX_TOKENS PROMPTS_JSON [DATA_PARALLEL]
       [KEY=VALUE ...] (more Engine options, e.g. kv_cache_dtype=int8)
"""
import json
import sys

from numa_runtime import Engine, SamplingParams

model, dtype, max_tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
kw = {}
for arg in sys.argv[5:]:
    key, _, value = arg.rpartition("=")
    kw[key or "data_parallel"] = int(value) if value.isdigit() else value
eng = Engine(model, dtype=dtype, kv_cache_memory=1 << 24, max_model_len=256, **kw)
# every rank gets here; on a worker rank generate() serves rank 0 and ends the process
outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
print("RESULT " + json.dumps({"world": eng.comm.world_size, "tokens": [list(o.token_ids) for o in outs],
                              "kv_blocks": eng.summary().get("kv_blocks"),
                              "kv_cache_dtype": eng.summary()["kv_cache_dtype"],
                              "data_parallel": eng.summary()["data_parallel"],
                              "routed": eng.scheduler.stats().get("routed"),
                              "per_rank": eng.summary()["per_rank"]}), flush=True)
eng.close()
