"""Nodes and their certificates: heartbeats, the node list, removal and revocation."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from llmgw.contract import ReplicaState
from llmgw.contract.records import (
    INVENTORY,
    Inventory,
    ModelSpec,
    NodeRecord,
    NodeReplica,
    RecordError,
    ReplicaUpdate,
    SplitWorker,
    checked,
)

from ._db import Aggregate, insert
from ._schema import certs, models, nodes, replicas
from .replicas import replica_columns, replica_row, stored_spec

log = logging.getLogger("llmgw.store")


@dataclass(frozen=True)
class Hearing:
    """Since when this control plane hears heartbeats, and the newest one stored before.

    A node cannot beat to a control plane that is down or starting: its silence is
    counted from `since`, not from its last beat, unless it was already silent when the
    previous control plane last heard anyone (`last_before`). So a restart keeps every
    node's state for one node timeout while the agents reconnect. The defaults count
    silence from the last beat alone."""

    since: float = float("-inf")
    last_before: float = float("-inf")


ALWAYS_HEARD = Hearing()


_META = (nodes.c.id, nodes.c.first_seen, nodes.c.last_seen, nodes.c.serial, nodes.c.inv_version)

# A beat that changes nothing writes nothing at once: its node's row is written again, in
# full and with its newest last_seen, once it is REWRITE_EVERY_S old (the agent API passes
# a third of the node timeout), with every other row due, in one transaction every
# FLUSH_EVERY_S. So another control plane on the store sees a node's last_seen at most
# REWRITE_EVERY_S + a beat + FLUSH_EVERY_S behind, well within the node timeout.
REWRITE_EVERY_S = 10.0
FLUSH_EVERY_S = 1.0
# Live replicas are read for every node at once and kept this long: a write to replicas or
# models through this store drops them at once, another process's is seen within this.
REPLICAS_FRESH_S = 1.0


@dataclass
class _Beat:
    """What this process last wrote of a node's row, and when it last heard it."""

    raw: Mapping[str, object]  # the inventory as the agent sent it (already checked)
    text: str  # as stored
    serial: str
    written: float  # when the row was written or queued to be, in full
    heard: float  # the node's newest beat here


@dataclass
class _Assigned:
    """Every node's live replicas as read at one moment, and the writes it had seen."""

    at: float  # the store's clock
    writes: tuple[int, int]  # the store's writes to replicas and to models, then
    by_node: dict[str, list[NodeReplica]]


def _upsert(dialect: str) -> sa.Insert:
    """A node's row, written in full (inv_version counts the inventory's changes): one
    statement per dialect, built once (building one costs more than running it)."""
    found = _UPSERTS.get(dialect)
    if found is None:
        from sqlalchemy.dialects import postgresql, sqlite

        row = (postgresql if dialect == "postgresql" else sqlite).insert(nodes)
        new = row.excluded
        found = _UPSERTS[dialect] = row.on_conflict_do_update(
            index_elements=[nodes.c.id], set_={
                "inv_version": nodes.c.inv_version
                + sa.case((nodes.c.inventory != new.inventory, 1), else_=0),
                "inventory": new.inventory,
                "last_seen": new.last_seen,
                "serial": new.serial})
    return found


_UPSERTS: dict[str, sa.Insert] = {}
_LIVE = (sa.select(replicas, models.c.spec.label("spec"))
         .select_from(replicas.outerjoin(models, models.c.name == replicas.c.model))
         .where(replicas.c.state != ReplicaState.STOPPED)
         .order_by(replicas.c.node, replicas.c.id))
# A node's report changes a replica still live only: one the scheduler stopped stays so.
_REPORTED = (replicas.update()
             .where(replicas.c.id == sa.bindparam("rid"),
                    replicas.c.state != ReplicaState.STOPPED))


def _worker_entry(share: SplitWorker, report: ReplicaUpdate, addr: str) -> SplitWorker:
    """A worker's entry in a split replica's `workers`, as its report leaves it."""
    entry: SplitWorker = {**share, "state": str(report.get("state", share.get("state", ""))),
                          "err": report.get("err", "")}
    port = report.get("relay_port")
    if port is not None:
        entry["port"] = port
        entry["addr"] = addr if port else ""
    return entry


def _write_share(conn: Connection, rid: str, entry: SplitWorker) -> None:
    """One worker's entry written into its replica's `workers`, the row locked while it is
    read and written (two workers beating at once to two control planes keep both); a
    replica stopped, or placed anew without this worker, is left as it is."""
    row = conn.execute(sa.select(replicas.c.workers).where(
        replicas.c.id == rid, replicas.c.state != ReplicaState.STOPPED)
        .with_for_update()).first()
    if row is None:
        return
    workers: list[SplitWorker] = json.loads(row.workers or "[]")
    mine = [i for i, w in enumerate(workers) if w["node"] == entry["node"]]
    if not mine:
        return
    workers[mine[0]] = entry
    # Not `updated`: the replica's time is its main's (its uptime, its last report).
    conn.execute(replicas.update().where(replicas.c.id == rid).values(
        workers=json.dumps(workers)))


class NodeStore(Aggregate):
    # The scheduler reads every node every second: an inventory is fetched and parsed again
    # only when its text changed (first_seen, inv_version), so thousands of nodes hold the
    # GIL briefly.
    _inventories: dict[str, tuple[tuple[float, int], Inventory]]
    _beats: dict[str, _Beat]
    _due: set[str]  # nodes whose rows the next flush writes
    _flushed: float  # the store's clock
    _assigned: _Assigned | None

    def _start_beats(self) -> None:
        self._beats, self._due, self._flushed, self._assigned = {}, set(), float("-inf"), None

    def record_heartbeat(self, node_id: str, inventory: Mapping[str, object],
                         serial: str = "") -> None:
        """Store a node's inventory; RecordError (nothing stored) when a key has the wrong
        type."""
        checked_inventory = _inventory_in(node_id, inventory)
        with self.db.tx() as conn:
            self._write_rows(conn, [(node_id, json.dumps(checked_inventory), serial,
                                     self.clock())])
        self._beats.pop(node_id, None)

    def _write_rows(self, conn: Connection, rows: list[tuple[str, str, str, float]]) -> None:
        """Nodes' rows in full: (id, inventory text, serial, last_seen) each."""
        conn.execute(_upsert(conn.dialect.name), [
            {"id": i, "inventory": text, "first_seen": seen, "last_seen": seen,
             "serial": serial} for i, text, serial, seen in rows])

    def heartbeat(self, node_id: str, inventory: Mapping[str, object], serial: str,
                  reports: Mapping[str, ReplicaUpdate], *,
                  rewrite_every_s: float = REWRITE_EVERY_S) -> list[NodeReplica]:
        """Record a beat: the node's row written at once when its inventory or serial
        changed (or this process had not heard it for rewrite_every_s: another control
        plane may have written it since), else with the next flush once rewrite_every_s
        old; take the node's reports on its own replicas (id → fields, checked by the agent
        API as it read them; a stopped replica stays stopped), and return the node's live
        replicas, each with its model's spec (None when the model is gone). RecordError,
        and nothing stored, when the inventory is invalid."""
        now = self.clock()
        beat = self._beats.get(node_id)
        if self.db.unreachable_since is not None:
            # Known away: the beat goes to the store, to be refused (503: the agent moves
            # to a control plane whose store answers), never answered from memory.
            beat, self._assigned = None, None
        if beat is not None and beat.raw == inventory and beat.serial == serial \
                and 0 <= now - beat.heard <= rewrite_every_s:
            beat.heard = now
            if now - beat.written >= rewrite_every_s:
                beat.written = now
                self._due.add(node_id)
        else:
            text = json.dumps(_inventory_in(node_id, inventory))
            with self.db.tx() as conn:
                self._write_rows(conn, [(node_id, text, serial, now)])
            self._beats[node_id] = _Beat(inventory, text, serial, now, now)
            self._due.discard(node_id)
        self._flush_due()
        addr = inventory.get("addr")
        return self._take_reports(node_id, reports, addr if isinstance(addr, str) else "")

    def _flush_due(self, force: bool = False) -> None:
        """Write the rows due in one transaction, once every FLUSH_EVERY_S (or now)."""
        now = self.clock()
        if not self._due or (not force and 0 <= now - self._flushed < FLUSH_EVERY_S):
            return
        self._flushed = now
        with self.db.tx() as conn:
            due, self._due = self._due, set()
            rows = [(i, b.text, b.serial, b.heard) for i in due
                    if (b := self._beats.get(i)) is not None]
            try:
                self._write_rows(conn, rows)
            except BaseException:
                self._due |= due  # for the next flush: the store may be back by then
                raise

    def _take_reports(self, node_id: str, reports: Mapping[str, ReplicaUpdate],
                      addr: str) -> list[NodeReplica]:
        """The node's reports on its replicas written where they changed something: on its
        own (it is their node, or main node) their state, err, endpoint and api_key; on a
        split replica it is a worker of, its own entry in `workers` alone (its state, err,
        relay port and management address), never the replica's state: that is the
        main's."""
        changed: list[tuple[str, ReplicaUpdate]] = []
        shares: dict[str, SplitWorker] = {}
        found: list[NodeReplica] = []
        for held in self._live().get(node_id, ()):
            record: NodeReplica = {**held}
            report = reports.get(record["id"])
            share = record.get("share")
            if share is not None:
                if report:
                    entry = _worker_entry(share, report, addr)
                    if entry != share:
                        record["share"] = shares[record["id"]] = entry
                found.append(record)
                continue
            if report and "relay_port" in report:  # a worker's word, not its main's
                report = {**report}
                report.pop("relay_port")
            if report and any(record.get(k) != v for k, v in report.items()):
                record.update(report)
                record["updated"] = self.clock()
                changed.append((record["id"], report))
            found.append(record)
        if changed or shares:
            now = self.clock()
            with self.db.tx() as conn:
                for rid, report in changed:
                    conn.execute(_REPORTED.values(**replica_columns(report), updated=now),
                                 {"rid": rid})
                for rid, entry in shares.items():
                    _write_share(conn, rid, entry)
        return found

    def live_replicas(self) -> dict[str, list[NodeReplica]]:
        """Every node's live replicas (without its latest reports), from the cache the
        heartbeats read: the same mapping until it is read again (nodes' watches compare
        it by identity)."""
        if self.db.unreachable_since is not None:
            self._assigned = None  # known away: read (and fail) rather than answer stale
        return self._live()

    def _live(self) -> dict[str, list[NodeReplica]]:
        """Every node's live replicas, read again when this store wrote replicas or models
        since, or REPLICAS_FRESH_S after the last read."""
        writes = (self.db.writes.get(replicas.name, 0), self.db.writes.get(models.name, 0))
        held = self._assigned
        at = self.clock()
        if held is not None and held.writes == writes \
                and 0 <= at - held.at < REPLICAS_FRESH_S:
            return held.by_node
        specs: dict[str, ModelSpec] = {}
        by_node: dict[str, list[NodeReplica]] = {}
        for row in self.db.read(_LIVE):
            text = row["spec"]
            spec = (specs.get(text) or specs.setdefault(text, stored_spec(text))) \
                if text else None
            record: NodeReplica = {**replica_row(row), "spec": spec}
            by_node.setdefault(row["node"], []).append(record)
            # A split replica is its workers' too: each reads it with its own entry.
            for worker in record.get("workers") or ():
                by_node.setdefault(worker["node"], []).append({**record, "share": worker})
        self._assigned = _Assigned(at, writes, by_node)
        return by_node

    def nodes(self, limit: int | None = None, after: str = "") -> list[NodeRecord]:
        """Nodes by id: every one, or a page of at most limit with ids after `after`."""
        query = sa.select(*_META).where(nodes.c.id > after).order_by(nodes.c.id)
        if limit is not None:
            query = query.limit(limit)
        return self._with_inventories(self.db.read_rows(query))

    def node(self, node_id: str) -> NodeRecord | None:
        found = self._with_inventories(
            self.db.read_rows(sa.select(*_META).where(nodes.c.id == node_id)))
        return found[0] if found else None

    def _with_inventories(self, rows: Sequence[tuple[Any, ...]]) -> list[NodeRecord]:
        """Rows of _META (plain tuples: the scheduler reads every node every second) with
        their inventories."""
        cache = self._inventories
        stale = [i for i, first, _, _, version in rows
                 if cache.get(i, (None,))[0] != (first, version)]
        for start in range(0, len(stale), 500):
            chunk = stale[start:start + 500]
            for r in self.db.read(
                    sa.select(nodes.c.id, nodes.c.first_seen, nodes.c.inv_version,
                              nodes.c.inventory).where(nodes.c.id.in_(chunk))):
                cache[r["id"]] = ((r["first_seen"], r["inv_version"]),
                                  _inventory_out(r["id"], r["inventory"]))
        # A beat here is stored with a delay (REWRITE_EVERY_S): this process says its own.
        beats = self._beats
        found: list[NodeRecord] = []
        for i, first, last, serial, _ in rows:
            held = cache.get(i)
            if held is None:
                continue
            beat = beats.get(i)
            found.append({"id": i, "inventory": held[1], "first_seen": first,
                          "last_seen": last if beat is None or beat.heard < last
                          else beat.heard, "serial": serial})
        return found

    def last_heard(self) -> float | None:
        """When any node last heartbeated (unix seconds), or None before the first."""
        last = self.db.read(sa.select(sa.func.max(nodes.c.last_seen).label("last")))[0]["last"]
        return None if last is None else float(last)

    def remove_node(self, node_id: str, why: str) -> list[str] | None:
        """Forget a node: stop its replicas with why, revoke its certificates. Returns the
        revoked serials, or None when there is no such node."""
        now = self.clock()
        with self.db.tx() as conn:
            row = conn.execute(sa.select(nodes.c.serial).where(nodes.c.id == node_id)
                               .with_for_update()).first()
            live = conn.execute(sa.select(certs.c.serial).where(
                certs.c.node == node_id, certs.c.revoked.is_(None))).scalars().all()
            if row is None and not live:
                return None
            serials = set(live) | ({row.serial} if row is not None and row.serial else set())
            for serial in serials:
                revoke = insert(conn, certs).values(serial=serial, node=node_id, not_after=0,
                                                    revoked=now)
                conn.execute(revoke.on_conflict_do_update(index_elements=[certs.c.serial],
                                                          set_={"revoked": now}))
            conn.execute(replicas.update().where(
                replicas.c.node == node_id, replicas.c.state != ReplicaState.STOPPED)
                .values(state=ReplicaState.STOPPED, err=why, updated=now))
            conn.execute(nodes.delete().where(nodes.c.id == node_id))
            # Under the write lock: a flush after this cannot write the row back.
            self._beats.pop(node_id, None)
            self._due.discard(node_id)
        self._inventories.pop(node_id, None)
        return sorted(serials)

    # --- certificates ---

    def add_cert(self, serial: str, node_id: str, not_after: float) -> None:
        with self.db.tx() as conn:
            conn.execute(certs.insert().values(serial=serial, node=node_id,
                                               not_after=not_after))

    def cert_expiry(self) -> dict[str, float]:
        """When each node's newest certificate not revoked expires (unix time), by node id:
        the ones this control plane signed (a join or a renewal)."""
        newest = sa.func.max(certs.c.not_after).label("not_after")
        return {r["node"]: float(r["not_after"]) for r in self.db.read(
            sa.select(certs.c.node, newest).where(certs.c.revoked.is_(None))
            .group_by(certs.c.node).order_by(certs.c.node))}

    def revoked_serials(self) -> list[str]:
        return [r["serial"] for r in self.db.read(
            sa.select(certs.c.serial).where(certs.c.revoked.is_not(None))
            .order_by(certs.c.serial))]

    def node_known(self, node_id: str) -> bool:
        """Whether a node of this id has heartbeated or holds a certificate not revoked."""
        return bool(self.db.read(sa.union_all(
            sa.select(sa.literal(1)).where(nodes.c.id == node_id),
            sa.select(sa.literal(1)).where(certs.c.node == node_id,
                                           certs.c.revoked.is_(None)))))


def _inventory_in(node_id: str, inventory: Mapping[str, object]) -> Inventory:
    found: Inventory = checked(INVENTORY, inventory, f"node {node_id}'s inventory")
    return found


def _inventory_out(node_id: str, text: str) -> Inventory:
    """A stored inventory; one stored before inventories were checked and now invalid is
    shown as a warning, so one node's old row never stops the scheduler or the admin API."""
    try:
        return _inventory_in(node_id, json.loads(text))
    except (RecordError, ValueError) as e:
        log.warning("%s", e)
        return {"warnings": [f"{e}; the node's next heartbeat replaces it"]}
