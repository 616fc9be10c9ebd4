"""A lean HTTP/1.1 server for one ASGI app: the core every listener of llmgw's own runs.

In front of a scripted replica (no engine time), the gateway under uvicorn spent 0.10 ms
of CPU a request at 16 in flight and 0.25 ms at 1; under this server 0.085 and 0.215,
side by side (nginx: 0.022 and 0.06). uvicorn's share was its cycle objects, default
headers, flow-control and event objects, and the writes it gathers only through its
private classes. This server does what llmgw needs and no more, in one asyncio protocol
per connection: httptools parses the request, one task runs the app, an answer whose body
comes in one message leaves in one write with its head, a streamed one as HTTP chunks, a
file with sendfile (the ASGI zero-copy send extension). Keep-alive, pipelining (one
request at a time, in order), Expect: 100-continue, HEAD, a client that leaves
(http.disconnect), write backpressure and a drain that loses no request on the
wire are kept. HTTP/1.1 (and 1.0) only: no upgrades, no HTTP/2.

What a client may send, and how slowly, is held as it reads (`Limits`): the head on raw
bytes (a line that never ends is cut at the limit), the header count, the body with its
framing, a deadline for the head, a minimum rate for the body and for taking the answer.
RFC 9112's framing is refused where httptools takes it: Host (section 3.2), a transfer
coding other than chunked alone (6.1, 501), HTTP/1.0 with Transfer-Encoding (closed after
its answer), versions other than 1.0 and 1.1 (505). A refused request is answered only
after the answers ahead of it, and nothing behind it is read.

A fast handler (fast=, the gateway's fast path) may take a request whose body is in and
answer it from callbacks, with no task: Cycle.answer writes it whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
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
from llmgw._http1_close import close_transport
from llmgw._http1_limits import Limits
from llmgw._service import run_service
from llmgw.config import parse_listen

log = logging.getLogger("llmgw.http")

DEFAULT_LIMITS = Limits()
# An idle keep-alive connection is closed after this long (uvicorn's default too).
KEEP_ALIVE_S = DEFAULT_LIMITS.keep_alive_s
# How long an idle connection stays open once its server drains: a busy client sends its
# next request within milliseconds and gets Connection: close with the answer. (uvicorn
# closes an idle connection at once, and one whose answer promised keep-alive right after
# it: a client that sent its next request just then lost it.)
IDLE_DRAIN_S = 1.0
# A request's line and headers together may be this long at most: 431 beyond.
MAX_HEAD_BYTES = DEFAULT_LIMITS.max_head_bytes
# Reading from a client stops while this much of its body waits for the app.
BODY_READ_AHEAD_BYTES = 256 << 10
BACKLOG = 4096
# A zero-copy send goes out in chunks of this size, each within the write deadline; a read
# of this size feeds the same send where sendfile is not there (TLS, uvloop).
SENDFILE_CHUNK_BYTES = 1 << 20
FILE_READ_BYTES = 256 << 10

# RFC 9112 3.2 / RFC 3986 3.2.2: uri-host [ ":" port ], the IP-literal kept loose.
_HOST = re.compile(rb"(\[[0-9A-Fa-f:.vV]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(:[0-9]*)?")
# The request headers whose values the server itself reads.
_FRAMING = frozenset({b"host", b"transfer-encoding", b"content-length", b"expect"})
_TLS_VERSIONS = {"TLSv1": 0x0301, "TLSv1.1": 0x0302, "TLSv1.2": 0x0303, "TLSv1.3": 0x0304}

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
            if conn.lost or conn.closing or self.complete:
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
        """What the app sends; once the connection is lost or let go (a deadline, a refusal)
        a send returns at once, writing nothing, so no app waits on a gone client."""
        conn = self.conn
        kind = message["type"]
        if conn.lost or conn.closing:
            return
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            return
        if not self.started or self.complete:
            raise RuntimeError(f"{kind} sent before http.response.start or after the last "
                               "body")
        if kind == "http.response.zerocopysend":
            await self._send_file(message)
            return
        if kind != "http.response.body":
            raise RuntimeError(f"an HTTP app cannot send {kind!r}")
        self._write(message.get("body", b""), message.get("more_body", False))
        if not self.complete and conn.paused_writing:
            await conn.writable()

    async def _send_file(self, message: Message) -> None:
        """The ASGI zero-copy send extension: count bytes of file (a file object or a
        descriptor) from offset (its position) with sendfile where the transport has it.
        An answer with no content-length that ends here gets one; else it is chunked."""
        file = message["file"]
        fd = file if isinstance(file, int) else file.fileno()
        offset = message.get("offset")
        if offset is None:
            offset = os.lseek(fd, 0, os.SEEK_CUR)
        count = message.get("count")
        if count is None:
            count = os.fstat(fd).st_size - offset
        more = message.get("more_body", False)
        if self.status and not more and not any(
                name.lower() == b"content-length" for name, _ in self.headers):
            self.headers.append((b"content-length", b"%d" % count))
        self._write(b"", True)  # the head, if it is not written yet
        if count and not self.head_only:
            if self.chunked:
                self.conn.write(b"%x\r\n" % count)
            await self.conn.send_file(file, offset, count)
            if self.chunked:
                self.conn.write(b"\r\n")
        if not more:
            self._write(b"", False)

    def _write(self, body: bytes, more: bool) -> None:
        conn = self.conn
        if conn.lost or conn.closing:
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
    """One client connection: its parser, the answer under way and the requests behind it.

    One timer a connection, moved on rather than made for every request, holds its
    deadlines (0: none): idle keep-alive, the head, the body's rate, the answer's rate."""

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.loop = server.loop
        self.limits = server.limits
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.lost = False
        # Let go of by the server (closed, aborted): nothing more is read, written or begun.
        self.closing = False
        self.draining = False
        self.paused_writing = False
        self._drained: asyncio.Future[None] | None = None
        self._reading_paused = False
        self.current: Cycle | None = None    # the answer under way
        self.parsing: Cycle | None = None    # the request whose body is being read
        self.queued: deque[Cycle] = deque()  # pipelined requests behind the current one
        # The TLS extension of the scope (asgiref's names), for the server's drop().
        self.tls: dict[str, Any] | None = None
        self.extensions: dict[str, Any] = {"http.response.zerocopysend": {}}
        self._tasks: set[asyncio.Task[None]] = set()
        # What is read: nothing more once stopped (a refusal, or a request that closes).
        self._stopped = False
        self._refusal = b""  # written once the answers ahead of it are
        self._reading_head = True
        self._head_bytes = 0  # raw bytes of the head so far
        self._head_end = b""  # the last bytes of the head so far: its end may straddle reads
        self._received = 0    # raw bytes in all, for the body's rate
        self._unfed = 0       # bytes of the read being taken not yet fed to the parser
        self._begun = 0       # requests begun, to tell a read that holds the next one
        self._feeding = 0     # the body read being fed, and the body bytes before it
        self._feed_seen = 0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._field_bytes = 0
        self._hosts = 0
        self._host = b""
        self._codings: list[bytes] | None = None
        self._length = -1
        self._expect_continue = False
        self._body_seen = 0     # body bytes as httptools gave them
        self._body_framing = 0  # chunk sizes, extensions and trailers around them
        self._body_mark = 0
        self._write_mark = (0, 0)
        self._written = 0
        self._sendfile = True
        # Deadlines (loop time; 0 for none) and the one timer that holds them.
        self._timer: asyncio.TimerHandle | None = None
        self._idle_at = 0.0
        self._head_at = 0.0
        self._body_at = 0.0
        self._write_at = 0.0

    # --- the event loop's side ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self.client = transport.get_extra_info("peername")
        self.sockname = transport.get_extra_info("sockname")
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self.tls = _tls_extension(ssl_object)
            self.extensions["tls"] = self.tls
        if self.server.draining:
            self.shutdown()
        else:
            self._idle_at = self.loop.time() + self.limits.keep_alive_s
            self._arm(self._idle_at)

    def data_received(self, data: bytes) -> None:
        if not self._stopped:
            self._received += len(data)
            self._take(data)

    def _take(self, data: bytes) -> None:
        if not self._reading_head:
            seen, begun = self._body_seen, self._begun
            self._feeding, self._feed_seen = len(data), seen
            self._feed(data)
            self._feeding = 0
            if self._begun == begun and not self._stopped:
                # The whole read was this body's (no request began behind it): what
                # httptools did not hand on was its framing (chunk sizes, extensions,
                # trailers). A read that also holds the next request goes uncounted: at
                # most one read's worth of framing.
                self._body_framing += len(data) - (self._body_seen - seen)
                if self._body_seen + self._body_framing > self.limits.max_body_bytes:
                    self._fail(413, self._too_large())
            return
        if not self._head_bytes and not self._head_at:
            self._start_head()
        # Where this read's head ends, so the body behind it is counted as body.
        window = self._head_end + data
        end = window.find(b"\r\n\r\n")
        if 0 <= end and end + 4 - len(self._head_end) < len(data):
            cut = end + 4 - len(self._head_end)
            self._head_end = b""
            rest = data[cut:]
            self._unfed = len(rest)
            self._take(data[:cut])
            self._unfed = 0
            if not self._stopped:
                self._take(rest)
            return
        self._head_end = window[-3:]
        room = self.limits.max_head_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            self._feed(data)
            return
        # Fed only up to the limit: a line that never ends is not buffered past it.
        self._head_bytes += room
        self._feed(data[:room])
        if self._stopped:
            return
        if self._reading_head:
            self._fail(431, f"the request's line and headers are over "
                            f"{self.limits.max_head_bytes} bytes")
        else:
            self._take(data[room:])

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "this server speaks HTTP/1.1 only: no upgrade")
        except httptools.HttpParserError as e:
            # httptools wraps what a callback raises: the callback's reason is its context.
            why = e.__context__
            if isinstance(why, _Refusal):
                self._fail(why.status, why.why)
            elif not isinstance(why, _Stop):
                self._fail(400, f"the request is not valid HTTP/1.1: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for cycle in (self.current, self.parsing, *self.queued):
            if cycle is not None:
                cycle.wake()
        self.queued.clear()
        self._wake_writer()

    def pause_writing(self) -> None:
        self.paused_writing = True
        if not self._write_at:
            self._watch_writes()

    def resume_writing(self) -> None:
        self.paused_writing = False
        if not self.closing:
            self._write_at = 0.0
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
        self._begun += 1
        self._url, self._headers, self._field_bytes = b"", [], 0
        self._hosts, self._codings, self._length = 0, None, -1
        self._expect_continue = False
        if not self._head_at:  # a head that began inside the read that ended the last one
            self._start_head()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._field_bytes += len(url)
        if self._field_bytes > self.limits.max_head_bytes:
            raise _Refusal(431, f"the request's line and headers are over "
                                f"{self.limits.max_head_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._reading_head:
            return  # a trailer field: counted in the body's bytes, not kept
        self._field_bytes += len(name) + len(value)
        if self._field_bytes > self.limits.max_head_bytes:
            raise _Refusal(431, f"the request's line and headers are over "
                                f"{self.limits.max_head_bytes} bytes")
        if len(self._headers) >= self.limits.max_headers:
            raise _Refusal(431, f"the request has over {self.limits.max_headers} header "
                                "fields")
        name = name.lower()
        # RFC 9110 5.5: a field's value excludes the whitespace around it (httptools keeps
        # what trails it).
        value = value.rstrip(b" \t")
        if name in _FRAMING:
            self._framing(name, value)
        self._headers.append((name, value))

    def _framing(self, name: bytes, value: bytes) -> None:
        if name == b"host":
            self._hosts += 1
            self._host = value
        elif name == b"transfer-encoding":
            codings = [c.strip().lower() for c in value.split(b",")]
            self._codings = codings if self._codings is None else self._codings + codings
        elif name == b"content-length":
            self._length = int(value)  # httptools took it: digits, only one
        elif value.lower() == b"100-continue":
            self._expect_continue = True

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._head_at = 0.0
        method = self.parser.get_method()
        if method == b"CONNECT":
            raise _Refusal(501, "CONNECT is not served: this server is no proxy")
        if self._url == b"*" and method != b"OPTIONS":
            raise _Refusal(400, "the asterisk-form target is for OPTIONS only (RFC 9112 3.2.4)")
        keep_alive = self._check_framing() and not self.draining
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
            "extensions": self.extensions,
        }
        cycle = Cycle(self, scope, keep_alive, self._expect_continue)
        self.parsing = cycle
        if self._codings is not None or self._length > 0:
            self._start_body()
        if self.current is not None:
            self.queued.append(cycle)
            self.pause_reading()
        elif self.server.fast is not None and not cycle.expect_continue:
            self.current = cycle  # answered once its body is in (_begin)
            cycle.deferred = True
        else:
            self._start(cycle)

    def _check_framing(self) -> bool:
        """RFC 9112's framing rules httptools leaves to the server: _Refusal if broken;
        whether the connection may carry another request after this one."""
        version = self.parser.get_http_version()
        if version != "1.1" and version != "1.0":
            raise _Refusal(505, f"HTTP/{version} is not served here: send HTTP/1.1")
        if self._hosts > 1 or (not self._hosts and version == "1.1"):
            raise _Refusal(400, f"the request has {self._hosts} Host header fields; HTTP/1.1 "
                                "needs exactly one (RFC 9112 3.2)")
        if self._hosts and _HOST.fullmatch(self._host) is None:
            raise _Refusal(400, f"the Host header {self._host[:200]!r} is not host[:port]")
        keep_alive: bool = self.parser.should_keep_alive()
        codings = self._codings
        if codings is not None:
            if codings[-1] != b"chunked" or codings.count(b"chunked") > 1:
                raise _Refusal(400, "the body's length cannot be told: Transfer-Encoding "
                                    "must end in chunked, applied once (RFC 9112 6.3)")
            if len(codings) > 1:
                raise _Refusal(501, "this server decodes no transfer coding but chunked: "
                                    f"{b', '.join(codings).decode('latin-1')} is not served")
            if version == "1.0":
                keep_alive = False  # RFC 9112 6.1: its framing is not to be trusted
        if self._length > self.limits.max_body_bytes:
            raise _Refusal(413, self._too_large())
        return keep_alive

    def on_body(self, body: bytes) -> None:
        self._body_seen += len(body)
        if self._body_seen > self.limits.max_body_bytes:
            raise _Refusal(413, self._too_large())
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
        if self._feeding and self._body_seen + self._body_framing + self._feeding - (
                self._body_seen - self._feed_seen) > self.limits.max_body_bytes:
            # The body ends in this read: its framing here is at most what of the read
            # was not body (over-counted only by a pipelined request behind it).
            raise _Refusal(413, self._too_large())
        cycle, self.parsing = self.parsing, None
        self._reading_head, self._head_bytes, self._body_at = True, 0, 0.0
        if cycle is None:
            return
        cycle.body_complete = True
        if cycle.deferred:
            self._begin(cycle)
        else:
            cycle.wake()
        if not cycle.keep_alive:
            # The connection ends with this answer: nothing behind it is read.
            self._stopped = True
            self.pause_reading()
            raise _Stop

    def _too_large(self) -> str:
        return (f"the request body is over {self.limits.max_body_bytes} bytes (framing "
                "included), this server's limit")

    # --- answers ---

    def _begin(self, cycle: Cycle) -> None:
        """A request whose body is all in: the fast handler's, or else the app's."""
        cycle.deferred = False
        self.current = cycle
        if self.lost or self.closing or self.transport.is_closing():  # type: ignore[union-attr]
            return
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
        """The app answers the request, in a task of its own; none for a connection that
        can no longer carry its answer."""
        cycle.deferred = False
        self.current = cycle
        if self.lost or self.closing or self.transport.is_closing():  # type: ignore[union-attr]
            return
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
        if not cycle.complete and not self.lost and not self.closing:
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
        # A write that found the client gone has closed the transport before it is lost.
        if not cycle.keep_alive or self.lost or self.transport.is_closing():  # type: ignore[union-attr]
            self.close()
            return
        if self.queued:
            cycle = self.queued.popleft()
            if not self.queued and not self._stopped:
                self.resume_reading()
            if self.server.fast is not None and cycle.body_complete and \
                    not cycle.expect_continue:
                self._begin(cycle)
            else:
                self._start(cycle)
            return
        if self._refusal:  # a bad request behind the ones just answered
            self.write(self._refusal)
            self.close()
            return
        self.resume_reading()
        self._idle_at = self.loop.time() + (IDLE_DRAIN_S if self.draining
                                            else self.limits.keep_alive_s)
        self._arm(self._idle_at)

    def _fail(self, status: int, why: str) -> None:
        """A request that cannot be served: refused with status once the answers ahead of
        it are written, then closed; nothing behind it is read, and the app never sees it
        (or, if it is already reading it, sees the client leave)."""
        self._stopped = True
        self.pause_reading()
        self._head_at = self._body_at = 0.0
        refusal = _plain(status, why)
        bad, self.parsing = self.parsing, None
        if bad is not None and bad is not self.current:
            with contextlib.suppress(ValueError):
                self.queued.remove(bad)
        elif bad is not None:  # the answer under way is this request's own
            if bad.status or not bad.started:  # and its head is not on the wire yet
                self.write(refusal)
            bad.complete = True
            self.close()
            bad.wake()
            return
        if self.current is None:
            self.write(refusal)
            self.close()
        else:
            self._refusal = refusal

    # --- deadlines ---

    def _arm(self, at: float) -> None:
        """The timer fires by `at`; when it fires first, _tick moves it on to what is due."""
        timer = self._timer
        if timer is not None:
            if timer.when() <= at:
                return
            timer.cancel()
        if not self.lost:
            self._timer = self.loop.call_at(at, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.lost:
            return
        now = self.loop.time()
        if self._idle_at and now >= self._idle_at:
            self._idle_at = 0.0
            self._close_if_idle(now)
        if self._head_at and now >= self._head_at:
            self._head_at = 0.0
            if self._reading_head and not self._stopped:
                self._fail(408, f"the request's head did not arrive within "
                                f"{self.limits.head_timeout_s:g} s")
        if self._body_at and now >= self._body_at:
            self._check_body_rate(now)
        if self._write_at and now >= self._write_at:
            self._check_write_rate()
        due = [at for at in (self._idle_at, self._head_at, self._body_at, self._write_at) if at]
        if due and not self.lost:
            self._arm(min(due))

    def _close_if_idle(self, now: float) -> None:
        """Close when no request is under way or coming in (a head part-way in is one:
        in a drain it is answered, with Connection: close; the head deadline ends a client
        that never finishes it). A request under way is not idle: its answer arms the
        timer again."""
        if self.current is not None or self.parsing is not None:
            return
        if not self._head_bytes:
            self.close()
        elif self.draining:
            self._idle_at = now + IDLE_DRAIN_S

    def _start_head(self) -> None:
        self._head_at = self.loop.time() + self.limits.head_timeout_s
        self._arm(self._head_at)

    def _start_body(self) -> None:
        self._body_seen = self._body_framing = 0
        # What came behind the head in the same read is the body's first bytes.
        self._body_mark = self._received - self._unfed
        self._body_at = self.loop.time() + self.limits.body_window_s
        self._arm(self._body_at)

    def _check_body_rate(self, now: float) -> None:
        """The body's minimum rate over the window just past, unless the server held it
        back (reading paused for the app, or a 100 Continue not yet sent)."""
        limits, cycle = self.limits, self.parsing
        if cycle is None or self._stopped:
            self._body_at = 0.0
            return
        need = int(limits.body_min_rate * limits.body_window_s)
        if self._length >= 0:
            need = min(need, self._length - self._body_seen)
        held = self._reading_paused or cycle.expect_continue
        if not held and self._received - self._body_mark < need:
            self._fail(408, f"the request body came slower than {limits.body_min_rate} "
                            f"bytes/s over {limits.body_window_s:g} s")
            return
        self._body_mark = self._received
        self._body_at = now + limits.body_window_s

    def _watch_writes(self) -> None:
        assert self.transport is not None
        self._write_mark = (self.transport.get_write_buffer_size(), self._written)
        self._write_at = self.loop.time() + self.limits.write_timeout_s
        self._arm(self._write_at)

    def _check_write_rate(self) -> None:
        """Over the window just past, while an answer waited on the client, it took at
        least the minimum rate (or all that waited); else it is let go."""
        assert self.transport is not None
        limits = self.limits
        waiting, written = self._write_mark
        backlog = self.transport.get_write_buffer_size()
        if not (self.paused_writing or self.closing and backlog):
            self._write_at = 0.0
            return
        offered = waiting + self._written - written
        need = min(int(limits.write_min_rate * limits.write_timeout_s), offered)
        if offered - backlog < need:
            log.info("let go of %s: it took %d of %d bytes of its answer in %g s", self.client,
                     offered - backlog, offered, limits.write_timeout_s)
            self.abort()
            return
        self._watch_writes()

    # --- the connection ---

    def shutdown(self) -> None:
        """The server drains: an answer not begun says Connection: close; an idle
        connection (or one whose answer promised keep-alive, once it is done) is closed
        IDLE_DRAIN_S later, if no request came: a request sent just then is answered."""
        self.draining = True
        for cycle in (self.current, *self.queued):
            if cycle is not None and (cycle.status or not cycle.started):
                cycle.keep_alive = False
        if self.current is None:
            self._idle_at = self.loop.time() + IDLE_DRAIN_S
            self._arm(self._idle_at)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._written += len(data)
            self.transport.write(data)

    async def send_file(self, file: Any, offset: int, count: int) -> None:
        """count bytes of file (an object or a descriptor) from offset, in chunks each of
        which must leave within the write deadline (the client is let go otherwise):
        sendfile where the transport has it, else reads written under backpressure."""
        while count > 0 and not self.lost and not self.closing:
            size = min(count, SENDFILE_CHUNK_BYTES)
            try:
                await asyncio.wait_for(self._send_chunk(file, offset, size),
                                       self.limits.write_timeout_s)
            except TimeoutError:
                log.info("let go of %s: %d bytes of a file did not leave in %g s",
                         self.client, size, self.limits.write_timeout_s)
                self.abort()
                return
            offset += size
            count -= size

    async def _send_chunk(self, file: Any, offset: int, size: int) -> None:
        assert self.transport is not None
        if self._sendfile:
            try:
                if isinstance(file, int):
                    with open(file, "rb", buffering=0, closefd=False) as f:
                        await self.loop.sendfile(self.transport, f, offset, size,
                                                 fallback=False)
                else:
                    await self.loop.sendfile(self.transport, file, offset, size,
                                             fallback=False)
                return
            except (NotImplementedError, asyncio.SendfileNotAvailableError):
                self._sendfile = False  # TLS, uvloop: read and write instead
        fd = file if isinstance(file, int) else file.fileno()
        end = offset + size
        while offset < end and not self.lost and not self.closing:
            data = os.pread(fd, min(end - offset, FILE_READ_BYTES), offset)
            if not data:
                raise RuntimeError(f"the file ends at byte {offset}, before the {end} the "
                                   "zero-copy send asked for")
            self.write(data)
            offset += len(data)
            await self.writable()

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.lost:
            self._reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        """Close once what is written has left; a client that does not take it within the
        write deadline is cut."""
        self.closing = True
        if self.transport is not None and not self.transport.is_closing():
            close_transport(self.transport, self.loop)
            if self.transport.get_write_buffer_size() and not self._write_at:
                self._watch_writes()

    def abort(self) -> None:
        """Cut the connection now: its tasks are cancelled, its buffers dropped."""
        self.closing = True
        for task in self._tasks:
            task.cancel()
        if self.transport is not None:
            self.transport.abort()


def _tls_extension(ssl_object: ssl.SSLObject) -> dict[str, Any]:
    """The scope's "tls" extension as asgiref's TLS spec names it (client_cert_name the
    subject as an RFC 4514 name), plus the verified client certificate's commonName and
    serial (upper-case hex of the integer, no leading zero, as pki.serial_hex writes it):
    "" for none. getpeercert() writes the serial's bytes, so one serial in eight (its
    first nibble 0) would otherwise be spelled with a leading zero and match nothing."""
    cert = ssl_object.getpeercert() or {}  # {} unless the certificate was verified
    # ssl types every value of the dict as any of its shapes: keep the (name, value) pairs.
    subject = [pair for rdn in cert.get("subject", ()) if isinstance(rdn, tuple)
               for pair in rdn if isinstance(pair, tuple)]
    der = ssl_object.getpeercert(binary_form=True) if cert else None
    short = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
             "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST"}
    cipher = ssl_object.cipher()
    return {
        "server_cert": None,
        "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
        "client_cert_name": ",".join(f"{short.get(k, k)}={v}" for k, v in reversed(subject))
        or None,
        "client_cert_error": None,
        "tls_version": _TLS_VERSIONS.get(ssl_object.version() or ""),
        "cipher_suite": None,
        "cipher_name": cipher[0] if cipher else None,
        "client_cert_common_name": dict(subject).get("commonName", ""),
        "client_cert_serial": _serial(str(cert.get("serialNumber", ""))),
    }


def _serial(written: str) -> str:
    """A serial as getpeercert() writes it (hex bytes), as its integer's hex."""
    return format(int(written, 16), "X") if written else ""


class _Refusal(Exception):
    """Raised from a parser callback: the request is answered status, why, and closed."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


class _Stop(Exception):
    """Raised from a parser callback: nothing after this request is read."""


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
    body over the read-ahead goes to the app as it comes.

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
