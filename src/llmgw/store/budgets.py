"""Shares of gateway keys' per-minute limits: what each gateway took of a key's minute, so
that the sum over every gateway sharing the store stays within the key's rpm and tpm."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ._db import Aggregate
from ._schema import key_budget, keys

WINDOW_S = 60.0


@dataclass(frozen=True)
class Want:
    """What a gateway asks of one key's minute: up to amount units of kind ("requests" or
    "tokens") while the minute has them; forced units were spent already (tokens an answer
    used beyond the gateway's share) and are counted whatever is left."""

    key_id: str
    kind: str
    amount: int
    forced: int = 0


@dataclass(frozen=True)
class Grant:
    """What a gateway got: amount units (0: none left) under the row claim (0 when none was
    written); when it got less than it wanted, wait_s until enough of the minute frees up."""

    key_id: str
    kind: str
    claim: int
    amount: int
    wait_s: float = 0.0


@dataclass(frozen=True)
class Settled:
    """A claim a gateway is done with: spent units of it were used, the last at last (unix
    time); the rest goes back to the key's minute."""

    claim: int
    spent: int
    last: float


class BudgetStore(Aggregate):
    def claim_budget(self, gateway: str, wants: Sequence[Want],
                     settled: Sequence[Settled] = (), *, census: bool = False
                     ) -> tuple[list[Grant], int | None]:
        """In one transaction: settle what gateway is done with, then grant each want what
        its key's minute has left (the key's row locked, so two gateways never both take
        the last of it); the grants, and with census how many gateways took shares in the
        last minute (else None).

        A settled claim keeps only its spent units, counted from its last use (never
        earlier than it was taken); one with none spent is removed. Rows older than a
        minute are removed as each key is claimed, and every key's with census."""
        now = self.clock()
        with self.db.tx() as conn:
            for done in settled:
                _settle(conn, done)
            # Keys in one order, so that two gateways claiming the same keys never wait on
            # each other's locks in a cycle.
            grants = [g for key_id in sorted({w.key_id for w in wants})
                      for g in _grants(conn, gateway, key_id,
                                       [w for w in wants if w.key_id == key_id], now)]
            if not census:
                return grants, None
            conn.execute(key_budget.delete().where(key_budget.c.at <= now - WINDOW_S))
            seen = conn.execute(sa.select(sa.func.count(sa.distinct(key_budget.c.gateway)))
                                .where(key_budget.c.at > now - WINDOW_S)).scalar()
        return grants, int(seen or 0)

    def key_budget(self, key_id: str, kind: str) -> dict[str, int]:
        """What each gateway holds of the key's minute now (units by gateway)."""
        now = self.clock()
        rows = self.db.read(
            sa.select(key_budget.c.gateway, sa.func.sum(key_budget.c.amount).label("n"))
            .where(key_budget.c.key_id == key_id, key_budget.c.kind == kind,
                   key_budget.c.at > now - WINDOW_S).group_by(key_budget.c.gateway))
        return {r["gateway"]: int(r["n"]) for r in rows}


def _settle(conn: Connection, done: Settled) -> None:
    row = key_budget.c
    if done.spent <= 0:
        conn.execute(key_budget.delete().where(row.id == done.claim))
        return
    conn.execute(key_budget.update().where(row.id == done.claim).values(
        amount=done.spent, at=sa.case((row.at > done.last, row.at), else_=done.last)))


def _grants(conn: Connection, gateway: str, key_id: str, wants: list[Want],
            now: float) -> list[Grant]:
    """One key's wants granted: its row locked, its rows older than the minute removed, and
    what each kind has left of it."""
    row = key_budget.c
    limits = conn.execute(sa.select(keys.c.rpm, keys.c.tpm).where(keys.c.id == key_id)
                          .with_for_update()).first()
    conn.execute(key_budget.delete().where(row.key_id == key_id, row.at <= now - WINDOW_S))
    used = dict(conn.execute(sa.select(row.kind, sa.func.sum(row.amount))
                             .where(row.key_id == key_id).group_by(row.kind)).all())
    found = []
    for want in wants:
        limit = 0 if limits is None else int(limits[0 if want.kind == "requests" else 1])
        if not limit:  # no such key, or no limit of this kind: nothing to share
            found.append(Grant(key_id, want.kind, 0, 0))
            continue
        found.append(_grant(conn, gateway, want, limit, int(used.get(want.kind) or 0), now))
    return found


def _grant(conn: Connection, gateway: str, want: Want, limit: int, used: int,
           now: float) -> Grant:
    granted = max(0, min(want.amount, limit - used - want.forced))
    if want.forced:
        conn.execute(key_budget.insert().values(key_id=want.key_id, kind=want.kind,
                                                gateway=gateway, at=now, amount=want.forced))
    claim = 0
    if granted:
        made = conn.execute(key_budget.insert().values(
            key_id=want.key_id, kind=want.kind, gateway=gateway, at=now, amount=granted))
        claim = int(made.inserted_primary_key[0])  # type: ignore[index]
    if granted >= want.amount:
        return Grant(want.key_id, want.kind, claim, granted)
    row = key_budget.c
    spent = conn.execute(sa.select(row.at, row.amount).where(
        row.key_id == want.key_id, row.kind == want.kind).order_by(row.at)).all()
    over = used + want.forced + granted + 1 - limit
    return Grant(want.key_id, want.kind, claim, granted, _wait_s(spent, over, now))


def _wait_s(spent: Sequence[tuple[float, int]], over: int, now: float) -> float:
    """Seconds until over units of the minute's rows have left it (the oldest first)."""
    if over <= 0:
        return 0.0
    freed = 0
    for at, n in spent:
        freed += int(n)
        if freed >= over:
            return max(at + WINDOW_S - now, 0.001)
    return WINDOW_S
