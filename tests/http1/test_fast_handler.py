"""Http1Server's fast handler (`fast=`), what the gateway's Forwarder is offered, against
raw sockets on loopback: whole bodies, answers in order, a handler that fails, large
bodies and 100-continue, a stream that follows its client."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from llmgw.http1.limits import Limits
from llmgw.http1.server import BODY_READ_AHEAD_BYTES
from tests.http1.servers import running
from tests.http1.wire import WAIT_S, Client, answer, get, read_body


def echo_body_app(scope: dict[str, Any], receive: Any, send: Any) -> Any:
    """The app: answers "app: BODY"."""
    async def run() -> None:
        if scope["type"] == "http":
            got, _ = await read_body(receive)
            await answer(send, b"app: " + got)

    return run()


class Upper:
    """A fast handler that takes POSTs to /fast and answers, from a later callback, with
    the body upper-cased; what it saw is kept."""

    def __init__(self, then: str = "answer") -> None:
        self.then = then
        self.bodies: list[bytes] = []

    def __call__(self, cycle: Any) -> bool:
        if cycle.scope["path"] != "/fast":
            return False
        body = cycle.body_bytes()
        self.bodies.append(body)
        loop = asyncio.get_running_loop()
        if self.then == "raise":
            raise RuntimeError("a fast handler that fails")
        else:
            loop.call_later(0.05, cycle.answer, 200, [(b"content-type", b"text/plain")],
                            body.upper())
        return True


def post(path: str, body: bytes, *extra: str) -> bytes:
    return get(path, f"Content-Length: {len(body)}", *extra, method="POST") + body


def test_a_fast_handler_is_offered_the_whole_body_and_answers_in_order() -> None:
    """A body that comes in two pieces is offered once, whole; pipelined requests are
    answered in turn, the handler's and the app's (it declined /other) alike."""
    fast = Upper()
    with running(echo_body_app, fast=fast) as (_, _, port), Client(port) as client:
        whole_request = post("/fast", b"hello there")
        client.send(whole_request[:-5])
        time.sleep(0.1)
        client.send(whole_request[-5:])
        first = client.answer()
        client.send(post("/fast", b"one") + post("/other", b"two") + post("/fast", b"three"))
        rest = [client.answer() for _ in range(3)]
    assert first.body == b"HELLO THERE" and first.headers["content-length"] == "11"
    assert [a.body for a in rest] == [b"ONE", b"app: two", b"THREE"]
    assert fast.bodies == [b"hello there", b"one", b"three"]


def test_a_fast_handler_that_raises_leaves_the_request_to_the_app(caplog) -> None:
    """Raised from the parser's callback, it would have read as a malformed request (400)."""
    with running(echo_body_app, fast=Upper(then="raise")) as (_, _, port), \
            Client(port) as client:
        client.send(post("/fast", b"x"))
        got = client.answer()
    assert (got.status, got.body) == (200, b"app: x")
    assert "the fast handler failed on POST /fast" in caplog.text


def test_a_body_over_the_read_ahead_and_an_expect_request_are_the_fast_handlers_too(
        ) -> None:
    """A large body is held whole for the handler (up to the limits' max_body_bytes); a
    client that waits for 100 Continue is told to send its body, then it is offered. The
    control: a body over max_body_bytes is refused, and never offered."""
    fast = Upper()
    body = b"b" * (2 * BODY_READ_AHEAD_BYTES)
    limits = Limits(max_body_bytes=4 * BODY_READ_AHEAD_BYTES)
    with running(echo_body_app, fast=fast, limits=limits) as (_, _, port), \
            Client(port) as client:
        client.send(post("/fast", body))
        large = client.answer()
        client.send(get("/fast", "Expect: 100-continue", "Content-Length: 2", method="POST"))
        interim = client.answer()
        client.send(b"hi")
        expecting = client.answer()
        client.send(post("/fast", b"x" * (5 * BODY_READ_AHEAD_BYTES)))
        over = client.answer()
    assert large.body == body.upper()
    assert interim.status == 100 and expecting.body == b"HI"
    assert over.status == 413 and fast.bodies == [body, b"hi"]


class Streamer:
    """A fast handler that streams `parts` chunks of `size` bytes to POST /stream, each
    written once the client took the last (when_writable), and notes whether it was told
    the client left (when_gone) and how many it wrote."""

    def __init__(self, parts: int, size: int) -> None:
        self.parts, self.size = parts, size
        self.written = 0
        self.gone = threading.Event()

    def __call__(self, cycle: Any) -> bool:
        cycle.when_gone(self.gone.set)
        cycle.start(200, [(b"content-type", b"text/plain")])
        self.more(cycle)
        return True

    def more(self, cycle: Any) -> None:
        while not cycle.paused and not cycle.gone and self.written < self.parts:
            self.written += 1
            cycle.write(b"p" * self.size)
        if cycle.gone:
            return
        if self.written == self.parts:
            cycle.end(b"end")
        else:
            cycle.when_writable(lambda: self.more(cycle))


def test_a_fast_handler_streams_as_the_client_takes_it_and_is_told_it_left() -> None:
    """start, write and end make a chunked answer; while the client does not read, the
    handler is held at paused (it wrote far fewer parts than the stream), and goes on
    once it reads; a client that leaves mid-stream is told to the handler."""
    whole, leaving = Streamer(64, 1 << 20), Streamer(64, 1 << 20)
    with running(echo_body_app, fast=whole) as (_, _, port), \
            Client(port, receive_buffer=1 << 16) as client:
        client.send(post("/stream", b""))
        time.sleep(0.3)
        held_at = whole.written
        got = client.answer()
    with running(echo_body_app, fast=leaving) as (_, _, port):
        with Client(port, receive_buffer=1 << 16) as client:
            client.send(post("/stream", b""))
            client.until(b"pppp")
        told = leaving.gone.wait(WAIT_S)
    assert got.headers["transfer-encoding"] == "chunked"
    assert got.body == b"p" * (64 << 20) + b"end" and not whole.gone.is_set()
    assert held_at < 32, f"{held_at} parts written to a client that read none"
    assert told and leaving.written < 64
