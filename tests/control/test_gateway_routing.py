"""The gateway's balanced routing against fake engines on loopback: slots as each replica's
limit, the queue and its 503, conversations kept on their replica, and the busy guard."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from llmgw.config import ServerConfig
from llmgw.control._upstream import Upstream
from llmgw.control.gateway import Gateway, make_gateway_app
from llmgw.control.store import Store
from llmgw.netaddr import free_port
from tests.control.fake_engine import FakeEngine, fake_engine
from tests.control.servers import scripted_upstream, serve_gateway

MODEL = {"name": "m", "aliases": [], "source": "http://m/m.gguf", "sha256": "",
         "scaling": {"min": 1, "max": 2}, "profiles": []}


@pytest.fixture
def store(tmp_path) -> Store:
    s = Store(tmp_path / "db.sqlite")
    s.add_model(MODEL)
    return s


def ready(store: Store, rid: str, engine: FakeEngine, key: str = "k") -> None:
    store.put_replica({"id": rid, "model": "m", "node": "n1", "profile": "cpu",
                       "state": "ready", "endpoint": engine.endpoint, "api_key": key})


@contextmanager
def gateway(store: Store, **settings: Any) -> Iterator[tuple[Gateway, httpx.Client]]:
    """The gateway with these server.yaml settings (gateway_routing=..., and so on)."""
    app = make_gateway_app(store, ServerConfig(**settings), upstream=Upstream())
    with serve_gateway(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield app, client


def wait_until(what: str, done: Callable[[], bool], seen: Callable[[], object]) -> None:
    __tracebackhide__ = True
    deadline = time.monotonic() + 5
    while not done():
        assert time.monotonic() < deadline, f"waited 5 s for {what}; last seen: {seen()}"
        time.sleep(0.02)


def wait_polled(app: Gateway, *ids: str) -> None:
    loads = app.balancer.loads
    wait_until(f"the slots of {ids} polled",
               lambda: all(i in loads and loads[i].slots is not None for i in ids),
               lambda: loads)


def chat(*contents: str) -> dict[str, Any]:
    roles = ["user", "assistant"]
    return {"model": "m", "messages": [{"role": roles[i % 2], "content": c}
                                       for i, c in enumerate(contents)]}


def conversation_of(body: bytes) -> str:
    return json.loads(body)["messages"][0]["content"]


@pytest.mark.parametrize(("routing", "in_engines"), [("balanced", 2), ("round-robin", 3)])
def test_a_request_beyond_every_replicas_slots_waits_in_the_gateway(
        store, routing, in_engines) -> None:
    """One slot each, both busy: the third request waits in the gateway and takes the first
    slot that frees. Round robin (the negative control) sends it into a busy engine."""
    with fake_engine(1, held=True) as e1, fake_engine(1, held=True) as e2:
        ready(store, "r1", e1)
        ready(store, "r2", e2)
        with gateway(store, gateway_routing=routing) as (app, gw), ThreadPoolExecutor(3) as pool:
            if routing == "balanced":
                wait_polled(app, "r1", "r2")
            sent = [pool.submit(gw.post, "/v1/chat/completions", json=chat(f"c{i}"))
                    for i in range(3)]
            arrived = lambda: len(e1.bodies) + len(e2.bodies)  # noqa: E731
            wait_until("two requests in the engines", lambda: arrived() >= 2, arrived)
            time.sleep(0.3)
            in_engines_while_busy = arrived()
            e1.hold.set()
            e2.hold.set()
            codes = [f.result().status_code for f in sent]
    assert in_engines_while_busy == in_engines
    assert codes == [200] * 3 and len(e1.bodies) + len(e2.bodies) == 3


def test_beyond_the_queue_or_its_wait_the_answer_is_503_with_retry_after(store) -> None:
    with fake_engine(1, held=True) as e1:
        ready(store, "r1", e1)
        cases = [({"gateway_queue_size": 0}, "0 requests already wait (gateway_queue_size"),
                 ({"gateway_queue_wait_s": 0.3}, "(gateway_queue_wait_s in server.yaml); "
                                                 "r1: 1 in flight of 1 slots")]
        for limits, says in cases:
            with gateway(store, **limits) as (app, gw), ThreadPoolExecutor(1) as pool:
                wait_polled(app, "r1")
                first = pool.submit(gw.post, "/v1/chat/completions", json=chat("a"))
                wait_until("the first request in the engine", lambda: e1.running == 1,
                           lambda: e1.running)
                refused = gw.post("/v1/chat/completions", json=chat("b"))
                e1.hold.set()
                assert first.result().status_code == 200
                assert gw.post("/v1/chat/completions", json=chat("c")).status_code == 200
                e1.hold.clear()
            error = refused.json()["error"]
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert error["code"] == "replicas_busy" and says in error["message"]


@pytest.mark.parametrize(("routing", "split"), [("balanced", False), ("round-robin", True)])
def test_each_turn_of_a_conversation_goes_back_to_the_replica_that_served_it(
        store, routing, split) -> None:
    """Two conversations of three turns, one after the other: balanced keeps each on one
    replica (and uses both); round robin (the negative control) splits them."""
    with fake_engine(8) as e1, fake_engine(8) as e2:
        ready(store, "r1", e1)
        ready(store, "r2", e2)
        with gateway(store, gateway_routing=routing) as (_, gw):
            for name in ("cats", "dogs"):
                history = [name]
                for turn in range(3):
                    assert gw.post("/v1/chat/completions", json=chat(*history)).is_success
                    history += [f"answer {turn}", f"question {turn}"]
    seen = [{conversation_of(b) for b in e.bodies} for e in (e1, e2)]
    if split:
        assert seen == [{"cats", "dogs"}, {"cats", "dogs"}]
    else:
        assert sorted(seen, key=sorted) == [{"cats"}, {"dogs"}]


def test_a_session_goes_elsewhere_once_its_replica_is_much_busier_than_the_idlest(
        store) -> None:
    """X-Session-Id pins a session: its first three requests stay on its busy replica
    (within the guard's margin of 2), the fourth goes to the idle one."""
    with fake_engine(8) as e1, fake_engine(8) as e2:
        ready(store, "r1", e1)
        ready(store, "r2", e2)
        session = {"X-Session-Id": "s-1"}
        with gateway(store) as (app, gw), ThreadPoolExecutor(4) as pool:
            wait_polled(app, "r1", "r2")
            gw.post("/v1/chat/completions", json=chat("a"), headers=session)
            home, other = (e1, e2) if e1.bodies else (e2, e1)
            home.hold.clear()
            held = [pool.submit(gw.post, "/v1/chat/completions", json=chat(f"b{i}"),
                                headers=session) for i in range(3)]
            wait_until("three requests on the session's replica", lambda: home.running == 3,
                       lambda: (home.running, len(other.bodies)))
            fourth = gw.post("/v1/chat/completions", json=chat("c"), headers=session)
            home.hold.set()
            assert [f.result().status_code for f in held] == [200] * 3
    assert fourth.status_code == 200
    assert [conversation_of(b) for b in other.bodies] == ["c"]


def test_a_replica_whose_slots_do_not_answer_is_balanced_without_a_limit(store) -> None:
    """The replica's /slots refuses the key it is polled with: its slots are unknown, so
    requests go to the engine as under round robin (none waits in the gateway)."""
    with fake_engine(1, key="other", held=True) as e1:
        ready(store, "r1", e1, key="k")
        with gateway(store) as (app, gw), ThreadPoolExecutor(3) as pool:
            sent = [pool.submit(gw.post, "/v1/chat/completions", json=chat(f"c{i}"))
                    for i in range(3)]
            wait_until("three requests in the engine", lambda: e1.running == 3,
                       lambda: (e1.running, app.balancer.loads))
            e1.hold.set()
            assert [f.result().status_code for f in sent] == [200] * 3
    assert e1.polls == 0 and app.balancer.loads["r1"].slots is None


@pytest.fixture(scope="module")
def two_engines(llama_server, tiny_gguf) -> Iterator[list[str]]:
    """Module: two real llama-servers on the tiny GGUF (2 slots each, key "k"), endpoints."""
    procs, endpoints = [], []
    try:
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen(
                [llama_server, "-m", str(tiny_gguf[0]), "--host", "127.0.0.1", "--port",
                 str(port), "--api-key", "k", "--parallel", "2", "-t", "1", "--ctx-size",
                 "2048"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            endpoints.append(f"http://127.0.0.1:{port}")
        for endpoint, proc in zip(endpoints, procs, strict=True):
            wait_until(f"{endpoint}/health", lambda e=endpoint: _healthy(e), proc.poll)
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def _healthy(endpoint: str) -> bool:
    try:
        return httpx.get(f"{endpoint}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize(("routing", "cached"), [("balanced", True), ("round-robin", False)])
def test_a_conversations_next_turn_reuses_the_real_engines_prompt_cache(
        store, two_engines, routing, cached) -> None:
    """On real llama-servers: balanced sends turn 2 to the replica that holds turn 1's
    prompt, so the engine reports cached prompt tokens; round robin (the negative control)
    sends it to the other replica, which has none. The real /slots is read with the key."""
    for i, endpoint in enumerate(two_engines):
        store.put_replica({"id": f"r{i + 1}", "model": "m", "node": "n1", "profile": "cpu",
                           "state": "ready", "endpoint": endpoint, "api_key": "k"})
    history = [f"tell me a story about {routing} routing and the long road home"]
    with gateway(store, gateway_routing=routing) as (app, gw):
        if routing == "balanced":
            wait_polled(app, "r1", "r2")
            assert [app.balancer.loads[r].slots for r in ("r1", "r2")] == [2, 2]
        first = gw.post("/v1/chat/completions", json={**chat(*history), "max_tokens": 4})
        history += [first.json()["choices"][0]["message"]["content"], "and then?"]
        second = gw.post("/v1/chat/completions", json={**chat(*history), "max_tokens": 4})
    assert first.status_code == second.status_code == 200
    reused = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (reused > 0) is cached, second.json()["usage"]


def test_every_lease_ends_with_its_answer_whole_streamed_broken_or_refused(store) -> None:
    """After answers whole, streamed, a replica that hung up (502) and a client that left
    a stream, no request is left counted in flight: no slot leaks. The negative control
    is the count while a request is held."""
    events = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'] * 50 + [b"data: [DONE]\n\n"]

    def answer(path: str, body: bytes) -> tuple[int, str, list[bytes]] | None:
        if b"drop" in body:
            return None
        if json.loads(body).get("stream"):
            time.sleep(0.2)
            return 200, "text/event-stream", events
        return 200, "application/json", [b'{"model":"x","choices":[]}']

    with scripted_upstream(answer) as up, fake_engine(4, held=True) as held:
        store.put_replica({"id": "r1", "model": "m", "node": "n1", "profile": "cpu",
                           "state": "ready", "endpoint": up.endpoint, "api_key": "k"})
        with gateway(store) as (app, gw):
            loads = app.balancer.loads
            assert gw.post("/v1/chat/completions", json=chat("a")).status_code == 200
            streamed = gw.post("/v1/chat/completions", json={**chat("b"), "stream": True})
            assert streamed.status_code == 200 and streamed.text.endswith("[DONE]\n\n")
            assert gw.post("/v1/chat/completions", json=chat("drop")).status_code == 502
            with gw.stream("POST", "/v1/chat/completions",
                           json={**chat("c"), "stream": True}) as left:
                next(left.iter_raw())
            wait_until("no request in flight", lambda: loads["r1"].in_flight == 0,
                       lambda: loads)
            store.put_replica({"id": "r1", "model": "m", "node": "n1", "profile": "cpu",
                               "state": "ready", "endpoint": held.endpoint, "api_key": "k"})
            time.sleep(0.6)  # the router's cache of the store
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(gw.post, "/v1/chat/completions", json=chat("d"))
                wait_until("one request in flight", lambda: loads["r1"].in_flight == 1,
                           lambda: loads)
                held.hold.set()
                assert pending.result().status_code == 200
            wait_until("none in flight again", lambda: loads["r1"].in_flight == 0,
                       lambda: loads)


def test_a_replica_ready_since_the_routers_last_read_takes_the_request(store) -> None:
    """The router reads the store at most every 0.5 s; before it would answer 503 it reads
    again, so a replica that just became ready is not refused in the meantime."""
    with fake_engine(4) as e1, gateway(store) as (_, gw):
        before = gw.post("/v1/chat/completions", json=chat("a"))
        ready(store, "r1", e1)
        after = gw.post("/v1/chat/completions", json=chat("b"))
    assert before.status_code == 503 and after.status_code == 200
