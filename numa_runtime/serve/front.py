"""The HTTP front: a small process that holds the server's public socket and relays every
connection, byte for byte, to rank 0's HTTP server on a Unix socket.

Why a second process: when an MPI rank is killed by a signal (the out-of-memory killer's
SIGKILL), mpirun kills every other rank at once, rank 0 and its HTTP server with it, and no
handler of ours can run. Rank 0 starts the front in a session of its own, out of mpirun's
reach. When rank 0's side of a connection ends in the middle of a request, the front answers
that request itself: a 503 with one sentence, or, in an event stream already under way, an
error event and [DONE]. Then it closes the port and exits, so a supervisor can restart the
job on the same port.

Both directions are parsed with h11 only to know where each request and response stands; the
bytes go through unchanged. Rank 0 talks to the front on its stdin: "ready" (accept now),
"stopping" (graceful shutdown: accept no more), end of file (rank 0 has exited).

This file is run as a script (`python -P front.py`) and imports nothing from numa_runtime,
so that it starts in a tenth of a second while the model loads.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import http
import json
import resource
import signal
import socket
import sys

import h11

SHUTTING_DOWN = "The server is shutting down; send the request again to another server."
STOPPED = ("The engine stopped before this request finished (one of its processes died or was killed; see the "
           "server's log); restart the server and send the request again.")
_READ = 1 << 16
_MAX_PENDING = 1 << 22  # bytes h11 may hold unparsed before the front stops following a connection
_CONNECT_WAIT_S = 30.0  # rank 0's accept queue full: how long a connection waits for room
_LATE_REQUEST_S = 1.0  # rank 0's side ended between requests: how long a request may still come
_LINGER_S = 2.0  # a request the front refused: how long it reads what the client still sends
_EXIT_AFTER_S = 10.0  # once rank 0 has gone, the longest the front waits for connections to end
_UNTRACKED_IDLE_S = 3600.0  # a connection h11 cannot follow closes after this long without a byte


def raise_file_limit() -> None:
    """The soft limit of open files up to the hard one: the front holds two descriptors a client
    connection and rank 0 one (the usual soft 1024 refused connections near 500 and 1000), as
    vLLM's server raises its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def error_json(message: str, code: str = "engine_stopped") -> bytes:
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": code}}).encode()


def unavailable(message: str, code: str, header: bytes) -> bytes:
    """A whole 503 response with one more header line, ending the connection."""
    body = error_json(message, code)
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n%s\r\n\r\n" % (len(body), header)) + body


def refusal(message: str) -> bytes:
    """Rank 0 has gone. `x-should-retry: false` tells the openai client not to retry (its
    retries would only meet a closed port)."""
    return unavailable(message, "engine_stopped", b"x-should-retry: false")


def bad_request(e: h11.ProtocolError) -> bytes:
    """The answer to a request that is not valid HTTP/1.1 (431: its headers are too large)."""
    status = getattr(e, "error_status_hint", 400)
    status = status if status in (400, 431) else 400
    why = "its headers are too large" if status == 431 else str(e).split(":")[0][:100]  # NOTE: not the bytes
    return client_error(status, f"The request is not valid HTTP/1.1 ({why}).")


def request_timeout(seconds: float) -> bytes:
    """408 to a request its client stopped sending before it was whole (nginx's client header
    and body timeouts): it held a connection here and one at rank 0 for as long as it liked."""
    return client_error(408, f"The request was not sent whole: nothing came for {seconds:g} s "
                             "(--request-timeout); send it again.")


def client_error(status: int, message: str) -> bytes:
    """A 4xx of the front's own, in the API's error format, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": str(status)}}).encode()
    reason = http.HTTPStatus(status).phrase.encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, reason, len(body))) + body


def busy(error: OSError) -> bytes:
    """A 503 the client may retry: this process could not open a connection to rank 0."""
    return unavailable(f"The server cannot take another connection now ({error.strerror or error}); "
                       "retry shortly.", "overloaded", b"retry-after: 1")


def stream_end(message: str) -> bytes:
    """The last chunks of a chunked event stream: an error event, [DONE], the terminating chunk."""
    payload = b"data: " + error_json(message) + b"\n\ndata: [DONE]\n\n"
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)


class Relay:
    """One client connection and its connection to rank 0."""

    def __init__(self, front: "Front", reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.front, self.creader, self.cwriter = front, reader, writer
        # NOTE: the access log (--log-level debug): rank 0 sees the front's Unix socket, the front the client
        peer = writer.get_extra_info("peername") if front.access_log else None
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "-"
        self.requests: list = []  # (method, target, version) of requests whose response has not begun
        self.up = h11.Connection(h11.SERVER)    # what the client sent
        self.down = h11.Connection(h11.CLIENT)  # what rank 0 sent back
        self.tracked = True                     # h11 follows both sides (else: relay only)
        self.event_stream = False               # the response under way is a chunked event stream
        self.at_chunk_end = True                # ... and what went out so far ends on a chunk boundary
        self.client_gone = False
        self.rejected: bytes | None = None      # the front's own answer to a request it cannot parse
        self.tail = b""                         # the last bytes rank 0 sent
        self.upstream: asyncio.Future | None = None
        self.bread_side: asyncio.StreamWriter | None = None  # the backend socket's reading transport
        loop = asyncio.get_running_loop()
        self.idle_since = loop.time()           # when the last response ended (or the connection began)
        self.last_byte = loop.time()            # when a byte last went either way
        self.client_byte = loop.time()          # when the client last sent a byte

    async def run(self) -> None:
        try:
            breader, bwriter, self.bread_side = await _open_backend(self.front.backend)
        except OSError as e:
            # NOTE: refused or gone: rank 0 has stopped; anything else (too many open files) is
            # this process's limit, and the client may retry
            gone = isinstance(e, (ConnectionRefusedError, FileNotFoundError))
            try:
                await self.refuse(wait_s=10.0, answer=refusal(self.front.message()) if gone else busy(e))
            finally:
                self.cwriter.close()
            return
        self.upstream = asyncio.ensure_future(self.client_to_backend(bwriter))
        try:
            await self.backend_to_client(breader)
            if self.rejected is not None:  # NOTE: its lingering close
                await asyncio.wait({self.upstream}, timeout=_LINGER_S + 1.0)
        finally:
            self.upstream.cancel()
            bwriter.close()
            self.bread_side.close()
            self.cwriter.close()

    async def client_to_backend(self, bwriter: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        read = asyncio.ensure_future(self.creader.read(_READ))
        try:
            while True:
                # NOTE: rank 0 keeps connections open; the front closes those idle keep_alive_s
                # after their last response ended (as uvicorn times keep-alive), and those it cannot
                # follow after _UNTRACKED_IDLE_S without a byte either way
                if self.tracked and self.idle():
                    left = self.idle_since + self.front.keep_alive_s - loop.time()
                elif self.tracked and self.answered_early():
                    # NOTE: answered before its body came (413, 401, an early 405): closed as
                    # uvicorn closes it, keep_alive_s after the last byte either way
                    left = self.last_byte + self.front.keep_alive_s - loop.time()
                elif self.tracked and self.sending():
                    # NOTE: a request begun and not whole: its client has request_timeout_s from its
                    # last byte (a client that stops mid-request held both connections for ever)
                    left = self.client_byte + self.front.request_timeout_s - loop.time()
                    if left <= 0:
                        self.client_gone = True
                        await self.send(request_timeout(self.front.request_timeout_s))
                        bwriter.close()
                        self.bread_side.close()
                        return
                    left = min(left, self.front.keep_alive_s)  # NOTE: rank 0 may answer early meanwhile
                elif self.tracked:
                    left = self.front.keep_alive_s
                else:
                    left = self.last_byte + _UNTRACKED_IDLE_S - loop.time()
                if left <= 0:  # NOTE: nothing in flight: close both sides; the relay then ends
                    self.client_gone = True
                    bwriter.close()
                    self.bread_side.close()
                    return
                done, _ = await asyncio.wait({read}, timeout=left)
                if not done:
                    continue
                try:
                    data = read.result()
                except OSError:
                    data = b""
                if not data:
                    # NOTE: the client's end of file, passed on as one: what rank 0 still sends
                    # is relayed (a client that half-closes after its request gets the answer
                    # where rank 0 gives it; uvicorn ends such a connection, with or without the
                    # front); one that has gone makes rank 0 see the disconnect and abort
                    self.client_gone = True
                    try:
                        bwriter.write_eof()
                    except OSError:
                        pass
                    return
                read = asyncio.ensure_future(self.creader.read(_READ))
                self.last_byte = self.client_byte = loop.time()
                self.watch(self.up, data)
                if self.rejected is not None:  # NOTE: not relayed: the front answers it and closes
                    self.client_gone = True
                    await self.send(self.rejected)
                    bwriter.close()
                    self.bread_side.close()
                    # NOTE: a lingering close: half-close, then drop what the client still sends
                    # until its end (or _LINGER_S); a close with its bytes unread reset the
                    # connection, and the client could lose the answer
                    try:
                        self.cwriter.write_eof()
                    except OSError:
                        return
                    end = loop.time() + _LINGER_S
                    while (left := end - loop.time()) > 0:
                        done, _ = await asyncio.wait({read}, timeout=left)
                        if not done or read.exception() is not None or not read.result():
                            return
                        read = asyncio.ensure_future(self.creader.read(_READ))
                    return
                try:
                    bwriter.write(data)
                    await bwriter.drain()
                except OSError:
                    return  # NOTE: rank 0's side has gone; backend_to_client answers the client
                # NOTE: while rank 0 took no more (it answers a pipelined request first), the front read
                # nothing: the client's pause counts from here, not from its last byte read
                self.client_byte = loop.time()
        finally:
            if read.done() and not read.cancelled() and read.exception() is None and read.result():
                self.watch(self.up, read.result())  # NOTE: read, not relayed: refuse() still sees it
            read.cancel()

    async def backend_to_client(self, breader: asyncio.StreamReader) -> None:
        while True:
            try:
                data = await breader.read(_READ)
            except OSError:
                data = b""
            if not data:
                break
            self.last_byte = asyncio.get_running_loop().time()
            self.cwriter.write(data)
            self.tail = (self.tail + data)[-2:]
            self.watch(self.down, data)
            try:
                await self.cwriter.drain()
            except OSError:
                return
        if self.client_gone:
            return
        if self.tracked and self.down.our_state is h11.IDLE:
            # NOTE: rank 0's side ended before a request reached it (between requests, or as it
            # stopped before it read the first): answer one the client has begun or sends now
            await self.answer_late()
            return
        ending = self.ending()
        if ending:
            self.front.answered += 1
            await self.send(ending)

    async def send(self, answer: bytes) -> None:
        """An answer of the front's own to the client (a client gone takes nothing)."""
        self.cwriter.write(answer)
        try:
            await self.cwriter.drain()
        except OSError:
            pass

    async def answer_late(self) -> None:
        """Rank 0's side ended before a request reached it: answer one the client has begun, or
        begins within _LATE_REQUEST_S, at once (as ending() answers one cut mid-body); else close."""
        if self.upstream is not None:
            self.upstream.cancel()  # NOTE: what it read and did not relay, it fed to `up`
            await asyncio.gather(self.upstream, return_exceptions=True)
        begun = self.up.their_state is not h11.IDLE or bool(self.up.trailing_data[0])
        if not begun:
            try:
                begun = bool(await asyncio.wait_for(self.creader.read(_READ), _LATE_REQUEST_S))
            except (OSError, asyncio.TimeoutError):
                pass
        if begun:
            self.front.answered += 1
            await self.send(refusal(self.front.message()))

    def answered_early(self) -> bool:
        """Rank 0 has answered the request under way whole before the request ended."""
        return self.down.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED) and self.up.their_state is not h11.IDLE

    def sending(self) -> bool:
        """A request begun and not whole (its headers or body under way), not answered yet."""
        up = self.up
        return ((up.their_state is h11.SEND_BODY or (up.their_state is h11.IDLE and bool(up.trailing_data[0])))
                and self.down.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED))

    def idle(self) -> bool:
        """Between requests: nothing asked, nothing owed, nothing half-received."""
        return (self.tracked and self.up.their_state is h11.IDLE and self.down.our_state is h11.IDLE
                and not self.up.trailing_data[0])

    def ending(self) -> bytes:
        """What the client still needs when rank 0's side closes: a 503 for a request not yet
        answered, the end of an event stream under way; nothing between requests (the close says
        all) or after a body cut mid-way."""
        if not self.tracked:
            return b""
        d = self.down
        if d.our_state is h11.IDLE:
            return b""
        if d.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            return b""
        if d.their_state is h11.SEND_RESPONSE:
            return refusal(self.front.message())
        # NOTE: h11 reports a chunk's end before its CRLF arrives; an event ends in "\n\n", so
        # a tail of CRLF means the whole chunk went out
        if (d.their_state is h11.SEND_BODY and self.event_stream and self.at_chunk_end
                and self.tail == b"\r\n" and not d.trailing_data[0]):
            return stream_end(self.front.message())
        return b""  # NOTE: a body cut mid-way cannot be ended well; closing says it is incomplete

    def watch(self, conn: h11.Connection, data: bytes) -> None:
        """Feed what went through to one side's parser; mirror every event into the other."""
        if not self.tracked:
            return
        try:
            conn.receive_data(data)
            self.pump()
        except (h11.ProtocolError, AttributeError) as e:
            if (conn is self.up and isinstance(e, h11.ProtocolError) and self.down.our_state is h11.IDLE
                    and self.down.their_state is h11.IDLE):
                # NOTE: a request that is not HTTP/1.1 (or whose headers pass h11's limit) with
                # nothing else under way: answered here, as uvicorn would (it could let headers
                # past the limit through, the front's reads arriving there merged, and the
                # front would have followed the connection no more)
                self.rejected = bad_request(e)
                return
            # NOTE: else rank 0 answers a malformed request itself; just relay (h11 may fail
            # formatting its own error: an AttributeError)
            self.tracked = False
            return
        if len(conn.trailing_data[0]) > _MAX_PENDING:  # e.g. requests pipelined behind a long stream
            self.tracked = False
            self.up = self.down = None

    def pump(self) -> None:
        """Take every event both parsers can give, in turn, until neither can: a response may
        wait in `down` for its request, pipelined, to come out of `up` (and so may a request's
        end arrive after its early answer)."""
        moved = True
        while moved:
            moved = False
            for conn, other in ((self.up, self.down), (self.down, self.up)):
                # NOTE: a response (pipelined) waits until its request has come out of `up`
                while conn is self.up or self.down.our_state is not h11.IDLE:
                    event = conn.next_event()
                    if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                        break
                    moved = True
                    if self.front.access_log:
                        self._log(conn, event)
                    if isinstance(event, h11.Response):
                        headers = dict(event.headers)
                        self.event_stream = (headers.get(b"transfer-encoding", b"").lower() == b"chunked" and
                                             headers.get(b"content-type", b"").startswith(b"text/event-stream"))
                        self.at_chunk_end = True
                    elif isinstance(event, h11.Data) and conn is self.down:
                        self.at_chunk_end = event.chunk_end
                    other.send(event)
                    if isinstance(event, h11.EndOfMessage) and self.cycle_done():
                        self.up.start_next_cycle()
                        self.down.start_next_cycle()
                        self.event_stream = False
                        # NOTE: a pipelined request waited for this answer: its client's pause counts from here
                        self.idle_since = self.client_byte = asyncio.get_running_loop().time()
                        break  # NOTE: `up` first: the next request before the next response

    def _log(self, conn, event) -> None:
        """uvicorn's access line, with the client's address, once a response begins."""
        if conn is self.up and isinstance(event, h11.Request):
            self.requests.append((event.method.decode("latin-1"), event.target.decode("latin-1"),
                                  event.http_version.decode("latin-1")))
        elif conn is self.down and isinstance(event, h11.Response) and self.requests:
            method, target, version = self.requests.pop(0)
            reason = event.reason.decode("latin-1") or http.HTTPStatus(event.status_code).phrase
            print(f'INFO:     {self.peer} - "{method} {target} HTTP/{version}" {event.status_code} {reason}',
                  file=sys.stderr, flush=True)

    def cycle_done(self) -> bool:
        done = {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}
        return self.up.states == done and self.down.states == done

    async def refuse(self, wait_s: float, answer: bytes) -> None:
        """Rank 0 cannot be reached: read a request (waiting at most wait_s for it), answer it."""
        if self.upstream is not None:
            self.upstream.cancel()  # NOTE: what it has not read stays in the reader
            await asyncio.gather(self.upstream, return_exceptions=True)
        if not self.tracked or self.client_gone:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        asked = self.up.their_state is not h11.IDLE
        try:
            while True:
                event = self.up.next_event()
                if event is h11.NEED_DATA:
                    if asked and self.up.they_are_waiting_for_100_continue:
                        break  # NOTE: its body comes only after a 100: answer now
                    timeout = deadline - loop.time() if not asked else 10.0
                    data = await asyncio.wait_for(self.creader.read(_READ), max(0.0, timeout))
                    self.up.receive_data(data)
                    continue
                asked = asked or isinstance(event, h11.Request)
                if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)) or event is h11.PAUSED:
                    break
        except (OSError, asyncio.TimeoutError, h11.ProtocolError):
            pass  # NOTE: a body that stopped coming (or did not parse) is still answered
        if asked:
            self.front.answered += 1
            await self.send(answer)


class _WriteOnly(asyncio.StreamReaderProtocol):
    """A stream protocol that never reads (another transport reads the same socket)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        transport.pause_reading()


async def _connect(sock: socket.socket, address: str) -> None:
    """Connect a non-blocking Unix socket. Its connect fails with EAGAIN while rank 0's accept
    queue is full (rank 0 behind, e.g. a long pause), which loop.sock_connect took for a connect
    in progress and reported as done on a socket that never connected: the client was told the
    engine had stopped. Here it waits as a client of a full TCP queue would, up to
    _CONNECT_WAIT_S, then fails (busy(): a 503 the client may retry)."""
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + _CONNECT_WAIT_S, 0.002
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            if loop.time() >= deadline:
                raise OSError(errno.EAGAIN, "the engine's connection queue stayed full") from None
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.1)


async def _open_backend(path: str):
    """A connection to rank 0 whose reading and writing are two descriptors of one socket: a
    failed write (rank 0 answered early, 413 or 401, and closed) closes only the writing one, so
    the answer already in the socket is still read and relayed (one descriptor lost it).
    Returns (reader, writer, the reading side's writer: close both to close the socket); the
    writer's write_eof() tells rank 0 the client has gone."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await _connect(sock, "\0" + path[1:] if path.startswith("@") else path)
        wsock = sock.dup()
    except OSError:
        sock.close()
        raise
    reader, rwriter = await asyncio.open_unix_connection(sock=sock)
    transport, protocol = await loop.create_unix_connection(lambda: _WriteOnly(asyncio.StreamReader()),
                                                            sock=wsock)
    # NOTE: Python 3.10 registers the transport's reader after connection_made, paused or not:
    # the writing descriptor then swallowed rank 0's answers (every request hung). A resume and a
    # pause leave it unregistered on every version (no callback can run between the two)
    transport.resume_reading()
    transport.pause_reading()
    return reader, asyncio.StreamWriter(transport, protocol, None, loop), rwriter


class Front:
    def __init__(self, sock: socket.socket, backend: str, keep_alive_s: float = 5.0, access_log: bool = False,
                 request_timeout_s: float = 60.0):
        self.sock, self.backend, self.keep_alive_s = sock, backend, keep_alive_s
        self.request_timeout_s = request_timeout_s
        self.access_log = access_log
        self.server: asyncio.AbstractServer | None = None
        self.relays: dict[asyncio.Task, Relay] = {}
        self.stopping = False  # rank 0 announced a graceful shutdown
        self.answered = 0      # requests the front answered because rank 0 could not

    def message(self) -> str:
        """Why a request cut short by rank 0's side closing was not answered."""
        return SHUTTING_DOWN if self.stopping else STOPPED

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.relays[task] = relay = Relay(self, reader, writer)
        try:
            await relay.run()
        except asyncio.CancelledError:
            # NOTE: the front is exiting (main's last resort); Python 3.11's stream callback logs a
            # cancelled handler's CancelledError as a traceback, so it ends here, normally
            writer.close()
        except Exception as e:  # noqa: BLE001 - one connection's failure must not end the others
            print(f"numa-serve front: connection failed: {e!r}", file=sys.stderr, flush=True)
        finally:
            self.relays.pop(task, None)

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        control = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(control), sys.stdin)
        while line := await control.readline():
            word = line.strip()
            # NOTE: "ready" after "stopping" (a stop signal just after the load, replayed before the
            # server started) would start a server on the socket "stopping" closed
            if word == b"ready" and self.server is None and not self.stopping:
                self.server = await asyncio.start_server(self.accept, sock=self.sock, backlog=2048)
            elif word == b"stopping":
                self.stopping = True
                self.close()
        # NOTE: rank 0 has exited (normally, or killed): accept no more; each relay ends as
        # rank 0's side of its connection closes, after answering what was cut short.
        self.close()
        if self.relays:
            await asyncio.wait(set(self.relays), timeout=_EXIT_AFTER_S)
        if self.relays:
            # NOTE: rank 0 has closed our stdin but still holds these connections (or is hung):
            # take its side as ended, so each client gets what ending() owes it, then cut the rest
            print(f"numa-serve front: {len(self.relays)} connection(s) to the engine still open {_EXIT_AFTER_S:.0f} s "
                  "after it stopped; closing them.", file=sys.stderr, flush=True)
            for relay in self.relays.values():
                if relay.bread_side is not None:
                    relay.bread_side.close()  # NOTE: its reader then reads what it holds and an end
            await asyncio.wait(set(self.relays), timeout=2.0)
        for task in list(self.relays):
            task.cancel()
        if self.relays:
            await asyncio.wait(set(self.relays), timeout=1.0)
        if self.answered:
            print(f"numa-serve front: the engine stopped with {self.answered} request(s) in flight; each was "
                  "answered with an error.", file=sys.stderr, flush=True)
        return 0

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        else:
            self.sock.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="numa-serve's HTTP front (started by rank 0).")
    ap.add_argument("--fd", type=int, required=True, help="the bound public socket, inherited")
    ap.add_argument("--backend", required=True, help="rank 0's Unix socket: a path, or @NAME in the abstract namespace")
    ap.add_argument("--keep-alive", type=float, default=5.0, help="seconds an idle client connection stays open")
    ap.add_argument("--access-log", action="store_true", help="log each request with the client's address")
    ap.add_argument("--request-timeout", type=float, default=60.0,
                    help="seconds a client may pause while sending a request before it is answered 408")
    args = ap.parse_args(argv)
    # NOTE: the front ends with rank 0 (end of file on stdin), never on a signal: `systemctl stop`
    # and `pkill -f numa_runtime.serve` signal it beside rank 0, which then shuts down gracefully
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise_file_limit()
    sock = socket.socket(fileno=args.fd)
    return asyncio.run(Front(sock, args.backend, args.keep_alive, args.access_log, args.request_timeout).main())


if __name__ == "__main__":
    sys.exit(main())
