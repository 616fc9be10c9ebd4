"""Nodes and certificates, on both backends: one transaction per heartbeat, paging by id,
inventories checked and re-read only when they change, removal revoking certificates."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmgw.contract.records import RecordError
from llmgw.store import Store

OpenStore = Callable[..., Store]
SPEC = {"name": "m", "source": "http://mirror/m.gguf", "sha256": "",
        "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "", "args": []}]}


def test_heartbeat_records_applies_reports_and_returns_only_this_nodes_replicas(
        open_store: OpenStore) -> None:
    store = open_store()
    store.add_model(SPEC)
    for rid, node, state in [("r1", "a", "pending"), ("r2", "b", "pending"),
                             ("r3", "a", "stopped")]:
        store.put_replica({"id": rid, "model": "m", "node": node, "profile": "cpu",
                           "state": state})
    reports = {"r1": {"state": "ready", "err": "", "endpoint": "http://a:1", "api_key": "k"},
               "r2": {"state": "ready", "err": "", "endpoint": "x", "api_key": "x"},
               "r3": {"state": "ready", "err": "", "endpoint": "x", "api_key": "x"}}
    rows = store.heartbeat("a", {"cpus": 2}, "ABC", reports)
    assert [r["id"] for r in rows] == ["r1"] and rows[0]["spec"]["name"] == "m"
    assert rows[0]["state"] == "ready", "the answer holds what the beat reported"
    states = {r["id"]: r["state"] for r in store.replicas()}
    # A node reports on its own replicas only, and a stopped one stays stopped.
    assert states == {"r1": "ready", "r2": "pending", "r3": "stopped"}
    assert store.node("a")["serial"] == "ABC"


def test_a_replica_whose_model_is_gone_comes_back_without_a_spec(open_store: OpenStore) -> None:
    store = open_store()
    store.put_replica({"id": "r1", "model": "gone", "node": "a", "profile": "cpu",
                       "state": "pending"})
    (row,) = store.heartbeat("a", {}, "", {})
    assert row["spec"] is None


def test_nodes_page_by_id(open_store: OpenStore) -> None:
    store = open_store()
    for n in ["n3", "n1", "n2", "n4"]:
        store.record_heartbeat(n, {})
    assert [n["id"] for n in store.nodes()] == ["n1", "n2", "n3", "n4"]
    assert [n["id"] for n in store.nodes(limit=2)] == ["n1", "n2"]
    assert [n["id"] for n in store.nodes(limit=2, after="n2")] == ["n3", "n4"]
    assert store.nodes(limit=2, after="n4") == []


def test_a_changed_inventory_is_read_again_and_an_unchanged_one_is_not(
        open_store: OpenStore) -> None:
    store = open_store()
    store.record_heartbeat("n1", {"engines": []})
    first = store.nodes()[0]["inventory"]
    store.record_heartbeat("n1", {"engines": []})
    assert store.nodes()[0]["inventory"] is first, "unchanged: the parsed copy is reused"
    store.record_heartbeat("n1", {"engines": ["llamacpp"]})
    assert store.nodes()[0]["inventory"] == {"engines": ["llamacpp"]}
    assert store.node("n1")["inventory"] == {"engines": ["llamacpp"]}


def test_another_process_sees_a_changed_inventory(open_store: OpenStore) -> None:
    """The cache is keyed by the row's version: a second store on the same database (the
    gateway, another control plane) reads the change, never its stale copy."""
    writer, reader = open_store(), open_store()
    writer.record_heartbeat("n1", {"engines": []})
    assert reader.node("n1")["inventory"] == {"engines": []}
    writer.record_heartbeat("n1", {"engines": ["llamacpp"]})
    assert reader.node("n1")["inventory"] == {"engines": ["llamacpp"]}


def test_an_inventory_with_a_wrong_type_is_refused_naming_the_key(
        open_store: OpenStore) -> None:
    store = open_store()
    with pytest.raises(RecordError, match=r"node n1's inventory refused: memory_mb is 'lots'"):
        store.record_heartbeat("n1", {"memory_mb": "lots"})
    assert store.nodes() == []
    # A key a newer agent adds is kept as sent.
    store.record_heartbeat("n1", {"memory_mb": 512, "future": {"x": 1}})
    assert store.node("n1")["inventory"] == {"memory_mb": 512, "future": {"x": 1}}


def test_removing_a_node_revokes_its_certificates_and_stops_its_replicas(
        open_store: OpenStore) -> None:
    store = open_store()
    store.add_cert("S1", "n1", 2e9)
    store.add_cert("S9", "n9", 2e9)
    store.record_heartbeat("n1", {}, serial="S2")
    store.put_replica({"id": "r1", "model": "m", "node": "n1", "profile": "cpu",
                       "state": "ready"})
    assert store.node_known("n1") and store.revoked_serials() == []
    assert store.remove_node("n1", "removed by the admin") == ["S1", "S2"]
    assert store.revoked_serials() == ["S1", "S2"]
    assert not store.node_known("n1") and store.node_known("n9")
    (replica,) = store.replicas()
    assert (replica["state"], replica["err"]) == ("stopped", "removed by the admin")
    assert store.remove_node("n1", "again") is None, "nothing left to remove"


def test_a_restarted_process_hears_from_when_the_last_node_was_heard(
        open_store: OpenStore) -> None:
    now = [1000.0]
    first = open_store(clock=lambda: now[0])
    assert first.hearing.last_before == float("-inf")
    first.record_heartbeat("n1", {})
    now[0] = 1010.0
    again = open_store(clock=lambda: now[0])
    assert (again.hearing.last_before, again.hearing.since) == (1000.0, 1010.0)
