"""Run under mpirun with AS_PROFILE=ON: generate, read the profile, reset, generate, trace;
prompt logprobs and an embedding, and a trace of the last step (TRACE_PATH.last).

usage: mpirun -np N python tests/mpi/profile_run.py MODEL_DIR BACKEND TOKENS_A TOKENS_B TRACE_PATH
Rank 0 prints one line: RESULT {"world", "stats_a", "stats_b", "report", "trace"}.
"""
import json
import sys

from numa_runtime import Engine, SamplingParams

model, backend, tokens_a, tokens_b, trace = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
eng = Engine(model, dtype="float32", backend=backend, kv_cache_memory=1 << 24, max_model_len=256)
# every rank gets here; on a worker rank generate() serves rank 0 (steps and profile
# requests) and ends the process
prompts = [[1, 17, 42, 99, 5], list(range(3, 30))]
eng.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens_a, ignore_eos=True))
stats_a = eng.get_op_profiling_stats()
report = eng.get_op_profiling_info()
eng.reset_op_profiling()
eng.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens_b, ignore_eos=True))
stats_b = eng.get_op_profiling_stats()
eng.export_chrome_trace(trace, steps=2)
# forwards outside the engine's steps (an embedding, prompt logprobs): a step each on every rank
eng.prompt_logprobs(list(range(3, 20)))
eng.embed([list(range(3, 12))])
eng.export_chrome_trace(trace + ".last", steps=1)
print("RESULT " + json.dumps({"world": eng.comm.world_size, "stats_a": stats_a, "stats_b": stats_b,
                              "report": report, "trace": trace}), flush=True)
eng.close()
