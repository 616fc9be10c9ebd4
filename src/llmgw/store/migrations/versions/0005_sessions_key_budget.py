"""Viewer keys may expire (completing 0004's table); the fleet page's sessions in the store,
so that every control plane of a fleet honours them and signing out on one ends them on all
(kept by the sha256 of the cookie, never the cookie); the shares of gateway keys' per-minute
limits that each gateway took, so that a key's rpm and tpm hold across every gateway of a
fleet (store/budgets.py; transient rows).

Frozen, as every revision once released: a later change is a new revision.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    op.add_column("viewers", sa.Column("expires", sa.Double))
    op.create_table(
        "sessions",
        sa.Column("hash", sa.Text, primary_key=True),
        sa.Column("role", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("credential", sa.Text, nullable=False),
        sa.Column("created", sa.Double, nullable=False),
        sa.Column("expires", sa.Double, nullable=False))
    op.create_index("sessions_by_credential", "sessions", ["credential", "created"])
    op.create_index("sessions_by_expiry", "sessions", ["expires"])
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
