"""The store: one transaction per heartbeat, reads beside a writer, paging by id."""

from __future__ import annotations

import threading
from pathlib import Path

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
