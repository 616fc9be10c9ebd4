"""Viewer keys: read-only credentials for the admin API and the fleet page, in a shape of
their own so that one is never taken for a gateway key (nor a gateway key for one)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from llmgw.contract.records import PublicViewer, ViewerRecord

# vk-llmgw-<8 hex: the id, shown to people>-<43 characters: the secret part>
PREFIX = "vk-llmgw-"


@dataclass(frozen=True)
class NewViewerKey:
    """A viewer key just made: the whole key (shown once) and what the store keeps."""

    id: str
    secret: str

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.id}"

    @property
    def key(self) -> str:
        return f"{self.prefix}-{self.secret}"

    @property
    def hash(self) -> str:
        return hash_viewer_key(self.key)


def new_viewer_key() -> NewViewerKey:
    """A fresh viewer key: 8 hex of id, then 256 random bits (urlsafe base64)."""
    return NewViewerKey(secrets.token_hex(4), secrets.token_urlsafe(32))


def hash_viewer_key(presented: str) -> str:
    return hashlib.sha256(presented.encode()).hexdigest()


def is_viewer_key(presented: str) -> bool:
    return presented.startswith(PREFIX)


def public(viewer: ViewerRecord) -> PublicViewer:
    """A stored viewer key as the admin API shows it: never its hash."""
    return {"id": viewer["id"], "name": viewer["name"], "prefix": viewer["prefix"],
            "created": viewer["created"], "revoked": viewer["revoked"],
            "expires": viewer["expires"]}
