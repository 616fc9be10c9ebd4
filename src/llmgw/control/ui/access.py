"""Who may do what on the admin API: the admin token everything; a viewer key, or a
fleet-page session, reads only. The page's own files and its sign-in are open."""

from __future__ import annotations

import hmac
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import anyio

from llmgw.admin_token import ASGIApp, RequireAdminToken, Verifier, _refuse, hash_token
from llmgw.control.store import Store, StoreError
from llmgw.control.ui.sessions import Principal, Sessions, cookie_value
from llmgw.control.viewers import hash_viewer_key, is_viewer_key

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

    async def principal(self, presented: str) -> Principal | None:
        """admin, a viewer key's name, or None; StoreError when a viewer key cannot be
        checked because the store is away."""
        presented = presented.strip()
        if not presented:
            return None
        if is_viewer_key(presented):
            digest = hash_viewer_key(presented)
            viewer = await anyio.to_thread.run_sync(self.store.viewer_by_hash, digest)
            return Principal("viewer", viewer["name"], digest) if viewer else None
        expected = self.verifier.current_hash()
        digest = hash_token(presented)
        if expected and hmac.compare_digest(digest, expected):
            return Principal("admin", "admin", digest)
        return None

    async def still(self, principal: Principal) -> str:
        """'' while a session's credential holds; else why it no longer does."""
        if principal.role == "admin":
            if principal.credential == self.verifier.current_hash():
                return ""
            return "the admin token has changed since this session signed in"
        found = await anyio.to_thread.run_sync(self.store.viewer_by_hash,
                                               principal.credential)
        return "" if found else f"the viewer key {principal.name!r} has been revoked"


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
        send = _with_headers(send)
        path = scope["path"]
        if path in ("/health", "/healthz", PAGE) or path.startswith(PAGE + "/"):
            await self.app(scope, receive, send)
            return
        try:
            principal, why = await self.who(scope)
        except StoreError as e:
            await _refuse(send, f"{scope['method']} {path}: {self.credentials.store.why(e)}; "
                          "a viewer key cannot be checked while the store is away; use the "
                          "admin token, or try again once the database answers", 503)
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
                found = await self.credentials.principal(presented)
                return found, "" if found else "the viewer key sent is not a live one here"
            why = self.verifier.problem(authorization)
            if why:
                return None, why
            return Principal("admin", "admin", self.verifier.current_hash()), ""
        token = cookie_value(headers)
        session = self.sessions.find(token) if token else None
        if session is None:
            return None, ("the fleet page's session has ended (signed out, expired, or the "
                          "control plane restarted)" if token else self.verifier.problem(""))
        gone = await self.credentials.still(session)
        if gone:
            self.sessions.forget(token)
            return None, f"{gone}; the session has ended"
        return session, ""


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
