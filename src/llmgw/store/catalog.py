"""The catalog: the models the fleet may serve, each its spec as JSON."""

from __future__ import annotations

import json

import sqlalchemy as sa

from llmgw.contract.records import ModelSpec

from ._db import Aggregate, StoreConflict
from ._schema import models
from .replicas import stored_spec


class CatalogStore(Aggregate):
    def add_model(self, spec: ModelSpec) -> bool:
        """Add a model; False when the name is taken."""
        try:
            with self.db.tx() as conn:
                conn.execute(models.insert().values(name=spec["name"], spec=json.dumps(spec),
                                                    created=self.clock()))
        except StoreConflict:
            return False
        return True

    def models(self) -> list[ModelSpec]:
        rows = self.db.read(sa.select(models.c.spec).order_by(models.c.created, models.c.name))
        return [stored_spec(r["spec"]) for r in rows]

    def created(self) -> dict[str, int]:
        """When each model entered the catalog (unix seconds), for the gateway's `created`."""
        return {r["name"]: int(r["created"])
                for r in self.db.read(sa.select(models.c.name, models.c.created))}

    def model(self, name: str) -> ModelSpec | None:
        rows = self.db.read(sa.select(models.c.spec).where(models.c.name == name))
        return stored_spec(rows[0]["spec"]) if rows else None

    def delete_model(self, name: str) -> bool:
        with self.db.tx() as conn:
            done = conn.execute(models.delete().where(models.c.name == name))
        return done.rowcount > 0
