"""Viewer keys: read-only credentials for the admin API and the fleet page (`llmgw keys
create --viewer`), kept as hashes.

Frozen, as every revision once released: a later change is a new revision.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from llmgw.store.migrations.credentials import create_live_name_index, credential_columns

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    op.create_table(
        "viewers",
        *credential_columns(),
        sa.Column("created", sa.Double, nullable=False),
        sa.Column("revoked", sa.Double))
    create_live_name_index("viewers")
