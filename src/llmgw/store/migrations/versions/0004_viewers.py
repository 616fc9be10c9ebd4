"""Viewer keys: read-only credentials for the admin API and the fleet page (`llmgw keys
create --viewer`), kept as hashes.

Frozen, as every revision once released: a later change is a new revision.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    op.create_table(
        "viewers",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("prefix", sa.Text, nullable=False),
        sa.Column("hash", sa.Text, nullable=False, unique=True),
        sa.Column("created", sa.Double, nullable=False),
        sa.Column("revoked", sa.Double))
    op.create_index("viewers_live_name", "viewers", ["name"], unique=True,
                    sqlite_where=sa.text("revoked IS NULL"),
                    postgresql_where=sa.text("revoked IS NULL"))
