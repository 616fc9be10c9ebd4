"""The fleet page's sign-in sessions: kept in the store by the sha256 of the cookie's value
(never the value), so every control plane of the fleet honours them and signing out on one
ends them on all; each process keeps what it read for a second."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.contract import secret
from llmgw.store import Store

COOKIE = "llmgw_session"
LIFETIME_S = 12 * 3600.0
# Bounds on what signing in may make the store hold: past PER_CREDENTIAL sessions of one
# credential (an admin token, a viewer key), its own oldest ends; past MAX_SESSIONS in all,
# the oldest of the credential holding the most. A viewer key signing in 10,000 times ends
# only its own sessions, never an admin's.
MAX_SESSIONS = 10_000
PER_CREDENTIAL = 100
# How long a process trusts a session it read from the store without reading it again:
# a sign-out or a revocation on another control plane holds here within this; on this one,
# at the next request (it forgets what it kept).
CACHE_S = 1.0
# Past this many sessions kept, the stale ones are dropped (then all, if none was stale).
CACHE_MAX = 4096


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


@dataclass(frozen=True)
class Session:
    """A session as the store holds it: who it speaks for, when it ends, and its viewer
    key's state when it was read (live: not revoked; expires: None for never)."""

    principal: Principal
    expires: float
    credential_live: bool = True
    credential_expires: float | None = None


class Sessions:
    """Open, find and forget sessions in the store; each lasts LIFETIME_S from its sign-in.
    find() reads the store at most once a CACHE_S per session (monotonic: the cache's own
    clock); the store's clock stamps and ends sessions. Store calls raise StoreError."""

    def __init__(self, store: Store, *, cache_s: float = CACHE_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store, self.cache_s, self.monotonic = store, cache_s, monotonic
        self._kept: dict[str, tuple[Session, float]] = {}
        self._lock = threading.Lock()

    def open(self, principal: Principal, credential_expires: float | None = None) -> str:
        """A new session for principal: the cookie's value (the store keeps its hash)."""
        cookie = secret.Secret.new()
        digest = cookie.hash
        expires = self.store.clock() + LIFETIME_S
        ended = self.store.add_session(
            {"hash": digest, "role": principal.role, "name": principal.name,
             "credential": principal.credential, "expires": expires},
            per_credential=PER_CREDENTIAL, total=MAX_SESSIONS)
        with self._lock:
            for gone in ended:
                self._kept.pop(gone, None)
            self._keep(digest, Session(principal, expires, True, credential_expires))
        return cookie.text

    def cached(self, token: str) -> Session | None:
        """The session this process read within CACHE_S, or None (then ask find)."""
        with self._lock:
            kept = self._kept.get(secret.digest(token))
        if kept is None or self.monotonic() - kept[1] >= self.cache_s:
            return None
        return kept[0]

    def find(self, token: str) -> Session | None:
        """The session of this cookie, expired or not (the caller says which it is), or
        None: never made, signed out or ended, here or on another control plane."""
        found = self.cached(token)
        if found is not None:
            return found
        digest = secret.digest(token)
        row = self.store.session(digest)
        if row is None:
            with self._lock:
                self._kept.pop(digest, None)
            return None
        found = Session(Principal(row["role"], row["name"], row["credential"], True),
                        row["expires"], row["viewer_live"], row["viewer_expires"])
        with self._lock:
            self._keep(digest, found)
        return found

    def forget(self, token: str) -> bool:
        """End a session, on every control plane; whether the store had it."""
        digest = secret.digest(token)
        with self._lock:
            self._kept.pop(digest, None)
        return self.store.end_session(digest)

    def forget_credential(self, credential: str) -> None:
        """Read again at their next request the sessions of this credential (its viewer
        key was revoked here): this process keeps none of them."""
        with self._lock:
            for digest in [d for d, (s, _) in self._kept.items()
                           if s.principal.credential == credential]:
                del self._kept[digest]

    def forget_admin_but(self, credential: str) -> None:
        """Keep no session of an admin token other than the one whose sha256 is
        credential (the admin token has changed)."""
        with self._lock:
            for digest in [d for d, (s, _) in self._kept.items()
                           if s.principal.role == "admin" and s.principal.credential != credential]:
                del self._kept[digest]

    def _keep(self, digest: str, session: Session) -> None:
        now = self.monotonic()
        if len(self._kept) >= CACHE_MAX:
            self._kept = {d: k for d, k in self._kept.items() if now - k[1] < self.cache_s}
            if len(self._kept) >= CACHE_MAX:
                self._kept.clear()
        self._kept[digest] = (session, now)


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
