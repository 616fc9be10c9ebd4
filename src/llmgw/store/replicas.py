"""Replicas: what the scheduler placed where, and what their nodes report of them."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping

from llmgw.contract import ReplicaState
from llmgw.contract.catalog import SPEC_DEFAULTS, ScalingSpec, defaults
from llmgw.contract.records import (
    REPLICA,
    REPLICA_UPDATE,
    ModelSpec,
    ReplicaRecord,
    SplitWorker,
    checked,
)

from ._db import Aggregate, insert
from ._schema import replicas
from .control_planes import Lease, fence

_FIELDS = ("id", "model", "node", "profile", "state", "err", "endpoint", "api_key", "gpus",
           "workers")
_UPDATABLE = frozenset(_FIELDS) - {"id", "model", "workers"}
# Columns held as JSON text.
_JSON = frozenset({"gpus", "workers"})


class PlanChanges(Protocol):
    """What a scheduler's plan changes (scheduler.Plan): replicas to add, to stop (id →
    why), to place (id → node, profile, GPUs; with its workers in split, when it is split
    over nodes) and still waiting (id → why)."""

    add: list[ReplicaRecord]
    stop: dict[str, str]
    place: dict[str, tuple[str, str, list[str]]]
    split: dict[str, list[SplitWorker]]
    waiting: dict[str, str]


class ReplicaStore(Aggregate):
    def put_replica(self, replica: ReplicaRecord) -> None:
        """Insert or replace a replica; RecordError (nothing stored) for an unknown state,
        a wrong type or an unknown key."""
        replica = checked(REPLICA, replica, f"replica {replica.get('id', '(no id)')!r}")
        values = replica_columns({f: replica.get(f, "") for f in _FIELDS})
        values["updated"] = self.clock()
        with self.db.tx() as conn:
            row = insert(conn, replicas).values(**values)
            conn.execute(row.on_conflict_do_update(
                index_elements=[replicas.c.id],
                set_={k: row.excluded[k] for k in values if k != "id"}))

    def replicas(self, model: str | None = None) -> list[ReplicaRecord]:
        """Replicas (with their api_key: callers decide what leaves the process); a row
        that is not a valid record raises RecordError naming it."""
        query = sa.select(replicas).order_by(replicas.c.model, replicas.c.id)
        if model is not None:
            query = query.where(replicas.c.model == model)
        return [checked(REPLICA, replica_row(r), f"stored replica {r['id']!r}")
                for r in self.db.read(query)]

    def update_replica(self, replica_id: str, **fields: str | list[str]) -> None:
        if not fields or set(fields) - _UPDATABLE:
            raise ValueError(f"replica fields to update must be among {sorted(_UPDATABLE)}")
        checked(REPLICA_UPDATE, fields, f"update of replica {replica_id!r}")
        with self.db.tx() as conn:
            conn.execute(replicas.update().where(replicas.c.id == replica_id).values(
                **replica_columns(fields), updated=self.clock()))

    def apply_plan(self, plan: PlanChanges, lease: Lease | None,
                   keep_stopped_s: float | None = None) -> None:
        """Write a whole plan in one transaction, fenced: with a lease, the transaction
        first checks (the lease row locked) that it is still this holder's under this
        epoch, unexpired, else raises LeaseLost and writes nothing; None writes unfenced
        (one control plane, a test). With keep_stopped_s, replicas stopped longer ago are
        forgotten in the same transaction. RecordError (nothing written) for a bad record."""
        added = [replica_columns({f: r.get(f, "") for f in _FIELDS})
                 for r in (checked(REPLICA, r, f"replica {r.get('id', '(no id)')!r}")
                           for r in plan.add)]
        with self.db.tx() as conn:
            now = self.clock()
            if lease is not None:
                fence(conn, lease, now)
            by_id = replicas.update().where(replicas.c.id == sa.bindparam("rid"))
            for rid, why in plan.stop.items():
                conn.execute(by_id.values(state=ReplicaState.STOPPED, err=why, updated=now),
                             {"rid": rid})
            for values in added:
                row = insert(conn, replicas).values(**values, updated=now)
                conn.execute(row.on_conflict_do_update(
                    index_elements=[replicas.c.id],
                    set_={k: row.excluded[k] for k in [*values, "updated"] if k != "id"}))
            for rid, (node, profile, gpus) in plan.place.items():
                conn.execute(by_id.values(node=node, profile=profile, gpus=json.dumps(gpus),
                                          workers=json.dumps(plan.split.get(rid, [])),
                                          state=ReplicaState.PENDING, err="", updated=now),
                             {"rid": rid})
            for rid, why in plan.waiting.items():
                conn.execute(by_id.values(err=why, updated=now), {"rid": rid})
            if keep_stopped_s is not None:
                conn.execute(replicas.delete().where(
                    replicas.c.state == ReplicaState.STOPPED,
                    replicas.c.updated < now - keep_stopped_s))

    def prune_stopped(self, older_than_s: float) -> int:
        """Forget replicas stopped more than older_than_s ago; returns how many."""
        with self.db.tx() as conn:
            done = conn.execute(replicas.delete().where(
                replicas.c.state == ReplicaState.STOPPED,
                replicas.c.updated < self.clock() - older_than_s))
        return done.rowcount


def replica_columns(fields: Mapping[str, object]) -> dict[str, object]:
    """A record's fields as the replicas table holds them: gpus and workers as JSON text."""
    return {k: json.dumps(v or []) if k in _JSON else v for k, v in fields.items()}


def replica_row(row: RowMapping) -> ReplicaRecord:
    """A replicas row as a record, not checked (its gpus and workers columns are JSON
    text); workers only for a replica split over nodes."""
    record: ReplicaRecord = {
        "id": row["id"], "model": row["model"], "node": row["node"],
        "profile": row["profile"], "state": row["state"], "err": row["err"],
        "endpoint": row["endpoint"], "api_key": row["api_key"],
        "gpus": json.loads(row["gpus"] or "[]"), "updated": row["updated"]}
    workers = row["workers"]
    if workers and workers != "[]":
        record["workers"] = json.loads(workers)
    return record


def stored_spec(text: str) -> ModelSpec:
    """A stored catalog model, with what a row stored before a field existed lacks (its
    digest, size, geometry) as the catalog's defaults: readers never hedge."""
    spec: ModelSpec = {**copy.deepcopy(SPEC_DEFAULTS), **json.loads(text)}  # type: ignore[typeddict-item]
    spec["scaling"] = {**defaults(ScalingSpec), **spec["scaling"]}  # type: ignore[typeddict-item]
    return spec
