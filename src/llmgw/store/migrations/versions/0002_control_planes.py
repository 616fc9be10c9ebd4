"""Several control planes on one store: each one's row, and the lease that says which one
schedules (with the epoch every placement write checks).

Frozen, as every revision once released: a later change is a new revision.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    time = sa.Double
    op.create_table(
        "control_planes",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("agent_url", sa.Text, nullable=False, server_default=""),
        sa.Column("admin_url", sa.Text, nullable=False, server_default=""),
        sa.Column("started", time, nullable=False),
        sa.Column("last_seen", time, nullable=False))
    op.create_table(
        "leases",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("holder", sa.Text, nullable=False, server_default=""),
        sa.Column("epoch", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("expires", time, nullable=False, server_default="0"))

