"""What an HTTP/1.1 client may send, and how slowly: the one place each default is spelled."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, ClassVar

from annotated_types import Gt

# Every limit is above 0: server.yaml's reader (pydantic) refuses one that is not where it
# reads it, naming the key; __post_init__ refuses it in code.
_Count = Annotated[int, Gt(0)]
_Seconds = Annotated[float, Gt(0)]


@dataclass(frozen=True)
class Limits:
    """The limits and deadlines `server.Http1Server` holds every connection to, as it reads.

    Sizes count raw bytes as they arrive (whitespace, chunk framing, chunk extensions and
    trailers included), so what a client sends is bounded before anything is buffered
    whole. server.yaml's `gateway_http` and `agent_http` are this class, read as it is
    (`config.ServerConfig`)."""

    # pydantic's settings for this class where a yaml is read into it: a key that is not a
    # field is refused (a misspelt one would otherwise be silently ignored).
    __pydantic_config__: ClassVar[dict[str, str]] = {"extra": "forbid"}

    # A request's line and headers together: 431 beyond; a line that never ends is cut here.
    max_head_bytes: _Count = 64 << 10
    # Header fields in one head: 431 beyond.
    max_headers: _Count = 100
    # One line of a chunked body's framing, counted as it arrives: a chunk-size line with
    # its extensions and CRLF, or a trailer field: 400 beyond (h11 bounds it the same way,
    # by its max_incomplete_event_size, 16 KiB; llhttp does not).
    max_chunk_line_bytes: _Count = 16 << 10
    # A body as sent (framing included): 413 beyond (a Content-Length over it, at once).
    max_body_bytes: _Count = 16 << 20
    # From a request's first byte to the end of its head: 408 and closed beyond.
    head_timeout_s: _Seconds = 10.0
    # While a body is read (and the server is not holding it back), at least
    # body_min_rate bytes a second must arrive, measured over each body_window_s (the
    # first window is the grace), or the rest of the body: 408 and closed otherwise.
    body_min_rate: _Count = 1024
    body_window_s: _Seconds = 10.0
    # While an answer waits on the client (its writes paused, a file chunk under way, or a
    # closing connection's last bytes), the client must take at least write_min_rate bytes
    # a second over each write_timeout_s (or all that waits): else it is let go (aborted),
    # its slot and buffers freed. A zero-copy file chunk must leave within write_timeout_s.
    write_timeout_s: _Seconds = 30.0
    write_min_rate: _Count = 1024
    # An idle keep-alive connection is closed after this long.
    keep_alive_s: _Seconds = 5.0
    # TLS only: a new connection's first byte must come within first_byte_timeout_s, and
    # its handshake end within handshake_timeout_s of its ClientHello, or it is closed.
    first_byte_timeout_s: _Seconds = 5.0
    handshake_timeout_s: _Seconds = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"Limits.{f.name} is {value!r}: it must be above 0 (raise "
                                 "it to loosen the limit)")
