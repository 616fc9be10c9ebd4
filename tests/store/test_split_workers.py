"""A replica split over nodes in the store, on both backends: the revision that adds its
`workers`; each worker's heartbeat reads the replica with its own entry; a worker's report
changes that entry alone (its state, error, relay port and management address), never the
replica's state or endpoint, which are its main node's; a stopped one is no worker's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from llmgw.contract import ReplicaState
from llmgw.store import Store
from llmgw.store._db import _alembic_config

OpenStore = Callable[..., Store]
SPEC = {"name": "big", "source": "http://mirror/big.gguf", "sha256": "",
        "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "", "args": [],
                      "nodes": "auto"}]}
SPLIT: dict[str, Any] = {
    "id": "r1", "model": "big", "node": "a", "profile": "cpu", "state": "pending",
    "gpus": [], "workers": [{"node": "b", "layers": 10, "addr": "", "port": 0},
                            {"node": "c", "layers": 8, "addr": "", "port": 0}]}
# The revision that adds replicas.workers, and the one before (renumbered with the file,
# should revisions merge).
WORKERS_REVISION, BEFORE_WORKERS = "0007", "0006"


def _store(open_store: OpenStore) -> Store:
    store = open_store()
    store.add_model(SPEC)  # type: ignore[arg-type]
    store.put_replica(SPLIT)  # type: ignore[arg-type]
    return store


def _report(state: str, **more: Any) -> dict[str, Any]:
    return {"r1": {"state": ReplicaState(state), "err": "", "endpoint": "", "api_key": "",
                   **more}}


def test_the_workers_revision_adds_the_column_keeping_replicas(store_at: str) -> None:
    """A store at the revision before gains replicas.workers, its replicas kept and read
    as on one node (no workers). (Its control: before it, the column is not there.)"""
    from alembic import command

    from llmgw.store import store_url

    engine = sa.create_engine(store_url(store_at))
    config = _alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, BEFORE_WORKERS)
        conn.execute(sa.text("INSERT INTO replicas (id, model, node, profile, state, updated) "
                             "VALUES ('r0', 'm', 'n1', 'cpu', 'ready', 1)"))
        assert "workers" not in {c["name"] for c in sa.inspect(conn).get_columns("replicas")}
        command.upgrade(config, WORKERS_REVISION)
        assert "workers" in {c["name"] for c in sa.inspect(conn).get_columns("replicas")}
    engine.dispose()
    again = Store(store_at)
    (r0,) = again.replicas()
    assert r0["node"] == "n1" and "workers" not in r0
    again.put_replica(SPLIT)  # type: ignore[arg-type]
    assert [(r["id"], r.get("workers")) for r in again.replicas()] == [
        ("r1", SPLIT["workers"]), ("r0", None)]
    again.close()


def test_each_worker_reads_the_split_replica_with_its_own_entry(open_store: OpenStore) -> None:
    """The main node reads it as its own (no share), each worker with its entry; a node
    that is neither reads nothing of it (the control)."""
    store = _store(open_store)
    (main,) = store.heartbeat("a", {"addr": "10.0.0.1"}, "", {})
    assert main["node"] == "a" and "share" not in main and main["spec"] is not None
    (b,) = store.heartbeat("b", {"addr": "10.0.0.2"}, "", {})
    assert b["id"] == "r1" and b["share"] == SPLIT["workers"][0]
    (c,) = store.heartbeat("c", {"addr": "10.0.0.3"}, "", {})
    assert c["share"]["layers"] == 8
    assert store.heartbeat("d", {"addr": "10.0.0.4"}, "", {}) == []


def test_a_workers_report_changes_its_entry_alone(open_store: OpenStore) -> None:
    """b reports its share ready on relay port 7001: its entry says so with the address
    its inventory gives; the replica stays pending, its endpoint empty, c's entry as it
    was. The control: the same report from the main node makes the replica ready."""
    store = _store(open_store)
    other = open_store()
    store.heartbeat("b", {"addr": "10.0.0.2"}, "",
                    _report("ready", endpoint="http://x", relay_port=7001))
    (r1,) = other.replicas()
    assert (r1["state"], r1["endpoint"]) == ("pending", "")
    assert r1["workers"] == [{"node": "b", "layers": 10, "addr": "10.0.0.2", "port": 7001,
                              "state": "ready", "err": ""},
                             {"node": "c", "layers": 8, "addr": "", "port": 0}]
    # c reports too, then fails: both entries are kept, each its own.
    store.heartbeat("c", {"addr": "10.0.0.3"}, "", _report("starting"))
    store.heartbeat("c", {"addr": "10.0.0.3"}, "",
                    _report("failed", err="rpc-server exited with 1"))
    (r1,) = other.replicas()
    assert [(w["node"], w.get("state"), w.get("err"), w["port"]) for w in r1["workers"]] == [
        ("b", "ready", "", 7001), ("c", "failed", "rpc-server exited with 1", 0)]
    assert r1["state"] == "pending"
    store.heartbeat("a", {"addr": "10.0.0.1"}, "",
                    _report("ready", endpoint="http://10.0.0.1:9000", relay_port=5))
    (r1,) = other.replicas()
    assert (r1["state"], r1["endpoint"]) == ("ready", "http://10.0.0.1:9000")
    assert r1["workers"][0]["port"] == 7001, "the main's relay_port is no worker's"


def test_a_stopped_split_replica_is_no_workers_and_its_report_changes_nothing(
        open_store: OpenStore) -> None:
    """Once the scheduler stopped r1, worker b (back after a fault) reads nothing of it and
    its report of r1 writes nothing. The control: while r1 is live, b reads it."""
    store = _store(open_store)
    assert [r["id"] for r in store.heartbeat("b", {}, "", {})] == ["r1"]
    store.update_replica("r1", state=ReplicaState.STOPPED, err="its worker b is not ready")
    assert store.heartbeat("b", {"addr": "10.0.0.2"}, "", _report("ready", relay_port=7001)) \
        == []
    (r1,) = store.replicas()
    assert r1["state"] == "stopped" and r1["workers"][0]["port"] == 0
