"""The HTTP side of several models: one `build_app` per model over a `ModelView`, and an ASGI
dispatcher in front that picks the app from the request body's `model` and lists every model
at /v1/models. One AsyncEngine (one engine thread) drives the ModelRouter behind all of them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from urllib.parse import parse_qs

from fastapi.responses import JSONResponse

from . import responses as R
from .app import (OPEN_PATHS, ApiError, ServeConfig, authorized, bearer_tokens, build_app, model_card, server_metrics,
                  with_cors)
from .async_engine import AsyncEngine
from .router import ModelLoadError, ModelRouter, ModelUnavailableError


_ROOM_POLL_S = 0.05  # how often a request for a model that does not fit yet tries again


class _ModelInfo:
    """What build_app reads from `aengine.engine`, available before the model is loaded."""

    def __init__(self, router: ModelRouter, name: str):
        self.router, self.name = router, name
        self.tokenizer = router.tokenizers[name]
        self.profiler = None

    @property
    def default_sampling(self) -> dict:
        """The model's generation_config.json sampling values (as its Engine reads them)."""
        eng = self.router.engines.get(self.name)
        if eng is not None:
            return eng.default_sampling
        from ..config import generation_defaults
        if self.router.config.engine_kwargs.get("generation_config", "auto") != "auto":
            return {}
        return generation_defaults(self.router.model_configs[self.name].model_dir)

    @property
    def grammars(self):
        """The loaded engine's Grammars; before the load, one whose prepare() waits for it (the
        engine thread builds llguidance's tokenizer view when it adds the first such request)."""
        eng = self.router.engines.get(self.name)
        return eng.grammars if eng is not None else _Unprepared()

    @property
    def recorder(self):
        """The loaded engine's recorder; before the load, what it will be (AS_PROFILE=ON or not):
        /debug/profile loads the model, as a request does."""
        eng = self.router.engines.get(self.name)
        if eng is not None:
            return eng.recorder
        from ..profiler import profiling_enabled
        return _Recording(profiling_enabled())

    @property
    def max_model_len(self) -> int:
        return self.router.context_len(self.name)

    def check_prompt_ids(self, ids: list[int]) -> None:
        from ..engine import check_prompt_ids
        check_prompt_ids(ids, self.router.model_configs[self.name].vocab_size)

    @property
    def model_config(self):
        return self.router.model_configs[self.name]


class _Recording:
    def __init__(self, enabled: bool):
        self.enabled = enabled


class _Unprepared:
    def prepare(self) -> None:
        pass


class ModelView:
    """The AsyncEngine surface build_app uses, for one model of the router."""

    def __init__(self, aengine: AsyncEngine, router: ModelRouter, name: str, load_timeout: float):
        self.aengine, self.router, self.name, self.load_timeout = aengine, router, name, load_timeout
        self.engine = _ModelInfo(router, name)

    @property
    def is_alive(self) -> bool:
        return self.aengine.is_alive

    @property
    def num_waiting(self) -> int:
        return self.aengine.num_waiting

    @property
    def stats(self):
        return self.aengine.stats

    @property
    def busy_seconds(self) -> float:
        return self.aengine.busy_seconds

    @property
    def seconds_since_last_step(self) -> float:
        return self.aengine.seconds_since_last_step

    async def add(self, request_id: str, prompt, params, sink: asyncio.Queue) -> None:
        def work(since):
            self.router.since[request_id] = since  # NOTE: both before the engine thread sees the request
            self.router.route[request_id] = self.name
            return self.aengine.add(request_id, prompt, params, sink)
        await self._in_time(work)

    def abort(self, request_id: str) -> None:
        self.aengine.abort(request_id)

    async def call(self, fn):
        return await self._in_time(lambda since: self.aengine.call(lambda router: router.call(self.name, fn, since)))

    async def _in_time(self, work):
        """Run work(since) within the load timeout (a model may be loading, or wait for room that
        busy models hold: tried again as their requests end), then 503. While it waits for room it
        is one of the router's `waiters`: requests that arrive after it to the busy models wait
        too, so a steady load on them cannot keep this model out until the timeout."""
        retry = {"Retry-After": str(max(1, round(self.router.load_seconds.get(self.name, self.load_timeout))))}
        since = time.monotonic()
        deadline = since + self.load_timeout
        token = object()
        try:
            while True:
                try:
                    return await asyncio.wait_for(work(since), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise ApiError(503, f"The model {self.name!r} is still loading; retry shortly.", "server_error",
                                   code="model_loading", headers=retry) from None
                except ModelLoadError as e:
                    raise ApiError(500, str(e), "server_error", code="model_load_failed") from None
                except ModelUnavailableError as e:
                    if time.monotonic() + _ROOM_POLL_S >= deadline:
                        raise ApiError(503, str(e), "server_error", code="model_unavailable",
                                       headers=retry) from None
                    self.router.waiters[token] = (self.name, since)
                    await asyncio.sleep(_ROOM_POLL_S)  # NOTE: the busy models' requests end between steps
        finally:
            self.router.waiters.pop(token, None)


def build_multi_app(aengine: AsyncEngine, router: ModelRouter, base: ServeConfig, load_timeout: float):
    """The dispatcher over one app per model; `base` gives every app's limits and API key."""
    from .responses_api import ResponseStore
    apps, metrics = {}, server_metrics(aengine)  # NOTE: one registry: /metrics counts every model
    stored = ResponseStore()  # NOTE: one store: GET /v1/responses/{id} goes to the first app
    for name, spec in router.specs.items():
        # NOTE: a --model's string as typed is one of its names, as with one model (it was a 404)
        given = spec.given if spec.given and spec.given not in router.specs else None
        cfg = dataclasses.replace(base, served_model_name=name, aliases=(given,) if given else (), model_root=given,
                                  cors=None)  # NOTE: CORS once, around the dispatcher
        apps[name] = build_app(ModelView(aengine, router, name, load_timeout), cfg, metrics, stored)
    return with_cors(ModelDispatcher(apps, router, base.api_key, base.max_body_bytes, metrics), base.cors)


# NOTE: the POST routes whose body names a model (any other POST, /ping or a path no app has, goes to the first)
_MODEL_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/tokenize",
                 "/detokenize")


class ModelDispatcher:
    """ASGI: POST bodies go to the app of their `model`; GET /v1/models lists every model;
    everything else (health, metrics, errors it cannot place) goes to the first app."""

    def __init__(self, apps: dict, router: ModelRouter, api_key: str | None, max_body: int, metrics=None):
        self.apps, self.router, self.max_body, self.metrics = apps, router, max_body, metrics
        # every name a request may give -> the model's name (its own, and its --model string as typed)
        self.names = {n: n for n in apps}
        for n, spec in router.specs.items():
            if n in apps and spec.given and spec.given not in self.names:
                self.names[spec.given] = n
        self.first = next(iter(apps.values()))
        self.expected = bearer_tokens(api_key)
        self.created = int(time.time())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self._authorized(scope):
            return await self.first(scope, receive, send)  # its guard answers 401
        if scope["path"] == "/v1/models" and scope["method"] == "GET":
            self._count(200)
            return await JSONResponse(self._models())(scope, receive, send)
        if scope["path"].startswith("/v1/models/") and scope["method"] == "GET":  # models.retrieve
            name = scope["path"][len("/v1/models/"):]
            card = self._card(self.names[name], name) if name in self.names else None
            if card is None:
                return await self._error(scope, receive, send, 404, f"The model {name!r} does not exist; this "
                                         f"server serves {self._names()}.", "model_not_found")
            self._count(200)
            return await JSONResponse(card)(scope, receive, send)
        if scope["path"] == "/debug/profile" and scope["method"] == "GET":  # NOTE: ?model=NAME, else the first
            name = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model", [None])[-1]
            if name is not None and name not in self.names:
                return await self._error(scope, receive, send, 404, f"The model {name!r} does not exist; this "
                                         f"server serves {self._names()}.", "model_not_found")
            return await (self.first if name is None else self.apps[self.names[name]])(scope, receive, send)
        if scope["method"] != "POST" or scope["path"] not in _MODEL_ROUTES:
            # NOTE: GETs, /ping (a POST without a body), unknown paths: the first app answers
            return await self.first(scope, receive, send)
        body, complete = await _read_body(receive, self.max_body)
        replay = _replay(body, receive)
        if not complete:
            return await self.first(scope, replay, send)  # its guard answers 413
        try:
            name = json.loads(body).get("model") if body else None
        except (ValueError, AttributeError):
            # NOTE: not JSON, or not an object: the app explains what is wrong with the body (it
            # was told to name the model)
            return await self.first(scope, replay, send)
        if name is not None and not isinstance(name, str):
            return await self._error(scope, receive, send, 400, f"The request's 'model' must be a string "
                                     f"naming one model, not {json.dumps(name)[:80]}; this server serves "
                                     f"{self._names()}.", "invalid_model")
        if name is None and len(self.apps) > 1:
            return await self._error(scope, receive, send, 400, "Name the model in the request's 'model' "
                                     f"field; this server serves {self._names()}.", "model_required")
        app = self.first if name is None else self.apps.get(self.names.get(name))
        if app is None:
            return await self._error(scope, receive, send, 404, f"The model {name!r} does not exist; this "
                                     f"server serves {self._names()}.", "model_not_found")
        return await app(scope, replay, send)

    def _authorized(self, scope) -> bool:
        if self.expected is None or scope.get("path") in OPEN_PATHS:
            return True
        return authorized(dict(scope.get("headers") or []).get(b"authorization", b""), self.expected)

    def _names(self) -> str:
        return ", ".join(repr(n) for n in self.apps)

    def _models(self) -> dict:
        data = [self._card(n) for n in self.apps]  # NOTE: one entry a model; its --model string is taken, not listed
        return {"object": "list", "data": data}

    def _card(self, n: str, as_name: str | None = None) -> dict:
        r = self.router  # NOTE: the last load's and unload's seconds (None before the first)
        return {**model_card(as_name or n, self.created, r.specs[n].given or n, _ModelInfo(r, n).max_model_len),
                "loaded": n in r.engines, "load_seconds": r.load_seconds.get(n), "unload_seconds": r.unload_seconds.get(n)}

    def _count(self, status: int) -> None:
        """A response the dispatcher gives itself (the apps' guards count theirs)."""
        if self.metrics is not None:
            self.metrics.http_responses.labels(str(status)).inc()

    async def _error(self, scope, receive, send, status, message, code):
        self._count(status)
        resp = JSONResponse(R.error_body(message, "invalid_request_error", "model", code), status_code=status)
        await resp(scope, receive, send)


async def _read_body(receive, limit: int) -> tuple[bytes, bool]:
    """The request body, and False if it grew past `limit` (then only its first part)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), True
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return b"".join(chunks), False
        if not message.get("more_body", False):
            return b"".join(chunks), True


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
