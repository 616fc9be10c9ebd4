"""The OpenAI-compatible gateway: models by name or alias, spread over ready replicas.

A plain ASGI app, not FastAPI, for everything but forwarding: the hot path (read the body,
pick a replica, relay the answer's bytes) is most of what the gateway costs, and a router
plus a JSON round trip per request cost as much as the engine's own answer to a short
prompt (profiled). The forwarded POSTs are the server's fast handler's
(`_forward.Forwarder`): each is one `_forward.Exchange`, driven from the server's callbacks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass

from llmgw.config import ServerConfig
from llmgw.contract import keys, secret
from llmgw.contract.records import ModelSpec, ReplicaRecord
from llmgw.errors import Error
from llmgw.gateway import _limits
from llmgw.gateway._budgets import CLAIM_WAIT_S, Budgets
from llmgw.gateway._demand import LoadFailed, Loads
from llmgw.gateway._relay import respond
from llmgw.gateway._router import Router
from llmgw.gateway._shares import KeyShares
from llmgw.gateway._slots import SlotPoller
from llmgw.gateway._upstream import Timeouts, Upstream
from llmgw.gateway.balancer import (
    RETRY_AFTER_S,
    Balancer,
    Conversation,
    Lease,
    Saturated,
)
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.http1.asgi import Receive, Scope, Send
from llmgw.store import Store, StoreError

log = logging.getLogger("llmgw.gateway")


FORWARDED = {"/v1/chat/completions": "chat", "/v1/completions": "chat",
             "/v1/embeddings": "embedding"}
KNOWN_GET = ("/healthz", "/v1/models")
JSON_HEADERS = [(b"content-type", b"application/json")]
# Usage per key reaches the store in batches, never per request: the store may be another
# process's too, and busy.
USAGE_FLUSH_S = 2.0


class GatewayError(Error):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, type_: str, code: str,
                 param: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status, message, type_, code, param)
        self.headers = headers or []

    def body(self) -> bytes:
        return json.dumps({"error": {"message": self.message, "type": self.type,
                                     "param": self.param, "code": self.code}}).encode()


@dataclass
class Caller:
    """Who sent a request: a gateway key (id set), a server.yaml token or nobody."""

    name: str
    id: str = ""
    models: tuple[str, ...] = ()
    rpm: int = 0
    tpm: int = 0

    def may_use(self, model: ModelSpec, names: dict[str, ModelSpec]) -> bool:
        """A key's models are catalog names or aliases; naming one allows all its names."""
        return not self.models or any(
            n in names and names[n]["name"] == model["name"] for n in self.models)


NOBODY = Caller(keys.ANONYMOUS)
STATIC = Caller(keys.STATIC)


class Gateway:
    """The ASGI app: GET /v1/models[/{id}] and /healthz; the POSTs to /v1/chat/completions,
    /v1/completions and /v1/embeddings are its Forwarder's (served as `fast=`); every error
    in OpenAI's shape.

    keys_required: every request needs a gateway key (or a server.yaml token); without it a
    request with none goes as anonymous unless tokens are listed. A key-shaped credential is
    always checked."""

    def __init__(self, store: Store, *, tokens: list[str], upstream: Upstream,
                 metrics: GatewayMetrics | None, max_body_bytes: int, keys_required: bool,
                 usage_flush_s: float, balancer: Balancer,
                 claim_wait_s: float = CLAIM_WAIT_S, load_wait_s: float = 120.0,
                 load_queue_size: int = 256) -> None:
        self.router = Router(store)
        self.tokens = [t.encode() for t in tokens]
        self.required = keys_required or bool(tokens)
        self.upstream = upstream
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.usage = _limits.Usage()
        self.usage_flush_s = usage_flush_s
        self._callers: dict[str, Caller] = {}
        self.balancer = balancer
        self.slots = SlotPoller(self.balancer, self.router.all_ready, upstream)
        # Keys' rpm and tpm, shared with every gateway of the store (gateway/_budgets.py).
        self.budgets = Budgets(store, claim_wait_s=claim_wait_s)
        # Models on demand: requests wait here for a replica to load (gateway/_demand.py).
        self.loads = Loads(store, self.budgets.id, wait_s=load_wait_s,
                           queue_size=load_queue_size, metrics=metrics,
                           ready=lambda model: self.router.ready(model, fresh=True))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            if self.balancer.routing == "balanced":
                self.slots.ensure_running()
            flusher = asyncio.ensure_future(self._flush_every())
            self.budgets.ensure_running()
            self.loads.ensure_running()
            try:
                await _lifespan(receive, send)
            finally:
                flusher.cancel()
                await self.flush_usage()
                await self.loads.close()
                await self.budgets.close()
                await self.slots.stop()
            return
        if scope["type"] != "http":
            return
        try:
            await self._dispatch(scope, receive, send)
        except GatewayError as e:
            await respond(send, e.status, e.body(), [*JSON_HEADERS, *e.headers])

    async def _flush_every(self) -> None:
        while True:
            await asyncio.sleep(self.usage_flush_s)
            await self.flush_usage()

    async def flush_usage(self) -> None:
        """Write the usage gathered since the last write; kept for the next one when the
        store is busy or cannot be written."""
        taken = self.usage.take()
        if not taken:
            return
        try:
            await asyncio.to_thread(self.router.store.add_key_usage, taken)
        except StoreError as e:
            self.usage.put_back(taken)
            log.warning("could not write the usage of %d gateway keys to the store (%s); "
                        "kept, trying again in %.0f s", len(taken), e, self.usage_flush_s)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        kind = FORWARDED.get(path)
        if kind is not None:
            if method != "POST":
                raise _not_allowed(method, path, "POST")
            # Forwarding has one driver, the server's fast handler (`_forward`): a POST
            # here was served without it.
            raise GatewayError(500, f"this gateway forwards {path} from its server's fast "
                               "handler, and it was served without one: serve it with "
                               "Http1Server(app, fast=Forwarder(app)) (gateway/_forward.py)",
                               "server_error", "gateway_error")
        if path in KNOWN_GET or path.startswith("/v1/models/"):
            if method not in ("GET", "HEAD"):
                raise _not_allowed(method, path, "GET")
            if path == "/healthz":
                await respond(send, 200, b'{"status":"ok"}', JSON_HEADERS)
                return
            caller = self.authorize(scope)
            await respond(send, 200, json.dumps(self._models(path, caller)).encode(), JSON_HEADERS)
            return
        raise GatewayError(404, f"{method} {path} is not a route of this gateway; it serves "
                           "/v1/models, /v1/chat/completions, /v1/completions and "
                           "/v1/embeddings", "invalid_request_error", "unknown_url")

    def authorize(self, scope: Scope) -> Caller:
        """Who sent the request, or a 401. The scheme is matched without regard to case;
        a gateway key by its sha256, then compared in constant time; a server.yaml token
        byte for byte, in constant time."""
        given = keys.bearer(scope["headers"])
        if given and keys.is_key_shaped(given):
            return self._key_caller(given)
        if given and any(secrets.compare_digest(given, t) for t in self.tokens):
            return STATIC
        if not self.required:
            return NOBODY
        why = "no API key was sent" if given is None else "the API key sent is not one of " \
            "this gateway's"
        raise _unauthorized(f"{why}; send 'Authorization: Bearer KEY' with a key the owner "
                            "made (`llmgw keys create`)")

    def _key_caller(self, given: bytes) -> Caller:
        digest = secret.digest(given)
        key = self.router.key(digest)
        shown = given[:len(keys.PREFIX) + 8].decode()
        if key is None or not secret.same_hash(key["hash"], digest):
            raise _unauthorized(f"the API key {shown}-... is not a key of this gateway: it "
                                "was revoked or never made here; ask the owner for one "
                                "(`llmgw keys create`)")
        if key["expires"] is not None and key["expires"] <= time.time():
            raise _unauthorized(f"the API key {shown}-... expired at "
                                f"{_utc(key['expires'])}; ask the owner for a new one")
        caller = self._callers.get(key["id"])
        if caller is None:
            caller = self._callers[key["id"]] = Caller(key["name"], key["id"],
                                                       tuple(key["models"]), key["rpm"],
                                                       key["tpm"])
        return caller

    def _models(self, path: str, caller: Caller) -> dict[str, object]:
        names, created = self.router.names(), self.router.created
        listed = [{"id": name, "object": "model", "created": created.get(m["name"], 0),
                   "owned_by": "llmgw", "root": m["name"]} for name, m in names.items()
                  if caller.may_use(m, names)]
        if path == "/v1/models":
            return {"object": "list", "data": listed}
        wanted = path.removeprefix("/v1/models/")
        found = next((m for m in listed if m["id"] == wanted), None)
        if found is None:
            raise GatewayError(404, f"The model '{wanted}' does not exist; GET /v1/models "
                               "lists what this gateway serves", "invalid_request_error",
                               "model_not_found", "model")
        return found

    def count_usage(self, caller: Caller, status: int, usage: tuple[int, int] | None) -> None:
        """A key's usage: its request (a 429 is none) and tokens, and its share of tokens."""
        if not caller.id or status == 429:
            return
        prompt, completion = usage or (0, 0)
        self.usage.add(caller.id, time.time(), prompt, completion)
        if caller.tpm:
            self.budgets.spend(self._shares(caller), prompt + completion)

    def _shares(self, caller: Caller) -> KeyShares:
        return self.budgets.shares(caller.id, caller.rpm, caller.tpm)

    def admit(self, caller: Caller, started: float) -> asyncio.Future[None] | None:
        """None when the caller may go now (its request counted against its key's rpm); a
        429 in OpenAI's shape (type requests or tokens, code rate_limit_exceeded) with
        Retry-After when its key spent its minute, fleet-wide; or a future to wait on while
        this gateway asks the store for a share of the key's minute (then ask again, until
        claim_wait_s after the request started: perf_counter's started)."""
        if not (caller.rpm or caller.tpm):
            return None
        deadline = time.monotonic() - (time.perf_counter() - started) \
            + self.budgets.claim_wait_s
        over = self.budgets.admit(self._shares(caller), deadline)
        if over is None or isinstance(over, asyncio.Future):
            return over
        what, wait_s = over
        limit = caller.rpm if what == "requests" else caller.tpm
        after = _limits.retry_after(wait_s)
        raise GatewayError(429, f"rate limit reached for key {caller.name!r} on {what} per "
                           f"minute: limit {limit}; try again in {after} s", what,
                           "rate_limit_exceeded",
                           headers=[(b"retry-after", after.encode()),
                                    (f"x-ratelimit-limit-{what}".encode(), str(limit).encode()),
                                    (f"x-ratelimit-remaining-{what}".encode(), b"0"),
                                    (f"x-ratelimit-reset-{what}".encode(), f"{after}s".encode())])

    async def lease(self, model: str, conv: Conversation | None,
                    tried: set[str]) -> Lease | None:
        """A replica of model not in tried, waiting in the balancer's queue when all are at
        their slots (a 503 when it stays so); None when there is no such replica."""
        replicas = self.router.ready(model)
        if all(r["id"] in tried for r in replicas):
            # About to answer 503: first make sure no replica became ready since the last
            # read (a replica that just became ready was refused for up to ttl_s).
            replicas = self.router.ready(model, fresh=True)
        if not replicas and not tried:
            replicas = await self._loaded(model)
        try:
            return await self.balancer.acquire(model, replicas, conv, tried)
        except Saturated as e:
            raise GatewayError(503, f"{e}; try again in {RETRY_AFTER_S} s", "server_busy",
                               "replicas_busy",
                               headers=[(b"retry-after", str(RETRY_AFTER_S).encode())]) from e

    async def _loaded(self, model: str) -> list[ReplicaRecord]:
        """The model's ready replicas once its load queue's wait ends (a 503 saying why
        when it fails); [] for a model no longer in the catalog."""
        spec = self.router.resolve(model)
        if spec is None:
            return []
        self.loads.ensure_running()
        try:
            await self.loads.wait(spec)
        except LoadFailed as e:
            raise GatewayError(503, str(e), "service_unavailable", e.code,
                               headers=[(b"retry-after", str(RETRY_AFTER_S).encode())]) from e
        return self.router.ready(model, fresh=True)

    def no_replica(self, model: str, refused: str) -> GatewayError:
        """The 503 for a request no replica could take (refused: why the last one tried
        could not, or "")."""
        return GatewayError(503, f"no replica of {model} could take the request: "
                            f"{self.router.states(model)}{refused}; try again shortly",
                            "service_unavailable", "no_ready_replica")


def make_gateway_app(store: Store, settings: ServerConfig | None = None, *,
                     upstream: Upstream | None = None, metrics: GatewayMetrics | None = None,
                     usage_flush_s: float = USAGE_FLUSH_S,
                     claim_wait_s: float = CLAIM_WAIT_S) -> Gateway:
    """The gateway for server.yaml's settings (its defaults when none are given): tokens,
    gateway_keys, gateway_max_body_bytes, gateway_routing and the queue; upstream, the
    replica client (its timeouts from the same settings unless given); claim_wait_s, the
    most a request waits for the store to grant its key a share."""
    settings = settings or ServerConfig()
    upstream = upstream or Upstream(Timeouts(settings.upstream_connect_timeout_s,
                                             settings.upstream_read_timeout_s))
    return Gateway(store, tokens=settings.tokens, upstream=upstream, metrics=metrics,
                   max_body_bytes=settings.gateway_max_body_bytes,
                   keys_required=settings.gateway_keys == "required",
                   usage_flush_s=usage_flush_s, claim_wait_s=claim_wait_s,
                   load_wait_s=settings.load_wait_s,
                   load_queue_size=settings.load_queue_size,
                   balancer=Balancer(settings.gateway_routing,
                                     queue_size=settings.gateway_queue_size,
                                     queue_wait_s=settings.gateway_queue_wait_s))


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, "invalid_request_error", "invalid_api_key",
                        headers=[(b"www-authenticate", b'Bearer realm="llmgw gateway"')])


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _not_allowed(method: str, path: str, allowed: str) -> GatewayError:
    return GatewayError(405, f"{path} takes {allowed}, not {method}", "invalid_request_error",
                        "method_not_allowed")


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
