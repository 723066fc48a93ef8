"""The HTTP front (numa_runtime/serve/front.py) against a scripted rank 0: bytes pass unchanged,
keep-alive connections carry one request after another, and when rank 0's side closes, what the
client gets depends on where its request stood."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading

import httpx
import pytest

FRONT = os.path.join(os.path.dirname(__file__), "..", "numa_runtime", "serve", "front.py")
EVENT = b'data: {"choices": [{"text": "hi"}]}\n\n'
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
               b"transfer-encoding: chunked\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class ScriptedRank0:
    """A Unix-socket server that answers each request on a connection with the next of `script`'s
    byte strings, closing the connection after one that is None-terminated."""

    def __init__(self, script, handler=None):
        self.script = list(script)
        self.handler = handler
        self.dir = tempfile.mkdtemp(prefix="numa-front-test-")
        self.path = os.path.join(self.dir, "http.sock")
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_unix_server(self.handler or self._serve, self.path))
        self.ready.set()
        self.loop.run_forever()

    async def _serve(self, reader, writer):
        try:
            while self.script:
                head = await reader.readuntil(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:")]
                if length:
                    await reader.readexactly(length[0])
                answer, close = self.script.pop(0)
                writer.write(answer)
                await writer.drain()
                if close:
                    break
        finally:
            writer.close()


@pytest.fixture
def front():
    procs = []

    def start(script, handler=None, args=(), preexec_fn=None, backend=None):
        backend = backend or ScriptedRank0(script, handler).path
        public = socket.socket()
        public.bind(("127.0.0.1", 0))
        proc = subprocess.Popen([sys.executable, "-P", FRONT, "--fd", str(public.fileno()), "--backend", backend,
                                 *args], stdin=subprocess.PIPE, pass_fds=(public.fileno(),), stderr=subprocess.PIPE,
                                preexec_fn=preexec_fn)
        port = public.getsockname()[1]
        public.close()
        proc.stdin.write(b"ready\n")
        proc.stdin.flush()
        procs.append(proc)
        for _ in range(400):  # NOTE: the front listens once it has read "ready"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=10).close()
                break
            except ConnectionRefusedError:
                threading.Event().wait(0.025)
        else:
            raise AssertionError("the front never listened")
        return f"http://127.0.0.1:{port}", proc

    yield start
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=30)


def post(client: httpx.Client, base: str):
    return client.post(base + "/v1/completions", json={"prompt": "x"})


def test_keep_alive_requests_pass_unchanged(front):
    body = b'{"ok": 1}'
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    stream = STREAM_HEAD + chunk(EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    base, _ = front([(ok, False), (stream, False), (ok, False)])
    with httpx.Client(timeout=30) as client:
        assert post(client, base).json() == {"ok": 1}
        with client.stream("POST", base + "/v1/completions", json={"prompt": "x"}) as r:
            assert list(r.iter_lines()) == [EVENT.decode().strip(), "", "data: [DONE]", ""]
        assert post(client, base).json() == {"ok": 1}


def test_a_request_rank_0_never_answered_gets_a_503(front):
    base, proc = front([(b"", True)])
    with httpx.Client(timeout=30) as client:
        r = post(client, base)
    assert r.status_code == 503 and r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["code"] == "engine_stopped"


def test_a_stream_cut_between_events_ends_with_an_error_event(front):
    base, _ = front([(STREAM_HEAD + chunk(EVENT) + chunk(EVENT), True)])
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", base + "/v1/completions", json={"prompt": "x"}) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[:2] == [EVENT.decode().strip()] * 2 and lines[-1] == "data: [DONE]", lines
    assert json.loads(lines[2][len("data: "):])["error"]["message"].startswith("The engine stopped")


@pytest.mark.parametrize("cut", [20, -2], ids=["mid-data", "before-crlf"])
def test_a_stream_cut_inside_an_event_is_left_incomplete(front, cut):
    """Nothing can follow half a chunk: the client gets rank 0's bytes as they were, then the close."""
    sent = STREAM_HEAD + chunk(EVENT) + chunk(EVENT)[:cut]
    base, _ = front([(sent, True)])
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        got = b""
        while data := sock.recv(65536):
            got += data
    assert got == sent


def test_an_idle_connection_closed_by_rank_0_is_just_closed(front):
    body = b'{"ok": 1}'
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    base, proc = front([(ok, True)])
    with httpx.Client(timeout=30) as client:
        assert post(client, base).json() == {"ok": 1}
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    assert b"request(s) in flight" not in proc.stderr.read()  # it answered nothing itself


def raw_exchange(base: str, request: bytes) -> bytes:
    """Send request bytes on a fresh connection; everything received until the front closes it."""
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        got = b""
        while data := sock.recv(65536):
            got += data
    return got


GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def ok(text: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text)


def test_pipelined_responses_read_together_are_not_followed_by_a_made_up_503(front):
    """Two answers to two pipelined requests in one read, then rank 0 closes: the client gets the
    two answers and nothing else (the second used to wait unparsed and be taken for unanswered)."""
    base, proc = front([(ok(b"one") + ok(b"two"), True)])
    assert raw_exchange(base, GET + GET) == ok(b"one") + ok(b"two")
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0 and b"in flight" not in proc.stderr.read()


def test_an_answer_before_the_body_keeps_the_connection_followed(front):
    """Rank 0 answers (401) before the request's body has arrived; the connection goes on, and a
    stream on it cut by rank 0's death still ends with the error event and [DONE]."""
    denied = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n"

    async def rank0(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(denied)  # NOTE: before the body
        await writer.drain()
        await reader.readexactly(50000)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(STREAM_HEAD + chunk(EVENT))
        await writer.drain()
        writer.close()  # NOTE: as rank 0's death closes it

    base, _ = front([], handler=rank0)
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50000\r\n\r\n")
        got = b""
        while not got.endswith(denied):
            got += sock.recv(65536)
        sock.sendall(b"x" * 50000 + b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        rest = b""
        while data := sock.recv(65536):
            rest += data
    assert rest.startswith(STREAM_HEAD + chunk(EVENT)), rest
    assert b'"code": "engine_stopped"' in rest and rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), rest


def test_idle_clients_are_closed_by_the_front(front):
    """Rank 0 keeps connections open (its idle close could not be told from a dead rank's); the
    front closes a client idle for --keep-alive seconds, with no answer made up."""
    base, proc = front([(ok(b"one"), False), (ok(b"two"), False)], args=("--keep-alive", "0.3"))
    assert raw_exchange(base, GET) == ok(b"one")  # NOTE: returns once the front closes it
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # NOTE: idle at once
        assert sock.recv(65536) == b""
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0 and b"in flight" not in proc.stderr.read()


def test_a_full_accept_queue_is_waited_for_not_taken_for_a_dead_engine(front, tmp_path):
    """Rank 0 behind on accepting (a long pause) with its queue full: the front's connect failed
    with EAGAIN, which asyncio reported as a connect done, and the client was told the engine had
    stopped and not to retry. It waits for room now, as a client of a full TCP queue does."""
    path = str(tmp_path / "rank0.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    base, _ = front([], backend=path)
    fillers = []
    while True:  # NOTE: fill the queue
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        fillers.append(s)

    def rank0():
        threading.Event().wait(1.0)  # NOTE: the pause: rank 0 accepts nothing for a second
        for s in fillers:
            s.close()
        while True:
            conn, _ = listener.accept()
            head = b""
            while not head.endswith(b"\r\n\r\n") and (data := conn.recv(1)):
                head += data
            if head.startswith(b"GET /health"):
                conn.sendall(ok(b"one"))
                conn.close()
                return
            conn.close()  # NOTE: a filler, or the fixture's probe
    thread = threading.Thread(target=rank0, daemon=True)
    thread.start()
    assert raw_exchange(base, GET) == ok(b"one")
    thread.join(30)
    listener.close()


def test_a_request_waiting_for_100_continue_gets_the_refusal(front, tmp_path):
    """Rank 0 cannot be reached (here: gone): a request that sends its body only after a 100
    (curl, over 1 KiB) got no answer, the front waiting for the body that never came."""
    base, _ = front([], backend=str(tmp_path / "gone.sock"))
    got = raw_exchange(base, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n"
                             b"Expect: 100-continue\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 503 ") and b'"code": "engine_stopped"' in got, got


def test_a_connection_answered_before_its_body_is_closed_when_idle(front):
    """Rank 0 answers (413, 401) before the body, which never comes (curl's Expect: 100-continue
    gives up on the body): the front closes it keep-alive seconds later, as uvicorn does (it
    stayed open for ever, three descriptors in the front and one in rank 0 each)."""
    too_large = b"HTTP/1.1 413 Request Entity Too Large\r\ncontent-length: 0\r\n\r\n"

    async def rank0(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(too_large)  # NOTE: and it keeps the connection, as rank 0 behind the front does
        await writer.drain()
        await reader.read()

    base, _ = front([], handler=rank0, args=("--keep-alive", "0.3"))
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        got = b""
        while data := sock.recv(65536):  # NOTE: a timeout here: never closed
            got += data
    assert got == too_large


def test_a_request_past_the_header_limit_is_refused_by_the_front(front):
    """Headers past h11's limit made the front stop following the connection (no 503 if rank 0
    died, an hour's idle close) while uvicorn, reading them merged, let them through."""
    base, proc = front([(ok(b"one"), False)])
    got = raw_exchange(base, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200000 + b"\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and b"connection: close" in head, got[:300]
    assert json.loads(body)["error"]["message"] == "The request is not valid HTTP/1.1 (its headers are too large)."
    assert raw_exchange(base, GET) == ok(b"one")  # NOTE: rank 0 never saw the refused request


def test_the_front_ignores_stop_signals_and_lifts_its_file_limit(front):
    """It ends with rank 0 (end of file on stdin), not on the SIGTERM that `systemctl stop` or
    `pkill -f numa_runtime.serve` also send it; and a soft limit of 1024 open files (two per
    connection) is raised to the hard one."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= 256:
        pytest.skip(f"the hard limit of open files is {hard}")
    base, proc = front([(ok(b"one"), False)], preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                                    (256, hard)))
    with open(f"/proc/{proc.pid}/status") as f:
        ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    assert all(ignored >> (sig - 1) & 1 for sig in (1, 2, 15)), hex(ignored)
    with open(f"/proc/{proc.pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    assert line.split()[3:5] == [str(hard)] * 2, line


def test_three_pipelined_requests_get_three_answers(front):
    """Every pipelined request is answered (the relay parsed the second answer before the second
    request and died, dropping the third request's answer)."""
    base, proc = front([(ok(b"one") + ok(b"two") + ok(b"three"), True)])
    assert raw_exchange(base, GET + GET + GET) == ok(b"one") + ok(b"two") + ok(b"three")
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    err = proc.stderr.read()
    assert b"connection failed" not in err and b"in flight" not in err, err


def test_an_early_answer_and_close_reach_the_client_whole(front):
    """Rank 0 refuses a large body at once (413) and closes without reading it: the client gets
    that 413, not a 503 saying the engine stopped (the front's failed write dropped the answer)."""
    too_big = b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"

    async def rank0(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(1 << 16)  # NOTE: the body is flowing: the front is writing it
        writer.write(too_big)
        await writer.drain()
        writer.close()

    base, proc = front([], handler=rank0)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
    for _ in range(10):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(head % (6 << 20))
            got = b""
            try:
                for _ in range(96):
                    sock.sendall(b"x" * (1 << 16))
            except OSError:
                pass  # NOTE: the front may close before the client has sent it all
            try:
                while data := sock.recv(65536):
                    got += data
            except OSError:
                pass
        assert got == too_big, got
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0 and b"in flight" not in proc.stderr.read()


def test_a_client_that_half_closes_after_its_request_gets_the_answer(front):
    base, _ = front([(ok(b"one"), False)])
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        got = b""
        while data := sock.recv(65536):
            got += data
    assert got == ok(b"one")


def test_keep_alive_counts_from_the_end_of_the_last_answer(front):
    """A connection stays open --keep-alive seconds after its answer ended, however long the answer
    took (a read begun with the request used to close it right after a slow answer)."""
    import time

    async def slow(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(2.5)  # NOTE: the answer takes 2.5 s, longer than the keep-alive (the scenario, not a wait)
        writer.write(ok(b"late"))
        await writer.drain()
        await reader.read()  # until the front closes

    base, _ = front([], handler=slow, args=("--keep-alive", "1.5"))
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(GET)
        got = b""
        while not got.endswith(b"late"):
            got += sock.recv(65536)
        answered = time.monotonic()
        assert sock.recv(65536) == b""
        assert time.monotonic() - answered >= 1.0  # NOTE: 0.5 s for this reader to be late on a loaded machine


_ECHO_CHECK = """
import asyncio, os, selectors, sys, tempfile
import front

async def main():
    path = os.path.join(tempfile.mkdtemp(), "s")

    async def echo(r, w):
        w.write(b"echo:" + await r.read(100))
        await w.drain()
        w.close()
    server = await asyncio.start_unix_server(echo, path)
    reader, writer, rwriter = await front._open_backend(path)
    fd = writer.transport.get_extra_info("socket").fileno()
    key = asyncio.get_running_loop()._selector.get_map().get(fd)
    reading = key is not None and bool(key.events & selectors.EVENT_READ)
    writer.write(b"hello")
    await writer.drain()
    got = await asyncio.wait_for(reader.read(100), 10)
    server.close()
    print(reading, got)
asyncio.run(main())
"""


def _other_pythons() -> list[str]:
    """Interpreters of other versions (3.10 and later) on this machine: pyenv's and Debian's."""
    import glob
    found = {}
    for exe in sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")) +
                      glob.glob("/usr/bin/python3.[0-9]*")):
        try:
            v = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2] >= (3, 10), sys.version[:4])"],
                               capture_output=True, text=True, timeout=30).stdout.split()
        except OSError:
            continue
        if v and v[0] == "True" and v[1] != sys.version[:4]:
            found.setdefault(v[1], exe)
    return list(found.values())


def test_the_writing_descriptor_never_reads_rank_0s_answers(tmp_path):
    """The connection to rank 0 reads through one descriptor and writes through another; on
    Python 3.10 the writing one was registered for reading too and swallowed rank 0's answers
    (every request through the front hung). Its descriptor is never in the selector for reading,
    and an answer comes back through the reading side: under this Python and every other one the
    machine has (the front's module needs only the standard library and h11)."""
    import h11
    (tmp_path / "h11").symlink_to(os.path.dirname(h11.__file__))
    serve_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "numa_runtime", "serve")
    for exe in [sys.executable, *_other_pythons()]:
        p = subprocess.run([exe, "-c", _ECHO_CHECK], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": f"{serve_dir}{os.pathsep}{tmp_path}"})
        assert p.stdout.strip() == "False b'echo:hello'", (exe, p.stdout, p.stderr[-2000:])


@pytest.mark.parametrize("begun", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty",
                                   b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro"])
def test_a_request_its_client_stops_sending_is_answered_408(front, begun):
    """A client that stops mid-request (its headers or its body) held a connection here and one at
    rank 0 for ever (a slow-loris); after --request-timeout without a byte it gets a 408 and the close.
    One that keeps sending, however slowly, is not cut."""
    base, proc = front([(ok(b"one"), False)], args=("--request-timeout", "1"))
    answer = raw_exchange(base, begun)  # NOTE: returns once the front closes it
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert b"nothing came for 1 s (--request-timeout)" in answer
    body = b'{"prompt": "x"}'
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        # NOTE: 6 pieces 0.3 s apart: 1.8 s in all, past the timeout, 0.7 s to spare at each
        for piece in (head[:20], head[20:40], head[40:], body[:5], body[5:10], body[10:]):
            sock.sendall(piece)
            threading.Event().wait(0.3)
        assert sock.recv(65536) == ok(b"one")
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


def test_a_pipelined_request_waiting_behind_a_long_answer_is_not_timed_out(front):
    """Rank 0 answers request 1 after 1.5 s and, as uvicorn, reads nothing meanwhile; request 2 (1 MiB)
    came pipelined behind it, every byte at once: the front, blocked relaying it, read nothing from the
    client either, and took that for the client's pause (a 408 "nothing came" to a client that never paused)."""
    async def rank0(reader, writer):
        n = 0
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:")]
            if length:
                await reader.readexactly(length[0])
            n += 1
            if n == 1:
                await asyncio.sleep(1.5)
            writer.write(ok(b"%d" % n))
            await writer.drain()
        writer.close()

    base, _ = front([], handler=rank0, args=("--request-timeout", "0.5"))
    port = int(base.rsplit(":", 1)[1])
    body = b"x" * (1 << 20)
    requests = (b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"
                b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        threading.Thread(target=sock.sendall, args=(requests,), daemon=True).start()
        got = b""
        while len(got) < 2 * len(ok(b"1")):
            data = sock.recv(65536)
            if not data:
                break
            got += data
    assert got == ok(b"1") + ok(b"2"), got
