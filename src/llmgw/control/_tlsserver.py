"""The agent API's server: TLS admission, then llmgw's HTTP/1.1 core, on one event loop in a
thread of its own (no thread per connection).

Not the core's own listener: the handshake is admitted here, before a connection may cost
anything, and identity comes from it (the core hands the verified client certificate's CN
and serial to the app in the scope's TLS extension). Every node reaches this port, and a
client without a certificate may connect (to join), so a connection is admitted in three
steps: its first byte and whole ClientHello must come within first_byte_timeout_s (it
takes no handshake slot meanwhile: a silent or half-done connection cannot keep a node
out), then it waits for one of HANDSHAKES_AT_ONCE slots (at most HANDSHAKE_QUEUE_S), then
the handshake must end within the handshake deadline. The requests are read by the core
(`llmgw.http1.server`) under its limits: a head or body that stops part-way is closed by its
deadline, before any certificate check would matter; framing the core refuses (two
Content-Lengths, an unknown coding, folded lines) never reaches the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from llmgw.config import AGENT_LIMITS
from llmgw.http1.asgi import Receive, Scope, Send
from llmgw.http1.limits import Limits
from llmgw.http1.server import Http1Server

log = logging.getLogger("llmgw.agent_api")

BACKLOG = 2048
# TLS handshakes in progress at once; the rest wait, accepted, in their sockets. Every node
# reconnects after a control-plane restart: handshakes all in progress together each take
# seconds, the agents give up on them and try again, and the work done is lost.
HANDSHAKES_AT_ONCE = 32
# A connection that waited this long for its turn is closed unanswered: its agent gives up
# on a handshake at 10 s, so the work would come too late; closed, the agent backs off and
# comes back when the queue is shorter.
HANDSHAKE_QUEUE_S = 5.0
# The handshake's deadline when set (tests set it); else the limits' handshake_timeout_s.
HANDSHAKE_TIMEOUT_S: float | None = None
# A TLS record: type 22 (handshake), a version, a length of at most 2^14 (+ expansion).
_HANDSHAKE_RECORD = 0x16
_MAX_RECORD = (1 << 14) + 2048
# How often a connection whose ClientHello came in part is looked at again (a readable
# socket with unread bytes would wake the loop at once, over and over).
_HELLO_POLL_S = 0.05
# A stopping server lets answers under way finish this long: agents reconnect by themselves.
DRAIN_S = 1.0


class _NotTLS(Exception):
    """The first bytes are not a TLS handshake record."""


@dataclass(frozen=True)
class Peer:
    """Who is on the other end, from the handshake: cn and serial are '' for a client that
    showed no certificate (allowed only where a route says so)."""

    cn: str
    serial: str
    addr: str


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: bytes
    peer: Peer

    def json(self) -> Any:
        return json.loads(self.body or b"{}")


@dataclass
class Reply:
    status: int
    body: Any
    close: bool = False
    # Retry-After, in seconds (0: none): a 503 says when to try again.
    retry_after: int = 0


# A reply, or for a route that holds its answer (a node's watch) an awaitable one, awaited
# on the loop until it comes or the client leaves.
Handler = Callable[[Request], Reply | Awaitable[Reply]]


def peer_of(scope: Scope) -> Peer:
    """Who sent this request, from the core's TLS extension ("" for no certificate)."""
    tls = scope.get("extensions", {}).get("tls") or {}
    client = scope.get("client") or ("?", 0)
    return Peer(cn=str(tls.get("client_cert_common_name", "")),
                serial=str(tls.get("client_cert_serial", "")), addr=str(client[0]))


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (its TLS runs in C: a beat costs a fraction of
    the CPU it does on asyncio's Python TLS), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class TLSServer:
    """Serves handler on host:port in a thread of its own running one event loop.

    gate(method, path, peer), when it answers, answers a request from its head alone (a
    401 for a path that needs a certificate the client did not show: no body is waited
    for); refused(peer) turns away a client that passed the handshake (a revoked serial)."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext, handler: Handler,
                 *, refused: Callable[[Peer], str | None] = lambda peer: None,
                 gate: Callable[[str, str, Peer], Reply | None] = lambda m, p, peer: None,
                 limits: Limits | None = None) -> None:
        self.context = context
        self._handler = handler
        self._refused = refused
        self._gate = gate
        # server.yaml's agent_http, or its defaults.
        self.limits = limits or AGENT_LIMITS
        self.http = Http1Server(self._app, drain_s=DRAIN_S, limits=self.limits)
        self._loop = new_event_loop()
        self._sock = self._listen(host, port)
        self._accepting: asyncio.Task[None] | None = None
        self._serving: asyncio.Task[None] | None = None
        self._handshakes: asyncio.Semaphore | None = None
        self._admitting: set[asyncio.Task[None]] = set()
        self.accepted = 0  # connections served since start
        self.shed = 0  # connections closed after waiting HANDSHAKE_QUEUE_S for a handshake
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-api",
                                        daemon=True)

    @staticmethod
    def _listen(host: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
        return sock

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._handshakes = asyncio.Semaphore(HANDSHAKES_AT_ONCE)
        self._serving = await self.http.start(sockets=[])
        self._protocol = self.http.protocol_factory()
        self._accepting = loop.create_task(self._accept())

    async def _accept(self) -> None:
        """Accept every connection at once (cheap); its TLS waits for its hello, then a turn."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as e:  # out of file descriptors, say: the next may do
                log.warning("accepting a connection failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._admit(sock))
            self._admitting.add(task)
            task.add_done_callback(self._admitting.discard)

    async def _admit(self, sock: socket.socket) -> None:
        """The whole ClientHello within the first-byte deadline, then the TLS handshake, at
        most HANDSHAKES_AT_ONCE together, then the requests (the core's)."""
        assert self._handshakes is not None
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(_hello(sock), self.limits.first_byte_timeout_s)
        except (TimeoutError, OSError, _NotTLS):
            sock.close()
            return
        hello_at = loop.time()
        async with self._handshakes:
            if loop.time() - hello_at > HANDSHAKE_QUEUE_S:
                self.shed += 1
                sock.close()
                return
            deadline = HANDSHAKE_TIMEOUT_S or self.limits.handshake_timeout_s
            try:
                transport, _ = await loop.connect_accepted_socket(
                    self._protocol, sock, ssl=self.context, ssl_handshake_timeout=deadline)
            except (OSError, ssl.SSLError, TimeoutError, ConnectionError):
                sock.close()
                return
        raw = transport.get_extra_info("socket")
        if raw is not None:
            # An answer is one write, sent at once (asyncio and uvloop set this too).
            with contextlib.suppress(OSError):
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.accepted += 1

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the server's loop, after what it is doing now (nothing once stopped)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn)

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    async def _stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        self._sock.close()
        for task in list(self._admitting):
            task.cancel()
        self.http.should_exit = True
        if self._serving is not None:
            with contextlib.suppress(Exception):
                await self._serving

    def connections(self) -> int:
        return len(self.http.connections)

    def drop(self, serials: set[str]) -> None:
        """Close every open connection whose client certificate has one of serials."""
        def revoked(tls: dict[str, Any] | None) -> bool:
            return bool(tls) and tls["client_cert_serial"] in serials  # type: ignore[index]

        def drop_now() -> None:
            if (cut := self.http.drop(revoked)):
                log.info("closed %d connection(s) of revoked serials %s", cut,
                         ", ".join(sorted(serials)))
        self._loop.call_soon_threadsafe(drop_now)

    # --- the app the core runs for each request ---

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no lifespan to speak
        peer = peer_of(scope)
        method, path = scope["method"], scope["path"]
        why = self._refused(peer)
        if why:
            log.info("refused %s from %s: %s", peer.cn, peer.addr, why)
            await _send(send, Reply(403, {"detail": f"refused: {why}"}, close=True))
            return
        early = self._gate(method, path, peer)
        if early is not None:
            await _send(send, early)
            return
        body = await _body(receive)
        if body is None:
            return  # the client left (or a deadline let it go) before its body came
        query = dict(parse_qsl(scope["query_string"].decode("latin-1")))
        request = Request(method, path, query, body, peer)
        try:
            # On the loop itself: a beat's SQLite work takes well under a millisecond,
            # less than handing it to a thread and back.
            answer = self._handler(request)
            reply = answer if isinstance(answer, Reply) else await _unless_gone(answer, receive)
        except Exception:  # one bad request must not take the agent API down
            log.exception("%s %s from %s failed", method, path, peer.cn or peer.addr)
            reply = Reply(500, {"detail": "the control plane failed on this request; see "
                                          "its log"}, close=True)
        if reply is not None:
            await _send(send, reply)


async def _unless_gone(answer: Awaitable[Reply], receive: Receive) -> Reply | None:
    """A held answer, or None as soon as its client leaves (the answer is then cancelled:
    a node that went away holds nothing here)."""
    held = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(receive())  # once the body was read: only a disconnect
    try:
        await asyncio.wait((held, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (held, gone):
            if not task.done():
                task.cancel()
    return held.result() if held.done() and not held.cancelled() else None


async def _body(receive: Receive) -> bytes | None:
    """The whole body (the core holds it to the limits' max_body_bytes, answering 413
    beyond); None when the client went first."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _send(send: Send, reply: Reply) -> None:
    data = json.dumps(reply.body).encode()
    headers = [(b"content-type", b"application/json")]
    if reply.close:
        headers.append((b"connection", b"close"))
    if reply.retry_after:
        headers.append((b"retry-after", str(reply.retry_after).encode()))
    # The head and body in one write (the core joins them): two small writes would wait
    # out Nagle and delayed ACKs.
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _hello(sock: socket.socket) -> None:
    """Until the socket holds a whole TLS record (its ClientHello), read without taking it
    (MSG_PEEK: the handshake reads it); _NotTLS for anything else, ConnectionError if the
    client leaves first."""
    loop = asyncio.get_running_loop()
    need = 5
    while True:
        try:
            data = sock.recv(need, socket.MSG_PEEK)
        except BlockingIOError:
            data = None
        if data is not None:
            if not data:
                raise ConnectionError("closed before its ClientHello")
            if data[0] != _HANDSHAKE_RECORD:
                raise _NotTLS(f"first byte {data[0]:#x}")
            if len(data) >= 5:
                need = 5 + int.from_bytes(data[3:5], "big")
                if need > _MAX_RECORD:
                    raise _NotTLS(f"a record of {need} bytes")
                if len(data) >= need:
                    return
            await asyncio.sleep(_HELLO_POLL_S)
            continue
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(sock.fileno(), _settle, readable)
        try:
            await readable
        finally:
            loop.remove_reader(sock.fileno())


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
