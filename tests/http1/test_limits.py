"""Each limit and deadline of the HTTP core (`Limits`), against a real Http1Server on
loopback, with its negative control: the same client with the limit raised gets through
(or stays open). Deadlines are set short in each test's own Limits; a close is waited for
MARGIN_S past its deadline, since the machine is shared and a timer fires late when the
loop is busy."""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack
from typing import Any

import pytest

from llmgw.config import ConfigError, ServerConfig, parse
from llmgw.gateway.dataplane import BODY_FRAMING_SLACK_BYTES, gateway_limits
from llmgw.http1.limits import Limits
from tests.http1.servers import running, wait_for
from tests.http1.wire import Client, answer, get, read_body

MARGIN_S = 4.0
SHORT_S = 1.0
LONG_S = 60.0


class Counting:
    """An app that answers each request with its body's length, and counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.calls += 1
        body, _ = await read_body(receive)
        await answer(send, b"%d" % len(body))


def closed_within(client: Client, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if client.closed(within=max(deadline - time.monotonic(), 0.05)):
            return True
    return False


# --- sizes ---

@pytest.mark.parametrize("limit, status", [(4096, 431), (1 << 20, 200)])
def test_whitespace_before_a_value_counts_toward_the_head_limit(limit: int, status: int) -> None:
    """8 KiB of blanks before a short value: 431 under a 4 KiB head limit, counted on the
    raw bytes; with the limit raised (the control) the request is served."""
    app = Counting()
    with running(app, limits=Limits(max_head_bytes=limit)) as (_, _, port), \
            Client(port) as client:
        client.send(get("/", "X-Pad:" + " " * 8192 + "v"))
        assert client.answer().status == status
    assert app.calls == (status == 200)


def test_a_header_line_that_never_ends_is_cut_at_the_limit() -> None:
    """A header value sent without its line's end, well past the limit: 431 and closed
    while the client is still sending, not buffered whole."""
    app = Counting()
    with running(app, limits=Limits(max_head_bytes=4096)) as (_, _, port), \
            Client(port) as client:
        client.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: ")
        sent, refused = 0, None
        while sent < 8 << 20 and refused is None:
            try:
                client.send(b"v" * 65536)
                sent += 65536
            except (BrokenPipeError, ConnectionResetError) as e:
                refused = e
        assert sent < 8 << 20, "8 MiB of one header line taken without an answer"
    assert app.calls == 0


@pytest.mark.parametrize("limit, status", [(20, 431), (200, 200)])
def test_the_header_count_limit(limit: int, status: int) -> None:
    with running(Counting(), limits=Limits(max_headers=limit)) as (_, _, port), \
            Client(port) as client:
        client.send(get("/", *[f"X-{i}: v" for i in range(50)]))
        assert client.answer().status == status


def chunked_with_extensions(data: bytes, extension_bytes: int) -> bytes:
    ext = b";x=" + b"e" * extension_bytes
    return (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"%x%s\r\n%s\r\n0\r\nX-Trailer: %s\r\n\r\n" % (len(data), ext, data,
                                                           b"t" * extension_bytes))


@pytest.mark.parametrize("limit, status", [(16 << 10, 413), (1 << 20, 200)])
def test_chunk_extensions_and_trailers_count_toward_the_body_limit(limit: int,
                                                                   status: int) -> None:
    """100 bytes of data framed by 20 KiB of chunk extension and a 20 KiB trailer: 413
    under a 16 KiB body limit; with it raised the app gets the 100 bytes."""
    app = Counting()
    with running(app, limits=Limits(max_body_bytes=limit, max_head_bytes=1 << 20,
                                    max_chunk_line_bytes=1 << 20)) as \
            (_, _, port), Client(port) as client:
        client.send(chunked_with_extensions(b"d" * 100, 20 << 10))
        got = client.answer()
    assert got.status == status
    if status == 200:
        assert got.body == b"100"


CHUNKED_HEAD = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


def _send_all(client: Client, *parts: bytes) -> None:
    """parts, each its own write; a server that refused and closed stops the rest."""
    try:
        for part in parts:
            client.send(part)
    except (BrokenPipeError, ConnectionResetError):
        pass


# "64;x=" and CRLF are 7 bytes of the line: 16377 bytes of extension make it 16 KiB.
@pytest.mark.parametrize("extension, status", [(1 << 20, 400), ((16 << 10) - 6, 400),
                                               (100, 200), ((16 << 10) - 7, 200)])
def test_a_chunk_size_line_is_bounded_whole_extensions_included(extension: int,
                                                                status: int) -> None:
    """A chunk-size line of 1 MiB (its extension) is 400, as h11 refuses it, though the whole
    body is far under the 16 MiB body limit (it was served); the line is bounded whole at
    16 KiB, size and CRLF included. The control: an ordinary extension, and a line of just
    16 KiB, are served."""
    app = Counting()
    line = b"64;x=" + b"e" * extension + b"\r\n"
    with running(app) as (_, _, port), Client(port) as client:
        _send_all(client, CHUNKED_HEAD + line + b"d" * 100 + b"\r\n0\r\n\r\n")
        got = client.answer()
    assert got.status == status, (len(line), got.status, got.body[:200])
    if status == 200:
        assert got.body == b"100"
    else:
        assert b"chunk-size line (extensions included) of the chunked body is over 16384 " \
            b"bytes" in got.body, got.body


def test_a_chunk_size_line_that_never_ends_is_refused_as_it_arrives() -> None:
    """An extension sent 1 KiB a write and never ended by CRLF is refused once 16 KiB are in:
    the server does not wait for the line's end to count it."""
    app = Counting()
    with running(app) as (_, _, port), Client(port) as client:
        _send_all(client, CHUNKED_HEAD, b"1;x=")
        for _ in range(40):
            _send_all(client, b"e" * 1024)
            time.sleep(0.005)
        got = client.answer()
    assert got.status == 400, got.body


@pytest.mark.parametrize("trailer, status", [(1 << 20, 400), (100, 200)])
def test_a_trailer_field_is_bounded_as_a_chunk_line_is(trailer: int, status: int) -> None:
    """A 1 MiB trailer field is 400; the control: a short one is served."""
    app = Counting()
    with running(app) as (_, _, port), Client(port) as client:
        _send_all(client, CHUNKED_HEAD + b"3\r\nabc\r\n0\r\nX-T: " + b"t" * trailer
                  + b"\r\n\r\n")
        got = client.answer()
    assert got.status == status, got.body[:200]


def test_pipelined_requests_behind_a_chunked_body_are_each_served() -> None:
    """Framing lines are found across chunk data that holds CRLFs and newlines, and the
    request behind a chunked body is read as a head (the count stops at the body's end)."""
    app = Counting()
    data = b"a\r\nb\nc" * 3000  # 18000 bytes: newlines that are no framing
    body = b"%x\r\n%s\r\n5;k=v\r\nhello\r\n0\r\n\r\n" % (len(data), data)
    with running(app) as (_, _, port), Client(port) as client:
        client.send(CHUNKED_HEAD + body + CHUNKED_HEAD + body)
        first, second = client.answer(), client.answer()
    assert (first.status, first.body) == (200, b"18005")
    assert (second.status, second.body) == (200, b"18005")


@pytest.mark.parametrize("limit, status", [(256 << 10, 413), (4 << 20, 200)])
def test_chunk_extensions_over_many_reads_count_toward_the_body_limit(limit: int,
                                                                      status: int) -> None:
    """One-byte chunks each framed by a 4 KiB extension, sent over many reads: 1 MiB of
    framing around 256 bytes of data is 413 under a 256 KiB limit; raised, it is served."""
    app = Counting()
    ext = b";x=" + b"e" * 4096
    with running(app, limits=Limits(max_body_bytes=limit)) as (_, _, port), \
            Client(port) as client:
        client.send(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for i in range(256):
                client.send(b"1%s\r\nd\r\n" % ext)
                if i % 32 == 0:
                    time.sleep(0.01)  # separate reads
            client.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = client.answer()
    assert got.status == status
    if status == 200:
        assert got.body == b"256"


def test_a_content_length_over_the_body_limit_is_413_before_the_body() -> None:
    app = Counting()
    with running(app, limits=Limits(max_body_bytes=1000)) as (_, _, port), \
            Client(port) as client:
        client.send(get("/", "Content-Length: 1001", method="POST"))
        assert client.answer().status == 413
    assert app.calls == 0


# --- deadlines ---

def test_200_heads_sent_a_byte_at_a_time_are_each_closed_while_a_client_is_answered() -> None:
    """200 connections trickle a head one byte at a time and never end it: each is closed
    by the head deadline (408) within its margin, and a normal client is answered
    meanwhile; the control (the deadline raised) holds all 200 open."""
    for deadline_s, cut in ((SHORT_S, True), (LONG_S, False)):
        app = Counting()
        with running(app, limits=Limits(head_timeout_s=deadline_s)) as (server, _, port), \
                ExitStack() as stack:
            socks = [stack.enter_context(socket.create_connection(("127.0.0.1", port)))
                     for _ in range(200)]
            head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: "
            for i in range(6):  # bytes keep coming: the deadline is the head's, not idle
                for sock in socks:
                    sock.send(head[i:i + 1])
                time.sleep(0.1)
            with Client(port) as normal:
                normal.send(get("/"))
                assert normal.answer().status == 200
            time.sleep(deadline_s + MARGIN_S if cut else SHORT_S + MARGIN_S)
            open_now = len(server.connections)
        assert app.calls == 1
        if cut:
            assert open_now == 0, f"{open_now} of 200 trickled heads still open"
        else:
            assert open_now == 200, f"the control lost {200 - open_now} connections"


@pytest.mark.parametrize("window_s, cut", [(SHORT_S, True), (LONG_S, False)])
def test_a_body_slower_than_the_minimum_rate_is_closed(window_s: float, cut: bool) -> None:
    """Content-Length: 100000, then ten bytes: at 1024 bytes/s over a 1 s window the body
    is cut (408); over a 60 s window (the control) it is still being waited for."""
    app = Counting()
    limits = Limits(body_min_rate=1024, body_window_s=window_s)
    with running(app, limits=limits) as (_, _, port), Client(port) as client:
        client.send(get("/", "Content-Length: 100000", method="POST") + b"0123456789")
        assert closed_within(client, SHORT_S + MARGIN_S) == cut
        if cut:
            assert client.buffer.startswith(b"HTTP/1.1 408 "), client.buffer[:200]


def streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> Any:
    async def run() -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(2000):  # bounded: 128 MiB at most
            await send({"type": "http.response.body", "body": b"s" * 65536,
                        "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    return run()


@pytest.mark.parametrize("write_s, let_go", [(SHORT_S, True), (LONG_S, False)])
def test_a_client_that_stops_reading_a_stream_is_let_go_by_the_write_deadline(
        write_s: float, let_go: bool) -> None:
    """A 4 KiB receive buffer and no reads: the write deadline lets the client go (its
    connection gone from the server's) within its margin; raised, it is still held."""
    with running(streaming_app, limits=Limits(write_timeout_s=write_s)) as (server, _, port), \
            Client(port, receive_buffer=4096) as client:
        client.send(get("/"))
        wait_for(lambda: len(server.connections) == 1, "the stream began")
        time.sleep(SHORT_S + MARGIN_S)
        assert (len(server.connections) == 0) == let_go


@pytest.mark.parametrize("keep_s, cut", [(SHORT_S, True), (LONG_S, False)])
def test_an_idle_keep_alive_connection_is_closed_after_keep_alive_s(keep_s: float,
                                                                    cut: bool) -> None:
    with running(Counting(), limits=Limits(keep_alive_s=keep_s)) as (_, _, port), \
            Client(port) as client:
        client.send(get("/"))
        assert client.answer().status == 200
        assert closed_within(client, SHORT_S + MARGIN_S) == cut


# --- server.yaml ---

def test_gateway_http_reaches_the_gateway_with_room_for_framing() -> None:
    """The gateway's core limit on a body leaves BODY_FRAMING_SLACK_BYTES above its own
    gateway_max_body_bytes (so a body just under it is refused in the gateway's words),
    unless gateway_http.max_body_bytes is set."""
    config = parse(ServerConfig, {"gateway_max_body_bytes": 1000,
                                  "gateway_http": {"head_timeout_s": 2.5}}, "server.yaml")
    limits = gateway_limits(config)
    assert limits.head_timeout_s == 2.5
    assert limits.max_body_bytes == max(Limits().max_body_bytes,
                                        1000 + BODY_FRAMING_SLACK_BYTES)
    big = parse(ServerConfig, {"gateway_max_body_bytes": 64 << 20}, "server.yaml")
    assert gateway_limits(big).max_body_bytes == (64 << 20) + BODY_FRAMING_SLACK_BYTES
    given = parse(ServerConfig, {"gateway_http": {"max_body_bytes": 5000}}, "server.yaml")
    assert gateway_limits(given).max_body_bytes == 5000


def test_the_agent_api_keeps_idle_agents_longer_than_a_heartbeat() -> None:
    assert ServerConfig().agent_http.keep_alive_s == 120.0
    assert ServerConfig().gateway_http.keep_alive_s == Limits().keep_alive_s


@pytest.mark.parametrize("section, key, value", [
    ("gateway_http", "head_timeout_s", 0), ("agent_http", "max_headers", -1),
    ("gateway_http", "max_head_byte", 10),
])
def test_a_bad_limit_in_server_yaml_is_refused_naming_the_key(section: str, key: str,
                                                              value: int) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.{key} (is|is not)"):
        parse(ServerConfig, {section: {key: value}}, "server.yaml")

