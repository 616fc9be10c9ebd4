"""The watch: a node whose heartbeat is 5 s learns a new replica within about a second,
because it holds GET /api/v1/agent/watch on the control plane, which answers as soon as
the node's assignments differ from its last heartbeat answer; answered unchanged after its
hold; and a control plane without the route (older) leaves the agent beating as before.
A real agent API (mutual TLS, its own store) and a real Agent in a thread, on loopback."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent import client as agent_client
from llmgw.agent.agent import Agent
from llmgw.agent.client import AgentClient
from llmgw.agent.workload import NoReplicas
from llmgw.contract import AgentPaths
from llmgw.contract.records import Assignment
from llmgw.control import _watch
from llmgw.control._tlsserver import Reply, Request
from llmgw.store import Store
from tests.agent.test_failover import Fleet, serving

HEARTBEAT_S = 5.0
MODEL = {"name": "tiny", "aliases": [], "source": "http://m/tiny.gguf", "sha256": "",
         "scaling": {"min": 1, "max": 1},
         "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "", "priority": 100,
                       "min_memory_gb": 0, "node_selector": {}, "args": []}]}


class Recorded(NoReplicas):
    """Runs nothing; notes when each set of assignments came."""

    def __init__(self) -> None:
        super().__init__()
        self.came: list[tuple[float, list[str]]] = []

    def reconcile(self, assignments: list[Assignment]) -> None:
        super().reconcile(assignments)
        self.came.append((time.monotonic(), [a["id"] for a in assignments]))


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Function: one control plane (its agent API, its own store with the model tiny)."""
    store = Store(tmp_path / "control.db")
    store.add_model(MODEL)
    with serving(tmp_path, [store]) as made:
        yield made


def running(fleet: Fleet, *, watch: bool = True) -> tuple[Agent, Recorded, Callable[[], None]]:
    """node-a's agent beating every HEARTBEAT_S in a thread, registered; and its stop."""
    agent = fleet.agent(fleet.url(0), fleet.tmp / "agent")
    agent.config = agent.config.model_copy(update={"heartbeat_s": HEARTBEAT_S})
    agent.watching = watch
    workload = agent.workload = Recorded()
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    until("node-a's first beat", lambda: workload.came, lambda: agent.failures)

    def stopped() -> None:
        stop.set()
        thread.join(10)
    return agent, workload, stopped


def until(what: str, done: Callable[[], Any], last: Callable[[], Any],
          timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := done()):
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}; last: {last()}"
        time.sleep(0.02)
    return found


def place(store: Store, rid: str) -> float:
    """What the scheduler does: a replica of tiny on node-a; returns when."""
    store.put_replica({"id": rid, "model": "tiny", "node": "node-a", "profile": "cpu",
                       "state": "pending", "err": ""})
    return time.monotonic()


def learned_after(workload: Recorded, rid: str, placed: float) -> float:
    came = until(f"node-a to be told of {rid}",
                 lambda: next((t for t, ids in workload.came if rid in ids), None),
                 lambda: workload.came, timeout_s=3 * HEARTBEAT_S)
    return came - placed


def settle_into_beats() -> None:
    """Past the beats that follow registering, into the 5 s rhythm, the watch held."""
    time.sleep(1.0)


def test_a_new_replica_reaches_a_node_beating_every_5_s_within_a_second(fleet: Fleet) -> None:
    agent, workload, stop = running(fleet)
    try:
        settle_into_beats()
        took = learned_after(workload, "r1", place(fleet.stores[0], "r1"))
    finally:
        stop()
    assert took < 1.0, (f"node-a learned of r1 {took:.2f} s after it was placed, at a "
                        f"heartbeat ({HEARTBEAT_S:g} s) rather than through its watch")


def test_negative_control_without_the_watch_it_waits_for_the_next_beat(fleet: Fleet) -> None:
    agent, workload, stop = running(fleet, watch=False)
    try:
        settle_into_beats()
        took = learned_after(workload, "r1", place(fleet.stores[0], "r1"))
    finally:
        stop()
    assert took >= 1.0, f"without a watch node-a still learned of r1 in {took:.2f} s"


def test_a_watch_is_answered_unchanged_after_its_hold_and_changed_at_once(
        fleet: Fleet) -> None:
    """A hold of 0.5 s: unchanged, with the same revision; then, with the revision of an
    answer before a placement, changed at once with the new one."""
    api = fleet.servers[0].api
    api.watches.hold_s = 0.5
    before = api.heartbeat("node-a", {})["revision"]
    with AgentClient(fleet.url(0), fleet.tls, timeout=10) as client:
        started = time.monotonic()
        assert client.watch(before) == {"changed": False, "revision": before}
        held = time.monotonic() - started
        place(fleet.stores[0], "r1")
        started = time.monotonic()
        answer = client.watch(before)
        took = time.monotonic() - started
    after = api.heartbeat("node-a", {})["revision"]
    assert held >= 0.5, f"an unchanged watch was answered after {held:.2f} s, not held"
    assert answer == {"changed": True, "revision": after} and after != before, answer
    assert took < 0.5, f"a changed watch took {took:.2f} s"
    assert len(api.watches) == 0, "an answered watch is still held"


def test_a_placement_while_the_watch_is_held_answers_it(fleet: Fleet) -> None:
    api = fleet.servers[0].api
    since = api.heartbeat("node-a", {})["revision"]
    answers: list[Any] = []
    with AgentClient(fleet.url(0), fleet.tls, timeout=10) as client:
        thread = threading.Thread(target=lambda: answers.append(client.watch(since)))
        thread.start()
        until("the watch to be held", lambda: len(api.watches) == 1, lambda: len(api.watches))
        placed = place(fleet.stores[0], "r1")
        thread.join(5)
        took = time.monotonic() - placed
    assert answers and answers[0]["changed"] is True, answers
    assert took < 2 * _watch.CHECK_EVERY_S + 0.5, f"answered {took:.2f} s after the placement"


def test_a_client_that_leaves_holds_nothing(fleet: Fleet,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch's client that gives up after 0.5 s: the held watch goes with it."""
    monkeypatch.setattr(agent_client, "WATCH_TIMEOUT_S", 0.5)
    api = fleet.servers[0].api
    since = api.heartbeat("node-a", {})["revision"]
    with AgentClient(fleet.url(0), fleet.tls, timeout=5) as client, \
            pytest.raises(Exception, match="did not answer"):
        client.watch(since)
    until("the watch to go with its client", lambda: len(api.watches) == 0,
          lambda: len(api.watches), timeout_s=5)


def test_an_older_control_plane_without_the_watch_leaves_the_agent_beating(
        fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    """The route answers 404, as a control plane before it does: the agent stops
    watching (one line says so) and goes on beating, learning at its beats."""
    server = fleet.servers[0]._server
    handle = server._handler

    def older(request: Request) -> Any:
        if request.path == AgentPaths.WATCH:
            return Reply(404, {"detail": f"no such path GET {request.path}"})
        return handle(request)
    server._handler = older
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    agent, workload, stop = running(fleet)
    try:
        until("the agent to stop watching", lambda: not agent.watching,
              lambda: caplog.text[-500:], timeout_s=5)
        place(fleet.stores[0], "r1")
        learned_after(workload, "r1", time.monotonic())
        beats = len(workload.came)
    finally:
        stop()
    assert agent.failures == 0 and beats >= 2, (agent.failures, workload.came)
    assert "has no watch (an older version)" in caplog.text


def test_negative_control_the_404_stand_in_is_what_turns_the_watch_off(fleet: Fleet) -> None:
    agent, workload, stop = running(fleet)
    try:
        time.sleep(1.0)
        watching = agent.watching
    finally:
        stop()
    assert watching, "the agent stopped watching a control plane that has the watch"


def test_revision_is_a_digest_of_exactly_the_assignments() -> None:
    a: Any = [{"id": "r1", "model": "m"}]
    assert _watch.revision(a) == _watch.revision([{"model": "m", "id": "r1"}])
    assert _watch.revision(a) != _watch.revision([{"id": "r2", "model": "m"}])
    assert _watch.revision([]) != _watch.revision(a)
