"""A secret made here and kept by its sha256 alone: the one shape, hash and check that the
admin token, gateway keys, viewer keys and the fleet page's session cookies share."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Secret:
    """KIND ID-RANDOM (a gateway key sk-llmgw-0123abcd-..., a viewer key vk-llmgw-...), or
    the random part alone when it has no kind (the admin token, a session cookie). The
    text is shown once, to whoever asked for it; what is kept is its hash."""

    kind: str
    id: str
    random: str

    @classmethod
    def new(cls, kind: str = "") -> Secret:
        """A fresh one: 8 hex of id when it has a kind, then 256 random bits (urlsafe
        base64, 43 characters)."""
        return cls(kind, secrets.token_hex(4) if kind else "", secrets.token_urlsafe(32))

    @property
    def prefix(self) -> str:
        """What people see of it: the kind and the id."""
        return f"{self.kind}{self.id}"

    @property
    def text(self) -> str:
        """The whole secret, as a client sends it."""
        return f"{self.prefix}-{self.random}" if self.kind else self.random

    @property
    def hash(self) -> str:
        """What the store or the hash file keeps: the sha256 of the text."""
        return digest(self.text)


def digest(presented: str | bytes) -> str:
    """The sha256 in hex of a secret as presented."""
    return hashlib.sha256(presented.encode() if isinstance(presented, str) else presented
                          ).hexdigest()


def same_hash(a: str, b: str) -> bool:
    """Whether two hashes are equal, compared in constant time: of equal length, the timing
    says nothing (compared as bytes, so a hash file holding other text is a mismatch)."""
    return hmac.compare_digest(a.encode(), b.encode())


def matches(presented: str | bytes, expected: str) -> bool:
    """Whether presented is the secret whose hash is expected."""
    return bool(expected) and same_hash(digest(presented), expected)
