"""The control plane's state: nodes and certificates, join tokens, the catalog, replicas,
gateway keys, their usage and the shares of their minutes that gateways took, viewer keys
and the fleet page's sessions, the control planes sharing it and which one schedules, in
SQLite (a file, the embedded default) or PostgreSQL (`store: postgresql://…` in
server.yaml), through SQLAlchemy Core.

One module an aggregate (nodes.py, tokens.py, catalog.py, replicas.py, keys.py, budgets.py,
viewers.py, sessions.py, control_planes.py, demand.py); _db.py opens the store and brings its schema
to this code's revision (migrations/, Alembic).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ._db import (
    Database,
    SchemaError,
    StoreConflict,
    StoreError,
    answers,
    redacted,
    refusal,
    store_url,
)
from .budgets import BudgetStore, Grant, Settled, Want
from .catalog import CatalogStore
from .control_planes import SCHEDULER, ControlPlaneStore, Lease, LeaseLost
from .demand import DemandStore, Use
from .keys import KeyStore
from .nodes import Hearing, NodeStore
from .replicas import ReplicaStore
from .sessions import SessionStore
from .tokens import TokenStore
from .viewers import ViewerStore

log = logging.getLogger("llmgw.store")

__all__ = ["SCHEDULER", "Grant", "Lease", "LeaseLost", "SchemaError", "Settled", "Store",
           "StoreConflict", "StoreError", "Use", "Want", "answers", "redacted", "refusal",
           "store_url"]


class Store(NodeStore, TokenStore, CatalogStore, ReplicaStore, KeyStore, ControlPlaneStore,
            ViewerStore, SessionStore, BudgetStore, DemandStore):
    """The store, shared by the API threads of one process.

    where: a SQLite file's path, or a URL (`sqlite:///PATH`, `postgresql://…`).
    busy_timeout_s: how long a read waits for a lock or a connection (the gateway waits
    little: its requests wait on it).
    migrate: bring the schema to this code's revision (the control plane); False reads a
    schema made elsewhere and raises SchemaError unless it is this code's (the gateway).
    """

    def __init__(self, where: str | Path, clock: Any = time.time,
                 busy_timeout_s: float = 5.0, migrate: bool = True) -> None:
        self.db = Database(where, busy_timeout_s=busy_timeout_s, migrate=migrate)
        self.clock = clock
        self._inventories = {}
        self._start_beats()
        # This process starts hearing now; node_view keeps a restart from silencing nodes.
        self.hearing = self._hearing_from_now()
        # Nor does an outage of the store: no node could beat while it was away.
        self.db.on_reachable = lambda down_s: setattr(self, "hearing",
                                                      self._hearing_from_now())

    def _hearing_from_now(self) -> Hearing:
        last = self.last_heard()
        return Hearing(since=self.clock(), last_before=float("-inf") if last is None
                       else last)

    def reachable(self) -> str:
        """'' when the store answers a query now, else why not (for readiness)."""
        try:
            self.db.read(sa.select(sa.literal(1)))
        except StoreError as e:
            return self.why(e)
        return ""

    def why(self, e: StoreError) -> str:
        """What a failed read or write says, for an answer that refuses because of it: from
        the error itself, so a store already away is not asked again to phrase it."""
        if e.unreachable:
            return f"the store {self.path} cannot be reached: {_first_line(e)}"
        return f"the store {self.path} failed: {_first_line(e)}"

    @property
    def path(self) -> str:
        """Where the store is, as it may be shown (a URL's password hidden)."""
        return self.db.where

    @property
    def backend(self) -> str:
        """'sqlite' or 'postgresql'."""
        return self.db.backend

    def checkpoint(self) -> None:
        """Copy SQLite's write-ahead log into the database, beside the writer."""
        self.db.checkpoint()

    def close(self) -> None:
        try:
            self._flush_due(force=True)
        except StoreError as e:
            log.warning("the last beats' rows were not written (%s): the nodes' next beats "
                        "write them", self.why(e))
        self.db.close()


def _first_line(e: StoreError) -> str:
    found = getattr(e, "orig", None) or e
    return (str(found).strip().splitlines() or [type(found).__name__])[0]
