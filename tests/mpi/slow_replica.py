"""Run under mpirun -np 2 with NUMA_RUNTIME_COLLECTIVE_TIMEOUT=T: two replicas of one rank.
Replica 0 gets a one-token request, replica 1 a long prompt in chunks: once replica 0 is idle,
rank 0 sends replica 1 the rest of the prompt's chunks at once and waits for the last one's
logits, a wait longer than T (each chunk well within it): the job must not stop. Prints
RESULT {tokens, seconds, routed}.

usage: mpirun -np 2 python tests/mpi/slow_replica.py MODEL_DIR PROMPT_TOKENS CHUNK
"""
import json
import sys
import time

from numa_runtime import Engine, SamplingParams

model, n, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
e = Engine(model, dtype="float32", max_model_len=n + 64, num_threads=1, data_parallel=2,
           max_num_batched_tokens=chunk, enable_prefix_caching=False)
prompts = [[5, 6, 7], [(7 * i) % 300 + 3 for i in range(n)]]
params = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)]
t0 = time.perf_counter()
# every rank gets here; on rank 1 generate() serves rank 0 and ends the process
outs = e.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - t0
print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
                              "routed": e.scheduler.stats().get("routed")}), flush=True)
e.close()
