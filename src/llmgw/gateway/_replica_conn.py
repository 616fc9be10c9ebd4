"""One pooled HTTP/1.1 connection to a replica, read by the event loop's callbacks, and the
pool's count of one replica's connections (`_upstream` sends requests on them)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Protocol, cast

import httptools

from llmgw.errors import Error

# llama-server (cpp-httplib) closes a connection idle for 5 s; a pooled one is dropped
# sooner, so a request is never written into a socket the engine is closing.
IDLE_EXPIRY_S = 2.0
# A connection stops reading from the replica while this much of an answer waits, untaken
# (a slow client of a stream): the replica then waits, not the gateway's RAM.
READ_AHEAD_BYTES = 1 << 20


class Listener(Protocol):
    """What a connection tells of the answer to the request it carries (`_upstream.Call`)."""

    def head_read(self) -> None: ...

    def body_read(self) -> None: ...

    def failed(self, conn: ReplicaConnection, error: BaseException) -> None: ...


class Replica:
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

    def __init__(self, replica: Replica, read_s: float) -> None:
        self.replica = replica
        self.read_s = read_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.closed = False
        self.lost = False
        self.call: Listener | None = None
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

    def send(self, call: Listener, request: bytes, cap: int) -> None:
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
            self._refuse(TooLarge(f"over {cap} bytes of it came", cap))

    def _too_long(self) -> bool:
        """Refused (True) when the Content-Length is over the cap."""
        length = self.headers.get(b"content-length", b"")
        if not length.isdigit() or int(length) <= self.cap:
            return False
        self._refuse(TooLarge(f"its Content-Length is {int(length)} bytes", self.cap))
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
            self.call.head_read()

    def on_body(self, body: bytes) -> None:
        if self.failed is not None:  # refused: the rest of the read is dropped
            return
        self.parts.append(body)
        self.buffered += len(body)
        self.received += len(body)
        if self.cap:
            if self.received > self.cap:
                self._refuse(TooLarge(f"over {self.cap} bytes of it came", self.cap))
            return
        if self.buffered > READ_AHEAD_BYTES and not self._paused and \
                self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        if self.call is not None:
            self.call.body_read()

    def on_message_complete(self) -> None:
        if self.failed is not None:
            return
        self.complete = True
        if not self.parser.should_keep_alive():
            self.headers[b"connection"] = b"close"
        if self.call is not None:
            self.call.body_read()

    def _refuse(self, error: TooLarge) -> None:
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
            call.failed(self, error)

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


class TooLarge(Error, ValueError):
    """A replica's answer over the cap the gateway gathers whole (the caller answers 502)."""

    def __init__(self, found: str, cap: int) -> None:
        super().__init__(f"the replica's answer is too large to take whole: {found}, and "
                         f"the cap is {cap} bytes")
