"""`python -m numa_runtime "question"`: chat with a model (the built-in default if none given)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m numa_runtime", description=__doc__)
    ap.add_argument("prompt", nargs="?", default="What is the capital of France?")
    ap.add_argument("--model", default=None,
                    help="Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--raw", action="store_true", help="complete the prompt instead of chatting")
    args = ap.parse_args(argv)
    from numa_runtime import Engine, SamplingParams
    try:
        # NOTE: the sampling values first: a bad one is one sentence before the model loads
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        eng = Engine(args.model, dtype=args.dtype)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not eng.is_driver:  # under mpirun: a worker rank executes rank 0's steps
        eng.serve_workers()
        return 0
    try:
        if args.raw:
            prompt = args.prompt
        else:
            prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        print(f">>> {args.prompt}", flush=True)
        for delta in eng.stream(eng.tokenizer.encode(prompt, add_special_tokens=args.raw), params):
            print(delta, end="", flush=True)
        print()
    except ValueError as e:  # NOTE: e.g. --max-tokens past the context
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
