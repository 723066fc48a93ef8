"""Run under mpirun: what code after Engine() does on each rank (README "Worker ranks").

usage: mpirun -np N python tests/mpi/worker_ranks.py MODEL_DIR plain|explicit|plain-twice|explicit-twice

plain:    a script written for one process: Engine(), generate(), print, close().
explicit: `with Engine() as eng:` drives on rank 0 only; every rank goes on after the block.
*-twice:  the same, then a second Engine (the plain script's workers have exited by then).
ctrl-c:   rank 0 generates until interrupted.
ctrl-c-in-report-and-close: (AS_PROFILE=ON) a Ctrl-C on rank 0 inside a profiling report and inside close().
new-while-served: a second Engine() while the workers run the first one's steps.
driver-only-twice: only rank 0 drives and closes; a worker's script ends (its engine closes at
          exit) and rank 0 then makes a second Engine.
Each rank writes "MARK <where> rank <r>" lines, one write each (ranks must not interleave).
"""
import os
import sys

from numa_runtime import Engine, SamplingParams

model, mode = sys.argv[1], sys.argv[2]
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def mark(where: str, rank: int, extra: str = "") -> None:
    os.write(1, f"MARK {where} rank {rank}{extra}\n".encode())


if mode == "ctrl-c":  # rank 0 generates until the test sends SIGINT to mpirun
    eng = Engine(model, dtype="float32", kv_cache_memory=1 << 24, max_model_len=128)
    if eng.is_driver:
        mark("generating", 0)
        while True:
            eng.generate([[1, 5, 9]] * 4, SamplingParams(max_tokens=100, ignore_eos=True))
    sys.exit(0)

if mode == "ctrl-c-in-report-and-close":  # AS_PROFILE=ON: a Ctrl-C on rank 0 between a plan and its gather
    import signal
    eng = Engine(model, dtype="float32", kv_cache_memory=1 << 24, max_model_len=128)
    if not eng.is_driver:
        eng.serve_workers()
        mark("served", eng.comm.rank)
        sys.exit(0)
    first = eng.generate([[1, 5, 9]], params)[0].token_ids
    rec, answer = eng._profile.recorder, eng._profile.recorder.answer
    rec.answer = lambda action: signal.raise_signal(signal.SIGINT) or answer(action)  # NOTE: the plan went out
    try:
        eng.get_op_profiling_info()
    except KeyboardInterrupt:
        mark("report-interrupted", 0)
    rec.answer = answer
    mark("same-tokens", 0, f" {eng.generate([[1, 5, 9]], params)[0].token_ids == first}")
    shutdown = eng.runner.shutdown_workers
    eng.runner.shutdown_workers = lambda: shutdown() or signal.raise_signal(signal.SIGINT)  # NOTE: before the gather
    try:
        eng.close()
    except KeyboardInterrupt:
        mark("close-interrupted", 0)
    mark("closed", 0)
    sys.exit(0)

if mode == "vllm-habits":  # lines before the first driving call run on every rank, as in one process
    eng = Engine(model, dtype="float32", kv_cache_memory=1 << 24, max_model_len=128)
    sp = eng.get_default_sampling_params()
    sp.max_tokens, sp.temperature, sp.ignore_eos = 4, 0.0, True
    info, busy = eng.summary(), eng.has_unfinished_requests()
    eng.abort_request("nothing")
    mark("before", eng.comm.rank, f" kv_blocks {info['kv_blocks'] is not None} busy {busy}")
    mark("after-generate", eng.comm.rank, f" tokens {eng.generate([[1, 5, 9]], sp)[0].token_ids}")
    eng.close()
    sys.exit(0)

if mode == "two-live":  # two engines alive at once; the workers run the first one driven
    a = Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)
    b = Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)
    mark("after-engines", a.comm.rank)
    a.generate([[1, 5, 9]], params)  # a worker serves a here, then exits
    for what in ("refused", "refused-after-close"):
        try:
            b.generate([[1, 5, 9]], params)
            mark("ran", 0)
        except RuntimeError as e:
            mark(what, 0, f" {e}")
        a.close()
    b.close()
    sys.exit(0)

if mode == "new-while-served":  # a second Engine made while the workers run the first one's steps
    a = Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)
    a.generate([[1, 5, 9]], params)  # a worker serves a here, then exits
    try:
        Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)
        mark("made", 0)
    except RuntimeError as e:
        mark("refused", 0, f" {e}")
    mark("same", 0, f" {a.generate([[1, 5, 9]], params)[0].token_ids == a.generate([[1, 5, 9]], params)[0].token_ids}")
    a.close()
    sys.exit(0)

if mode == "close-the-other":  # two engines; the one never driven is closed while the workers run the other
    a = Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)
    b = Engine(model, dtype="float32", kv_cache_memory=1 << 23, max_model_len=128)
    first = a.generate([[1, 5, 9]], params)[0].token_ids  # a worker serves a here, then exits
    b.close()
    mark("again", 0, f" same {a.generate([[1, 5, 9]], params)[0].token_ids == first}")
    a.close()
    sys.exit(0)

if mode == "driver-only-twice":
    eng = Engine(model, dtype="float32", kv_cache_memory=1 << 24, max_model_len=128)
    if eng.is_driver:
        mark("driving", 0, f" tokens {eng.generate([[1, 5, 9]], params)[0].token_ids}")
        eng.close()
        try:
            Engine(model, dtype="float32", kv_cache_memory=1 << 24, max_model_len=128)
        except RuntimeError as e:
            mark("refused", 0, f" {e}")
    sys.exit(0)

for round_ in range(2 if mode.endswith("-twice") else 1):
    if mode.startswith("plain"):
        try:
            eng = Engine(model, dtype="float32", kv_cache_memory=1 << 24, max_model_len=128)
        except RuntimeError as e:  # NOTE: the second round, on rank 0 alone
            mark("refused", 0, f" {e}")
            break
        mark("after-engine", eng.comm.rank)
        out = eng.generate([[1, 5, 9]], params)  # a worker serves rank 0 here, then exits
        mark("after-generate", eng.comm.rank, f" tokens {out[0].token_ids}")
        eng.close()
    else:
        with Engine(model, dtype="float32", kv_cache_memory=1 << 24, max_model_len=128) as eng:
            mark("in-with", eng.comm.rank)
            if eng.is_driver:
                mark("driving", eng.comm.rank, f" tokens {eng.generate([[1, 5, 9]], params)[0].token_ids}")
        mark("after-with", eng.comm.rank)
