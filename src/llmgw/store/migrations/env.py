"""Alembic's entry: migrations run on the connection the store opened (Database._migrate),
inside its transaction; there is no alembic.ini and no offline mode."""

from __future__ import annotations

from alembic import context

from llmgw.store._schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
