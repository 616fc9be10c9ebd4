"""One client connection of Http1Server: reads requests, answers them in turn, holds deadlines.

An asyncio protocol: the sans-IO parser's events (`_parse`) become ASGI cycles
(`_cycle`), one request at a time, in order (pipelined ones wait, their reading
paused). What the parser refuses is answered only after the answers ahead of it, and
nothing behind it is read. Here too: Expect: 100-continue, a client that leaves
(http.disconnect), the deadlines, write backpressure, sendfile, the scope's TLS extension
and a drain that loses no request on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llmgw.http1._close import close_transport
from llmgw.http1._cycle import BODY_READ_AHEAD_BYTES, Cycle, plain_answer
from llmgw.http1._parse import RequestParser
from llmgw.http1.asgi import Scope

if TYPE_CHECKING:
    from llmgw.http1.server import Http1Server

log = logging.getLogger("llmgw.http")

# How long an idle connection stays open once its server drains: a busy client sends its
# next request within milliseconds and gets Connection: close with the answer. (uvicorn
# closes an idle connection at once, and one whose answer promised keep-alive right after
# it: a client that sent its next request just then lost it.)
IDLE_DRAIN_S = 1.0
# A zero-copy send goes out in chunks of this size, each within the write deadline; a read
# of this size feeds the same send where sendfile is not there (TLS, uvloop).
SENDFILE_CHUNK_BYTES = 1 << 20
FILE_READ_BYTES = 256 << 10
_TLS_VERSIONS = {"TLSv1": 0x0301, "TLSv1.1": 0x0302, "TLSv1.2": 0x0303, "TLSv1.3": 0x0304}


class _Connection(asyncio.Protocol):
    """One client connection: its parser, the answer under way and the requests behind it.

    One timer a connection, moved on rather than made for every request, holds its
    deadlines (0: none): idle keep-alive, the head, the body's rate, the answer's rate."""

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.loop = server.loop
        self.limits = server.limits
        self.parser = RequestParser(self, server.limits)
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
        self.client: Any = None
        self.sockname: Any = None
        self.scheme = "http"
        self._tasks: set[asyncio.Task[None]] = set()
        self._refusal = b""  # written once the answers ahead of it are
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
        self.parser.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for cycle in (self.current, self.parsing, *self.queued):
            if cycle is not None:
                cycle.left()
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
            if self._drained is None:
                self._drained = self.loop.create_future()
            await self._drained

    def when_writable(self, callback: Callable[[], None]) -> None:
        if not self.paused_writing or self.lost:
            self.loop.call_soon(callback)
            return
        if self._drained is None:
            self._drained = self.loop.create_future()
        self._drained.add_done_callback(lambda _: callback())

    # --- what the parser tells ---

    def request_started(self) -> None:
        if not self._head_at:
            self._start_head()

    def request_head(self, method: str, version: str, path: str, raw_path: bytes,
                     query: bytes, headers: list[tuple[bytes, bytes]], keep_alive: bool,
                     expect_continue: bool, has_body: bool) -> None:
        self._head_at = 0.0
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version, "scheme": self.scheme, "method": method,
            "root_path": "", "path": path, "raw_path": raw_path, "query_string": query,
            "headers": headers, "server": self.sockname, "client": self.client,
            "state": {}, "extensions": self.extensions,
        }
        cycle = Cycle(self, scope, keep_alive and not self.draining, expect_continue)
        self.parsing = cycle
        if has_body:
            self._start_body()
        if self.current is not None:
            self.queued.append(cycle)
            self.pause_reading()
        elif self.server.fast is not None:
            self._defer(cycle)
        else:
            self._start(cycle)

    def request_body(self, data: bytes) -> None:
        cycle = self.parsing
        if cycle is None or cycle.complete:  # answered without it: read on, and drop it
            return
        cycle.body.append(data)
        cycle.buffered += len(data)
        if cycle.buffered > BODY_READ_AHEAD_BYTES and not cycle.deferred:
            # (a fast handler's is held whole: limits.max_body_bytes bounds it)
            self.pause_reading()
        cycle.wake()

    def request_end(self) -> None:
        cycle, self.parsing = self.parsing, None
        self._body_at = 0.0
        if cycle is None:
            return
        cycle.body_complete = True
        if cycle.deferred:
            self._begin(cycle)
        else:
            cycle.wake()
        if not cycle.keep_alive:
            # The connection ends with this answer: nothing behind it is read.
            self.parser.stop()
            self.pause_reading()

    def request_refused(self, status: int, why: str) -> None:
        self._fail(status, why)

    # --- answers ---

    def _defer(self, cycle: Cycle) -> None:
        """Held for the fast handler until its whole body is in (_begin); a client that
        waits for 100 Continue is told to send it."""
        self.current = cycle
        cycle.deferred = True
        if cycle.expect_continue and not cycle.body_complete:
            cycle.expect_continue = False
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

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
                self.write(plain_answer(500, "Internal Server Error"))
            self.close()
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        if not cycle.complete and not self.lost and not self.closing:
            log.error("the app returned without finishing its answer to %s %s",
                      cycle.scope["method"], cycle.scope["path"])
            if not cycle.started:
                self.write(plain_answer(500, "Internal Server Error"))
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
            if not self.queued and not self.parser.stopped:
                self.resume_reading()
            if self.server.fast is None:
                self._start(cycle)
            elif cycle.body_complete:
                self._begin(cycle)
            else:
                self._defer(cycle)
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
        self.parser.stop()
        self.pause_reading()
        self._head_at = self._body_at = 0.0
        refusal = plain_answer(status, why)
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
            if self.parser.reading_head and not self.parser.stopped:
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
        if not self.parser.head_bytes:
            self.close()
        elif self.draining:
            self._idle_at = now + IDLE_DRAIN_S

    def _start_head(self) -> None:
        self._head_at = self.loop.time() + self.limits.head_timeout_s
        self._arm(self._head_at)

    def _start_body(self) -> None:
        # What came behind the head in the same read is the body's first bytes.
        self._body_mark = self.parser.received - self.parser.unfed
        self._body_at = self.loop.time() + self.limits.body_window_s
        self._arm(self._body_at)

    def _check_body_rate(self, now: float) -> None:
        """The body's minimum rate over the window just past, unless the server held it
        back (reading paused for the app, or a 100 Continue not yet sent)."""
        limits, cycle = self.limits, self.parsing
        if cycle is None or self.parser.stopped:
            self._body_at = 0.0
            return
        need = int(limits.body_min_rate * limits.body_window_s)
        if self.parser.length >= 0:
            need = min(need, self.parser.length - self.parser.body_seen)
        held = self._reading_paused or cycle.expect_continue
        if not held and self.parser.received - self._body_mark < need:
            self._fail(408, f"the request body came slower than {limits.body_min_rate} "
                            f"bytes/s over {limits.body_window_s:g} s")
            return
        self._body_mark = self.parser.received
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
