"""Viewer keys: read-only credentials for the admin API and the fleet page, in a shape of
their own so that one is never taken for a gateway key (nor a gateway key for one)."""

from __future__ import annotations

from llmgw.contract.records import PublicViewer, ViewerRecord
from llmgw.contract.secret import Secret

# vk-llmgw-<8 hex: the id, shown to people>-<43 characters: the secret part>
PREFIX = "vk-llmgw-"


def new_viewer_key() -> Secret:
    """A fresh viewer key: 8 hex of id, then 256 random bits."""
    return Secret.new(PREFIX)


def is_viewer_key(presented: str) -> bool:
    return presented.startswith(PREFIX)


def public(viewer: ViewerRecord) -> PublicViewer:
    """A stored viewer key as the admin API shows it: never its hash."""
    return {"id": viewer["id"], "name": viewer["name"], "prefix": viewer["prefix"],
            "created": viewer["created"], "revoked": viewer["revoked"],
            "expires": viewer["expires"]}
