"""Gateway keys: their format (a Secret of kind sk-llmgw-, kept by its sha256), reading a
presented key, their names and expiry, how the admin API shows one. Made by the control
plane, read by the gateway (whose limit windows and usage are llmgw.gateway._limits')."""

from __future__ import annotations

import datetime as dt
import re

from llmgw.contract.records import KeyRecord, PublicKey
from llmgw.contract.secret import Secret

# sk-llmgw-<8 hex: the id, shown to people>-<43 characters: the secret part>
PREFIX = "sk-llmgw-"
_FORMAT = re.compile(rb"sk-llmgw-([0-9a-f]{8})-[A-Za-z0-9_-]{43}")
# What keys count under in metrics when none (an open gateway) or a server.yaml token is sent.
ANONYMOUS = ""
STATIC = "server.yaml"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def new_key() -> Secret:
    """A fresh key: 8 hex of id, then 256 random bits; the store keeps the sha256 of the
    whole key as a client sends it."""
    return Secret.new(PREFIX)


def bearer(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The bearer credential of an ASGI request's headers: None when no Authorization
    header was sent, b"" when it is not a bearer one; the scheme in any case."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, given = value.strip().partition(b" ")
            return given.strip() if scheme.lower() == b"bearer" else b""
    return None


def is_key_shaped(presented: bytes) -> bool:
    """Whether presented has a gateway key's shape (ASCII, the prefix, the lengths)."""
    return _FORMAT.fullmatch(presented) is not None


def check_name(name: str) -> str:
    """A key's name as given; ValueError saying what is allowed when it is not."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"key name {name!r} is not allowed: use 1 to 64 letters, digits and "
                         ". _ @ -, starting with a letter or digit")
    return name


def parse_expires(text: str, now: float) -> float:
    """--expires: a date (2027-01-31, the end of that day UTC), a time with its zone
    (2027-01-31T12:00:00+00:00) or a span (30d, 12h); ValueError saying what is allowed."""
    span = re.fullmatch(r"(\d+)([dhm])", text.strip())
    if span:
        n, unit = int(span[1]), span[2]
        return now + n * {"d": 86400, "h": 3600, "m": 60}[unit]
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--expires {text!r} is not a date: write 2027-01-31, "
                         "2027-01-31T12:00:00+00:00, or a span such as 30d or 12h") from None
    if len(text.strip()) == 10:  # a date alone: valid through that whole day
        when = when + dt.timedelta(days=1)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    if when.timestamp() <= now:
        raise ValueError(f"--expires {text!r} is in the past; give a later date")
    return when.timestamp()


def public(key: KeyRecord) -> PublicKey:
    """A stored key as the admin API shows it: never its hash."""
    return {"id": key["id"], "name": key["name"], "prefix": key["prefix"],
            "models": key["models"], "rpm": key["rpm"], "tpm": key["tpm"],
            "expires": key["expires"], "created": key["created"], "revoked": key["revoked"],
            "last_used": key["last_used"], "requests": key["requests"],
            "prompt_tokens": key["prompt_tokens"], "completion_tokens": key["completion_tokens"]}
