"""The bytes server: GET and HEAD of finished files, with single ranges, nothing else.

Served by llmgw's HTTP/1.1 core (`llmgw.http1.server`), which reads every request under its
limits and deadlines (a head one byte at a time, two Content-Lengths, a client that stops
reading a multi-gigabyte answer) before this app sees it. Not Starlette's FileResponse,
which reads the file in a worker thread and pushes every chunk through the ASGI loop:
this app answers with the core's zero-copy send, which hands the socket to the kernel
with sendfile(2) in 1 MiB chunks, each under the write deadline, so a node pulling many
gigabytes costs the mirror almost no CPU (bench/mirror_throughput.py measures it against
`python -m http.server` and nginx). It serves what nodes need: GET/HEAD, one Range;
anything else is answered 400, 405 or 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import stat
from email.utils import formatdate
from http import HTTPStatus
from pathlib import Path
from urllib.parse import unquote, urlsplit

from llmgw.host.netaddr import join_host_port
from llmgw.http1.asgi import Receive, Scope, Send
from llmgw.http1.limits import Limits
from llmgw.http1.server import Http1Server
from llmgw.mirror._disk import is_name
from llmgw.mirror._downloads import Manager, Servable
from llmgw.mirror._metrics import ServedCounter

log = logging.getLogger("llmgw.mirror.bytes")

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
# A byte position longer than this lies past the end of any file (10^18 bytes is an
# exabyte); int() of thousands of digits would otherwise cost time, or raise past
# Python's digit limit.
_MAX_DIGITS = 18
# A node downloads for as long as it takes; a client that takes nothing is let go by the
# write deadline, not by this.
KEEP_ALIVE_S = 60.0
DRAIN_S = 2.0


class _Refused(Exception):
    """A request answered with an error status and a line saying why."""

    def __init__(self, status: int, why: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(why)
        self.status = status
        self.headers = headers or {}


def resolve(target: str, base_path: str) -> tuple[str, str, str]:
    """(model, version, file) from a request target; _Refused when it names nothing servable."""
    if not target.startswith("/"):
        raise _Refused(400, "only origin-form targets (/model/version/file) are served")
    try:
        path = unquote(urlsplit(target).path, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise _Refused(400, "the path is not valid UTF-8 once decoded") from None
    if "\x00" in path or "\\" in path:
        raise _Refused(400, "the path holds a NUL or a backslash")
    if not path.startswith(base_path + "/"):
        raise _Refused(404, "not under the mirror's base path")
    parts = path[len(base_path) + 1:].split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise _Refused(400, "the path holds an empty, '.' or '..' segment")
    if len(parts) != 3 or not all(is_name(p) for p in parts):
        raise _Refused(404, "no such file")
    return parts[0], parts[1], parts[2]


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The (start, end inclusive) a single Range asks for; None to send the whole file.

    Raises _Refused(416) when the range lies past the end.
    """
    found = _RANGE.match(header.strip()) if header else None
    if not found or (not found[1] and not found[2]):
        return None  # absent, several ranges or not bytes: the whole file is a valid answer
    unsatisfiable = _Refused(
        416, f"the range lies past the end of the file ({size} bytes)",
        {"Content-Range": f"bytes */{size}"},
    )
    if len(found[1]) > _MAX_DIGITS or len(found[2]) > _MAX_DIGITS:
        raise unsatisfiable
    if not found[1]:
        suffix = int(found[2])
        if suffix == 0 or size == 0:
            raise unsatisfiable
        return max(0, size - suffix), size - 1
    start = int(found[1])
    if found[2] and int(found[2]) < start:
        return None  # syntactically invalid: ignored, as RFC 9110 says
    if start >= size:
        raise unsatisfiable
    end = min(int(found[2]), size - 1) if found[2] else size - 1
    return start, end


def _open_inside(root: Path, servable: Servable) -> int:
    """An fd on the file, refusing symlinks and anything whose real path leaves root."""
    real_root = os.path.realpath(root)
    real_dir = os.path.realpath(servable.path.parent)
    if os.path.commonpath([real_root, real_dir]) != real_root:
        raise _Refused(404, "the file's folder leads outside the models dir")
    try:
        fd = os.open(servable.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise _Refused(404, "no such file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _Refused(404, "not a regular file")
    return fd


class BytesServer:
    """Serves the manager's present files under base_path on one listening socket, on the
    HTTP core with limits (its defaults, with a longer keep-alive, unless given)."""

    def __init__(self, manager: Manager, base_path: str = "",
                 served: ServedCounter | None = None, *, limits: Limits | None = None) -> None:
        self.manager = manager
        self.base_path = base_path.rstrip("/")
        self.served = served or ServedCounter()
        self.http = Http1Server(self.app, drain_s=DRAIN_S,
                                limits=limits or Limits(keep_alive_s=KEEP_ALIVE_S))
        self._serving: asyncio.Task[None] | None = None

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self.http.connections)

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port ("" for every interface); OSError when it cannot."""
        self.http.listen = join_host_port(host, port)
        self._serving = await self.http.start()  # an OSError when it cannot listen

    async def close(self) -> None:
        """Stop listening; answers under way get DRAIN_S, then are cut."""
        self.http.should_exit = True
        if self._serving is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._serving, DRAIN_S + 5.0)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no lifespan to speak
        head_only = scope["method"] == "HEAD"
        try:
            await self._answer(scope, send, head_only)
        except _Refused as e:
            self.served.sent(e.status, 0)
            await _send_error(send, e, body=not head_only)

    async def _answer(self, scope: Scope, send: Send, head_only: bool) -> None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                   for name, value in scope["headers"]}
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            raise _Refused(400, "requests with a body are not served")
        if scope["method"] not in ("GET", "HEAD"):
            raise _Refused(405, f"{scope['method']} is not served; only GET and HEAD")
        target = scope["raw_path"].decode("latin-1")
        model, version, file = resolve(target, self.base_path)
        servable = self.manager.servable(model, version, file)
        if servable is None:
            raise _Refused(404, f"{model}/{version}/{file} is not present in this mirror")
        fd = _open_inside(self.manager.disk.root, servable)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            etag = f'"{servable.sha256}"'
            wanted = headers.get("range")
            if headers.get("if-range", etag) != etag:
                wanted = None  # the client holds another version: send it this one whole
            span = byte_range(wanted, st.st_size)
            status = 206 if span else 200
            start, end = span or (0, st.st_size - 1)
            count = max(end - start + 1, 0)
            answer = [(b"content-type", b"application/octet-stream"),
                      (b"content-length", b"%d" % count), (b"accept-ranges", b"bytes"),
                      (b"etag", etag.encode()), (b"server", b"llmgw-mirror"),
                      (b"last-modified", formatdate(st.st_mtime, usegmt=True).encode())]
            if span:
                answer.append((b"content-range", f"bytes {start}-{end}/{st.st_size}".encode()))
            await send({"type": "http.response.start", "status": status, "headers": answer})
            if head_only or not count:
                await send({"type": "http.response.body", "body": b""})
                self.served.sent(status, 0)
                return
            await send({"type": "http.response.zerocopysend", "file": f, "offset": start,
                        "count": count})
            self.served.sent(status, count)


async def _send_error(send: Send, e: _Refused, *, body: bool) -> None:
    text = f"{e.status} {HTTPStatus(e.status).phrase}: {e}\n".encode()
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(text)),
        (b"server", b"llmgw-mirror"), (b"connection", b"close"),
        *((k.lower().encode(), v.encode()) for k, v in e.headers.items())]
    if e.status == 405:
        headers.append((b"allow", b"GET, HEAD"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": text if body else b""})
