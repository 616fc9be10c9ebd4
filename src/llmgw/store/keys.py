"""Gateway keys (their hashes, never their secrets) and the usage counted against them."""

from __future__ import annotations

import json
from collections.abc import Mapping

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping

from llmgw.contract.records import KeyRecord

from . import _credentials
from ._db import Aggregate
from ._schema import keys

_GIVEN = ("id", "name", "prefix", "hash", "rpm", "tpm", "expires")
_LIVE = _credentials.live(keys)


class KeyStore(Aggregate):
    def add_key(self, key: Mapping[str, object]) -> str:
        """Store a gateway key (its hash, never the secret): '' when stored, else why not
        ('name', 'id': a live key has it)."""
        return _credentials.add(self, keys, {**{f: key[f] for f in _GIVEN if f in key},
                                             "models": json.dumps(key.get("models", []))})

    def keys(self, revoked: bool = False) -> list[KeyRecord]:
        """Live gateway keys by creation (revoked ones too with revoked=True), with their
        hashes: callers decide what leaves the process."""
        query = sa.select(keys).order_by(keys.c.created, keys.c.name)
        if not revoked:
            query = query.where(_LIVE)
        return [_key_record(r) for r in self.db.read(query)]

    def revoke_key(self, name_or_prefix: str) -> KeyRecord | None:
        """Revoke the live key of this name, prefix or id; the key as it was, or None."""
        row = _credentials.revoke(self, keys, name_or_prefix)
        return None if row is None else _key_record(row)

    def add_key_usage(self, usage: dict[str, tuple[int, int, int, float]]) -> None:
        """Add a batch of usage (key id -> requests, prompt and completion tokens, last
        used) in one transaction; StoreError when the store stays busy or is away."""
        last = sa.bindparam("at", type_=sa.Double)
        add = keys.update().where(keys.c.id == sa.bindparam("key")).values(
            requests=keys.c.requests + sa.bindparam("n"),
            prompt_tokens=keys.c.prompt_tokens + sa.bindparam("prompt"),
            completion_tokens=keys.c.completion_tokens + sa.bindparam("completion"),
            last_used=sa.case((sa.func.coalesce(keys.c.last_used, 0) > last, keys.c.last_used),
                              else_=last))
        with self.db.tx() as conn:
            conn.execute(add, [{"key": key_id, "n": n, "prompt": prompt,
                                "completion": completion, "at": at}
                               for key_id, (n, prompt, completion, at) in usage.items()])


def _key_record(row: RowMapping) -> KeyRecord:
    """A keys row as a record: models is JSON text."""
    return {"id": row["id"], "name": row["name"], "prefix": row["prefix"], "hash": row["hash"],
            "models": json.loads(row["models"]), "rpm": row["rpm"], "tpm": row["tpm"],
            "expires": row["expires"], "created": row["created"], "revoked": row["revoked"],
            "last_used": row["last_used"], "requests": row["requests"],
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"]}
