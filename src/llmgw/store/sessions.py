"""The fleet page's sessions: by the sha256 of the cookie (never the cookie), with who they
speak for, the credential they came from and when they end, so that every control plane
sharing the store honours them and signing out on one ends them on all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from llmgw.contract.records import SessionRecord

from ._db import Aggregate
from ._schema import sessions, viewers


class SessionStore(Aggregate):
    def add_session(self, session: Mapping[str, Any], *, per_credential: int,
                    total: int) -> list[str]:
        """Store a session (hash, role, name, credential, expires), first dropping those
        expired. Past per_credential sessions of its credential, that credential's oldest
        end; past total in all, the oldest of whichever credential holds the most (the one
        signing in, on a tie), so one credential signing in over and over never ends
        another's. The hashes ended."""
        now = self.clock()
        with self.db.tx() as conn:
            conn.execute(sessions.delete().where(sessions.c.expires <= now))
            conn.execute(sessions.insert().values(
                **{f: session[f] for f in ("hash", "role", "name", "credential", "expires")},
                created=now))
            ended = _end_oldest(conn, session["credential"],
                                _count(conn, session["credential"]) - per_credential)
            over = _count(conn) - total
            if over > 0:
                mine = sa.case((sessions.c.credential == session["credential"], 1), else_=0)
                most = conn.execute(
                    sa.select(sessions.c.credential).group_by(sessions.c.credential)
                    .order_by(sa.func.count().desc(), sa.func.max(mine).desc(),
                              sessions.c.credential).limit(1)).scalar_one()
                ended += _end_oldest(conn, most, over)
        return ended

    def session(self, digest: str) -> SessionRecord | None:
        """The session whose cookie's sha256 is digest (expired or not: the caller says
        which), with its viewer key's state read in the same query; None when there is
        none (never made, signed out, or ended)."""
        query = (sa.select(sessions, viewers.c.id.label("viewer_id"),
                           viewers.c.revoked.label("viewer_revoked"),
                           viewers.c.expires.label("viewer_expires"))
                 .select_from(sessions.outerjoin(viewers, sa.and_(
                     sessions.c.role == "viewer", viewers.c.hash == sessions.c.credential)))
                 .where(sessions.c.hash == digest))
        rows = self.db.read(query)
        return _record(rows[0]) if rows else None

    def end_session(self, digest: str) -> bool:
        """End a session, on every control plane; whether there was one."""
        with self.db.tx() as conn:
            return bool(conn.execute(sessions.delete().where(sessions.c.hash == digest))
                        .rowcount)

    def end_admin_sessions_but(self, credential: str) -> int:
        """End every session signed in with an admin token other than the one whose sha256
        is credential (the admin token has changed); how many."""
        with self.db.tx() as conn:
            return int(conn.execute(sessions.delete().where(
                sessions.c.role == "admin", sessions.c.credential != credential)).rowcount)


def _count(conn: Connection, credential: str | None = None) -> int:
    query = sa.select(sa.func.count()).select_from(sessions)
    if credential is not None:
        query = query.where(sessions.c.credential == credential)
    return int(conn.execute(query).scalar_one())


def _end_oldest(conn: Connection, credential: str, n: int) -> list[str]:
    if n <= 0:
        return []
    oldest = [r[0] for r in conn.execute(
        sa.select(sessions.c.hash).where(sessions.c.credential == credential)
        .order_by(sessions.c.created, sessions.c.hash).limit(n))]
    conn.execute(sessions.delete().where(sessions.c.hash.in_(oldest)))
    return oldest


def _record(row: RowMapping) -> SessionRecord:
    viewer = row["role"] == "viewer"
    return {"hash": row["hash"], "role": row["role"], "name": row["name"],
            "credential": row["credential"], "created": row["created"],
            "expires": row["expires"],
            "viewer_live": not viewer or (row["viewer_id"] is not None
                                          and row["viewer_revoked"] is None),
            "viewer_expires": row["viewer_expires"] if viewer else None}
