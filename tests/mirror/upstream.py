"""A real upstream HTTP server on loopback that can drop, corrupt and throttle, and counts."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

_RANGE = re.compile(r"^bytes=(\d+)-$")
CHUNK = 64 * 1024


@dataclass
class Behaviour:
    """What the upstream does: drop the first connection at a byte, corrupt, go slowly."""

    drop_at: int | None = None
    corrupt: bool = False
    delay_per_chunk_s: float = 0.0
    unavailable_first: int = 0  # answer 503 to this many GETs first
    headers: dict[str, str] = field(default_factory=dict)


class Upstream:
    """Serves one file at /files/NAME with single open-ended ranges; counts the bytes it sent."""

    def __init__(self, data: bytes, name: str = "model.gguf", **behaviour: Any) -> None:
        self.data = data
        self.name = name
        self.behaviour = Behaviour(**behaviour)
        self.sent = 0
        self.requests: list[str | None] = []  # the Range header of every GET
        self._lock = threading.Lock()
        self._dropped = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}/files/{self.name}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def body(self) -> bytes:
        if not self.behaviour.corrupt:
            return self.data
        middle = len(self.data) // 2
        return self.data[:middle] + bytes([self.data[middle] ^ 0xFF]) + self.data[middle + 1:]

    def _should_drop(self) -> bool:
        with self._lock:
            if self.behaviour.drop_at is None or self._dropped:
                return False
            self._dropped = True
            return True

    def _count(self, n: int) -> None:
        with self._lock:
            self.sent += n

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != f"/files/{upstream.name}":
                    self.send_error(404)
                    return
                rng = self.headers.get("Range")
                upstream.requests.append(rng)
                if len(upstream.requests) <= upstream.behaviour.unavailable_first:
                    self.send_error(503)
                    return
                body = upstream.body()
                found = _RANGE.match(rng or "")
                start = int(found[1]) if found else 0
                self.send_response(206 if found else 200)
                if found:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                self.send_header("ETag", '"v1"')
                for k, v in upstream.behaviour.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self._send(body, start)

            def _send(self, body: bytes, start: int) -> None:
                drop = upstream.behaviour.drop_at if upstream._should_drop() else None
                end = drop if drop is not None else len(body)
                for at in range(start, end, CHUNK):
                    piece = body[at:min(at + CHUNK, end)]
                    try:
                        self.wfile.write(piece)
                    except OSError:
                        return
                    upstream._count(len(piece))
                    time.sleep(upstream.behaviour.delay_per_chunk_s)
                if drop is not None:
                    self.close_connection = True  # mid-body: the client sees a short read

        return Handler
