"""What each gateway saw of each model (requests waiting for a load, in flight, the last
one's time), so the scheduler loads models on demand and gives idle ones' memory back
(store/demand.py; transient rows).

Frozen, as every revision once released: a later change is a new revision.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "demand",
        sa.Column("gateway", sa.Text, primary_key=True),
        sa.Column("model", sa.Text, primary_key=True),
        sa.Column("waiting", sa.Integer, nullable=False, server_default="0"),
        sa.Column("in_flight", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_used", sa.Double, nullable=False, server_default="0"),
        sa.Column("at", sa.Double, nullable=False))
