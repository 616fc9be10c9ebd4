"""The OpenAI-compatible gateway: models by name or alias, spread over ready replicas.

A plain ASGI app, not FastAPI: the hot path (read the body, pick a replica, relay the
answer's bytes) is most of what the gateway costs, and a router plus a JSON round trip
per request cost as much as the engine's own answer to a short prompt (issue 11).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sqlite3
import time
from dataclasses import dataclass

from llmgw._asgi import Receive, Scope, Send
from llmgw.contract.records import ModelSpec
from llmgw.control import _wire, keys
from llmgw.control._relay import relay_events, relay_whole, respond
from llmgw.control._router import Router
from llmgw.control._slots import SlotPoller
from llmgw.control._upstream import ConnectFailed, Response, Upstream, UpstreamError
from llmgw.control.balancer import (
    RETRY_AFTER_S,
    Balancer,
    Conversation,
    Lease,
    Routing,
    Saturated,
    conversation,
)
from llmgw.control.metrics import GatewayMetrics
from llmgw.control.store import Store

log = logging.getLogger("llmgw.gateway")


FORWARDED = {"/v1/chat/completions": "chat", "/v1/completions": "chat",
             "/v1/embeddings": "embedding"}
KNOWN_GET = ("/healthz", "/v1/models")
DEFAULT_MAX_BODY_BYTES = 16 << 20
JSON_HEADERS = [(b"content-type", b"application/json")]
# Usage per key reaches the store in batches, never per request: the store may be another
# process's too, and busy.
USAGE_FLUSH_S = 2.0


class GatewayError(Exception):
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
    limits: keys.Limits | None = None

    def may_use(self, model: ModelSpec, names: dict[str, ModelSpec]) -> bool:
        """A key's models are catalog names or aliases; naming one allows all its names."""
        return not self.models or any(
            names.get(n, {}).get("name") == model["name"] for n in self.models)


NOBODY = Caller(keys.ANONYMOUS)
STATIC = Caller(keys.STATIC)


class Gateway:
    """The ASGI app: GET /v1/models[/{id}], POST /v1/chat/completions, /v1/completions and
    /v1/embeddings; every error in OpenAI's shape.

    keys_required: every request needs a gateway key (or a server.yaml token); without it a
    request with none goes as anonymous unless tokens are listed. A key-shaped credential is
    always checked."""

    def __init__(self, store: Store, *, tokens: list[str], upstream: Upstream,
                 metrics: GatewayMetrics | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 keys_required: bool = False, usage_flush_s: float = USAGE_FLUSH_S,
                 balancer: Balancer | None = None) -> None:
        self.router = Router(store)
        self.tokens = [t.encode() for t in tokens]
        self.required = keys_required or bool(tokens)
        self.upstream = upstream
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.usage = keys.Usage()
        self.usage_flush_s = usage_flush_s
        self._callers: dict[str, Caller] = {}
        self.balancer = balancer or Balancer()
        self.slots = SlotPoller(self.balancer, self.router.all_ready)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            if self.balancer.routing == "balanced":
                self.slots.ensure_running()
            flusher = asyncio.ensure_future(self._flush_every())
            try:
                await _lifespan(receive, send)
            finally:
                flusher.cancel()
                await self.flush_usage()
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
        except sqlite3.Error as e:
            self.usage.put_back(taken)
            log.warning("could not write the usage of %d gateway keys to the store (%s); "
                        "kept, trying again in %.0f s", len(taken), e, self.usage_flush_s)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        kind = FORWARDED.get(path)
        if kind is not None:
            if method != "POST":
                raise _not_allowed(method, path, "POST")
            await self._forward(scope, receive, send, kind)
            return
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
        digest = keys.hash_key(given)
        key = self.router.key(digest)
        shown = given[:len(keys.PREFIX) + 8].decode()
        if key is None or not secrets.compare_digest(key["hash"], digest):
            raise _unauthorized(f"the API key {shown}-... is not a key of this gateway: it "
                                "was revoked or never made here; ask the owner for one "
                                "(`llmgw keys create`)")
        if key["expires"] is not None and key["expires"] <= time.time():
            raise _unauthorized(f"the API key {shown}-... expired at "
                                f"{_utc(key['expires'])}; ask the owner for a new one")
        caller = self._callers.get(key["id"])
        if caller is None:
            limits = keys.Limits(key["rpm"], key["tpm"]) if key["rpm"] or key["tpm"] else None
            caller = self._callers[key["id"]] = Caller(key["name"], key["id"],
                                                       tuple(key["models"]), limits)
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

    async def _forward(self, scope: Scope, receive: Receive, send: Send,
                       kind: str) -> None:
        """Counted under the catalog name, or model="" when the request named none."""
        started, name, status, usage, caller = time.perf_counter(), "", 500, None, NOBODY
        if self.metrics:
            self.metrics.in_flight += 1
        try:
            caller = self.authorize(scope)
            raw = await self._body(scope, receive)
            requested, stream = _parse(raw)
            model = self.router.resolve(requested)
            if model is None or not caller.may_use(model, self.router.names()):
                raise GatewayError(404, f"The model '{requested}' does not exist; GET "
                                   "/v1/models lists what this gateway serves",
                                   "invalid_request_error", "model_not_found", "model")
            name = model["name"]
            _check_kind(model, kind, scope["path"])
            _admit(caller)
            response = await self._send_to_replica(name, scope["path"], raw, scope["headers"])
            status = response.status
            member = _wire.model_value(requested)
            if stream and status == 200:
                usage = await relay_events(response, send, member, receive)
            else:
                try:
                    usage = await relay_whole(response, send, member)
                except UpstreamError as e:
                    status = 502
                    raise replica_failed(response.source, name, e) from e
        except GatewayError as e:
            status = e.status
            raise
        finally:
            self.count_usage(caller, status, usage)
            if self.metrics:
                self.metrics.in_flight -= 1
                self.metrics.observe(name, status, started, usage, caller.name)

    def count_usage(self, caller: Caller, status: int, usage: tuple[int, int] | None) -> None:
        """A key's usage: its request (a 429 is none) and tokens, and its token window."""
        if not caller.id or status == 429:
            return
        prompt, completion = usage or (0, 0)
        self.usage.add(caller.id, time.time(), prompt, completion)
        if caller.limits:
            caller.limits.spend(time.monotonic(), prompt + completion)

    async def _send_to_replica(self, model: str, path: str, raw: bytes,
                               headers: list[tuple[bytes, bytes]]) -> Response:
        """The replica the balancer leases that takes the connection, the next one if it
        is refused; a request that reached one is never sent to another (no generation
        runs twice). The lease ends when the answer is relayed."""
        balanced = self.balancer.routing == "balanced"
        if balanced:
            self.slots.ensure_running()
        # With one replica there is no choice to make: its conversations need no keys.
        many = len(self.router.ready(model)) > 1
        conv = conversation(headers, raw) if balanced and many else None
        tried: set[str] = set()
        refused = ""
        while lease := await self._lease(model, conv, tried):
            replica = lease.replica
            try:
                response = await self.upstream.post(replica["endpoint"], path, raw,
                                                    replica["api_key"])
            except ConnectFailed as e:
                lease.release()
                log.warning("replica %s of %s could not take the request, trying the next: "
                            "%s", replica["id"], model, e)
                tried.add(replica["id"])
                refused = f"; the last one tried: {e}"
                continue
            except UpstreamError as e:
                lease.release()
                self.balancer.forget(conv, replica["id"])
                log.warning("replica %s of %s failed after the request was sent: %s",
                            replica["id"], model, e)
                raise replica_failed(replica["id"], model, e) from e
            except BaseException:
                lease.release()
                raise
            response.on_release = lease.release
            response.source = replica["id"]
            return response
        raise GatewayError(503, f"no replica of {model} could take the request: "
                           f"{self.router.states(model)}{refused}; try again shortly",
                           "service_unavailable", "no_ready_replica")

    async def _lease(self, model: str, conv: Conversation | None,
                     tried: set[str]) -> Lease | None:
        replicas = self.router.ready(model)
        if all(r["id"] in tried for r in replicas):
            # About to answer 503: first make sure no replica became ready since the last
            # read (a replica that just became ready was refused for up to ttl_s).
            replicas = self.router.ready(model, fresh=True)
        try:
            return await self.balancer.acquire(model, replicas, conv, tried)
        except Saturated as e:
            raise GatewayError(503, f"{e}; try again in {RETRY_AFTER_S} s", "server_busy",
                               "replicas_busy",
                               headers=[(b"retry-after", str(RETRY_AFTER_S).encode())]) from e

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and \
                    int(value) > self.max_body_bytes:
                raise self._too_large()
        parts, size = [], 0
        while True:
            message = await receive()
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_body_bytes:
                raise self._too_large()
            parts.append(part)
            if not message.get("more_body"):
                return b"".join(parts)

    def _too_large(self) -> GatewayError:
        return GatewayError(413, f"the request body is over {self.max_body_bytes} bytes, the "
                            "gateway's limit (gateway_max_body_bytes in server.yaml)",
                            "invalid_request_error", "request_too_large")


def make_gateway_app(store: Store, *, tokens: list[str], upstream: Upstream,
                     metrics: GatewayMetrics | None = None,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     keys_required: bool = False,
                     usage_flush_s: float = USAGE_FLUSH_S,
                     routing: Routing = "balanced", queue_size: int = 256,
                     queue_wait_s: float = 30.0) -> Gateway:
    return Gateway(store, tokens=tokens, upstream=upstream, metrics=metrics,
                   max_body_bytes=max_body_bytes, keys_required=keys_required,
                   usage_flush_s=usage_flush_s,
                   balancer=Balancer(routing, queue_size=queue_size, queue_wait_s=queue_wait_s))


def replica_failed(replica_id: str, model: str, why: object) -> GatewayError:
    """A 502 for a request a replica took and then failed: never resent elsewhere."""
    return GatewayError(502, f"replica {replica_id} of {model} failed while answering: "
                        f"{why}; the request was not retried, so it may have run once",
                        "upstream_error", "replica_failed")


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, "invalid_request_error", "invalid_api_key",
                        headers=[(b"www-authenticate", b'Bearer realm="llmgw gateway"')])


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _admit(caller: Caller) -> None:
    """A 429 in OpenAI's shape (type requests or tokens, code rate_limit_exceeded) with
    Retry-After when the caller's key spent its minute."""
    if caller.limits is None:
        return
    over = caller.limits.admit(time.monotonic())
    if over is None:
        return
    what, wait_s = over
    limit = caller.limits.rpm if what == "requests" else caller.limits.tpm
    after = keys.retry_after(wait_s)
    raise GatewayError(429, f"rate limit reached for key {caller.name!r} on {what} per "
                       f"minute: limit {limit}; try again in {after} s", what,
                       "rate_limit_exceeded",
                       headers=[(b"retry-after", after.encode()),
                                (f"x-ratelimit-limit-{what}".encode(), str(limit).encode()),
                                (f"x-ratelimit-remaining-{what}".encode(), b"0"),
                                (f"x-ratelimit-reset-{what}".encode(), f"{after}s".encode())])


def _parse(raw: bytes) -> tuple[str, bool]:
    """The requested model and whether to stream; the body itself is forwarded as sent."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise GatewayError(400, f"the request body is not valid JSON: {e}",
                           "invalid_request_error", "invalid_json") from e
    if not isinstance(body, dict):
        raise GatewayError(422, f"the request body must be a JSON object, found "
                           f"{type(body).__name__}", "invalid_request_error", "invalid_body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(422, "the request names no model: set \"model\" to a name from "
                           "GET /v1/models", "invalid_request_error", "missing_model", "model")
    return model, bool(body.get("stream"))


def serves(model: ModelSpec, kind: str) -> bool:
    """Whether the model serves requests of this kind (chat or embedding)."""
    return (model.get("routing_profile", "chat") == "embedding") == (kind == "embedding")


def _check_kind(model: ModelSpec, kind: str, path: str) -> None:
    profile = model.get("routing_profile", "chat")
    if not serves(model, kind):
        routes = "/v1/embeddings" if profile == "embedding" else \
            "/v1/chat/completions and /v1/completions"
        raise GatewayError(400, f"{model['name']} is an {profile} model (routing_profile "
                           f"{profile!r}); it serves {routes}, not {path}",
                           "invalid_request_error", "wrong_model_kind", "model")


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
