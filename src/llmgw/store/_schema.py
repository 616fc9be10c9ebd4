"""The store's tables, once, for both backends (SQLite and PostgreSQL).

This is the schema at the newest migration (migrations/versions/): a migration that changes
it changes this too, and tests/store/test_migrations.py holds the two equal.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

# Times are unix seconds (float): REAL in SQLite, double precision in PostgreSQL.
Time = sa.Double

nodes = sa.Table(
    "nodes", metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("inventory", sa.Text, nullable=False),
    sa.Column("first_seen", Time, nullable=False),
    sa.Column("last_seen", Time, nullable=False),
    sa.Column("serial", sa.Text, nullable=False, server_default=""),
    # Counts changes of the inventory text, so readers fetch and parse only what changed.
    sa.Column("inv_version", sa.Integer, nullable=False, server_default="0"),
)

models = sa.Table(
    "models", metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("created", Time, nullable=False),
)

replicas = sa.Table(
    "replicas", metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("node", sa.Text, nullable=False),
    sa.Column("profile", sa.Text, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("err", sa.Text, nullable=False, server_default=""),
    sa.Column("endpoint", sa.Text, nullable=False, server_default=""),
    sa.Column("api_key", sa.Text, nullable=False, server_default=""),
    sa.Column("updated", Time, nullable=False),
    # The GPUs the scheduler assigned (NVML UUIDs, a JSON list).
    sa.Column("gpus", sa.Text, nullable=False, server_default="[]"),
    # A replica split over nodes: its workers (contract.records.SplitWorker, a JSON list);
    # `node` is its main node.
    sa.Column("workers", sa.Text, nullable=False, server_default="[]"),
    sa.Index("replicas_by_model", "model"),
    sa.Index("replicas_by_node", "node"),
)

certs = sa.Table(
    "certs", metadata,
    sa.Column("serial", sa.Text, primary_key=True),
    sa.Column("node", sa.Text, nullable=False),
    sa.Column("not_after", Time, nullable=False),
    sa.Column("revoked", Time),
    sa.Index("certs_by_node", "node"),
)

tokens = sa.Table(
    "tokens", metadata,
    sa.Column("hash", sa.Text, primary_key=True),
    sa.Column("created", Time, nullable=False),
    sa.Column("expires", Time, nullable=False),
    sa.Column("used", Time),
    sa.Column("used_by", sa.Text, nullable=False, server_default=""),
    # A control-plane token's sealed bundle (base64; only its certificate key opens it).
    sa.Column("bundle", sa.Text, nullable=False, server_default=""),
)

keys = sa.Table(
    "keys", metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("prefix", sa.Text, nullable=False),
    sa.Column("hash", sa.Text, nullable=False, unique=True),
    sa.Column("models", sa.Text, nullable=False, server_default="[]"),
    sa.Column("rpm", sa.Integer, nullable=False, server_default="0"),
    sa.Column("tpm", sa.Integer, nullable=False, server_default="0"),
    sa.Column("expires", Time),
    sa.Column("created", Time, nullable=False),
    sa.Column("revoked", Time),
    sa.Column("last_used", Time),
    sa.Column("requests", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    # A name is one live key's; a revoked key keeps its row (and usage), and its name is free.
    sa.Index("keys_live_name", "name", unique=True,
             sqlite_where=sa.text("revoked IS NULL"),
             postgresql_where=sa.text("revoked IS NULL")),
)

# Each control plane sharing this store, upserted every second by itself.
control_planes = sa.Table(
    "control_planes", metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("agent_url", sa.Text, nullable=False, server_default=""),
    sa.Column("admin_url", sa.Text, nullable=False, server_default=""),
    sa.Column("started", Time, nullable=False),
    sa.Column("last_seen", Time, nullable=False),
)

# Who does what only one control plane may do at a time ("scheduler"): until expires, and
# under an epoch that grows each time the lease is taken anew, which every fenced write
# checks in its own transaction.
leases = sa.Table(
    "leases", metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("holder", sa.Text, nullable=False, server_default=""),
    sa.Column("epoch", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("expires", Time, nullable=False, server_default="0"),
)

# Viewer keys: read-only credentials for the admin API and the fleet page (their hashes).
viewers = sa.Table(
    "viewers", metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("prefix", sa.Text, nullable=False),
    sa.Column("hash", sa.Text, nullable=False, unique=True),
    sa.Column("created", Time, nullable=False),
    sa.Column("revoked", Time),
    # When it stops signing in or reading (unix seconds); NULL: never.
    sa.Column("expires", Time),
    sa.Index("viewers_live_name", "name", unique=True,
             sqlite_where=sa.text("revoked IS NULL"),
             postgresql_where=sa.text("revoked IS NULL")),
)

# The fleet page's sessions, by the sha256 of the cookie's value (never the value): who
# (role, name) and by which credential (the sha256 of the admin token or viewer key it
# signed in with), until expires. Every control plane of the fleet reads them.
sessions = sa.Table(
    "sessions", metadata,
    sa.Column("hash", sa.Text, primary_key=True),
    sa.Column("role", sa.Text, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("credential", sa.Text, nullable=False),
    sa.Column("created", Time, nullable=False),
    sa.Column("expires", Time, nullable=False),
    sa.Index("sessions_by_credential", "credential", "created"),
    sa.Index("sessions_by_expiry", "expires"),
)

# Shares of gateway keys' minutes (rpm, tpm) that gateways took (store/budgets.py): a row
# counts amount units against its key's limit from at for a minute. Transient: rows older than
# a minute mean nothing, and copies (backup, restore, store migrate) leave the table out
# (copy.NOT_COPIED).
key_budget = sa.Table(
    "key_budget", metadata,
    # BIGSERIAL in PostgreSQL; SQLite's INTEGER PRIMARY KEY is its rowid (a BIGINT one is not).
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
              autoincrement=True),
    sa.Column("key_id", sa.Text, nullable=False),
    # "requests" or "tokens"
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("gateway", sa.Text, nullable=False),
    sa.Column("at", Time, nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),
    sa.Index("key_budget_by_key", "key_id", "kind", "at"),
    sa.Index("key_budget_by_at", "at"),
)

# What each gateway saw of each model (store/demand.py), written every few seconds: requests
# waiting for a replica to load, in flight, and when the last one came. The scheduler loads
# a model that requests wait for and removes replicas idle past scaling.idle_s. Transient
# (copy.NOT_COPIED): a row not rewritten within DEMAND_FRESH_S means nothing.
demand = sa.Table(
    "demand", metadata,
    sa.Column("gateway", sa.Text, primary_key=True),
    sa.Column("model", sa.Text, primary_key=True),
    sa.Column("waiting", sa.Integer, nullable=False, server_default="0"),
    sa.Column("in_flight", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_used", Time, nullable=False, server_default="0"),
    sa.Column("at", Time, nullable=False),
)

TABLES = (nodes, models, replicas, certs, tokens, keys, control_planes, leases, viewers,
          sessions, key_budget, demand)
