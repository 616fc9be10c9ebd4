"""Gateway keys: their format, hashing, reading a presented key, the window of a limit."""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import re
import secrets
from collections import deque
from dataclasses import dataclass, field

from llmgw.contract.records import KeyRecord, PublicKey

# sk-llmgw-<8 hex: the id, shown to people>-<43 characters: the secret part>
PREFIX = "sk-llmgw-"
_FORMAT = re.compile(rb"sk-llmgw-([0-9a-f]{8})-[A-Za-z0-9_-]{43}")
WINDOW_S = 60.0
# What keys count under in metrics when none (an open gateway) or a server.yaml token is sent.
ANONYMOUS = ""
STATIC = "server.yaml"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


@dataclass(frozen=True)
class NewKey:
    """A key just made: the secret (shown once) and what the store keeps of it."""

    id: str
    secret: str

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.id}"

    @property
    def hash(self) -> str:
        """What the store keeps: the sha256 of the whole key as a client sends it."""
        return hash_key(render(self).encode())


def new_key() -> NewKey:
    """A fresh key: 8 hex of id, then 256 random bits (urlsafe base64, 43 characters)."""
    return NewKey(secrets.token_hex(4), secrets.token_urlsafe(32))


def render(key: NewKey) -> str:
    return f"{key.prefix}-{key.secret}"


def hash_key(presented: bytes) -> str:
    return hashlib.sha256(presented).hexdigest()


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


@dataclass
class Window:
    """What was spent in the last span_s seconds against a limit (a sliding log).

    Entries older than the span fall out; the log holds at most one entry per request."""

    limit: int
    span_s: float = WINDOW_S
    spent: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0

    def _expire(self, now: float) -> None:
        while self.spent and self.spent[0][0] <= now - self.span_s:
            self.total -= self.spent.popleft()[1]

    def wait_s(self, now: float, amount: int = 1, limit: int | None = None) -> float:
        """0 when amount more fits under the limit (or the limit given) now; else the
        seconds until enough of what was spent falls out of the window (at least one entry
        must go)."""
        self._expire(now)
        limit = self.limit if limit is None else limit
        if self.total + amount <= limit or not self.spent:
            return 0.0
        over, freed = self.total + amount - limit, 0
        for at, n in self.spent:
            freed += n
            if freed >= over:
                return max(at + self.span_s - now, 0.001)
        return self.spent[-1][0] + self.span_s - now

    def add(self, now: float, amount: int) -> None:
        if amount > 0:
            self._expire(now)
            self.spent.append((now, amount))
            self.total += amount

    def since(self, t: float) -> int:
        """What was spent after t (newest entries first: cheap for a recent t)."""
        found = 0
        for at, n in reversed(self.spent):
            if at <= t:
                break
            found += n
        return found


def retry_after(wait_s: float) -> str:
    """Retry-After's value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait_s)))


@dataclass
class Usage:
    """Requests and tokens per key id, gathered in memory between two writes to the store."""

    counts: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key_id: str, now: float, prompt: int, completion: int) -> None:
        got = self.counts.get(key_id)
        if got is None:
            self.counts[key_id] = [1, prompt, completion, now]
            return
        got[0] += 1
        got[1] += prompt
        got[2] += completion
        got[3] = max(got[3], now)

    def take(self) -> dict[str, tuple[int, int, int, float]]:
        """Everything gathered, leaving none."""
        taken = {k: (int(v[0]), int(v[1]), int(v[2]), v[3]) for k, v in self.counts.items()}
        self.counts = {}
        return taken

    def put_back(self, taken: dict[str, tuple[int, int, int, float]]) -> None:
        """Gathered counts that could not be written, merged with what came since."""
        for key_id, (requests, prompt, completion, last) in taken.items():
            got = self.counts.setdefault(key_id, [0, 0, 0, 0.0])
            got[0] += requests
            got[1] += prompt
            got[2] += completion
            got[3] = max(got[3], last)


def public(key: KeyRecord) -> PublicKey:
    """A stored key as the admin API shows it: never its hash."""
    return {"id": key["id"], "name": key["name"], "prefix": key["prefix"],
            "models": key["models"], "rpm": key["rpm"], "tpm": key["tpm"],
            "expires": key["expires"], "created": key["created"], "revoked": key["revoked"],
            "last_used": key["last_used"], "requests": key["requests"],
            "prompt_tokens": key["prompt_tokens"], "completion_tokens": key["completion_tokens"]}
