"""The management API (loopback): health, fetch, and the status of each model version."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from llmgw.contract.records import MirrorVersion
from llmgw.host.admin_token import RequireAdminToken
from llmgw.mirror import _metrics
from llmgw.mirror._disk import FAILED, NAME_PATTERN
from llmgw.mirror._downloads import Conflict, Manager, WrongOffset
from llmgw.mirror._errors import Forbidden, SourceError

_Name = Annotated[str, PathParam(pattern=NAME_PATTERN)]


class FetchRequest(BaseModel):
    source: str = Field(description="hf:ORG/REPO/FILE, https://..., http://... or file:///...")
    model: str = Field(pattern=NAME_PATTERN)
    version: str = Field(pattern=NAME_PATTERN)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")


def make_api(
    manager: Manager, *, token_hash: Path | None, about: dict[str, str] | None = None,
    metrics: CollectorRegistry | None = None,
) -> FastAPI:
    """The management API; every path but /health needs the admin token whose sha256 is in
    token_hash (with none, every such request is refused)."""
    app = FastAPI(title="llmgw mirror management API", version="1")
    app.add_middleware(RequireAdminToken, hash_path=token_hash)
    metrics = metrics or _metrics.registry(manager, _metrics.ServedCounter())

    @app.get("/metrics")
    def prometheus() -> Response:
        """Bytes served to nodes and downloads by state, as Prometheus text."""
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", **(about or {})}

    @app.post("/api/v1/fetch", status_code=202)
    def fetch(req: FetchRequest) -> MirrorVersion:
        sha256 = req.sha256.lower() if req.sha256 else None
        try:
            return manager.fetch(req.source, req.model, req.version, sha256)
        except SourceError as e:
            raise HTTPException(422, str(e)) from e
        except Forbidden as e:
            raise HTTPException(403, str(e)) from e
        except Conflict as e:
            raise HTTPException(409, str(e)) from e

    @app.put("/api/v1/import/{model}/{version}/{file}")
    async def upload(
        model: _Name, version: _Name, file: _Name, request: Request,
        size: Annotated[int, Query(ge=0)],
        sha256: Annotated[str, Query(pattern=r"^[0-9a-fA-F]{64}$")],
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> MirrorVersion:
        """The body is the file from byte offset on; an interrupted upload keeps what came,
        and GET /api/v1/models/{model}/{version} says where to continue (status.bytes)."""
        try:
            dl = manager.begin_import(model, version, file, size, sha256.lower(), offset)
        except WrongOffset as e:
            raise HTTPException(409, str(e), headers={"X-Llmgw-Have": str(e.have)}) from e
        except Conflict as e:
            raise HTTPException(409, str(e)) from e
        if dl is not None:
            try:
                with manager.import_file(dl) as out:
                    async for chunk in request.stream():
                        manager.receive(dl, out, chunk)
            except Conflict as e:
                raise HTTPException(413, str(e)) from e
            except ClientDisconnect:
                raise HTTPException(400, "the upload stopped before its end; resume it") from None
            finally:
                rec = await asyncio.to_thread(manager.end_import, dl)
            if rec.state == FAILED:
                raise HTTPException(422, rec.err)
        view = manager.view(model, version)
        assert view is not None
        return view

    @app.get("/api/v1/models")
    def models() -> list[MirrorVersion]:
        return manager.views()

    @app.get("/api/v1/models/{model}/{version}")
    def status(model: str, version: str) -> MirrorVersion:
        view = manager.view(model, version)
        if view is None:
            raise HTTPException(
                404, f"the mirror holds no {model}/{version}; POST /api/v1/fetch to get it"
            )
        return view

    return app
