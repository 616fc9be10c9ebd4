"""The fleet page at /ui/: a read-only view of nodes, GPUs, engines, replicas, drift,
traffic and keys, served by the admin API with its sign-in (admin token or viewer key)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from llmgw.contract import AdminPaths
from llmgw.control.ui.access import PAGE, AdminAccess, Credentials
from llmgw.control.ui.sessions import Principal, Sessions, clear_cookie, cookie_value, set_cookie
from llmgw.control.ui.traffic import Traffic, TrafficWatch

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
        """Sign in with the admin token or a viewer key: a session cookie that reads."""
        _same_origin(request)
        principal = await credentials.principal(body.credential)
        if principal is None:
            raise HTTPException(401, "that is neither this host's admin token nor a live "
                                "viewer key; `llmgw keys create --viewer` makes a viewer key")
        session = Principal(principal.role, principal.name, principal.credential, True)
        answer = JSONResponse(_who(session))
        answer.headers["set-cookie"] = set_cookie(sessions.open(session),
                                                  secure=request.url.scheme == "https")
        return answer

    @app.get(SESSION)
    async def signed_in(request: Request) -> dict[str, str]:
        """Who this browser's session speaks for; 401 without one."""
        token = cookie_value(request.scope.get("headers") or [])
        principal = sessions.find(token) if token else None
        if principal is None or await credentials.still(principal):
            raise HTTPException(401, "not signed in: sign in with the admin token or a "
                                "viewer key")
        return _who(principal)

    @app.delete(SESSION, status_code=204)
    def sign_out(request: Request) -> Response:
        """End this browser's session: the control plane forgets it."""
        _same_origin(request)
        token = cookie_value(request.scope.get("headers") or [])
        if token:
            sessions.forget(token)
        answer = Response(status_code=204)
        answer.headers["set-cookie"] = clear_cookie(secure=request.url.scheme == "https")
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
