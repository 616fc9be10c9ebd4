"""The gateway's load queue (gateway/_demand.py) against a real store, with the scheduler's
part played by the test writing replica rows: a request for a model with no ready replica
waits for one and is served by the first that comes ready; the wait is bounded in count
(load_queue_size) and time (load_wait_s), and what it waited for reaches the store."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from llmgw.config import ServerConfig
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
