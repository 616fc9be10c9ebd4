"""HTTP/1.1 requests parsed without I/O: bytes in, events out, limits counted as it reads.

As h11 is, it can be driven alone (tests/http1/test_parser.py feeds it the hostile-input
corpus the servers are held to): `RequestParser(events, limits).feed(data)` calls, in
order, events.request_started() at a head's first byte, request_head(...) with the head's
method, target, headers and framing decided, request_body(data) as the body comes,
request_end() at its end; or request_refused(status, why) once, after which nothing more
is read. It reads no clock, opens nothing and awaits nothing: the deadlines are the
connection's (`_conn`), which reads `received`, `body_seen` and `length` for them.

httptools (llhttp in its strict mode) parses; what it leaves to a server is done here, as
it reads (`Limits`): the head on raw bytes (a line that never ends is cut at the limit),
the header count, the body with its framing. RFC 9112's framing is refused where
httptools takes it: Host (section 3.2), a transfer coding other than chunked alone (6.1,
501), HTTP/1.0 with Transfer-Encoding (the connection is not kept), versions other than
1.0 and 1.1 (505), CONNECT (501) and the asterisk-form for anything but OPTIONS.
"""

from __future__ import annotations

import re
from typing import Protocol
from urllib.parse import unquote

import httptools

from llmgw.http1.limits import Limits

# RFC 9112 3.2 / RFC 3986 3.2.2: uri-host [ ":" port ], the IP-literal kept loose.
_HOST = re.compile(rb"(\[[0-9A-Fa-f:.vV]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(:[0-9]*)?")
# The request headers whose values the parser itself reads.
_FRAMING = frozenset({b"host", b"transfer-encoding", b"content-length", b"expect"})


class Events(Protocol):
    """What a RequestParser tells its reader, each as it happens."""

    def request_started(self) -> None:
        """A head's first byte is in (its deadline starts)."""

    def request_head(self, method: str, version: str, path: str, raw_path: bytes,
                     query: bytes, headers: list[tuple[bytes, bytes]], keep_alive: bool,
                     expect_continue: bool, has_body: bool) -> None:
        """A whole head, valid: path unquoted, headers lower-cased with their values
        stripped, keep_alive whether the connection may carry another request after this
        one, has_body whether a body follows (counted from here on)."""

    def request_body(self, data: bytes) -> None:
        """The body's next bytes, framing taken off."""

    def request_end(self) -> None:
        """The request is all in (the reader may stop() the parser here)."""

    def request_refused(self, status: int, why: str) -> None:
        """The request cannot be served: answer status with why, then close."""


class _Refusal(Exception):
    """Raised from a parser callback: the request is refused with status and why."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


class _Stop(Exception):
    """Raised from a parser callback: nothing after this request is read."""


class _ChunkLines:
    """Where a chunked body's framing lines are, as its bytes arrive, so each is bounded
    before it ends: a chunk-size line (its size, extensions and CRLF) or a trailer field.
    httptools checks their grammar; this only counts, skipping each chunk's data."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.line = 0         # bytes of the line under way
        self.size = b""       # its first bytes: the chunk size is read from them
        self.skip = 0         # data (and its CRLF) left of the chunk under way
        self.trailers = False
        self.done = False

    def scan(self, data: bytes) -> str | None:
        """data, the body's next raw bytes; why it is refused, or None."""
        at = 0
        while at < len(data) and not self.done:
            if self.skip:
                taken = min(self.skip, len(data) - at)
                self.skip -= taken
                at += taken
                continue
            end = data.find(b"\n", at)
            stop = len(data) if end < 0 else end + 1
            self.line += stop - at
            if self.line > self.limit:
                what = "trailer field" if self.trailers else "chunk-size line (extensions included)"
                return (f"a {what} of the chunked body is over {self.limit} bytes, this "
                        "server's limit (Limits.max_chunk_line_bytes)")
            if not self.trailers and len(self.size) < 20:
                self.size += data[at:min(stop, at + 20)]
            at = stop
            if end >= 0:
                self._line_ended()
        return None

    def _line_ended(self) -> None:
        if self.trailers:
            self.done = self.line <= 2  # the empty line that ends the body
        else:
            digits = self.size.split(b";", 1)[0].strip(b" \t\r\n")
            try:
                size = int(digits, 16)
            except ValueError:
                self.done = True  # not a size: httptools refuses it
                size = 0
            self.trailers = size == 0
            self.skip = size + 2 if size else 0
        self.line, self.size = 0, b""


class RequestParser:
    """One connection's requests, one after another (pipelined ones too), as events."""

    def __init__(self, events: Events, limits: Limits) -> None:
        self.events = events
        self.limits = limits
        self.parser = httptools.HttpRequestParser(self)
        # Nothing more is read once stopped (a refusal, or a request that closes).
        self.stopped = False
        self.reading_head = True
        self.head_bytes = 0   # raw bytes of the head so far
        self.received = 0     # raw bytes in all, for the body's rate
        self.unfed = 0        # bytes of the read being taken not yet fed to httptools
        self.body_seen = 0    # body bytes as httptools gave them
        self.length = -1      # the Content-Length; -1 for none
        self._head_end = b""  # the last bytes of the head so far: its end may straddle reads
        self._started = False  # request_started told for the head being read
        self._begun = 0       # requests begun, to tell a read that holds the next one
        self._feeding = 0     # the body read being fed, and the body bytes before it
        self._feed_seen = 0
        self._body_framing = 0  # chunk sizes, extensions and trailers around the body
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._field_bytes = 0
        self._hosts = 0
        self._host = b""
        self._codings: list[bytes] | None = None
        self._expect_continue = False
        self._chunk_lines: _ChunkLines | None = None  # the chunked body being read

    def feed(self, data: bytes) -> None:
        """The next bytes from the client; none are read once stopped."""
        if not self.stopped:
            self.received += len(data)
            self._take(data)

    def stop(self) -> None:
        """Read nothing more (the reader refused the request, or it closes the connection);
        called from an event, it ends the read under way."""
        self.stopped = True

    def _take(self, data: bytes) -> None:
        if not self.reading_head:
            lines = self._chunk_lines
            why = lines.scan(data) if lines is not None else None
            if why is not None:
                self._refuse(400, why)
                return
            seen, begun = self.body_seen, self._begun
            self._feeding, self._feed_seen = len(data), seen
            self._feed(data)
            self._feeding = 0
            if self._begun == begun and not self.stopped:
                # The whole read was this body's (no request began behind it): what
                # httptools did not hand on was its framing (chunk sizes, extensions,
                # trailers). A read that also holds the next request goes uncounted: at
                # most one read's worth of framing.
                self._body_framing += len(data) - (self.body_seen - seen)
                if self.body_seen + self._body_framing > self.limits.max_body_bytes:
                    self._refuse(413, self._too_large())
            return
        if not self.head_bytes and not self._started:
            self._started = True
            self.events.request_started()
        # Where this read's head ends, so the body behind it is counted as body.
        window = self._head_end + data
        end = window.find(b"\r\n\r\n")
        if 0 <= end and end + 4 - len(self._head_end) < len(data):
            cut = end + 4 - len(self._head_end)
            self._head_end = b""
            rest = data[cut:]
            self.unfed = len(rest)
            self._take(data[:cut])
            self.unfed = 0
            if not self.stopped:
                self._take(rest)
            return
        self._head_end = window[-3:]
        room = self.limits.max_head_bytes - self.head_bytes
        if len(data) <= room:
            self.head_bytes += len(data)
            self._feed(data)
            return
        # Fed only up to the limit: a line that never ends is not buffered past it.
        self.head_bytes += room
        self._feed(data[:room])
        if self.stopped:
            return
        if self.reading_head:
            self._refuse(431, f"the request's line and headers are over "
                              f"{self.limits.max_head_bytes} bytes")
        else:
            self._take(data[room:])

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "this server speaks HTTP/1.1 only: no upgrade")
        except httptools.HttpParserError as e:
            # httptools wraps what a callback raises: the callback's reason is its context.
            why = e.__context__
            if isinstance(why, _Refusal):
                self._refuse(why.status, why.why)
            elif not isinstance(why, _Stop):
                self._refuse(400, f"the request is not valid HTTP/1.1: {e}")

    def _refuse(self, status: int, why: str) -> None:
        self.stopped = True
        self.events.request_refused(status, why)

    def _too_large(self) -> str:
        return (f"the request body is over {self.limits.max_body_bytes} bytes (framing "
                "included), this server's limit")

    # --- what httptools calls ---

    def on_message_begin(self) -> None:
        self._begun += 1
        self._url, self._headers, self._field_bytes = b"", [], 0
        self._hosts, self._codings, self.length = 0, None, -1
        self._expect_continue = False
        if not self._started:  # a head that began inside the read that ended the last one
            self._started = True
            self.events.request_started()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._field_bytes += len(url)
        if self._field_bytes > self.limits.max_head_bytes:
            raise _Refusal(431, f"the request's line and headers are over "
                                f"{self.limits.max_head_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.reading_head:
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
            self.length = int(value)  # httptools took it: digits, only one
        elif value.lower() == b"100-continue":
            self._expect_continue = True

    def on_headers_complete(self) -> None:
        self.reading_head = False
        self._started = False
        method = self.parser.get_method()
        if method == b"CONNECT":
            raise _Refusal(501, "CONNECT is not served: this server is no proxy")
        url = self._url
        if url == b"*" and method != b"OPTIONS":
            raise _Refusal(400, "the asterisk-form target is for OPTIONS only (RFC 9112 3.2.4)")
        version = self.parser.get_http_version()
        keep_alive = self._check_framing(version)
        if b"?" in url or not url.startswith(b"/"):
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path, parsed.query or b""
        else:
            raw_path, query = url, b""
        path = raw_path.decode("latin-1")
        has_body = self._codings is not None or self.length > 0
        if has_body:
            self.body_seen = self._body_framing = 0
        self._chunk_lines = _ChunkLines(self.limits.max_chunk_line_bytes) \
            if self._codings is not None else None
        self.events.request_head(method.decode("ascii"), version,
                                 unquote(path) if "%" in path else path, raw_path, query,
                                 self._headers, keep_alive, self._expect_continue, has_body)

    def _check_framing(self, version: str) -> bool:
        """RFC 9112's framing rules httptools leaves to the server: _Refusal if broken;
        whether the connection may carry another request after this one."""
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
        if self.length > self.limits.max_body_bytes:
            raise _Refusal(413, self._too_large())
        return keep_alive

    def on_body(self, body: bytes) -> None:
        self.body_seen += len(body)
        if self.body_seen > self.limits.max_body_bytes:
            raise _Refusal(413, self._too_large())
        self.events.request_body(body)

    def on_message_complete(self) -> None:
        if self._feeding and self.body_seen + self._body_framing + self._feeding - (
                self.body_seen - self._feed_seen) > self.limits.max_body_bytes:
            # The body ends in this read: its framing here is at most what of the read
            # was not body (over-counted only by a pipelined request behind it).
            raise _Refusal(413, self._too_large())
        self.reading_head, self.head_bytes = True, 0
        self.events.request_end()
        if self.stopped:
            raise _Stop
