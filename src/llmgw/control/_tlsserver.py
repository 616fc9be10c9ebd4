"""A small HTTP/1.1 JSON server over TLS on asyncio: no thread per connection.

Served by hand rather than by uvicorn because uvicorn does not hand the verified client
certificate to the app (no ASGI TLS extension), and identity must come from the handshake.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl, urlsplit

log = logging.getLogger("llmgw.agent_api")

BACKLOG = 2048
MAX_BODY = 4 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 10.0
# TLS handshakes in progress at once; the rest wait, accepted, in their sockets. Every node
# reconnects after a control-plane restart: handshakes all in progress together each take
# seconds, the agents give up on them and try again, and the work done is lost.
HANDSHAKES_AT_ONCE = 32
# A connection that waited this long for its turn is closed unanswered: its agent gives up
# on a handshake at 10 s, so the work would come too late; closed, the agent backs off and
# comes back when the queue is shorter.
HANDSHAKE_QUEUE_S = 5.0
# Longer than any heartbeat interval, so a kept-alive agent never finds its connection gone.
IDLE_TIMEOUT_S = 120.0


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


Handler = Callable[[Request], Reply]


def peer_of(ssl_object: ssl.SSLObject | None, addr: str) -> Peer:
    cert = ssl_object.getpeercert() if ssl_object else None
    cn = ""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                cn = str(value)
    return Peer(cn=cn, serial=str((cert or {}).get("serialNumber", "")), addr=addr)


def _encode(reply: Reply, keep_alive: bool) -> bytes:
    data = json.dumps(reply.body).encode()
    reason = HTTPStatus(reply.status).phrase
    head = (
        f"HTTP/1.1 {reply.status} {reason}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    # Headers and body in one write: two small writes wait out Nagle and delayed ACKs.
    return head.encode() + data


@dataclass
class _Head:
    method: str
    target: str
    version: str
    headers: dict[str, str] = field(default_factory=dict)


def _parse_head(raw: bytes) -> _Head:
    lines = raw.decode("latin-1").split("\r\n")
    method, target, version = lines[0].split(" ", 2)
    head = _Head(method, target, version)
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            head.headers[name.strip().lower()] = value.strip()
    return head


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (its TLS runs in C: a beat costs a fraction of
    the CPU it does on asyncio's Python TLS), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class TLSServer:
    """Serves handler on host:port in a thread of its own running one event loop."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext, handler: Handler,
                 *, refused: Callable[[Peer], str | None] = lambda peer: None) -> None:
        self.context = context
        self._handler = handler
        self._refused = refused
        self._loop = new_event_loop()
        self._sock = self._listen(host, port)
        self._accepting: asyncio.Task[None] | None = None
        self._conns: dict[asyncio.StreamWriter, Peer] = {}
        self._handshakes: asyncio.Semaphore | None = None
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
        self._handshakes = asyncio.Semaphore(HANDSHAKES_AT_ONCE)
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        """Accept every connection at once (cheap); its TLS waits for a turn."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as e:  # out of file descriptors, say: the next may do
                log.warning("accepting a connection failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            loop.create_task(self._admit(sock))

    async def _admit(self, sock: socket.socket) -> None:
        """The TLS handshake, at most HANDSHAKES_AT_ONCE together, then the requests."""
        assert self._handshakes is not None
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=2 ** 16)
        protocol = asyncio.StreamReaderProtocol(reader)
        arrived = loop.time()
        async with self._handshakes:
            if loop.time() - arrived > HANDSHAKE_QUEUE_S:
                self.shed += 1
                sock.close()
                return
            try:
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol, sock, ssl=self.context,
                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
            except (OSError, ssl.SSLError, TimeoutError, ConnectionError):
                sock.close()
                return
        await self._connection(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the server's loop, after what it is doing now."""
        self._loop.call_soon_threadsafe(fn)

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop.close()

    async def _stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        self._sock.close()
        for writer in list(self._conns):
            writer.transport.abort()

    def connections(self) -> int:
        return len(self._conns)

    def drop(self, serials: set[str]) -> None:
        """Close every open connection whose client certificate has one of serials."""
        def drop_now() -> None:
            for writer, peer in list(self._conns.items()):
                if peer.serial in serials:
                    log.info("closing the connection of %s (serial %s): revoked",
                             peer.cn, peer.serial)
                    writer.transport.abort()
        self._loop.call_soon_threadsafe(drop_now)

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        addr = str((writer.get_extra_info("peername") or ("?",))[0])
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # An answer is one write, sent at once (asyncio and uvloop set this too).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = peer_of(writer.get_extra_info("ssl_object"), addr)
        why = self._refused(peer)
        if why:
            log.info("refused %s from %s: %s", peer.cn, addr, why)
            writer.transport.abort()
            return
        self._conns[writer] = peer
        self.accepted += 1
        try:
            await self._requests(reader, writer, peer)
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            self._conns.pop(writer, None)
            writer.close()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        peer: Peer) -> None:
        while True:
            try:
                raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_TIMEOUT_S)
            except asyncio.LimitOverrunError:
                writer.write(_encode(Reply(431, {"detail": "the headers are too large"}), False))
                return
            try:
                head = _parse_head(raw)
            except ValueError:
                writer.write(_encode(Reply(400, {"detail": "malformed request line"}), False))
                return
            reply = await self._read_and_handle(reader, head, peer)
            keep = (not reply.close and head.version == "HTTP/1.1"
                    and head.headers.get("connection", "").lower() != "close")
            writer.write(_encode(reply, keep))
            await writer.drain()
            if not keep:
                return

    async def _read_and_handle(self, reader: asyncio.StreamReader, head: _Head,
                               peer: Peer) -> Reply:
        if "chunked" in head.headers.get("transfer-encoding", "").lower():
            return Reply(411, {"detail": "send a Content-Length, not a chunked body"}, True)
        try:
            length = int(head.headers.get("content-length") or 0)
        except ValueError:
            return Reply(400, {"detail": "Content-Length is not a number"}, True)
        if length > MAX_BODY:
            return Reply(413, {"detail": f"a request body is at most {MAX_BODY} bytes"}, True)
        body = await reader.readexactly(length) if length else b""
        url = urlsplit(head.target)
        request = Request(head.method, url.path, dict(parse_qsl(url.query)), body, peer)
        try:
            # On the loop itself: a beat's SQLite work takes well under a millisecond,
            # less than handing it to a thread and back.
            return self._handler(request)
        except Exception:  # one bad request must not take the agent API down
            log.exception("%s %s from %s failed", head.method, url.path, peer.cn or peer.addr)
            return Reply(500, {"detail": "the control plane failed on this request; "
                                         "see its log"}, True)
