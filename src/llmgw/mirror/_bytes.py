"""The bytes server: GET and HEAD of finished files, with single ranges, nothing else.

Not on uvicorn/Starlette: Starlette's FileResponse reads the file in a worker thread and
pushes every chunk through the ASGI loop, while this server hands the socket to the
kernel with sendfile(2) (asyncio's loop.sendfile), so a node pulling many gigabytes costs
the mirror almost no CPU. bench/mirror_throughput.py measures it against
`python -m http.server` and nginx. It speaks only what nodes need: HTTP/1.1 with
keep-alive, GET/HEAD, one Range; anything else is answered 400, 405 or 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import stat
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from pathlib import Path
from urllib.parse import unquote, urlsplit

from llmgw.mirror._disk import is_name
from llmgw.mirror._downloads import Manager, Servable
from llmgw.mirror._metrics import ServedCounter

log = logging.getLogger("llmgw.mirror.bytes")

_HEAD_LIMIT = 16 * 1024
_IDLE_S = 60.0
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class _Refused(Exception):
    """A request answered with an error status and a line saying why."""

    def __init__(self, status: int, why: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(why)
        self.status = status
        self.headers = headers or {}


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    version: str
    headers: dict[str, str]

    def keep_alive(self) -> bool:
        conn = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return conn == "keep-alive"
        return conn != "close"


def parse_head(block: bytes) -> Request:
    try:
        lines = block.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise _Refused(400, "malformed request line") from None
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise _Refused(400, f"unsupported protocol {version}")
    headers = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _Refused(400, "malformed header")
        headers[name.lower()] = value.strip()
    return Request(method, target, version, headers)


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
    """Serves the manager's present files under base_path on one listening socket."""

    def __init__(self, manager: Manager, base_path: str = "",
                 served: ServedCounter | None = None) -> None:
        self.manager = manager
        self.base_path = base_path.rstrip("/")
        self.served = served or ServedCounter()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int) -> asyncio.Server:
        self._server = await asyncio.start_server(self._serve, host, port, limit=_HEAD_LIMIT)
        return self._server

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while await self._one(reader, writer):
                pass
        except (
            TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError
        ):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; whether the connection stays open for another."""
        block = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _IDLE_S)
        method = "GET"
        try:
            req = parse_head(block[:-4])
            method = req.method
            if req.headers.get("content-length", "0") != "0" or "transfer-encoding" in req.headers:
                raise _Refused(400, "requests with a body are not served")
            if req.method not in ("GET", "HEAD"):
                raise _Refused(405, f"{req.method} is not served; only GET and HEAD")
            return await self._send_file(req, writer)
        except _Refused as e:
            self.served.sent(e.status, 0)
            await _send_error(writer, e, body=method != "HEAD")
            return False

    async def _send_file(self, req: Request, writer: asyncio.StreamWriter) -> bool:
        model, version, file = resolve(req.target, self.base_path)
        servable = self.manager.servable(model, version, file)
        if servable is None:
            raise _Refused(404, f"{model}/{version}/{file} is not present in this mirror")
        fd = _open_inside(self.manager.disk.root, servable)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            etag = f'"{servable.sha256}"'
            wanted = req.headers.get("range")
            if req.headers.get("if-range", etag) != etag:
                wanted = None  # the client holds another version: send it this one whole
            span = byte_range(wanted, st.st_size)
            status = 206 if span else 200
            start, end = span or (0, st.st_size - 1)
            headers = {
                "Content-Type": "application/octet-stream",
                "Content-Length": str(end - start + 1),
                "Accept-Ranges": "bytes",
                "ETag": etag,
                "Last-Modified": formatdate(st.st_mtime, usegmt=True),
            }
            if span:
                headers["Content-Range"] = f"bytes {start}-{end}/{st.st_size}"
            keep = req.keep_alive()
            writer.write(_head(status, headers, keep))
            await writer.drain()
            if req.method == "GET" and end >= start:
                loop = asyncio.get_running_loop()
                await loop.sendfile(writer.transport, f, start, end - start + 1)
                self.served.sent(status, end - start + 1)
            else:
                self.served.sent(status, 0)
        return keep


def _head(status: int, headers: dict[str, str], keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
             f"Date: {formatdate(usegmt=True)}", "Server: llmgw-mirror",
             f"Connection: {'keep-alive' if keep_alive else 'close'}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _send_error(writer: asyncio.StreamWriter, e: _Refused, *, body: bool) -> None:
    text = f"{e.status} {HTTPStatus(e.status).phrase}: {e}\n".encode()
    headers = {"Content-Type": "text/plain; charset=utf-8", "Content-Length": str(len(text)),
               **e.headers}
    if e.status == 405:
        headers["Allow"] = "GET, HEAD"
    writer.write(_head(e.status, headers, keep_alive=False) + (text if body else b""))
    with contextlib.suppress(ConnectionError):
        await writer.drain()
