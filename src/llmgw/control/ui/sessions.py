"""The fleet page's sign-in sessions: held in this process's memory by the sha256 of the
cookie's value, so signing out (or a restart of the control plane) forgets them."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

COOKIE = "llmgw_session"
LIFETIME_S = 12 * 3600.0
# A bound on what signing in may make this process hold: past it the oldest session goes.
MAX_SESSIONS = 10_000


@dataclass(frozen=True)
class Principal:
    """Who a request speaks for: role "admin" (the admin token) or "viewer" (a viewer
    key, named), credential the sha256 of what was presented, session whether it came
    by the page's cookie (which only reads) rather than as a bearer."""

    role: str
    name: str
    credential: str
    session: bool = False

    @property
    def reads_only(self) -> bool:
        return self.role != "admin" or self.session


class Sessions:
    """Open, find and forget sessions; each lasts LIFETIME_S from its sign-in."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._open: dict[str, tuple[Principal, float]] = {}
        self._lock = threading.Lock()

    def open(self, principal: Principal) -> str:
        """A new session for principal: the cookie's value (this process keeps its hash)."""
        token = secrets.token_urlsafe(32)
        with self._lock:
            while len(self._open) >= MAX_SESSIONS:
                self._open.pop(next(iter(self._open)))
            self._open[_digest(token)] = (principal, self.clock() + LIFETIME_S)
        return token

    def find(self, token: str) -> Principal | None:
        """The principal of a live session, or None (unknown, forgotten or expired)."""
        with self._lock:
            found = self._open.get(_digest(token))
            if found is None:
                return None
            if found[1] <= self.clock():
                del self._open[_digest(token)]
                return None
        return found[0]

    def forget(self, token: str) -> bool:
        """End a session; whether there was one."""
        with self._lock:
            return self._open.pop(_digest(token), None) is not None


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def cookie_value(headers: list[tuple[bytes, bytes]]) -> str:
    """The session cookie's value among an ASGI request's headers, or ''."""
    for name, value in headers:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            key, _, given = part.strip().partition("=")
            if key == COOKIE:
                return given
    return ""


def set_cookie(token: str, *, secure: bool) -> str:
    """The Set-Cookie value that hands a session to the browser: never to scripts
    (HttpOnly), never on another site's requests (SameSite=Strict), over TLS only where
    the page came over TLS."""
    return (f"{COOKIE}={token}; Path=/; Max-Age={int(LIFETIME_S)}; HttpOnly; "
            f"SameSite=Strict{'; Secure' if secure else ''}")


def clear_cookie(*, secure: bool) -> str:
    return f"{COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict{'; Secure' if secure else ''}"
