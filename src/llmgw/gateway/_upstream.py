"""A small pooled HTTP/1.1 client for the data plane: the gateway's requests to replicas and
the slot poller's GETs.

httpx costs the gateway about as much CPU per request as the engine spends on a short
answer (profiled), so the data plane speaks HTTP/1.1 itself: an asyncio protocol per
connection, its answers parsed by httptools (the parser uvicorn uses), read by callbacks.
One request is a `Call`, told of its answer by callbacks (`Reader`); `post()` and `get()`
are thin futures over one. It tells the two failures that matter apart: ConnectFailed
(the request never reached the engine: safe to try another replica) and UpstreamError (it
was sent: never resent, so a generation is never run twice), but for one case, decided in
one place (`Call.failed`): a pooled connection the replica had closed is sent once more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

from llmgw.config import ServerConfig
from llmgw.errors import Error
from llmgw.gateway._replica_conn import Replica, ReplicaConnection, TooLarge
from llmgw.model.engine_args import MAX_CONNECTIONS_PER_REPLICA

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
            self.upstream.give_back(conn)
        else:
            conn.close()

    # --- the sequence ---

    def start(self, pooled: bool = True) -> None:
        replica = self.upstream.replica(self.key)
        conn = replica.pop_idle(time.monotonic()) if pooled and replica.idle else None
        if conn is not None:
            self._send(conn, reused=True)
        elif replica.open < replica.limit:
            replica.open += 1
            self._open(replica)
        else:
            self._wait_turn(replica)

    def _wait_turn(self, replica: Replica) -> None:
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
                    self.upstream.give_back(conn)
            elif conn is None:
                self._open(replica)
            else:
                self._send(conn, reused=True)

        waiter.add_done_callback(handed)

    def _open(self, replica: Replica) -> None:
        """A new connection, in a task of its own (its place at the limit taken)."""
        opening = asyncio.ensure_future(self.upstream.connect(self.key, replica))
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

    def head_read(self) -> None:
        self.reader.answer_head(self)

    def body_read(self) -> None:
        self.reader.answer_data(self)

    def _refused(self, error: ConnectFailed) -> None:
        self._ended = True
        self.reader.answer_failed(self, error)

    def failed(self, conn: ReplicaConnection, error: BaseException) -> None:
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
        if isinstance(error, TooLarge):
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
        self._replicas: dict[tuple[str, int], Replica] = {}
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

    def replica(self, key: tuple[str, int]) -> Replica:
        replica = self._replicas.get(key)
        if replica is None:
            replica = self._replicas[key] = Replica(self.max_connections)
        return replica

    async def connect(self, key: tuple[str, int], replica: Replica) -> ReplicaConnection:
        loop = asyncio.get_running_loop()
        read_s = self.timeouts.read_s
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: ReplicaConnection(replica, read_s), *key),
                self.timeouts.connect_s)
        except (OSError, TimeoutError) as e:
            raise ConnectFailed(f"cannot connect to {key[0]}:{key[1]}: {e!r}") from e
        return conn

    def give_back(self, conn: ReplicaConnection) -> None:
        conn.idle_since = time.monotonic()
        if not conn.replica.hand_over(conn):
            conn.replica.idle.append(conn)

    async def aclose(self) -> None:
        for replica in self._replicas.values():
            for conn in replica.idle:
                conn.close()
            replica.idle.clear()
