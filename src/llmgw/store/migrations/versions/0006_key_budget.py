"""Shares of gateway keys' per-minute limits that each gateway took, so that a key's rpm and
tpm hold across every gateway of a fleet (store/budgets.py); transient rows.

Self-contained (one table, its two indexes, nothing else touched): renumbering it only changes
revision and down_revision.

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
        "key_budget",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("key_id", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("gateway", sa.Text, nullable=False),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("amount", sa.BigInteger, nullable=False))
    op.create_index("key_budget_by_key", "key_budget", ["key_id", "kind", "at"])
    op.create_index("key_budget_by_at", "key_budget", ["at"])
