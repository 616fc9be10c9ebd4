"""Viewer keys (their hashes, never the keys): read-only credentials for the admin API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping

from llmgw.contract.records import ViewerRecord

from ._db import Aggregate, StoreConflict
from ._schema import viewers

_LIVE = viewers.c.revoked.is_(None)


class ViewerStore(Aggregate):
    def add_viewer(self, viewer: Mapping[str, Any]) -> str:
        """Store a viewer key (id, name, prefix, hash, and expires if it does): '' when
        stored, else why not ('name', 'id': a live viewer key has it)."""
        try:
            with self.db.tx() as conn:
                if conn.execute(sa.select(viewers.c.id).where(
                        viewers.c.name == viewer["name"], _LIVE)).first():
                    return "name"
                conn.execute(viewers.insert().values(
                    id=viewer["id"], name=viewer["name"], prefix=viewer["prefix"],
                    hash=viewer["hash"], expires=viewer.get("expires"),
                    created=self.clock()))
        except StoreConflict:
            # Another control plane's viewer key of this name came first, or the id is taken.
            if self.db.read(sa.select(viewers.c.id).where(viewers.c.name == viewer["name"],
                                                          _LIVE)):
                return "name"
            return "id"
        return ""

    def viewers(self) -> list[ViewerRecord]:
        """Unrevoked viewer keys by creation (expired ones too: they show as such), with
        their hashes: callers decide what leaves."""
        return [_record(r) for r in self.db.read(
            sa.select(viewers).where(_LIVE).order_by(viewers.c.created, viewers.c.name))]

    def viewer_by_hash(self, digest: str) -> ViewerRecord | None:
        """The unrevoked viewer key whose sha256 is digest, or None; the caller refuses it
        once it has expired, saying so."""
        rows = self.db.read(sa.select(viewers).where(viewers.c.hash == digest, _LIVE))
        return _record(rows[0]) if rows else None

    def revoke_viewer(self, name_or_prefix: str) -> ViewerRecord | None:
        """Revoke the live viewer key of this name, prefix or id; it as it was, or None."""
        with self.db.tx() as conn:
            row = conn.execute(sa.select(viewers).where(_LIVE, sa.or_(
                viewers.c.name == name_or_prefix, viewers.c.prefix == name_or_prefix,
                viewers.c.id == name_or_prefix)).with_for_update()).mappings().first()
            if row is None:
                return None
            conn.execute(viewers.update().where(viewers.c.id == row["id"])
                         .values(revoked=self.clock()))
        return _record(row)


def _record(row: RowMapping) -> ViewerRecord:
    return {"id": row["id"], "name": row["name"], "prefix": row["prefix"],
            "hash": row["hash"], "created": row["created"], "revoked": row["revoked"],
            "expires": row["expires"]}
