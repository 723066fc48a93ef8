"""Run under mpirun: every rank loads the model quantized; rank 0 generates and prints JSON.

usage: mpirun -np N python tests/mpi/quant_generate.py MODEL QUANTIZATION PROMPTS_JSON [LM_HEAD [PREFILL]]

PREFILL (bf16 or int8): a bfloat16 engine with that prefill_activations; else float32.
"""
import json
import sys

from numa_runtime import Engine, SamplingParams

model, quantization, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
head = sys.argv[4] if len(sys.argv) > 4 else "auto"
prefill = sys.argv[5] if len(sys.argv) > 5 else None
kw = {"dtype": "float32"} if prefill is None else {"dtype": "bfloat16", "prefill_activations": prefill}
eng = Engine(model, kv_cache_memory=1 << 23, max_model_len=128,
             quantization=None if quantization == "none" else quantization,
             lm_head_quantization=None if head == "none" else head, **kw)
outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0))
model = eng.runner.model
down = model.layers[0].down_proj
print("RESULT " + json.dumps({"world": eng.comm.world_size, "tokens": [list(o.token_ids) for o in outs],
                              "logprobs": [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.token_ids)]
                                           for o in outs],
                              "o_act8": getattr(model.layers[0].o_proj, "act8", None),
                              "mlp_columns": [model.lay.inter.start, model.lay.inter.stop],
                              "down_ks": getattr(down, "ks", None)}), flush=True)
eng.close()
