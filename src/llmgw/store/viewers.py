"""Viewer keys (their hashes, never the keys): read-only credentials for the admin API."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping

from llmgw.contract.records import ViewerRecord

from . import _credentials
from ._db import Aggregate
from ._schema import viewers

_LIVE = _credentials.live(viewers)


class ViewerStore(Aggregate):
    def add_viewer(self, viewer: Mapping[str, Any]) -> str:
        """Store a viewer key (id, name, prefix, hash, and expires if it does): '' when
        stored, else why not ('name', 'id': a live viewer key has it)."""
        return _credentials.add(self, viewers, {
            "id": viewer["id"], "name": viewer["name"], "prefix": viewer["prefix"],
            "hash": viewer["hash"], "expires": viewer.get("expires")})

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
        row = _credentials.revoke(self, viewers, name_or_prefix)
        return None if row is None else _record(row)


def _record(row: RowMapping) -> ViewerRecord:
    return {"id": row["id"], "name": row["name"], "prefix": row["prefix"],
            "hash": row["hash"], "created": row["created"], "revoked": row["revoked"],
            "expires": row["expires"]}
