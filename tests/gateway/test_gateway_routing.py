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
from llmgw.gateway import _slottable as st
from llmgw.gateway._upstream import Upstream
from llmgw.gateway.app import Gateway, make_gateway_app
from llmgw.host.netaddr import free_port
from llmgw.model.engine_args import engine_args
from llmgw.store import Store
from tests.gateway.fake_engine import FakeEngine, fake_engine
from tests.servers import scripted_upstream, serve_gateway

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


def test_each_turn_is_sent_with_the_slot_that_holds_its_conversation(store) -> None:
    """Turn 1 is new and sent as it came; turns 2 and 3 carry the id_slot of the slot the
    engine took for it (the last of its idle slots, under llama-server's LRU), on the same
    replica."""
    with fake_engine(4) as e1, fake_engine(4) as e2:
        ready(store, "r1", e1)
        ready(store, "r2", e2)
        with gateway(store) as (app, gw):
            wait_polled(app, "r1", "r2")
            history = ["cats"]
            for turn in range(3):
                assert gw.post("/v1/chat/completions", json=chat(*history)).is_success
                history += [f"answer {turn}", f"question {turn}"]
    bodies = [json.loads(b) for b in e1.bodies + e2.bodies]
    assert [b.get("id_slot") for b in bodies] == [None, 3, 3]
    assert len(e1.bodies) in (0, 3), "one replica took every turn"
    assert app.balancer.decisions[st.SLOT] == 2


def test_a_clients_own_id_slot_is_refused_since_the_gateway_owns_slots(store) -> None:
    """400 naming id_slot, nothing sent to an engine; the negative control: the same body
    without it is served."""
    with fake_engine(4) as e1:
        ready(store, "r1", e1)
        with gateway(store) as (_, gw):
            refused = gw.post("/v1/chat/completions", json={**chat("a"), "id_slot": 0})
            served = gw.post("/v1/chat/completions", json=chat("a"))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "id_slot"
    assert refused.json()["error"]["code"] == "id_slot_not_allowed"
    assert served.status_code == 200 and len(e1.bodies) == 1


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


@pytest.fixture(scope="module")
def slot_engines(llama_server, tiny_gguf) -> Iterator[list[str]]:
    """Module: two real llama-servers on the tiny GGUF (2 slots each, key "k") with the
    flags the control plane gives a chat replica (engine_args: similarity 0, idle slots
    kept); their endpoints."""
    flags = engine_args({"name": "m", "routing_profile": "chat"},  # type: ignore[arg-type]
                        {"args": ["--parallel", "2", "-t", "1", "--ctx-size", "4096"]})
    procs, endpoints = [], []
    try:
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen(
                [llama_server, "-m", str(tiny_gguf[0]), "--host", "127.0.0.1", "--port",
                 str(port), "--api-key", "k", *flags],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            endpoints.append(f"http://127.0.0.1:{port}")
        for endpoint, proc in zip(endpoints, procs, strict=True):
            wait_until(f"{endpoint}/health", lambda e=endpoint: _healthy(e), proc.poll)
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def _put_replicas(store: Store, endpoints: list[str]) -> None:
    for i, endpoint in enumerate(endpoints):
        store.put_replica({"id": f"r{i + 1}", "model": "m", "node": "n1", "profile": "cpu",
                           "state": "ready", "endpoint": endpoint, "api_key": "k"})


def _talk(gw: httpx.Client, openings: list[str], turns: int) -> list[tuple[str, list[float]]]:
    """Conversations taking turns, each turn sending the whole history at temperature 0;
    every answer in the order given, with its tokens' log-probabilities (the tiny model's
    random weights repeat a few characters whatever they are sent, but the numbers behind
    them follow every token of the prompt)."""
    histories, answers = [[o] for o in openings], []
    for turn in range(turns):
        for history in histories:
            r = gw.post("/v1/chat/completions", json={**chat(*history), "max_tokens": 12,
                                                     "temperature": 0, "logprobs": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            answers.append((choice["message"]["content"],
                            [t["logprob"] for t in choice["logprobs"]["content"]]))
            history += [answers[-1][0], f"and after turn {turn}?"]
    return answers


def test_answers_at_temperature_0_are_the_same_pinned_to_slots_as_under_round_robin(
        store, slot_engines) -> None:
    """Three conversations of three turns through a balanced gateway, which pins their
    later turns to their slots, and through a round-robin one, on the same real engines:
    the same answers, word for word, and the same log-probabilities. The negative control:
    another opening changes the log-probabilities tenfold more than the routing does, so
    they do follow what the engines were sent."""
    _put_replicas(store, slot_engines)
    openings = [f"conversation {i} about the harbor, the lighthouse and its keeper"
                for i in range(3)]
    with gateway(store) as (app, gw):
        wait_polled(app, "r1", "r2")
        pinned = _talk(gw, openings, 3)
        pins = app.balancer.decisions[st.SLOT]
    with gateway(store, gateway_routing="round-robin") as (_, gw):
        rotated = _talk(gw, openings, 3)
        other = _talk(gw, ["a list of apples, pears and plums from the market"], 3)
    assert pins >= 4, f"later turns were pinned to their slots: {app.balancer.decisions}"
    assert [text for text, _ in pinned] == [text for text, _ in rotated]
    # Not to the last bit: llama.cpp's sums come out a few 1e-4 apart when a prompt is
    # computed in other pieces (some of it from a cache, as under either routing).
    assert _apart(pinned, rotated) < 2e-3
    assert _apart(other, rotated[0::3]) > 2e-2


def _apart(one: list[tuple[str, list[float]]], two: list[tuple[str, list[float]]]) -> float:
    return max(abs(a - b) for (_, x), (_, y) in zip(one, two, strict=True)
               for a, b in zip(x, y, strict=True))


@pytest.mark.parametrize("rule", [True, False])
def test_a_request_whose_slot_is_busy_does_not_wait_for_it(
        store, slot_engines, monkeypatch, rule) -> None:
    """A conversation's turn runs long in its slot (1,800 tokens); the same turn sent
    again meanwhile is not pinned behind it: it runs in the replica's other slot and is
    answered while the long one still runs. The negative control, the rule removed (a
    slot this gateway has a request on counts as idle): it is pinned to the busy slot,
    and llama-server makes it wait until the long one ends."""
    if not rule:
        monkeypatch.setattr(st.Slot, "idle", property(lambda self: not self.others))
    _put_replicas(store, slot_engines)
    history = [f"the keeper's log, rule {rule}"]
    with gateway(store) as (app, gw), ThreadPoolExecutor(1) as pool:
        wait_polled(app, "r1", "r2")
        first = gw.post("/v1/chat/completions", json={**chat(*history), "max_tokens": 4})
        history += [first.json()["choices"][0]["message"]["content"], "go on"]
        long = pool.submit(gw.post, "/v1/chat/completions", json={
            **chat(*history), "max_tokens": 1800, "ignore_eos": True})
        loads = app.balancer.loads
        wait_until("the long turn in flight", lambda: sum(
            load.in_flight for load in loads.values()) == 1, lambda: loads)
        again = gw.post("/v1/chat/completions", json={**chat(*history), "max_tokens": 4})
        long_done_first = long.done()
        assert again.status_code == long.result().status_code == 200
    decided = app.balancer.decisions
    if rule:
        assert not long_done_first and decided[st.SLOT_BUSY] == 1, decided
    else:
        assert long_done_first and decided[st.SLOT] == 2, decided
