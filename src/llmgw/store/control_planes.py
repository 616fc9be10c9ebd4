"""Control planes sharing one store: each one's row, beaten every second, and the leases
that let exactly one of them do what only one may (schedule), fenced by an epoch."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from llmgw.contract.records import ControlPlane
from llmgw.errors import Error

from ._db import Aggregate, insert
from ._schema import control_planes, leases

SCHEDULER = "scheduler"
# A control plane not heard from for a day is gone (a machine replaced, a state dir
# rebuilt under a new id): its row is forgotten by the next beat of another.
FORGET_AFTER_S = 86_400.0


@dataclass(frozen=True)
class Lease:
    """A lease as its holder took it: valid until expires (the store's clock), and only
    under this epoch (a holder that lost it and took it again has another)."""

    name: str
    holder: str
    epoch: int
    expires: float


class LeaseLost(Error):
    """A fenced write found the lease no longer this holder's under this epoch (it lapsed,
    or another control plane took it); nothing was written."""


class ControlPlaneStore(Aggregate):
    def beat_control_plane(self, cp_id: str, agent_url: str, admin_url: str,
                           started: float | None = None) -> None:
        """Upsert this control plane's row: last_seen now; started as given (the process's
        start), else kept from the row, else now. Rows silent for FORGET_AFTER_S go."""
        now = self.clock()
        with self.db.tx() as conn:
            row = insert(conn, control_planes).values(
                id=cp_id, agent_url=agent_url, admin_url=admin_url,
                started=now if started is None else started, last_seen=now)
            update = {"agent_url": row.excluded.agent_url, "admin_url": row.excluded.admin_url,
                      "last_seen": row.excluded.last_seen}
            if started is not None:
                update["started"] = row.excluded.started
            conn.execute(row.on_conflict_do_update(index_elements=[control_planes.c.id],
                                                   set_=update))
            conn.execute(control_planes.delete().where(
                control_planes.c.last_seen < now - FORGET_AFTER_S))

    def control_planes(self) -> list[ControlPlane]:
        """Every control plane that ever beat here, by id."""
        rows = self.db.read(sa.select(control_planes).order_by(control_planes.c.id))
        return [{"id": r["id"], "agent_url": r["agent_url"], "admin_url": r["admin_url"],
                 "started": r["started"], "last_seen": r["last_seen"]} for r in rows]

    def lease(self, name: str = SCHEDULER) -> Lease | None:
        """The lease as stored (perhaps expired: compare expires with the clock), or None
        when nobody ever took it."""
        rows = self.db.read(sa.select(leases).where(leases.c.name == name))
        return _lease(rows[0]) if rows and rows[0]["holder"] else None

    def acquire_lease(self, holder: str, ttl_s: float, name: str = SCHEDULER) -> Lease | None:
        """Take the lease for ttl_s when it is free or expired (its epoch +1: a new term,
        even for the holder it lapsed from), renew it when holder has it unexpired (same
        epoch), or None when another holds it unexpired. One transaction, the row locked."""
        now = self.clock()
        with self.db.tx() as conn:
            current = _locked(conn, name)
            if current.holder and current.holder != holder and current.expires > now:
                return None
            renew = current.holder == holder and current.expires > now
            lease = Lease(name, holder, current.epoch + (0 if renew else 1), now + ttl_s)
            conn.execute(leases.update().where(leases.c.name == name).values(
                holder=holder, epoch=lease.epoch, expires=lease.expires))
        return lease

    def release_lease(self, lease: Lease) -> bool:
        """Give the lease up now (a clean stop), so another takes it at its next try instead
        of after the ttl; False when it was no longer this holder's under this epoch."""
        with self.db.tx() as conn:
            done = conn.execute(leases.update().where(
                leases.c.name == lease.name, leases.c.holder == lease.holder,
                leases.c.epoch == lease.epoch).values(expires=0))
        return bool(done.rowcount)


def fence(conn: Connection, lease: Lease, now: float) -> None:
    """In conn's transaction, lock the lease row and raise LeaseLost unless it still
    names lease's holder under lease's epoch, unexpired: a write after this is fenced
    (nobody takes the lease over until the transaction ends)."""
    current = _locked(conn, lease.name)
    if (current.holder, current.epoch) == (lease.holder, lease.epoch) \
            and current.expires > now:
        return
    if current.holder == lease.holder and current.epoch == lease.epoch:
        now_held = "it lapsed and nobody has taken it since"
    else:
        now_held = (f"{current.holder or 'nobody'} holds it now under epoch "
                    f"{current.epoch}")
    raise LeaseLost(
        f"the {lease.name} lease is no longer {lease.holder}'s under epoch {lease.epoch}: "
        f"{now_held}; nothing was written (this control plane was frozen or cut off past "
        "its lease); it stops and takes the lease again only once it is free")


def _locked(conn: Connection, name: str) -> Lease:
    """The lease row, locked for the transaction (made free first if missing, so two
    first takers on PostgreSQL queue on the row instead of racing to insert it)."""
    conn.execute(insert(conn, leases).values(name=name, holder="", epoch=0, expires=0)
                 .on_conflict_do_nothing(index_elements=[leases.c.name]))
    return _lease(conn.execute(sa.select(leases).where(leases.c.name == name)
                               .with_for_update()).mappings().one())


def _lease(row: RowMapping) -> Lease:
    return Lease(row["name"], row["holder"], int(row["epoch"]), float(row["expires"]))
