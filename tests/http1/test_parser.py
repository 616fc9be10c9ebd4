"""The sans-IO request parser (`llmgw.http1._parse`) alone, as h11 is tested: bytes in,
events out, no server, socket or loop.

The hostile-input corpus the servers are held to (test_conformance.py) is fed to it
whole, a byte at a time and split at random points, and must get the servers' verdicts:
a valid vector's requests as it says them (or the RFC's refusal), an invalid one refused
with a 4xx or 5xx, or left incomplete, with no request ended. Then its limits and RFC 9112
refusals one by one, each beside its control: the same request made right passes."""

from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import Any

import pytest

from llmgw.http1 import _parse
from llmgw.http1._parse import RequestParser
from llmgw.http1.limits import Limits
from tests.http1.test_conformance import HOW, SEED, _expected, load, pieces, rfc_refusal, vectors


class Recorder:
    """The parser's events, and a reader that stops where the connection would: after a
    request that closes the connection."""

    def __init__(self) -> None:
        self.started = 0
        self.requests: list[dict[str, Any]] = []  # each head, its body and whether it ended
        self.refusal: tuple[int, str] | None = None
        self.parser: RequestParser | None = None

    def request_started(self) -> None:
        self.started += 1

    def request_head(self, method: str, version: str, path: str, raw_path: bytes,
                     query: bytes, headers: list[tuple[bytes, bytes]], keep_alive: bool,
                     expect_continue: bool, has_body: bool) -> None:
        assert self.refusal is None, "a head after the refusal"
        self.requests.append({
            "method": method, "version": version, "path": path, "raw_path": raw_path,
            "query": query, "headers": headers, "keep_alive": keep_alive,
            "expect_continue": expect_continue, "has_body": has_body, "body": b"",
            "ended": False})

    def request_body(self, data: bytes) -> None:
        assert self.refusal is None and not self.requests[-1]["ended"]
        self.requests[-1]["body"] += data

    def request_end(self) -> None:
        assert self.refusal is None
        self.requests[-1]["ended"] = True
        if not self.requests[-1]["keep_alive"]:
            assert self.parser is not None
            self.parser.stop()

    def request_refused(self, status: int, why: str) -> None:
        assert self.refusal is None, f"refused twice: {self.refusal} and {status} {why}"
        self.refusal = (status, why)

    @property
    def ended(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["ended"]]


def parse(*parts: bytes, limits: Limits | None = None) -> Recorder:
    """parts fed one by one (each its own read) to a new parser: what it told."""
    events = Recorder()
    parser = events.parser = RequestParser(events, limits or Limits())
    for part in parts:
        parser.feed(part)
    return events


def as_app_saw(request: dict[str, Any]) -> dict[str, Any]:
    """A request as test_conformance's Echo app records it."""
    return {"method": request["method"], "path": request["raw_path"].decode("latin-1"),
            "query": request["query"].decode("latin-1"), "version": request["version"],
            "headers": [(k.decode("latin-1"), v.decode("latin-1"))
                        for k, v in request["headers"]],
            "body": request["body"].decode("latin-1")}


# --- the corpus ---

@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", vectors("valid"))
def test_a_valid_vector_is_parsed_as_it_was_sent(name: str, how: str) -> None:
    data, expect, _ = load(name)
    requests = expect if isinstance(expect, list) else [expect]
    events = parse(*pieces(data, how, random.Random(f"{SEED}{name}{how}")))
    refusal = rfc_refusal(requests)
    if refusal is not None:  # the RFC's verdict, as the servers give it
        allowed, why = refusal
        assert events.refusal is not None and events.refusal[0] in allowed, (why, events.refusal)
        ended = events.ended
        assert [as_app_saw(r) for r in ended] == [_expected(r) for r in requests[:len(ended)]]
        return
    assert events.refusal is None, events.refusal
    assert [as_app_saw(r) for r in events.requests] == [_expected(r) for r in requests]
    assert len(events.ended) == len(requests)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("name", vectors("invalid"))
def test_an_invalid_vector_is_refused_or_never_ends(name: str, how: str) -> None:
    """The servers' verdict: a 4xx or 5xx, or (a request that never ends) closed when the
    client leaves; either way no request reaches the app."""
    data, _, _ = load(name)
    events = parse(*pieces(data, how, random.Random(f"{SEED}{name}{how}")))
    assert events.ended == [], f"ended: {events.ended}"
    if events.refusal is not None:
        assert 400 <= events.refusal[0] < 600, events.refusal


# --- one request, its events ---

GET = b"GET /a%20b?x=1 HTTP/1.1\r\nHost: h\r\nAccept:  */*  \r\n\r\n"


def test_a_head_gives_its_method_target_version_and_headers_stripped() -> None:
    """The same events whole and a byte at a time; the control is the split itself."""
    for events in (parse(GET), parse(*[GET[i:i + 1] for i in range(len(GET))])):
        (request,) = events.requests
        assert events.started == 1 and events.refusal is None and request["ended"]
        assert (request["method"], request["path"], request["raw_path"], request["query"],
                request["version"]) == ("GET", "/a b", b"/a%20b", b"x=1", "1.1")
        assert request["headers"] == [(b"host", b"h"), (b"accept", b"*/*")]
        assert request["keep_alive"] and not request["has_body"]


def test_a_head_part_way_in_has_started_and_not_ended() -> None:
    events = parse(GET[:10])
    assert events.started == 1 and events.requests == [] and events.refusal is None
    assert parse().started == 0, "control: nothing read, no head has started"


def test_pipelined_requests_come_out_in_order_with_their_bodies() -> None:
    post = b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
    chunked = (b"POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"2\r\nhi\r\n0\r\n\r\n")
    events = parse(post + chunked + GET)
    assert [(r["raw_path"], r["body"], r["ended"]) for r in events.requests] == [
        (b"/p", b"abc", True), (b"/c", b"hi", True), (b"/a%20b", b"", True)]
    assert events.started == 3


def test_stop_at_a_request_end_leaves_what_is_behind_it_unread() -> None:
    """A reader that stops at a request's end (the connection closes after it): the
    request behind it in the same read is never parsed. Control: kept alive, it is."""
    closing = b"GET /first HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    events = parse(closing + GET)
    assert [r["raw_path"] for r in events.requests] == [b"/first"]
    events = parse(closing.replace(b"close", b"keep-alive") + GET)
    assert [r["raw_path"] for r in events.requests] == [b"/first", b"/a%20b"]


def test_nothing_is_read_after_a_refusal() -> None:
    events = parse(b"GET / HTTP/1.1\r\n\r\n", GET)
    assert events.refusal is not None and events.refusal[0] == 400
    assert events.requests == []
    assert parse(GET, GET).requests[1]["ended"], "control: the same read after a good one"


# --- limits, counted as it reads ---

def head_of(size: int) -> bytes:
    """A GET whose head is exactly size bytes."""
    start = b"GET / HTTP/1.1\r\nHost: h\r\nX: "
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


@pytest.mark.parametrize("over", [0, 1])
def test_a_head_over_max_head_bytes_is_431(over: int) -> None:
    events = parse(head_of(200 + over), limits=Limits(max_head_bytes=200))
    assert (events.refusal or (0,))[0] == (431 if over else 0)
    assert len(events.ended) == (0 if over else 1)


def test_a_line_that_never_ends_is_read_no_further_than_the_limit() -> None:
    """The parser holds at most max_head_bytes of a head: the rest of a 1 MB line is not
    fed on, and it is refused once the limit is reached. Control: under the limit it waits."""
    limits = Limits(max_head_bytes=1000)
    events = Recorder()
    parser = events.parser = RequestParser(events, limits)
    parser.feed(b"GET /" + b"a" * 900)
    assert events.refusal is None and parser.head_bytes == 905
    parser.feed(b"a" * (1 << 20))
    assert events.refusal is not None and events.refusal[0] == 431
    assert parser.head_bytes == 1000


@pytest.mark.parametrize("count, status", [(10, 0), (11, 431)])
def test_the_header_count_limit(count: int, status: int) -> None:
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(count - 1))
    events = parse(b"GET / HTTP/1.1\r\nHost: h\r\n" + fields + b"\r\n",
                   limits=Limits(max_headers=10))
    assert (events.refusal or (0,))[0] == status


@pytest.mark.parametrize("length, status", [(100, 0), (101, 413)])
def test_a_content_length_over_the_body_limit_is_413_at_the_head(length: int,
                                                                 status: int) -> None:
    events = parse(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % length,
                   limits=Limits(max_body_bytes=100))
    assert (events.refusal or (0,))[0] == status
    assert len(events.requests) == (0 if status else 1)


@pytest.mark.parametrize("reads", ["one", "head, body", "a read a chunk"])
def test_chunk_framing_counts_toward_the_body_limit(reads: str) -> None:
    """60 body bytes fit a 100-byte limit in one chunk (71 bytes on the wire) and not in
    sixty (360): raw bytes are counted, framing included, whether the body comes in the
    head's read, in one of its own or over many."""
    head = b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
    one = [b"3c\r\n" + b"x" * 60 + b"\r\n", b"0\r\n\r\n"]
    many = [b"1\r\nx\r\n"] * 60 + [b"0\r\n\r\n"]
    limits = Limits(max_body_bytes=100)
    for chunks, status in ((one, 0), (many, 413)):
        body = b"".join(chunks)
        parts = {"one": [head + body], "head, body": [head, body],
                 "a read a chunk": [head, *chunks]}[reads]
        events = parse(*parts, limits=limits)
        assert (events.refusal or (0,))[0] == status, body[:20]
        assert len(events.ended) == (0 if status else 1)


def test_body_counters_are_what_the_connection_rates() -> None:
    events = Recorder()
    parser = events.parser = RequestParser(events, Limits())
    head = b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\n"
    parser.feed(head + b"12345")
    assert (parser.received, parser.body_seen, parser.length) == (len(head) + 5, 5, 10)
    assert not parser.reading_head
    parser.feed(b"67890")
    assert parser.body_seen == 10 and parser.reading_head and events.ended


# --- what RFC 9112 refuses ---

@pytest.mark.parametrize("head, status", [
    (b"GET /a HTTP/1.1\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nHost: x y\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n", 0),
    (b"GET /a HTTP/1.0\r\n\r\n", 0),
    (b"GET /a HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    (b"CONNECT h:443 HTTP/1.1\r\nHost: h\r\n\r\n", 501),
    (b"GET * HTTP/1.1\r\nHost: h\r\n\r\n", 400),
    (b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n", 0),
])
def test_host_version_method_and_target_rules(head: bytes, status: int) -> None:
    events = parse(head)
    assert (events.refusal or (0,))[0] == status
    assert len(events.ended) == (0 if status else 1)


@pytest.mark.parametrize("coding, status", [
    (b"gzip, chunked", 501), (b"chunked, gzip", 400), (b"chunked, chunked", 400),
    (b"gzip", 400), (b"chunked", 0),
])
def test_a_transfer_coding_other_than_chunked_alone_is_refused(coding: bytes,
                                                               status: int) -> None:
    events = parse(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding
                   + b"\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
    assert (events.refusal or (0,))[0] == status


@pytest.mark.parametrize("version, kept", [(b"1.0", False), (b"1.1", True)])
def test_http_1_0_with_a_chunked_body_is_read_and_not_kept_alive(version: bytes,
                                                                 kept: bool) -> None:
    events = parse(b"POST /a HTTP/" + version + b"\r\nHost: x\r\nConnection: keep-alive\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
    (request,) = events.requests
    assert request["body"] == b"hi" and request["ended"] and request["keep_alive"] is kept


def test_expect_100_continue_is_told_with_the_head() -> None:
    head = b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n"
    assert parse(head + b"Expect: 100-continue\r\n\r\n").requests[0]["expect_continue"]
    assert not parse(head + b"\r\n").requests[0]["expect_continue"]


# --- sans-IO ---

def _imports(module: Any) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    return {alias.name.split(".")[0] for node in ast.walk(tree)
            if isinstance(node, ast.Import) for alias in node.names} | {
        (node.module or "").split(".")[0] for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)}


IO = {"asyncio", "socket", "ssl", "time", "selectors", "threading", "os"}


def test_the_parser_imports_no_io_loop_or_clock() -> None:
    """Control: the connection module, which does I/O, is caught by the same check."""
    from llmgw.http1 import _conn
    assert _imports(_parse) & IO == set()
    assert _imports(_conn) & IO
