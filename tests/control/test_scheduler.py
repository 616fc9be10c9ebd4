"""Scheduling as pure logic: which node and profile each replica gets, and why not."""

from __future__ import annotations

import copy
from typing import Any

from llmgw.contract.catalog import SPEC_DEFAULTS
from llmgw.control.scheduler import plan

PIN = {"llmgw.control-plane": "true"}


def node(id: str, state: str = "ready", labels: dict | None = None, gpus: list | None = None,
         memory_mb: int = 16_000, engines: tuple | None = None) -> dict[str, Any]:
    """A node view; one with GPUs has its GPU engine ready unless engines says otherwise."""
    if engines is None:
        engines = ("llamacpp", "llamacpp-cuda") if gpus else ("llamacpp",)
    return {"id": id, "state": state, "labels": labels if labels is not None else dict(PIN),
            "gpus": gpus or [], "memory_mb": memory_mb, "engines": list(engines)}


def model(name: str = "m", min: int = 1, max: int = 1, gpu: str = "", selector=PIN) -> dict:
    profiles = [{"name": "cpu", "engine": "llamacpp", "gpu_class": "", "priority": 100,
                 "min_memory_gb": 2, "node_selector": dict(selector), "args": []}]
    if gpu:
        profiles.insert(0, {"name": f"gpu-{gpu}", "engine": "llamacpp", "gpu_class": gpu,
                            "priority": 200, "min_memory_gb": 2, "node_selector": dict(selector),
                            "args": []})
    # As the store hands a model out: the catalog's defaults filled in.
    return {**copy.deepcopy(SPEC_DEFAULTS), "name": name, "scaling": {"min": min, "max": max},
            "profiles": profiles}


def replica(id: str, node: str, state: str = "ready", model: str = "m", profile: str = "cpu",
            gpus: list[str] | None = None):
    return {"id": id, "model": model, "node": node, "profile": profile, "state": state,
            "gpus": gpus or []}


H200 = [{"index": 0, "class": "h200", "memory_mb": 143_000, "uuid": "GPU-h200-0"}]


def test_places_min_replicas_on_a_fitting_node() -> None:
    p = plan([model(min=1)], [node("a")], [])
    assert [(r["node"], r["profile"], r["state"]) for r in p.add] == [("a", "cpu", "pending")]


def test_prefers_the_highest_priority_profile_that_fits() -> None:
    p = plan([model(gpu="h200")], [node("a", gpus=H200)], [])
    assert p.add[0]["profile"] == "gpu-h200"


def test_a_busy_gpu_falls_back_to_the_cpu_profile() -> None:
    other = replica("x", "a", model="other", profile="gpu-h200")
    p = plan([model(gpu="h200"), model("other", gpu="h200")], [node("a", gpus=H200)], [other])
    assert [(r["model"], r["profile"]) for r in p.add] == [("m", "cpu")]


def test_a_label_no_node_has_stays_pending_and_says_why() -> None:
    p = plan([model(selector={"zone": "mars"})], [node("a")], [])
    assert p.add[0]["node"] == "" and p.add[0]["state"] == "pending"
    assert "lacks the label zone=mars" in p.add[0]["err"]


def test_a_waiting_replica_is_placed_once_a_node_fits() -> None:
    waiting = replica("w", "", state="pending")
    assert plan([model()], [node("a", state="provisioning")], [waiting]).waiting["w"]
    assert plan([model()], [node("a")], [waiting]).place == {"w": ("a", "cpu", [])}


def test_not_ready_node_loses_its_replicas_to_another_that_fits() -> None:
    p = plan([model()], [node("a", state="not_ready"), node("b")], [replica("r", "a")])
    assert "not_ready" in p.stop["r"]
    assert [r["node"] for r in p.add] == ["b"]


def test_a_node_checking_its_engine_again_keeps_its_replicas() -> None:
    """An agent that restarts reports `provisioning` for a moment; its engines still serve."""
    p = plan([model()], [node("a", state="provisioning")], [replica("r", "a")])
    assert not (p.add or p.stop)


def test_deleted_model_stops_its_replicas() -> None:
    p = plan([], [node("a")], [replica("r", "a")])
    assert "deleted" in p.stop["r"] and not p.add


def test_never_more_than_max_and_spread_over_nodes() -> None:
    p = plan([model(min=2, max=2)], [node("a"), node("b")], [])
    assert sorted(r["node"] for r in p.add) == ["a", "b"]
    three = [replica(f"r{i}", "a") for i in range(3)]
    assert list(plan([model(min=1, max=2)], [node("a")], three).stop) == ["r2"]


def test_memory_and_engine_are_required() -> None:
    assert plan([model()], [node("a", memory_mb=1000)], []).add[0]["node"] == ""
    assert "no llamacpp engine" in plan([model()], [node("a", engines=())], []).add[0]["err"]


def test_satisfied_model_changes_nothing() -> None:
    p = plan([model()], [node("a")], [replica("r", "a")])
    assert not (p.add or p.stop or p.place or p.waiting)


def test_tick_applies_the_plan_and_forgets_long_stopped_replicas(tmp_path) -> None:
    from llmgw.control.scheduler import KEEP_STOPPED_S, Scheduler
    from llmgw.store import Store

    now = [1000.0]
    store = Store(tmp_path / "db", clock=lambda: now[0])
    store.record_heartbeat("a", {"engines": ["llamacpp"], "labels": PIN, "memory_mb": 16_000})
    store.add_model(model())
    Scheduler(store, node_timeout_s=30).tick()
    (r,) = store.replicas()
    assert (r["node"], r["state"]) == ("a", "pending")
    store.delete_model("m")
    Scheduler(store, node_timeout_s=30).tick()
    assert store.replicas()[0]["state"] == "stopped"
    now[0] += KEEP_STOPPED_S + 1
    store.record_heartbeat("a", {"engines": ["llamacpp"], "labels": PIN})
    Scheduler(store, node_timeout_s=30).tick()
    assert store.replicas() == []
