"""The services' uvicorn listeners: what is written in one turn of the event loop leaves in
one send(), nothing written is held past that turn, and an idle HTTPS client does not hold
a draining server open."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

import httpx

from llmgw import pki
from llmgw._serving import _WritesGathered, quiet_server
from llmgw.netaddr import free_port
from tests.control.servers import events_released_by, run_in_thread, serve_asgi


class Recorded:
    """A transport that records what reaches it (pure logic: the class under test only
    decides when to write, never how)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.calls: list[str] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.calls.append("close")
        self.closing = True

    def abort(self) -> None:
        self.calls.append("abort")
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str) -> Any:
        return f"extra {name}"


def gathered() -> tuple[_WritesGathered, Recorded]:
    inner = Recorded()
    return _WritesGathered(inner, asyncio.get_running_loop()), inner  # type: ignore[arg-type]


def test_an_answers_head_and_body_written_back_to_back_leave_in_one_write() -> None:
    async def scenario() -> list[bytes]:
        transport, inner = gathered()
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(b'{"ok":true}')
        assert inner.writes == [], "nothing leaves before the turn ends"
        await asyncio.sleep(0)
        return inner.writes

    assert asyncio.run(scenario()) == [b'HTTP/1.1 200 OK\r\n\r\n{"ok":true}']


def test_a_write_after_a_wait_leaves_in_its_own_turn() -> None:
    async def scenario() -> list[bytes]:
        transport, inner = gathered()
        transport.write(b"event 1")
        await asyncio.sleep(0)
        transport.write(b"event 2")
        await asyncio.sleep(0)
        return inner.writes

    assert asyncio.run(scenario()) == [b"event 1", b"event 2"]


def test_close_sends_what_is_pending_first_and_abort_drops_it() -> None:
    async def scenario() -> tuple[Recorded, Recorded]:
        closed, inner_closed = gathered()
        closed.write(b"last bytes")
        closed.close()
        aborted, inner_aborted = gathered()
        aborted.write(b"never sent")
        aborted.abort()
        await asyncio.sleep(0)
        return inner_closed, inner_aborted

    closed, aborted = asyncio.run(scenario())
    assert (closed.writes, closed.calls) == ([b"last bytes"], ["close"])
    assert (aborted.writes, aborted.calls) == ([], ["abort"])


def test_pending_bytes_count_toward_the_write_buffer_and_the_rest_is_the_transports() -> None:
    async def scenario() -> tuple[int, Any]:
        transport, _ = gathered()
        transport.write(b"12345")
        return transport.get_write_buffer_size(), transport.get_extra_info("peername")

    assert asyncio.run(scenario()) == (7 + 5, "extra peername")


def test_nothing_is_written_to_a_transport_that_closed_meanwhile() -> None:
    async def scenario() -> list[bytes]:
        transport, inner = gathered()
        transport.write(b"too late")
        inner.closing = True  # the peer hung up before the turn ended
        await asyncio.sleep(0)
        return inner.writes

    assert asyncio.run(scenario()) == []


def test_a_real_listener_streams_each_event_while_the_app_still_waits() -> None:
    """Negative control for holding writes: were they held until the answer ends, the
    client would never see the first event while the app waits for it to be read."""
    first_read = threading.Event()
    app = events_released_by(first_read, 10)

    with serve_asgi(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            seen = b""
            while b"data: 1\n\n" not in seen:
                part = client.recv(4096)
                assert part, f"the connection closed after {seen!r}"
                seen += part
            assert b"data: 2" not in seen
            first_read.set()
            while b"0\r\n\r\n" not in seen:
                seen += client.recv(4096)
    assert seen.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"data: 2\n\n" in seen


def test_an_idle_https_keep_alive_client_does_not_hold_a_draining_server(tmp_path: Path) -> None:
    """A TLS close waits for the peer's close_notify, which an idle keep-alive client never
    sends: without the abort after TLS_CLOSE_GRACE_S the stop waited uvloop's whole bound
    for it (30 s measured). The client stays open throughout, as a pooled one does."""
    ca = pki.create_ca()
    cert, key = pki.issue_server(ca, ["127.0.0.1"]).write(tmp_path, "server")
    bundle, _ = ca.write(tmp_path, "ca")

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = quiet_server(app, f"127.0.0.1:{port}", certfile=str(cert), keyfile=str(key))
    thread = run_in_thread(server)
    with httpx.Client(verify=ssl.create_default_context(cafile=str(bundle))) as client:
        assert client.get(f"https://127.0.0.1:{port}/").text == "ok"
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "an idle HTTPS client held the server past 15 s"
