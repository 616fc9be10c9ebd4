"""Alembic revisions of the store's schema, applied by the control plane at start."""
