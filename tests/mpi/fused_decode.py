"""Run under mpirun: a bf16 engine with quantized weights (NUMA_RUNTIME_FUSED_DECODE decides
how its decode steps run); rank 0 generates greedily and prints JSON.

usage: mpirun -np N python tests/mpi/fused_decode.py MODEL QUANTIZATION PROMPTS_JSON
"""
import json
import sys

from numa_runtime import Engine, SamplingParams

model, quantization, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
eng = Engine(model, dtype="bfloat16", kv_cache_memory=1 << 23, max_model_len=128, quantization=quantization)
outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
print("RESULT " + json.dumps({"world": eng.comm.world_size, "fused": eng.runner.model.fused is not None,
                              "tokens": [list(o.token_ids) for o in outs]}), flush=True)
eng.close()
