"""The gateway's fast path against real loopback servers: what it takes it answers as the
coroutine path does; what it cannot do at once it leaves to that path before sending; a
replica's failure, a silence, a client that leaves and a drain end as they do there."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client import CollectorRegistry

from llmgw._http1 import Http1Server
from llmgw.config import ServerConfig
from llmgw.control._fastpath import FastPath
from llmgw.control._upstream import Timeouts, Upstream
from llmgw.control.admin_api import KeyRequest, create_key
from llmgw.control.gateway import Gateway, make_gateway_app
from llmgw.control.metrics import GatewayMetrics
from llmgw.control.store import Store
from llmgw.netaddr import free_port
from tests.control.servers import raw_server, run_in_thread, scripted_upstream, serve_gateway
from tests.control.test_gateway import CHAT, EMBED, MODEL, json_answer, ready

# One step of a scripted answer: wait this long, then send these bytes (HANG_UP: close).
Step = tuple[float, bytes]
HANG_UP = b""


def whole(body: bytes, extra: bytes = b"") -> list[Step]:
    return [(0.0, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
             + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)]


@contextmanager
def raw_replica(script: Callable[[int, bytes], list[Step] | None]
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
def fast_gateway(store: Store, timeouts: Timeouts | None = None, with_fast: bool = True,
                 **options: object) -> Iterator[tuple[httpx.Client, FastPath, Gateway]]:
    """A gateway served with its fast path (or, not with_fast, without: the coroutine path
    alone), its client, the fast path (how many requests it took) and the app."""
    app = make_gateway_app(store, ServerConfig(**options), upstream=Upstream(timeouts),  # type: ignore[arg-type]
                           metrics=GatewayMetrics(CollectorRegistry()))
    fast = FastPath(app)
    with serve_gateway(app, fast=fast if with_fast else None) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        yield client, fast, app


def answers(store: Store, requests: list[dict[str, object]], with_fast: bool
            ) -> tuple[list[tuple[int, list[tuple[str, str]], bytes]], int]:
    """Each request's status, headers (but Date) and body, and how many the fast path took."""
    got = []
    with fast_gateway(store, with_fast=with_fast) as (gw, fast, _):
        for request in requests:
            r = gw.post("/v1/chat/completions", json=request)
            got.append((r.status_code, [(k, v) for k, v in r.headers.items() if k != "date"],
                        r.content))
    return got, fast.taken


def test_a_plain_answer_is_taken_once_a_connection_is_pooled_and_matches_the_other_path(
        store) -> None:
    """The first request opens the replica's connection (the coroutine path's work); the
    rest ride it on the fast path, and every answer is the coroutine path's, byte for byte
    (the model renamed to the alias asked for, usage passed through)."""
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        asked = [{**CHAT, "model": "tiny-chat"}] * 4
        fast, taken = answers(store, asked, with_fast=True)
        plain, none_taken = answers(store, asked, with_fast=False)
    assert (taken, none_taken) == (3, 0)
    assert fast == plain
    assert json.loads(fast[-1][2])["model"] == "tiny-chat"


@pytest.mark.parametrize("request_, status, taken_", [
    ({**CHAT, "stream": True}, 200, 0),
    ({**CHAT, "model": "nope"}, 404, 2),
    ({"messages": []}, 422, 2),
    ({**CHAT, "model": "tiny-embed"}, 400, 2),
])
def test_a_stream_goes_to_the_coroutine_path_and_an_error_is_answered_at_once(
        store, request_, status, taken_) -> None:
    """A stream waits on its replica: the coroutine path relays it. An error is written at
    once, from the fast path (the first request, which opens the replica's connection, is
    the coroutine path's); either way the answers are a gateway's without the fast path,
    byte for byte."""
    events = [b'data: {"model":"m","choices":[]}\n\n', b"data: [DONE]\n\n"]
    with scripted_upstream(lambda p, b: (200, "text/event-stream", events)
                           if json.loads(b).get("stream") else
                           (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        ready(store, "e1", up.endpoint, model="tiny-embed")
        warm_then = [CHAT, request_, request_]
        fast, taken = answers(store, warm_then, with_fast=True)
        plain, _ = answers(store, warm_then, with_fast=False)
    assert taken == taken_
    assert [s for s, _, _ in fast] == [200, status, status]
    assert fast == plain


def test_bad_json_is_answered_at_once_as_the_coroutine_path_answers_it(store) -> None:
    asked = [CHAT, "{not json", "[1]"]
    got = []
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        for with_fast in (True, False):
            with fast_gateway(store, with_fast=with_fast) as (gw, fast, _):
                got.append(([(r.status_code, r.json()["error"]["code"] if r.is_error else "",
                              r.content) for r in (
                    gw.post("/v1/chat/completions", json=a) if isinstance(a, dict) else
                    gw.post("/v1/chat/completions", content=a.encode()) for a in asked)],
                            fast.taken))
    (on_fast, taken), (plain, none_taken) = got
    assert [(s, c) for s, c, _ in on_fast] == [(200, ""), (400, "invalid_json"),
                                               (422, "invalid_body")]
    assert on_fast == plain and (taken, none_taken) == (2, 0)


def test_a_key_with_limits_spends_its_minute_once_whichever_path_ends_the_request(
        store) -> None:
    """rpm 2: the first request goes to the coroutine path part-way (no pooled connection
    yet) with its minute already spent there; the second rides the fast path; the third
    is the 429, written at once. Were a step run again on the way over, the second would
    be refused. The coroutine path alone gives the same answers."""
    made = create_key(store, KeyRequest(name="ci", rpm=2))["key"]
    outcomes = []
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        for with_fast in (True, False):
            with fast_gateway(store, with_fast=with_fast) as (gw, fast, _):
                codes = [gw.post("/v1/chat/completions", json=CHAT,
                                 headers={"Authorization": f"Bearer {made}"}).status_code
                         for _ in range(3)]
            outcomes.append((codes, fast.taken))  # each gateway keeps its own minute
    assert outcomes == [([200, 200, 429], 2), ([200, 200, 429], 0)]


def test_a_pooled_connection_the_replica_closed_goes_back_and_is_sent_once_more(
        store) -> None:
    """The fast path's request met a pooled connection the replica had closed (no byte
    came): the coroutine path sends it once on a new connection, as it does itself; the
    replica, which hangs up on the next requests too, then gets the 502."""
    def script(n: int, body: bytes) -> list[Step] | None:
        return whole(json_answer()) if n == 0 else None

    outcomes = []
    for with_fast in (True, False):
        with raw_replica(script) as (endpoint, seen):
            ready(store, "r1", endpoint)
            with fast_gateway(store, with_fast=with_fast) as (gw, fast, _):
                codes = [gw.post("/v1/chat/completions", json=CHAT).status_code
                         for _ in range(2)]
                message = gw.post("/v1/chat/completions", json=CHAT).json()
            outcomes.append((codes, len(seen), fast.taken))
    # The second request, sent twice (the stale connection, then a new one), and the third.
    assert outcomes[0][:2] == outcomes[1][:2] == ([200, 502], 4)
    assert outcomes[0][2] == 1 and outcomes[1][2] == 0
    assert "closed the connection without an answer" in message["error"]["message"]


@pytest.mark.parametrize("with_fast", [True, False], ids=["fast path", "coroutine path"])
def test_a_replica_that_breaks_off_its_answer_is_502_and_not_resent(store, with_fast) -> None:
    """Both paths answer a 502 in OpenAI's shape (the coroutine path answered a plain 500
    before the fast path came), and the request is not sent again."""
    def script(n: int, body: bytes) -> list[Step] | None:
        if n == 0:
            return whole(json_answer())
        answer = whole(json_answer())[0][1]
        return [(0.0, answer[:-10]), (0.0, HANG_UP)]

    with raw_replica(lambda n, b: script(n, b) if n < 2 else whole(json_answer())) as \
            (endpoint, seen):
        ready(store, "r1", endpoint)
        with fast_gateway(store, with_fast=with_fast) as (gw, fast, app):
            first = gw.post("/v1/chat/completions", json=CHAT)
            broken = gw.post("/v1/chat/completions", json=CHAT)
            again = [gw.post("/v1/chat/completions", json=CHAT).status_code for _ in range(2)]
    assert first.status_code == 200 and broken.status_code == 502
    assert broken.json()["error"]["code"] == "replica_failed"
    assert "broke off its answer" in broken.json()["error"]["message"]
    # The broken one once; the next opens a new connection (the coroutine path's work).
    assert len(seen) == 4 and fast.taken == (2 if with_fast else 0)
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
        with fast_gateway(store, Timeouts(connect_s=1.0, read_s=0.5)) as (gw, fast, _):
            codes = []
            messages = []
            for _ in range(5):
                r = gw.post("/v1/chat/completions", json=CHAT)
                codes.append(r.status_code)
                messages.append(r.json().get("error", {}).get("message", ""))
    assert codes == [200, 200, 502, 200, 502], messages
    assert "sent nothing for 0.5 s (upstream_read_timeout_s" in messages[2]
    assert "sent no answer within 0.5 s (upstream_read_timeout_s" in messages[4]
    assert fast.taken == 3  # 1, 2 and 4; 3 opened a new connection, on the coroutine path


def test_pipelined_requests_are_answered_in_order(store) -> None:
    """Three requests in one write: the first opens the replica's connection, the next two
    ride the fast path, each answered in turn with its own content."""
    def script(n: int, body: bytes) -> list[Step] | None:
        return whole(json_answer(content=json.loads(body)["messages"][0]["content"]))

    with raw_replica(script) as (endpoint, _):
        ready(store, "r1", endpoint)
        with fast_gateway(store) as (gw, fast, _):
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
    assert order == sorted(order) and fast.taken >= 2


def test_a_client_that_leaves_ends_nothing_but_its_answer(store) -> None:
    """The client hangs up while its request is at the replica: the answer is dropped, the
    lease ends, and the next request is answered."""
    def script(n: int, body: bytes) -> list[Step] | None:
        return [(0.5 if n == 1 else 0.0, whole(json_answer())[0][1])]

    with raw_replica(script) as (endpoint, seen):
        ready(store, "r1", endpoint)
        with fast_gateway(store) as (gw, fast, app):
            gw.post("/v1/chat/completions", json=CHAT)
            with pytest.raises(httpx.ReadTimeout):
                gw.post("/v1/chat/completions", json=CHAT, timeout=0.2)
            time.sleep(0.6)
            after = gw.post("/v1/chat/completions", json=CHAT).status_code
            in_flight = app.balancer.loads["r1"].in_flight
    assert after == 200 and len(seen) == 3 and fast.taken == 2
    assert in_flight == 0


def test_a_drain_answers_a_request_on_the_fast_path_and_closes(store) -> None:
    """The server told to stop while a fast-path request is at the replica: its answer
    comes whole, with Connection: close."""
    def script(n: int, body: bytes) -> list[Step] | None:
        return [(0.5 if n == 1 else 0.0, whole(json_answer())[0][1])]

    with raw_replica(script) as (endpoint, _):
        ready(store, "r1", endpoint)
        app = make_gateway_app(store, upstream=Upstream())
        fast = FastPath(app)
        port = free_port()
        server = Http1Server(app, f"127.0.0.1:{port}", drain_s=5.0, fast=fast)
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
    assert result[0].headers["connection"] == "close" and fast.taken == 1


def test_usage_and_metrics_count_fast_path_answers(store) -> None:
    """A key's usage reaches the store and the request counts reach /metrics, from answers
    the fast path relayed."""
    made = create_key(store, KeyRequest(name="ci"))["key"]
    registry = CollectorRegistry()
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        app = make_gateway_app(store, upstream=Upstream(),
                               metrics=GatewayMetrics(registry), usage_flush_s=0.2)
        fast = FastPath(app)
        with serve_gateway(app, fast=fast) as url, httpx.Client(base_url=url) as gw:
            for _ in range(4):
                gw.post("/v1/chat/completions", json=CHAT,
                        headers={"Authorization": f"Bearer {made}"}).raise_for_status()
            time.sleep(0.6)
    assert fast.taken == 3
    (stored,) = store.keys()
    assert (stored["requests"], stored["prompt_tokens"], stored["completion_tokens"]) == \
        (4, 12, 20)
    count = registry.get_sample_value("llmgw_gateway_requests_total",
                                      {"model": "tiny", "status": "200", "key": "ci"})
    assert count == 4
    assert registry.get_sample_value("llmgw_gateway_requests_in_flight") == 0
