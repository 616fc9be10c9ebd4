"""Http1Server's life (`http1.server`) against raw sockets on loopback: the drain that lets
what is under way finish, and the ASGI lifespan around it."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.host import pki
from llmgw.host.netaddr import free_port
from llmgw.http1.server import IDLE_DRAIN_S, Http1Server
from tests.http1.servers import echo_path_app, port_of, running, wait_for
from tests.http1.wire import WAIT_S, Client, answer, get
from tests.servers import serve_gateway


def stream_released_by(event: threading.Event, parts: list[bytes],
                       events: list[str] | None = None) -> Any:
    """An app that streams parts[0], waits for event, then sends the rest (and records
    what it did in events, lifespan too)."""
    record = events.append if events is not None else (lambda _: None)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await asyncio.sleep(0.1)  # a slow startup: requests must wait for it
                    record("startup")
                    await send({"type": "lifespan.startup.complete"})
                else:
                    record("shutdown")
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        record("request")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": parts[0], "more_body": True})
        await asyncio.to_thread(event.wait, WAIT_S)
        for part in parts[1:]:
            await asyncio.sleep(0.05)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        record("answered")

    return app


def test_a_stream_under_way_when_the_stop_begins_finishes_before_the_server_exits() -> None:
    release = threading.Event()
    parts = [b"part 1;", b"part 2;", b"part 3;", b"part 4;"]
    try:
        with running(stream_released_by(release, parts)) as (server, thread, port), \
                Client(port) as client:
            client.send(get())
            client.until(b"part 1;")
            server.should_exit = True
            wait_for(lambda: server.draining, "the server did not begin to drain")
            release.set()
            rest = client.until(b"0\r\n\r\n")
            assert client.closed(), "the drained connection was not closed"
            thread.join(WAIT_S)
            assert not thread.is_alive(), "the server did not exit after the stream"
    finally:
        release.set()
    assert rest == b"\r\n" + b"".join(b"7\r\n%s\r\n" % p for p in parts[1:]) + b"0\r\n\r\n"


def test_a_drain_closes_an_idle_connection_and_answers_a_request_sent_as_it_began() -> None:
    """An idle keep-alive connection is closed about IDLE_DRAIN_S into the drain (not
    before the stop: the negative control); one whose request comes just after the stop
    began is answered with connection: close, then closed."""
    with running(echo_path_app()) as (server, thread, port), \
            Client(port) as idle, Client(port) as busy:
        for client in (idle, busy):
            client.send(get("/before"))
            assert client.answer().body == b"/before"
        assert not idle.closed(within=0.2), "an idle connection closed before the stop"
        server.should_exit = True
        wait_for(lambda: server.draining, "the server did not begin to drain")
        busy.send(get("/during"))
        during = busy.answer()
        assert busy.closed()
        assert idle.closed(within=IDLE_DRAIN_S + 2.0), \
            f"an idle connection still open {IDLE_DRAIN_S + 2.0} s into the drain"
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the server did not exit once its connections closed"
    assert (during.body, during.headers["connection"]) == (b"/during", "close")


def test_a_request_whose_head_is_part_way_in_when_the_drain_begins_is_answered() -> None:
    """The idle close IDLE_DRAIN_S into the drain waits for a head that is still coming:
    closing then would lose a request the client was sending."""
    with running(echo_path_app()) as (server, thread, port), Client(port) as client:
        client.send(get("/before"))
        assert client.answer().body == b"/before"
        client.send(b"GET /slow HTTP/1.1\r\n")
        server.should_exit = True
        wait_for(lambda: server.draining, "the server did not begin to drain")
        time.sleep(IDLE_DRAIN_S + 0.5)
        client.send(b"Host: x\r\n\r\n")
        slow = client.answer()
        assert client.closed()
        thread.join(WAIT_S)
    assert (slow.body, slow.headers["connection"]) == (b"/slow", "close")


def test_an_idle_https_keep_alive_client_does_not_hold_a_draining_server(
        tmp_path: Path) -> None:
    """A TLS close waits for the peer's close_notify, which an idle pooled client never
    sends: the server cuts the socket TLS_CLOSE_GRACE_S after closing it, not at the end
    of its drain bound (30 s here). The client stays open throughout."""
    ca = pki.create_ca()
    cert, key = pki.issue_server(ca, ["127.0.0.1"]).write(tmp_path, "server")
    bundle, _ = ca.write(tmp_path, "ca")
    with running(echo_path_app(), drain_s=30, certfile=str(cert),
                 keyfile=str(key)) as (server, thread, port), \
            httpx.Client(verify=ssl.create_default_context(cafile=str(bundle)),
                         timeout=WAIT_S) as client:
        assert client.get(f"https://127.0.0.1:{port}/tls").text == "/tls"
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "an idle HTTPS client held the server past 15 s"


def test_lifespan_starts_before_the_first_request_and_shuts_down_after_the_drain() -> None:
    events: list[str] = []
    release = threading.Event()
    app = stream_released_by(release, [b"one;", b"two;"], events)
    try:
        with running(app) as (server, thread, port), Client(port) as client:
            client.send(get())
            client.until(b"one;")
            server.should_exit = True
            wait_for(lambda: server.draining, "the server did not begin to drain")
            assert events == ["startup", "request"], "shut down before the drain ended"
            release.set()
            client.until(b"0\r\n\r\n")
            thread.join(WAIT_S)
    finally:
        release.set()
    assert events == ["startup", "request", "answered", "shutdown"]


@pytest.mark.parametrize("kind", ["returns", "raises"])
def test_an_app_that_does_not_speak_lifespan_is_served_anyway(kind: str) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            if kind == "raises":
                raise ValueError(f"unknown scope type {scope['type']}")
            return
        await answer(send, b"served")

    with serve_gateway(app) as url, Client(port_of(url)) as client:
        client.send(get())
        assert client.answer().body == b"served"


def test_an_app_whose_startup_fails_is_never_served() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.failed", "message": "no database"})
            return
        await answer(send, b"served")

    port = free_port()
    with pytest.raises(RuntimeError, match="no database"):
        asyncio.run(asyncio.wait_for(Http1Server(app, f"127.0.0.1:{port}").serve(), WAIT_S))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S).close()
