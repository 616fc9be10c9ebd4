"""Join tokens that make another control plane: each may carry the fleet's secrets (the
CA, the admin credential, the store's address), sealed with a certificate key the store
never sees (`llmgw token create --control-plane`).

Frozen, as every revision once released: a later change is a new revision.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("bundle", sa.Text, nullable=False, server_default=""))
