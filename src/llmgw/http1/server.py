"""A lean HTTP/1.1 server for one ASGI app: the core every listener of llmgw's own runs.

In front of a scripted replica (no engine time), the gateway under uvicorn spent 0.10 ms
of CPU a request at 16 in flight and 0.25 ms at 1; under this server 0.085 and 0.215,
side by side (nginx: 0.022 and 0.06). uvicorn's share was its cycle objects, default
headers, flow-control and event objects, and the writes it gathers only through its
private classes. This server does what llmgw needs and no more, in one asyncio protocol
per connection. HTTP/1.1 (and 1.0) only: no upgrades, no HTTP/2. Its parts, one job each:

- `_parse`: the sans-IO request parser, where `Limits`' sizes and RFC 9112's
  refusals are counted as it reads;
- `_conn`: one connection (keep-alive, pipelining, deadlines, backpressure,
  sendfile, the TLS scope, the drain of one connection);
- `_cycle`: one request and its answer (the app's receive() and send());
- this module: the server (listen, serve, lifespan, started/should_exit, drain).

What a client may send, and how slowly, is held as it reads (`Limits`): the head on raw
bytes, the header count, the body with its framing (the parser), a deadline for the head,
a minimum rate for the body and for taking the answer (the connection).

A fast handler (fast=, the gateway's Forwarder: the one fast interface) is offered each
request once its whole body is in, and may answer it from callbacks, with no task:
Cycle.answer writes it whole, or Cycle.start, write and end as it comes, told when the
client takes what was written (when_writable) or leaves (when_gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import threading
from collections.abc import Callable
from typing import Any

from llmgw.config import parse_listen
from llmgw.http1._conn import IDLE_DRAIN_S, SENDFILE_CHUNK_BYTES, _Connection
from llmgw.http1._cycle import BODY_READ_AHEAD_BYTES, Cycle
from llmgw.http1.asgi import Lifespan
from llmgw.http1.limits import Limits
from llmgw.http1.service import run_service

__all__ = ["BODY_READ_AHEAD_BYTES", "DEFAULT_LIMITS", "IDLE_DRAIN_S", "KEEP_ALIVE_S",
           "MAX_HEAD_BYTES", "SENDFILE_CHUNK_BYTES", "Cycle", "Http1Server"]

log = logging.getLogger("llmgw.http")

DEFAULT_LIMITS = Limits()
# An idle keep-alive connection is closed after this long (uvicorn's default too).
KEEP_ALIVE_S = DEFAULT_LIMITS.keep_alive_s
# A request's line and headers together may be this long at most: 431 beyond.
MAX_HEAD_BYTES = DEFAULT_LIMITS.max_head_bytes
BACKLOG = 4096


class Http1Server:
    """Serves app on listen (HOST:PORT) or on sockets handed to serve(); HTTPS with
    certfile (the chain, leaf first) and keyfile. `started`, an event, is set once it
    listens (a thread waits on it; the serving loop awaits `start()` or `wait_started()`),
    `should_exit = True` to stop (a service's signal handler sets it: `service`).

    On stop: no new connections; requests under way (streams too) get drain_s to finish,
    idle connections are closed without losing a request on the wire; then whatever is
    left is cut.

    fast, when given (the server's one fast interface, the gateway's alone), is offered
    each request once its whole body is in (held up to limits.max_body_bytes; a client
    that expects 100-continue is told to send it), before the app: it returns False to
    leave it to the app, or True having taken it, and then answers it from the event
    loop's callbacks, no task: cycle.answer, or cycle.start, write and end.

    limits: what each client may send and how slowly (`Limits`; its defaults otherwise).
    A caller that accepts connections itself (TLS admission) serves them with
    protocol_factory(), and serve(sockets=[]) listens on nothing of its own."""

    def __init__(self, app: Any, listen: str = "", *, drain_s: float = 30.0,
                 certfile: str = "", keyfile: str = "",
                 fast: Callable[[Cycle], bool] | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.app = app
        self.fast = fast
        self.limits = limits
        self.listen = listen
        self.drain_s = drain_s
        self.ssl: ssl.SSLContext | None = None
        if certfile:
            self.ssl = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.ssl.load_cert_chain(certfile, keyfile or None)
        # Set once it listens: a threading.Event for the threads that wait on it (tests, a
        # check's server), an asyncio.Event for the serving loop (bound on its first wait).
        self.started = threading.Event()
        self._listening = asyncio.Event()
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

    async def start(self, sockets: list[Any] | None = None) -> asyncio.Task[None]:
        """serve(sockets) in a task, returned once it listens; what serve() raised (an
        OSError when it cannot listen) when it stopped before."""
        serving = asyncio.get_running_loop().create_task(self.serve(sockets))
        listening = asyncio.ensure_future(self._listening.wait())
        try:
            await asyncio.wait((serving, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
        if not self._listening.is_set():
            await serving  # it raised, or it stopped before it listened
            raise RuntimeError(f"the server stopped before it listened on {self.listen}")
        return serving

    async def wait_started(self) -> None:
        """Return once it listens (call it in the serving loop)."""
        await self._listening.wait()

    def protocol_factory(self) -> Callable[[], asyncio.Protocol]:
        """What makes a connection of this server, for a caller that accepts sockets
        itself: `loop.connect_accepted_socket(server.protocol_factory(), sock, ssl=ctx,
        ssl_handshake_timeout=...)`. Its connections are limited, tracked and drained like
        the listeners' (call it in the serving loop, once serve() has started)."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        return lambda: _Connection(self)

    def _handshake_timeout(self) -> float | None:
        # asyncio refuses a handshake timeout without TLS.
        return self.limits.handshake_timeout_s if self.ssl is not None else None

    def drop(self, predicate: Callable[[dict[str, Any] | None], bool]) -> int:
        """Cut every connection whose TLS extension (scope["extensions"]["tls"]; None on
        plain HTTP) predicate holds for, at once, its tasks cancelled (a revoked
        certificate's connections); how many were cut. Call it in the serving loop."""
        doomed = [conn for conn in self.connections if predicate(conn.tls)]
        for conn in doomed:
            conn.abort()
        return len(doomed)

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self._exiting = asyncio.Event()
        if self._should_exit:
            self._exiting.set()
        lifespan = Lifespan(self.app)
        await lifespan.startup()
        servers = []
        try:
            if sockets is not None:
                for sock in sockets:
                    servers.append(await self.loop.create_server(
                        lambda: _Connection(self), sock=sock, ssl=self.ssl, backlog=BACKLOG,
                        ssl_handshake_timeout=self._handshake_timeout()))
            elif self.listen:
                host, port = parse_listen(self.listen)
                servers.append(await self.loop.create_server(
                    lambda: _Connection(self), host, port, ssl=self.ssl, backlog=BACKLOG,
                    ssl_handshake_timeout=self._handshake_timeout(),
                    reuse_address=True))
            self._listening.set()
            self.started.set()
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

