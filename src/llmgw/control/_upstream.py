"""A small pooled HTTP/1.1 client for the gateway's hot path: replicas only, POST only.

httpx costs the gateway about as much CPU per request as the engine spends on a short
answer (profiled), so the hot path speaks HTTP/1.1 itself: an asyncio protocol
per connection, its answers parsed by httptools (the parser uvicorn uses).
It tells the two failures that matter apart: ConnectFailed (the request never reached
the engine: safe to try another replica) and UpstreamError (it was sent: never resent,
so a generation is never run twice).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NoReturn, cast
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


# A connection stops reading from the replica while this much of an answer waits, unread
# by the gateway (a slow client of a stream): the replica then waits, not the gateway's RAM.
READ_AHEAD_BYTES = 1 << 20


class ReplicaConnection(asyncio.Protocol):
    """One connection to a replica, read by the event loop's callbacks: httptools parses
    each answer as it arrives (de-chunked), and the request waiting on it is woken only
    when there is something to take. No stream reader, no task, no timer per read: those
    were most of what relaying an answer cost (profiled against a scripted replica). Upstream
    .send_now uses it from callbacks alone: on_done is called when the answer is whole."""

    def __init__(self, replica: _Replica) -> None:
        self.replica = replica
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self._closed = False
        self.lost = False
        # Sent by Upstream.send_now: called once the answer is in whole, or failed.
        self.on_done: Callable[[ReplicaConnection], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.read_at = 0.0
        self._begin()

    def _begin(self) -> None:
        """Ready for the next answer."""
        self.head: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.parts: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.failed: BaseException | None = None
        self.got_bytes = False
        self.waiter: asyncio.Future[None] | None = None

    def send(self, data: bytes) -> asyncio.Future[None]:
        """Write one request; the future is done when its answer's head is read."""
        self._begin()
        self.head = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(data)
        return self.head

    def usable(self, now: float) -> bool:
        return (not self.lost and self.transport is not None
                and not self.transport.is_closing()
                and now - self.idle_since < IDLE_EXPIRY_S)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._closed:
            self._closed = True
            if self.transport is not None:
                self.transport.close()
            self.replica.closed()

    # --- what the event loop calls ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's: asyncio's protocol API types it as the base class.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self._timer is not None:
            self.read_at = time.monotonic()  # the read timeout counts from here
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ValueError(f"the replica's answer is not HTTP/1.1: {e}"))
            assert self.transport is not None
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.head is not None and self.head.done() and not self.complete and \
                b"content-length" not in self.headers and \
                self.headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            # An answer without a length ends where the connection does.
            self.headers[b"connection"] = b"close"
            self.on_message_complete()
            return
        self._fail(asyncio.IncompleteReadError(b"x" if self.got_bytes else b"", None)
                   if exc is None else exc)

    # --- what httptools calls ---

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)
        self.buffered += len(body)
        if self.buffered > READ_AHEAD_BYTES and self.transport is not None and \
                self.on_done is None:  # sent by send_now, the answer is kept whole
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        if not self.parser.should_keep_alive():
            self.headers[b"connection"] = b"close"
        if self.on_done is not None:
            self._done()
        else:
            self._wake()

    def _fail(self, error: BaseException) -> None:
        if self.complete or self.failed is not None:
            return
        self.failed = error
        if self.on_done is not None:
            self._done()
            return
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        self._wake()

    def _done(self) -> None:
        done, self.on_done = self.on_done, None
        if done is not None:
            done(self)

    def _expire(self, timeout_s: float) -> None:
        """send_now's read timeout: timeout_s without a byte from the replica, as post()
        and iter_raw() wait. One timer a connection, moved on when it fires, not made
        and cancelled for every request; with no request out it just ends."""
        if self.on_done is None:
            self._timer = None
            return
        idle_s = time.monotonic() - self.read_at
        if idle_s < timeout_s:
            self._timer = asyncio.get_running_loop().call_later(
                timeout_s - idle_s, self._expire, timeout_s)
            return
        self._timer = None
        self._fail(TimeoutError())

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- what the request reads ---

    def take(self) -> bytes:
        """What arrived of the body since the last take."""
        data = b"".join(self.parts) if len(self.parts) != 1 else self.parts[0]
        self.parts.clear()
        if self.buffered > READ_AHEAD_BYTES and self.transport is not None:
            self.transport.resume_reading()
        self.buffered = 0
        return data

    async def more(self, timeout_s: float) -> None:
        """Until more of the body, its end, or a failure arrives."""
        self.waiter = asyncio.get_running_loop().create_future()
        await _within(self.waiter, timeout_s)


class _Expired(Exception):
    pass


async def _within(future: asyncio.Future[None], timeout_s: float) -> None:
    """Wait for future, raising TimeoutError after timeout_s: one timer, no task (which
    asyncio.wait_for makes) and no context manager (asyncio.timeout) per wait."""
    def expire() -> None:
        if not future.done():
            future.set_exception(_Expired())

    timer = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        await future
    except _Expired:
        raise TimeoutError from None
    finally:
        timer.cancel()


@dataclass
class Response:
    """A replica's answer: status and headers read, the body still on the wire."""

    status: int
    headers: dict[bytes, bytes]
    # None once released: the connection is the pool's again.
    _conn: ReplicaConnection | None
    _pool: Upstream
    _read_s: float
    _done: bool = field(default=False)
    # Called once, when the answer is done with (read whole, broken off or hung up on).
    on_release: Callable[[], None] | None = None
    # The replica that answers (its id), for what is said when it fails.
    source: str = ""

    @property
    def chunked(self) -> bool:
        return self.headers.get(b"transfer-encoding", b"").lower() == b"chunked"

    async def read(self) -> bytes:
        conn = self._conn
        assert conn is not None, "a replica's answer is read once"
        if conn.complete:  # the usual case: the whole answer came with its head
            data = conn.take()
            self._done = True
            self.release()
            return data
        return b"".join([part async for part in self.iter_raw()])

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, de-chunked; the connection is pooled after."""
        conn = self._conn
        assert conn is not None, "a replica's answer is read once"
        try:
            while True:
                if conn.parts:
                    yield conn.take()
                    continue
                if conn.complete:
                    break
                if conn.failed is not None:
                    raise conn.failed
                try:
                    await conn.more(self._read_s)
                except TimeoutError as e:
                    raise UpstreamError(f"the replica sent nothing for {self._read_s:g} s "
                                        "(upstream_read_timeout_s in server.yaml)") from e
            self._done = True
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            raise UpstreamError(f"the replica broke off its answer: {e!r}") from e
        finally:
            self.release()

    def abort(self) -> None:
        """Hang up on the replica mid-answer: llama-server stops generating for it."""
        if self._conn is not None:
            self._conn.close()
        self._released()

    def release(self) -> None:
        """Back to the pool when the body was read whole and the replica keeps it open."""
        if self._conn is None:
            return
        keep = self._done and self.headers.get(b"connection", b"").lower() != b"close"
        self._pool._give_back(self._conn, keep)
        self._conn = None
        self._released()

    def _released(self) -> None:
        hook, self.on_release = self.on_release, None
        if hook is not None:
            hook()


class Upstream:
    """Connections to replicas, kept open between requests and reused."""

    def __init__(self, timeouts: Timeouts | None = None,
                 max_connections: int = MAX_CONNECTIONS_PER_REPLICA) -> None:
        self.timeouts = timeouts or Timeouts()
        self.max_connections = max_connections
        self._replicas: dict[tuple[str, int], _Replica] = {}
        self._targets: dict[tuple[str, str, str, bytes], tuple[tuple[str, int], bytes]] = {}

    async def post(self, endpoint: str, path: str, body: bytes, api_key: str,
                   content_type: bytes = b"application/json") -> Response:
        """Send one POST to a replica and read its status and headers."""
        key, head = self._target(endpoint, path, api_key, content_type)
        head += b"%d\r\n\r\n" % len(body)
        conn, reused = await self._checkout(key)
        try:
            await _within(conn.send(head + body), self.timeouts.read_s)
        except BaseException as e:
            conn.close()
            if reused and not conn.got_bytes and isinstance(
                    e, (ConnectionError, asyncio.IncompleteReadError)):
                # A pooled connection the replica had already closed (its engine restarted
                # or died, or it dropped the idle connection): nothing of an answer came,
                # so the request never reached a live engine. Send it once on a new
                # connection, which fails as ConnectFailed when the engine is gone (the
                # gateway then moves on).
                return await self._post_fresh(endpoint, key, head + body)
            self._no_answer(endpoint, e)
        return Response(conn.status, conn.headers, conn, self, self.timeouts.read_s)

    def send_now(self, endpoint: str, path: str, body: bytes, api_key: str,
                 done: Callable[[ReplicaConnection], None]) -> ReplicaConnection | None:
        """Write one POST on an idle pooled connection to the replica, at once, and call
        done(conn) from the event loop when the whole answer is in (conn.status,
        conn.headers, conn.take()) or it failed (conn.failed); then give it to finish().
        None, with nothing sent, when no pooled connection is at hand."""
        key, head = self._target(endpoint, path, api_key, b"application/json")
        replica = self._replicas.get(key)
        now = time.monotonic()
        conn = replica.pop_idle(now) if replica is not None else None
        if conn is None:
            return None
        conn._begin()
        conn.on_done = done
        read_s = self.timeouts.read_s
        conn.read_at = now
        if conn._timer is None:
            conn._timer = asyncio.get_running_loop().call_later(read_s, conn._expire, read_s)
        assert conn.transport is not None  # an idle pooled connection is connected
        conn.transport.write(head + b"%d\r\n\r\n" % len(body) + body)
        return conn

    @staticmethod
    def stale(conn: ReplicaConnection) -> bool:
        """A request sent by send_now on a connection the replica had closed: nothing of an
        answer came, so it never reached a live engine and may be sent again (as post()
        does on a new connection)."""
        return not conn.got_bytes and isinstance(
            conn.failed, (ConnectionError, asyncio.IncompleteReadError))

    def failure(self, conn: ReplicaConnection, endpoint: str) -> str:
        """What went wrong with a request send_now sent, worded as post() and iter_raw()
        word it."""
        error, read_s = conn.failed, self.timeouts.read_s
        if not conn.status:  # no answer's head came
            if isinstance(error, TimeoutError):
                return (f"{endpoint} sent no answer within {read_s:g} s "
                        "(upstream_read_timeout_s in server.yaml)")
            return (f"{endpoint} took the request and closed the connection without an "
                    f"answer: {error!r}")
        if isinstance(error, TimeoutError):
            return (f"the replica sent nothing for {read_s:g} s (upstream_read_timeout_s in "
                    "server.yaml)")
        return f"the replica broke off its answer: {error!r}"

    def finish(self, conn: ReplicaConnection) -> None:
        """After send_now's done: the connection back to the pool, or closed."""
        keep = conn.complete and conn.headers.get(b"connection", b"").lower() != b"close"
        self._give_back(conn, keep)

    def _target(self, endpoint: str, path: str, api_key: str, content_type: bytes
                ) -> tuple[tuple[str, int], bytes]:
        """Where a request goes and its head up to the body's length, made once."""
        made = self._targets.get((endpoint, path, api_key, content_type))
        if made is not None:
            return made
        url = urlsplit(endpoint)
        key = (url.hostname or "127.0.0.1", url.port or 80)
        head = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + url.netloc.encode()
                + b"\r\nAuthorization: Bearer " + api_key.encode()
                + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: ")
        if len(self._targets) >= 4096:  # replicas come and go: the cache stays small
            self._targets.clear()
        self._targets[(endpoint, path, api_key, content_type)] = (key, head)
        return key, head

    async def _post_fresh(self, endpoint: str, key: tuple[str, int],
                          request: bytes) -> Response:
        conn, _ = await self._checkout(key, pooled=False)
        try:
            await _within(conn.send(request), self.timeouts.read_s)
        except BaseException as e:
            conn.close()
            self._no_answer(endpoint, e)
        return Response(conn.status, conn.headers, conn, self, self.timeouts.read_s)

    def _no_answer(self, endpoint: str, e: BaseException) -> NoReturn:
        """Raise the error for a request sent that got no answer's head (e itself when it
        is not the replica's doing: a cancellation)."""
        if isinstance(e, TimeoutError):
            raise UpstreamError(f"{endpoint} sent no answer within "
                                f"{self.timeouts.read_s:g} s (upstream_read_timeout_s in "
                                "server.yaml)") from e
        if isinstance(e, (OSError, asyncio.IncompleteReadError, ValueError)):
            raise UpstreamError(f"{endpoint} took the request and closed the connection "
                                f"without an answer: {e!r}") from e
        raise e

    async def _checkout(self, key: tuple[str, int], pooled: bool = True
                        ) -> tuple[ReplicaConnection, bool]:
        """A pooled connection (and True), else a new one (and False); at the replica's
        limit, the first connection given back or the place of one that closed."""
        replica = self._replicas.get(key)
        if replica is None:
            replica = self._replicas[key] = _Replica(self.max_connections)
        conn = replica.pop_idle(time.monotonic()) if pooled else None
        if conn is not None:
            return conn, True
        if replica.open < replica.limit:
            replica.open += 1
        else:
            handed = await self._wait_turn(key, replica)
            if handed is not None:
                return handed, True
        try:
            return await self._connect(key, replica), False
        except BaseException:
            replica.closed()
            raise

    async def _wait_turn(self, key: tuple[str, int], replica: _Replica
                         ) -> ReplicaConnection | None:
        waiter: asyncio.Future[ReplicaConnection | None] = \
            asyncio.get_running_loop().create_future()
        replica.waiters.append(waiter)
        try:
            async with asyncio.timeout(self.timeouts.read_s):
                return await waiter
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():
                # Handed a connection or a place just as the wait ended: pass it on.
                handed = waiter.result()
                if handed is None:
                    replica.closed()
                else:
                    self._give_back(handed, keep=True)
            if isinstance(e, TimeoutError):
                raise ConnectFailed(
                    f"all {replica.limit} connections to {key[0]}:{key[1]} stayed busy for "
                    f"{self.timeouts.read_s:g} s (upstream_read_timeout_s in server.yaml); "
                    "the request was not sent") from e
            raise
        finally:
            if waiter in replica.waiters:
                replica.waiters.remove(waiter)

    async def _connect(self, key: tuple[str, int], replica: _Replica) -> ReplicaConnection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: ReplicaConnection(replica), *key),
                self.timeouts.connect_s)
        except (OSError, TimeoutError) as e:
            raise ConnectFailed(f"cannot connect to {key[0]}:{key[1]}: {e!r}") from e
        return conn

    def _give_back(self, conn: ReplicaConnection, keep: bool) -> None:
        if not keep:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        if not conn.replica.hand_over(conn):
            conn.replica.idle.append(conn)

    async def aclose(self) -> None:
        for replica in self._replicas.values():
            for conn in replica.idle:
                conn.close()
            replica.idle.clear()
