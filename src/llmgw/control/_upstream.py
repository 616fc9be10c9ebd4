"""A small pooled HTTP/1.1 client for the gateway's hot path: replicas only, POST only.

httpx costs the gateway about as much CPU per request as the engine spends on a short
answer (profiled, issue 11), so the hot path speaks HTTP/1.1 itself over asyncio streams.
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
from urllib.parse import urlsplit

from llmgw.errors import Error

# llama-server (cpp-httplib) closes a connection idle for 5 s; a pooled one is dropped
# sooner, so a request is never written into a socket the engine is closing.
IDLE_EXPIRY_S = 2.0
# cpp-httplib gives each open connection one of the engine's HTTP threads for as long as
# requests keep coming on it; a connection beyond the threads waits, unserved, until one
# frees. With 32 busy keep-alive connections on a default engine (6 threads: slots + 2) a
# new connection waited 5-7 s, and so did the agent's /health probe, on its own fresh
# connection (measured, issue 11). So the gateway opens at most this many connections to
# one replica, in use and idle together, and the agent starts engines with more HTTP
# threads than this (control/engine_args.py HTTP_THREADS): some are always free for the
# probe. A request beyond them waits in the gateway for a connection, not in the engine.
MAX_CONNECTIONS_PER_REPLICA = 64


class UpstreamError(Error):
    """The replica failed after the request was sent: answered nothing, or broke off."""


class ConnectFailed(UpstreamError):
    """The request never reached the replica: connection refused, unreachable, timed out,
    or no connection to it freed in time."""


@dataclass
class Timeouts:
    connect_s: float = 5.0
    read_s: float = 600.0


class _Replica:
    """One replica's connections: the idle ones, how many are open, and the requests
    waiting for one (each is handed a connection, or a free place to open one)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle: list[_Conn] = []
        self.open = 0
        self.waiters: deque[asyncio.Future[_Conn | None]] = deque()

    def hand_over(self, conn: _Conn | None) -> bool:
        """Give a connection (or, for None, its place) to the first waiter, if any."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

    def closed(self) -> None:
        """A connection closed: its place goes to a waiter, or is free."""
        if not self.hand_over(None):
            self.open -= 1


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    replica: _Replica
    idle_since: float = 0.0
    _closed: bool = False

    def usable(self, now: float) -> bool:
        return (not self.reader.at_eof() and not self.writer.is_closing()
                and now - self.idle_since < IDLE_EXPIRY_S)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.writer.close()
            self.replica.closed()


@dataclass
class Response:
    """A replica's answer: status and headers read, the body still on the wire."""

    status: int
    headers: dict[bytes, bytes]
    _conn: _Conn
    _pool: Upstream
    _read_s: float
    _done: bool = field(default=False)
    # Called once, when the answer is done with (read whole, broken off or hung up on).
    on_release: Callable[[], None] | None = None

    @property
    def chunked(self) -> bool:
        return self.headers.get(b"transfer-encoding", b"").lower() == b"chunked"

    async def read(self) -> bytes:
        return b"".join([part async for part in self.iter_raw()])

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, de-chunked; the connection is pooled after."""
        try:
            if self.chunked:
                async for part in self._chunks():
                    yield part
            elif b"content-length" in self.headers:
                n = int(self.headers[b"content-length"])
                if n:
                    yield await self._wait(self._conn.reader.readexactly(n))
            else:
                while part := await self._wait(self._conn.reader.read(65536)):
                    yield part
                self.headers[b"connection"] = b"close"
            self._done = True
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            raise UpstreamError(f"the replica broke off its answer: {e!r}") from e
        finally:
            self.release()

    async def _chunks(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        while True:
            size_line = await self._wait(reader.readuntil(b"\r\n"))
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                await self._wait(reader.readuntil(b"\r\n"))  # no trailers from llama-server
                return
            data = await self._wait(reader.readexactly(size + 2))
            yield data[:-2]

    async def _wait(self, step):  # type: ignore[no-untyped-def]
        # asyncio.timeout, not wait_for: wait_for wraps each read in a task (profiled).
        try:
            async with asyncio.timeout(self._read_s):
                return await step
        except TimeoutError as e:
            raise UpstreamError(f"the replica sent nothing for {self._read_s:g} s "
                                "(upstream_read_timeout_s in server.yaml)") from e

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
        self._conn = None  # type: ignore[assignment]
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

    async def post(self, endpoint: str, path: str, body: bytes, api_key: str,
                   content_type: bytes = b"application/json") -> Response:
        """Send one POST to a replica and read its status and headers."""
        url = urlsplit(endpoint)
        key = (url.hostname or "127.0.0.1", url.port or 80)
        host = url.netloc.encode()
        head = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + host
                + b"\r\nAuthorization: Bearer " + api_key.encode()
                + b"\r\nContent-Type: " + content_type
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        conn, reused = await self._checkout(key)
        try:
            conn.writer.write(head + body)
            async with asyncio.timeout(self.timeouts.read_s):
                status, headers = await self._head(conn.reader)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            conn.close()
            if not reused or (isinstance(e, asyncio.IncompleteReadError) and e.partial):
                raise UpstreamError(f"{endpoint} took the request and closed the "
                                    f"connection without an answer: {e!r}") from e
            # A pooled connection the replica had already closed (its engine restarted or
            # died, or it dropped the idle connection): nothing of an answer came, so the
            # request never reached a live engine. Send it once on a new connection, which
            # fails as ConnectFailed when the engine is gone (the gateway then moves on).
            return await self._post_fresh(endpoint, key, head + body)
        except BaseException as e:
            conn.close()
            if isinstance(e, TimeoutError):
                raise UpstreamError(f"{endpoint} sent no answer within "
                                    f"{self.timeouts.read_s:g} s (upstream_read_timeout_s "
                                    "in server.yaml)") from e
            if isinstance(e, (OSError, asyncio.IncompleteReadError, ValueError)):
                raise UpstreamError(f"{endpoint} took the request and closed the "
                                    f"connection without an answer: {e!r}") from e
            raise
        return Response(status, headers, conn, self, self.timeouts.read_s)

    async def _post_fresh(self, endpoint: str, key: tuple[str, int],
                          request: bytes) -> Response:
        conn, _ = await self._checkout(key, pooled=False)
        try:
            conn.writer.write(request)
            async with asyncio.timeout(self.timeouts.read_s):
                status, headers = await self._head(conn.reader)
        except BaseException as e:
            conn.close()
            if isinstance(e, (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError)):
                raise UpstreamError(f"{endpoint} took the request and closed the "
                                    f"connection without an answer: {e!r}") from e
            raise
        return Response(status, headers, conn, self, self.timeouts.read_s)

    async def _checkout(self, key: tuple[str, int], pooled: bool = True
                        ) -> tuple[_Conn, bool]:
        """A pooled connection (and True), else a new one (and False); at the replica's
        limit, the first connection given back or the place of one that closed."""
        replica = self._replicas.setdefault(key, _Replica(self.max_connections))
        now = time.monotonic()
        while pooled and replica.idle:
            conn = replica.idle.pop()
            if conn.usable(now):
                return conn, True
            conn.close()
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

    async def _wait_turn(self, key: tuple[str, int], replica: _Replica) -> _Conn | None:
        waiter: asyncio.Future[_Conn | None] = asyncio.get_running_loop().create_future()
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

    async def _connect(self, key: tuple[str, int], replica: _Replica) -> _Conn:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(*key, limit=1 << 20), self.timeouts.connect_s)
        except (OSError, TimeoutError) as e:
            raise ConnectFailed(f"cannot connect to {key[0]}:{key[1]}: {e!r}") from e
        return _Conn(reader, writer, replica)

    @staticmethod
    async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw[:-4].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def _give_back(self, conn: _Conn, keep: bool) -> None:
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
