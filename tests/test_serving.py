"""The services' uvicorn listeners, on uvicorn's public API: each event of a stream leaves
while the app still waits, an idle HTTPS client holds a draining server no longer than its
drain bound, and SIGTERM stops a process that serves one, through the process's own
handler, with exit status 0."""

from __future__ import annotations

import contextlib
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw import pki
from llmgw._serving import quiet_server
from llmgw.netaddr import free_port
from tests.control.servers import events_released_by, run_in_thread, serve_asgi


def test_a_real_listener_streams_each_event_while_the_app_still_waits() -> None:
    """Were writes held until the answer ends, the client would never see the first event
    while the app waits for it to be read."""
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


def test_an_idle_https_keep_alive_client_holds_a_draining_server_no_longer_than_its_bound(
        tmp_path: Path) -> None:
    """A TLS close waits for the peer's close_notify, which an idle keep-alive client never
    sends (uvloop waits 30 s for it). The drain bound (drain_s, uvicorn's
    timeout_graceful_shutdown) ends the stop at 1 s; the margin to 10 s is the machine's.
    The client stays open throughout, as a pooled one does."""
    ca = pki.create_ca()
    cert, key = pki.issue_server(ca, ["127.0.0.1"]).write(tmp_path, "server")
    bundle, _ = ca.write(tmp_path, "ca")

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = quiet_server(app, f"127.0.0.1:{port}", certfile=str(cert), keyfile=str(key),
                          drain_s=1.0)
    thread = run_in_thread(server)
    with httpx.Client(verify=ssl.create_default_context(cafile=str(bundle))) as client:
        assert client.get(f"https://127.0.0.1:{port}/").text == "ok"
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "an idle HTTPS client held the server past 10 s"


SERVES_UNTIL_SIGTERM = """
import asyncio, logging, sys
from llmgw._serving import on_stop_signals, quiet_server, run_service

async def app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

async def main():
    server = quiet_server(app, sys.argv[1])
    def stop():
        print("stop", flush=True)
        server.should_exit = True
    if sys.argv[2] == "handled":
        on_stop_signals(logging.getLogger("t"), stop)
    await server.serve()
    print("served out", flush=True)

run_service(main())
"""


@pytest.mark.parametrize("handled", [True, False], ids=["own handler", "none"])
def test_sigterm_stops_a_process_serving_uvicorn_through_its_own_handler(handled) -> None:
    """uvicorn catches SIGTERM while it serves and raises it again once stopped: with the
    process's handler (on_stop_signals) set, that handler stops it, it serves out and exits
    0. The negative control, without one: uvicorn's stop, then the raised SIGTERM kills
    it (-15), the status the process's handler is there to avoid."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVES_UNTIL_SIGTERM, f"127.0.0.1:{port}",
                             "handled" if handled else "bare"],
                            stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "it did not serve"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=1).text == "ok":
                    break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    if handled:
        # stop, served out; then stop once more, for the SIGTERM uvicorn raised again
        assert (proc.returncode, out.splitlines()[:2]) == (0, ["stop", "served out"])
    else:
        assert (proc.returncode, out) == (-signal.SIGTERM, "")
