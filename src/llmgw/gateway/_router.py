"""The gateway's routing table: the catalog, the ready replicas and the keys, read from the
control plane's store at most every ttl_s (kept when a read fails), never per request."""

from __future__ import annotations

import logging
import time

from llmgw.contract import ReplicaState
from llmgw.contract.records import KeyRecord, ModelSpec, ReplicaRecord
from llmgw.store import Store, StoreError

log = logging.getLogger("llmgw.gateway")


# How stale the table may be when it lacks a request's key (Router.key) or model
# (Router.resolve): the slot poller reads the table every 0.5 s, so a key made or a model
# added a moment ago would be refused meanwhile; the floor keeps requests with made-up keys
# or names from reading the store each time.
FRESH_TTL_S = 0.05


class Router:
    """Resolves a requested model to the catalog and hands out its ready replicas.

    It reads the catalog and the replicas at most every ttl_s, not on every request: the
    hot path stays off SQLite, and a replica that died in between costs one failed try.
    When a read fails (the control plane's database locked, moved or mid-migration while it
    restarts), it serves from the last table it read and says so once, until a read works.
    """

    def __init__(self, store: Store, ttl_s: float = 0.5) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._read_at = -float("inf")
        self._names: dict[str, ModelSpec] = {}
        self._ready: dict[str, list[ReplicaRecord]] = {}
        self.created: dict[str, int] = {}
        self._keys: dict[str, KeyRecord] = {}
        self.stale_since: float | None = None

    def _refresh(self, ttl_s: float | None = None) -> None:
        if time.monotonic() - self._read_at < (self.ttl_s if ttl_s is None else ttl_s):
            return
        try:
            self._read_table()
        except (StoreError, OSError) as e:
            self._read_at = time.monotonic()  # try again after ttl_s, not on every request
            if self.stale_since is None:
                self.stale_since = time.monotonic()
                log.warning("cannot read the routing table from %s (%s); serving from the "
                            "last one read until it can", self.store.path, e)
            return
        if self.stale_since is not None:
            log.info("the routing table reads again, after %.1f s of serving the last one",
                     time.monotonic() - self.stale_since)
            self.stale_since = None

    def _read_table(self) -> None:
        # As of the read's start: a row written while it ran may be missing from it, so a
        # lookup that misses reads again (FRESH_TTL_S) instead of trusting it.
        started = time.monotonic()
        names: dict[str, ModelSpec] = {}
        ready: dict[str, list[ReplicaRecord]] = {}
        for model in self.store.models():
            for name in [model["name"], *model["aliases"]]:
                names[name] = model
        for r in self.store.replicas():
            if r["state"] == ReplicaState.READY and r["endpoint"]:
                ready.setdefault(r["model"], []).append(r)
        self.created = self.store.created()
        self._keys = {k["hash"]: k for k in self.store.keys()}
        self._names, self._ready, self._read_at = names, ready, started

    def resolve(self, requested: str) -> ModelSpec | None:
        """The catalog model of this name or alias. A name not in the table has the store
        read again unless it was just read (as a key is), so a model added a moment ago
        (perhaps at scaling.min 0, loaded by this very request) is found at once."""
        self._refresh()
        if requested not in self._names:
            self._refresh(ttl_s=FRESH_TTL_S)
        return self._names.get(requested)

    def names(self) -> dict[str, ModelSpec]:
        self._refresh()
        return self._names

    def key(self, key_hash: str) -> KeyRecord | None:
        """The live gateway key of this sha256, as of the last refresh. A hash not in the
        table has the store read again unless it was just read, so a key made a moment ago
        works at once; a revoked one is refused from the next refresh on."""
        self._refresh()
        if key_hash not in self._keys:
            self._refresh(ttl_s=FRESH_TTL_S)
        return self._keys.get(key_hash)

    def ready(self, model: str, fresh: bool = False) -> list[ReplicaRecord]:
        """The model's ready replicas, in the store's order (the balancer picks). With none
        in the table, or fresh (every one was tried), the store is read again first: a
        replica that came ready since is served now, not after a 503 (the slot poller keeps
        the table from ever being fresh when a request comes)."""
        self._refresh()
        if fresh or not self._ready.get(model):
            self._refresh(ttl_s=0.0)
        return self._ready.get(model, [])

    def all_ready(self) -> list[ReplicaRecord]:
        self._refresh()
        return [r for replicas in self._ready.values() for r in replicas]

    def states(self, model: str) -> str:
        try:
            reps = [r for r in self.store.replicas(model) if r["state"] != ReplicaState.STOPPED]
        except (StoreError, OSError) as e:
            return f"the replicas' states cannot be read now ({e})"
        if not reps:
            return "no replica is scheduled"
        return "; ".join(
            f"{r['id']} on {r['node'] or '(no node)'}: {r['state']}"
            + (f" ({r['err']})" if r["err"] else "")
            for r in reps
        )
