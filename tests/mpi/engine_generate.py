"""Run under mpirun: every rank builds the Engine; rank 0 generates and prints JSON.

usage: mpirun -np N python tests/mpi/engine_generate.py MODEL_DIR DTYPE MAX_TOKENS PROMPTS_JSON [DATA_PARALLEL]
"""
import json
import sys

from numa_runtime import Engine, SamplingParams

model, dtype, max_tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
dp = {"data_parallel": int(sys.argv[5])} if len(sys.argv) > 5 else {}
eng = Engine(model, dtype=dtype, kv_cache_memory=1 << 24, max_model_len=256, **dp)
# every rank gets here; on a worker rank generate() serves rank 0 and ends the process
outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
print("RESULT " + json.dumps({"world": eng.comm.world_size, "tokens": [list(o.token_ids) for o in outs],
                              "kv_blocks": eng.summary().get("kv_blocks"),
                              "data_parallel": eng.summary()["data_parallel"],
                              "routed": eng.scheduler.stats().get("routed"),
                              "per_rank": eng.summary()["per_rank"]}), flush=True)
eng.close()
