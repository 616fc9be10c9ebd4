"""The control plane's state in SQLite (WAL): nodes, catalog models and replicas."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY,
    inventory TEXT NOT NULL,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS replicas (
    id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    node TEXT NOT NULL,
    profile TEXT NOT NULL,
    state TEXT NOT NULL,
    err TEXT NOT NULL DEFAULT '',
    endpoint TEXT NOT NULL DEFAULT '',
    api_key TEXT NOT NULL DEFAULT '',
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS replicas_by_model ON replicas (model);
"""


class Store:
    """One SQLite database shared by the API threads; every call is one transaction."""

    def __init__(self, path: str | Path, clock: Any = time.time) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self.clock = clock
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- nodes ---

    def record_heartbeat(self, node_id: str, inventory: dict[str, Any]) -> None:
        now = self.clock()
        with self._tx() as db:
            db.execute(
                "INSERT INTO nodes (id, inventory, first_seen, last_seen) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET inventory=excluded.inventory, "
                "last_seen=excluded.last_seen",
                (node_id, json.dumps(inventory), now, now),
            )

    def nodes(self) -> list[dict[str, Any]]:
        """Every node: id, inventory, first_seen, last_seen."""
        with self._tx() as db:
            rows = db.execute("SELECT * FROM nodes ORDER BY id").fetchall()
        return [
            {
                "id": r["id"],
                "inventory": json.loads(r["inventory"]),
                "first_seen": r["first_seen"],
                "last_seen": r["last_seen"],
            }
            for r in rows
        ]

    # --- catalog ---

    def add_model(self, spec: dict[str, Any]) -> bool:
        """Add a model; False when the name is taken."""
        with self._tx() as db:
            try:
                db.execute(
                    "INSERT INTO models (name, spec, created) VALUES (?, ?, ?)",
                    (spec["name"], json.dumps(spec), self.clock()),
                )
            except sqlite3.IntegrityError:
                return False
        return True

    def models(self) -> list[dict[str, Any]]:
        with self._tx() as db:
            rows = db.execute("SELECT spec FROM models ORDER BY created, name").fetchall()
        return [json.loads(r["spec"]) for r in rows]

    def created(self) -> dict[str, int]:
        """When each model entered the catalog (unix seconds), for the gateway's `created`."""
        with self._tx() as db:
            rows = db.execute("SELECT name, created FROM models").fetchall()
        return {r["name"]: int(r["created"]) for r in rows}

    def model(self, name: str) -> dict[str, Any] | None:
        with self._tx() as db:
            row = db.execute("SELECT spec FROM models WHERE name = ?", (name,)).fetchone()
        return json.loads(row["spec"]) if row else None

    def delete_model(self, name: str) -> bool:
        with self._tx() as db:
            cur = db.execute("DELETE FROM models WHERE name = ?", (name,))
        return cur.rowcount > 0

    # --- replicas ---

    def put_replica(self, replica: dict[str, Any]) -> None:
        fields = ("id", "model", "node", "profile", "state", "err", "endpoint", "api_key")
        values = [replica.get(f, "") for f in fields]
        with self._tx() as db:
            db.execute(
                f"INSERT OR REPLACE INTO replicas ({', '.join(fields)}, updated) "
                f"VALUES ({', '.join('?' * len(fields))}, ?)",
                (*values, self.clock()),
            )

    def replicas(self, model: str | None = None) -> list[dict[str, Any]]:
        """Replicas (with their api_key: callers decide what leaves the process)."""
        query, args = "SELECT * FROM replicas", ()
        if model is not None:
            query, args = query + " WHERE model = ?", (model,)
        with self._tx() as db:
            rows = db.execute(query + " ORDER BY model, id", args).fetchall()
        return [dict(r) for r in rows]

    def update_replica(self, replica_id: str, **fields: str) -> None:
        allowed = {"node", "profile", "state", "err", "endpoint", "api_key"}
        if not fields or set(fields) - allowed:
            raise ValueError(f"replica fields to update must be among {sorted(allowed)}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as db:
            db.execute(f"UPDATE replicas SET {sets}, updated = ? WHERE id = ?",
                       (*fields.values(), self.clock(), replica_id))

    def prune_stopped(self, older_than_s: float) -> int:
        """Forget replicas stopped more than older_than_s ago; returns how many."""
        with self._tx() as db:
            cur = db.execute("DELETE FROM replicas WHERE state = 'stopped' AND updated < ?",
                             (self.clock() - older_than_s,))
        return cur.rowcount

    def delete_replica(self, replica_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM replicas WHERE id = ?", (replica_id,))
