"""The OpenAI-compatible gateway: models by name or alias, spread over ready replicas."""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmgw.control.store import Store

log = logging.getLogger("llmgw.gateway")

_FORWARDED = ("/v1/chat/completions", "/v1/completions")
_UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=10.0)


def openai_error(status: int, message: str, type_: str, code: str, param: str | None = None,
                 **extra: Any) -> JSONResponse:
    """An error in the shape OpenAI clients parse."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}
    return JSONResponse(body, status_code=status)


class Router:
    """Resolves a requested model to the catalog and picks a ready replica, round robin.

    It reads the catalog and the replicas at most every ttl_s, not on every request: the
    hot path stays off SQLite, and a replica that died in between costs one failed try.
    """

    def __init__(self, store: Store, ttl_s: float = 0.5) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._turns = itertools.count()
        self._read_at = -float("inf")
        self._names: dict[str, dict[str, Any]] = {}
        self._ready: dict[str, list[dict[str, Any]]] = {}

    def _refresh(self) -> None:
        if time.monotonic() - self._read_at < self.ttl_s:
            return
        names, ready = {}, {}
        for model in self.store.models():
            for name in [model["name"], *model.get("aliases", [])]:
                names[name] = model
        for r in self.store.replicas():
            if r["state"] == "ready" and r["endpoint"]:
                ready.setdefault(r["model"], []).append(r)
        self._names, self._ready, self._read_at = names, ready, time.monotonic()

    def resolve(self, requested: str) -> dict[str, Any] | None:
        self._refresh()
        return self._names.get(requested)

    def ready(self, model: str) -> list[dict[str, Any]]:
        self._refresh()
        return self._ready.get(model, [])

    def order(self, model: str) -> list[dict[str, Any]]:
        """Ready replicas, starting from the next one's turn."""
        ready = self.ready(model)
        if not ready:
            return []
        start = next(self._turns) % len(ready)
        return ready[start:] + ready[:start]

    def states(self, model: str) -> str:
        reps = [r for r in self.store.replicas(model) if r["state"] != "stopped"]
        if not reps:
            return "no replica is scheduled"
        return "; ".join(
            f"{r['id']} on {r['node'] or '(no node)'}: {r['state']}"
            + (f" ({r['err']})" if r["err"] else "")
            for r in reps
        )


def upstream_client(transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The client the gateway reaches replicas with; its owner closes it."""
    return httpx.AsyncClient(timeout=_UPSTREAM_TIMEOUT, transport=transport)


def make_gateway_app(store: Store, *, tokens: list[str], upstream: httpx.AsyncClient) -> FastAPI:
    app = FastAPI(title="llmgw gateway", version="1")
    router = Router(store)

    def unauthorized(request: Request) -> Response | None:
        """A 401 when server.yaml lists tokens and the request carries none of them."""
        if not tokens:
            return None
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if any(secrets.compare_digest(given, t) for t in tokens):
            return None
        return openai_error(401, "a valid API key is required: send "
                            "'Authorization: Bearer TOKEN' with a token from server.yaml",
                            "invalid_request_error", "invalid_api_key")

    @app.get("/healthz")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models(request: Request) -> Any:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        data = []
        for m in store.models():
            for name in [m["name"], *m.get("aliases", [])]:
                data.append({"id": name, "object": "model", "created": 0,
                             "owned_by": "llmgw", "root": m["name"]})
        return {"object": "list", "data": data}

    async def forward(request: Request) -> Response:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        raw = await request.body()
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return openai_error(400, f"the request body is not valid JSON: {e}",
                                "invalid_request_error", "invalid_json")
        requested = str(body.get("model") or "")
        model = router.resolve(requested)
        if model is None:
            return openai_error(404, f"The model '{requested}' does not exist; GET /v1/models "
                                "lists what this gateway serves", "invalid_request_error",
                                "model_not_found", "model")
        for replica in router.order(model["name"]):
            try:
                return await _relay(upstream, replica, request.url.path, raw, body, requested)
            except httpx.TransportError as e:
                log.warning("replica %s at %s failed: %s", replica["id"], replica["endpoint"], e)
        return openai_error(503, f"no replica of {model['name']} is ready: "
                            f"{router.states(model['name'])}; try again shortly",
                            "service_unavailable", "no_ready_replica")

    for path in _FORWARDED:
        app.add_api_route(path, forward, methods=["POST"])
    return app


def _renamed_event(line: str, requested: str) -> str:
    """An SSE line with the model the client asked for, not the engine's file path."""
    if not line.startswith("data: {"):
        return line
    try:
        event = json.loads(line[len("data: "):])
    except ValueError:
        return line
    if isinstance(event, dict) and "model" in event:
        event["model"] = requested
    return "data: " + json.dumps(event)


async def _relay(upstream: httpx.AsyncClient, replica: dict[str, Any], path: str, raw: bytes,
                 body: dict[str, Any], requested: str) -> Response:
    """Send the request's own bytes to a replica with the replica's key; stream the answer
    back when asked to."""
    headers = {"Authorization": f"Bearer {replica['api_key']}",
               "Content-Type": "application/json"}
    url = replica["endpoint"].rstrip("/") + path
    request = upstream.build_request("POST", url, content=raw, headers=headers)
    response = await upstream.send(request, stream=True)
    kept = {k: v for k, v in response.headers.items()
            if k.lower() in ("content-type", "cache-control")}
    if body.get("stream"):
        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for line in response.aiter_lines():
                    yield (_renamed_event(line, requested) + "\n").encode()
            finally:
                await response.aclose()

        return StreamingResponse(chunks(), status_code=response.status_code, headers=kept)
    data = await response.aread()
    await response.aclose()
    if response.status_code == 200 and "json" in kept.get("content-type", ""):
        answer = json.loads(data)
        answer["model"] = requested
        data = json.dumps(answer).encode()
    return Response(data, status_code=response.status_code, headers=kept)
