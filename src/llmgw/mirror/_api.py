"""The management API (loopback): health, fetch, and the status of each model version."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field

from llmgw.mirror import _metrics
from llmgw.mirror._disk import NAME_PATTERN
from llmgw.mirror._downloads import Conflict, Manager
from llmgw.mirror._errors import SourceError


class FetchRequest(BaseModel):
    source: str = Field(description="hf:ORG/REPO/FILE, https://..., http://... or file:///...")
    model: str = Field(pattern=NAME_PATTERN)
    version: str = Field(pattern=NAME_PATTERN)
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")


def make_api(manager: Manager, *, about: dict[str, str] | None = None,
             metrics: CollectorRegistry | None = None) -> FastAPI:
    app = FastAPI(title="llmgw mirror management API", version="1")
    metrics = metrics or _metrics.registry(manager, _metrics.ServedCounter())

    @app.get("/metrics")
    def prometheus() -> Response:
        """Bytes served to nodes and downloads by state, as Prometheus text."""
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", **(about or {})}

    @app.post("/api/v1/fetch", status_code=202)
    def fetch(req: FetchRequest) -> dict[str, Any]:
        sha256 = req.sha256.lower() if req.sha256 else None
        try:
            return manager.fetch(req.source, req.model, req.version, sha256)
        except SourceError as e:
            raise HTTPException(422, str(e)) from e
        except Conflict as e:
            raise HTTPException(409, str(e)) from e

    @app.get("/api/v1/models")
    def models() -> list[dict[str, Any]]:
        return manager.views()

    @app.get("/api/v1/models/{model}/{version}")
    def status(model: str, version: str) -> dict[str, Any]:
        view = manager.view(model, version)
        if view is None:
            raise HTTPException(
                404, f"the mirror holds no {model}/{version}; POST /api/v1/fetch to get it"
            )
        return view

    return app
