"""The store's rows as data: read whole from one snapshot, written into an empty store of
either backend, and a digest of each table to prove two stores hold the same.

A logical copy rather than SQLite's backup API or pg_dump: one format restores into either
backend (`llmgw restore --store`, `llmgw store migrate --to`), and needs no client binary
of the server's own major version.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from llmgw.errors import Error

from . import Store
from ._schema import metadata

Rows = dict[str, list[dict[str, Any]]]
# Not copied: the fleet page's sessions end with the store they were made in. A restore
# (or a move) that brought them back would revive sessions signed out after the backup
# was taken, and a backup would carry live sign-ins; signing in again is cheap. Nor the
# shares of keys' minutes gateways took (key_budget), which mean nothing a minute later.
NOT_COPIED = frozenset({"sessions", "key_budget", "demand"})


def _copied() -> list[sa.Table]:
    return [t for t in metadata.sorted_tables if t.name not in NOT_COPIED]


class CopyError(Error):
    """A copy that cannot be made or written; says which table and what to do."""


@dataclass(frozen=True)
class Copy:
    """Every table's rows (ordered by primary key) at one moment, but the sessions and the
    shares of keys' minutes (NOT_COPIED), and the schema revision they were read at."""

    revision: str
    rows: Rows

    def digests(self) -> dict[str, str]:
        return {name: digest(rows) for name, rows in sorted(self.rows.items())}

    def counts(self) -> dict[str, int]:
        return {name: len(rows) for name, rows in sorted(self.rows.items())}


def read(store: Store) -> Copy:
    """The whole store from one snapshot (writers go on beside it)."""
    with store.db.snapshot() as conn:
        revision = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
        rows: Rows = {}
        for table in _copied():
            query = sa.select(table).order_by(*table.primary_key.columns)
            rows[table.name] = [dict(r) for r in conn.execute(query).mappings()]
    return Copy(str(revision or ""), rows)


def write(store: Store, copy: Copy) -> None:
    """copy's rows into store, in one transaction; CopyError, and nothing written, when
    store already holds rows, or copy is of a schema revision this code does not have."""
    have = store.db.revision()
    if copy.revision != have:
        raise CopyError(
            f"the copy is of schema revision {copy.revision or 'none'}, the store {store.path} "
            f"is at {have}: restore it with the llmgw that made it (`llmgw --version` there), "
            "then upgrade")
    with store.db.tx() as conn:
        for table in _copied():
            if conn.execute(sa.select(sa.func.count()).select_from(table)).scalar():
                raise CopyError(
                    f"the store {store.path} already holds {table.name}: a copy goes into "
                    "an empty store only (a new database, or a state dir without "
                    "control.db), so nothing there is lost")
        for table in _copied():
            rows = copy.rows.get(table.name, [])
            unknown = set().union(*rows) - set(table.columns.keys()) if rows else set()
            if unknown:
                raise CopyError(f"the copy's {table.name} has columns {sorted(unknown)} this "
                                "schema lacks; it is not of the revision it says")
            for start in range(0, len(rows), 1000):
                conn.execute(table.insert(), rows[start:start + 1000])


def write_verified(store: Store, copy: Copy) -> None:
    """write, then read the store back and compare: CopyError naming what differs."""
    write(store, copy)
    differences = compare(copy, read(store))
    if differences:
        raise CopyError(f"the copy written to {store.path} differs: {'; '.join(differences)}")


def digest(rows: Sequence[Mapping[str, Any]]) -> str:
    """sha256 of rows as canonical JSON (keys sorted, floats as Python writes them): the
    same rows give the same digest whichever backend they were read from."""
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def compare(a: Copy, b: Copy) -> list[str]:
    """What differs between two copies, table by table (count and digest); [] when none."""
    differences = []
    for name in sorted(set(a.rows) | set(b.rows)):
        ra, rb = a.rows.get(name, []), b.rows.get(name, [])
        if len(ra) != len(rb):
            differences.append(f"{name}: {len(ra)} rows, then {len(rb)}")
        elif digest(ra) != digest(rb):
            differences.append(f"{name}: {len(ra)} rows each, but their contents differ")
    return differences
