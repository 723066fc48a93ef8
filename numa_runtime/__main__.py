"""`python -m numa_runtime "question"`: chat with a model (the built-in default if none given)."""
from __future__ import annotations

import argparse
import os
import signal
import sys


def main(argv=None) -> int:
    from numa_runtime.env import RankZeroParser
    ap = RankZeroParser(prog="python -m numa_runtime", description=__doc__)
    ap.add_argument("prompt", nargs="?", default="What is the capital of France?")
    ap.add_argument("--model", default=None,
                    help="Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16", type=dtype_arg, help=DTYPE_HELP)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--raw", action="store_true", help="complete the prompt instead of chatting")
    args = ap.parse_args(argv)
    from numa_runtime import Engine, SamplingParams, env
    from numa_runtime.tokenizer import ChatTemplateError
    world = env.mpi_world() or (0, 1)
    lead = world[0] == 0  # NOTE: under mpirun one rank says what is wrong
    if lead:  # NOTE: a stop (SIGTERM) ends as Ctrl-C does: the answer so far stays, the workers end; as a
        # SIGINT, so that the engine holds it while a step runs (the ranks stay in step)
        signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    elif world[1] > 1:  # NOTE: mpirun forwards both to every rank; rank 0's close() ends the workers
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        # NOTE: the sampling values first: a bad one is one sentence before the model loads
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except ValueError as e:
        if lead:
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        eng = Engine(args.model, dtype=args.dtype)
    except KeyboardInterrupt:
        if lead:
            print("\ninterrupted while loading the model.", file=sys.stderr, flush=True)
        if world[1] > 1:
            env.abort_job(130)  # NOTE: the workers are in the load's collectives: they would wait for ever
        return 130
    except Exception as e:  # noqa: BLE001 - one sentence, not a traceback (MemoryError, another rank's)
        return env.load_failed(e, "")
    if not eng.is_driver:  # under mpirun: a worker rank executes rank 0's steps
        eng.serve_workers()
        return 0
    try:
        if args.raw:
            prompt = args.prompt
        else:
            prompt = eng.tokenizer.render_chat([{"role": "user", "content": args.prompt}])
        print(f">>> {args.prompt}", flush=True)
        for delta in eng.stream(eng.tokenizer.encode(prompt, add_special_tokens=args.raw), params):
            print(delta, end="", flush=True)
        print()
    except ChatTemplateError as e:
        print(f"error: {e}" if eng.tokenizer.has_chat_template else
              "error: this model has no chat template; pass --raw to complete the prompt as it is.", file=sys.stderr)
        return 2
    except ValueError as e:  # NOTE: e.g. --max-tokens past the context
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # NOTE: `... | head`: the reader is gone; no traceback, nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # NOTE: Ctrl-C: the answer so far stays, no traceback
        print(file=sys.stderr)
        return 130
    finally:
        eng.close()
    return 0


DTYPE_HELP = ("bfloat16 (default; 'auto' too, as vLLM's flag) or float32 ('float'); the weights compute in one "
              "of the two whatever the checkpoint stores")


def dtype_arg(value: str) -> str:
    """--dtype as vLLM spells it (config.compute_dtype: auto and bfloat16 are bfloat16, float and
    float32 float32; half / float16 refused in one sentence)."""
    from numa_runtime.config import compute_dtype
    try:
        return compute_dtype(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).rstrip(".")) from None


if __name__ == "__main__":
    sys.exit(main())
