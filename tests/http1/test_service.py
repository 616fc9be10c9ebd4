"""A service process (llmgw.http1.service): SIGTERM stops a process that serves through its own
handler, which lets the server drain and the process exit 0; a listener that cannot
listen says where and for what."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from llmgw.host.netaddr import free_port
from llmgw.http1.server import Http1Server
from llmgw.http1.service import ListenError, listening

SERVES_UNTIL_SIGTERM = """
import logging, sys
from llmgw.http1.server import Http1Server
from llmgw.http1.service import on_stop_signals, run_service

async def app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

async def main():
    server = Http1Server(app, sys.argv[1])
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
def test_sigterm_stops_a_serving_process_through_its_own_handler(handled: bool) -> None:
    """With on_stop_signals set, SIGTERM stops the server, it serves out and the process
    exits 0. The negative control, without it: SIGTERM's default kills the process (-15)
    before it serves out."""
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
        assert (proc.returncode, out.splitlines()) == (0, ["stop", "served out"])
    else:
        assert (proc.returncode, out) == (-signal.SIGTERM, "")


async def _app(scope: object, receive: object, send: object) -> None:
    pass


def test_a_listener_on_a_taken_address_says_where_and_for_what() -> None:
    """listening() returns once the server listens; on an address another socket holds it
    raises ListenError naming the address and what was to be served there. The negative
    control: the same call on a free port listens."""
    async def attempt(listen: str) -> None:
        server = Http1Server(_app, listen)
        serving = await listening(server, "the test API")
        assert server.started.is_set()
        server.should_exit = True
        await serving

    with socket.create_server(("127.0.0.1", 0)) as taken:
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ListenError, match=rf"cannot listen on {listen} for the test API: "):
            asyncio.run(attempt(listen))
    asyncio.run(attempt(f"127.0.0.1:{free_port()}"))


def test_started_is_an_event_that_a_waiter_is_told_of_once_the_server_listens() -> None:
    """A server's `started` is an event: unset before serve() (the negative control), set
    once it listens, and a waiter in the serving loop (wait_started) is woken by it, with
    no poll; start() returns the serving task then, and connections are taken."""
    async def attempt() -> None:
        port = free_port()
        server = Http1Server(_app, f"127.0.0.1:{port}")
        waiter = asyncio.create_task(server.wait_started())
        await asyncio.sleep(0.05)
        assert not server.started.is_set() and not waiter.done(), "set before it listens"
        serving = await server.start()
        await asyncio.wait_for(waiter, 1)
        assert server.started.is_set()
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        server.should_exit = True
        await serving

    asyncio.run(attempt())
