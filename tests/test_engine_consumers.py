"""One Engine, several consumers: generate(), stream() and add_request/step interleaved from one
thread. Each consumer gets exactly its own requests' outputs, nothing is lost, nothing hangs."""
import gc
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models import build_model

from numa_runtime import Engine, SamplingParams

PROMPTS = ["Hello world", "The quick brown fox", "Bonjour le monde", "café, naïve", "Numa runtime splits",
           "1234567890 tokens"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    build_model(str(d), arch="llama")
    return str(d)


@pytest.fixture(scope="module")
def eng(model_dir):
    # NOTE: a small pool and few running sequences: requests wait, chunk and get preempted.
    return Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def alone(model_dir):
    """(prompt index, max_tokens[, n]) -> text of that request run by itself on a fresh engine
    (with n: the texts of its n seeded samples)."""
    ref = Engine(model_dir, dtype="float32", kv_cache_memory=1 << 24, max_model_len=256)
    cache = {}

    def text(i: int, max_tokens: int, n: int | None = None):
        if (i, max_tokens, n) not in cache:
            out = ref.generate(PROMPTS[i], greedy(max_tokens) if n is None else sampled(max_tokens, n))[0]
            cache[(i, max_tokens, n)] = out.text if n is None else [c.text for c in out.outputs]
        return cache[(i, max_tokens, n)]
    return text


def sampled(max_tokens: int, n: int) -> SamplingParams:
    # NOTE: each sample draws from its own seeded generator, so what runs beside it cannot matter
    return SamplingParams(n=n, temperature=0.9, top_p=0.95, seed=11, max_tokens=max_tokens, ignore_eos=True)


def assert_idle(eng):
    assert not eng.has_unfinished_requests() and not eng.scheduler.has_unfinished()
    assert eng.block_manager.usage == 0.0


def test_generate_while_a_stream_is_open(eng, alone):
    s = eng.stream(PROMPTS[0], greedy(20))
    first = next(s)
    outs = eng.generate([PROMPTS[1], PROMPTS[2]], greedy(12))
    assert [o.text for o in outs] == [alone(1, 12), alone(2, 12)]
    assert first + "".join(s) == alone(0, 20)
    assert_idle(eng)


def test_two_streams_read_alternately(eng, alone):
    a, b = eng.stream(PROMPTS[0], greedy(24)), eng.stream(PROMPTS[3], greedy(10))
    got = {"a": "", "b": ""}
    live = {"a": a, "b": b}
    while live:
        for name in list(live):
            try:
                got[name] += next(live[name])
            except StopIteration:
                del live[name]
    assert got == {"a": alone(0, 24), "b": alone(3, 10)}
    assert_idle(eng)


def test_step_returns_only_add_request_outputs(eng, alone):
    rid = eng.add_request(PROMPTS[4], greedy(16))
    streamed = "".join(eng.stream(PROMPTS[5], greedy(16)))  # steps the engine: rid advances meanwhile
    outs = []
    while eng.has_unfinished_requests() or not outs or not outs[-1].finished:
        outs += eng.step()
    assert {o.request_id for o in outs} == {rid}
    assert "".join(o.outputs[0].delta for o in outs) == outs[-1].text == alone(4, 16)
    assert sum(len(o.outputs[0].new_token_ids) for o in outs) == 16
    assert streamed == alone(5, 16)
    assert_idle(eng)


def test_abort_gives_the_owner_a_last_output(eng, alone):
    rid = eng.add_request(PROMPTS[0], greedy(30))
    eng.step()
    eng.abort_request(rid)
    outs = eng.step()
    assert outs[-1].request_id == rid and outs[-1].finished and outs[-1].finish_reason == "abort"
    assert alone(0, 30).startswith(outs[-1].text)
    assert_idle(eng)


# ------------------------------------------------------------------------------ random interleavings
OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 12)),
    st.tuples(st.just("add_n"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 12), st.integers(2, 3)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("open"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 12)),
    st.tuples(st.just("read"), st.integers(0, 20)),
    st.tuples(st.just("close"), st.integers(0, 20)),
    st.tuples(st.just("generate"), st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=3),
              st.integers(1, 8)),
)


class Consumers:
    """Plays a list of operations against one engine and checks every consumer's text."""

    def __init__(self, eng, alone):
        self.eng, self.alone = eng, alone
        self.added = {}    # rid -> [prompt index, max_tokens, text so far, aborted]
        self.streams = []  # [generator, prompt index, max_tokens, text so far]

    def run(self, ops):
        for op in ops:
            getattr(self, "op_" + op[0])(*op[1:])
        for s in list(self.streams):  # drain: every stream to its end
            while s in self.streams:
                self.op_read(self.streams.index(s))
        for _ in range(10_000):
            if not self.added:
                break
            self.op_step()
        assert not self.added, "requests never finished"
        assert_idle(self.eng)

    def op_add(self, i, max_tokens):
        self.added[self.eng.add_request(PROMPTS[i], greedy(max_tokens))] = [i, max_tokens, "", False]

    def op_add_n(self, i, max_tokens, n):
        rid = self.eng.add_request(PROMPTS[i], sampled(max_tokens, n))
        self.added[rid] = [i, max_tokens, [""] * n, False, n]

    def op_step(self):
        for o in self.eng.step():
            assert o.request_id in self.added, f"step() returned another consumer's request {o.request_id}"
            entry = self.added[o.request_id]
            if len(entry) == 5:  # n sequences
                for c in o.outputs:
                    entry[2][c.index] += c.delta
            else:
                entry[2] += o.outputs[0].delta
            if o.finished:
                del self.added[o.request_id]
                self._check_final(entry, o)

    def _check_final(self, entry, o):
        if len(entry) == 5:
            want, got = self.alone(entry[0], entry[1], entry[4]), [c.text for c in o.outputs]
            assert entry[2] == got
            assert all(w.startswith(g) for w, g in zip(want, got)) if entry[3] else got == want
            return
        want = self.alone(entry[0], entry[1])
        assert entry[2] == o.text
        assert want.startswith(o.text) if entry[3] else o.text == want

    def op_abort(self, k):
        if self.added:
            rid = sorted(self.added)[k % len(self.added)]
            self.added[rid][3] = True
            self.eng.abort_request(rid)

    def op_open(self, i, max_tokens):
        self.streams.append([self.eng.stream(PROMPTS[i], greedy(max_tokens)), i, max_tokens, ""])

    def op_read(self, k):
        if self.streams:
            s = self.streams[k % len(self.streams)]
            try:
                s[3] += next(s[0])
            except StopIteration:
                self.streams.remove(s)
                assert s[3] == self.alone(s[1], s[2])

    def op_close(self, k):
        if self.streams:
            s = self.streams.pop(k % len(self.streams))
            s[0].close()
            assert self.alone(s[1], s[2]).startswith(s[3])

    def op_generate(self, idx, max_tokens):
        outs = self.eng.generate([PROMPTS[i] for i in idx], greedy(max_tokens))
        assert [o.text for o in outs] == [self.alone(i, max_tokens) for i in idx]


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(ops=st.lists(OPS, max_size=40))
def test_random_interleavings_equal_each_request_alone(eng, alone, ops):
    Consumers(eng, alone).run(ops)


# ------------------------------------------------------------------------------ cost of outputs
def test_an_output_holds_what_it_adds_not_the_whole_sequence(eng):
    """Memory held by outputs 150-199 of one request is about that of outputs 0-49 (each holds
    its own new tokens), not several times more (each held a copy of every token before it)."""
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, logprobs=2)
    tracemalloc.start()  # NOTE: it sees only what is allocated after this
    try:
        rid = eng.add_request([5, 6, 7], sp)
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        late, early = _freed(outs, 150, 200), _freed(outs, 0, 50)
    finally:
        tracemalloc.stop()
    assert len(outs) == 100 and outs[-1].request_id == rid  # outputs 50-149 are left
    assert list(outs[-1].token_ids)[50:] == [t for o in outs for t in o.outputs[0].new_token_ids]
    assert outs[20].outputs[0].token_ids == outs[-1].token_ids[:71] and len(outs[-1].logprobs) == 150
    assert early > 0
    print(f"\nbytes held by outputs 150-199: {late}, by outputs 0-49: {early}")
    assert late / early < 1.5, (late, early)


def _freed(outs: list, lo: int, hi: int) -> int:
    """Bytes freed by dropping outs[lo:hi]."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    del outs[lo:hi]
    gc.collect()
    return before - tracemalloc.get_traced_memory()[0]


# ------------------------------------------------------------------------------ AsyncEngine, many tasks
def test_async_engine_many_tasks_each_get_their_own_text(model_dir, alone):
    """40 asyncio tasks share one AsyncEngine; a third of them abort midway. Every task sees only
    its own request's outputs, the rest equal each request run alone, and the pool ends empty."""
    import asyncio
    import random

    from numa_runtime.serve import AsyncEngine
    eng = Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256, max_num_seqs=4,
                 max_num_batched_tokens=64)
    aengine = AsyncEngine(eng)
    aengine.start()
    rng = random.Random(7)
    jobs = [(f"task-{k}", rng.randrange(len(PROMPTS)), rng.randrange(1, 12), k % 3 == 0) for k in range(40)]

    async def one(rid, i, max_tokens, abort):
        sink = asyncio.Queue()
        await aengine.add(rid, PROMPTS[i], greedy(max_tokens), sink)
        text = ""
        while True:
            out = await asyncio.wait_for(sink.get(), timeout=120)
            assert out.request_id == rid
            text += out.outputs[0].delta
            if abort:
                aengine.abort(rid)
                return "aborted", i, max_tokens, text
            if out.finished:
                return out.text, i, max_tokens, text

    async def run_all():
        return await asyncio.gather(*(one(*job) for job in jobs))
    try:
        results = asyncio.run(run_all())
        assert asyncio.run(aengine.call(lambda e: e.has_unfinished_requests())) is False
        assert eng.block_manager.usage == 0.0
    finally:
        aengine.stop()
    for final, i, max_tokens, streamed in results:
        want = alone(i, max_tokens)
        assert want.startswith(streamed) if final == "aborted" else final == streamed == want


def test_stop_strings_of_every_length_cut_streams_and_outputs_alike(eng, alone):
    """Stop strings of 1-5 characters taken at several places of the greedy text: the streamed
    deltas, the output deltas and the final text all end just before the first occurrence."""
    full = alone(0, 24)
    cases = {full[i:i + k] for k in range(1, 6) for i in range(2, len(full) - k, 7) if full[i:i + k].strip()}
    assert len(cases) >= 10, full
    for stop in sorted(cases):
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "@@@@@@"])
        want = full[:full.index(stop)]
        assert "".join(eng.stream(PROMPTS[0], sp)) == want, stop
        rid = eng.add_request(PROMPTS[0], sp)
        outs = []
        while not outs or not outs[-1].finished:
            outs += eng.step()
        assert {o.request_id for o in outs} == {rid}
        assert "".join(o.outputs[0].delta for o in outs) == outs[-1].text == want, stop
        assert outs[-1].outputs[0].stop_reason == stop
    assert_idle(eng)


def test_async_engine_counts_each_waiting_request_once():
    """A request is counted in the inbox until the scheduler's count includes it, never in both
    (the 429 message said "4 requests waiting" under --max-queue 2) and never in neither. The
    count is read on the event loop right after every stats update of the engine thread."""
    import asyncio
    import threading
    from types import SimpleNamespace
    from numa_runtime.serve.async_engine import AsyncEngine

    class Scheduler:
        def __init__(self):
            self.waiting = []

        @property
        def num_waiting(self):
            return len(self.waiting)

    class FakeEngine:  # requests wait forever: nothing steps
        num_threads = 1
        ops = SimpleNamespace(set_num_threads=lambda n: None)

        def __init__(self):
            self.scheduler = Scheduler()

        def add_request(self, prompt, params, request_id, cap_max_tokens=True):
            self.scheduler.waiting.append(request_id)

        def abort_request(self, rid):
            if rid in self.scheduler.waiting:
                self.scheduler.waiting.remove(rid)

        def has_unfinished_requests(self):
            return False

    seen = []

    class Observed(AsyncEngine):
        def _update_stats(self):
            super()._update_stats()
            if self.loop is not None and threading.current_thread() is not threading.main_thread():
                self.loop.call_soon_threadsafe(lambda: seen.append(self.num_waiting))

    async def main():
        aengine.loop = asyncio.get_running_loop()
        sinks = [asyncio.Queue() for _ in range(6)]
        await asyncio.gather(*(aengine.add(f"r{i}", [1, 2], None, q) for i, q in enumerate(sinks)))
        await asyncio.sleep(0)  # NOTE: lets the last observations run
        return aengine.num_waiting

    aengine = Observed(FakeEngine())
    aengine.loop = None
    aengine.start()
    try:
        assert asyncio.run(main()) == 6
    finally:
        aengine.stop()
    assert seen and max(seen) == 6 and all(n <= 6 for n in seen), seen
    # free batch seats take waiting requests at the next step: only those beyond them queue (a burst that
    # fit max_num_seqs got 429s under --max-queue, counted as waiting until the step ran)
    seen.clear()
    four = FakeEngine()
    four.scheduler.config = SimpleNamespace(max_num_seqs=4)
    four.scheduler.num_running = 1
    aengine = Observed(four)
    aengine.loop = None
    aengine.start()
    try:
        assert asyncio.run(main()) == 3  # 6 waiting, 3 seats free
    finally:
        aengine.stop()
    assert seen and max(seen) == 3, seen
    # ... but requests a step left waiting (no KV room) are a backlog that free seats do not take: they and all
    # that came since queue (the seats hid them: the limit never refused while memory held every request back)
    from numa_runtime.serve.async_engine import EngineStats
    a = AsyncEngine(four)
    a.stats = EngineStats(num_running=1, num_waiting=6)
    assert a.num_waiting == 3  # none held: 6 fresh, 3 seats free
    a._held = 5
    assert a.num_waiting == 6  # 5 held + 1 fresh
    a.stats = EngineStats(num_running=1, num_waiting=2)  # NOTE: held ones aborted since: at most what waits
    assert a.num_waiting == 2


@pytest.mark.parametrize("bound", ["memory", "budget"])
def test_a_step_says_whether_kv_room_held_its_waiting_requests(model_dir, bound):
    """The queue limit counts what a step left waiting for KV room as a backlog; requests a step's
    token budget left waiting are admitted by the next steps, and free seats take them (they counted
    as a backlog: a burst of long prompts got 429s with 15 of 16 seats and the pool free)."""
    kw = dict(kv_cache_memory=6 * 8192) if bound == "memory" else dict(kv_cache_memory=1 << 24, max_num_batched_tokens=64)
    eng = Engine(model_dir, dtype="float32", max_model_len=96, max_num_seqs=16, **kw)
    try:
        for i in range(8):
            eng.add_request(list(range(5 + i, 45 + i)), SamplingParams(max_tokens=4, temperature=0))
        eng.step()
        assert eng.scheduler.num_waiting > 0 and eng.scheduler.memory_bound == (bound == "memory")
    finally:
        eng.close()


def test_threads_sharing_an_engine_are_served_in_turn(model_dir, alone):
    """generate() from several threads at once: each gets its own text (they hung, two threads
    stepping one scheduler)."""
    import threading
    eng = Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256, max_num_batched_tokens=32)
    results, errors = {}, []

    def run(t):
        try:
            for k in range(4):
                i = (t + k) % len(PROMPTS)
                results[(t, k)] = (i, eng.generate(PROMPTS[i], greedy(24))[0].text)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert not errors and not any(t.is_alive() for t in threads), errors
        assert len(results) == 12 and all(text == alone(i, 24) for i, text in results.values())
    finally:
        eng.close()


def test_ctrl_c_in_generate_leaves_other_requests_whole(model_dir, alone):
    """A SIGINT lands in the middle of a step of generate() (right after the scheduler took the
    step's tokens) while a stream is open: generate raises KeyboardInterrupt once the step is
    whole, and the stream's text is still its text alone (the step cut half-way lost the
    stream's tokens, or left it waiting for ever)."""
    import signal
    eng = Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256, max_num_seqs=3,
                 max_num_batched_tokens=16)
    update, calls = eng.scheduler.update, []

    def update_then_interrupt(*args):
        update(*args)
        calls.append(1)
        if len(calls) == 6:
            signal.raise_signal(signal.SIGINT)  # NOTE: its handler runs at once, mid-step
    eng.scheduler.update = update_then_interrupt
    try:
        bg = eng.stream(PROMPTS[0], greedy(24))
        text = next(bg)
        with pytest.raises(KeyboardInterrupt):
            eng.generate(PROMPTS[1:4], greedy(24))
        assert len(calls) >= 6
        text += "".join(bg)
        assert text == alone(0, 24)
        assert not eng.has_unfinished_requests()
        assert eng.generate(PROMPTS[2], greedy(24))[0].text == alone(2, 24)
    finally:
        eng.close()


def test_ctrl_c_while_the_held_handler_is_being_restored(model_dir, alone, monkeypatch):
    """A SIGINT lands after a step ended and before the engine put the caller's SIGINT handler
    back (the clean-clone CI of 2026-12-05 hit it under mpirun): the held handler ran with its list
    already gone and raised AttributeError; now the caller gets its KeyboardInterrupt and the
    engine goes on."""
    import signal
    eng = Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256, max_num_seqs=3)
    real, fired = signal.signal, []

    def restore_after_a_sigint(signum, handler):
        if signum == signal.SIGINT and handler is signal.default_int_handler and not fired:
            fired.append(1)
            signal.raise_signal(signal.SIGINT)  # NOTE: runs the engine's holding handler at once
        return real(signum, handler)
    try:
        monkeypatch.setattr(signal, "signal", restore_after_a_sigint)
        with pytest.raises(KeyboardInterrupt):
            eng.generate(PROMPTS[1], greedy(8))
        assert fired and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert not eng.has_unfinished_requests()
        fired.clear()
        with pytest.raises(KeyboardInterrupt):  # NOTE: a stream adds its request at the first read
            next(eng.stream(PROMPTS[1], greedy(8)))
        monkeypatch.setattr(signal, "signal", real)
        assert fired and not eng.has_unfinished_requests()
        assert eng.generate(PROMPTS[2], greedy(24))[0].text == alone(2, 24)
    finally:
        eng.close()


def test_ctrl_c_in_step_keeps_the_outputs_for_the_next_step(model_dir):
    """vLLM's loop `while has_unfinished_requests(): step()` that catches a KeyboardInterrupt: the
    step's outputs (a finished request's last one) come with the next step() (they were taken out
    before the held Ctrl-C raised, and lost with the return value)."""
    import signal
    eng = Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256)
    try:
        eng.add_request(PROMPTS[0], greedy(1), request_id="r1")
        step = eng._step

        def step_then_ctrl_c():
            step()
            signal.raise_signal(signal.SIGINT)
        eng._step = step_then_ctrl_c
        with pytest.raises(KeyboardInterrupt):
            eng.step()
        eng._step = step
        assert eng.has_unfinished_requests()
        outs = eng.step()
        assert [(o.request_id, o.finished, len(o.outputs[0].token_ids)) for o in outs] == [("r1", True, 1)]
    finally:
        eng.close()


def test_ctrl_c_pending_as_a_change_begins_leaves_later_ones_held(model_dir, alone, monkeypatch):
    """A SIGINT pending when the engine swaps in its holding handler raises from signal.signal; the
    engine kept a mark that it was holding, never held again, and a later Ctrl-C cut an update
    half-way (a request lost its first token's text). A second Ctrl-C while generate() aborts its
    requests leaves none of them running (they were aborted one by one)."""
    import signal
    eng = Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256, max_num_seqs=8)
    real = signal.signal

    def pending_at_install(signum, handler):
        if signum == signal.SIGINT and handler is not signal.default_int_handler:
            signal.raise_signal(signal.SIGINT)  # NOTE: the default handler still in place raises here
        return real(signum, handler)
    try:
        monkeypatch.setattr(signal, "signal", pending_at_install)
        with pytest.raises(KeyboardInterrupt):
            eng.generate(PROMPTS[1], greedy(8))
        monkeypatch.setattr(signal, "signal", real)
        assert not eng.has_unfinished_requests()
        update, calls = eng.scheduler.update, []

        def update_then_ctrl_c(*args):
            update(*args)
            calls.append(1)
            if len(calls) == 2:
                signal.raise_signal(signal.SIGINT)  # NOTE: mid-update: held until the step is whole
        eng.scheduler.update = update_then_ctrl_c
        eng.add_request(PROMPTS[0], greedy(8), request_id="b")
        text, interrupts = None, 0
        while eng.has_unfinished_requests():
            try:
                text = next((o.outputs[0].text for o in eng.step() if o.finished), text)
            except KeyboardInterrupt:
                interrupts += 1
        assert interrupts == 1 and text == alone(0, 8)
        eng.scheduler.update = update
        abort, first = eng.scheduler.abort_request, []

        def abort_with_a_second_ctrl_c(rid):
            if not first:
                first.append(1)
                signal.raise_signal(signal.SIGINT)
            return abort(rid)
        calls.clear()
        eng.scheduler.update = update_then_ctrl_c
        eng.scheduler.abort_request = abort_with_a_second_ctrl_c
        with pytest.raises(KeyboardInterrupt):
            eng.generate(PROMPTS[:6], greedy(40))
        assert first and not eng.has_unfinished_requests() and not eng.scheduler.has_unfinished()
    finally:
        eng.close()


def _abandon_a_stream_in_a_cycle(eng) -> None:
    """A stream() read once and dropped while a reference cycle holds it (frame -> exception ->
    traceback -> frame): only the garbage collector finalizes it (disabled by the caller)."""
    g = eng.stream(PROMPTS[0], greedy(20))
    next(g)
    try:
        raise ValueError("the consumer gave up")
    except ValueError as e:
        err = e
    assert err


def test_a_stream_finalized_inside_a_step_is_aborted_after_it(model_dir, alone):
    """A stream() generator left in a reference cycle is finalized by the garbage collector, which
    may run inside another consumer's step on the same thread: its abort came in the middle of the
    step (KeyError in the step's update); it now waits for the step's end."""
    eng = Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256)
    gc.disable()
    try:
        _abandon_a_stream_in_a_cycle(eng)
        assert eng.get_num_unfinished_requests() == 1
        execute, collected = eng.runner.execute, []

        def execute_then_collect(plan):
            out = execute(plan)
            if not collected:
                collected.append(gc.collect())  # NOTE: as an allocation in the step would
            return out
        eng.runner.execute = execute_then_collect
        assert eng.generate(PROMPTS[1], greedy(20))[0].text == alone(1, 20)
        assert collected and not eng.has_unfinished_requests()
    finally:
        gc.enable()
        eng.close()


def test_close_waits_for_another_threads_step(model_dir):
    """close() beside another thread's step returned while it ran (the step's KV never reached the
    disk tier, and that generate() returned after close()); it now runs between steps, and the
    other thread's request ends with the engine's one-sentence error or its whole output."""
    import threading
    eng = Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256)
    inside, go, order = threading.Event(), threading.Event(), []
    execute = eng.runner.execute

    def held_execute(plan):
        if threading.current_thread().name == "gen" and not go.is_set():
            inside.set()
            go.wait(60)
        out = execute(plan)
        order.append("step")
        return out
    eng.runner.execute = held_execute
    res = {}

    def gen():
        try:
            res["out"] = eng.generate(PROMPTS[0], greedy(4))[0].text
        except RuntimeError as e:
            res["err"] = str(e)
    t = threading.Thread(target=gen, name="gen")
    t.start()
    assert inside.wait(60)
    closer = threading.Thread(target=lambda: (eng.close(), order.append("closed")))
    closer.start()
    closer.join(timeout=1.0)  # NOTE: close() must be waiting for the step, however long this waits
    alive = closer.is_alive()
    go.set()
    closer.join(timeout=60)
    t.join(timeout=60)
    assert alive and order.index("closed") > order.index("step"), order
    assert res.get("err", "").startswith("The engine was closed while this request ran") or res.get("out"), res


def test_async_engine_add_as_the_loop_ends_is_answered():
    """An add() that passed the loop's liveness check as the loop ended (stop, a broken step) was
    put in the inbox after the loop's last drain of it: nobody answered it and the client waited
    for ever. It now gets EngineDeadError."""
    import asyncio
    import queue
    import threading
    from types import SimpleNamespace
    from numa_runtime.serve.async_engine import AsyncEngine, EngineDeadError

    class FakeEngine:  # an idle engine
        num_threads = 1
        ops = SimpleNamespace(set_num_threads=lambda n: None)

        def has_unfinished_requests(self):
            return False

        def abort_request(self, rid):
            pass
    aengine = AsyncEngine(FakeEngine())
    drained = threading.Event()

    class Inbox(queue.SimpleQueue):
        def put(self, item, *args, **kw):
            if item[0] == "add":  # NOTE: add() passed its check; the loop ends before the put
                super().put(("stop",))
                assert drained.wait(60)
            super().put(item, *args, **kw)
    aengine._inbox = Inbox()
    fail_all = aengine._fail_all

    def fail_all_then_mark(err):
        fail_all(err)
        drained.set()
    aengine._fail_all = fail_all_then_mark

    async def main():
        loop = asyncio.get_running_loop()
        t = threading.Thread(target=aengine.run_forever, daemon=True)
        t.start()
        task = asyncio.ensure_future(aengine.add("r1", [1, 2, 3], None, asyncio.Queue()))
        await loop.run_in_executor(None, t.join, 60)
        assert not aengine.is_alive
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 60)
        assert aengine.num_waiting == 0
    asyncio.run(main())


def test_two_ctrl_c_inside_asyncio_run_are_held_to_the_steps_end(model_dir, alone):
    """Inside asyncio.run (Python 3.11 installs its own SIGINT handler: the first Ctrl-C cancels
    the main task, the second raises KeyboardInterrupt) two Ctrl-Cs in the middle of a step's
    update are held until the step is whole, then replayed in order: vLLM's step loop that catches
    KeyboardInterrupt gets the request's text whole (held for Python's own handler only, the second
    cut the update and lost a token's text)."""
    import asyncio
    import signal
    result = {}

    async def main():
        eng = Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256)
        result["handler"] = signal.getsignal(signal.SIGINT)
        update, calls = eng.scheduler.update, []

        def update_then_two_ctrl_c(*args):
            update(*args)
            calls.append(1)
            if len(calls) == 2:
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
        eng.scheduler.update = update_then_two_ctrl_c
        eng.add_request(PROMPTS[0], greedy(8), request_id="b")
        text, interrupts = None, 0
        try:
            while eng.has_unfinished_requests():
                try:
                    text = next((o.outputs[0].text for o in eng.step() if o.finished), text)
                except KeyboardInterrupt:
                    interrupts += 1
        finally:
            eng.close()
        result.update(text=text, interrupts=interrupts)
    with pytest.raises((asyncio.CancelledError, KeyboardInterrupt)):  # NOTE: the first Ctrl-C cancelled main
        asyncio.run(main())
    assert result["handler"] is not signal.default_int_handler  # NOTE: asyncio's own (Python >= 3.11)
    assert result["interrupts"] == 1 and result["text"] == alone(0, 8), result


def test_a_stream_finalized_on_a_thread_the_engine_waits_for_does_not_hang(model_dir):
    """The garbage collector may finalize an abandoned stream() on the grammar compiler's thread
    while the engine's holder waits for that thread (adding a json_schema request): the stream's
    abort waited for the engine's lock, and both hung. It is queued and applied when the add ends."""
    import threading
    from numa_runtime import structured
    eng = Engine(model_dir, dtype="float32", kv_cache_memory=40 * 8192, max_model_len=256)
    gc.disable()
    first, threads, t = structured.Grammars._first_mask, [], None
    try:
        _abandon_a_stream_in_a_cycle(eng)
        assert eng.get_num_unfinished_requests() == 1

        def first_mask_after_gc(self, m):
            threads.append(threading.current_thread().name)
            gc.collect()  # NOTE: as an allocation on that thread would
            return first(self, m)
        structured.Grammars._first_mask = first_mask_after_gc
        done = {}
        t = threading.Thread(target=lambda: done.update(out=eng.generate(
            PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, json_schema={"type": "object"}))), daemon=True)
        t.start()
        t.join(timeout=120)
        assert not t.is_alive(), "the add of a json_schema request hung"
        assert threads and threads[0] != t.name and len(done["out"][0].outputs[0].token_ids) >= 1
        assert not eng.has_unfinished_requests()
    finally:
        structured.Grammars._first_mask = first
        gc.enable()
        if t is None or not t.is_alive():  # NOTE: a hung add holds the engine: close() would wait for ever
            eng.close()
