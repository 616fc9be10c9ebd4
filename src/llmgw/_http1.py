"""A lean HTTP/1.1 server for one ASGI app: what the gateway's listener runs.

In front of a scripted replica (no engine time), the gateway under uvicorn spent 0.10 ms
of CPU a request at 16 in flight and 0.25 ms at 1; under this server 0.085 and 0.215,
side by side (nginx: 0.022 and 0.06). uvicorn's share was its cycle objects, default
headers, flow-control and event objects, and the writes it gathers only with help
(`_serving._WritesGathered`). This server does what the gateway needs and no more, in one
asyncio protocol per connection: httptools parses the request, one task runs the app, an
answer whose body comes in one message leaves in one write with its head, a streamed one
as HTTP chunks. Keep-alive, pipelining (one request at a time, in order), Expect:
100-continue, HEAD, a client that leaves (http.disconnect), write backpressure and a
drain that loses no request on the wire are kept. HTTP/1.1 only: no upgrades, no HTTP/2.
A fast handler (fast=, the gateway's fast path) may take a request whose body is in and
answer it from callbacks, with no task: Cycle.answer writes it whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools

from llmgw._asgi import Lifespan, Message, Scope
from llmgw._serving import close_transport, run_service
from llmgw.config import parse_listen

log = logging.getLogger("llmgw.http")

# An idle keep-alive connection is closed after this long (uvicorn's default too).
KEEP_ALIVE_S = 5.0
# How long an idle connection stays open once its server drains: a busy client sends its
# next request within milliseconds and gets Connection: close with the answer. (uvicorn
# closes an idle connection at once, and one whose answer promised keep-alive right after
# it: a client that sent its next request just then lost it.)
IDLE_DRAIN_S = 1.0
# A request's line and headers together may be this long at most: 431 beyond.
MAX_HEAD_BYTES = 64 << 10
# Reading from a client stops while this much of its body waits for the app.
BODY_READ_AHEAD_BYTES = 256 << 10
BACKLOG = 4096

# Reason phrases as the standard library names them (every status the gateway sends).
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


class _Date:
    """The Date header's value, made once a second."""

    second = 0
    value = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.value = second, formatdate(second, usegmt=True).encode()
        return cls.value


def _plain(status: int, text: str) -> bytes:
    body = text.encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close"
            b"\r\ncontent-length: %d\r\n\r\n" % (status, _REASONS.get(status, b""), len(body))
            + body)


class Cycle:
    """One request and its answer: what the app's receive() and send() act on."""

    def __init__(self, conn: _Connection, scope: Scope, keep_alive: bool,
                 expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.head_only = scope["method"] == "HEAD"
        self.body: list[bytes] = []
        self.buffered = 0
        self.body_complete = False
        self.body_given = False
        self.waiter: asyncio.Future[None] | None = None
        self.started = False
        self.complete = False
        self.chunked = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        # Held for the server's fast handler until the whole body is in.
        self.deferred = False

    # --- what a fast handler (Http1Server's fast=) uses ---

    def body_bytes(self) -> bytes:
        """The whole body (the fast handler is called once it is in); it stays there for
        the app's receive() should the request fall back to it."""
        if len(self.body) > 1:
            self.body[:] = [b"".join(self.body)]
        return self.body[0] if self.body else b""

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole answer, head and body, in one write; then on to the next request."""
        self.started = True
        self.status = status
        self.headers = headers
        self._write(body, False)

    def fall_back(self) -> None:
        """The fast handler let go of the request, before answering: the app answers it."""
        self.conn._start(self)

    def wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self) -> Message:
        """The body as it came; once all of it was given, http.disconnect when the client
        leaves or the answer is done (as uvicorn does)."""
        conn = self.conn
        while True:
            if conn.lost or self.complete:
                return {"type": "http.disconnect"}
            if self.body or self.body_complete and not self.body_given:
                data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
                self.body.clear()
                if self.buffered > BODY_READ_AHEAD_BYTES:
                    conn.resume_reading()
                self.buffered = 0
                self.body_given = self.body_complete
                return {"type": "http.request", "body": data,
                        "more_body": not self.body_complete}
            if self.expect_continue:
                self.expect_continue = False
                conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter

    async def send(self, message: Message) -> None:
        conn = self.conn
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            return
        if kind != "http.response.body":
            raise RuntimeError(f"an HTTP app cannot send {kind!r}")
        if not self.started or self.complete:
            raise RuntimeError("http.response.body sent before http.response.start or "
                               "after the last body")
        self._write(message.get("body", b""), message.get("more_body", False))
        if not self.complete and conn.paused_writing:
            await conn.writable()

    def _write(self, body: bytes, more: bool) -> None:
        conn = self.conn
        if conn.lost:
            return
        if self.status:  # the head is not written yet
            if self.expect_continue and not self.body_complete:
                # Answered before the body was asked for: the client may never send it,
                # so the connection cannot carry another request (RFC 9110 10.1.1).
                self.keep_alive = False
            data = self._head(body, more)
            self.status = 0
            self.expect_continue = False  # a 100 Continue now would break the answer
            if not self.head_only:
                data += b"%x\r\n%s\r\n" % (len(body), body) if self.chunked and body else body
        elif self.head_only:
            data = b""
        elif self.chunked:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
        else:
            data = body
        if not more:
            if self.chunked and not self.head_only:
                data += b"0\r\n\r\n"
            self.complete = True
        if data:
            conn.write(data)
        if self.complete:
            self.wake()  # a receive() waiting for the client to leave: it is done
            conn.answered(self)

    def _head(self, body: bytes, more: bool) -> bytes:
        lines = [b"HTTP/1.1 %d %s\r\n" % (self.status, _REASONS.get(self.status, b""))]
        has_length = False
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"content-length":
                has_length = True
            elif lowered == b"connection":
                if value.lower() == b"close":
                    self.keep_alive = False
                continue
            lines.append(b"%s: %s\r\n" % (name, value))
        if not has_length and self.status not in (204, 304) and self.status >= 200:
            if more:
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
            else:
                lines.append(b"content-length: %d\r\n" % len(body))
        lines.append(b"date: " + _Date.now() + b"\r\n")
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        elif self.scope["http_version"] == "1.0":
            lines.append(b"connection: keep-alive\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)


class _Connection(asyncio.Protocol):
    """One client connection: its parser, the answer under way and the requests behind it."""

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.draining = False
        self.paused_writing = False
        self._drained: asyncio.Future[None] | None = None
        self._reading_paused = False
        self.current: Cycle | None = None    # the answer under way
        self.parsing: Cycle | None = None    # the request whose body is being read
        self.queued: deque[Cycle] = deque()  # pipelined requests behind the current one
        self._idle: asyncio.TimerHandle | None = None
        self._idle_deadline = 0.0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._in_head = False
        self._expect_continue = False
        self._tasks: set[asyncio.Task[None]] = set()

    # --- the event loop's side ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self.client = transport.get_extra_info("peername")
        self.sockname = transport.get_extra_info("sockname")
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        if self.server.draining:
            self.shutdown()
        else:
            self._arm_idle(KEEP_ALIVE_S)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "this server speaks HTTP/1.1 only: no upgrade")
        except httptools.HttpParserError as e:
            # httptools wraps what a callback raises: _HeadTooLarge is its context.
            if isinstance(e.__context__, _HeadTooLarge):
                self._refuse(431, f"the request's line and headers are over "
                             f"{MAX_HEAD_BYTES} bytes")
            else:
                self._refuse(400, f"the request is not valid HTTP/1.1: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        for cycle in (self.current, self.parsing, *self.queued):
            if cycle is not None:
                cycle.wake()
        self.queued.clear()
        self._wake_writer()

    def pause_writing(self) -> None:
        self.paused_writing = True

    def resume_writing(self) -> None:
        self.paused_writing = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    async def writable(self) -> None:
        if self.paused_writing and not self.lost:
            self._drained = self.loop.create_future()
            await self._drained

    # --- what httptools calls ---

    def on_message_begin(self) -> None:
        self._url, self._headers, self._head_bytes = b"", [], 0
        self._in_head = True
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        url = self._url
        if b"?" in url or not url.startswith(b"/"):
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path, parsed.query or b""
        else:
            raw_path, query = url, b""
        path = raw_path.decode("latin-1")
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.parser.get_http_version(), "scheme": self.scheme,
            "method": self.parser.get_method().decode("ascii"), "root_path": "",
            "path": unquote(path) if "%" in path else path, "raw_path": raw_path,
            "query_string": query, "headers": self._headers,
            "server": self.sockname, "client": self.client, "state": {},
        }
        cycle = Cycle(self, scope, self.parser.should_keep_alive() and not self.draining,
                       self._expect_continue)
        self.parsing = cycle
        if self.current is not None:
            self.queued.append(cycle)
            self.pause_reading()
        elif self.server.fast is not None and not cycle.expect_continue:
            self.current = cycle  # answered once its body is in (_begin)
            cycle.deferred = True
        else:
            self._start(cycle)

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle is None or cycle.complete:  # answered without it: read on, and drop it
            return
        cycle.body.append(body)
        cycle.buffered += len(body)
        if cycle.buffered > BODY_READ_AHEAD_BYTES:
            if cycle.deferred:  # a large body: the app reads it as it comes
                self._start(cycle)
            self.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle, self.parsing = self.parsing, None
        if cycle is not None:
            cycle.body_complete = True
            if cycle.deferred:
                self._begin(cycle)
            else:
                cycle.wake()

    # --- answers ---

    def _begin(self, cycle: Cycle) -> None:
        """A request whose body is all in: the fast handler's, or else the app's."""
        cycle.deferred = False
        self.current = cycle
        try:
            taken = self.server.fast(cycle)  # type: ignore[misc]
        except Exception:
            # Called from the parser's callback: what it raised would read as a bad request.
            log.exception("the fast handler failed on %s %s; the app answers it",
                          cycle.scope["method"], cycle.scope["path"])
            taken = cycle.started
        if not taken:
            self._start(cycle)

    def _start(self, cycle: Cycle) -> None:
        """The app answers the request, in a task of its own."""
        cycle.deferred = False
        self.current = cycle
        task = self.loop.create_task(self._run(cycle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, cycle: Cycle) -> None:
        try:
            await self.server.app(cycle.scope, cycle.receive, cycle.send)
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                log.exception("the app failed on %s %s", cycle.scope["method"],
                              cycle.scope["path"])
            if not cycle.started and not self.lost:
                self.write(_plain(500, "Internal Server Error"))
            self.close()
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        if not cycle.complete and not self.lost:
            log.error("the app returned without finishing its answer to %s %s",
                      cycle.scope["method"], cycle.scope["path"])
            if not cycle.started:
                self.write(_plain(500, "Internal Server Error"))
            self.close()

    def answered(self, cycle: Cycle) -> None:
        """The answer is written: on to the next request, or close."""
        if self.current is not cycle:
            return
        self.current = None
        if not cycle.keep_alive or self.lost:
            self.close()
            return
        if self.queued:
            cycle = self.queued.popleft()
            if not self.queued:
                self.resume_reading()
            if self.server.fast is not None and cycle.body_complete and \
                    not cycle.expect_continue:
                self._begin(cycle)
            else:
                self._start(cycle)
            return
        self.resume_reading()
        self._arm_idle(IDLE_DRAIN_S if self.draining else KEEP_ALIVE_S)

    def _arm_idle(self, delay_s: float) -> None:
        """The connection is closed delay_s from now if it is idle then. One timer, moved
        on when it fires, not made and cancelled for every request."""
        deadline = self.loop.time() + delay_s
        self._idle_deadline = deadline
        if self._idle is not None:
            if self._idle.when() <= deadline:
                return  # it fires first, and waits on from there
            self._idle.cancel()
        self._idle = self.loop.call_at(deadline, self._close_if_idle)

    def shutdown(self) -> None:
        """The server drains: an answer not begun says Connection: close; an idle
        connection (or one whose answer promised keep-alive, once it is done) is closed
        IDLE_DRAIN_S later, if no request came: a request sent just then is answered."""
        self.draining = True
        for cycle in (self.current, *self.queued):
            if cycle is not None and (cycle.status or not cycle.started):
                cycle.keep_alive = False
        if self.current is None:
            self._arm_idle(IDLE_DRAIN_S)

    def _close_if_idle(self) -> None:
        """Close when no request is under way or coming in (a head part-way in is one:
        in a drain it is answered, with Connection: close; the drain bound ends a client
        that never finishes it). A request under way is not idle: its answer arms the
        timer again."""
        self._idle = None
        if self.loop.time() < self._idle_deadline:
            self._idle = self.loop.call_at(self._idle_deadline, self._close_if_idle)
        elif self.current is None and self.parsing is None and not self._in_head:
            self.close()
        elif self.current is None and self._in_head and self.draining:
            self._arm_idle(IDLE_DRAIN_S)

    def _refuse(self, status: int, why: str) -> None:
        self.write(_plain(status, why))
        self.close()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.lost:
            self._reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            close_transport(self.transport, self.loop)

    def abort(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.transport is not None:
            self.transport.abort()


class _HeadTooLarge(Exception):
    pass


class Http1Server:
    """Serves app on listen (HOST:PORT) or on sockets handed to serve(); HTTPS with
    certfile (the chain, leaf first) and keyfile. The same switches as uvicorn's Server,
    so a process runs either: `started` once it listens, `should_exit = True` to stop.

    On stop: no new connections; requests under way (streams too) get drain_s to finish,
    idle connections are closed without losing a request on the wire; then whatever is
    left is cut.

    fast, when given, is offered each request (but one that expects 100-continue) once its
    whole body is in, before the app: it returns False to leave it to the app, or True
    having taken it, and then answers it from the event loop's callbacks, no task (with
    cycle.answer), or lets go of it unanswered (cycle.fall_back: the app answers). A
    body over the read-ahead goes to the app as it comes."""

    def __init__(self, app: Any, listen: str = "", *, drain_s: float = 30.0,
                 certfile: str = "", keyfile: str = "",
                 fast: Callable[[Cycle], bool] | None = None) -> None:
        self.app = app
        self.fast = fast
        self.listen = listen
        self.drain_s = drain_s
        self.ssl: ssl.SSLContext | None = None
        if certfile:
            self.ssl = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.ssl.load_cert_chain(certfile, keyfile or None)
        self.started = False
        self._should_exit = False
        self._exiting: asyncio.Event | None = None
        self.draining = False
        self.connections: set[_Connection] = set()
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """Set from any thread (a signal handler, a test): the listeners close in the
        loop's next turn, not at a poll. A worker handed over shares its sockets with the
        new one, and must stop taking their connections at once: one it took after the
        new worker served would be answered by the old code and settings."""
        self._should_exit = value
        if value and self._exiting is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: it served out
                self.loop.call_soon_threadsafe(self._exiting.set)

    def run(self) -> None:
        run_service(self.serve())

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self._exiting = asyncio.Event()
        if self._should_exit:
            self._exiting.set()
        lifespan = Lifespan(self.app)
        await lifespan.startup()
        servers = []
        try:
            if sockets:
                for sock in sockets:
                    servers.append(await self.loop.create_server(
                        lambda: _Connection(self), sock=sock, ssl=self.ssl, backlog=BACKLOG))
            else:
                host, port = parse_listen(self.listen)
                servers.append(await self.loop.create_server(
                    lambda: _Connection(self), host, port, ssl=self.ssl, backlog=BACKLOG,
                    reuse_address=True))
            self.started = True
            await self._exiting.wait()
        finally:
            for server in servers:
                server.close()
            await self._drain()
            await lifespan.shutdown()

    async def _drain(self) -> None:
        self.draining = True
        for conn in list(self.connections):
            conn.shutdown()
        deadline = self.loop.time() + self.drain_s
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.connections:
            log.warning("%d connections still open %.0f s into the drain; cutting them",
                        len(self.connections), self.drain_s)
            for conn in list(self.connections):
                conn.abort()
            await asyncio.sleep(0)
