"""The gateway's one driver of forwarded requests (the Forwarder, the server's fast handler)
against real loopback servers: it takes every forwarded POST and the app none; each step
runs once; a replica's failure, a silence, a client that leaves or is slow to read, a
large body, 100-continue and a drain each end as they should."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client import CollectorRegistry

from llmgw.config import ServerConfig
from llmgw.control.admin_api import KeyRequest, create_key
from llmgw.gateway import _replica_conn
from llmgw.gateway._forward import Forwarder
from llmgw.gateway._upstream import Timeouts, Upstream
from llmgw.gateway.app import Gateway, make_gateway_app
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.host.netaddr import free_port
from llmgw.http1.server import Http1Server
from llmgw.store import Store
from tests.gateway.test_gateway import CHAT, EMBED, MODEL, json_answer, ready
from tests.servers import raw_server, run_in_thread, scripted_upstream, serve_gateway

# One step of a scripted answer: wait this long, then send these bytes (HANG_UP: close).
Step = tuple[float, bytes]
HANG_UP = b""


def whole(body: bytes, extra: bytes = b"") -> list[Step]:
    return [(0.0, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
             + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)]


@contextmanager
def raw_replica(script: Callable[[int, bytes], Iterable[Step] | None]
                ) -> Iterator[tuple[str, list[bytes]]]:
    """A replica that reads each POST on each connection and answers the nth (from 0,
    counted over all connections) with script(n, body)'s steps, byte for byte; None hangs up
    without a byte, a step of HANG_UP after what came before. GET /slots is answered 404
    (slots unknown)."""
    seen: list[bytes] = []

    def read_request(f) -> tuple[bytes, bytes] | None:  # type: ignore[no-untyped-def]
        line = f.readline()
        if not line:
            return None
        length = 0
        while (header := f.readline()) not in (b"\r\n", b""):
            if header.lower().startswith(b"content-length:"):
                length = int(header.split(b":")[1])
        return line, f.read(length)

    def connection(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            while (request := read_request(f)) is not None:
                line, body = request
                if line.startswith(b"GET"):
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                seen.append(body)
                steps = script(len(seen) - 1, body)
                if steps is None:
                    return
                for delay, data in steps:
                    time.sleep(delay)
                    if data == HANG_UP:
                        return
                    conn.sendall(data)

    with raw_server(connection) as endpoint:
        yield endpoint, seen


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:
    s = Store(tmp_path / "control.db")
    s.add_model(MODEL)
    s.add_model(EMBED)
    yield s
    s.close()


@contextmanager
def forward_gateway(store: Store, timeouts: Timeouts | None = None, **options: object
                    ) -> Iterator[tuple[httpx.Client, Forwarder, Gateway]]:
    """A gateway served as `llmgw gateway` serves it, its client, its Forwarder (how many
    requests it took) and the app."""
    app = make_gateway_app(store, ServerConfig(**options), upstream=Upstream(timeouts),  # type: ignore[arg-type]
                           metrics=GatewayMetrics(CollectorRegistry()))
    forwarder = Forwarder(app)
    with serve_gateway(app, fast=forwarder) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        yield client, forwarder, app


def test_every_forwarded_post_is_the_forwarders_and_everything_else_the_apps(store) -> None:
    """The Forwarder takes each POST to a forwarded route (answers and errors alike, the
    first, which opens the replica's connection, too); the app answers the rest."""
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        with forward_gateway(store) as (gw, forwarder, _):
            codes = [gw.post("/v1/chat/completions", json={**CHAT, "model": "tiny-chat"}
                             ).status_code for _ in range(3)]
            codes.append(gw.post("/v1/chat/completions", content=b"{not json").status_code)
            answer = gw.post("/v1/completions", json=CHAT).json()
            codes += [gw.get("/v1/models").status_code,
                      gw.get("/v1/chat/completions").status_code]
    assert codes == [200, 200, 200, 400, 200, 405]
    assert forwarder.taken == 5 and answer["model"] == "tiny"


def test_negative_control_the_app_alone_forwards_nothing(store) -> None:
    """Served without its Forwarder, the app is no second driver: a forwarded POST is a 500
    that names the fix, and nothing reaches the replica."""
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        app = make_gateway_app(store, upstream=Upstream())
        port = free_port()
        server = Http1Server(app, f"127.0.0.1:{port}", drain_s=1.0)
        thread = run_in_thread(server)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as gw:
                r = gw.post("/v1/chat/completions", json=CHAT)
        finally:
            server.should_exit = True
            thread.join(10)
        assert up.seen == []
    assert r.status_code == 500 and "fast=Forwarder(app)" in r.json()["error"]["message"]


def test_a_key_with_limits_spends_its_minute_once_a_request(store) -> None:
    """rpm 2: two answers, then the 429, written at once; were a step of a request run
    twice (a second driver taking over part-way), the second would be refused."""
    made = create_key(store, KeyRequest(name="ci", rpm=2))["key"]
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        with forward_gateway(store) as (gw, forwarder, _):
            codes = [gw.post("/v1/chat/completions", json=CHAT,
                             headers={"Authorization": f"Bearer {made}"}).status_code
                     for _ in range(3)]
    assert codes == [200, 200, 429] and forwarder.taken == 3


def test_a_pooled_connection_the_replica_closed_is_sent_once_more_then_502(store) -> None:
    """The second request met a pooled connection the replica had closed (no byte came):
    it is sent once on a new connection; the replica, which hangs up on that and on the
    third request too (on a new connection: not sent again), gets the 502s."""
    def script(n: int, body: bytes) -> list[Step] | None:
        return whole(json_answer()) if n == 0 else None

    with raw_replica(script) as (endpoint, seen):
        ready(store, "r1", endpoint)
        with forward_gateway(store) as (gw, _, app):
            codes = [gw.post("/v1/chat/completions", json=CHAT).status_code
                     for _ in range(2)]
            message = gw.post("/v1/chat/completions", json=CHAT).json()
            in_flight = app.balancer.loads["r1"].in_flight
    assert codes == [200, 502] and len(seen) == 4 and in_flight == 0
    assert "closed the connection without an answer" in message["error"]["message"]


def test_a_replica_that_breaks_off_its_answer_is_502_and_not_resent(store) -> None:
    """A 502 in OpenAI's shape, and the request is not sent again."""
    def script(n: int, body: bytes) -> list[Step] | None:
        if n == 0:
            return whole(json_answer())
        answer = whole(json_answer())[0][1]
        return [(0.0, answer[:-10]), (0.0, HANG_UP)]

    with raw_replica(lambda n, b: script(n, b) if n < 2 else whole(json_answer())) as \
            (endpoint, seen):
        ready(store, "r1", endpoint)
        with forward_gateway(store) as (gw, forwarder, app):
            first = gw.post("/v1/chat/completions", json=CHAT)
            broken = gw.post("/v1/chat/completions", json=CHAT)
            again = [gw.post("/v1/chat/completions", json=CHAT).status_code for _ in range(2)]
    assert first.status_code == 200 and broken.status_code == 502
    assert broken.json()["error"]["code"] == "replica_failed"
    assert "broke off its answer" in broken.json()["error"]["message"]
    # The broken one once; the next opens a new connection.
    assert len(seen) == 4 and forwarder.taken == 4
    assert again == [200, 200]
    assert app.balancer.loads["r1"].in_flight == 0


def test_the_read_timeout_counts_silence_not_the_whole_answer(store) -> None:
    """read_s (upstream_read_timeout_s) ends a replica silent that long with a 502 naming
    it; one that keeps sending, slower than read_s in all, is waited for."""
    answer = whole(json_answer())[0][1]

    def script(n: int, body: bytes) -> list[Step] | None:
        if n == 1:  # trickles: 1.2 s in all, never 0.5 s without a byte
            step = len(answer) // 4 + 1
            return [(0.3, answer[i:i + step]) for i in range(0, len(answer), step)]
        if n == 2:  # its head and a little of its body, then silence
            cut = answer.index(b"\r\n\r\n") + 6
            return [(0.0, answer[:cut]), (1.5, answer[cut:])]
        if n == 4:  # silent from the start
            return [(1.5, answer)]
        return whole(json_answer())

    with raw_replica(script) as (endpoint, seen):
        ready(store, "r1", endpoint)
        with forward_gateway(store, Timeouts(connect_s=1.0, read_s=0.5)) as (gw, _, _):
            codes = []
            messages = []
            for _ in range(5):
                r = gw.post("/v1/chat/completions", json=CHAT)
                codes.append(r.status_code)
                messages.append(r.json().get("error", {}).get("message", ""))
    assert codes == [200, 200, 502, 200, 502], messages
    assert "sent nothing for 0.5 s (upstream_read_timeout_s" in messages[2]
    assert "sent no answer within 0.5 s (upstream_read_timeout_s" in messages[4]


def test_pipelined_requests_are_answered_in_order(store) -> None:
    """Three requests in one write, each answered in turn with its own content."""
    def script(n: int, body: bytes) -> list[Step] | None:
        return whole(json_answer(content=json.loads(body)["messages"][0]["content"]))

    with raw_replica(script) as (endpoint, _):
        ready(store, "r1", endpoint)
        with forward_gateway(store) as (gw, forwarder, _):
            gw.post("/v1/chat/completions", json=CHAT)  # the connection to the replica
            port = int(str(gw.base_url).rsplit(":", 1)[1].rstrip("/"))
            requests = b""
            for word in (b"one", b"two", b"three"):
                body = json.dumps({**CHAT, "messages": [{"role": "user",
                                                         "content": word.decode()}]}).encode()
                requests += (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(requests)
                got = b""
                while got.count(b"HTTP/1.1 200") < 3 or not got.endswith(b"}"):
                    got += s.recv(65536)
    order = [got.index(word) for word in (b'"one"', b'"two"', b'"three"')]
    assert order == sorted(order) and forwarder.taken == 4


def test_a_client_that_leaves_ends_nothing_but_its_answer(store) -> None:
    """The client hangs up while its request is at the replica: the answer is dropped, the
    lease ends, and the next request is answered."""
    def script(n: int, body: bytes) -> list[Step] | None:
        return [(0.5 if n == 1 else 0.0, whole(json_answer())[0][1])]

    with raw_replica(script) as (endpoint, seen):
        ready(store, "r1", endpoint)
        with forward_gateway(store) as (gw, forwarder, app):
            gw.post("/v1/chat/completions", json=CHAT)
            with pytest.raises(httpx.ReadTimeout):
                gw.post("/v1/chat/completions", json=CHAT, timeout=0.2)
            time.sleep(0.6)
            after = gw.post("/v1/chat/completions", json=CHAT).status_code
            in_flight = app.balancer.loads["r1"].in_flight
    assert after == 200 and len(seen) == 3 and forwarder.taken == 3
    assert in_flight == 0


def test_a_drain_answers_a_forwarded_request_and_closes(store) -> None:
    """The server told to stop while a request is at the replica: its answer comes whole,
    with Connection: close."""
    def script(n: int, body: bytes) -> list[Step] | None:
        return [(0.5 if n == 1 else 0.0, whole(json_answer())[0][1])]

    with raw_replica(script) as (endpoint, _):
        ready(store, "r1", endpoint)
        app = make_gateway_app(store, upstream=Upstream())
        forwarder = Forwarder(app)
        port = free_port()
        server = Http1Server(app, f"127.0.0.1:{port}", drain_s=5.0, fast=forwarder)
        thread = run_in_thread(server)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as gw:
            gw.post("/v1/chat/completions", json=CHAT)
            result: list[httpx.Response] = []
            caller = threading.Thread(target=lambda: result.append(
                gw.post("/v1/chat/completions", json=CHAT)))
            caller.start()
            time.sleep(0.2)
            server.should_exit = True
            caller.join(10)
        thread.join(10)
    assert result and result[0].status_code == 200
    assert result[0].headers["connection"] == "close" and forwarder.taken == 2


def test_usage_and_metrics_count_forwarded_answers(store) -> None:
    """A key's usage reaches the store and the request counts reach /metrics, from answers
    the Forwarder relayed."""
    made = create_key(store, KeyRequest(name="ci"))["key"]
    registry = CollectorRegistry()
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        app = make_gateway_app(store, upstream=Upstream(),
                               metrics=GatewayMetrics(registry), usage_flush_s=0.2)
        forwarder = Forwarder(app)
        with serve_gateway(app, fast=forwarder) as url, httpx.Client(base_url=url) as gw:
            for _ in range(4):
                gw.post("/v1/chat/completions", json=CHAT,
                        headers={"Authorization": f"Bearer {made}"}).raise_for_status()
            time.sleep(0.6)
    assert forwarder.taken == 4
    (stored,) = store.keys()
    assert (stored["requests"], stored["prompt_tokens"], stored["completion_tokens"]) == \
        (4, 12, 20)
    count = registry.get_sample_value("llmgw_gateway_requests_total",
                                      {"model": "tiny", "status": "200", "key": "ci"})
    assert count == 4
    assert registry.get_sample_value("llmgw_gateway_requests_in_flight") == 0


EVENT = b"data: " + json.dumps({"model": "m", "choices": [{"delta": {"content": "x" * 65000}}]}
                              ).encode() + b"\n\n"


@pytest.mark.parametrize("lifted", [False, True], ids=["slow-client", "control-no-read-ahead"])
def test_a_stream_whose_client_does_not_read_holds_the_replica_back(
        store, monkeypatch, lifted) -> None:
    """A client that stops reading a stream: once the gateway's socket to it is full, the
    Forwarder stops taking the replica's events, the replica's connection stops reading at
    READ_AHEAD_BYTES, and the replica waits (what it sent stays far short of the stream).
    Read on, the client gets every event. The control lifts the read-ahead bound: the
    gateway then reads the whole stream while the client sleeps."""
    if lifted:
        monkeypatch.setattr(_replica_conn, "READ_AHEAD_BYTES", 1 << 40)
    events = 768  # 48 MiB
    sent = [0]

    def stream(n: int, body: bytes) -> Iterator[Step]:
        if not json.loads(body).get("stream"):
            yield from whole(json_answer())
            return
        yield (0.0, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
        for _ in range(events):
            yield (0.0, chunk)
            sent[0] += 1
        yield (0.0, b"0\r\n\r\n")

    with raw_replica(stream) as (endpoint, _):
        ready(store, "r1", endpoint)
        with forward_gateway(store) as (gw, _, app):
            port = int(str(gw.base_url).rsplit(":", 1)[1].rstrip("/"))
            body = json.dumps({**CHAT, "stream": True}).encode()
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
                s.settimeout(30)
                s.connect(("127.0.0.1", port))
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\n\r\n" + body)
                parts = [s.recv(1 << 16)]
                time.sleep(1.5)
                while_asleep = sent[0]
                while not (parts[-1] or b"0\r\n\r\n").endswith(b"0\r\n\r\n"):
                    parts.append(s.recv(1 << 20))
            in_flight = app.balancer.loads["r1"].in_flight
    print(f"{while_asleep} of {events} events sent while the client slept")
    assert b"".join(parts).count(b'"choices"') == events and in_flight == 0
    if lifted:
        assert while_asleep == events
    else:
        assert while_asleep < events // 2, f"{while_asleep} of {events} events sent"


def test_a_large_body_and_one_sent_after_100_continue_are_forwarded_too(store) -> None:
    """A body past the server's read-ahead, and a client that waits for 100 Continue, are
    the Forwarder's as any other (the app would answer them 500): the body reaches the
    replica whole. The control: past gateway_max_body_bytes, the 413."""
    def script(n: int, body: bytes) -> list[Step] | None:
        return whole(json_answer(content=str(len(body))))

    big = {**CHAT, "messages": [{"role": "user", "content": "y" * (600 << 10)}]}
    large_body, body = json.dumps(big).encode(), json.dumps(CHAT).encode()
    with raw_replica(script) as (endpoint, seen):
        ready(store, "r1", endpoint)
        with forward_gateway(store, gateway_max_body_bytes=1 << 20) as (gw, forwarder, _):
            large = gw.post("/v1/chat/completions", content=large_body)
            over = gw.post("/v1/chat/completions", json={**big, "pad": "z" * (1 << 20)})
            port = int(str(gw.base_url).rsplit(":", 1)[1].rstrip("/"))
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: "
                          b"100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
                told = s.recv(1 << 16)
                s.sendall(body)
                answer = b""
                while not answer.endswith(b"}"):
                    answer += s.recv(1 << 16)
    assert large.status_code == 200 and seen[0] == large_body
    assert over.status_code == 413
    assert told == b"HTTP/1.1 100 Continue\r\n\r\n" and answer.startswith(b"HTTP/1.1 200")
    assert seen[1] == body and forwarder.taken == 3
