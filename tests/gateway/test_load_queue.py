"""The gateway's load queue (gateway/_demand.py) against a real store, with the scheduler's
part played by the test writing replica rows: a request for a model with no ready replica
waits for one and is served by the first that comes ready; the wait is bounded in count
(load_queue_size) and time (load_wait_s), and what it waited for reaches the store."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import openai
import pytest

from llmgw.config import ServerConfig
from llmgw.gateway import _forward
from llmgw.gateway._upstream import Upstream
from llmgw.gateway.app import make_gateway_app
from llmgw.store import Store
from tests.gateway.test_gateway import CHAT, MODEL, json_answer, ready
from tests.servers import scripted_upstream, serve_gateway


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:
    """Function: a store with the model tiny and a control plane holding the scheduler
    lease (so the gateway waits for loads instead of refusing them)."""
    s = Store(tmp_path / "db.sqlite")
    s.add_model(MODEL)
    assert s.acquire_lease("cp", 600.0) is not None
    yield s
    s.close()


def post_in_background(url: str, answers: list[httpx.Response]) -> threading.Thread:
    def go() -> None:
        answers.append(httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30))

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def waiting(store: Store) -> int:
    use = store.uses().get("tiny")
    return use.waiting if use else 0


def until(what: str, done, seen) -> None:
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, f"waited 10 s for {what}; last seen: {seen()}"
        time.sleep(0.05)


def test_a_waiting_request_is_served_by_the_first_replica_that_comes_ready(store) -> None:
    app = make_gateway_app(store, ServerConfig(load_wait_s=20), upstream=Upstream())
    answers: list[httpx.Response] = []
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up, \
            serve_gateway(app) as url:
        thread = post_in_background(url, answers)
        # What it waits for reaches the store at once: the scheduler's cue.
        until("the store to show tiny waited for", lambda: waiting(store) == 1,
              lambda: store.uses())
        assert answers == []
        ready(store, "r1", up.endpoint)
        thread.join(15)
    assert [a.status_code for a in answers] == [200], answers[0].text
    until("the wait to leave the store", lambda: waiting(store) == 0, lambda: store.uses())


def test_the_queue_is_bounded_in_count_and_in_time(store) -> None:
    """load_queue_size 1: a second waiter is refused at once (load_queue_full); load_wait_s
    2: the first gets 503 load_timeout naming the model's replicas."""
    store.put_replica({"id": "r1", "model": "tiny", "node": "n1", "profile": "cpu",
                       "state": "downloading", "err": ""})
    app = make_gateway_app(store, ServerConfig(load_wait_s=2, load_queue_size=1),
                           upstream=Upstream())
    answers: list[httpx.Response] = []
    with serve_gateway(app) as url:
        first = post_in_background(url, answers)
        until("the first to wait", lambda: waiting(store) == 1, lambda: store.uses())
        second = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        first.join(15)
    assert second.status_code == 503
    assert second.json()["error"]["code"] == "load_queue_full", second.text
    (timed_out,) = answers
    error = timed_out.json()["error"]
    assert timed_out.status_code == 503 and error["code"] == "load_timeout", error
    assert "within 2 s (load_wait_s" in error["message"]
    assert "r1 on n1: downloading" in error["message"]


def test_a_replica_that_fails_after_the_request_came_answers_it_with_why(store) -> None:
    """Not at load_wait_s (30 s here): as soon as the store shows the failure."""
    app = make_gateway_app(store, ServerConfig(load_wait_s=30), upstream=Upstream())
    answers: list[httpx.Response] = []
    with serve_gateway(app) as url:
        thread = post_in_background(url, answers)
        until("the request to wait", lambda: waiting(store) == 1, lambda: store.uses())
        store.put_replica({"id": "r1", "model": "tiny", "node": "n1", "profile": "cpu",
                           "state": "failed", "err": "llama-server exited with code 1"})
        thread.join(10)
    (failed,) = answers
    error = failed.json()["error"]
    assert failed.status_code == 503 and error["code"] == "load_failed", error
    assert "replica r1 of tiny on n1 failed to load: llama-server exited" in error["message"]


def test_a_model_no_node_has_room_for_answers_with_the_schedulers_why(store) -> None:
    """The scheduler wrote the replica unplaced, saying why (no room even after eviction):
    the waiting request gets it at once. Control: an unplaced replica from before the
    request came, not written again since, does not fail it."""
    store.put_replica({"id": "r0", "model": "tiny", "node": "", "profile": "",
                       "state": "pending", "err": "no ready node fits any profile (old)"})
    app = make_gateway_app(store, ServerConfig(load_wait_s=3), upstream=Upstream())
    answers: list[httpx.Response] = []
    with serve_gateway(app) as url:
        thread = post_in_background(url, answers)
        until("the request to wait", lambda: waiting(store) == 1, lambda: store.uses())
        time.sleep(0.6)  # two polls: the old row fails nothing
        assert answers == []
        store.put_replica({"id": "r0", "model": "tiny", "node": "", "profile": "",
                           "state": "pending",
                           "err": "no ready node fits any profile (cpu: n1 has under 4 GB)"})
        thread.join(10)
    (refused,) = answers
    error = refused.json()["error"]
    assert refused.status_code == 503 and error["code"] == "load_failed", error
    assert "tiny cannot be placed: no ready node fits any profile (cpu: n1 has under 4 GB)" \
        in error["message"]


def test_waiters_are_answered_when_the_scheduler_lease_lapses(tmp_path) -> None:
    """A control plane killed while requests wait: once its lease lapses (2 s here), they
    get 503 control_plane_away, not at load_wait_s (30 s); a new request at once."""
    store = Store(tmp_path / "db.sqlite")
    store.add_model(MODEL)
    assert store.acquire_lease("cp", 2.0) is not None
    app = make_gateway_app(store, ServerConfig(load_wait_s=30), upstream=Upstream())
    answers: list[httpx.Response] = []
    try:
        with serve_gateway(app) as url:
            thread = post_in_background(url, answers)
            until("the request to wait", lambda: waiting(store) == 1, lambda: store.uses())
            thread.join(10)
            again = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
    finally:
        store.close()
    (away,) = answers
    for answer in (away, again):
        error = answer.json()["error"]
        assert answer.status_code == 503 and error["code"] == "control_plane_away", error
        assert "no control plane is scheduling" in error["message"]


@contextmanager
def one_at_a_time(served: list[str]) -> Iterator[str]:
    """A replica with one slot: a server that takes one connection at a time, in the
    order they came, answers it (a tenth of a second of work) and closes it; served gets
    each request's message in the order it was served. Yields its endpoint."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request a connection: the next waits its turn

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            said = body["messages"][0]["content"]
            time.sleep(0.1)
            served.append(said)
            answer = json_answer(content=said)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_held_requests_are_served_in_order_of_arrival(store) -> None:
    """Six requests come one after another while tiny has no replica, each waiting before
    the next is sent; then one replica with one slot comes ready: it serves them, and
    they complete, in the order they came."""
    app = make_gateway_app(store, ServerConfig(load_wait_s=30), upstream=Upstream())
    served: list[str] = []
    completed: list[str] = []
    lock = threading.Lock()

    def ask(said: str) -> None:
        body = {**CHAT, "messages": [{"role": "user", "content": said}]}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        with lock:
            completed.append(f"{answer.status_code} {said}")

    came = [f"request {i}" for i in range(6)]
    with one_at_a_time(served) as endpoint, serve_gateway(app) as url:
        threads = []
        for i, said in enumerate(came):
            threads.append(threading.Thread(target=ask, args=(said,)))
            threads[-1].start()
            until(f"{said} to wait", lambda n=i + 1: waiting(store) == n, lambda: store.uses())
        ready(store, "r1", endpoint)
        for thread in threads:
            thread.join(30)
    assert served == came, f"the replica served them in the order {served}"
    assert completed == [f"200 {said}" for said in came], completed


def chunk(content: str) -> bytes:
    event = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


@pytest.fixture
def keepalive_s(monkeypatch: pytest.MonkeyPatch) -> float:
    """Function: a waiting stream's comment every 0.2 s (10 s in service)."""
    monkeypatch.setattr(_forward, "SSE_KEEPALIVE_S", 0.2)
    return 0.2


def test_a_waiting_stream_gets_comment_lines_that_the_openai_sdk_skips(
        store, keepalive_s) -> None:
    """While tiny loads, a streaming request gets its 200 head and `: waiting for tiny to
    load` every keepalive; the openai package's stream yields only the replica's chunks
    once it is ready. Control: the same raw bytes, comments and all, are read here too."""
    app = make_gateway_app(store, ServerConfig(load_wait_s=30), upstream=Upstream())
    stream_parts = [chunk("Hel"), chunk("lo"), b"data: [DONE]\n\n"]
    got: list[str] = []
    with scripted_upstream(lambda p, b: (200, "text/event-stream", stream_parts)) as up, \
            serve_gateway(app) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30,
                          json={**CHAT, "stream": True}) as raw:
            lines = raw.iter_lines()
            head = (raw.status_code, raw.headers["content-type"])
            comments = [next(lines) for _ in range(4)]  # two comments, each with its blank
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

            def sdk() -> None:
                stream = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)
                got.extend(c.choices[0].delta.content or "" for c in stream)

            thread = threading.Thread(target=sdk)
            thread.start()
            time.sleep(3 * keepalive_s)  # the SDK's stream reads comments meanwhile
            ready(store, "r1", up.endpoint)
            thread.join(15)
            rest = list(lines)
    assert got == ["Hel", "lo"], f"the openai package's stream yielded {got}"
    assert head == (200, "text/event-stream")
    assert comments == [": waiting for tiny to load", "", ": waiting for tiny to load", ""]
    assert any(line.startswith("data: ") and "Hel" in line for line in rest), rest


def test_a_load_that_fails_after_the_head_is_an_error_event_the_sdk_raises(
        store, keepalive_s) -> None:
    """The 200 head went while it waited: the load's failure comes as `data: {"error":
    ...}`, and openai's stream raises APIError with the gateway's why."""
    app = make_gateway_app(store, ServerConfig(load_wait_s=30), upstream=Upstream())
    client = openai.OpenAI(base_url="http://unset", api_key="none", max_retries=0)
    with serve_gateway(app) as url:
        client = client.with_options(base_url=f"{url}/v1")
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)
        store.put_replica({"id": "r1", "model": "tiny", "node": "n1", "profile": "cpu",
                           "state": "failed", "err": "llama-server exited with code 1"})
        with pytest.raises(openai.APIError) as raised:
            list(stream)
    assert "replica r1 of tiny on n1 failed to load: llama-server exited" in str(raised.value)


def test_negative_control_a_stream_answered_before_the_keepalive_gets_no_comment(
        store) -> None:
    """Keepalive at 10 s: a load that fails within it is a plain 503, no head sent first."""
    app = make_gateway_app(store, ServerConfig(load_wait_s=30), upstream=Upstream())
    with serve_gateway(app) as url:
        answers: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)))
        thread.start()
        until("the request to wait", lambda: waiting(store) == 1, lambda: store.uses())
        store.put_replica({"id": "r1", "model": "tiny", "node": "n1", "profile": "cpu",
                           "state": "failed", "err": "llama-server exited with code 1"})
        thread.join(10)
    (answer,) = answers
    assert answer.status_code == 503 and not answer.text.startswith(":"), answer.text
