"""Http1Server in a thread for the HTTP core's tests: on uvloop (what services run) or on
asyncio's own loop (its native sendfile), listening itself or fed connections accepted
by the test, as a caller with its own TLS admission does; and the waits and the echo app
those tests share."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from llmgw.host.netaddr import free_port
from llmgw.http1.server import Http1Server
from tests.http1.wire import WAIT_S, answer

LoopKind = Literal["uvloop", "asyncio"]


def _wait_started(server: Http1Server, thread: threading.Thread) -> None:
    deadline = time.monotonic() + 10
    while not server.started.wait(0.01):
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"


def run_in_thread(server: Http1Server, loop: LoopKind = "uvloop") -> threading.Thread:
    """server running in a daemon thread of its own, on that loop, once it has started."""
    target = server.run if loop == "uvloop" else lambda: asyncio.run(server.serve())
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    _wait_started(server, thread)
    return thread


@contextmanager
def running(app: Any, loop: LoopKind = "uvloop", drain_s: float = 5.0, **options: Any
            ) -> Iterator[tuple[Http1Server, threading.Thread, int]]:
    """app under Http1Server(**options) on a free loopback port, on that loop, for the
    length of the block: the server (to stop it), its thread and its port."""
    port = free_port()
    server = Http1Server(app, f"127.0.0.1:{port}", drain_s=drain_s, **options)
    thread = run_in_thread(server, loop)
    try:
        yield server, thread, port
    finally:
        server.should_exit = True
        thread.join(WAIT_S + drain_s)


@contextmanager
def accepting(app: Any, context: ssl.SSLContext | None, **options: Any
              ) -> Iterator[tuple[Http1Server, int]]:
    """app under an Http1Server that listens on nothing of its own (serve(sockets=[])):
    this helper accepts each connection and hands it over with protocol_factory() and
    loop.connect_accepted_socket, TLS with context. The server and the port."""
    server = Http1Server(app, **{"drain_s": 2.0, **options})
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)

    async def hand_over(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        try:
            await loop.connect_accepted_socket(server.protocol_factory(), sock, ssl=context,
                                               ssl_handshake_timeout=WAIT_S)
        except (OSError, ssl.SSLError, TimeoutError):
            sock.close()  # a handshake that failed: the client sees it closed

    async def main() -> None:
        loop = asyncio.get_running_loop()
        serve = asyncio.create_task(server.serve(sockets=[]))

        async def accept() -> None:
            while True:
                sock, _ = await loop.sock_accept(listener)
                loop.create_task(hand_over(loop, sock))

        acceptor = asyncio.create_task(accept())
        try:
            await serve
        finally:
            acceptor.cancel()
            listener.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    _wait_started(server, thread)
    try:
        yield server, listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(WAIT_S + server.drain_s)


def in_loop(server: Http1Server, call: Callable[[], Any]) -> Any:
    """call() run in the server's event loop (drop() and the like live there); its result."""
    async def run() -> Any:
        return call()

    return asyncio.run_coroutine_threadsafe(run(), server.loop).result(WAIT_S)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.01)


def echo_path_app(delays: dict[str, float] | None = None) -> Any:
    """Answers each request with its path, after delays[path] seconds."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await asyncio.sleep((delays or {}).get(scope["path"], 0))
        await answer(send, scope["path"].encode())

    return app


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])
