"""Which control plane schedules: each beats its row and tries for the scheduler lease
every second; the holder schedules, fenced by the lease's epoch, until it loses it."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from llmgw.contract.records import ControlPlaneView
from llmgw.store import Lease, LeaseLost, Store, StoreError

log = logging.getLogger("llmgw.server")

# A killed holder's lease lapses within LEASE_TTL_S; the next try (every second) of another
# control plane takes it: scheduling resumes elsewhere within LEASE_TTL_S + 1 s.
LEASE_TTL_S = 10.0
ID_FILE = "control-plane-id"


def control_plane_id(state_dir: str | Path) -> str:
    """This control plane's id, made once (HOSTNAME-RANDOM) and kept in state_dir, so a
    restart is the same control plane and two on one host are two."""
    path = Path(state_dir) / ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    made = f"{socket.gethostname()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:  # another start made it first: theirs is the id
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(made + "\n")
    return made


@dataclass(frozen=True)
class Identity:
    """What this control plane says of itself in its row."""

    id: str
    agent_url: str
    admin_url: str
    started: float


class Leadership:
    """Each step beats this control plane's row and takes or renews the scheduler lease;
    `lease` is what the scheduler writes under (None: do not schedule). Says once, at each
    change, whether it schedules and why."""

    def __init__(self, store: Store, me: Identity, ttl_s: float = LEASE_TTL_S) -> None:
        self.store = store
        self.me = me
        self.ttl_s = ttl_s
        self.lease: Lease | None = None
        self._said = ""

    def step(self) -> Lease | None:
        """One try: the lease to schedule under now, or None (another holds it, or the
        store cannot be reached: tried again at the next step)."""
        try:
            self.store.beat_control_plane(self.me.id, self.me.agent_url, self.me.admin_url,
                                          started=self.me.started)
            lease = self.store.acquire_lease(self.me.id, self.ttl_s)
            holder = self.store.lease() if lease is None else None
        except StoreError as e:
            self.unreachable(e)
            return None
        if lease is None:
            who = holder.holder if holder else "another control plane"
            epoch = holder.epoch if holder else "?"
            self._stop(f"other:{who}", f"{who} schedules (scheduler lease, epoch {epoch}); "
                       "this one takes over if it lapses")
            return None
        if self.lease is None or self.lease.epoch != lease.epoch:
            self._say("holding", f"scheduling: {self.me.id} holds the scheduler lease, "
                      f"epoch {lease.epoch}, renewed every second for {self.ttl_s:g} s")
        self.lease = lease
        return lease

    def unreachable(self, e: StoreError) -> None:
        """The store did not answer: stop until a step reaches it again."""
        self._stop("store", f"the store {self.store.path} cannot be reached "
                   f"({_first_line(e)}); trying again every second")

    def lost(self, e: LeaseLost) -> None:
        """The scheduler's write found the lease gone: stop until a step takes it again."""
        self._stop("lost", f"{e}")

    def release(self) -> None:
        """A clean stop: give the lease up so another takes it at once."""
        if self.lease is None:
            return
        try:
            self.store.release_lease(self.lease)
        except StoreError as e:
            log.warning("could not give up the scheduler lease (%s): another control plane "
                        "takes it when it lapses, within %g s", _first_line(e), self.ttl_s)
        self.lease = None

    def _stop(self, kind: str, why: str) -> None:
        self.lease = None
        self._say(kind, f"not scheduling: {why}")

    def _say(self, kind: str, line: str) -> None:
        if kind != self._said:
            log.log(logging.WARNING if kind in ("store", "lost") else logging.INFO, line)
            self._said = kind


def control_plane_views(store: Store) -> list[ControlPlaneView]:
    """Every control plane sharing the store; scheduling (with the lease's epoch) for the
    one holding the scheduler lease unexpired, if any."""
    lease = store.lease()
    if lease is not None and lease.expires <= store.clock():
        lease = None
    views: list[ControlPlaneView] = []
    for cp in store.control_planes():
        holds = lease is not None and lease.holder == cp["id"]
        views.append({**cp, "scheduling": holds,
                      "epoch": lease.epoch if lease is not None and holds else 0})
    return views


def _first_line(e: BaseException) -> str:
    found = getattr(e, "orig", None) or e
    return (str(found).strip().splitlines() or [type(found).__name__])[0]
