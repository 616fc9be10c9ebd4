"""Real servers on loopback for the services' tests: an ASGI app under llmgw's own server
in a thread (as the admin API, or as the gateway with its Forwarder), and an upstream that
answers with exactly the bytes a test scripts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from llmgw.gateway._forward import Forwarder
from llmgw.gateway.app import Gateway
from llmgw.host.netaddr import free_port
from llmgw.http1.server import Http1Server
from tests.http1.servers import run_in_thread


@contextmanager
def _served(server: Http1Server, port: int, tls: bool) -> Iterator[str]:
    """server in a thread for the length of the block; its URL."""
    thread = run_in_thread(server)
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def serve_asgi(app: Any, certfile: str = "", keyfile: str = ""
               ) -> contextlib.AbstractContextManager[str]:
    """The app on a free loopback port under Http1Server, as `llmgw server` serves the admin
    API (no fast handler), for the length of the block; HTTPS with certfile and keyfile."""
    port = free_port()
    return _served(Http1Server(app, f"127.0.0.1:{port}", certfile=certfile, keyfile=keyfile),
                   port, bool(certfile))


def serve_gateway(app: Any, certfile: str = "", keyfile: str = "",
                  fast: Forwarder | None = None) -> contextlib.AbstractContextManager[str]:
    """The app on a free loopback port under the server `llmgw gateway` runs (Http1Server,
    with a Gateway's Forwarder as its fast handler; fast: that one), for the length of the
    block; HTTPS with certfile and keyfile."""
    port = free_port()
    if fast is None and isinstance(app, Gateway):
        fast = Forwarder(app)
    return _served(Http1Server(app, f"127.0.0.1:{port}", drain_s=5.0, certfile=certfile,
                               keyfile=keyfile, fast=fast), port, bool(certfile))


def events_released_by(first_read: threading.Event, wait_s: float) -> Any:
    """An app that streams one event, waits (up to wait_s) until the client has read it,
    then sends the second and ends the answer."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        released = await asyncio.to_thread(first_read.wait, wait_s)
        body = b"data: 2\n\n" if released else b"data: timed out\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Upstream:
    """A scripted replica: `answer(path, body)` returns (status, content type, body parts);
    parts are sent as separate HTTP chunks, so a test can cut events anywhere. An answer of
    None takes the request and closes the connection without a word."""

    answer: Callable[[str, bytes], tuple[int, str, list[bytes]] | None]
    seen: list[Seen] = field(default_factory=list)
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def scripted_upstream(answer: Callable[[str, bytes], tuple[int, str, list[bytes]] | None]
                      ) -> Iterator[Upstream]:
    upstream = Upstream(answer)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            upstream.seen.append(Seen(self.path, dict(self.headers), body))
            got = upstream.answer(self.path, body)
            if got is None:
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            status, ctype, parts = got
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in parts:
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    upstream.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield upstream
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def raw_server(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A loopback listener whose each connection goes to handle, in a thread of its own,
    for the length of the block; its http:// endpoint."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def refused_endpoint() -> str:
    """A loopback endpoint nothing listens on: connecting to it is refused."""
    return f"http://127.0.0.1:{free_port()}"


def admin_test_client(store: Any, root: Path) -> Any:
    """The admin API on store, in process (FastAPI's TestClient), sending the admin token
    made under root/etc."""
    from fastapi.testclient import TestClient

    from llmgw.control.admin_api import make_admin_app
    from llmgw.host import admin_token

    token_path = root / "etc" / admin_token.TOKEN_FILE
    admin_token.ensure(token_path)
    app = make_admin_app(store, node_timeout_s=30.0,
                         token_hash=admin_token.hash_path_for(token_path))
    return TestClient(app, headers={
        "Authorization": f"Bearer {admin_token.read_token(token_path)}"})
