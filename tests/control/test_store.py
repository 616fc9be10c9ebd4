"""The store: one transaction per heartbeat, reads beside a writer, paging by id."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest

from llmgw.contract.records import RecordError
from llmgw.control.store import Store

SPEC = {"name": "m", "source": "http://mirror/m.gguf", "sha256": "",
        "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "", "args": []}]}


def test_heartbeat_records_applies_reports_and_returns_only_this_nodes_replicas(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "db")
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
    states = {r["id"]: r["state"] for r in store.replicas()}
    # A node reports on its own replicas only, and a stopped one stays stopped.
    assert states == {"r1": "ready", "r2": "pending", "r3": "stopped"}
    assert store.node("a")["serial"] == "ABC"
    store.close()


def test_nodes_page_by_id(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    for n in ["n3", "n1", "n2", "n4"]:
        store.record_heartbeat(n, {})
    assert [n["id"] for n in store.nodes()] == ["n1", "n2", "n3", "n4"]
    assert [n["id"] for n in store.nodes(limit=2)] == ["n1", "n2"]
    assert [n["id"] for n in store.nodes(limit=2, after="n2")] == ["n3", "n4"]
    assert store.nodes(limit=2, after="n4") == []
    store.close()


def test_reads_do_not_wait_for_a_writer(tmp_path: Path) -> None:
    """A reader on another thread reads while a write transaction is open (WAL, no lock)."""
    store = Store(tmp_path / "db")
    store.record_heartbeat("n1", {})
    read: list[int] = []
    with store._tx() as db:
        db.execute("UPDATE nodes SET last_seen = 0")
        t = threading.Thread(target=lambda: read.append(len(store.nodes())))
        t.start()
        t.join(timeout=5)
    assert read == [1]
    store.close()


def test_tokens_are_single_use_and_expire(tmp_path: Path) -> None:
    now = [1000.0]
    store = Store(tmp_path / "db", clock=lambda: now[0])
    store.add_token("h1", 60)
    store.add_token("h2", 60)
    assert store.use_token("h1", "n2") == "ok"
    assert store.use_token("h1", "n3") == "used by n2"
    now[0] += 61
    assert store.use_token("h2", "n3") == "expired"
    assert store.use_token("nope", "n3") == "unknown"
    store.close()


def test_an_old_database_gains_the_serial_column(tmp_path: Path) -> None:
    import sqlite3
    db = sqlite3.connect(tmp_path / "db")
    db.execute("CREATE TABLE nodes (id TEXT PRIMARY KEY, inventory TEXT NOT NULL, "
               "first_seen REAL NOT NULL, last_seen REAL NOT NULL)")
    db.execute("INSERT INTO nodes VALUES ('old', '{}', 1, 1)")
    db.commit()
    db.close()
    store = Store(tmp_path / "db")
    assert store.node("old")["serial"] == ""
    store.close()


def test_the_log_is_checkpointed_off_the_writer(tmp_path: Path) -> None:
    """Commits never checkpoint (a heartbeat must not wait for a sync); checkpoint() does."""
    store = Store(tmp_path / "db")
    for i in range(2000):
        store.record_heartbeat(f"n{i}", {"pad": "x" * 500})
    wal = tmp_path / "db-wal"
    grown = wal.stat().st_size
    assert grown > 1000 * 4096, "past the default threshold, no commit checkpointed"
    store.checkpoint()
    assert len(Store(tmp_path / "db").nodes()) == 2000
    store.close()


def test_a_changed_inventory_is_read_again_and_an_unchanged_one_is_not(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    store.record_heartbeat("n1", {"engines": []})
    first = store.nodes()[0]["inventory"]
    store.record_heartbeat("n1", {"engines": []})
    assert store.nodes()[0]["inventory"] is first, "unchanged: the parsed copy is reused"
    store.record_heartbeat("n1", {"engines": ["llamacpp"]})
    assert store.nodes()[0]["inventory"] == {"engines": ["llamacpp"]}
    assert store.node("n1")["inventory"] == {"engines": ["llamacpp"]}
    store.close()


def test_a_replica_with_an_unknown_state_or_key_is_refused_and_not_stored(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "db")
    row = {"id": "r1", "model": "m", "node": "", "profile": "cpu", "state": "pending"}
    with pytest.raises(RecordError, match="state is 'paused': Input should be 'pending'"):
        store.put_replica({**row, "state": "paused"})
    with pytest.raises(RecordError, match="colour is not a known key"):
        store.put_replica({**row, "colour": "red"})
    assert store.replicas() == []
    store.put_replica(row)  # negative control: the valid record is stored
    with pytest.raises(RecordError, match="state"):
        store.update_replica("r1", state="paused")
    assert [r["state"] for r in store.replicas()] == ["pending"]
    store.close()


def test_an_inventory_with_a_wrong_type_is_refused_naming_the_key(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    with pytest.raises(RecordError, match=r"node n1's inventory refused: memory_mb is 'lots'"):
        store.record_heartbeat("n1", {"memory_mb": "lots"})
    assert store.nodes() == []
    # A key a newer agent adds is kept as sent.
    store.record_heartbeat("n1", {"memory_mb": 512, "future": {"x": 1}})
    assert store.node("n1")["inventory"] == {"memory_mb": 512, "future": {"x": 1}}
    store.close()


def _old_database(path: Path, inventory: str) -> None:
    """Rows as the previous main wrote them: plain JSON text, no inv_version or serial."""
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE nodes (id TEXT PRIMARY KEY, inventory TEXT NOT NULL, "
        "first_seen REAL NOT NULL, last_seen REAL NOT NULL);"
        "CREATE TABLE replicas (id TEXT PRIMARY KEY, model TEXT NOT NULL, node TEXT NOT NULL, "
        "profile TEXT NOT NULL, state TEXT NOT NULL, err TEXT NOT NULL DEFAULT '', "
        "endpoint TEXT NOT NULL DEFAULT '', api_key TEXT NOT NULL DEFAULT '', "
        "updated REAL NOT NULL);")
    db.execute("INSERT INTO nodes VALUES ('n1', ?, 1, 2)", (inventory,))
    db.execute("INSERT INTO replicas VALUES ('r1', 'm', 'n1', 'cpu', 'ready', '', "
               "'http://127.0.0.1:9', 'k', 3)")
    db.commit()
    db.close()


def test_a_database_written_by_the_previous_release_loads(tmp_path: Path) -> None:
    inventory = {"node_id": "n1", "claimed_id": "n1", "cpus": 2, "memory_mb": 2048,
                 "gpus": [{"index": 0, "name": "NVIDIA H100", "memory_mb": 81559,
                           "uuid": "GPU-1", "class": "h100-80gb"}],
                 "labels": {"zone": "a"}, "engines": ["llamacpp"],
                 "provision": [{"engine": "llamacpp", "version": "0.3.36", "state": "ready",
                                "detail": ""}],
                 "interface": "lo", "addr": "127.0.0.1", "warnings": [],
                 "replica_state_changes": {"r1": {"model": "m", "to": {"ready": 1}}},
                 "replica_logs": {"r1": ["line"]}}
    _old_database(tmp_path / "db", json.dumps(inventory))
    store = Store(tmp_path / "db")
    assert store.node("n1") == {"id": "n1", "inventory": inventory, "first_seen": 1,
                                "last_seen": 2, "serial": ""}
    assert store.replicas() == [{"id": "r1", "model": "m", "node": "n1", "profile": "cpu",
                                 "state": "ready", "err": "", "endpoint": "http://127.0.0.1:9",
                                 "api_key": "k", "gpus": [], "updated": 3}]
    store.close()


def test_an_old_invalid_inventory_is_shown_as_a_warning_not_a_crash(tmp_path: Path) -> None:
    """One bad row stored before inventories were checked never stops the readers."""
    _old_database(tmp_path / "db", json.dumps({"cpus": "many"}))
    store = Store(tmp_path / "db")
    (warning,) = store.node("n1")["inventory"]["warnings"]
    assert "cpus" in warning and "next heartbeat replaces it" in warning
    store.record_heartbeat("n1", {"cpus": 2})
    assert store.node("n1")["inventory"] == {"cpus": 2}
    store.close()


def test_a_model_stored_before_a_field_existed_is_read_with_the_catalogs_defaults(
        tmp_path: Path) -> None:
    """Readers never hedge (`.get("routing_profile", "chat")`): the store fills in what an
    older row lacks, as the catalog would have."""
    import sqlite3

    store = Store(tmp_path / "db")
    old = {"name": "m", "source": "http://mirror/m.gguf", "scaling": {"min": 1, "max": 1},
           "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "",
                         "priority": 100, "min_memory_gb": 0, "node_selector": {},
                         "args": []}]}
    with sqlite3.connect(tmp_path / "db") as db:
        db.execute("INSERT INTO models (name, spec, created) VALUES (?, ?, 0)",
                   ("m", json.dumps(old)))
        (raw,) = db.execute("SELECT spec FROM models").fetchone()
    assert "routing_profile" not in json.loads(raw), "negative control: the row lacks it"
    (model,) = store.models()
    assert (model["routing_profile"], model["sha256"], model["size_bytes"]) == ("chat", "", 0)
    assert model["aliases"] == [] and model["geometry"]["context_length"] == 0
    model["aliases"].append("x")
    assert store.model("m")["aliases"] == [], "each read gets its own defaults"
    store.close()
