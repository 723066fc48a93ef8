"""Run under mpirun: every rank builds a device="cuda" Engine; rank 0 generates and prints JSON.

usage: mpirun -np N python tests/mpi/cuda_generate.py MODEL_DIR MAX_TOKENS PROMPTS_JSON [KV_BYTES HOST_KV_BYTES
       [MAX_MODEL_LEN]]
With KV_BYTES and HOST_KV_BYTES the prompts run one at a time, twice over (so that a small GPU
pool evicts them to the host tier and the second round brings them back). DATA_PARALLEL=D in the
environment: D replicas; AS_PROFILE=ON: rank 0 also gathers the operator profile of every rank.
"""
import json
import os
import sys

from numa_runtime import Engine, SamplingParams

model, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
kv, host = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (1 << 22, 0)
max_len = int(sys.argv[6]) if len(sys.argv) > 6 else 256  # NOTE: no more than the pool holds
eng = Engine(model, dtype="float32", device="cuda", kv_cache_memory=kv, host_kv_cache_memory=host,
             max_model_len=max_len, max_num_seqs=8, data_parallel=int(os.environ.get("DATA_PARALLEL", "1")))
params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
# every rank gets here; on a worker rank generate() serves rank 0 and ends the process
if host:
    outs = [eng.generate([p], params)[0] for _ in range(2) for p in prompts]
else:
    outs = eng.generate(prompts, params)
tier = getattr(eng.runner, "local", eng.runner).host_tier
report = eng.get_op_profiling_info() if os.environ.get("AS_PROFILE") == "ON" else ""
print("RESULT " + json.dumps({"world": eng.comm.world_size, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                              "restored": tier.num_restored if tier else 0, "profile": report}), flush=True)
eng.close()
