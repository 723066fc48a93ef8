"""Run under mpirun: every rank loads the model quantized; rank 0 generates and prints JSON.

usage: mpirun -np N python tests/mpi/quant_generate.py MODEL QUANTIZATION PROMPTS_JSON [LM_HEAD]
"""
import json
import sys

from numa_runtime import Engine, SamplingParams

model, quantization, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
head = sys.argv[4] if len(sys.argv) > 4 else "auto"
eng = Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128,
             quantization=None if quantization == "none" else quantization,
             lm_head_quantization=None if head == "none" else head)
outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
print("RESULT " + json.dumps({"world": eng.comm.world_size, "tokens": [list(o.token_ids) for o in outs]}),
      flush=True)
eng.close()
