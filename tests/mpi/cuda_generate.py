"""Run under mpirun: every rank builds a device="cuda" Engine; rank 0 generates and prints JSON.

usage: mpirun -np N python tests/mpi/cuda_generate.py MODEL_DIR DTYPE MAX_TOKENS PROMPTS_JSON
"""
import json
import sys

from numa_runtime import Engine, SamplingParams

model, dtype, max_tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
eng = Engine(model, dtype=dtype, device="cuda", kv_cache_memory=1 << 22, max_model_len=256,
             max_num_seqs=8, data_parallel=1)
# every rank gets here; on a worker rank generate() serves rank 0 and ends the process
outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
print("RESULT " + json.dumps({"world": eng.comm.world_size, "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
eng.close()
