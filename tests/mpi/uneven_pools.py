"""Run under mpirun with the ranks under different memory limits (ulimit -v): every rank sizes
its default KV pool from its own limit; rank 0 generates prompts that need more blocks than the
smallest pool holds at once. Prints one RESULT line per rank."""
import json
import os
import sys

from numa_runtime import Engine, SamplingParams

model = sys.argv[1]
e = Engine(model, dtype="float32", max_model_len=512, kv_cache_fraction=0.002, num_threads=1)
out = {"rank": e.comm.rank, "kv_blocks": e.runner.num_blocks}
if e.is_driver:
    prompts = [[(7 * i + j) % 200 + 3 for j in range(400)] for i in range(16)]
    res = e.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    out.update(used=e.block_manager.num_blocks, ranks=[r["kv_blocks"] for r in e.ranks],
               tokens=[len(r.outputs[0].token_ids) for r in res])
else:
    e.serve_workers()
e.close()
os.write(1, ("RESULT " + json.dumps(out) + "\n").encode())
