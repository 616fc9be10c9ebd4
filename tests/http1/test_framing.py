"""RFC 9112's framing rules the HTTP core holds where httptools leaves them to the server:
Host (3.2), transfer codings (6.1, 6.3), HTTP/1.0 with a body framed by chunks (6.1),
versions other than 1.0 and 1.1, and answers in request order with nothing processed
after a malformed request. Each refusal has its control: the same request made right is
served."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.http1.servers import running
from tests.http1.wire import Client, answer, read_body


class Recording:
    """Answers each request with its path (after delays[path] s), recording the paths."""

    def __init__(self, delays: dict[str, float] | None = None) -> None:
        self.paths: list[str] = []
        self.delays = delays or {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.paths.append(scope["path"])
        await read_body(receive)
        await asyncio.sleep(self.delays.get(scope["path"], 0))
        await answer(send, scope["path"].encode())


def exchange(raw: bytes, app: Recording | None = None) -> tuple[list[int], bool, Recording]:
    """raw sent on one connection: the statuses answered, whether it was closed after, and
    the app (what it saw)."""
    app = app or Recording()
    with running(app) as (_, _, port), Client(port) as client:
        client.send(raw)
        statuses = []
        while True:
            try:
                statuses.append(client.answer().status)
            except (ConnectionError, TimeoutError):
                return statuses, True, app
            if client.buffer:
                continue  # the next answer came with this one
            if client.closed(within=0.5):
                if client.buffer:
                    continue
                return statuses, True, app
            if not client.buffer:
                return statuses, False, app


@pytest.mark.parametrize("head, status", [
    (b"GET /a HTTP/1.1\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nHost: x y\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nHost: x:80:90\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n", 200),
    (b"GET /a HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n", 200),
    (b"GET /a HTTP/1.0\r\n\r\n", 200),
])
def test_host_exactly_once_in_http_1_1_and_of_host_port_shape(head: bytes, status: int) -> None:
    statuses, _, app = exchange(head)
    assert statuses == [status]
    assert app.paths == (["/a"] if status == 200 else [])


@pytest.mark.parametrize("coding, status", [
    (b"gzip, chunked", 501), (b"chunked, gzip", 400), (b"chunked, chunked", 400),
    (b"gzip", 400), (b"chunked", 200),
])
def test_a_transfer_coding_other_than_chunked_alone_is_refused(coding: bytes,
                                                               status: int) -> None:
    """RFC 9112 6.1 and 6.3: chunked must come last and once, else the length cannot be
    told (400); a coding this server does not decode is 501; chunked alone is served."""
    statuses, _, app = exchange(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding
                                + b"\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
    assert statuses == [status]
    assert app.paths == (["/a"] if status == 200 else [])


def test_http_1_0_with_a_chunked_body_is_answered_then_closed_and_nothing_behind_is_read(
        ) -> None:
    """RFC 9112 6.1: a 1.0 request framed by Transfer-Encoding is answered, then the
    connection closed (even with keep-alive asked for); the request hidden behind it is
    never answered. Control: the same pair in HTTP/1.1 is answered twice."""
    hidden = b"GET /hidden HTTP/1.1\r\nHost: x\r\n\r\n"
    statuses, closed, app = exchange(
        b"POST /a HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n" + hidden)
    assert statuses == [200] and closed and app.paths == ["/a"]
    statuses, _, app = exchange(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                                b"\r\n\r\n0\r\n\r\n" + hidden)
    assert statuses == [200, 200] and app.paths == ["/a", "/hidden"]


@pytest.mark.parametrize("version, status", [(b"2.0", 505), (b"0.9", 505), (b"1.1", 200)])
def test_versions_other_than_1_0_and_1_1_are_505(version: bytes, status: int) -> None:
    statuses, _, app = exchange(b"GET /a HTTP/" + version + b"\r\nHost: x\r\n\r\n")
    assert statuses == [status]
    assert app.paths == (["/a"] if status == 200 else [])


def test_a_malformed_request_behind_a_slow_one_is_refused_after_its_answer() -> None:
    """Pipelined: a slow request, then a malformed one, then a good one. The slow one is
    answered first, then the 400, then the connection closes: the third is never read and
    the app saw only the first."""
    app = Recording({"/slow": 0.3})
    statuses, closed, app = exchange(
        b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /bad HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
        b"GET /never HTTP/1.1\r\nHost: x\r\n\r\n", app)
    assert statuses == [200, 400] and closed
    assert app.paths == ["/slow"]


def test_negative_control_three_good_pipelined_requests_are_all_answered_in_order() -> None:
    app = Recording({"/slow": 0.3})
    statuses, _, app = exchange(
        b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /c HTTP/1.1\r\nHost: x\r\n\r\n", app)
    assert statuses == [200, 200, 200] and app.paths == ["/slow", "/b", "/c"]
