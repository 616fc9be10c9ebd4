"""Models on demand as the scheduler's pure logic: a waited-for model gets one replica, an
idle one goes after scaling.idle_s, and a model with no room evicts the least recently used
idle replica of another model, never one with a request in flight or waiting."""

from __future__ import annotations

from typing import Any

from llmgw.contract import ModelState, model_state
from llmgw.control import _demand
from llmgw.control.scheduler import plan
from llmgw.store import Use
from tests.control.test_scheduler import model, node, replica

NOW = 10_000.0


def cold(name: str, idle_s: int = 60) -> dict[str, Any]:
    """A model at scaling.min 0, 4 GB on CPU: a 10 GB node has room for two."""
    m = model(name, min=0, max=1)
    m["scaling"]["idle_s"] = idle_s
    m["profiles"][0]["min_memory_gb"] = 4
    return m


def ready(id: str, name: str, updated: float = NOW - 1000) -> dict[str, Any]:
    return {**replica(id, "a", model=name), "updated": updated}


ROOM_FOR_TWO = node("a", memory_mb=10 * 1024)


def test_a_model_at_zero_gets_one_replica_only_while_requests_wait_for_it() -> None:
    assert plan([cold("m")], [ROOM_FOR_TWO], [], {}, NOW).add == []
    p = plan([cold("m")], [ROOM_FOR_TWO], [], {"m": Use(waiting=30)}, NOW)
    assert [(r["model"], r["node"]) for r in p.add] == [("m", "a")]  # one, not thirty
    # Control: with a replica live already, the waiters start no second one.
    assert plan([cold("m")], [ROOM_FOR_TWO], [ready("r1", "m")],
                {"m": Use(waiting=30)}, NOW).add == []


def test_a_replica_idle_past_idle_s_is_removed_and_named_so() -> None:
    idle = {"m": Use(last_used=NOW - 61)}
    p = plan([cold("m", idle_s=60)], [ROOM_FOR_TWO], [ready("r1", "m")], idle, NOW)
    assert list(p.stop) == ["r1"] and "no request for 61 s (scaling.idle_s 60)" in p.stop["r1"]
    assert [(e.replica, e.reason) for e in p.evicted] == [("r1", "idle")]
    # Controls: used within idle_s, a request in flight, idle_s 0, or at its min: kept.
    assert plan([cold("m", 60)], [ROOM_FOR_TWO], [ready("r1", "m")],
                {"m": Use(last_used=NOW - 59)}, NOW).stop == {}
    assert plan([cold("m", 60)], [ROOM_FOR_TWO], [ready("r1", "m")],
                {"m": Use(in_flight=1, last_used=NOW - 600)}, NOW).stop == {}
    assert plan([cold("m", 0)], [ROOM_FOR_TWO], [ready("r1", "m")], idle, NOW).stop == {}
    pinned = {**cold("m", 60), "scaling": {"min": 1, "max": 1, "idle_s": 60}}
    assert plan([pinned], [ROOM_FOR_TWO], [ready("r1", "m")], idle, NOW).stop == {}


def test_a_model_with_no_room_evicts_the_least_recently_used_idle_one() -> None:
    models = [cold("a1", 0), cold("a2", 0), cold("b", 0)]
    running = [ready("r1", "a1"), ready("r2", "a2")]
    uses = {"a1": Use(last_used=NOW - 50), "a2": Use(last_used=NOW - 500), "b": Use(waiting=1)}
    p = plan(models, [ROOM_FOR_TWO], running, uses, NOW)
    assert list(p.stop) == ["r2"]
    eviction = p.evicted[0]
    assert (eviction.replica, eviction.model, eviction.wanted_by, eviction.reason) == \
        ("r2", "a2", "b", "no_room")
    assert "evicted replica r2 of a2 on a for b" in p.stop["r2"]
    assert "no node had room" in p.stop["r2"]
    assert [(r["model"], r["node"]) for r in p.add] == [("b", "a")]


def test_a_model_with_a_request_in_flight_or_waiting_is_never_evicted() -> None:
    models = [cold("a1", 0), cold("a2", 0), cold("b", 0)]
    running = [ready("r1", "a1"), ready("r2", "a2")]
    busy = {"a1": Use(in_flight=1, last_used=NOW - 900), "a2": Use(waiting=1),
            "b": Use(waiting=1)}
    p = plan(models, [ROOM_FOR_TWO], running, busy, NOW)
    assert p.stop == {} and p.evicted == []
    assert [(r["model"], r["node"]) for r in p.add] == [("b", "")]
    assert "under 4" in p.add[0]["err"]
    # Control: with a1's stream over, a1 (the least recently used) goes for b.
    idle = {**busy, "a1": Use(last_used=NOW - 900)}
    assert list(plan(models, [ROOM_FOR_TWO], running, idle, NOW).stop) == ["r1"]


def test_no_eviction_for_a_model_nobody_waits_for() -> None:
    models = [cold("a1", 0), cold("a2", 0), {**cold("b", 0), "scaling":
                                                {"min": 1, "max": 1, "idle_s": 0}}]
    p = plan(models, [ROOM_FOR_TWO], [ready("r1", "a1"), ready("r2", "a2")], {}, NOW)
    assert p.stop == {}


def test_evictable_keeps_each_model_at_its_min() -> None:
    pinned = {**cold("a1"), "scaling": {"min": 1, "max": 1, "idle_s": 60}}
    found = _demand.evictable([ready("r1", "a1")], {"a1": pinned}, {}, "b")
    assert found == []


def test_a_models_state_follows_its_replicas() -> None:
    assert model_state([]) == ModelState.IDLE
    assert model_state(["stopped"]) == ModelState.IDLE
    assert model_state(["pending", "stopped"]) == ModelState.LOADING
    assert model_state(["starting", "ready"]) == ModelState.SERVING


def test_a_replica_no_node_had_room_for_goes_once_nothing_waits_for_it() -> None:
    """It holds nothing, and would show the model loading for ever; the next request asks
    again. Control: while a request waits, it stays (the scheduler keeps trying)."""
    unplaced = {**replica("r1", "", state="pending", model="m"), "updated": NOW,
                "err": "no ready node fits any profile"}
    p = plan([cold("m", 0)], [ROOM_FOR_TWO], [unplaced], {"m": Use(last_used=NOW)}, NOW)
    assert list(p.stop) == ["r1"] and "no request waits for m any more" in p.stop["r1"]
    assert p.evicted == [] and p.add == []
    waited = plan([cold("m", 0)], [ROOM_FOR_TWO], [unplaced], {"m": Use(waiting=1)}, NOW)
    assert waited.stop == {}
