"""`python -m numa_runtime.serve` / `numa-serve`: the OpenAI-compatible server.

Under mpirun every rank builds the Engine; worker ranks then execute rank 0's steps in
engine.serve_workers() until it shuts down, and rank 0 goes on to serve. The engine loop runs on
the main thread (the one that initialised MPI, as thread level "funneled" requires) and the HTTP
server on a second thread, behind the HTTP front (front.py): a process outside the MPI job that
holds the public socket, so that requests in flight get an answer even when mpirun kills rank 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import sys
import threading

from numa_runtime import env
from numa_runtime.config import LOGPROBS_MODES, POOLING_VALUES, RUNNER_VALUES
from numa_runtime.env import RankZeroParser
from numa_runtime.__main__ import DTYPE_HELP, dtype_arg
from numa_runtime.serve.tools import PARSERS
from numa_runtime.serve.reasoning import PARSERS as REASONING_PARSERS


class _Parser(RankZeroParser):
    def error(self, message):
        """One sentence (argparse prints the whole usage first); under mpirun, from rank 0 only."""
        self.exit(2, f"{self.prog}: error: {message[:1].lower()}{message[1:].rstrip('.')}; "
                     f"`{self.prog} --help` lists the flags.\n")


def _size(text: str) -> int:
    """A byte count: 16G, 512M, 1.5T or a plain number (powers of 1024)."""
    from .router import parse_bytes
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_REFUSED_VLLM: dict[str, str] = {}  # vLLM flag -> why it cannot mean the same here (check_args)
# NOTE: vLLM's runner flags: config.RUNNER_VALUES (parse_args' help, check_args), POOLING_VALUES (engine_kwargs)


def _json_list(flag: str):
    """An argparse type: a JSON list of strings (vLLM's --allowed-origins '["https://a.example"]')."""
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    ap = _Parser(prog="numa-serve", description="OpenAI-compatible HTTP server for numa_runtime.")
    ap.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                    help="the model, as vLLM's `vllm serve MODEL` (the same as --model MODEL)")
    ap.add_argument("--model", action="append", default=None,
                    help="Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct); "
                         "repeat it to serve several models, each named by its directory or file")
    ap.add_argument("--models-dir", default=None, help="serve every model directory and .gguf file inside this "
                                                         "directory")
    ap.add_argument("--memory-budget", default=None,
                    help="several models: bytes per rank for all weights and KV pools (e.g. 16G; default: 60%% "
                         "of this host's memory / ranks)")
    ap.add_argument("--load-timeout", type=float, default=None,
                    help="several models: seconds a request waits for its model to load before a 503 "
                         f"(default {_LOAD_TIMEOUT_S:g})")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on every endpoint but /health and /ping (several "
                         "keys: any of them; default: $VLLM_API_KEY, as vLLM)")
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="names clients send as `model` (default: the model directory's name); answers carry "
                         "the first (given twice, the last flag counts, as in vLLM)")
    ap.add_argument("--dtype", default="bfloat16", type=dtype_arg, help=DTYPE_HELP)
    ap.add_argument("--max-model-len", type=_model_len, default=None,
                    help="the context in tokens; as vLLM, 32k = 32000 and 32K = 32768 (m/M, g/G, t/T likewise); "
                         "auto or -1: the default (the model's, up to 32768, and what the KV cache holds)")
    ap.add_argument("--quantization", default=None,
                    help="quantize dense weights while loading: int8 (groups of 128), int4 (groups of "
                         "32 with a min), or e.g. int4-g128-sym, int8-channel; gguf, awq or gptq (as "
                         "vLLM) only check that the checkpoint holds that format")
    ap.add_argument("--lm-head-quantization", default="auto",
                    help="lm_head format when loading a dense checkpoint: auto (int8 when --quantization "
                         "is set, else as stored), none (as stored), or an int8 format such as int8-channel")
    ap.add_argument("--prefill-activations", default="bf16", choices=("bf16", "int8"),
                    help="prefill rows of quantized linears in a bf16 engine: bf16 (bf16 panels; the "
                         "default) or int8 blocks (integer dot products, as llama.cpp: faster with "
                         "AVX-512 VNNI, AMX-INT8 included; slightly less exact)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded side by side at most (default 64; vLLM's is 256)")
    ap.add_argument("--max-num-batched-tokens", type=human_int, default=None,
                    help="tokens one step computes at most (longer prompts are prefilled in chunks; "
                         "default 2048)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the KV blocks of earlier prompts' common prefixes (default on)")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block (default 16)")
    ap.add_argument("--seed", type=int, default=None,
                    help="the seed of the random draws of requests that give no seed (default 0)")
    ap.add_argument("--num-scheduler-steps", type=int, default=8,
                    help="greedy decode steps of up to 4 sequences, with no request waiting, run up to "
                         "this many steps per scheduling round (about 25 ms of decode at most; 1: off; default 8)")
    ap.add_argument("--max-queue", type=int, default=256, help="waiting sequences beyond which requests get 429 (default 256)")
    ap.add_argument("--max-request-bytes", type=_size, default=64 << 20,
                    help="the largest request body taken, e.g. 64M (the default) or 1G; a larger one gets 413")
    ap.add_argument("--kv-cache-memory", type=_size, default=None, help="KV cache bytes per rank (16G, 512M, ...)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32", "int8"],
                    help="KV cache element type: auto (as --dtype), or int8 (a scale per token and kv head: "
                         "about half the bytes of bf16, so about twice the tokens in the same memory)")
    ap.add_argument("--kv-cache-dir", default=None, help="keep evicted prefix-cache blocks in files here "
                                                         "(survives restarts)")
    ap.add_argument("--kv-cache-disk-bytes", type=_size, default=None,
                    help="size cap of --kv-cache-dir per rank and model configuration (default 8 GiB)")
    ap.add_argument("--kv-cache-disk-load", default=None, choices=["auto", "always"],
                    help="with --kv-cache-dir; auto (default): read blocks back only when that beats "
                         "recomputing them")
    ap.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                    help="auto (default): the model's generation_config.json sampling values (temperature, "
                         "top_p, top_k, min_p, repetition_penalty) are the defaults of requests that leave them "
                         "unset, as in vLLM; vllm: the OpenAI defaults")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="let tool_choice 'auto' (the default with tools) parse the model's calls from its text; "
                         "needs --tool-call-parser")
    ap.add_argument("--tool-call-parser", default=None, choices=list(PARSERS),
                    help="how the model writes tool calls: hermes (Qwen2.5/3, Hermes) or llama3_json (Llama 3.x)")
    ap.add_argument("--chat-template", default=None,
                    help="a Jinja chat template file, or the template itself, used instead of the model's (vLLM's)")
    ap.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                    help="chat replies' <think> part as reasoning_content: deepseek_r1 (DeepSeek-R1 distills, QwQ, "
                         "Qwen3 thinking-2507) or qwen3 (Qwen3 hybrid models)")
    ap.add_argument("--embedding-pooling", default=None, choices=["mean", "last", "cls"],
                    help="/v1/embeddings pooling (default: the checkpoint's sentence-transformers pooling; last "
                         "for a model without an LM head; else mean)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="compute threads per rank (default: its cpus; rank 0 leaves one to the HTTP "
                         "server when it has 8 or more)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs "
                    "(cuda: one GPU per rank; needs `pip install numa_runtime[cuda]`)")
    ap.add_argument("--host-kv-cache-memory", type=_size, default=0, help="bytes of pinned host memory that "
                    "keep prefix-cache blocks evicted from the GPU (--device cuda; 0: off)")
    ap.add_argument("--data-parallel", "--data-parallel-size", "-dp", type=int, default=None,
                    help="model replicas over the MPI ranks, each tensor parallel over its share "
                         "(default: a rule logged at start-up)")
    ap.add_argument("--max-tokens-cap", type=int, default=None, help="clamp every request's max_tokens to this")
    ap.add_argument("--stall-timeout", type=float, default=60.0,
                    help="seconds one engine step may run before /health reports 503 (a stuck rank; default 60)")
    ap.add_argument("--shutdown-grace", type=float, default=2.0,
                    help="on SIGINT/SIGTERM, seconds in-flight requests may still run before they are cut "
                         "(a stream then ends with an error event and [DONE]; default 2)")
    ap.add_argument("--request-timeout", type=float, default=60.0,
                    help="seconds a client may pause while sending a request (its headers or body) before the "
                         "HTTP front answers 408 and closes the connection, as nginx's client timeouts")
    ap.add_argument("--http-front", action=argparse.BooleanOptionalAction, default=True,
                    help="relay HTTP through a small process outside the MPI job, which answers the "
                         "requests in flight with an error if a rank is killed (default); "
                         "--no-http-front serves from rank 0 directly (one hop less)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="the runtime's log (info: start-up facts; warning: problems only); the HTTP "
                         "server logs warnings and errors, and every request at debug")
    vl = ap.add_argument_group("vLLM's flags", "taken as `vllm serve` takes them, or refused in one sentence where "
                               "they cannot mean the same here")
    vl.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                    help="ranks a replica's tensor-parallel shards: must be what the MPI job gives it "
                         "(mpirun -np N / numa-launch --ranks N, divided by --data-parallel)")
    vl.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1 only")
    vl.add_argument("--trust-remote-code", action="store_true",
                    help="accepted: no model code is ever run here (the architectures are built in)")
    vl.add_argument("--disable-log-requests", action="store_true",
                    help="accepted: requests are logged at --log-level debug only")
    vl.add_argument("--disable-log-stats", action="store_true", help="accepted: no periodic stats are logged "
                    "(GET /metrics has them)")
    vl.add_argument("--enforce-eager", action="store_true",
                    help="no CUDA graphs (--device cuda replays decode steps as graphs otherwise; no-op on cpu)")
    vl.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="on (long prompts are always prefilled in chunks of --max-num-batched-tokens)")
    vl.add_argument("--download-dir", default=None, help="where a Hugging Face Hub id's files go (HF_HUB_CACHE)")
    vl.add_argument("--revision", default=None, help="the branch, tag or commit of a Hugging Face Hub id")
    vl.add_argument("--hf-token", nargs="?", const=True, default=None, metavar="TOKEN",
                    help="the token that fetches a gated Hugging Face Hub id (alone: the saved login's); "
                    "default: HF_TOKEN or the saved login")
    vl.add_argument("--load-format", default="auto", help="auto, safetensors or gguf (as the model's files say)")
    vl.add_argument("--max-logprobs", type=int, default=None,
                    help="the most log-probabilities a request may ask for, 0 to 20 (default 20)")
    vl.add_argument("--logprobs-mode", default=LOGPROBS_MODES[0], metavar="|".join(LOGPROBS_MODES),
                    help="raw_logprobs only: log-probabilities are the model's own distribution, before "
                         "temperature, penalties, logit_bias, top-k and top-p (vLLM's default)")
    # NOTE: as Engine(runner=...): `vllm serve M --runner pooling` users dropped the flag and got mean pooling
    for flag, ok in RUNNER_VALUES.items():
        vl.add_argument("--" + flag, default=None, metavar="|".join(ok),
                        help=f"{', '.join(ok)}: pooling/embed make /v1/embeddings pool the last token where the "
                             "checkpoint declares no pooling, as vLLM's pooling runner does (generation stays "
                             "served); --embedding-pooling chooses outright")
    # NOTE: as vLLM's CORS flags and defaults (any origin, method and header; no credentials), so a
    # browser page can call the server; Access-Control-* headers on every answer, preflights answered
    # before the API key is asked for
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        vl.add_argument(flag, default=["*"], type=_json_list(flag),
                        help=f'CORS: the {what} a browser page may use, a JSON list (default ["*"]: any)')
    vl.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    for flag, why in (("--gpu-memory-utilization", "sizes a GPU's KV cache as a share of its memory; give the KV "
                       "cache's bytes per rank with --kv-cache-memory"),
                      ("--swap-space", "keeps preempted sequences in host memory; here they are recomputed, and "
                       "--host-kv-cache-memory (cuda) or --kv-cache-dir keep evicted prefix blocks"),
                      ("--tokenizer", "names a tokenizer apart from the model; here it is the model's own "
                       "(tokenizer.json, or the GGUF's)"),
                      ("--uvicorn-log-level", "is --log-level here")):
        vl.add_argument(flag, default=None, help=argparse.SUPPRESS, dest="refused_" + flag[2:].replace("-", "_"))
        _REFUSED_VLLM[flag] = why
    args = ap.parse_args(_dashed(sys.argv[1:] if argv is None else argv))
    if args.model_path is None and not args.model and args.api_key and len(args.api_key) > 1 and _names_a_model(
            args.api_key[-1]):
        # NOTE: `serve --api-key KEY MODEL`: --api-key takes several keys (vLLM's), so it took the
        # model too; with no model given, a last key that names one (a path here, a .gguf, a Hub id)
        # is the model
        *args.api_key, args.model_path = args.api_key
    names = args.served_model_name
    if args.model_path is None and not args.model and names and len(names) > 1 and _is_local_model(names[-1]):
        # NOTE: `serve --served-model-name NAME MODEL` the same way (the built-in model was served under the
        # path's name); only a local path or .gguf: a served name may well look like a Hub id
        *args.served_model_name, args.model_path = names
    if args.model_path is None and not args.model and isinstance(args.hf_token, str) and _names_a_model(
            args.hf_token) and not args.hf_token.startswith("hf_"):
        # NOTE: `serve --hf-token MODEL`: the flag alone means the saved login, and took the model
        args.hf_token, args.model_path = True, args.hf_token
    if args.model_path is not None:  # NOTE: vLLM's positional form comes first among the models
        args.model = [args.model_path, *(args.model or [])]
    if args.model:  # NOTE: one model given twice, in any spelling of its path, is that one model (it was two
        # of one name, refused with advice about symlinks)
        seen, kept = set(), []
        for m in args.model:
            key = os.path.realpath(os.path.expanduser(m)) if os.path.exists(os.path.expanduser(m)) else m
            if key not in seen:
                seen.add(key)
                kept.append(m)
        args.model = kept
    if args.api_key is None and os.environ.get("VLLM_API_KEY") is not None:  # NOTE: as vLLM reads it
        args.api_key = [os.environ["VLLM_API_KEY"]]
    return args


def _dashed(argv: list[str]) -> list[str]:
    """Flag names with '_' read as '-' (vLLM's FlexibleArgumentParser: `--max_num_seqs=256`, as
    deployment files write them); values as they are."""
    out, flags = [], True
    for a in argv:
        if a == "--":
            flags = False
        if flags and a.startswith("--") and "_" in a.split("=", 1)[0]:
            name, eq, value = a.partition("=")
            a = name.replace("_", "-") + eq + value
        out.append(a)
    return out


def _is_local_model(value: str) -> bool:
    """A model folder (its config.json) or a .gguf file here: what a last --served-model-name may be
    taken for (any existing path was: a name that happened to be a folder became the model)."""
    path = os.path.expanduser(value)
    return (os.path.isfile(os.path.join(path, "config.json")) or
            (os.path.isfile(path) and path.lower().endswith(".gguf")))


def _names_a_model(value: str) -> bool:
    from numa_runtime.hub import is_repo_id
    return os.path.exists(os.path.expanduser(value)) or value.lower().endswith(".gguf") or is_repo_id(value)


# vLLM's environment variables this server reads (VLLM_API_KEY); any other set is named in a warning
_VLLM_ENV_TAKEN = ("VLLM_API_KEY",)


def vllm_env_warning() -> str | None:
    """A line naming the VLLM_* environment variables that are set and mean nothing here."""
    unread = sorted(k for k in os.environ if k.startswith("VLLM_") and k not in _VLLM_ENV_TAKEN)
    if not unread:
        return None
    return (f"numa-serve: warning: {', '.join(unread)} (vLLM's environment) {'is' if len(unread) == 1 else 'are'} "
            "not read by this server; see `python -m numa_runtime.serve --help` for its flags.")


def is_multi_model(args) -> bool:
    return args.models_dir is not None or len(args.model or []) > 1


def engine_kwargs(args) -> dict:
    kwargs = {"max_num_seqs": args.max_num_seqs, "dtype": args.dtype, "max_model_len": args.max_model_len,
              "num_threads": args.num_threads, "quantization": args.quantization,
              "lm_head_quantization": args.lm_head_quantization, "device": args.device,
              "prefill_activations": args.prefill_activations,
              "host_kv_cache_memory": args.host_kv_cache_memory, "kv_cache_dtype": args.kv_cache_dtype,
              "reserve_server_core": True, "num_scheduler_steps": args.num_scheduler_steps,
              "generation_config": args.generation_config}
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = args.kv_cache_memory
    for key in ("max_num_batched_tokens", "block_size", "seed"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    if not args.enable_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.kv_cache_dir is not None:  # NOTE: check_args refuses the disk flags without it
        kwargs["kv_cache_dir"] = args.kv_cache_dir
        for key in ("kv_cache_disk_bytes", "kv_cache_disk_load"):
            if getattr(args, key) is not None:
                kwargs[key] = getattr(args, key)
    if args.data_parallel is not None:
        kwargs["data_parallel"] = args.data_parallel
    if args.max_logprobs is not None:
        kwargs["max_logprobs"] = args.max_logprobs
    if args.enforce_eager:
        kwargs["cuda_graphs"] = False
    if {getattr(args, flag) for flag in RUNNER_VALUES} & POOLING_VALUES:
        # NOTE: as Engine(runner="pooling"): the last token by default, after what a checkpoint declares
        kwargs["runner"] = "pooling"
    return kwargs


def _hub_paths(args) -> None:
    """--model values that are Hugging Face Hub ids, fetched now with --revision and --download-dir
    (the engine then reads the local directory); the names they are served under stay the ids."""
    from numa_runtime.hub import is_repo_id, local_path
    args.model_ids = list(args.model or [])
    if args.model:
        args.model = [local_path(m, revision=args.revision, cache_dir=args.download_dir, token=args.hf_token)
                      if is_repo_id(m) else m for m in args.model]


def build_engine(args):
    from numa_runtime import Engine
    _hub_paths(args)
    return Engine(args.model[0] if args.model else None, **engine_kwargs(args))


def build_router(args):
    """Several models (every rank): rank 0 gets the ModelRouter with its first model loaded;
    workers serve it until rank 0 exits, then get None."""
    import psutil
    from numa_runtime.hub import served_name
    from numa_runtime.config import ModelConfig
    from .router import ModelRouter, RouterConfig, model_paths_in_dir, model_spec, model_tokenizer, parse_bytes
    world, local = env.mpi_world() or (0, 1), env.mpi_local() or (0, 1)
    paths = model_paths_in_dir(args.models_dir) if args.models_dir else []
    found, failed, tokenizers = {}, {}, {}
    for path in paths:
        try:  # NOTE: one unreadable or unsupported entry of the folder stopped every model in it
            found[path] = model_spec(path)
            ModelConfig.from_dir(found[path].model_dir)
            if world[0] == 0:  # NOTE: rank 0 reads the tokenizers (a broken tokenizer.json stopped them all)
                tokenizers[found[path].name] = model_tokenizer(found[path].name, found[path].model_dir)
        except (ValueError, OSError) as e:
            failed[path] = f"{e} (rank {world[0]})" if world[1] > 1 else str(e)
    if args.models_dir and world[1] > 1:
        # NOTE: the ranks serve one list (models are named by index between them): an entry that fails on
        # any rank (a cache it cannot write there, another host's files) is left out on all
        from numa_runtime.distributed import init_distributed
        for theirs in init_distributed().all_gather_object(failed):
            for path, why in theirs.items():
                failed.setdefault(path, why)
    if world[0] == 0:
        for path, why in failed.items():
            logging.getLogger("numa_runtime.serve").error("--models-dir: %s is not served: %s", path, why)
    specs = [found[p] for p in paths if p not in failed]
    if args.models_dir and not specs and not args.model:
        raise ValueError(f"--models-dir {args.models_dir!r} holds no model numa_runtime serves" +
                         (f": {next(iter(failed.values()))}" if failed else
                          " (a subdirectory with config.json, or a .gguf file)."))
    _hub_paths(args)
    for d, i in zip(args.model or [], args.model_ids):
        spec = model_spec(d, name=served_name(i))
        specs.append(dataclasses.replace(spec, given=i) if i != spec.name else spec)
    budget = (parse_bytes(args.memory_budget) if args.memory_budget
              else int(env.memory_limit_bytes(psutil.virtual_memory().total) * 0.6 / local[1]))
    router = ModelRouter(RouterConfig(tuple(specs), budget, engine_kwargs(args)), world[1], world[0] == 0,
                         tokenizers)
    if world[0] != 0:
        router.worker_main()
        return None
    from .router import ModelLoadError
    first = None
    for spec in specs:  # NOTE: the first model that loads at start-up; one that fails answers its
        try:            # requests with a 500 naming why (a broken first model of a --models-dir stopped them all)
            router.get(spec.name)
            return router
        except ModelLoadError as e:
            first = first or e
    router.close()  # NOTE: none loads: the workers leave their loop (and exit 0); rank 0 says why
    err = ValueError(str(first))
    err.agreed = True  # NOTE: no rank waits for rank 0 (env.load_failed)
    raise err from None


def router_summary(router, url: str) -> str:
    loaded = ", ".join(router.engines)
    return (f"numa-serve: {len(router.specs)} models ({', '.join(router.specs)}); loaded: {loaded}; "
            f"memory budget {router.config.memory_budget / (1 << 20):.0f} MiB per rank\n  serving at {url}")


def summary_text(engine, url: str) -> str:
    s = engine.summary()
    placement = getattr(engine, "placement", None)
    topo = f" | rank 0 on {placement.describe()}" if placement is not None else ""
    kv_mib = s.get("kv_cache_bytes", 0) / (1 << 20)
    return (f"numa-serve: {s.get('model')} ({s.get('architecture')}, {s.get('dtype')})\n"
            f"  {s.get('ranks')} rank(s) x {s.get('threads_per_rank')} threads{topo}\n"
            f"  KV cache ({s.get('kv_cache_dtype')}): {s.get('kv_blocks')} blocks x {s.get('block_size')} tokens = "
            f"{s.get('max_concurrent_tokens')} tokens"
            f"{' over %d replicas' % s['data_parallel'] if s.get('data_parallel', 1) > 1 else ''}, "
            f"{kv_mib:.1f} MiB per rank; "
            f"max_model_len {s.get('max_model_len')}\n"
            f"  serving at {url}")


def human_int(text: str) -> int:
    """vLLM's human_readable_int: an integer, or a number with a unit: k/m/g decimal (25.6k = 25600),
    K/M/G binary (32K = 32768, whole numbers only)."""
    import re
    from decimal import Decimal, InvalidOperation
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is no integer (as vLLM: 32k = 32000, 32K = 32768)") from None
    number, unit = m.groups()
    if unit.isupper() and "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a binary unit ({unit}) takes a whole number (as vLLM)")
    scale = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
             "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    try:
        value = Decimal(number) * scale
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"{text!r} is no number") from None
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def _model_len(text: str):
    """--max-model-len: human_int, or vLLM's "auto" / -1 (fit what memory holds): None, this
    server's default, which does the same within the model's length."""
    if text.strip().lower() == "auto" or text.strip() == "-1":
        return None
    return human_int(text)


def read_chat_template(value: str) -> str:
    """--chat-template's Jinja source: the file it names, or the value itself where it is a
    template (vLLM's rule); ValueError in one sentence for neither, or a template Jinja cannot read."""
    import jinja2
    from ..tokenizer import _compile
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {path!r} cannot be read ({e}).") from None
    elif not any(d in value for d in ("{{", "{%", "{#")):  # NOTE: a path with a brace in it is no template
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template.")
    try:
        _compile(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template ({e.message}, line {e.lineno}).") from None
    return value


def check_args(args) -> str | None:
    """The first flag that cannot work, as a sentence; None if all can."""
    for flag, why in _REFUSED_VLLM.items():
        if getattr(args, "refused_" + flag[2:].replace("-", "_"), None) is not None:
            return f"{flag} (vLLM's) {why}."
    if args.pipeline_parallel_size != 1:
        return "--pipeline-parallel-size must be 1: ranks split each layer (tensor parallel), not the layers."
    if args.max_request_bytes < 1024:
        return f"--max-request-bytes must be at least 1024 (the largest request body taken), got {args.max_request_bytes}."
    if args.logprobs_mode not in LOGPROBS_MODES:
        return (f"--logprobs-mode {args.logprobs_mode} (vLLM's) is not supported: log-probabilities here are the "
                "model's own distribution, before temperature, penalties, logit_bias, top-k and top-p "
                "(raw_logprobs).")
    if args.max_logprobs is not None and not 0 <= args.max_logprobs <= 20:
        unlimited = " (no limit, vLLM's -1, is not offered)" if args.max_logprobs == -1 else ""
        return (f"--max-logprobs must be 0 to 20 (the log-probabilities a request may ask for), got "
                f"{args.max_logprobs}{unlimited}.")
    for flag, ok in RUNNER_VALUES.items():
        value = getattr(args, flag)
        if value is not None and value not in ok:
            return (f"--{flag} {value} (vLLM's) is not supported here: it takes {', '.join(ok)} (this server "
                    "generates text and embeds; classify, score, reward and draft models are not run).")
    if not args.enable_chunked_prefill:
        return ("--no-enable-chunked-prefill is not supported: long prompts are always prefilled in chunks of "
                "--max-num-batched-tokens.")
    if args.load_format not in ("auto", "safetensors", "gguf"):
        return (f"--load-format must be auto, safetensors or gguf (the model's files say which), got "
                f"{args.load_format!r}.")
    from numa_runtime.engine import check_load_format
    models = list(args.model or ([] if args.models_dir else [None]))
    if args.models_dir is not None and args.load_format != "auto":
        from .router import model_paths_in_dir
        try:
            models += model_paths_in_dir(args.models_dir)
        except OSError:
            pass  # NOTE: said where the folder is read
    for model in models:
        try:
            check_load_format(args.load_format, model)
        except ValueError as e:
            return "--" + str(e).replace("load_format", "load-format", 1)
    from numa_runtime.hub import is_repo_id
    for flag, value in (("--revision", args.revision), ("--download-dir", args.download_dir)):
        if value is not None and not any(is_repo_id(m) for m in args.model or []):
            return (f"{flag} applies to a Hugging Face Hub id (org/name) given as the model, and no model given is "
                    "one; drop the flag.")
    tp, ranks = args.tensor_parallel_size, (env.mpi_world() or (0, 1))[1]
    if tp is not None and tp >= 1 and is_multi_model(args) and tp != ranks:
        return (f"--tensor-parallel-size {tp}: with several models every model is split over all {ranks} rank(s) "
                f"of the job; drop the flag or start the job with {tp} ranks.")
    if tp is not None and (tp < 1 or not is_multi_model(args)):
        from numa_runtime.config import replicas_for_tp
        try:
            dp = replicas_for_tp(tp, args.data_parallel, ranks, f"--tensor-parallel-size {tp}",
                                 "start it as `mpirun -np {n} python -m numa_runtime.serve ...` (or `numa-launch "
                                 "--ranks {n} ...`), one rank per NUMA node", "--data-parallel {}")
        except ValueError as e:
            return str(e)
        if dp is not None:
            args.data_parallel = dp  # NOTE: the ranks beyond one replica's are replicas
    if not args.shutdown_grace >= 0:  # NOTE: nan too
        return f"--shutdown-grace must be >= 0, got {args.shutdown_grace}."
    if not 0 < args.request_timeout < float("inf"):
        return f"--request-timeout must be a positive number of seconds, got {args.request_timeout}."
    if not 0 <= args.port <= 65535:
        return f"--port must be in 0..65535 (0: any free port), got {args.port}."
    if args.load_timeout is not None and not args.load_timeout > 0:
        return f"--load-timeout must be a positive number of seconds, got {args.load_timeout}."
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return "--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json, as the model writes calls)."
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        return "--tool-call-parser is used by tool_choice 'auto', which needs --enable-auto-tool-choice too."
    multi = is_multi_model(args)
    if args.chat_template is not None:
        if multi:
            return "--chat-template applies to one model (each of several keeps its own); drop it."
        try:
            args.chat_template = read_chat_template(args.chat_template)
        except ValueError as e:
            return str(e)
    for flag, value in (("--memory-budget", args.memory_budget), ("--load-timeout", args.load_timeout)):
        if value is not None and not multi:
            return f"{flag} applies to several models (--model given twice or more, or --models-dir); drop it."
    if args.memory_budget is not None:
        from .router import parse_bytes
        try:
            if parse_bytes(args.memory_budget) <= 0:
                return f"--memory-budget must be a positive size, got {args.memory_budget!r}."
        except ValueError as e:
            return f"--memory-budget: {e}"
    if args.data_parallel is not None and args.data_parallel < 1:  # NOTE: several models took 0 and -1
        return f"--data-parallel must be a positive integer, got {args.data_parallel}."
    from numa_runtime.config import ParallelConfig, asked_replicas
    try:
        dp, dp_as = asked_replicas(args.data_parallel, "--data-parallel {}")
        if dp is not None and not multi:
            ParallelConfig(ranks, dp, asked_as=dp_as)
    except ValueError as e:
        return str(e)
    if (dp or 1) > 1 and multi:  # NOTE: numa-launch --tp sets 1
        return ("--data-parallel (numa-launch --dp, NUMA_RUNTIME_DATA_PARALLEL) applies to one model; with several "
                "models each spans all ranks as one tensor-parallel model.")
    for flag, value in (("--kv-cache-disk-bytes", args.kv_cache_disk_bytes),
                        ("--kv-cache-disk-load", args.kv_cache_disk_load)):
        if value is not None and args.kv_cache_dir is None:
            return f"{flag} applies to the disk tier; give --kv-cache-dir too, or drop it."
    if args.kv_cache_dir is not None:  # NOTE: before the weights load, not after
        where = os.path.abspath(os.path.expanduser(args.kv_cache_dir))
        try:
            os.makedirs(where, exist_ok=True)
        except OSError as e:
            return (f"--kv-cache-dir {args.kv_cache_dir!r} cannot be created ({e.strerror or e}); "
                    "pass a writable folder.")
        if not os.access(where, os.W_OK | os.X_OK):
            return f"--kv-cache-dir {args.kv_cache_dir!r} is not writable; pass a writable folder."
    if args.kv_cache_disk_bytes is not None and args.kv_cache_disk_bytes < 1:
        return (f"--kv-cache-disk-bytes must be a positive size (to run without the disk tier, leave out "
                f"--kv-cache-dir), got {args.kv_cache_disk_bytes}.")
    if args.kv_cache_memory is not None and args.kv_cache_memory <= 0:
        return f"--kv-cache-memory must be a positive number of bytes, got {args.kv_cache_memory}."
    if args.api_key is not None and not all(k.strip() for k in args.api_key):
        return ("--api-key (or VLLM_API_KEY) is empty (an unset variable?); give a key, or leave it out to serve "
                "without one.")
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        return "--served-model-name is empty; give a name, or leave the flag out to use the model's."
    if args.served_model_name is not None and multi:
        return ("--served-model-name names a single model; with several models each is named by the last "
                "part of its directory or file (a symlink chooses another name).")
    try:
        serve_config(args, "-")  # NOTE: its checks, before the model loads
    except ValueError as e:
        return str(e)
    return None


def serve_config(args, name: str, given: str | None = None):
    """`given`: the --model string as typed, also answered to where --served-model-name is not
    set (vLLM serves a model under that string; ours is its directory's name)."""
    from .app import Cors, ServeConfig
    names = (args.served_model_name or [])[1:] if args.served_model_name else [given] if given else []
    aliases = tuple(dict.fromkeys(n for n in names if n != name))
    return ServeConfig(served_model_name=name, aliases=aliases, model_root=given,
                       api_key=tuple(args.api_key) if args.api_key else None,
                       max_queue=args.max_queue, max_body_bytes=args.max_request_bytes,
                       max_tokens_cap=args.max_tokens_cap, stall_timeout_s=args.stall_timeout,
                       embedding_pooling=args.embedding_pooling,
                       tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                       reasoning_parser=args.reasoning_parser,
                       cors=Cors(tuple(args.allowed_origins), tuple(args.allowed_methods),
                                 tuple(args.allowed_headers), args.allow_credentials))


def listen(host: str, port: int):
    """A socket bound to host:port (port 0: any free one), before the model loads, so that a
    busy port fails at once and the printed address is the real one."""
    import socket
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        # NOTE: listening now, not after the load: two SO_REUSEADDR sockets that only bind share a
        # port (a second server loaded its model, then died in a traceback); clients that come
        # during the load wait in the backlog
        sock.listen(2048)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}.") from None
    sock.set_inheritable(True)
    return sock


_LOAD_TIMEOUT_S = 60.0  # several models: --load-timeout's default
_KEEP_ALIVE_S = 5.0  # an idle client connection's life (uvicorn's default)
_BACKEND_KEEP_ALIVE_S = 7 * 24 * 3600


class HttpFront:
    """The front process (front.py) and the Unix socket it relays to, from rank 0's side."""

    def __init__(self, public, access_log: bool = False, request_timeout: float = 60.0):
        import secrets
        import socket
        import subprocess
        # NOTE: an abstract socket (Linux): no file in /tmp that a cleaner (systemd-tmpfiles, after
        # 10 days) could remove under a long-running server, which then refused every request as
        # if the engine had died; nor one left behind when rank 0 is killed
        self.name = f"@numa-serve-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.name[1:])
        self.sock.listen(2048)  # NOTE: the front may connect before uvicorn accepts
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "front.py")
        isolate = "-P" if sys.version_info >= (3, 11) else "-I"  # NOTE: not this package's dir on sys.path
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA_", "MPIR_", "I_MPI_"))}
        self.proc = subprocess.Popen([sys.executable, isolate, script, "--fd", str(public.fileno()),
                                      "--backend", self.name, "--keep-alive", str(_KEEP_ALIVE_S),
                                      "--request-timeout", repr(request_timeout)]
                                     + (["--access-log"] if access_log else []),
                                     stdin=subprocess.PIPE, env=env,
                                     pass_fds=(public.fileno(),), start_new_session=True)
        self._fd = self.proc.stdin.fileno()

    def tell(self, word: str) -> None:
        """Signal-safe: one write to the front's stdin."""
        try:
            os.write(self._fd, word.encode() + b"\n")
        except OSError:
            pass

    def close(self) -> None:
        """Rank 0 is done: the front relays what is left and exits."""
        # NOTE: first: a connection the front opened that uvicorn never accepted (it came as the
        # shutdown began) waits in this socket's queue; closing it ends them, and the front answers
        # their clients at once (it waited 10 s for them, then cut them off without an answer)
        self.sock.close()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=15)
        except Exception:  # noqa: BLE001 - it exits by itself within 10 s of end of file
            pass


def main(argv=None) -> int:
    args = parse_args(argv)
    world = env.mpi_world()
    lead = world is None or world[0] == 0  # NOTE: one rank says what is wrong, not every rank
    bad = check_args(args)
    if bad:
        if lead:
            print(f"numa-serve: error: {bad}", file=sys.stderr)
        return 2  # NOTE: every rank reads the same flags: all stop here
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # NOTE: a process killed by a fault (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) says so in the log,
    # with every thread's Python stack: the clients' 503 points there, and it held nothing
    faulthandler.enable(all_threads=True)
    # NOTE: the runtime's logger follows --log-level (its own default would be INFO); set for
    # every logger made later too (env.log_level)
    os.environ["NUMA_RUNTIME_LOG_LEVEL"] = args.log_level.upper()
    logging.getLogger("numa_runtime").setLevel(args.log_level.upper())
    sock = None
    if lead:
        from .front import raise_file_limit
        raise_file_limit()  # NOTE: a descriptor a client connection (the front's relays, or the clients)
        try:
            sock = listen(args.host, args.port)
        except OSError as e:
            print(f"numa-serve: error: {e}", file=sys.stderr, flush=True)
            if world is not None and world[1] > 1:
                env.abort_job(2)  # NOTE: the other ranks would wait for rank 0 for ever
            return 2
    front = None
    if sock is not None and args.http_front:
        # NOTE: before the model loads (and before MPI starts): the front runs outside mpirun's reach
        front = HttpFront(sock, access_log=args.log_level == "debug", request_timeout=args.request_timeout)
    try:
        rc = _serve(args, world, sock, front)
    finally:
        if front is not None:
            front.close()
    if lead:
        _exit_watchdog(rc)
    return rc


_EXIT_WAIT_S = 10.0


def _exit_watchdog(rc: int) -> None:
    """Rank 0 returns `rc`: if the interpreter's exit is still waiting for threads _EXIT_WAIT_S later (a
    call on a tokenizing thread that does not end), exit without them. It waited for ever, and by then
    no signal reached a handler that could end it."""
    import time

    def watch():
        time.sleep(_EXIT_WAIT_S)
        busy = [t.name for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
        print(f"numa-serve: warning: {len(busy)} thread(s) still running {_EXIT_WAIT_S:.0f} s after the server "
              "stopped; exiting without them.", file=sys.stderr, flush=True)
        os._exit(rc)
    threading.Thread(target=watch, name="numa-exit", daemon=True).start()


def _serve(args, world, sock, front) -> int:
    if world is not None and world[0] != 0:
        # NOTE: mpirun forwards SIGINT/SIGTERM to every rank; a worker must outlive rank 0's
        # graceful shutdown, which ends it through engine.close().
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    multi = is_multi_model(args)
    if world is None or world[0] == 0:
        # NOTE: a stop (systemctl stop: SIGTERM) while loading ends as Ctrl-C does, in one line (it
        # killed rank 0 outright: mpiexec's "BAD TERMINATION" banner and exit code 15)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        # NOTE: first, and on every rank
        engine = build_router(args) if multi else build_engine(args)
    except Exception as e:  # noqa: BLE001 - OSError: e.g. NUMA_RUNTIME_CACHE names a file; MemoryError
        # NOTE: a load fails on every rank alike (Engine's _agree: the others raise RankLoadError);
        # rank 0 says why, for all, in one sentence, and every rank exits 2 (an uncaught error on a
        # worker printed its traceback and aborted the job before rank 0 could say it)
        return env.load_failed(e, "numa-serve: ")
    except KeyboardInterrupt:  # NOTE: rank 0 only (workers ignore SIGINT): a line, not a traceback
        print("numa-serve: error: interrupted while loading the model.", file=sys.stderr, flush=True)
        if world is not None and world[1] > 1:
            env.abort_job(130)  # NOTE: the workers are in the load's collectives
        return 130
    early: list = []  # NOTE: a stop between the load and the server's own handlers: served as one then
    if world is None or world[0] == 0:
        signal.signal(signal.SIGTERM, lambda signum, _frame: early.append(signum))
        signal.signal(signal.SIGINT, lambda signum, _frame: early.append(signum))
    if engine is None:  # a worker rank of several models: rank 0 has shut down
        return 0
    if not multi and not engine.is_driver:
        engine.serve_workers()  # returns when rank 0 shuts down
        return 0
    if args.chat_template is not None:  # NOTE: read and checked by check_args
        engine.tokenizer.use_chat_template(args.chat_template)

    import uvicorn
    from .app import build_app
    from .async_engine import AsyncEngine

    from numa_runtime.hub import served_name
    if multi:
        name = next(iter(engine.specs))
    else:
        given = (getattr(args, "model_ids", None) or args.model or [None])[0]
        own = served_name(given) or os.path.basename(os.path.normpath(engine.model_config.model_dir))
        name = (args.served_model_name or [own])[0]
    config = serve_config(args, name, None if multi else given)
    unread = vllm_env_warning()
    if unread:
        print(unread, file=sys.stderr, flush=True)
    if args.api_key is None and not _is_loopback(args.host):
        print(f"numa-serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
              "address can use the server; pass --api-key KEY or bind 127.0.0.1.", file=sys.stderr, flush=True)
    aengine = AsyncEngine(engine)
    if multi:
        from .multi_app import build_multi_app
        asgi = build_multi_app(aengine, engine, config,
                               _LOAD_TIMEOUT_S if args.load_timeout is None else args.load_timeout)
    else:
        asgi = build_app(aengine, config)
    # NOTE: uvicorn cancels what still runs after its own grace (a CancelledError traceback);
    # the engine ends every request before that. The app has no lifespan events: with them on,
    # a second signal (exit now) cancels the lifespan task and Starlette logs a traceback.
    # NOTE: requests cut at the grace end their streams within a moment; 2 s more, then uvicorn
    # cancels what is left (a client stalled mid-upload held the exit 10 s)
    # NOTE: behind the front, rank 0 never closes an idle connection (its close could not be told
    # from a dead rank's); the front closes idle clients after uvicorn's usual 5 s instead
    http_log = args.log_level if args.log_level in ("debug", "error") else "warning"
    server = uvicorn.Server(uvicorn.Config(asgi, host=args.host, port=args.port, log_level=http_log,
                                           access_log=args.log_level == "debug" and front is None,
                                           lifespan="off", timeout_graceful_shutdown=args.shutdown_grace + 2,
                                           timeout_keep_alive=_BACKEND_KEEP_ALIVE_S if front else 5))
    port = sock.getsockname()[1]
    if front is not None:
        sock.close()  # NOTE: the front holds the public socket; uvicorn serves the front
        sock = front.sock
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="numa-http", daemon=True)

    def begin_shutdown() -> None:
        # NOTE: stop accepting first; requests in flight run for the grace period, then the
        # engine fails them (streams end with an error event and [DONE]); the engine loop ends
        # when the HTTP thread does. Idempotent.
        server.should_exit = True
        aengine.shutdown(args.shutdown_grace)
        if front is not None:
            front.tell("stopping")

    signals = []

    def on_signal(signum, _frame):
        import time
        now = time.monotonic()
        if signals and world is not None and now - signals[0] < _SAME_SIGNAL_S:
            return  # NOTE: the copy mpiexec forwards of a signal rank 0 got too (pkill -f, Ctrl-C)
        signals.append(now)
        if len(signals) > 1:  # NOTE: a second signal: exit now
            server.force_exit = True
        begin_shutdown()

    # NOTE: it only sets flags, so an engine step need not hold it, and it dates each signal as it comes
    # (held to a step's end, mpiexec's copy of one Ctrl-C came over 1 s after the first: an exit at once)
    on_signal.numa_runtime_unheld = True
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    for signum in early:  # NOTE: a graceful stop at once (nothing runs yet); a second one exits now
        on_signal(signum, None)
    closed = threading.Event()  # NOTE: set once engine.close() returned
    if world is not None and world[1] > 1:
        _watch_signals(aengine, begin_shutdown, args.shutdown_grace, closed, args.stall_timeout)
    http.start()
    if front is not None:
        front.tell("ready")
    bare = args.host.strip("[]")
    host = f"[{bare}]" if ":" in bare else bare
    print((router_summary if multi else summary_text)(engine, f"http://{host}:{port}/v1"), flush=True)
    front_died = (lambda: front.proc.poll() is not None) if front is not None else (lambda: False)
    try:
        aengine.run_forever(should_stop=lambda: not http.is_alive() or front_died())
    finally:
        server.should_exit = True
        http.join(timeout=10)
        if front is not None:
            _end_connections(server)
        if world is not None and world[1] > 1:
            _watch_close(closed)
        engine.close()
        closed.set()
    if front_died():
        print(f"numa-serve: error: the HTTP front process exited (code {front.proc.returncode}), so nothing "
              "reaches the server any more; it has shut down.", file=sys.stderr, flush=True)
        return 1
    return 0 if server.started else 1


def _end_connections(server) -> None:
    """Behind the front: end rank 0's side of every connection uvicorn left open (on a forced exit,
    one whose request stopped mid-body). The front then answers its client at once; it waited for
    the garbage collector to close them (or 10 s, and then cut the client off without an answer)."""
    import socket
    for conn in list(getattr(getattr(server, "server_state", None), "connections", ())):
        transport = getattr(conn, "transport", None)
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # NOTE: any thread may; the event loop has ended
            except OSError:
                pass


_STUCK_EXIT_S = 15.0  # past the grace: how long a shutdown may wait for an engine step to end
# NOTE: under mpirun one SIGTERM/SIGINT sent to the job's processes (systemctl stop, pkill -f, Ctrl-C
# in a terminal) reaches rank 0 twice: itself, then mpiexec's forwarded copy milliseconds later.
# Signals this close to the first count as that one, not as the second that forces an exit.
_SAME_SIGNAL_S = 1.0


def _watch_signals(aengine, begin_shutdown, grace: float, closed: threading.Event, stall: float) -> None:
    """Rank 0 of several: a thread that sees SIGINT/SIGTERM even while the main thread waits in an
    MPI call for a rank that is stopped or stuck (Python runs signal handlers on the main thread
    only, between calls). It starts the graceful shutdown itself if the handler could not, and
    if the engine loop has still not ended _STUCK_EXIT_S after the grace, it ends the MPI job (the
    HTTP front then answers what was in flight). A second signal means exit now, as in one
    process: once the step in progress ends, or at once when it has run `stall` seconds
    (--stall-timeout: a stopped or stuck rank; it waited out the grace). The job ignored every
    signal before."""
    import select
    import time
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    wanted, seen, first = {signal.SIGINT, signal.SIGTERM}, [0], [None]

    def signals(n: int, timeout: float | None) -> bool:
        """Whether `n` SIGINT/SIGTERMs in all have arrived within `timeout` s (None: wait for them);
        those within _SAME_SIGNAL_S of the first count as the first."""
        end = None if timeout is None else time.monotonic() + timeout
        while seen[0] < n:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([r], [], [], left)[0]:
                return False
            for b in os.read(r, 64):
                now = time.monotonic()
                if b in wanted and (first[0] is None or now - first[0] >= _SAME_SIGNAL_S):
                    first[0] = now if first[0] is None else first[0]
                    seen[0] += 1
        return True

    def watch():
        signals(1, None)
        begin_shutdown()  # NOTE: idempotent (the handler may run it too); never a forced exit
        deadline = time.monotonic() + grace + _STUCK_EXIT_S
        while not closed.is_set() and not aengine.wait_stopped(0) and not signals(2, 0):
            left = deadline - time.monotonic()
            if left <= 0:
                _end_job(f"an engine step has not ended {grace + _STUCK_EXIT_S:.0f} s after the shutdown began "
                        "(a rank is stopped or stuck)")
            signals(2, min(left, 0.5))
        # NOTE: the loop ended (_watch_close covers close()) or a second signal came: exit now, as
        # soon as the step in progress ends (the handler's forced exit), unless it is stuck
        signals(2, None)
        while not closed.wait(0.5) and not aengine.wait_stopped(0):
            if aengine.busy_seconds > stall:
                _end_job(f"a second signal, and an engine step has run {aengine.busy_seconds:.0f} s "
                        "(a rank is stopped or stuck)")
    threading.Thread(target=watch, name="numa-signals", daemon=True).start()


def _watch_close(closed: threading.Event) -> None:
    """Rank 0 of several, once the engine loop has ended: close() waits in MPI for every rank (the
    shutdown plan, the disk tier's last writes), where no signal handler can run, so a stopped or
    dead worker rank held the job for ever. End the MPI job if close() has not ended _STUCK_EXIT_S
    after the loop did; a disk tier's last writes add what they took on this rank, again, from its
    last write (the other ranks write their shares of the same blocks meanwhile)."""
    import time

    from ..kv_cache import disk_tier
    start = time.monotonic()

    def watch():
        while not closed.wait(0.5):
            last = disk_tier.last_op_at
            writing = max(0.0, last - start)  # NOTE: this rank's flush so far
            if time.monotonic() - max(start, last) > _STUCK_EXIT_S + writing:
                _end_job(f"the shutdown has not ended {_STUCK_EXIT_S:.0f} s after the engine loop did (a worker "
                         "rank is stopped or stuck)")
    threading.Thread(target=watch, name="numa-close", daemon=True).start()


def _end_job(why: str) -> None:
    """A watcher thread of rank 0: say why in one line, then end every rank of the job."""
    import time
    print(f"numa-serve: error: {why}; ending the MPI job.", file=sys.stderr, flush=True)
    time.sleep(0.5)  # NOTE: mpirun drops output still in flight when the job is aborted
    env.abort_job(1)


def _is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
