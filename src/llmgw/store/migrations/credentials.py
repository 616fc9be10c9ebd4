"""What two released revisions create alike for hashed credentials (0001 gateway keys,
0004 viewer keys); frozen with them: a later change to either table is a new revision's,
never an edit here."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op


def credential_columns() -> list[sa.Column[Any]]:
    """A credential's first columns: its id, its name, the prefix it is shown by and the
    sha256 it is found by."""
    return [sa.Column("id", sa.Text, primary_key=True),
            sa.Column("name", sa.Text, nullable=False),
            sa.Column("prefix", sa.Text, nullable=False),
            sa.Column("hash", sa.Text, nullable=False, unique=True)]


def create_live_name_index(table: str, **options: Any) -> None:
    """A name is one live credential's; a revoked one keeps its row, and its name is free."""
    op.create_index(f"{table}_live_name", table, ["name"], unique=True,
                    sqlite_where=sa.text("revoked IS NULL"),
                    postgresql_where=sa.text("revoked IS NULL"), **options)
