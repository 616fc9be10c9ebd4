"""What gateway keys and viewer keys store alike: a row per credential (id, name, prefix, its
hash, created, revoked, expires), a name held by one live row at most. The tables stay two
(released revisions are frozen); this is the one code that adds and revokes their rows."""

from __future__ import annotations

from collections.abc import Mapping

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping

from ._db import Aggregate, StoreConflict


def live(table: sa.Table) -> sa.ColumnElement[bool]:
    """Its rows not revoked."""
    return table.c.revoked.is_(None)


def add(store: Aggregate, table: sa.Table, values: Mapping[str, object]) -> str:
    """Insert a credential's row, created now: '' when stored, else why not ('name', 'id':
    a live one has the name, or any has the id)."""
    named = sa.select(table.c.id).where(table.c.name == values["name"], live(table))
    try:
        with store.db.tx() as conn:
            if conn.execute(named).first():
                return "name"
            conn.execute(table.insert().values(**values, created=store.clock()))
    except StoreConflict:
        # Another control plane's credential of this name came first, or the id is taken.
        if store.db.read(named):
            return "name"
        if store.db.read(sa.select(table.c.id).where(table.c.id == values["id"])):
            return "id"
        raise
    return ""


def revoke(store: Aggregate, table: sa.Table, name_or_prefix: str) -> RowMapping | None:
    """Revoke the live credential of this name, prefix or id; its row as it was, or None."""
    with store.db.tx() as conn:
        row = conn.execute(sa.select(table).where(live(table), sa.or_(
            table.c.name == name_or_prefix, table.c.prefix == name_or_prefix,
            table.c.id == name_or_prefix)).with_for_update()).mappings().first()
        if row is None:
            return None
        conn.execute(table.update().where(table.c.id == row["id"]).values(revoked=store.clock()))
    return row
