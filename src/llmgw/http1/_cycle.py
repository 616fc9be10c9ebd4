"""One request and its answer: what an ASGI app's receive() and send() act on.

An answer whose body comes in one message leaves in one write with its head, a streamed
one as HTTP chunks, a file through the connection's send_file (the ASGI zero-copy send
extension); a HEAD's answer leaves without its body. The connection (`_conn`) reads
the request into it and writes what it makes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING

from llmgw.http1.asgi import Message, Scope

if TYPE_CHECKING:
    from llmgw.http1._conn import _Connection

# Reading from a client stops while this much of its body waits for the app.
BODY_READ_AHEAD_BYTES = 256 << 10

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


def plain_answer(status: int, text: str) -> bytes:
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
        self._on_gone: Callable[[], None] | None = None

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

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """An answer whose body follows in parts (write, then end): its head goes now."""
        self.started = True
        self.status = status
        self.headers = headers
        self._write(b"", True)

    def write(self, data: bytes) -> None:
        """One part of the answer start() began (an HTTP chunk): see paused."""
        if data:
            self._write(data, True)

    def end(self, data: bytes = b"") -> None:
        """The last part of the answer start() began; then on to the next request."""
        self._write(data, False)

    @property
    def paused(self) -> bool:
        """The client has not taken what was written: write more once when_writable calls."""
        return self.conn.paused_writing

    @property
    def gone(self) -> bool:
        """The connection is lost or let go: what is written goes nowhere."""
        return self.conn.lost or self.conn.closing

    def when_writable(self, callback: Callable[[], None]) -> None:
        """callback, from the event loop, once the client takes what was written (at once
        if it has) or the connection is lost."""
        self.conn.when_writable(callback)

    def when_gone(self, callback: Callable[[], None]) -> None:
        """callback, once, should the connection be lost before the answer is done."""
        self._on_gone = callback

    def left(self) -> None:
        """The connection is lost (the connection's side)."""
        self.wake()
        callback, self._on_gone = self._on_gone, None
        if callback is not None and not self.complete:
            callback()

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


