"""AsyncEngine: one thread owns the Engine; asyncio handlers submit requests and read outputs.

The engine thread takes commands (add, abort, call, stop) from a thread-safe inbox, calls
`Engine.step()` while work exists, and hands each RequestOutput to the asyncio queue of its
request with `loop.call_soon_threadsafe`. Nothing else touches the Engine, so the Engine needs
no locks, and under MPI (thread level "funneled") every MPI call is made by the thread that
built the Engine: `__main__` runs `run_forever()` on the main thread and the HTTP server on a
second one.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("numa_runtime.serve")

_IDLE_POLL_S = 0.5  # how often an idle loop checks `should_stop`


@dataclass(frozen=True)
class EngineStats:
    """What /metrics shows about the engine, written by the engine thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_threads: int = 0          # compute threads of the thread that steps the engine
    num_preemptions: int = 0      # since the start (KV blocks given back for a newer request's room)
    prefix_cache_queries: int = 0  # since the start: prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0     # since the start: those served from it
    # several models (a ModelRouter): per model (name, running, waiting, KV usage, hit rate, preemptions,
    # prefix-cache queries, hits)
    per_model: tuple = ()


# NOTE: the server's worker threads (tokenizing, chat templates, large bodies), not the event loop's
# default executor: asyncio.run's end waits for that one's threads, and one that never returned (a chat
# template looping for ever) held the HTTP thread, and so the whole server, for ever
_WORKERS = concurrent.futures.ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 1) + 4),
                                                 thread_name_prefix="numa-work")


async def off_loop(fn, *args, **kwargs):
    """fn(*args, **kwargs) on the server's worker threads (asyncio.to_thread's role)."""
    return await asyncio.get_running_loop().run_in_executor(_WORKERS, functools.partial(fn, *args, **kwargs))


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class AsyncEngine:
    def __init__(self, engine):
        self.engine = engine
        # NOTE: several models: a row each from the start (their gauges and counters were one unlabelled
        # series until the first request, then changed series)
        self.stats = EngineStats(per_model=tuple(engine.model_stats()) if hasattr(engine, "model_stats") else ())
        self._seats = _seats(engine)
        self._held = 0  # sequences the last step left waiting (num_waiting)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # NOTE: put() is reentrant (signal-safe)
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._waiting_calls: list[tuple] = []  # "call"s waiting for KV room (retried after each step)
        self._reserved = None  # the block manager whose blocks the oldest waiting call reserved
        self._thread: threading.Thread | None = None
        # add() commands put in the inbox (written by the event loop only) and taken out of it
        # (by the engine thread only, once the scheduler's count includes the request): their
        # difference is the requests on their way in, counted once
        self._adds_sent = 0
        self._adds_taken = 0
        self._count_lock = threading.Lock()  # the scheduler's count and _adds_taken change together
        self._stopped = threading.Event()
        # NOTE: written by the engine thread, read by others (a float store is atomic)
        self._busy_since: float | None = None  # when the engine thread began its current step or command
        self._last_step = time.monotonic()     # when the last step ended
        self._cancel_at: float | None = None   # shutting down: fail what is in flight from then on
        self._num_threads = 0

    # ------------------------------------------------------------------ asyncio side
    @property
    def is_alive(self) -> bool:
        return not self._stopped.is_set()

    def wait_stopped(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the engine loop to end; whether it has."""
        return self._stopped.wait(timeout)

    @property
    def busy_seconds(self) -> float:
        """How long the engine thread has been inside its current step or command without a
        forward ending (0 when it waits for work): a command of many forwards (embeddings,
        prompt logprobs of a long prompt, in prefill chunks) makes progress at each. A stuck rank
        shows here: its forward never ends."""
        since = self._busy_since
        if since is None:
            return 0.0
        return max(0.0, time.monotonic() - max(since, getattr(self.engine, "last_progress", since)))

    @property
    def seconds_since_last_step(self) -> float:
        return max(0.0, time.monotonic() - self._last_step)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running (still in the inbox or waiting in the scheduler) beyond the
        batch seats free for them (the queue --max-queue bounds). NOTE: requests that arrived
        since the last step waited until it ran: a burst that fit the free seats got 429s."""
        with self._count_lock:
            # held: what the last step left waiting for KV room (the scheduler could not admit it);
            # fresh: arrived since (the inbox, and what the scheduler took after that step)
            held = min(self._held, self.stats.num_waiting)
            fresh = self._adds_sent - self._adds_taken + self.stats.num_waiting - held
            if held:  # NOTE: a backlog: the fresh ones queue behind it, free seats or not
                return held + fresh
            return max(0, fresh - max(0, self._seats - self.stats.num_running))

    async def add(self, request_id: str, prompt: str | list[int], params, sink: asyncio.Queue) -> None:
        """Queue a request; its RequestOutputs (or an exception) will arrive in `sink`.

        Raises what `Engine.add_request` raises (ValueError for a request that cannot run).
        If the caller is cancelled, the request is aborted.
        """
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._adds_sent += 1  # NOTE: before the engine thread can take it; _put takes it back if the loop is gone
        try:
            self._put(("add", request_id, prompt, params, (loop, sink), done))
            await done
        except BaseException:
            # NOTE: a request the engine refused was never added: no abort (a queued abort would
            # remove a retry of the same id, e.g. a model waiting for room, from the router)
            if not (done.done() and not done.cancelled() and done.exception() is not None):
                self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent); its KV blocks are freed by the engine thread."""
        if self.is_alive:
            self._inbox.put(("abort", request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread and return its result."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._put(("call", fn, done))
        return await done

    def _put(self, cmd: tuple) -> None:
        if not self.is_alive:
            if cmd[0] == "add":
                self._took_add()
            raise EngineDeadError("The engine loop has stopped; restart the server.")
        self._inbox.put(cmd)
        if not self.is_alive:
            # NOTE: the loop ended between the check and the put: its last drain of the inbox may
            # have run before the put, and nobody would read the command (an add waited for ever)
            self._fail_inbox(EngineDeadError("The engine loop has stopped; restart the server."))

    # ------------------------------------------------------------------ engine thread
    def start(self) -> None:
        """Run the loop on a background thread (single-process use and tests)."""
        self._thread = threading.Thread(target=self.run_forever, name="numa-engine", daemon=True)
        self._thread.start()

    def shutdown(self, grace_s: float) -> None:
        """Refuse new requests; those in flight may finish for grace_s seconds, then fail with
        EngineDeadError (a stream ends with an error event). Signal-safe."""
        self._inbox.put(("shutdown", time.monotonic() + grace_s))

    def stop(self) -> None:
        """Ask the loop to finish; in-flight requests get EngineDeadError. Signal-safe."""
        self._inbox.put(("stop",))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def run_forever(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """The engine loop. Returns after stop() or when should_stop() turns true."""
        # NOTE: OpenMP's thread count is per calling thread: set it on the one that steps.
        self.engine.ops.set_num_threads(self.engine.num_threads)
        get = getattr(self.engine.ops, "get_num_threads", None)
        self._num_threads = int(get()) if get is not None else self.engine.num_threads
        try:
            while not should_stop():
                busy = self.engine.has_unfinished_requests()
                if not self._drain(block=not busy):
                    break
                if self._cancel_at is not None and time.monotonic() >= self._cancel_at and self._sinks:
                    self._fail_all(EngineDeadError("The server is shutting down; the request was cut short."))
                stepped = self.engine.has_unfinished_requests()
                if stepped:
                    self._busy_since = time.monotonic()
                    self._step()
                    self._last_step = time.monotonic()
                    self._busy_since = None
                if self._waiting_calls:
                    self._retry_calls()
                with self._count_lock:
                    self._update_stats()
                    if stepped:  # NOTE: a backlog only where KV room held them (not a step's token budget)
                        bound = getattr(getattr(self.engine, "scheduler", None), "memory_bound", False)
                        self._held = self.stats.num_waiting if bound else 0
        finally:
            self._busy_since = None
            self._stopped.set()
            self._fail_all(EngineDeadError("The server is shutting down."))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting a little for one if block); False on stop."""
        while True:
            try:
                cmd = self._inbox.get(timeout=_IDLE_POLL_S) if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            kind = cmd[0]
            if kind == "stop":
                return False
            self._busy_since = time.monotonic()
            try:
                self._apply(cmd)
            finally:
                self._busy_since = None

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(*cmd[1:])
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
            self._sinks.pop(cmd[1], None)
        elif kind == "shutdown":
            self._cancel_at = cmd[1] if self._cancel_at is None else min(self._cancel_at, cmd[1])
        elif kind == "call":
            self._call(cmd)

    def _call(self, cmd: tuple) -> bool:
        """Run a call; False if it waits for KV room (retried after the next step)."""
        from ..engine import KVCacheBusyError
        _, fn, fut = cmd
        try:
            _resolve(fut, result=fn(self.engine))
        except KVCacheBusyError as e:
            if not self.engine.has_unfinished_requests():  # NOTE: nothing will free a block
                _resolve(fut, error=e)
                return True
            self._waiting_calls.append(cmd)
            if len(self._waiting_calls) == 1:  # NOTE: the oldest waiting call holds the reservation
                self._reserve(e.block_manager, e.num_blocks)
            return False
        except Exception as e:  # noqa: BLE001 - handed to the caller
            _resolve(fut, error=e)
        return True

    def _retry_calls(self) -> None:
        """Calls that waited for KV room (embeddings, scoring), oldest first, after a step freed
        blocks and before the next step admits new requests into them."""
        waiting, self._waiting_calls = self._waiting_calls, []
        self._reserve(None, 0)
        for i, cmd in enumerate(waiting):
            if cmd[2].done():  # NOTE: the caller gave up (its client went away)
                continue
            if not self._call(cmd):
                # NOTE: in order: the oldest waits first; the blocks it reserved stay reserved
                self._waiting_calls.extend(c for c in waiting[i + 1:] if not c[2].done())
                return

    def _reserve(self, block_manager, num_blocks: int) -> None:
        """Keep `num_blocks` of `block_manager` free of new admissions for the oldest waiting call
        (None: release the reservation), so that a steady flow of new requests cannot starve it."""
        if self._reserved is not None:
            self._reserved.reserve("waiting calls", 0)
        self._reserved = block_manager
        if block_manager is not None:
            block_manager.reserve("waiting calls", num_blocks)

    def _add(self, request_id, prompt, params, sink, fut) -> None:
        if self._cancel_at is not None:
            self._took_add()
            _resolve(fut, error=EngineDeadError("The server is shutting down; retry on another server."))
            return
        try:
            self.engine.add_request(prompt, params, request_id=request_id, cap_max_tokens=False)
        except Exception as e:  # noqa: BLE001 - ValueError/TypeError are the caller's 400s
            self._took_add()
            _resolve(fut, error=e)
            return
        self._sinks[request_id] = sink
        # NOTE: the scheduler's count takes the request as the inbox count lets it go, at once
        # (the queue limit neither misses it nor counts it twice)
        with self._count_lock:
            self._update_stats()
            self._adds_taken += 1
        _resolve(fut, result=None)

    def _took_add(self) -> None:
        with self._count_lock:
            self._adds_taken += 1

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - keep serving: fail what was in flight
            log.exception("engine step failed; aborting %d in-flight requests", len(self._sinks))
            self._fail_all(RuntimeError(f"The engine failed while running this request ({e})."))
            if getattr(self.engine, "_broken", None):  # NOTE: ranks out of step: serving on would
                raise  # give wrong answers; the loop ends, and the server with it (Engine.close)
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            loop, q = sink
            _deliver(loop, q, out)

    def _fail_all(self, error: BaseException) -> None:
        waiting, self._waiting_calls = self._waiting_calls, []
        self._reserve(None, 0)
        for cmd in waiting:
            _resolve(cmd[-1], error=error)
        for rid, (loop, q) in list(self._sinks.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - best effort while failing
                pass
            _deliver(loop, q, error)
        self._sinks.clear()
        self._fail_inbox(error)

    def _fail_inbox(self, error: BaseException) -> None:
        """Answer the commands still in the inbox (they never reached the engine) with `error`."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] in ("add", "call"):
                _resolve(cmd[-1], error=error)
            if cmd[0] == "add":
                self._took_add()

    def _update_stats(self) -> None:
        # NOTE: a ModelRouter (several models) has no scheduler of its own: it sums its engines'
        sched = getattr(self.engine, "scheduler", None) or self.engine
        bm = getattr(self.engine, "block_manager", None) or getattr(sched, "block_manager", None) or self.engine
        self.stats = EngineStats(
            num_running=_num(sched, "num_running", "running"),
            num_waiting=_num(sched, "num_waiting", "waiting"),
            kv_cache_usage=float(getattr(bm, "usage", 0.0) or 0.0),
            prefix_cache_hit_rate=float(getattr(bm, "hit_rate", 0.0) or 0.0),
            num_threads=self._num_threads, num_preemptions=int(getattr(sched, "num_preemptions", 0) or 0),
            prefix_cache_queries=int(getattr(bm, "lookups_total", 0) or 0),
            prefix_cache_hits=int(getattr(bm, "hits_total", 0) or 0),
            per_model=tuple(self.engine.model_stats()) if hasattr(self.engine, "model_stats") else ())


def _seats(engine) -> int:
    """Sequences the engine runs at once (every replica's max_num_seqs); 0 where it has no
    scheduler of its own (a ModelRouter: its models come and go)."""
    sched = getattr(engine, "scheduler", None)
    subs = getattr(sched, "replicas", None) or ([sched] if sched is not None else [])
    return sum(int(getattr(getattr(s, "config", None), "max_num_seqs", 0) or 0) for s in subs)


def _num(obj, count_attr: str, list_attr: str) -> int:
    value = getattr(obj, count_attr, None)
    if value is None:
        value = len(getattr(obj, list_attr, ()) or ())
    return int(value)


def _deliver(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
    except RuntimeError:  # the event loop is closed: nobody is listening
        pass


def _resolve(fut: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    def set_():
        if fut.done():  # the waiter was cancelled
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    try:
        fut.get_loop().call_soon_threadsafe(set_)
    except RuntimeError:
        pass
