"""Run under mpirun with NUMA_RUNTIME_COLLECTIVE_TIMEOUT set low: rank 0 generates, stops a
worker rank (SIGSTOP: a hung process, which mpiexec does not see die), then ACTION: 'generate'
again or 'close' the engine. The job must stop with a line that says why, not hang.

usage: mpirun -np N python tests/mpi/stuck_worker.py MODEL_DIR ACTION [DATA_PARALLEL [RANK]]
(RANK: the rank stopped, the last by default)"""
import os
import signal
import sys

from numa_runtime import Engine, SamplingParams

model, action = sys.argv[1], sys.argv[2]
dp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
e = Engine(model, dtype="float32", kv_cache_memory=1 << 22, max_model_len=128, num_threads=1, data_parallel=dp)
pids = e.comm.gather_object(os.getpid())
if not e.is_driver:
    e.serve_workers()
    e.close()
    sys.exit(0)
greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
print("first", [list(o.outputs[0].token_ids) for o in e.generate([[5, 6, 7], [8, 9]], greedy, use_tqdm=False)],
      flush=True)
stop = int(sys.argv[4]) if len(sys.argv) > 4 else len(pids) - 1
os.kill(pids[stop], signal.SIGSTOP)
print("stopped rank", stop, flush=True)
if action == "generate":
    e.generate([[5, 6, 7], [8, 9]], greedy, use_tqdm=False)
e.close()
print("NOT STOPPED", flush=True)
