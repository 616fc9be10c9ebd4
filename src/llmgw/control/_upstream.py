"""A small pooled HTTP/1.1 client for the data plane: the gateway's requests to replicas and
the slot poller's GETs.

httpx costs the gateway about as much CPU per request as the engine spends on a short
answer (profiled), so the data plane speaks HTTP/1.1 itself: an asyncio protocol per
connection, its answers parsed by httptools (the parser uvicorn uses), read by callbacks.
One request is a `Call`, told of its answer by callbacks (`Reader`); `post()` and `get()`
are thin futures over one. It tells the two failures that matter apart: ConnectFailed
(the request never reached the engine: safe to try another replica) and UpstreamError (it
was sent: never resent, so a generation is never run twice), but for one case, decided in
one place (`Call._failed`): a pooled connection the replica had closed is sent once more.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

from llmgw.config import ServerConfig
from llmgw.errors import Error

# llama-server (cpp-httplib) closes a connection idle for 5 s; a pooled one is dropped
# sooner, so a request is never written into a socket the engine is closing.
IDLE_EXPIRY_S = 2.0
# cpp-httplib gives each open connection one of the engine's HTTP threads for as long as
# requests keep coming on it; a connection beyond the threads waits, unserved, until one
# frees. With 32 busy keep-alive connections on a default engine (6 threads: slots + 2) a
# new connection waited 5-7 s, and so did the agent's /health probe, on its own fresh
# connection (measured against llama-server). So the gateway opens at most this many connections to
# one replica, in use and idle together, and the agent starts engines with more HTTP
# threads than this (control/engine_args.py HTTP_THREADS): some are always free for the
# probe. A request beyond them waits in the gateway for a connection, not in the engine.
MAX_CONNECTIONS_PER_REPLICA = 64
# A connection stops reading from the replica while this much of an answer waits, untaken
# (a slow client of a stream): the replica then waits, not the gateway's RAM.
READ_AHEAD_BYTES = 1 << 20
# The most of one answer gathered whole (Call.gather): a chat completion or a batch of
# embeddings is far less; anything near this is no answer the gateway should hold.
MAX_WHOLE_ANSWER_BYTES = 64 << 20


class UpstreamError(Error):
    """The replica failed after the request was sent: answered nothing, or broke off."""


class ConnectFailed(UpstreamError):
    """The request never reached the replica: connection refused, unreachable, timed out,
    or no connection to it freed in time."""


_SERVER_FIELDS = ServerConfig.model_fields


@dataclass
class Timeouts:
    """How long the gateway waits on a replica: server.yaml's upstream_*_timeout_s, whose
    defaults these are."""

    connect_s: float = _SERVER_FIELDS["upstream_connect_timeout_s"].default
    read_s: float = _SERVER_FIELDS["upstream_read_timeout_s"].default


class Reader(Protocol):
    """What a Call tells of its answer, from the event loop's callbacks. Nothing here may
    raise into them."""

    def answer_head(self, call: Call) -> None:
        """call.status and call.headers are read."""

    def answer_data(self, call: Call) -> None:
        """More of the body to take (call.take()), or its end (call.complete)."""

    def answer_failed(self, call: Call, error: UpstreamError) -> None:
        """The call failed (ConnectFailed: never sent); its connection is closed. What
        came of the body before may still be taken."""


class _Replica:
    """One replica's connections: the idle ones, how many are open, and the requests
    waiting for one (each is handed a connection, or a free place to open one)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle: list[ReplicaConnection] = []
        self.open = 0
        self.waiters: deque[asyncio.Future[ReplicaConnection | None]] = deque()

    def hand_over(self, conn: ReplicaConnection | None) -> bool:
        """Give a connection (or, for None, its place) to the first waiter, if any."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

    def pop_idle(self, now: float) -> ReplicaConnection | None:
        """The most recently pooled connection still usable; the stale ones are closed."""
        while self.idle:
            conn = self.idle.pop()
            if conn.usable(now):
                return conn
            conn.close()
        return None

    def closed(self) -> None:
        """A connection closed: its place goes to a waiter, or is free."""
        if not self.hand_over(None):
            self.open -= 1


class ReplicaConnection(asyncio.Protocol):
    """One connection to a replica, read by the event loop's callbacks: httptools parses
    each answer as it arrives (de-chunked) and its Call is told. No stream reader, no task,
    no timer per read: those were most of what relaying an answer cost (profiled against a
    scripted replica). Reading pauses while READ_AHEAD_BYTES of an answer wait untaken, and
    a body gathered whole is refused past its cap. One timer a connection holds the read
    timeout, moved on rather than made for every request."""

    def __init__(self, replica: _Replica, read_s: float) -> None:
        self.replica = replica
        self.read_s = read_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.closed = False
        self.lost = False
        self.call: Call | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._read_at = 0.0
        self._paused = False
        self._ready()

    def _ready(self) -> None:
        """Ready for the next answer."""
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.parts: list[bytes] = []
        self.buffered = 0  # untaken
        self.received = 0  # of the body in all
        self.cap = 0  # 0: not gathered whole (reading pauses instead)
        self.complete = False
        self.failed: BaseException | None = None
        self.got_bytes = False

    def send(self, call: Call, request: bytes, cap: int) -> None:
        """Write one request; call is told of its answer (gathered whole up to cap bytes,
        with 0: as it comes)."""
        self._ready()
        self.cap = cap
        self.call = call
        self._read_at = time.monotonic()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.read_s, self._expire)
        assert self.transport is not None  # connected before it is used
        self.transport.write(request)

    def usable(self, now: float) -> bool:
        return (not self.lost and self.transport is not None
                and not self.transport.is_closing()
                and now - self.idle_since < IDLE_EXPIRY_S)

    def gather(self, cap: int) -> None:
        """The body is taken whole once in: reading no longer pauses for it, and a body
        over cap bytes fails the call."""
        self.cap = cap
        self._resume()
        if not self._too_long() and self.received > cap:
            self._refuse(_TooLarge(f"over {cap} bytes of it came", cap))

    def _too_long(self) -> bool:
        """Refused (True) when the Content-Length is over the cap."""
        length = self.headers.get(b"content-length", b"")
        if not length.isdigit() or int(length) <= self.cap:
            return False
        self._refuse(_TooLarge(f"its Content-Length is {int(length)} bytes", self.cap))
        return True

    def take(self) -> bytes:
        """What arrived of the body since the last take."""
        data = b"".join(self.parts) if len(self.parts) != 1 else self.parts[0]
        self.parts.clear()
        self.buffered = 0
        self._resume()
        return data

    def close(self) -> None:
        """Closed, its place in the pool freed (a request on it is hung up on: llama-server
        stops generating for it)."""
        self.call = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self.replica.closed()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.close()

    def _resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self._read_at = time.monotonic()  # the wait was the client's, not the replica's
            self.transport.resume_reading()

    # --- what the event loop calls ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's: asyncio's protocol API types it as the base class.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._read_at = time.monotonic()  # the read timeout counts from here
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ValueError(f"the replica's answer is not HTTP/1.1: {e}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.status and not self.complete and self.failed is None \
                and b"content-length" not in self.headers \
                and self.headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            # An answer without a length ends where the connection does.
            self.headers[b"connection"] = b"close"
            self.on_message_complete()
            return
        self._fail(asyncio.IncompleteReadError(b"x" if self.got_bytes else b"", None)
                   if exc is None else exc)
        self.close()

    # --- what httptools calls ---

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.cap:  # gathered whole: the reader is told of its end alone
            self._too_long()
        elif self.call is not None:
            self.call._head()

    def on_body(self, body: bytes) -> None:
        if self.failed is not None:  # refused: the rest of the read is dropped
            return
        self.parts.append(body)
        self.buffered += len(body)
        self.received += len(body)
        if self.cap:
            if self.received > self.cap:
                self._refuse(_TooLarge(f"over {self.cap} bytes of it came", self.cap))
            return
        if self.buffered > READ_AHEAD_BYTES and not self._paused and \
                self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        if self.call is not None:
            self.call._data()

    def on_message_complete(self) -> None:
        if self.failed is not None:
            return
        self.complete = True
        if not self.parser.should_keep_alive():
            self.headers[b"connection"] = b"close"
        if self.call is not None:
            self.call._data()

    def _refuse(self, error: _TooLarge) -> None:
        """An answer too large to gather: none of it is kept, even were it all in."""
        self.parts.clear()
        self.buffered = 0
        self.complete = False
        self._fail(error)
        self.abort()

    def _fail(self, error: BaseException) -> None:
        if self.complete or self.failed is not None:
            return
        self.failed = error
        call, self.call = self.call, None
        if call is not None:
            call._failed(self, error)

    def _expire(self) -> None:
        """read_s without a byte from the replica while a request is out (not counting
        a wait for the client to take what came) fails it."""
        self._timer = None
        if self.call is None or self.closed or self.complete:
            return
        idle_s = time.monotonic() - self._read_at
        if self._paused or idle_s < self.read_s:
            self._timer = asyncio.get_running_loop().call_later(
                self.read_s - idle_s if not self._paused else self.read_s, self._expire)
            return
        self._fail(TimeoutError())
        self.abort()


class _TooLarge(ValueError):
    def __init__(self, found: str, cap: int) -> None:
        super().__init__(f"the replica's answer is too large to take whole: {found}, and "
                         f"the cap is {cap} bytes")


class Call:
    """One request to a replica and its answer: a connection found (pooled, else opened,
    else waited for at the replica's limit), the request written, the reader told of the
    answer as it comes. end() when done with it."""

    __slots__ = ("upstream", "endpoint", "key", "request", "reader", "cap", "conn",
                 "reused", "resent", "_pending", "_ended")

    def __init__(self, upstream: Upstream, endpoint: str, key: tuple[str, int],
                 request: bytes, reader: Reader, cap: int = 0) -> None:
        self.upstream, self.endpoint, self.key = upstream, endpoint, key
        self.request, self.reader, self.cap = request, reader, cap
        self.conn: ReplicaConnection | None = None
        self.reused = False
        self.resent = False
        # The wait under way for a connection: a place at the limit, or one opening.
        self._pending: asyncio.Future[ReplicaConnection | None] | None = None
        self._ended = False

    # --- what the reader uses ---

    @property
    def status(self) -> int:
        return self.conn.status if self.conn is not None else 0

    @property
    def headers(self) -> dict[bytes, bytes]:
        return self.conn.headers if self.conn is not None else {}

    @property
    def complete(self) -> bool:
        return self.conn is not None and self.conn.complete

    def take(self) -> bytes:
        """What arrived of the body since the last take (reading resumes if it paused)."""
        return self.conn.take() if self.conn is not None else b""

    def gather(self, cap: int = MAX_WHOLE_ANSWER_BYTES) -> None:
        """The reader takes the body whole, once complete: it is not paused for, and is
        refused (answer_failed) past cap bytes."""
        if self.conn is not None:
            self.conn.gather(cap)

    def end(self) -> None:
        """Done with: the connection back to the pool when its answer came whole and the
        replica keeps it open; else closed (a request under way is hung up on, or its wait
        for a connection given up)."""
        if self._ended:
            return
        self._ended = True
        if self._pending is not None:
            self._pending.cancel()
        conn, self.conn = self.conn, None
        if conn is None or conn.closed:
            return
        conn.call = None
        if conn.complete and conn.headers.get(b"connection", b"").lower() != b"close":
            self.upstream._give_back(conn)
        else:
            conn.close()

    # --- the sequence ---

    def start(self, pooled: bool = True) -> None:
        replica = self.upstream._replica(self.key)
        conn = replica.pop_idle(time.monotonic()) if pooled and replica.idle else None
        if conn is not None:
            self._send(conn, reused=True)
        elif replica.open < replica.limit:
            replica.open += 1
            self._open(replica)
        else:
            self._wait_turn(replica)

    def _wait_turn(self, replica: _Replica) -> None:
        """A connection handed back, or the place of one that closed, within read_s."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[ReplicaConnection | None] = loop.create_future()
        replica.waiters.append(waiter)
        self._pending = waiter
        read_s = self.upstream.timeouts.read_s
        timer = loop.call_later(read_s, waiter.cancel)

        def handed(_: object) -> None:
            timer.cancel()
            self._pending = None
            if waiter.cancelled():
                if waiter in replica.waiters:
                    replica.waiters.remove(waiter)
                if not self._ended:  # the wait ran out, not given up
                    self._refused(ConnectFailed(
                        f"all {replica.limit} connections to {self.key[0]}:{self.key[1]} "
                        f"stayed busy for {read_s:g} s (upstream_read_timeout_s in "
                        "server.yaml); the request was not sent"))
                return
            conn = waiter.result()
            if self._ended:  # given up just as it was handed: pass it on
                if conn is None:
                    replica.closed()
                else:
                    self.upstream._give_back(conn)
            elif conn is None:
                self._open(replica)
            else:
                self._send(conn, reused=True)

        waiter.add_done_callback(handed)

    def _open(self, replica: _Replica) -> None:
        """A new connection, in a task of its own (its place at the limit taken)."""
        opening = asyncio.ensure_future(self.upstream._connect(self.key, replica))
        self._pending = cast("asyncio.Future[ReplicaConnection | None]", opening)

        def opened(_: object) -> None:
            self._pending = None
            if opening.cancelled():
                replica.closed()
                return
            error = opening.exception()
            if error is not None:
                replica.closed()
                if not self._ended:
                    self._refused(error if isinstance(error, ConnectFailed) else
                                  ConnectFailed(f"cannot connect to {self.key[0]}:"
                                                f"{self.key[1]}: {error!r}"))
                return
            conn = opening.result()
            if self._ended:
                conn.close()
            else:
                self._send(conn, reused=False)

        opening.add_done_callback(opened)

    def _send(self, conn: ReplicaConnection, reused: bool) -> None:
        self.conn, self.reused = conn, reused
        conn.send(self, self.request, self.cap)

    def _head(self) -> None:
        self.reader.answer_head(self)

    def _data(self) -> None:
        self.reader.answer_data(self)

    def _refused(self, error: ConnectFailed) -> None:
        self._ended = True
        self.reader.answer_failed(self, error)

    def _failed(self, conn: ReplicaConnection, error: BaseException) -> None:
        """The one place a sent request may be sent again: on a pooled connection the
        replica had already closed (its engine restarted or died, or it dropped the idle
        connection) nothing of an answer came, so it never reached a live engine. It goes
        once more on a new connection, which fails as ConnectFailed when the engine is gone
        (the gateway then moves on). Any other failure is the reader's."""
        conn.close()
        if self._ended:
            return
        if self.reused and not self.resent and not conn.got_bytes and isinstance(
                error, (ConnectionError, asyncio.IncompleteReadError)):
            self.resent = True
            self.conn = None
            self.start(pooled=False)
            return
        self._ended = True
        self.reader.answer_failed(self, UpstreamError(self._why(conn, error)))

    def _why(self, conn: ReplicaConnection, error: BaseException) -> str:
        read_s = self.upstream.timeouts.read_s
        if not conn.status:  # no answer's head came
            if isinstance(error, TimeoutError):
                return (f"{self.endpoint} sent no answer within {read_s:g} s "
                        "(upstream_read_timeout_s in server.yaml)")
            return (f"{self.endpoint} took the request and closed the connection without an "
                    f"answer: {error!r}")
        if isinstance(error, TimeoutError):
            return (f"the replica sent nothing for {read_s:g} s (upstream_read_timeout_s in "
                    "server.yaml)")
        if isinstance(error, _TooLarge):
            return str(error)
        return f"the replica broke off its answer: {error!r}"


class Response:
    """An answer read through futures (post(), get()): status and headers read, the body
    still on the wire."""

    def __init__(self, call: Call, reader: _Awaited) -> None:
        self._call, self._reader = call, reader
        self.status, self.headers = call.status, dict(call.headers)

    async def read(self, cap: int = MAX_WHOLE_ANSWER_BYTES) -> bytes:
        """The whole body (UpstreamError past cap bytes); the connection pooled after."""
        self._call.gather(cap)
        return b"".join([part async for part in self.iter_raw()])

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, de-chunked; reading from the replica pauses
        while they are not taken. The connection is pooled after."""
        call, reader = self._call, self._reader
        try:
            while True:
                data = call.take()
                if data:
                    yield data
                elif call.complete:
                    return
                elif reader.error is not None:
                    raise reader.error
                else:
                    await reader.more()
        finally:
            call.end()

    def abort(self) -> None:
        """Hang up on the replica mid-answer: llama-server stops generating for it."""
        self._call.end()


class _Awaited:
    """A Reader for post() and get(): futures for the head and for more of the body."""

    __slots__ = ("head", "error", "_more")

    def __init__(self) -> None:
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.error: UpstreamError | None = None
        self._more: asyncio.Future[None] | None = None

    def answer_head(self, call: Call) -> None:
        if not self.head.done():
            self.head.set_result(None)

    def answer_data(self, call: Call) -> None:
        self._wake()

    def answer_failed(self, call: Call, error: UpstreamError) -> None:
        self.error = error
        if not self.head.done():
            self.head.set_exception(error)
        self._wake()

    async def more(self) -> None:
        self._more = asyncio.get_running_loop().create_future()
        await self._more

    def _wake(self) -> None:
        more, self._more = self._more, None
        if more is not None and not more.done():
            more.set_result(None)


class Upstream:
    """Connections to replicas, kept open between requests and reused."""

    def __init__(self, timeouts: Timeouts | None = None,
                 max_connections: int = MAX_CONNECTIONS_PER_REPLICA) -> None:
        self.timeouts = timeouts or Timeouts()
        self.max_connections = max_connections
        self._replicas: dict[tuple[str, int], _Replica] = {}
        self._targets: dict[tuple[str, str, str, str], tuple[tuple[str, int], bytes]] = {}

    def call(self, reader: Reader, endpoint: str, path: str, api_key: str,
             body: bytes | None = None, whole: bool = False) -> Call:
        """Send a request to a replica (a POST of body, a GET without one); reader is told
        of its answer from the event loop's callbacks: whole, only of its end (the body
        gathered, up to MAX_WHOLE_ANSWER_BYTES) or its failure."""
        key, head = self._target("GET" if body is None else "POST", endpoint, path, api_key)
        request = head + b"0\r\n\r\n" if body is None else \
            head + b"%d\r\n\r\n" % len(body) + body
        call = Call(self, endpoint, key, request, reader,
                    MAX_WHOLE_ANSWER_BYTES if whole else 0)
        call.start()
        return call

    async def post(self, endpoint: str, path: str, body: bytes, api_key: str) -> Response:
        """Send one POST to a replica and read its status and headers."""
        return await self._awaited(endpoint, path, api_key, body)

    async def get(self, endpoint: str, path: str, api_key: str) -> Response:
        """Send one GET to a replica and read its status and headers."""
        return await self._awaited(endpoint, path, api_key, None)

    async def _awaited(self, endpoint: str, path: str, api_key: str,
                       body: bytes | None) -> Response:
        reader = _Awaited()
        call = self.call(reader, endpoint, path, api_key, body)
        try:
            await reader.head
        except BaseException:
            call.end()  # a wait given up (cancelled): nothing is left behind
            raise
        return Response(call, reader)

    def _target(self, method: str, endpoint: str, path: str, api_key: str
                ) -> tuple[tuple[str, int], bytes]:
        """Where a request goes and its head up to the body's length, made once."""
        made = self._targets.get((method, endpoint, path, api_key))
        if made is not None:
            return made
        url = urlsplit(endpoint)
        key = (url.hostname or "127.0.0.1", url.port or 80)
        head = (method.encode() + b" " + path.encode() + b" HTTP/1.1\r\nHost: "
                + url.netloc.encode() + b"\r\nAuthorization: Bearer " + api_key.encode()
                + (b"\r\nContent-Type: application/json" if method == "POST" else b"")
                + b"\r\nContent-Length: ")
        if len(self._targets) >= 4096:  # replicas come and go: the cache stays small
            self._targets.clear()
        self._targets[(method, endpoint, path, api_key)] = (key, head)
        return key, head

    def _replica(self, key: tuple[str, int]) -> _Replica:
        replica = self._replicas.get(key)
        if replica is None:
            replica = self._replicas[key] = _Replica(self.max_connections)
        return replica

    async def _connect(self, key: tuple[str, int], replica: _Replica) -> ReplicaConnection:
        loop = asyncio.get_running_loop()
        read_s = self.timeouts.read_s
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: ReplicaConnection(replica, read_s), *key),
                self.timeouts.connect_s)
        except (OSError, TimeoutError) as e:
            raise ConnectFailed(f"cannot connect to {key[0]}:{key[1]}: {e!r}") from e
        return conn

    def _give_back(self, conn: ReplicaConnection) -> None:
        conn.idle_since = time.monotonic()
        if not conn.replica.hand_over(conn):
            conn.replica.idle.append(conn)

    async def aclose(self) -> None:
        for replica in self._replicas.values():
            for conn in replica.idle:
                conn.close()
            replica.idle.clear()
