"""The OpenAI-compatible HTTP API over an AsyncEngine: routes, errors, auth and limits.

    app = build_app(AsyncEngine(engine), ServeConfig(served_model_name="smollm2"))
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..tokenizer import open_tail
from . import responses as R
from .async_engine import AsyncEngine, EngineDeadError, off_loop
from ..engine import prompt_truncation
from .embeddings import EmbeddingRequest, create_embeddings
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ..sampling_params import SamplingParams
from ..scheduler import check_context

log = logging.getLogger("numa_runtime.serve")


@dataclass(frozen=True)
class Cors:
    """What a browser page from another origin may do (Starlette's CORSMiddleware; vLLM's flags)."""
    origins: tuple = ("*",)
    methods: tuple = ("*",)
    headers: tuple = ("*",)
    credentials: bool = False

    def middleware_kwargs(self) -> dict:
        return {"allow_origins": list(self.origins), "allow_methods": list(self.methods),
                "allow_headers": list(self.headers), "allow_credentials": self.credentials}


def with_cors(asgi, cors: Cors | None):
    """`asgi` behind CORS: Access-Control-* headers on its answers, and preflights (OPTIONS)
    answered before its API key check; `asgi` itself when cors is None. Either way, requests whose
    target is an absolute URL are routed by its path (_OriginForm)."""
    return _OriginForm(asgi if cors is None else CORSMiddleware(asgi, **cors.middleware_kwargs()))


class _OriginForm:
    """A request line's absolute URL (`POST http://host:8000/v1/completions HTTP/1.1`, which
    RFC 9112 says a server must accept) routed by its path, as uvicorn's httptools parser routes
    it: it was a 404, "no such endpoint"."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path[:8].lower().startswith(("http://", "https://")):  # NOTE: the scheme's case is free
            rest = path.split("://", 1)[1]
            raw = (scope.get("raw_path") or path.encode()).split(b"://", 1)[-1]
            scope = {**scope, "path": "/" + rest.split("/", 1)[1] if "/" in rest else "/",
                     "raw_path": b"/" + raw.split(b"/", 1)[1] if b"/" in raw else b"/"}
        return await self.app(scope, receive, send)


@dataclass(frozen=True)
class ServeConfig:
    served_model_name: str
    api_key: str | tuple | None = None  # one key or several (vLLM's --api-key K1 K2): any of them
    max_queue: int = 256              # waiting sequences beyond which new requests get 429
    max_tokens_cap: int | None = None  # larger max_tokens are clamped to this
    max_body_bytes: int = 64 << 20    # a request body beyond gets 413 (--max-request-bytes)
    stall_timeout_s: float = 60.0      # /health is 503 once one engine step or command runs this long
    embedding_pooling: str | None = None  # "mean", "last" or "cls"; None: the model's default
    tool_call_parser: str | None = None   # tool_choice "auto": the models' call format (tools.py); None: refused
    reasoning_parser: str | None = None   # <think> output as reasoning_content (reasoning.py); None: all content
    aliases: tuple = ()               # more names clients may send as `model` (vLLM's --served-model-name a b)
    model_root: str | None = None     # /v1/models' root: the model as given (--model); None: the served name
    cors: Cors | None = None          # browser pages of other origins (serve's --allowed-origins ...); None: none

    @property
    def names(self) -> tuple:
        """Every name a request may give as `model`: the served name first."""
        return (self.served_model_name, *self.aliases)

    def __post_init__(self):
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}.")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1 (requests are refused once that many wait), got "
                             f"{self.max_queue}.")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be a positive integer, got {self.max_tokens_cap}.")


class ApiError(Exception):
    """An error the client caused (or must wait out), rendered as an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


@contextmanager
def _client_errors(renames: dict[str, str] | None = None, api_names: dict[str, str] | None = None):
    """ValueError/TypeError raised while reading the request: the client's 400. `renames`: fields
    the request spelled otherwise (max_completion_tokens arrives as max_tokens); `api_names`:
    the request field an internal one came from, beyond _API_NAME's."""
    try:
        yield
    except (ValueError, TypeError) as e:
        text = str(e)
        for old, new in (renames or {}).items():
            text = re.sub(rf"\b{old}\b", new, text)
        # "top_p must be ...", "min_tokens (5) must ...": keep the field's spelling
        field = _LEADING_FIELD.match(text) or _LEADING_PARAM.match(text)
        field = field.group(1) if field and (field.re is _LEADING_FIELD or field.group(1) in _PARAMS) else None
        named = getattr(e, "param", None)  # NOTE: an error that names its field starts with it
        message = _sentence(text, capitalize=field is None and named is None)
        code = "context_length_exceeded" if re.search("max_model_len|context", message) else "invalid_value"
        names = {**_API_NAME, **(api_names or {})}
        param = named or (field and names.get(field, field))
        if param is None and code == "context_length_exceeded":  # NOTE: "The prompt (N tokens) plus max_tokens..."
            limit = re.search(r"\bmax(?:_completion|_output)?_tokens\b", message)
            param = limit.group(0) if limit else None
        raise ApiError(400, message, param=param, code=code) from None


_LEADING_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)*)(?:\[\d+\])*(?: keys| values| of type \S+)? "
                            r"(?:must|requires|is not supported|cannot)")
_LEADING_PARAM = re.compile(r"^([a-z]+(?:_[a-z]+)+)\b")  # a sampling parameter's name, whatever follows
_PARAMS = ({f.name for f in dataclasses.fields(SamplingParams)} | set(CompletionRequest.model_fields)
           | set(ChatCompletionRequest.model_fields))
_API_NAME = {"json_schema": "response_format"}  # SamplingParams field -> the OpenAI field it came from
OPEN_PATHS = ("/health", "/ping")  # NOTE: health checks: open without the API key


def model_card(name: str, created: int, root: str, max_model_len: int) -> dict:
    """One /v1/models entry, as vLLM's ModelCard."""
    return {"id": name, "object": "model", "created": created, "owned_by": "numa_runtime", "root": root,
            "parent": None, "max_model_len": max_model_len, "permission": []}


def server_metrics(aengine, model_name: str | None = None) -> ServerMetrics:
    """`model_name`: the one model the engine gauges are of (vLLM labels them with it)."""
    return ServerMetrics(lambda: aengine.stats, lambda name: {
        "seconds_since_last_step": aengine.seconds_since_last_step,
        "engine_busy_seconds": aengine.busy_seconds}[name], model_name)


def build_app(aengine: AsyncEngine, config: ServeConfig, metrics: ServerMetrics | None = None,
              stored=None) -> FastAPI:
    """The app of one model; `metrics`: a registry shared with the other models' apps; `stored`:
    the /v1/responses store (responses_api.ResponseStore) shared with them."""
    from . import responses_api as RA
    stored = stored if stored is not None else RA.ResponseStore()
    engine = aengine.engine
    metrics = metrics if metrics is not None else server_metrics(aengine, config.served_model_name)
    app = FastAPI(title="numa_runtime", version="0.1.0", docs_url=None, redoc_url=None,
                  description="OpenAI-compatible completions and chat over numa_runtime.")
    app.add_middleware(_Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes, metrics=metrics)
    if config.cors is not None:  # NOTE: added last, so outermost: a preflight never meets the API key
        app.add_middleware(CORSMiddleware, **config.cors.middleware_kwargs())
    app.add_middleware(_OriginForm)
    _install_error_handlers(app)
    created = int(time.time())
    _ = engine.tokenizer.max_token_chars  # NOTE: computed once here, not by the first request

    decode_token = functools.lru_cache(maxsize=1 << 16)(engine.tokenizer.token_bytes)

    def check_model(model: str | None) -> None:
        if model is not None and model not in config.names:
            names = ", ".join(repr(n) for n in config.names)
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {names}.",
                           param="model", code="model_not_found")

    def check_queue() -> None:
        if aengine.num_waiting >= config.max_queue:
            raise ApiError(429, f"The server has {aengine.num_waiting} requests waiting; retry shortly.",
                           type_="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    def cap(max_tokens: int | None) -> int | None:
        if config.max_tokens_cap is None:
            return max_tokens
        return config.max_tokens_cap if max_tokens is None else min(max_tokens, config.max_tokens_cap)

    @app.get("/health")
    async def health():
        if not aengine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        busy = aengine.busy_seconds
        if busy > config.stall_timeout_s:
            return JSONResponse({"status": "engine stalled", "busy_seconds": round(busy, 1)}, status_code=503)
        return {"status": "ok"}

    @app.get("/ping")
    async def ping():
        """vLLM's /ping (SageMaker's health check): /health's answer."""
        return await health()

    @app.post("/ping")  # NOTE: its own operation: one for both methods gave /openapi.json one id twice
    async def ping_post():
        return await health()

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name, created, config.model_root or config.served_model_name,
                                                      engine.max_model_len) for name in config.names]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        """OpenAI's model retrieval (the openai client's models.retrieve): one card, or a 404."""
        check_model(model)
        return model_card(model, created, config.model_root or config.served_model_name, engine.max_model_len)

    @app.get("/version")
    async def version():
        from .. import __version__
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's: the tokens of a prompt or of chat messages as the model's template renders them."""
        check_model(body.model)
        with _client_errors():
            body.checked()
            tok = engine.tokenizer
            if body.messages is not None:
                from .tools import plan
                plan(body.tools, "none", None)  # NOTE: the tools chat takes, checked as chat checks them
                kwargs = body.template_kwargs() | ({"tools": body.tools} if body.tools else {})
                # NOTE: off the event loop, as chat renders: a slow template holds no other request
                text = await off_loop(tok.render_chat, [m.as_template_dict() for m in body.messages],
                                               **kwargs)
                add = bool(body.add_special_tokens)
            else:
                text, add = body.prompt, body.add_special_tokens is not False
            ids = await off_loop(tok.encode, text, add_special_tokens=add)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": [tok.token_str(t) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        with _client_errors():
            vocab = len(engine.tokenizer)
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"tokens holds {bad}, which is not a token id (0 to {vocab - 1}).", param="tokens",
                               code="invalid_value")
            # NOTE: as vLLM (transformers' decode): special tokens stay, so /tokenize round-trips
            return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/debug/profile", response_class=PlainTextResponse)
    async def profile(model: str | None = None):
        check_model(model)  # NOTE: as a server of several models (multi_app): a wrong name is a 404
        if not getattr(getattr(engine, "recorder", None), "enabled", False):
            raise ApiError(404, "Operator profiling is off; start the server with AS_PROFILE=ON.",
                           code="profiling_off")
        return PlainTextResponse(str(await aengine.call(lambda e: e.get_op_profiling_info())))

    def tokenize_prompts(prompts: list, add_special_tokens: bool, keep: int | None = None) -> list[list[int]]:
        """`keep`: truncate_prompt_tokens (a text's special tokens kept, as vLLM's tokenizer keeps
        them; token ids: the last `keep`). Runs in a worker thread; the tokenizer releases the GIL
        while it encodes."""
        return [engine.tokenizer.prompt_ids(p, keep, add_special_tokens) for p in prompts]

    def tokenize_chat(messages: list[dict], template_kwargs: dict, add_special_tokens: bool,
                      keep: int | None = None) -> list[int]:
        text = engine.tokenizer.render_chat(messages, **template_kwargs)
        if keep is None:
            engine.tokenizer.check_length(text, engine.max_model_len)
        return engine.tokenizer.prompt_ids(text, keep, add_special_tokens)

    async def prompt_pairs(request: Request, prompts: list[list[int]], k: int) -> list[list[tuple]]:
        """Each prompt's tokens' logprob pairs (tokens 1..n-1, `k` most likely each), computed
        between steps, one engine call a prompt; a prompt the KV cache cannot hold now waits for
        room, as an embedding. A client gone leaves the rest unrun."""
        async def work():
            return [await aengine.call(lambda e, ids=ids: e.prompt_logprob_pairs(ids, k)) for ids in prompts]
        return await _unless_gone(request, work())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.monotonic()
        check_model(body.model)
        with _client_errors():
            texts = body.prompts()
            keep = prompt_truncation(body.truncate_prompt_tokens, engine.max_model_len)
            echo_only = body.echo and body.max_tokens == 0  # NOTE: as OpenAI and vLLM: the prompt, scored
            if body.max_tokens == 0 and not body.echo:
                raise ValueError("max_tokens must be at least 1 (0 only with echo: true, which returns the prompt "
                                 "alone), got 0.")
            for p in texts:
                if isinstance(p, str) and keep is None:
                    engine.tokenizer.check_length(p, engine.max_model_len)
            # NOTE: as vLLM: an omitted max_tokens is OpenAI's 16, an explicit null runs to the context's end
            max_tokens = ((None if body.max_tokens_to_the_end else 16) if body.max_tokens is None
                          else 1 if echo_only else body.max_tokens)
            params = body.sampling_params(cap(max_tokens), body.logprobs, body.json_schema(), engine.default_sampling)
            if echo_only and params.constraint is not None:  # NOTE: it was accepted unchecked and unused
                field = body.constraint_field() or "response_format"
                raise ValueError(f"{field} constrains generated text, and echo with max_tokens 0 generates none; "
                                 "drop one.")
            if params.constraint is not None and not echo_only:  # NOTE: guided_json; built once, off the loop
                await off_loop(engine.grammars.prepare)
            # NOTE: as vLLM's truncate_prompt_tokens: the last `keep` tokens
            prompts = await off_loop(tokenize_prompts, texts, body.add_special_tokens, keep)
            echo = scores = None
            if body.echo or body.prompt_logprobs is not None:
                check_queue()  # NOTE: before the prompt's forward
                for field in ("logprobs", "prompt_logprobs"):  # NOTE: --max-logprobs; echo's forward ran past it
                    engine.check_logprobs(field, getattr(body, field))
                # NOTE: a request the engine would refuse is refused before its forward or its echo
                for p in prompts:
                    engine.check_prompt_ids(p)
                    if not echo_only:
                        check_context(len(p), params.max_tokens, engine.max_model_len)
                    elif len(p) > engine.max_model_len:  # NOTE: echo alone computes no token after it
                        raise ValueError(f"The prompt has {len(p)} tokens, but the context holds max_model_len="
                                         f"{engine.max_model_len}; shorten the prompt.")
            if body.echo:  # NOTE: the prompt as given; a token or truncated prompt as its tokens decode
                pairs = await prompt_pairs(request, prompts, body.logprobs) if body.logprobs is not None else None
                # NOTE: but for the last tokens of a character they leave open: the output's first
                # text completes that character and carries all of it (the echo repeated its bytes)
                echo = [(t if isinstance(t, str) and (not keep or len(p) < keep) else
                         engine.tokenizer.decode(p if echo_only else p[:len(p) - open_tail(engine.tokenizer, p)],
                                                 skip_special_tokens=False), p, None if pairs is None else pairs[i])
                        for i, (t, p) in enumerate(zip(texts, prompts))]
            if body.prompt_logprobs is not None:
                scores = list(zip(prompts, await prompt_pairs(request, prompts, body.prompt_logprobs)))
        if echo_only:
            out = R.echo_body(body.response_id("cmpl"), config.served_model_name, echo, scores, body.n,
                              decode_token, engine.tokenizer.decoded_token)
            end = time.monotonic()
            metrics.observe_request(config.served_model_name,
                                    [("length", len(p), 0, None, None, end) for p in prompts for _ in range(body.n)],
                                    out["usage"]["prompt_tokens"], 0, arrival)
            if not body.stream:
                return JSONResponse(out)
            usage = out.pop("usage")  # NOTE: in its own last event, and only with include_usage
            events = [R.sse({**out, "choices": [c], **({"usage": None} if body.include_usage else {})})
                      for c in out.pop("choices")]
            if body.include_usage:
                events.append(R.sse({**out, "choices": [], "usage": usage}))
            return StreamingResponse(iter(events + [R.sse("[DONE]")]), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        # NOTE: a token prompt that ends inside a character: its output's text begins with that
        # character's bytes, which its text_offsets count
        tails = None if body.echo or body.logprobs is None else [
            b"".join(decode_token(t) for t in p[len(p) - open_tail(engine.tokenizer, p):]) for p in prompts]
        return await _serve(request, body, "cmpl", prompts, params, arrival, echo=(echo, scores), tails=tails)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat_answer(body, request)

    async def chat_answer(body: ChatCompletionRequest, request: Request, renames: dict | None = None):
        """The chat path; `renames`: the fields a request of another API (/v1/responses) spelled
        otherwise, for its error messages."""
        arrival = time.monotonic()
        check_model(body.model)
        if body.max_completion_tokens is not None:
            renames = {**(renames or {}), "max_tokens": "max_completion_tokens"}
        with _client_errors(renames):
            body.refuse_unsupported()
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            tool_plan = body.tool_plan(config.tool_call_parser)
            schema = body.json_schema()
            if tool_plan.schema is not None:
                if schema is not None or body.constraint_field() is not None:
                    field = "response_format" if schema is not None else body.constraint_field()
                    raise ValueError(f"{field} cannot be combined with a tool_choice that calls a function; drop "
                                     "one.")
                schema = tool_plan.schema
            params = body.sampling_params(cap(max_tokens), body.num_logprobs(), schema, engine.default_sampling)
            if tool_plan.mode == "auto" and tool_plan.parser == "hermes":
                params.skip_special_tokens = False  # NOTE: as vLLM: <tool_call> is a special token of some models
            # NOTE: the rendered prompt's length is checked (tokenize_chat), not the messages': a template
            # may leave text out (older turns, earlier reasoning), as vLLM judges the rendered prompt
            keep = prompt_truncation(body.truncate_prompt_tokens, engine.max_model_len)
            if params.constraint is not None:  # NOTE: built once, off the loop and the engine thread
                await off_loop(engine.grammars.prepare)
            messages = [m.as_template_dict() for m in body.messages]
            kwargs = body.template_kwargs() | ({"tools": tool_plan.tools} if tool_plan.tools else {})
            ids = await off_loop(tokenize_chat, messages, kwargs, body.add_special_tokens, keep)
        return await _serve(request, body, "chatcmpl", [ids], params, arrival, renames, tool_plan)

    @app.post("/v1/responses")
    async def responses_create(request: Request):
        """OpenAI's Responses API over the chat path (serve/responses_api.py)."""
        from pydantic import ValidationError
        try:
            raw = json.loads(await request.body() or b"null")
        except ValueError:
            raise ApiError(400, "The request body is not valid JSON.", code="invalid_value") from None
        with _client_errors(), _not_stored("previous_response_id"):
            body = RA.chat_request(raw, stored)
        named = RA.resp_id(raw) if RA.stores(raw) and raw.get("request_id") is not None else None
        if named is not None and not stored.reserve(named):  # NOTE: it replaced that one
            raise ApiError(400, f"request_id {raw['request_id']!r} is the id of a stored response or of one under "
                                f"way ({named}); use another, or delete that one first.", param="request_id",
                           code="invalid_value")
        streamed = False
        try:
            try:
                chat = ChatCompletionRequest.model_validate(body)
            except ValidationError as e:  # NOTE: named as the Responses request names its fields
                raise RequestValidationError([{**err, "loc": tuple(RA.RENAMES.get(x, x) if isinstance(x, str) else x
                                                                   for x in err.get("loc", ()))}
                                              for err in e.errors()]) from None
            answer = await chat_answer(chat, request, RA.RENAMES)
            keep = functools.partial(stored.keep, raw) if RA.stores(raw) else None
            if isinstance(answer, StreamingResponse):
                begin = functools.partial(stored.begin, raw) if RA.stores(raw) else None
                streamed = True  # NOTE: its end (keep) frees the id
                return StreamingResponse(RA.events(raw, config.served_model_name, answer.body_iterator, keep,
                                                   engine.default_sampling, begin),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            if not isinstance(answer, JSONResponse) or answer.status_code != 200:
                return answer  # NOTE: the client went away (499): nothing to convert
            resp = RA.response_body(raw, json.loads(answer.body), engine.default_sampling)
            if keep is not None:
                keep(resp)
            return JSONResponse(resp)
        finally:
            if named is not None and not streamed:
                stored.release(named)

    @app.get("/v1/responses/{response_id}")
    async def responses_get(response_id: str, request: Request):
        for key, value in request.query_params.items():  # NOTE: OpenAI's stream, starting_after, include[]
            if key == "stream" and value.lower() in ("false", "0", ""):
                continue
            why = ("a stored response is sent whole, not streamed again" if key in ("stream", "starting_after") else
                   "it adds nothing to a stored response here" if key.startswith("include") else "no such option")
            raise ApiError(400, f"{key}={value} is not supported when reading a stored response ({why}); leave it "
                                "out.", param=key.rstrip("[]"), code="invalid_value")
        with _not_stored():
            return JSONResponse(stored.get(response_id).resp)

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str):
        with _not_stored():
            stored.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def responses_input_items(response_id: str, order: str = "desc", limit: int = 20, after: str | None = None):
        """The response's own input items (OpenAI's list: newest first unless order=asc)."""
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise ApiError(400, "order must be asc or desc and limit 1 to 100.", param="order" if order not in (
                "asc", "desc") else "limit", code="invalid_value")
        with _not_stored():
            items = stored.get(response_id).items
        items = [{**item, "id": item.get("id") or f"item_{response_id}_{i}"} for i, item in enumerate(items)]
        items = items[::-1] if order == "desc" else items
        start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), None) if after else 0
        if start is None:  # NOTE: a cursor of no item here gave the first page again (a pager looped)
            raise ApiError(400, f"after names no input item of response {response_id!r}: {after!r}.", param="after",
                           code="invalid_value")
        page = items[start:start + limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        arrival, answer = time.monotonic(), None
        check_model(body.model)
        try:
            with _client_errors():
                try:
                    answer = await _unless_gone(request, create_embeddings(
                        aengine, body, config.served_model_name, config.embedding_pooling))
                except RuntimeError as e:  # NOTE: an OpenAI error body, not a bare 500
                    raise _engine_failure(e) from None
            return answer
        finally:
            metrics.observe_embedding(config.served_model_name, answer is not None,
                                      answer["usage"]["prompt_tokens"] if answer else 0, arrival, time.monotonic())

    async def _serve(request: Request, body, kind: str, prompts: list, params, arrival: float, renames=None,
                     tool_plan=None, echo=(None, None), tails=None):
        """`echo`: completions' (per prompt (text, ids, pairs or None) to echo, or None; per prompt
        (ids, pairs) of prompt_logprobs, or None); `tails`: completions' per prompt the bytes of
        its last tokens that leave a character open (text_offset counts them), or None."""
        check_queue()
        rid = body.response_id(kind)
        gen = _Generation(aengine, f"{kind}-{uuid.uuid4().hex}", len(prompts))  # NOTE: unique, whatever request_id is
        # NOTE: a schema a tool_choice made is the tools' (an unusable one names them)
        schema_param = _schema_param(tool_plan, body)
        schema_param = (renames or {}).get(schema_param, schema_param)  # NOTE: /v1/responses: text.format
        # NOTE: "json_schema cannot be used: ..." names the field the schema came from (the tools'
        # parameters of a tool_choice that calls a function: json_schema is no field of theirs)
        fields = {f: schema_param for f in ("json_schema", "structured_outputs.regex", "structured_outputs.choice",
                                            "structured_outputs.grammar")}
        # NOTE: the schema's field first, then what the request called it (/v1/responses: text.format)
        with _client_errors({**fields, **(renames or {})}, {k: (renames or {}).get(v, v) for k, v in fields.items()}):
            await gen.start(prompts, params)
        tracker = R.ChoiceTracker(params.n)
        report = _Report(metrics, tracker, arrival, len(prompts) * params.n, config.served_model_name)
        name = config.served_model_name
        # NOTE: the special tokens a completion's text leaves out take no characters of its text_offset
        skipped = engine.tokenizer.skipped_ids if params.skip_special_tokens else frozenset()
        # NOTE: a schema-constrained output has no room to reason: it is all content
        thinking = (config.reasoning_parser if kind == "chatcmpl" and params.constraint is None else None,
                    getattr(body, "include_reasoning", True))
        if body.stream:
            return StreamingResponse(_paced(_stream(gen, tracker, report, rid, name, kind, body.include_usage,
                                                    decode_token, tool_plan, schema_param, body.continuous_usage,
                                                    thinking, echo[0], tails, skipped)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        status, reasons = "abort", None
        try:
            done = await _until_disconnect(request, _collect(gen, tracker, report, schema_param))
            if not done:
                return Response(status_code=499)  # nobody reads it; the request is aborted
            status = tracker.choices()[0][1].finish_reason or "stop"
            # NOTE: built off the event loop: n=128 x 480 tokens of 20 logprobs took 12 s of it, and every other
            # client waited that long
            if kind == "chatcmpl":
                out = await off_loop(R.chat_body, rid, name, tracker, decode_token, tool_plan, *thinking)
            else:
                out = await off_loop(R.completion_body, rid, name, tracker, decode_token, *echo,
                                     engine.tokenizer.decoded_token, tails, skipped)
            # NOTE: each choice's reason as the client sees it ("tool_calls" too)
            reasons = {c["index"]: c["finish_reason"] for c in out["choices"]}
        except RuntimeError as e:  # NOTE: EngineDeadError too
            status = "error"
            raise _engine_failure(e) from None
        except ApiError:
            status = "error"
            raise
        finally:
            gen.abort()
            report.finish(status, reasons)
        return await off_loop(JSONResponse, out)  # NOTE: its json.dumps too (80 MB there)

    return app


# ------------------------------------------------------------------------------ generation
class _Generation:
    """The engine requests (one per prompt) behind one API request, merged into one queue."""

    def __init__(self, aengine: AsyncEngine, rid: str, num_prompts: int):
        self.aengine = aengine
        self.sink: asyncio.Queue = asyncio.Queue()
        self.index = {f"{rid}-{i}": i for i in range(num_prompts)}
        self.pending = set(self.index)

    async def start(self, prompts: list, params) -> None:
        try:
            for rid, prompt in zip(self.index, prompts):
                await self.aengine.add(rid, prompt, params, self.sink)
        except BaseException:
            self.abort()
            raise

    async def outputs(self):
        """(prompt index, RequestOutput) until every request finished; raises an engine error."""
        while self.pending:
            item = await self.sink.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.pending.discard(item.request_id)
            yield self.index[item.request_id], item

    def abort(self) -> None:
        for rid in self.pending:
            self.aengine.abort(rid)
        self.pending.clear()


class _Report:
    """Feeds ServerMetrics for one API request."""

    def __init__(self, metrics: ServerMetrics, tracker: R.ChoiceTracker, arrival: float, num_seqs: int, model: str):
        self.metrics, self.tracker, self.arrival, self.num_seqs = metrics, tracker, arrival, num_seqs
        self.model = model
        self.first_token: float | None = None

    def saw(self, pieces: list[R.Piece]) -> None:
        if self.first_token is None and any(p.token_ids for p in pieces):
            self.first_token = time.monotonic()

    def finish(self, status: str, reasons: dict | None = None) -> None:
        """`reasons`: choice index -> its finish reason, where the request ended well (else every
        sequence takes `status`)."""
        u = self.tracker.usage()
        end = time.monotonic()
        own = dict(self.tracker.choices())  # choice index -> its CompletionOutput (those with an output)
        seqs = []
        for i in range(self.num_seqs):
            c = own.get(i)
            # NOTE: a choice that ended before an abort or error keeps its own reason
            seq_status = (reasons or {}).get(i) or (c.finish_reason if c is not None else None) or status
            if c is None:
                seqs.append((seq_status, None, 0, None, None, None))
                continue
            first, last, done = c.times
            group = self.tracker.latest[i // self.tracker.n]
            seqs.append((seq_status, len(group.prompt_token_ids), len(c.token_ids),
                         first if first is not None else self.first_token, last, done or end))
            # NOTE: vLLM's phases of each engine request (each of n too)
            self.metrics.observe_phases(self.model, group.metrics, done or end, first)
        self.metrics.observe_request(self.model, seqs, u["prompt_tokens"], u["completion_tokens"], self.arrival)


async def _collect(gen: _Generation, tracker: R.ChoiceTracker, report: _Report, param: str) -> None:
    async for index, out in gen.outputs():
        _check_failed(out, param)
        report.saw(tracker.update(index, out))


@contextmanager
def _not_stored(param: str | None = None):
    """A response id the /v1/responses store does not hold: the client's 404."""
    from .responses_api import NotStored
    try:
        yield
    except NotStored as e:
        raise ApiError(404, str(e), param=param, code="response_not_found") from None


def _engine_failure(e: RuntimeError) -> ApiError:
    """The engine stopped (503 engine_stopped) or failed on the request (500 engine_error)."""
    if isinstance(e, EngineDeadError):
        return ApiError(503, str(e), type_="server_error", code="engine_stopped")
    return ApiError(500, str(e), type_="server_error", code="engine_error")


def _schema_param(tool_plan, body=None) -> str:
    """The request field an output constraint came from: tools (a tool_choice), guided_json,
    guided_regex, guided_choice, guided_grammar, structured_outputs or response_format."""
    if tool_plan is not None and tool_plan.schema is not None:
        return "tools"
    field = body.constraint_field() if hasattr(body, "constraint_field") else None
    return field or "response_format"


def _check_failed(out, param: str = "response_format") -> None:
    """A choice the engine ended with an error (its JSON schema allowed no next token: no finite
    value completes it) fails the request, in one sentence; it never passes for a stop. `param`:
    where the schema came from (tools, for a tool_choice that calls a function)."""
    for c in out.outputs:
        if c.finish_reason == "error":
            code = "invalid_json_schema" if str(c.stop_reason).startswith("the JSON schema") else "invalid_value"
            raise ApiError(400, _sentence(str(c.stop_reason)), param=param, code=code)


async def _unless_gone(request: Request, work):
    """The result of the coroutine `work`, or (work cancelled: what it runs on the engine one
    call at a time stops) a 499 nobody reads when the client disconnects first."""
    box = {}

    async def run():
        box["v"] = await work
    if not await _until_disconnect(request, run()):
        raise ApiError(499, "The client closed the connection before the answer was ready.", code="client_closed")
    return box["v"]


async def _until_disconnect(request: Request, work) -> bool:
    """Run `work`; False (and work cancelled) if the client disconnects first."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        task.result()
        return True
    return False


async def _paced(events):
    """The events, with the event loop let run after each: a burst of several steps' chunks was
    written without a pause, so a client's hang-up (its connection_lost callback) was seen only
    after the whole burst, and asyncio logged "socket.send() raised exception." for every write past
    the fifth (97 lines for 10 streams cut under --num-scheduler-steps 8)."""
    async for event in events:
        yield event
        await asyncio.sleep(0)


async def _stream(gen, tracker, report, rid, model, kind, include_usage, decode, tool_plan=None,
                  schema_param: str = "response_format", continuous_usage: bool = False, thinking=(None, True),
                  echo=None, tails=None, skipped=frozenset()):
    """SSE events of one request. Cancelled (client gone) -> finally aborts the request.
    `continuous_usage`: every chunk carries the usage so far (then the chat's opening role chunks
    wait for the first output, as vLLM sends them, when the prompt's tokens are counted)."""
    created, chat = int(time.time()), kind == "chatcmpl"
    status, offsets, reasons = "abort", {}, None
    calls = {} if tool_plan is not None and tool_plan.parses else None  # choice index -> ToolStream
    api_reason = {}  # choice index -> its finish_reason as sent, where tools rewrote it
    parser, include_reasoning = thinking
    thinks = {} if parser is not None else None  # choice index -> ReasoningStream
    held: dict[int, tuple] = {}  # choice index -> (token ids, logprobs) of text the reasoning stream holds back

    def event(chunk: dict, opening: bool = False) -> str:
        if continuous_usage:  # NOTE: as vLLM, each chunk its own choice's usage so far
            chunk["usage"] = tracker.usage_of(chunk["choices"][0]["index"], opening)
        return R.sse(chunk)
    roles = [R.chat_chunk(rid, model, created, None, i, decode, include_usage)
             for i in range(len(gen.index) * tracker.n)] if chat else []
    try:
        if not continuous_usage:
            for chunk in roles:
                yield event(chunk, opening=True)
            roles = []
        async for index, out in gen.outputs():
            _check_failed(out, schema_param)
            pieces = tracker.update(index, out)
            report.saw(pieces)
            for chunk in roles:
                yield event(chunk, opening=True)
            roles = []
            for p in pieces:
                if echo is not None and p.index not in offsets:  # NOTE: the prompt first, as its own chunk
                    text, ids, pairs = echo[p.index // tracker.n]
                    first = R.Piece(p.index, text, list(ids), None if pairs is None else [None, *pairs])
                    yield event(R.completion_chunk(rid, model, created, first, decode, include_usage, offsets))
                if thinks is not None:  # NOTE: the reasoning first; its content goes on as the piece's text
                    from .reasoning import ReasoningStream
                    rs = thinks.setdefault(p.index, ReasoningStream(parser))
                    reasoning, text = rs.feed(p.text)
                    if p.finish_reason is not None:
                        more = rs.finish()
                        reasoning, text = reasoning + more[0], text + more[1]
                    # NOTE: as vLLM, tokens' logprobs ride with the text they wrote: those of tokens whose
                    # text is held back (a tag's beginning) wait for the next chunk that has text
                    ids, lps = held.pop(p.index, ([], []))
                    ids, lps = ids + list(p.token_ids), None if p.logprobs is None else lps + list(p.logprobs)
                    if reasoning and include_reasoning:
                        yield event(R.reasoning_chunk(rid, model, created, p.index, reasoning, include_usage,
                                                      R.chat_logprobs(ids, lps, decode)))
                        ids, lps = [], None if lps is None else []
                    if not text and p.finish_reason is None:
                        if ids:
                            held[p.index] = (ids, lps or [])
                        continue  # NOTE: no content yet: no empty chunk after the reasoning's
                    p = dataclasses.replace(p, text=text, token_ids=ids, logprobs=lps)
                if calls is not None:
                    for chunk in _tool_chunks(calls, tool_plan, p, rid, model, created, decode, include_usage):
                        reason = chunk["choices"][0].get("finish_reason") if chunk.get("choices") else None
                        if reason is not None:
                            api_reason[p.index] = reason  # NOTE: "tool_calls", as the client sees it
                        yield event(chunk)
                    continue
                chunk = (R.chat_chunk(rid, model, created, p, p.index, decode, include_usage) if chat
                         else R.completion_chunk(rid, model, created, p, decode, include_usage, offsets,
                                                 tails[p.index // tracker.n] if tails and echo is None else b"",
                                                 skipped))
                yield event(chunk)
        status = api_reason.get(0) or tracker.choices()[0][1].finish_reason or "stop"
        reasons = {i: api_reason.get(i) or c.finish_reason for i, c in tracker.choices()}
        if include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield R.sse(R.usage_chunk(rid, obj, model, created, R.chat_usage(tracker, parser, decode) if chat
                                      else tracker.usage()))
        yield R.sse("[DONE]")
    except RuntimeError as e:  # NOTE: EngineDeadError too: the error a body would get
        status = "error"
        err = _engine_failure(e)
        yield R.sse(R.error_body(err.message, err.type, code=err.code))
        yield R.sse("[DONE]")
    except ApiError as e:
        status = "error"
        yield R.sse(R.error_body(e.message, e.type, e.param, e.code))
        yield R.sse("[DONE]")
    finally:
        gen.abort()
        report.finish(status, reasons)


def _tool_chunks(streams: dict, tool_plan, p, rid, model, created, decode, include_usage) -> list[dict]:
    """The chunks of piece `p` of a chat with tools: its text less what may open a call; at the
    end, the rest of the text, then the calls whole, with the finish reason."""
    from .tools import ToolStream
    ts = streams.setdefault(p.index, ToolStream(tool_plan))
    text = ts.feed(p.text)
    # NOTE: text held back as a possible call, with no logprobs to carry, makes no chunk (a stream of
    # empty deltas went out while a forced call was written)
    empty = p.logprobs is None
    if p.finish_reason is None:
        if not text and empty:
            return []
        return [R.chat_chunk(rid, model, created, dataclasses.replace(p, text=text), p.index, decode, include_usage)]
    rest, calls = ts.finish(R.ended_whole(p.finish_reason, p.stop_reason))
    last = dataclasses.replace(p, text=text + rest, finish_reason=None, stop_reason=None)
    out = [] if not (text + rest) and empty else [R.chat_chunk(rid, model, created, last, p.index, decode,
                                                               include_usage)]
    if calls:
        out.append(R.tool_calls_chunk(rid, model, created, p.index, calls, include_usage))
        p = dataclasses.replace(p, text="", token_ids=[], logprobs=None,
                                finish_reason=R.calls_finish_reason(p.finish_reason, tool_plan.mode))
    else:
        p = dataclasses.replace(p, text="", token_ids=[], logprobs=None)
    out.append(R.chat_chunk(rid, model, created, p, p.index, decode, include_usage))
    return out


# ------------------------------------------------------------------------------ errors
_TYPE_TAG = re.compile(r"^([A-Z]\w*|str|int|float|bool|list|dict|none|.*[\[\-].*)$")


def _sentence(msg: str, capitalize: bool = True) -> str:
    msg = msg.strip() or "The request is invalid."
    if capitalize:
        msg = msg[0].upper() + msg[1:]
    return msg if msg.endswith((".", "?", "!")) else msg + "."


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "The request body is invalid.", None
    e = errors[0]
    loc = [x for x in e.get("loc", ()) if x != "body"]
    param = ".".join(str(x) for x in loc if isinstance(x, int) or not _TYPE_TAG.match(str(x))) or None
    kind = e.get("type", "")
    if kind == "json_invalid":
        return "The request body is not valid JSON.", None
    if kind == "missing":
        return (f"The field {param!r} is required." if param else "A JSON request body is required."), param
    where = f"{param!r}" if param else "the request body"
    return _sentence(f"Invalid value for {where}: {e.get('msg', 'invalid')}"), param


def _install_error_handlers(app: FastAPI) -> None:
    def render(status, message, type_="invalid_request_error", param=None, code=None, headers=None):
        return JSONResponse(R.error_body(message, type_, param, code), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(_, exc: ApiError):
        return render(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        if param is None and b"json" not in request.headers.get("content-type", "").encode():
            message = "The request body must be a JSON object sent with 'Content-Type: application/json'."
        return render(400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        messages = {404: "There is no such endpoint; see /openapi.json.",
                    405: "This endpoint does not accept that HTTP method."}
        message = messages.get(exc.status_code) or _sentence(str(exc.detail))
        # NOTE: a chunked body past the limit, found as it is read: the code a declared length gets
        code = "request_too_large" if exc.status_code == 413 else str(exc.status_code)
        return render(exc.status_code, message, code=code, headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def dead(_, exc: EngineDeadError):
        return render(503, str(exc), "server_error", code="engine_stopped")

    @app.exception_handler(Exception)
    async def failed(_, exc: Exception):
        # NOTE: anything else is the server's fault: an OpenAI error body, never a bare text 500
        # (Starlette still hands the exception on, so the log keeps its traceback)
        return render(500, _sentence(f"The server failed on this request ({type(exc).__name__}: {exc})"),
                      "server_error", code="internal_error")


# ------------------------------------------------------------------------------ middleware
def bearer_tokens(api_key) -> list[bytes] | None:
    """The Authorization header values that pass: one per key; None without a key."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    return [f"Bearer {k}".encode() for k in keys] or None


def authorized(header: bytes, expected: list[bytes]) -> bool:
    """Whether the header is one of the expected values (each compared in constant time)."""
    return any([hmac.compare_digest(header, e) for e in expected])


class _Guard:
    """Pure ASGI middleware (streams and disconnects pass through untouched): API key, body size
    limit, and the count of responses by status code."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics):
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body_bytes, metrics
        self.expected = bearer_tokens(api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.http_responses.labels(str(message["status"])).inc()
            await send(message)

        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            if not authorized(headers.get(b"authorization", b""), self.expected):
                return await _send_error(counting_send, 401, "A valid API key is required; send "
                                         "'Authorization: Bearer <key>'.", "authentication_error", "invalid_api_key")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            return await _send_error(counting_send, 413, f"The request body exceeds the limit of {self.max_body} "
                                     "bytes.", code="request_too_large")
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body:
                raise StarletteHTTPException(413, f"The request body exceeds the limit of {self.max_body} bytes.")
            return message

        try:
            await self.app(scope, limited_receive, counting_send)
        except asyncio.CancelledError:
            # NOTE: uvicorn cancels a request still open when its shutdown grace ends or on a
            # second signal (exit now); answer what has not started, and end without a traceback.
            if not started:
                with contextlib.suppress(Exception):
                    await _send_error(counting_send, 503, "The server is shutting down.", "server_error",
                                      "shutting_down")


async def _send_error(send, status: int, message: str, type_="invalid_request_error", code=None):
    body = JSONResponse(R.error_body(message, type_, None, code), status_code=status)
    await send({"type": "http.response.start", "status": status, "headers": body.raw_headers})
    await send({"type": "http.response.body", "body": body.body})
