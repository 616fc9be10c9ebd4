"""Nodes and their certificates: heartbeats, the node list, removal and revocation."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from llmgw.contract import ReplicaState
from llmgw.contract.records import (
    INVENTORY,
    Inventory,
    NodeRecord,
    NodeReplica,
    RecordError,
    ReplicaUpdate,
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


class NodeStore(Aggregate):
    # The scheduler reads every node every second: an inventory is fetched and parsed again
    # only when its text changed (first_seen, inv_version), so thousands of nodes hold the
    # GIL briefly.
    _inventories: dict[str, tuple[tuple[float, int], Inventory]]

    def record_heartbeat(self, node_id: str, inventory: Mapping[str, object],
                         serial: str = "") -> None:
        """Store a node's inventory; RecordError (nothing stored) when a key has the wrong
        type."""
        checked_inventory = _inventory_in(node_id, inventory)
        with self.db.tx() as conn:
            self._upsert_node(conn, node_id, checked_inventory, serial)

    def _upsert_node(self, conn: Connection, node_id: str, inventory: Inventory,
                     serial: str) -> None:
        now = self.clock()
        row = insert(conn, nodes).values(id=node_id, inventory=json.dumps(inventory),
                                         first_seen=now, last_seen=now, serial=serial)
        new = row.excluded
        conn.execute(row.on_conflict_do_update(index_elements=[nodes.c.id], set_={
            "inv_version": nodes.c.inv_version
            + sa.case((nodes.c.inventory != new.inventory, 1), else_=0),
            "inventory": new.inventory, "last_seen": new.last_seen, "serial": new.serial}))

    def heartbeat(self, node_id: str, inventory: Mapping[str, object], serial: str,
                  reports: Mapping[str, ReplicaUpdate]) -> list[NodeReplica]:
        """One beat in one transaction: record the inventory, take the node's reports on its
        own replicas (id → fields, checked by the agent API as it read them; a stopped
        replica stays stopped), and return the node's live replicas, each with its model's
        spec (None when the model is gone). RecordError, and nothing stored, when the
        inventory is invalid."""
        checked_inventory = _inventory_in(node_id, inventory)
        with self.db.tx() as conn:
            self._upsert_node(conn, node_id, checked_inventory, serial)
            rows = conn.execute(
                sa.select(replicas, models.c.spec.label("spec"))
                .select_from(replicas.outerjoin(models, models.c.name == replicas.c.model))
                .where(replicas.c.node == node_id, replicas.c.state != ReplicaState.STOPPED)
                .order_by(replicas.c.id)).mappings().all()
            found: list[NodeReplica] = []
            for row in rows:
                record = replica_row(row)
                report = reports.get(row["id"])
                if report and any(record.get(k) != v for k, v in report.items()):
                    record.update(report)
                    record["updated"] = self.clock()
                    conn.execute(replicas.update().where(replicas.c.id == row["id"]).values(
                        **replica_columns(report), updated=record["updated"]))
                found.append({**record, "spec": stored_spec(row["spec"]) if row["spec"]
                              else None})
        return found

    def nodes(self, limit: int | None = None, after: str = "") -> list[NodeRecord]:
        """Nodes by id: every one, or a page of at most limit with ids after `after`."""
        query = sa.select(*_META).where(nodes.c.id > after).order_by(nodes.c.id)
        if limit is not None:
            query = query.limit(limit)
        return self._with_inventories(self.db.read(query))

    def node(self, node_id: str) -> NodeRecord | None:
        found = self._with_inventories(
            self.db.read(sa.select(*_META).where(nodes.c.id == node_id)))
        return found[0] if found else None

    def _with_inventories(self, rows: Sequence[RowMapping]) -> list[NodeRecord]:
        cache = self._inventories
        stale = [r["id"] for r in rows
                 if cache.get(r["id"], (None,))[0] != (r["first_seen"], r["inv_version"])]
        for start in range(0, len(stale), 500):
            chunk = stale[start:start + 500]
            for r in self.db.read(
                    sa.select(nodes.c.id, nodes.c.first_seen, nodes.c.inv_version,
                              nodes.c.inventory).where(nodes.c.id.in_(chunk))):
                cache[r["id"]] = ((r["first_seen"], r["inv_version"]),
                                  _inventory_out(r["id"], r["inventory"]))
        return [{"id": r["id"], "inventory": cache[r["id"]][1], "first_seen": r["first_seen"],
                 "last_seen": r["last_seen"], "serial": r["serial"]}
                for r in rows if r["id"] in cache]

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
