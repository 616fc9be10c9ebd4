"""A replica split over several nodes (llama.cpp's RPC backend): its workers beside its main
node, each with the layers it holds and its last report (a JSON list, `[]` for a replica
on one node).

Frozen, as every revision once released: a later change is a new revision.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("replicas", sa.Column("workers", sa.Text, nullable=False,
                                        server_default="[]"))
