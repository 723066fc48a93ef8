"""Run under mpirun: an Engine with a disk tier generates the prompts one by one, then closes
(writing its cache to disk). Rank 0 prints JSON with the tokens and the blocks read from disk.

usage: mpirun -np N python tests/mpi/disk_tier_restart.py MODEL_DIR CACHE_DIR PROMPTS_JSON
"""
import json
import sys

from numa_runtime import Engine, SamplingParams

model, cache_dir, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
eng = Engine(model, dtype="float32", kv_cache_memory=6 * 4096, max_model_len=96,
             kv_cache_dir=cache_dir, kv_cache_disk_load="always")
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
outs = [list(eng.generate([p], params)[0].outputs[0].token_ids) for p in prompts]
print("RESULT " + json.dumps({"tokens": outs, "tier_hits": eng.block_manager.tier_hit_blocks}), flush=True)
eng.close()
