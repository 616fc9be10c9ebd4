"""The control plane's state in SQLite (WAL): nodes, certificates, join tokens, catalog
models, replicas and gateway keys."""

from __future__ import annotations

import copy
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmgw.contract import ReplicaState
from llmgw.contract.catalog import SPEC_DEFAULTS
from llmgw.contract.records import (
    INVENTORY,
    REPLICA,
    REPLICA_UPDATE,
    Inventory,
    KeyRecord,
    ModelSpec,
    NodeRecord,
    NodeReplica,
    RecordError,
    ReplicaRecord,
    ReplicaUpdate,
    checked,
)
from llmgw.control.nodes import Hearing

log = logging.getLogger("llmgw.store")

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
CREATE INDEX IF NOT EXISTS replicas_by_node ON replicas (node);
CREATE TABLE IF NOT EXISTS certs (
    serial TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    not_after REAL NOT NULL,
    revoked REAL
);
CREATE INDEX IF NOT EXISTS certs_by_node ON certs (node);
CREATE TABLE IF NOT EXISTS tokens (
    hash TEXT PRIMARY KEY,
    created REAL NOT NULL,
    expires REAL NOT NULL,
    used REAL,
    used_by TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    prefix TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    models TEXT NOT NULL DEFAULT '[]',
    rpm INTEGER NOT NULL DEFAULT 0,
    tpm INTEGER NOT NULL DEFAULT 0,
    expires REAL,
    created REAL NOT NULL,
    revoked REAL,
    last_used REAL,
    requests INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0
);
-- A name is one live key's; a revoked key keeps its row (and usage), and its name is free.
CREATE UNIQUE INDEX IF NOT EXISTS keys_live_name ON keys (name) WHERE revoked IS NULL;
"""
# Added after the first release; an older database gains them on open.
_NODE_COLUMNS = {
    "serial": "TEXT NOT NULL DEFAULT ''",
    # Counts changes of the inventory text, so readers fetch and parse only what changed.
    "inv_version": "INTEGER NOT NULL DEFAULT 0",
}
_NODE_META = "id, first_seen, last_seen, serial, inv_version"
_REPLICA_COLUMNS = {
    # The GPUs the scheduler assigned (NVML UUIDs, a JSON list).
    "gpus": "TEXT NOT NULL DEFAULT '[]'",
}


class Store:
    """One SQLite database shared by the API threads.

    Writes go through one connection under a lock, one transaction per call; reads use a
    connection per thread and take no write lock (WAL lets them run beside a writer).
    """

    def __init__(self, path: str | Path, clock: Any = time.time,
                 busy_timeout_s: float = 5.0) -> None:
        """busy_timeout_s: how long a read waits for a lock another process holds (the
        gateway waits little: its requests wait on it); writes wait 5 s."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._path = str(path)
        self._busy_ms = int(busy_timeout_s * 1000)
        self._db = self._connect(5000)
        self._lock = threading.RLock()
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._inventories: dict[str, tuple[tuple[float, int], Inventory]] = {}
        self.clock = clock
        self._db.execute("PRAGMA journal_mode=WAL")
        # In WAL, NORMAL syncs at checkpoints, not on every commit: a heartbeat lost to a
        # power cut is sent again 5 s later, and an fsync per beat caps the node count.
        self._db.execute("PRAGMA synchronous=NORMAL")
        # A checkpoint copies the log into the database and syncs it: done inside a commit
        # it stalls the heartbeat that happened to cross the threshold, so `checkpoint()`
        # runs it on the scheduler's thread instead.
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._db.executescript(_SCHEMA)
        self._migrate()
        # This process starts hearing now; node_view keeps a restart from silencing nodes.
        last = self._db.execute("SELECT MAX(last_seen) FROM nodes").fetchone()[0]
        self.hearing = Hearing(since=clock(), last_before=float("-inf") if last is None
                               else float(last))

    def _connect(self, busy_ms: int) -> sqlite3.Connection:
        db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute(f"PRAGMA busy_timeout={busy_ms}")
        return db

    @property
    def path(self) -> str:
        return self._path

    def _migrate(self) -> None:
        for table, columns in (("nodes", _NODE_COLUMNS), ("replicas", _REPLICA_COLUMNS)):
            have = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for column, kind in columns.items():
                if column not in have:
                    try:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                    except sqlite3.OperationalError as e:
                        # The gateway's process opens the same file: it may have added it
                        # first.
                        if "duplicate column" not in str(e):
                            raise

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

    def _read(self, query: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        """One statement on this thread's own connection: a snapshot, no write lock."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect(self._busy_ms)
            with self._readers_lock:
                self._readers.append(db)
        return db.execute(query, args).fetchall()

    def checkpoint(self) -> None:
        """Copy the write-ahead log into the database, beside the writer (PASSIVE)."""
        self._read("PRAGMA wal_checkpoint(PASSIVE)")

    def close(self) -> None:
        with self._lock, self._readers_lock:
            for db in self._readers:
                db.close()
            self._db.close()

    # --- nodes ---

    def record_heartbeat(self, node_id: str, inventory: Mapping[str, object],
                         serial: str = "") -> None:
        """Store a node's inventory; RecordError (nothing stored) when a key has the wrong
        type."""
        inventory = _inventory_in(node_id, inventory)
        with self._tx() as db:
            self._upsert_node(db, node_id, inventory, serial)

    def _upsert_node(self, db: sqlite3.Connection, node_id: str, inventory: Inventory,
                     serial: str) -> None:
        now = self.clock()
        db.execute(
            "INSERT INTO nodes (id, inventory, first_seen, last_seen, serial) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
            "inv_version = inv_version + (inventory != excluded.inventory), "
            "inventory=excluded.inventory, last_seen=excluded.last_seen, serial=excluded.serial",
            (node_id, json.dumps(inventory), now, now, serial),
        )

    def heartbeat(self, node_id: str, inventory: Mapping[str, object], serial: str,
                  reports: Mapping[str, ReplicaUpdate]) -> list[NodeReplica]:
        """One beat in one transaction: record the inventory, take the node's reports on its
        own replicas (id → fields, checked by the agent API as it read them; a stopped
        replica stays stopped), and return the node's live replicas, each with its model's
        spec (None when the model is gone). RecordError, and nothing stored, when the
        inventory is invalid."""
        inventory = _inventory_in(node_id, inventory)
        with self._tx() as db:
            self._upsert_node(db, node_id, inventory, serial)
            rows = db.execute(
                "SELECT r.*, m.spec AS spec FROM replicas r LEFT JOIN models m "
                "ON m.name = r.model WHERE r.node = ? AND r.state != ? ORDER BY r.id",
                (node_id, ReplicaState.STOPPED),
            ).fetchall()
            for row in rows:
                report = reports.get(row["id"])
                if report and any(row[k] != v for k, v in report.items()):
                    sets = ", ".join(f"{k} = ?" for k in report)
                    db.execute(f"UPDATE replicas SET {sets}, updated = ? WHERE id = ?",
                               (*report.values(), self.clock(), row["id"]))
        return [
            {**_replica_row(r), "spec": _stored_spec(r["spec"]) if r["spec"] else None}
            for r in rows
        ]

    def nodes(self, limit: int | None = None, after: str = "") -> list[NodeRecord]:
        """Nodes by id: every one, or a page of at most limit with ids after `after`."""
        query = f"SELECT {_NODE_META} FROM nodes WHERE id > ? ORDER BY id"
        args: tuple[str | int, ...] = (after,)
        if limit is not None:
            query, args = query + " LIMIT ?", (after, limit)
        return self._with_inventories(self._read(query, args))

    def node(self, node_id: str) -> NodeRecord | None:
        found = self._with_inventories(
            self._read(f"SELECT {_NODE_META} FROM nodes WHERE id = ?", (node_id,)))
        return found[0] if found else None

    def _with_inventories(self, rows: list[sqlite3.Row]) -> list[NodeRecord]:
        # The scheduler reads every node every second: an inventory is fetched and parsed
        # again only when its text changed, so thousands of nodes hold the GIL briefly.
        cache = self._inventories
        stale = [r["id"] for r in rows
                 if cache.get(r["id"], (None,))[0] != (r["first_seen"], r["inv_version"])]
        for start in range(0, len(stale), 500):
            chunk = stale[start:start + 500]
            for r in self._read("SELECT id, first_seen, inv_version, inventory FROM nodes "
                                f"WHERE id IN ({', '.join('?' * len(chunk))})", tuple(chunk)):
                cache[r["id"]] = ((r["first_seen"], r["inv_version"]),
                                  _inventory_out(r["id"], r["inventory"]))
        return [{"id": r["id"], "inventory": cache[r["id"]][1], "first_seen": r["first_seen"],
                 "last_seen": r["last_seen"], "serial": r["serial"]}
                for r in rows if r["id"] in cache]

    def remove_node(self, node_id: str, why: str) -> list[str] | None:
        """Forget a node: stop its replicas with why, revoke its certificates. Returns the
        revoked serials, or None when there is no such node."""
        now = self.clock()
        with self._tx() as db:
            row = db.execute("SELECT serial FROM nodes WHERE id = ?", (node_id,)).fetchone()
            certs = db.execute("SELECT serial FROM certs WHERE node = ? AND revoked IS NULL",
                               (node_id,)).fetchall()
            if row is None and not certs:
                return None
            serials = {c["serial"] for c in certs} | ({row["serial"]} if row and row["serial"]
                                                       else set())
            for serial in serials:
                db.execute("INSERT INTO certs (serial, node, not_after, revoked) "
                           "VALUES (?, ?, 0, ?) ON CONFLICT(serial) DO UPDATE SET revoked = ?",
                           (serial, node_id, now, now))
            db.execute("UPDATE replicas SET state = ?, err = ?, updated = ? "
                       "WHERE node = ? AND state != ?",
                       (ReplicaState.STOPPED, why, now, node_id, ReplicaState.STOPPED))
            db.execute("DELETE FROM nodes WHERE id = ?", (node_id,))
        self._inventories.pop(node_id, None)
        return sorted(serials)

    # --- certificates and join tokens ---

    def add_cert(self, serial: str, node_id: str, not_after: float) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO certs (serial, node, not_after) VALUES (?, ?, ?)",
                       (serial, node_id, not_after))

    def revoked_serials(self) -> list[str]:
        return [r["serial"] for r in
                self._read("SELECT serial FROM certs WHERE revoked IS NOT NULL ORDER BY serial")]

    def node_known(self, node_id: str) -> bool:
        """Whether a node of this id has heartbeated or holds a certificate not revoked."""
        return bool(self._read(
            "SELECT 1 FROM nodes WHERE id = ? UNION ALL "
            "SELECT 1 FROM certs WHERE node = ? AND revoked IS NULL", (node_id, node_id)))

    def add_token(self, token_hash: str, ttl_s: float) -> float:
        """Store a join token by its hash; returns when it expires."""
        now = self.clock()
        with self._tx() as db:
            db.execute("INSERT INTO tokens (hash, created, expires) VALUES (?, ?, ?)",
                       (token_hash, now, now + ttl_s))
        return now + ttl_s

    def use_token(self, token_hash: str, node_id: str) -> str:
        """Spend a token: 'ok', or why not ('unknown', 'used by NODE', 'expired')."""
        now = self.clock()
        with self._tx() as db:
            row = db.execute("SELECT * FROM tokens WHERE hash = ?", (token_hash,)).fetchone()
            if row is None:
                return "unknown"
            if row["used"] is not None:
                return f"used by {row['used_by']}"
            if row["expires"] <= now:
                return "expired"
            db.execute("UPDATE tokens SET used = ?, used_by = ? WHERE hash = ?",
                       (now, node_id, token_hash))
        return "ok"

    # --- catalog ---

    def add_model(self, spec: ModelSpec) -> bool:
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

    def models(self) -> list[ModelSpec]:
        rows = self._read("SELECT spec FROM models ORDER BY created, name")
        return [_stored_spec(r["spec"]) for r in rows]

    def created(self) -> dict[str, int]:
        """When each model entered the catalog (unix seconds), for the gateway's `created`."""
        rows = self._read("SELECT name, created FROM models")
        return {r["name"]: int(r["created"]) for r in rows}

    def model(self, name: str) -> ModelSpec | None:
        rows = self._read("SELECT spec FROM models WHERE name = ?", (name,))
        return _stored_spec(rows[0]["spec"]) if rows else None

    def delete_model(self, name: str) -> bool:
        with self._tx() as db:
            cur = db.execute("DELETE FROM models WHERE name = ?", (name,))
        return cur.rowcount > 0

    # --- replicas ---

    def put_replica(self, replica: ReplicaRecord) -> None:
        """Insert or replace a replica; RecordError (nothing stored) for an unknown state,
        a wrong type or an unknown key."""
        replica = checked(REPLICA, replica, f"replica {replica.get('id', '(no id)')!r}")
        fields = ("id", "model", "node", "profile", "state", "err", "endpoint", "api_key",
                  "gpus")
        values = [json.dumps(replica.get(f) or []) if f == "gpus" else replica.get(f, "")
                  for f in fields]
        with self._tx() as db:
            db.execute(
                f"INSERT OR REPLACE INTO replicas ({', '.join(fields)}, updated) "
                f"VALUES ({', '.join('?' * len(fields))}, ?)",
                (*values, self.clock()),
            )

    def replicas(self, model: str | None = None) -> list[ReplicaRecord]:
        """Replicas (with their api_key: callers decide what leaves the process); a row
        that is not a valid record raises RecordError naming it."""
        query = "SELECT * FROM replicas"
        args: tuple[str, ...] = ()
        if model is not None:
            query, args = query + " WHERE model = ?", (model,)
        return [checked(REPLICA, _replica_row(r), f"stored replica {r['id']!r}")
                for r in self._read(query + " ORDER BY model, id", args)]

    def update_replica(self, replica_id: str, **fields: str | list[str]) -> None:
        allowed = {"node", "profile", "state", "err", "endpoint", "api_key", "gpus"}
        if not fields or set(fields) - allowed:
            raise ValueError(f"replica fields to update must be among {sorted(allowed)}")
        checked(REPLICA_UPDATE, fields, f"update of replica {replica_id!r}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        values = [json.dumps(v) if k == "gpus" else v for k, v in fields.items()]
        with self._tx() as db:
            db.execute(f"UPDATE replicas SET {sets}, updated = ? WHERE id = ?",
                       (*values, self.clock(), replica_id))

    def prune_stopped(self, older_than_s: float) -> int:
        """Forget replicas stopped more than older_than_s ago; returns how many."""
        with self._tx() as db:
            cur = db.execute("DELETE FROM replicas WHERE state = ? AND updated < ?",
                             (ReplicaState.STOPPED, self.clock() - older_than_s))
        return cur.rowcount

    # --- gateway keys ---

    def add_key(self, key: Mapping[str, object]) -> str:
        """Store a gateway key (its hash, never the secret): '' when stored, else why not
        ('name', 'id': a live key has it)."""
        fields = ("id", "name", "prefix", "hash", "rpm", "tpm", "expires")
        with self._tx() as db:
            if db.execute("SELECT 1 FROM keys WHERE name = ? AND revoked IS NULL",
                          (key["name"],)).fetchone():
                return "name"
            try:
                db.execute(f"INSERT INTO keys ({', '.join(fields)}, models, created) "
                           f"VALUES ({', '.join('?' * len(fields))}, ?, ?)",
                           (*(key.get(f) for f in fields), json.dumps(key.get("models", [])),
                            self.clock()))
            except sqlite3.IntegrityError:
                return "id"
        return ""

    def keys(self, revoked: bool = False) -> list[KeyRecord]:
        """Live gateway keys by creation (revoked ones too with revoked=True), with their
        hashes: callers decide what leaves the process."""
        where = "" if revoked else " WHERE revoked IS NULL"
        return [_key_record(r)
                for r in self._read(f"SELECT * FROM keys{where} ORDER BY created, name")]

    def revoke_key(self, name_or_prefix: str) -> KeyRecord | None:
        """Revoke the live key of this name, prefix or id; the key as it was, or None."""
        with self._tx() as db:
            row = db.execute(
                "SELECT * FROM keys WHERE revoked IS NULL AND (name = ? OR prefix = ? OR id = ?)",
                (name_or_prefix,) * 3).fetchone()
            if row is None:
                return None
            db.execute("UPDATE keys SET revoked = ? WHERE id = ?", (self.clock(), row["id"]))
        return _key_record(row)

    def add_key_usage(self, usage: dict[str, tuple[int, int, int, float]]) -> None:
        """Add a batch of usage (key id -> requests, prompt and completion tokens, last
        used) in one transaction; sqlite3.OperationalError when the store stays busy."""
        with self._tx() as db:
            db.executemany(
                "UPDATE keys SET requests = requests + ?, prompt_tokens = prompt_tokens + ?, "
                "completion_tokens = completion_tokens + ?, "
                "last_used = MAX(COALESCE(last_used, 0), ?) WHERE id = ?",
                [(*counts, key_id) for key_id, counts in usage.items()])



def _inventory_in(node_id: str, inventory: Mapping[str, object]) -> Inventory:
    return checked(INVENTORY, inventory, f"node {node_id}'s inventory")


def _inventory_out(node_id: str, text: str) -> Inventory:
    """A stored inventory; one stored before inventories were checked and now invalid is
    shown as a warning, so one node's old row never stops the scheduler or the admin API."""
    try:
        return _inventory_in(node_id, json.loads(text))
    except (RecordError, ValueError) as e:
        log.warning("%s", e)
        return {"warnings": [f"{e}; the node's next heartbeat replaces it"]}


def _replica_row(row: sqlite3.Row) -> ReplicaRecord:
    """A replicas row (its columns as _SCHEMA and _REPLICA_COLUMNS make them) as a record,
    not checked: its gpus column is JSON text."""
    return {"id": row["id"], "model": row["model"], "node": row["node"],
            "profile": row["profile"], "state": row["state"], "err": row["err"],
            "endpoint": row["endpoint"], "api_key": row["api_key"],
            "gpus": json.loads(row["gpus"] or "[]"), "updated": row["updated"]}


def _key_record(row: sqlite3.Row) -> KeyRecord:
    """A keys row (its columns as _SCHEMA makes them) as a record: models is JSON text."""
    return {"id": row["id"], "name": row["name"], "prefix": row["prefix"], "hash": row["hash"],
            "models": json.loads(row["models"]), "rpm": row["rpm"], "tpm": row["tpm"],
            "expires": row["expires"], "created": row["created"], "revoked": row["revoked"],
            "last_used": row["last_used"], "requests": row["requests"],
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"]}


def _stored_spec(text: str) -> ModelSpec:
    """A stored catalog model, with what a row stored before a field existed lacks (its
    digest, size, geometry) as the catalog's defaults: readers never hedge."""
    spec: ModelSpec = {**copy.deepcopy(SPEC_DEFAULTS), **json.loads(text)}  # type: ignore[typeddict-item]
    return spec
