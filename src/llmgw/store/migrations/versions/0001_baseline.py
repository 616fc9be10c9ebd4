"""The baseline: the store as llmgw kept it before schema revisions.

Each table and index is created only when missing, so a store from before revisions (its
columns completed by Database._migrate) is stamped here without being rebuilt. Frozen: a
later change to the schema is a new revision, never an edit of this one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from llmgw.store.migrations.credentials import create_live_name_index, credential_columns

revision = "0001"
down_revision = None


def upgrade() -> None:
    time = sa.Double
    op.create_table(
        "nodes",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("inventory", sa.Text, nullable=False),
        sa.Column("first_seen", time, nullable=False),
        sa.Column("last_seen", time, nullable=False),
        sa.Column("serial", sa.Text, nullable=False, server_default=""),
        sa.Column("inv_version", sa.Integer, nullable=False, server_default="0"),
        if_not_exists=True)
    op.create_table(
        "models",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("spec", sa.Text, nullable=False),
        sa.Column("created", time, nullable=False),
        if_not_exists=True)
    op.create_table(
        "replicas",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("node", sa.Text, nullable=False),
        sa.Column("profile", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("err", sa.Text, nullable=False, server_default=""),
        sa.Column("endpoint", sa.Text, nullable=False, server_default=""),
        sa.Column("api_key", sa.Text, nullable=False, server_default=""),
        sa.Column("updated", time, nullable=False),
        sa.Column("gpus", sa.Text, nullable=False, server_default="[]"),
        if_not_exists=True)
    op.create_index("replicas_by_model", "replicas", ["model"], if_not_exists=True)
    op.create_index("replicas_by_node", "replicas", ["node"], if_not_exists=True)
    op.create_table(
        "certs",
        sa.Column("serial", sa.Text, primary_key=True),
        sa.Column("node", sa.Text, nullable=False),
        sa.Column("not_after", time, nullable=False),
        sa.Column("revoked", time),
        if_not_exists=True)
    op.create_index("certs_by_node", "certs", ["node"], if_not_exists=True)
    op.create_table(
        "tokens",
        sa.Column("hash", sa.Text, primary_key=True),
        sa.Column("created", time, nullable=False),
        sa.Column("expires", time, nullable=False),
        sa.Column("used", time),
        sa.Column("used_by", sa.Text, nullable=False, server_default=""),
        if_not_exists=True)
    op.create_table(
        "keys",
        *credential_columns(),
        sa.Column("models", sa.Text, nullable=False, server_default="[]"),
        sa.Column("rpm", sa.Integer, nullable=False, server_default="0"),
        sa.Column("tpm", sa.Integer, nullable=False, server_default="0"),
        sa.Column("expires", time),
        sa.Column("created", time, nullable=False),
        sa.Column("revoked", time),
        sa.Column("last_used", time),
        sa.Column("requests", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
        if_not_exists=True)
    create_live_name_index("keys", if_not_exists=True)
