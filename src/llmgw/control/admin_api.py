"""The admin API (loopback): nodes, the catalog, replicas, gateway and viewer keys, and the
fleet page (/ui/)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from llmgw import httpclient
from llmgw.contract import AdminPaths, keys, model_state
from llmgw.contract.catalog import CatalogModel, names
from llmgw.contract.explain import problems
from llmgw.contract.records import (
    ControlPlaneView,
    JoinToken,
    ModelSpec,
    NewKey,
    NewViewer,
    NodeRemoval,
    NodeView,
    PublicKey,
    PublicReplica,
    PublicViewer,
    ReplicaLog,
    ReplicaRecord,
)
from llmgw.control import viewers
from llmgw.control.agent_api import token_hash as join_token_hash
from llmgw.control.catalog import read_file_facts
from llmgw.control.drift import DriftBoard, add_drift_routes
from llmgw.control.leadership import control_plane_views
from llmgw.control.metrics import ControlPlaneMetrics
from llmgw.control.nodes import node_view
from llmgw.control.scheduler import held_back
from llmgw.control.ui import AdminAccess, Credentials, Sessions, TrafficWatch, add_fleet_page
from llmgw.store import Store, StoreError

log = logging.getLogger("llmgw.admin_api")


def public_replica(replica: ReplicaRecord, held: str = "") -> PublicReplica:
    """A replica as the admin API shows it: never its api_key; held is why it is not on a
    better profile (scheduler.held_back)."""
    public: PublicReplica = {
        "id": replica["id"], "model": replica["model"], "node": replica["node"],
        "profile": replica["profile"], "state": replica["state"],
        "err": replica.get("err", ""), "endpoint": replica.get("endpoint", ""),
        "updated": replica.get("updated", 0.0), "gpus": replica.get("gpus", []),
        "held_back": held}
    if replica.get("workers"):
        # Split over nodes: node is its main node, these its workers with their reports.
        public["workers"] = replica.get("workers", [])
    return public


def public_replicas(store: Store, node_timeout_s: float,
                    model: str | None = None) -> list[PublicReplica]:
    """The replicas (of model), each with why it is held back from a better profile."""
    now = store.clock()
    everyone = store.replicas()
    nodes = [node_view(n, now, node_timeout_s, store.hearing)
             for n in store.nodes() if any(r["node"] == n["id"] for r in everyone)]
    models = {m["name"]: m for m in store.models()}
    return [public_replica(r, held_back(r, models, nodes, everyone)) for r in everyone
            if model is None or r["model"] == model]


def replica_log(store: Store, rid: str, n: int) -> ReplicaLog:
    replica = next((r for r in store.replicas() if r["id"] == rid), None)
    if replica is None:
        raise HTTPException(404, f"no replica {rid!r}; GET /api/v1/replicas lists them")
    node = store.node(replica["node"]) if replica["node"] else None
    logs = (node["inventory"].get("replica_logs") or {}) if node else {}
    if rid not in logs:
        raise HTTPException(404, f"node {replica['node'] or '(none)'} has sent no log for "
                            f"{rid}: it has not started an engine for it yet, or the log was "
                            "removed with the replica")
    return {"replica": rid, "node": replica["node"], "lines": logs[rid][-n:] if n > 0 else []}


class TokenRequest(BaseModel):
    ttl_s: float = Field(3600.0, gt=0, le=7 * 24 * 3600)
    # A control-plane token's sealed bundle (llmgw.cli.control_plane_join.seal): kept with the
    # token's hash, handed to whoever spends it; this process cannot open it.
    bundle: str = Field("", max_length=1 << 20)


class KeyRequest(BaseModel):
    """A gateway key to make: models it may use (empty: all), its limits per minute (0: none)
    and when it expires (unix seconds; none: never)."""

    name: str = ""
    models: list[str] = Field(default_factory=list)
    rpm: int = Field(0, ge=0)
    tpm: int = Field(0, ge=0)
    expires: float | None = None


def create_key(store: Store, request: KeyRequest) -> NewKey:
    """Make and store a key (its hash only); the answer is the one place its secret shows."""
    names = {n for m in store.models() for n in [m["name"], *m["aliases"]]}
    unknown = [n for n in request.models if n not in names]
    if unknown:
        raise HTTPException(422, f"{', '.join(unknown)} names no model in the catalog "
                            f"(it has {', '.join(sorted(names)) or 'none'}); GET "
                            "/api/v1/models lists them")
    _check_expires(store, request.expires)
    for _ in range(3):  # a clash of two 32-bit ids: take another
        made = keys.new_key()
        name = _checked_name(request.name or f"key-{made.id}")
        record = {**request.model_dump(), "id": made.id, "name": name, "prefix": made.prefix,
                  "hash": made.hash}
        clash = store.add_key(record)
        if clash == "name":
            raise HTTPException(409, f"a key named {name!r} exists; `llmgw keys rm {name}` "
                                "first, or choose another name")
        if not clash:
            stored = next(k for k in store.keys() if k["id"] == made.id)
            return {**keys.public(stored), "key": made.text}
    raise HTTPException(500, "three new key ids in a row were taken; try again")


class ViewerRequest(BaseModel):
    """A viewer key to make: its name (default viewer-ID) and when it expires (unix
    seconds; none: never)."""

    name: str = ""
    expires: float | None = None


def create_viewer(store: Store, request: ViewerRequest) -> NewViewer:
    """Make and store a viewer key (its hash only); the answer is the one place it shows."""
    _check_expires(store, request.expires)
    for _ in range(3):  # a clash of two 32-bit ids: take another
        made = viewers.new_viewer_key()
        name = _checked_name(request.name or f"viewer-{made.id}")
        clash = store.add_viewer({"id": made.id, "name": name, "prefix": made.prefix,
                                  "hash": made.hash, "expires": request.expires})
        if clash == "name":
            raise HTTPException(409, f"a viewer key named {name!r} exists; `llmgw keys rm "
                                f"--viewer {name}` first, or choose another name")
        if not clash:
            stored = next(v for v in store.viewers() if v["id"] == made.id)
            return {**viewers.public(stored), "key": made.text}
    raise HTTPException(500, "three new viewer key ids in a row were taken; try again")


def _check_expires(store: Store, expires: float | None) -> None:
    """A 422 when a new key's expiry is already past."""
    if expires is not None and expires <= store.clock():
        raise HTTPException(422, "expires is in the past; give a later time (unix seconds)")


def _checked_name(name: str) -> str:
    """name, or a 422 saying why a key (gateway or viewer) cannot be named so."""
    try:
        keys.check_name(name)
    except ValueError as e:
        raise HTTPException(422, str(e)) from None
    return name


def make_admin_app(
    store: Store, *, node_timeout_s: float, token_hash: Path | None,
    metrics: ControlPlaneMetrics | None = None,
    on_node_removed: Callable[[list[str]], None] = lambda serials: None,
    drift: DriftBoard | None = None, sessions: Sessions | None = None,
) -> FastAPI:
    """The admin API; every path but /healthz and the fleet page's (/ui/) needs the admin
    token whose sha256 is in token_hash (with none, every such request is refused),
    /metrics too; a viewer key or a fleet-page session may GET (ui.access).

    on_node_removed gets a removed node's certificate serials (the agent API refuses
    them from then on). sessions: the fleet page's sign-ins (default: kept in the store,
    each process trusting what it read of one for ui.sessions.CACHE_S)."""
    app = FastAPI(title="llmgw admin API", version="1")
    credentials, sessions = Credentials(token_hash, store), sessions or Sessions(store)
    app.add_middleware(AdminAccess, credentials=credentials, sessions=sessions)

    @app.exception_handler(RequestValidationError)
    async def refused(request: Request, e: RequestValidationError) -> JSONResponse:
        """A body of the wrong shape, in the words every boundary uses (contract.explain)."""
        return JSONResponse(status_code=422, content={
            "detail": f"{request.method} {request.url.path} refused: "
                      f"{problems(e.errors(), within='body')}"})

    @app.exception_handler(StoreError)
    async def store_away(request: Request, e: StoreError) -> JSONResponse:
        """The store cannot be reached (PostgreSQL restarting, a split): 503, never a
        refusal of the caller's credential, and nothing half-done (one transaction)."""
        return JSONResponse(status_code=503, headers={"Retry-After": "5"}, content={
            "detail": f"{request.method} {request.url.path}: "
                      f"{store.why(e)}; nothing was changed; the control plane reconnects "
                      "by itself, so try again once the database answers"})
    metrics = metrics or ControlPlaneMetrics(store, node_timeout_s)
    # httpx's own default wait; each scrape names its own (ENGINE_SCRAPE_TIMEOUT_S).
    scraper = httpclient.async_client(timeout=5.0)
    add_drift_routes(app, drift or DriftBoard())
    add_fleet_page(app, credentials, sessions, TrafficWatch(metrics.gateway_url, scraper))

    @app.get("/metrics")
    async def prometheus() -> Response:
        """The control plane's metrics, then each ready replica's engine metrics."""
        return Response(await metrics.render(scraper), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/v1/replicas/{rid}/logs")
    def replica_logs(rid: str, n: int = 50) -> ReplicaLog:
        """The tail of a replica's engine log, as its node sent it with its last heartbeat."""
        return replica_log(store, rid, n)

    @app.get("/healthz", response_model=None)
    def health() -> dict[str, str] | JSONResponse:
        """200 while the control plane can read its store; 503 saying why when not."""
        away = store.reachable()
        if away:
            return JSONResponse(status_code=503, content={"status": "unavailable",
                                                          "detail": away})
        return {"status": "ok"}

    @app.get("/api/v1/nodes")
    def nodes(limit: int | None = Query(None, ge=1, le=10000),
              after: str = "") -> list[NodeView]:
        """Every node by id; with limit, a page of nodes after the id `after`."""
        now = store.clock()
        return [node_view(n, now, node_timeout_s, store.hearing) for n in store.nodes(limit, after)]

    @app.get("/api/v1/control-planes")
    def control_planes() -> list[ControlPlaneView]:
        """The control planes sharing the store, and which one schedules."""
        return control_plane_views(store)

    @app.delete("/api/v1/nodes/{node_id}")
    def remove_node(node_id: str) -> NodeRemoval:
        serials = store.remove_node(node_id, f"node {node_id} was removed")
        if serials is None:
            raise HTTPException(404, f"no node {node_id!r}; GET /api/v1/nodes lists them")
        on_node_removed(serials)
        return {"id": node_id, "revoked": serials}

    @app.post("/api/v1/tokens", status_code=201)
    def create_token(request: TokenRequest) -> JoinToken:
        """A single-use join token; only its hash is kept."""
        token = f"{secrets.token_hex(3)}.{secrets.token_hex(16)}"
        expires = store.add_token(join_token_hash(token), request.ttl_s, request.bundle)
        return {"token": token, "expires": expires}

    @app.post("/api/v1/keys", status_code=201)
    def add_key(request: KeyRequest) -> NewKey:
        """A gateway key; its secret is in this answer only (the store keeps its sha256)."""
        return create_key(store, request)

    @app.get("/api/v1/keys")
    def list_keys() -> list[PublicKey]:
        """Live keys with their limits and usage (flushed every few seconds); no secrets."""
        return [keys.public(k) for k in store.keys()]

    @app.delete("/api/v1/keys/{name}")
    def revoke_key(name: str) -> PublicKey:
        """Revoke a key by name, prefix or id; the gateway refuses it within a refresh."""
        revoked = store.revoke_key(name)
        if revoked is None:
            raise HTTPException(404, f"no live key named {name!r} (nor with that prefix); "
                                "GET /api/v1/keys lists them")
        return keys.public(revoked)

    @app.post(AdminPaths.VIEWERS, status_code=201)
    def add_viewer(request: ViewerRequest) -> NewViewer:
        """A viewer key: it reads (GET) and changes nothing; its secret is in this answer
        only (the store keeps its sha256)."""
        return create_viewer(store, request)

    @app.get(AdminPaths.VIEWERS)
    def list_viewers() -> list[PublicViewer]:
        """Unrevoked viewer keys, with when each expires; no secrets."""
        return [viewers.public(v) for v in store.viewers()]

    @app.delete(AdminPaths.viewer("{name}"))
    def revoke_viewer(name: str) -> PublicViewer:
        """Revoke a viewer key by name, prefix or id: refused from its next request, and
        its fleet-page sessions end with it."""
        revoked = store.revoke_viewer(name)
        if revoked is None:
            raise HTTPException(404, f"no live viewer key named {name!r} (nor with that "
                                "prefix); GET /api/v1/viewers lists them")
        sessions.forget_credential(revoked["hash"])
        return viewers.public(revoked)

    # Catalog specs leave as stored (a row written by an older release may lack a newer
    # key), so FastAPI does not check them against ModelSpec on the way out.
    @app.get("/api/v1/models", response_model=None)
    def models() -> list[dict[str, object]]:
        """The catalog, each model with its state (idle, loading, serving) from its
        replicas."""
        states: dict[str, list[str]] = {}
        for r in store.replicas():
            states.setdefault(r["model"], []).append(r["state"])
        return [{**m, "state": model_state(states.get(m["name"], []))}
                for m in store.models()]

    @app.post("/api/v1/models", status_code=201, response_model=None)
    def add_model(model: CatalogModel) -> ModelSpec:
        taken = {n for m in store.models() for n in names(m)}
        clash = [n for n in names(model) if n in taken]
        if clash:
            raise HTTPException(
                409,
                f"{', '.join(clash)} already names a model in the catalog; "
                f"DELETE /api/v1/models/{model['name']} first to replace it",
            )
        if not model["size_bytes"]:
            model["size_bytes"], geometry, why = read_file_facts(model["source"])
            model["geometry"] = {**model["geometry"], **geometry}
            if why:
                log.warning("model %s: %s; the scheduler places it without checking that "
                            "it fits a GPU's memory", model["name"], why)
        if not store.add_model(model):
            raise HTTPException(409, f"{model['name']} is already in the catalog")
        return model

    @app.get("/api/v1/models/{name}", response_model=None)
    def get_model(name: str) -> ModelSpec:
        spec = store.model(name)
        if spec is None:
            raise HTTPException(404, f"no model {name!r} in the catalog")
        return spec

    @app.delete("/api/v1/models/{name}", status_code=204)
    def delete_model(name: str) -> Response:
        if not store.delete_model(name):
            raise HTTPException(404, f"no model {name!r} in the catalog")
        return Response(status_code=204)

    @app.get("/api/v1/replicas")
    def replicas(model: str | None = None) -> list[PublicReplica]:
        """Replicas by model and id; never their api_key (PublicReplica has none, and
        FastAPI serializes by it)."""
        return public_replicas(store, node_timeout_s, model)

    return app
