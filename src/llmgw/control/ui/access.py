"""Who may do what on the admin API: the admin token everything; a viewer key, or a
fleet-page session, reads only. The page's own files and its sign-in are open."""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import anyio

from llmgw.contract.secret import digest, same_hash
from llmgw.control.ui.sessions import (
    LIFETIME_S,
    PER_CREDENTIAL,
    Principal,
    Session,
    Sessions,
    cookie_value,
)
from llmgw.control.viewers import is_viewer_key
from llmgw.host.admin_token import ASGIApp, RequireAdminToken, Verifier, _refuse
from llmgw.store import Store, StoreError

# Where the page, its files and its sign-in live: open, as a sign-in form must be.
PAGE = "/ui"
READS = frozenset({"GET", "HEAD"})
# On every answer: no page of the admin API runs a script or style from elsewhere, nor
# inline, nor is framed; no type is sniffed; no address leaks in a Referer.
SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
     b"connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
     b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


class Credentials:
    """What a presented secret is: the admin token (checked against its hash file) or a
    live viewer key (checked against the store)."""

    def __init__(self, hash_path: Path | None, store: Store) -> None:
        self.verifier, self.store = Verifier(hash_path), store
        # The admin token's hash whose predecessors' sessions this process has ended.
        self._swept = ""

    async def identify(self, presented: str) -> tuple[Principal | None, float | None, str]:
        """admin, or a viewer key's name, with when the credential expires (None: never);
        or None and why not. StoreError when a viewer key cannot be checked because the
        store is away."""
        presented = presented.strip()
        if not presented:
            return None, None, "no credential was sent"
        hashed = digest(presented)
        if is_viewer_key(presented):
            viewer = await anyio.to_thread.run_sync(self.store.viewer_by_hash, hashed)
            if viewer is None:
                return None, None, ("the viewer key sent is not a live one here (revoked, or "
                                    "never made on this fleet); `llmgw keys ls --viewer` "
                                    "lists the live ones, `llmgw keys create --viewer` "
                                    "makes one")
            why = expired(viewer["name"], viewer["expires"], self.store.clock())
            if why:
                return None, None, why
            return Principal("viewer", viewer["name"], hashed), viewer["expires"], ""
        expected = self.verifier.current_hash()
        if expected and same_hash(hashed, expected):
            return Principal("admin", "admin", hashed), None, ""
        return None, None, ("that is neither this host's admin token nor a live viewer key; "
                            "`llmgw keys create --viewer` makes a viewer key")

    def refusal(self, session: Session) -> str:
        """'' while a session holds; else why it no longer does (then it is forgotten)."""
        principal = session.principal
        if principal.role == "admin":
            if principal.credential != self.verifier.current_hash():
                return ("the admin token has changed since this session signed in; sign in "
                        "with the new one")
        elif not session.credential_live:
            return (f"the viewer key {principal.name!r} has been revoked; ask an admin for "
                    "another (`llmgw keys create --viewer`)")
        else:
            why = expired(principal.name, session.credential_expires, self.store.clock())
            if why:
                return why
        if session.expires <= self.store.clock():
            return (f"the session's {LIFETIME_S / 3600:.0f} hours since signing in are over; "
                    "sign in again")
        return ""

    async def end_old_admin_sessions(self, sessions: Sessions) -> None:
        """Once for each admin token this process sees (at its first request, then after
        each change of the hash file): end every session signed in with another, in the
        store and in what this process keeps, so that putting an old token's hash back
        revives none of them."""
        current = self.verifier.current_hash()
        if not current or current == self._swept:
            return
        sessions.forget_admin_but(current)
        try:
            await anyio.to_thread.run_sync(self.store.end_admin_sessions_but, current)
        except StoreError:
            return  # the next request tries again; each session is checked meanwhile
        self._swept = current


def expired(name: str, expires: float | None, now: float) -> str:
    """'' while a viewer key has not expired; else what to say."""
    if expires is None or expires > now:
        return ""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
    return (f"the viewer key {name!r} expired at {when}; ask an admin for a new one "
            "(`llmgw keys create --viewer --expires 30d`)")


async def signed_in(credentials: Credentials, sessions: Sessions,
                    token: str) -> tuple[Principal | None, str]:
    """The principal of the session whose cookie is token, or None and why not. StoreError
    when the store is away.

    A session of an admin token that has changed is forgotten in the store there and then,
    on every control plane, so putting the old token's hash back revives none. A session
    refused for what cannot be undone (its viewer key revoked or expired, its lifetime
    over) is kept until its lifetime ends: every page and control plane that asks reads the
    same reason from the store (two tabs, each on its own control plane, both say the key
    was revoked, not the one that asks second "the session has ended"), and the sweep at a
    sign-in removes it with the other expired ones."""
    found = sessions.cached(token)
    if found is None:
        found = await anyio.to_thread.run_sync(sessions.find, token)
    if found is None:
        return None, (f"the fleet page's session has ended (signed out, past its "
                      f"{LIFETIME_S / 3600:.0f} hours, ended by a new admin token, its viewer "
                      f"key revoked, or {PER_CREDENTIAL} newer sign-ins with the same "
                      "credential); sign in again")
    why = credentials.refusal(found)
    if why:
        if found.principal.role == "admin":
            await anyio.to_thread.run_sync(sessions.forget, token)
        return None, f"the session has ended: {why}"
    return found.principal, ""


class AdminAccess(RequireAdminToken):
    """ASGI middleware in RequireAdminToken's place on the admin API: a bearer admin token
    may do anything; a bearer viewer key, and a fleet-page session (its cookie rides on
    any request the browser makes to this host, so it only reads), GET and HEAD only;
    the rest is 401 or 403 saying what to send instead."""

    def __init__(self, app: ASGIApp, *, credentials: Credentials, sessions: Sessions) -> None:
        super().__init__(app, hash_path=credentials.verifier.hash_path)
        self.verifier = credentials.verifier
        self.credentials, self.sessions = credentials, sessions

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        try:
            await self._answer(scope, receive, _with_headers(send))
        finally:
            # After the answer, so a session of the old token is told why it ended.
            await self.credentials.end_old_admin_sessions(self.sessions)

    async def _answer(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        if path in ("/health", "/healthz", PAGE) or path.startswith(PAGE + "/"):
            await self.app(scope, receive, send)
            return
        try:
            principal, why = await self.who(scope)
        except StoreError as e:
            await _refuse(send, f"{scope['method']} {path}: {self.credentials.store.why(e)}; "
                          "a viewer key or a fleet-page session cannot be checked while the "
                          "store is away; use the admin token as a bearer, or try again once "
                          "the database answers", 503)
            return
        if principal is None:
            await _refuse(send, f"{why}. {self.how_to()}; or sign in at {PAGE}/")
        elif principal.reads_only and scope["method"] not in READS:
            await _refuse(send, f"{_read_only(principal, scope)} {self.how_to()}", 403)
        else:
            await self.app(scope, receive, send)

    async def who(self, scope: MutableMapping[str, Any]) -> tuple[Principal | None, str]:
        """The request's principal (a bearer first, else the session cookie), or why none."""
        headers = scope.get("headers") or []
        authorization = dict(headers).get(b"authorization", b"").decode("latin-1")
        if authorization:
            scheme, _, presented = authorization.partition(" ")
            if scheme.lower() == "bearer" and is_viewer_key(presented.strip()):
                found, _, why = await self.credentials.identify(presented)
                return found, why
            why = self.verifier.problem(authorization)
            if why:
                return None, why
            return Principal("admin", "admin", self.verifier.current_hash()), ""
        token = cookie_value(headers)
        if not token:
            return None, self.verifier.problem("")
        return await signed_in(self.credentials, self.sessions, token)


def _read_only(principal: Principal, scope: MutableMapping[str, Any]) -> str:
    what = f"{scope['method']} {scope['path']} would change the fleet, and "
    if principal.role == "viewer":
        return what + f"the viewer key {principal.name!r} only reads (GET)."
    return what + ("the fleet page's session only reads (GET), so that no other site can "
                   "change anything through a browser that is signed in.")


def _with_headers(send: Any) -> Any:
    async def sending(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
        await send(message)

    return sending
