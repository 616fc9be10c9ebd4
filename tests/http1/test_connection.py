"""One connection of Http1Server against raw sockets on loopback (`http1._conn`,
`http1._cycle`): keep-alive, pipelining, streams, bodies, Expect: 100-continue, HEAD,
refusals, a client that leaves, an app that fails, closing and the idle bound."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from typing import Any

import pytest

from llmgw.http1.limits import Limits
from llmgw.http1.server import BODY_READ_AHEAD_BYTES, MAX_HEAD_BYTES
from tests.http1.servers import echo_path_app, port_of, running
from tests.http1.wire import WAIT_S, Client, answer, get, read_body
from tests.servers import events_released_by, serve_gateway


def test_keep_alive_answers_two_requests_on_one_connection_with_length_and_date() -> None:
    clients = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            clients.append(scope["client"])
            await answer(send, scope["path"].encode())

    with serve_gateway(app) as url, Client(port_of(url)) as client:
        client.send(get("/one"))
        first = client.answer()
        client.send(get("/second"))
        second = client.answer()
    for got, body in ((first, b"/one"), (second, b"/second")):
        assert (got.status, got.body) == (200, body)
        assert got.headers["content-length"] == str(len(body))
        assert "transfer-encoding" not in got.headers and "connection" not in got.headers
        assert got.headers["date"].endswith(" GMT")
    assert clients[0] == clients[1], "the two requests came on two connections"


def test_the_scope_holds_what_the_request_said() -> None:
    scopes = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scopes.append(scope)
            await answer(send, b"ok")

    with serve_gateway(app) as url, Client(port_of(url)) as client:
        client.send(get("/a%20b/c?x=1&y=%20", "X-Thing: Value", "Content-Length: 0",
                        method="POST"))
        assert client.answer().body == b"ok"
        local = client.sock.getsockname()
    scope = scopes[0]
    assert (scope["method"], scope["http_version"], scope["scheme"]) == ("POST", "1.1", "http")
    assert (scope["path"], scope["raw_path"]) == ("/a b/c", b"/a%20b/c")
    assert scope["query_string"] == b"x=1&y=%20"
    assert (b"x-thing", b"Value") in scope["headers"]
    assert scope["server"] == ("127.0.0.1", port_of(url))
    assert tuple(scope["client"]) == local


def test_pipelined_requests_are_answered_in_order_each_with_its_own_body() -> None:
    """The first request is the slow one: were requests answered as they finish, the
    second's answer would come first."""
    with serve_gateway(echo_path_app({"/first": 0.1})) as url, \
            Client(port_of(url)) as client:
        client.send(get("/first") + get("/second") + get("/third"))
        bodies = [client.answer().body for _ in range(3)]
    assert bodies == [b"/first", b"/second", b"/third"]


def test_a_streamed_answer_leaves_as_chunks_each_while_the_app_still_waits() -> None:
    """Negative control for holding writes: were they held until the answer ends, the
    client would never see the first chunk while the app waits for it to be read."""
    first_read = threading.Event()
    app = events_released_by(first_read, WAIT_S)

    try:
        with serve_gateway(app) as url, Client(port_of(url)) as client:
            client.send(get())
            head = client.until(b"\r\n\r\n")
            first = client.until(b"data: 1\n\n\r\n")
            assert b"data: 2" not in client.buffer
            first_read.set()
            rest = client.until(b"0\r\n\r\n")
    finally:
        first_read.set()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding: chunked\r\n" in head and b"content-length" not in head
    assert first == b"9\r\ndata: 1\n\n\r\n"
    assert rest == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n", "an empty last message ends the chunks"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_sent_in_pieces_and_over_the_read_ahead_reaches_the_app_whole(
        framing: str) -> None:
    """The app waits before it reads, so the server stops reading past
    BODY_READ_AHEAD_BYTES and must start again as the app takes the body: a body that
    stopped there would time out the answer."""
    body = bytes(range(256)) * (3 * BODY_READ_AHEAD_BYTES // 256 + 7)
    assert len(body) > BODY_READ_AHEAD_BYTES
    seen = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.sleep(0.1)
            got, messages = await read_body(receive)
            seen.append(messages)
            await answer(send, f"{len(got)} {hashlib.sha256(got).hexdigest()}".encode())

    piece = 100_000
    pieces = [body[i:i + piece] for i in range(0, len(body), piece)]
    if framing == "chunked":
        head = get("/", "Transfer-Encoding: chunked", method="POST")
        pieces = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]
    else:
        head = get("/", f"Content-Length: {len(body)}", method="POST")
    with serve_gateway(app) as url, Client(port_of(url)) as client:
        client.send(head)
        for part in pieces:
            client.send(part)
            time.sleep(0.005)
        got = client.answer()
    assert got.body == f"{len(body)} {hashlib.sha256(body).hexdigest()}".encode()
    assert seen[0] > 1, "the whole body waited for the app at once: no read-ahead bound"


def test_a_body_the_app_left_unread_does_not_stall_the_connection() -> None:
    """An app that answers before reading the body (the gateway's 413): the rest of the
    body is read and dropped, and the next request on the connection is answered.
    Buffered for the finished answer, it stopped reading past BODY_READ_AHEAD_BYTES and
    the connection hung."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await answer(send, b"too large" if scope["method"] == "POST" else b"next",
                         status=413 if scope["method"] == "POST" else 200)

    body = b"x" * (8 * BODY_READ_AHEAD_BYTES)
    with serve_gateway(app) as url, Client(port_of(url)) as client:
        client.send(get("/", f"Content-Length: {len(body)}", method="POST"))
        assert client.answer().status == 413
        try:
            client.send(body + get("/next"))
        except TimeoutError:
            pytest.fail("the server stopped reading the body the app left unread")
        got = client.answer()
    assert (got.status, got.body) == (200, b"next")


def test_a_client_that_does_not_read_holds_the_apps_send_until_it_reads_again() -> None:
    """Write backpressure: with the client's window small, the app's send() waits once
    the transport's buffer is full (without it the app would have sent all of its chunks,
    the negative control), and carries on once the client reads."""
    chunk, total = b"x" * (1 << 20), 32
    sent: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(total):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent.append(i)
        await send({"type": "http.response.body", "body": b""})

    with serve_gateway(app) as url, Client(port_of(url), receive_buffer=1 << 16) as client:
        client.send(get())
        before = -1
        while len(sent) != before:  # until the app has stopped sending for a while
            before = len(sent)
            time.sleep(0.2)
            assert len(sent) < total, "the app sent everything to a client that reads nothing"
        got = client.answer()
    assert len(got.body) == total * len(chunk)


def test_expect_100_continue_is_answered_once_the_app_asks_for_the_body() -> None:
    """The client sends the body only after 100 Continue, as curl does (here without
    its 1 s fallback): without the interim answer the test would hang on it."""
    asked = threading.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await asyncio.sleep(0.1)
            asked.set()
            got, _ = await read_body(receive)
            await answer(send, b"got " + got)

    with serve_gateway(app) as url, Client(port_of(url)) as client:
        client.send(get("/", "Expect: 100-continue", "Content-Length: 5", method="POST"))
        interim = client.answer()
        assert asked.is_set(), "100 Continue came before the app asked for the body"
        client.send(b"hello")
        final = client.answer()
    assert interim.raw == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert (final.status, final.body) == (200, b"got hello")


def test_an_expect_request_answered_before_its_body_was_asked_for_closes() -> None:
    """The client waits for 100 Continue and may never send the body: were the connection
    kept, its next bytes would be read as that body (RFC 9110 10.1.1). The control: the
    same answer after the body was read keeps the connection."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/read":
            await read_body(receive)
        await answer(send, b"too large", status=413)

    with serve_gateway(app) as url, Client(port_of(url)) as early, \
            Client(port_of(url)) as late:
        early.send(get("/early", "Expect: 100-continue", "Content-Length: 5",
                       method="POST"))
        refused = early.answer()
        assert early.closed()
        late.send(get("/read", "Content-Length: 5", method="POST") + b"hello")
        kept = late.answer()
        assert not late.closed(within=0.2)
    assert (refused.status, refused.headers["connection"]) == (413, "close")
    assert kept.status == 413 and "connection" not in kept.headers


def test_100_continue_is_not_written_into_an_answer_already_under_way() -> None:
    """An app that starts a streamed answer before it reads the body: a 100 Continue
    then would land between the answer's chunks and break its framing."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        got, _ = await read_body(receive)
        await send({"type": "http.response.body", "body": b" then " + got})

    with serve_gateway(app) as url, Client(port_of(url)) as client:
        client.send(get("/", "Expect: 100-continue", "Content-Length: 5", method="POST"))
        head = client.until(b"\r\n\r\n")
        client.until(b"first\r\n")
        client.send(b"hello")
        rest = client.until(b"0\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert rest == b"b\r\n then hello\r\n0\r\n\r\n"


@pytest.mark.parametrize("streamed", [False, True], ids=["one message", "streamed"])
def test_head_sends_the_headers_and_no_body_and_the_connection_goes_on(
        streamed: bool) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        if streamed:
            await send({"type": "http.response.body", "body": b"hel", "more_body": True})
            await send({"type": "http.response.body", "body": b"lo"})
        else:
            await send({"type": "http.response.body", "body": b"hello"})

    with serve_gateway(app) as url, Client(port_of(url)) as client:
        client.send(get(method="HEAD"))
        head = client.answer(head_only=True)
        client.send(get())
        after = client.answer()
    if streamed:
        assert head.headers["transfer-encoding"] == "chunked"
    else:
        assert head.headers["content-length"] == "5"
    assert head.headers["content-type"] == "text/plain"
    assert after.raw.startswith(b"HTTP/1.1 200 OK\r\n"), \
        "bytes of a body came after the HEAD answer"
    assert after.body == b"hello"


@pytest.mark.parametrize("request_bytes", [
    b"NOT/HTTP\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n",
], ids=["no request line", "header without colon", "bad length"])
def test_a_malformed_request_gets_400_with_a_text_body_and_the_connection_closes(
        request_bytes: bytes) -> None:
    called = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            called.append(scope)
            await answer(send, b"ok")

    with serve_gateway(app) as url, Client(port_of(url)) as client:
        client.send(request_bytes)
        got = client.answer()
        assert client.closed()
    assert got.status == 400
    assert got.headers["content-type"].startswith("text/plain")
    assert got.headers["connection"] == "close"
    assert b"not valid HTTP/1.1" in got.body
    assert called == []


def test_a_head_over_max_head_bytes_gets_431_and_one_under_it_is_served() -> None:
    """The negative control (a big head under the limit) shows that 431 answers the
    size, not the header's shape."""
    with serve_gateway(echo_path_app()) as url:
        with Client(port_of(url)) as client:
            client.send(get("/under", "X-Big: " + "a" * (MAX_HEAD_BYTES - 100)))
            assert client.answer().body == b"/under"
        with Client(port_of(url)) as client:
            client.send(get("/over", "X-Big: " + "a" * MAX_HEAD_BYTES))
            got = client.answer()
            assert client.closed()
    assert got.status == 431, got.raw
    assert got.headers["connection"] == "close"
    assert str(MAX_HEAD_BYTES).encode() in got.body


def test_a_client_that_leaves_mid_stream_is_seen_as_http_disconnect() -> None:
    """Negative control: while the client stays, receive() keeps waiting."""
    left = threading.Event()
    said = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        said.append((await receive())["type"])  # the (empty) request body
        said.append((await receive())["type"])
        left.set()

    with serve_gateway(app) as url:
        with Client(port_of(url)) as client:
            client.send(get())
            client.until(b"data: 1\n\n")
            assert not left.wait(0.2), f"receive() returned {said} while the client stayed"
        assert left.wait(WAIT_S), "the app never heard that the client left"
    assert said == ["http.request", "http.disconnect"]


@pytest.mark.parametrize("failure", ["raises", "returns without answering"])
def test_an_app_that_fails_before_answering_gets_500_and_others_are_still_served(
        failure: str) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/fail":
            if failure == "raises":
                raise RuntimeError("the app broke")
            return
        await answer(send, b"fine")

    with serve_gateway(app) as url:
        with Client(port_of(url)) as client:
            client.send(get("/fail"))
            got = client.answer()
            assert client.closed()
        with Client(port_of(url)) as other:
            other.send(get("/other"))
            after = other.answer()
    assert (got.status, got.headers["connection"]) == (500, "close")
    assert (after.status, after.body) == (200, b"fine")


def test_http_1_0_without_keep_alive_gets_connection_close_and_the_socket_closes() -> None:
    """Negative control: an HTTP/1.0 request that asks for keep-alive keeps it."""
    with serve_gateway(echo_path_app()) as url:
        with Client(port_of(url)) as client:
            client.send(get("/kept", "Connection: keep-alive", version="1.0"))
            kept = client.answer()
            client.send(get("/closed", version="1.0"))
            closed = client.answer()
            assert client.closed()
    assert (kept.body, kept.headers["connection"]) == (b"/kept", "keep-alive")
    assert (closed.body, closed.headers["connection"]) == (b"/closed", "close")


def test_an_app_that_says_connection_close_has_it_closed_after_the_answer() -> None:
    """Negative control: the same app's answer without the header keeps the connection."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            bye = scope["path"] == "/bye"
            await answer(send, b"bye" if bye else b"stay",
                         headers=[(b"Connection", b"close")] if bye else [])

    with serve_gateway(app) as url, Client(port_of(url)) as client:
        client.send(get("/stay"))
        stay = client.answer()
        client.send(get("/bye"))
        bye = client.answer()
        assert client.closed()
    assert stay.body == b"stay" and "connection" not in stay.headers
    assert bye.body == b"bye"
    assert bye.raw.lower().count(b"\r\nconnection:") == 1
    assert bye.headers["connection"] == "close"


def test_a_keep_alive_connection_is_closed_once_idle_that_long_and_not_while_in_use(
        ) -> None:
    """One timer a connection, moved on as requests come: a client that sends a request
    every 0.6 of the idle bound keeps its connection; once it stops, it is closed."""
    with running(echo_path_app(), limits=Limits(keep_alive_s=0.5)) as (_, _, port), \
            Client(port) as client:
        for i in range(4):
            client.send(get(f"/{i}"))
            assert client.answer().body == f"/{i}".encode()
            time.sleep(0.3)
        assert client.closed(within=2.0), "an idle connection stayed open"
