"""Http1Server, the gateway's listener, against raw sockets on loopback: keep-alive,
pipelining, streams, bodies, Expect: 100-continue, HEAD, refusals, a client that leaves,
an app that fails, the drain, the lifespan, and the fast handler (`fast=`)."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw import pki
from llmgw._http1 import BODY_READ_AHEAD_BYTES, IDLE_DRAIN_S, MAX_HEAD_BYTES, Http1Server
from llmgw._http1_limits import Limits
from llmgw.netaddr import free_port
from tests.control.servers import events_released_by, run_in_thread, serve_gateway
from tests.http1.wire import WAIT_S, Client, answer, get, read_body


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


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.01)


@contextmanager
def running(app: Any, drain_s: float = 5.0, certfile: str = "", keyfile: str = "",
            fast: Any = None, limits: Limits | None = None
            ) -> Iterator[tuple[Http1Server, threading.Thread, int]]:
    """app under an Http1Server in a thread: the server (to stop it), its thread and port."""
    port = free_port()
    server = Http1Server(app, f"127.0.0.1:{port}", drain_s=drain_s, certfile=certfile,
                         keyfile=keyfile, fast=fast, limits=limits or Limits())
    thread = run_in_thread(server)
    try:
        yield server, thread, port
    finally:
        server.should_exit = True
        thread.join(WAIT_S + drain_s)


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


# --- the fast handler (fast=): what the gateway's Forwarder is offered ---


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
