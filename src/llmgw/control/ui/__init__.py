"""The fleet page at /ui/: a read-only view of nodes, GPUs, engines, replicas, drift,
traffic and keys, served by the admin API with its sign-in (admin token or viewer key)."""

from __future__ import annotations

from pathlib import Path

import anyio
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from llmgw.contract import AdminPaths
from llmgw.control.ui.access import PAGE, AdminAccess, Credentials, signed_in
from llmgw.control.ui.sessions import (
    LIFETIME_S,
    Principal,
    Sessions,
    clear_cookie,
    cookie_value,
    set_cookie,
)
from llmgw.control.ui.traffic import Traffic, TrafficWatch
from llmgw.store import StoreError

__all__ = ["PAGE", "AdminAccess", "Credentials", "Sessions", "TrafficWatch", "add_fleet_page"]

STATIC = Path(__file__).with_name("static")
SESSION = f"{PAGE}/session"


class SignIn(BaseModel):
    credential: str = Field(min_length=1, max_length=512)


def _who(principal: Principal) -> dict[str, str]:
    return {"role": principal.role, "name": principal.name}


def _same_origin(request: Request) -> None:
    """Refuse a sign-in or sign-out another site's page sends (its Origin is not ours)."""
    origin = request.headers.get("origin")
    ours = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin != ours:
        raise HTTPException(403, f"a sign-in or sign-out from {origin[:100]} refused: only "
                            f"the fleet page itself ({ours}/ui/) may send one")


def add_fleet_page(app: FastAPI, credentials: Credentials, sessions: Sessions,
                   traffic: TrafficWatch) -> None:
    """The page's files under /ui/, its sign-in and sign-out (/ui/session), and the
    gateway's traffic per model (/api/v1/traffic), on the admin API's app."""

    @app.post(SESSION)
    async def sign_in(body: SignIn, request: Request) -> JSONResponse:
        """Sign in with the admin token or a viewer key: a session cookie that reads, kept
        (by its hash) in the store, so every control plane of the fleet honours it."""
        _same_origin(request)
        principal, expires, why = await credentials.identify(body.credential)
        if principal is None:
            raise HTTPException(401, why)
        session = Principal(principal.role, principal.name, principal.credential, True)
        token = await anyio.to_thread.run_sync(sessions.open, session, expires)
        answer = JSONResponse(_who(session))
        answer.headers["set-cookie"] = set_cookie(token, secure=request.url.scheme == "https")
        return answer

    @app.get(SESSION)
    async def who_signed_in(request: Request) -> dict[str, str]:
        """Who this browser's session speaks for; 401 saying why without one (a session
        refused here is forgotten, as on every other path)."""
        token = cookie_value(request.scope.get("headers") or [])
        if not token:
            raise HTTPException(401, "not signed in: sign in with the admin token or a "
                                "viewer key")
        principal, why = await signed_in(credentials, sessions, token)
        if principal is None:
            raise HTTPException(401, f"not signed in: {why}")
        return _who(principal)

    @app.delete(SESSION, status_code=204)
    async def sign_out(request: Request) -> Response:
        """End this browser's session on every control plane of the fleet."""
        _same_origin(request)
        token = cookie_value(request.scope.get("headers") or [])
        secure = request.url.scheme == "https"
        try:
            if token:
                await anyio.to_thread.run_sync(sessions.forget, token)
        except StoreError as e:
            return JSONResponse(status_code=503, headers={
                "set-cookie": clear_cookie(secure=secure), "retry-after": "5"}, content={
                "detail": f"signing out: {sessions.store.why(e)}, so the session could not "
                          "be ended on the control planes; this browser forgot it, and it "
                          f"ends by itself {LIFETIME_S / 3600:.0f} hours after signing in, "
                          "or at once when its viewer key is revoked or the admin token "
                          "changes"})
        answer = Response(status_code=204)
        answer.headers["set-cookie"] = clear_cookie(secure=secure)
        return answer

    @app.get(AdminPaths.TRAFFIC)
    async def gateway_traffic() -> Traffic:
        """Per model: requests/s, p50/p99 and tokens/s over the last minute (from the
        gateway's metrics read at each call), 4xx/5xx and requests since it started."""
        return await traffic.read()

    @app.get(PAGE, include_in_schema=False)
    def page() -> RedirectResponse:
        return RedirectResponse(f"{PAGE}/")

    app.mount(PAGE, StaticFiles(directory=STATIC, html=True), name="fleet-page")
