"""A forwarded request, one object from its body to its counting (`Exchange`), run from the
event loop's callbacks.

Awaited, a request costs a task, the ASGI messages and a future per wait. In front of a
scripted replica (both measured side by side) the awaited path spent 0.06-0.08 ms of CPU a
request at 16 in flight, callbacks 0.045-0.058 (nginx 0.02); with the real engine the
gateway served 1.02-1.13x the requests a second with them. So Http1Server offers each
request to the Forwarder first (`fast=`, the server's one fast interface), once its body is
in, and it takes every POST it forwards: the steps that need not wait run at once, and one
that must continues from its own callback: a queue for a slot (a task for that one wait),
a connection to open or to free at the replica's limit, a pooled one the replica had
closed (sent once more, in `_upstream`), the answer, and a stream relayed event by event
as the client takes it (the replica's read pauses while it does not).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from llmgw.contract.records import ModelSpec
from llmgw.gateway import _wire
from llmgw.gateway._relay import kept, whole_answer
from llmgw.gateway._upstream import Call, ConnectFailed, UpstreamError
from llmgw.gateway.app import FORWARDED, JSON_HEADERS, NOBODY, Gateway, GatewayError
from llmgw.gateway.balancer import Conversation, Lease, conversation
from llmgw.http1.server import Cycle

log = logging.getLogger("llmgw.gateway")

# The status counted for a request whose client hung up before it was answered (nginx's).
CLIENT_LEFT = 499
# A stream that waits this long for its model to load (no replica was ready) gets its
# 200 head and an SSE comment line, and another comment each time this passes again:
# its client sees the request is alive. Both OpenAI SDKs skip lines starting with ':'
# (docs/operations.md "Models on demand" cites their lines); once the head is sent, a
# failure can only be told as an event, `data: {"error": {...}}`, on which both raise.
SSE_KEEPALIVE_S = 10.0
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Forwarder:
    """Http1Server's fast handler for one Gateway (see the module's docstring): takes each
    POST to a forwarded route; the app answers everything else."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.taken = 0  # requests it took

    def __call__(self, cycle: Cycle) -> bool:
        scope = cycle.scope
        kind = FORWARDED.get(scope["path"])
        if kind is None or scope["method"] != "POST":
            return False
        self.taken += 1
        Exchange(self.gateway, cycle, kind).start()
        return True


class Exchange:
    """One forwarded request and the gateway's sequence for it, written once: authorise,
    check the body (its model, the model's kind, the key's minute), lease a replica,
    forward, relay the answer (the model renamed, its usage read), count (the key's usage,
    the metrics), once, however it ended. Each step runs once, so a key's minute is spent
    once and the request is counted once. Every entry from a callback goes through
    _safely: nothing raises into the server's or the replica connection's callbacks."""

    __slots__ = ("gw", "cycle", "scope", "kind", "started", "caller", "raw", "requested",
                 "stream", "name", "conv", "status", "usage", "body", "tried", "refused",
                 "lease", "call", "buffer", "streaming", "failure", "finished", "waiting",
                 "headed", "keepalive")

    def __init__(self, gw: Gateway, cycle: Cycle, kind: str) -> None:
        self.gw, self.cycle, self.scope, self.kind = gw, cycle, cycle.scope, kind
        self.started = time.perf_counter()
        self.caller = NOBODY
        self.raw: bytes | None = None  # set once checked
        self.requested = self.name = ""  # counted under the catalog name, "" if none
        self.stream = False
        self.conv: Conversation | None = None
        self.status = 500
        self.usage: tuple[int, int] | None = None
        self.body: dict[str, object] = {}
        self.tried: set[str] = set()
        self.refused = ""
        self.lease: Lease | None = None
        self.call: Call | None = None
        self.buffer = b""  # a stream's bytes short of a whole event
        self.streaming = False
        self.failure: UpstreamError | None = None  # a stream's, told after what came
        self.finished = False
        self.waiting = False  # for the client to take what was written
        self.headed = False  # a waiting stream's 200 head is sent (comments followed)
        self.keepalive: asyncio.TimerHandle | None = None
        if gw.metrics:
            gw.metrics.in_flight += 1

    def start(self) -> None:
        try:  # _safely's, written out: this runs for every request
            self.caller = self.gw.authorize(self.scope)
            pending = self._check(self.cycle.body_bytes())
            if pending is None:
                self._lease()
            else:
                self._wait_for_share(pending)
        except Exception as e:
            self._failing(e)

    # --- the body, and the key's minute ---

    def _check(self, raw: bytes) -> asyncio.Future[None] | None:
        """The body: under the limit, JSON naming a model this caller may use, of the
        route's kind; then the key's minute is spent (a 429 when it is over). A future when
        the key's share must come from the store first: once it is done, `_admitted()`."""
        gw = self.gw
        if len(raw) > gw.max_body_bytes:
            raise _too_large(gw.max_body_bytes)
        self.body, self.requested, self.stream = _parse(raw)
        if "id_slot" in self.body:
            raise GatewayError(400, "the request sets \"id_slot\": this gateway chooses each "
                               "replica's slot itself (a conversation goes back to the slot "
                               "that holds it); send the request without it",
                               "invalid_request_error", "id_slot_not_allowed", "id_slot")
        model = gw.router.resolve(self.requested)
        if model is None or not self.caller.may_use(model, gw.router.names()):
            raise GatewayError(404, f"The model '{self.requested}' does not exist; GET "
                               "/v1/models lists what this gateway serves",
                               "invalid_request_error", "model_not_found", "model")
        self.name = model["name"]
        gw.loads.began(self.name)
        _check_kind(model, self.kind, self.scope["path"])
        self.raw = raw
        return self._admitted()

    def _admitted(self) -> asyncio.Future[None] | None:
        """The key's minute spent (a 429 when it is over), then the conversation found; a
        future while the store is asked for the key's share (then this again, within
        claim_wait_s of the request's start)."""
        gw = self.gw
        pending = gw.admit(self.caller, self.started)
        if pending is not None:
            return pending
        if gw.balancer.routing == "balanced":
            gw.slots.ensure_running()
            # With one replica there is no choice to make: its conversations need no keys.
            # A body in another encoding than UTF-8 (JSON allows UTF-16 and 32) gets no
            # id_slot (Lease.body), so it gets no conversation either.
            raw = self.raw or b""
            if len(gw.router.ready(self.name)) > 1 and raw.lstrip().startswith(b"{"):
                self.conv = conversation(self.scope["headers"], raw, self.body)
        self.body = {}
        return None

    def _wait_for_share(self, pending: asyncio.Future[None]) -> None:
        pending.add_done_callback(lambda _: self._safely(self._shared))

    def _shared(self) -> None:
        pending = self._admitted()  # a 429 is answered by _safely
        if pending is None:
            self._lease()
        else:
            self._wait_for_share(pending)

    # --- a replica ---

    def _lease(self) -> None:
        """A replica leased at once, or a wait (none free, or requests already queue)."""
        gw = self.gw
        lease = gw.balancer.try_now(self.name, gw.router.ready(self.name), self.conv)
        if lease is None:
            self._wait_for_lease()
        else:
            self._send(lease)

    def _wait_for_lease(self) -> None:
        """The balancer's queue (or a fresh read of the ready replicas): one task for that
        one wait, and on from its callback."""
        waiting = asyncio.ensure_future(self.gw.lease(self.name, self.conv, self.tried))
        waiting.add_done_callback(lambda _: self._safely(self._leased, waiting))
        # A client that hangs up while it waits leaves the queue (a model's load) at once.
        self.cycle.when_gone(lambda: _cancel(waiting))
        if self.stream and self.keepalive is None and not self.gw.router.ready(self.name):
            self._keep_alive_in(SSE_KEEPALIVE_S)  # a load's wait (not a slot's)

    def _keep_alive_in(self, delay_s: float) -> None:
        self.keepalive = asyncio.get_running_loop().call_later(
            delay_s, lambda: self._safely(self._keep_alive))

    def _keep_alive(self) -> None:
        """A stream still waiting for a replica: its head once, then a comment line."""
        if self.finished or self.call is not None or self.cycle.gone:
            return
        if not self.headed:
            self.headed = True
            self.cycle.start(200, SSE_HEADERS)
        self.cycle.write(f": waiting for {self.requested} to load\n\n".encode())
        self._keep_alive_in(SSE_KEEPALIVE_S)

    def _quiet(self) -> None:
        keepalive, self.keepalive = self.keepalive, None
        if keepalive is not None:
            keepalive.cancel()

    def _leased(self, waiting: asyncio.Future[Lease | None]) -> None:
        if waiting.cancelled():
            self.status = CLIENT_LEFT
            self._finish()
            return
        lease = waiting.result()  # a GatewayError (503) is answered by _safely
        if lease is None:
            raise self.gw.no_replica(self.name, self.refused)
        self._send(lease)

    def _send(self, lease: Lease) -> None:
        self._quiet()
        self.lease = lease
        replica = lease.replica
        raw = self.raw
        assert raw is not None, "an exchange is sent once _check() has taken its body"
        # A request that is no stream gets its answer whole: only its end is told.
        self.call = self.gw.upstream.call(self, replica["endpoint"], self.scope["path"],
                                          replica["api_key"], lease.body(raw),
                                          whole=not self.stream)

    # --- what the replica's Call tells (Reader) ---

    def answer_head(self, call: Call) -> None:
        self._safely(self._head, call)

    def answer_data(self, call: Call) -> None:
        if self.streaming:
            self._safely(self._relay)
            return
        conn = call.conn
        if conn is None or not conn.complete:
            return
        try:  # _safely's, written out: this runs for every request
            # The whole answer as the client gets it: the model renamed, its usage noted.
            status, headers, data = conn.status, conn.headers, conn.take()
            self.status = status
            data, self.usage = whole_answer(status, headers, data, self.member)
            kept_headers = kept(headers)
            self._end_call()
            if self.headed:  # a stream whose 200 went while it waited: an error event
                self.cycle.end(b"data: " + _error_event(status, data) + b"\n\n")
            else:
                self.cycle.answer(status, kept_headers, data)
            self._finish()
        except Exception as e:
            self._failing(e)

    def answer_failed(self, call: Call, error: UpstreamError) -> None:
        self._safely(self._failed, error)

    def _head(self, call: Call) -> None:
        """A stream's head (a request that is none is told only its end)."""
        self.status = call.status
        if call.status != 200:
            call.gather()
            return
        self.streaming = True
        self.cycle.when_gone(lambda: self._safely(self._client_left))
        if not self.headed:
            self.cycle.start(200, kept(call.headers))

    def _failed(self, error: UpstreamError) -> None:
        replica = self.lease.replica if self.lease is not None else None
        if isinstance(error, ConnectFailed) and replica is not None:
            self._end_call()
            log.warning("replica %s of %s could not take the request, trying the next: %s",
                        replica["id"], self.name, error)
            self.tried.add(replica["id"])
            self.refused = f"; the last one tried: {error}"
            self._wait_for_lease()
            return
        if self.streaming:
            self.failure = error
            self._relay()
            return
        self._end_call()
        raise self._broke(replica["id"] if replica else "", error)

    def _broke(self, replica_id: str, why: object) -> GatewayError:
        """The 502 for a replica that failed once the request was sent; its conversation
        is no longer sent there."""
        self.gw.balancer.forget(self.conv, replica_id)
        log.warning("replica %s of %s failed after the request was sent: %s",
                    replica_id, self.name, why)
        self.status = 502
        return replica_failed(replica_id, self.name, why)

    @property
    def member(self) -> bytes:
        """The model as the client named it, as the answer's JSON member carries it."""
        return _wire.model_value(self.requested)

    # --- a stream ---

    def _relay(self) -> None:
        """What came, event by event with the model renamed, as fast as the client takes
        it; what it does not take waits in the replica's connection, whose read pauses."""
        call, cycle, member = self.call, self.cycle, self.member
        if self.finished or call is None or self.waiting:
            return
        while not cycle.paused:
            data = call.take()
            if not data:
                break
            events, self.buffer = _wire.split_events(self.buffer + data)
            for event in events:
                self.usage = _wire.usage(event) or self.usage
                cycle.write(_wire.rename_model(event, member))
        if cycle.paused and not cycle.gone:
            self.waiting = True
            cycle.when_writable(lambda: self._safely(self._writable))
        elif self.failure is not None:
            # The status is sent: what is left to say is an event, after any whole one.
            replica = self.lease.replica["id"] if self.lease is not None else ""
            self._end_stream(b"data: " + self._broke(replica, self.failure).body() + b"\n\n")
        elif call.complete:
            self._end_stream(self.buffer)

    def _writable(self) -> None:
        self.waiting = False
        self._relay()

    def _client_left(self) -> None:
        """A client that leaves stops the generation: the gateway hangs up on the replica."""
        if not self.finished:
            self._end_call()
            self._finish()

    def _end_stream(self, last: bytes) -> None:
        self._end_call()
        self.cycle.end(last)
        self._finish()

    # --- the end ---

    def _end_call(self) -> None:
        """The replica's part is over: its connection pooled (or hung up on), the lease
        ended."""
        call, self.call = self.call, None
        if call is not None:
            call.end()
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def _finish(self) -> None:
        """Counted, once, however the request ended: the key's usage and the metrics."""
        if self.finished:
            return
        self.finished = True
        self._quiet()
        gw = self.gw
        if self.name:
            gw.loads.ended(self.name)
        gw.count_usage(self.caller, self.status, self.usage)
        if gw.metrics:
            gw.metrics.in_flight -= 1
            gw.metrics.observe(self.name, self.status, self.started, self.usage,
                               self.caller.name)

    def _safely(self, step: Callable[..., None], *args: object) -> None:
        """Run a step; an error is answered in OpenAI's shape (or, once a stream's head is
        sent, ends it), and the request counted."""
        try:
            step(*args)
        except Exception as e:
            self._failing(e)

    def _failing(self, e: Exception) -> None:
        if isinstance(e, GatewayError):
            self._answer(e)
            return
        log.error("the gateway failed forwarding a request for %s", self.name or
                  self.requested or self.scope["path"], exc_info=e)
        self._answer(GatewayError(500, "the gateway failed forwarding the request; see its "
                                  "log", "server_error", "gateway_error"))

    def _answer(self, error: GatewayError) -> None:
        if self.finished:
            return
        self._end_call()
        self.status = error.status
        if self.streaming or self.headed:
            self.cycle.end(b"data: " + error.body() + b"\n\n")
        else:
            self.cycle.answer(error.status, [*JSON_HEADERS, *error.headers], error.body())
        self._finish()


def _error_event(status: int, data: bytes) -> bytes:
    """A replica's error answer as an SSE event's data, `{"error": {...}}`: its own error
    object when it sent one in OpenAI's shape, else one saying what it answered."""
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError):
        error = None
    if not isinstance(error, dict):
        error = {"message": f"the replica answered {status}: "
                            f"{data[:300].decode(errors='replace')}",
                 "type": "server_error", "param": None, "code": f"upstream_{status}"}
    return json.dumps({"error": error}).encode()


def _cancel(task: asyncio.Future[Lease | None]) -> None:
    task.cancel()


def replica_failed(replica_id: str, model: str, why: object) -> GatewayError:
    """A 502 for a request a replica took and then failed: never resent elsewhere."""
    return GatewayError(502, f"replica {replica_id} of {model} failed while answering: "
                        f"{why}; the request was not retried, so it may have run once",
                        "upstream_error", "replica_failed")


def _too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"the request body is over {limit} bytes, the gateway's limit "
                        "(gateway_max_body_bytes in server.yaml)", "invalid_request_error",
                        "request_too_large")


def _parse(raw: bytes) -> tuple[dict[str, object], str, bool]:
    """The body parsed, its model and whether to stream; the body is forwarded as sent."""
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
    return body, model, bool(body.get("stream"))


def serves(model: ModelSpec, kind: str) -> bool:
    """Whether the model serves requests of this kind (chat or embedding)."""
    return (model["routing_profile"] == "embedding") == (kind == "embedding")


def _check_kind(model: ModelSpec, kind: str, path: str) -> None:
    profile = model["routing_profile"]
    if not serves(model, kind):
        routes = "/v1/embeddings" if profile == "embedding" else \
            "/v1/chat/completions and /v1/completions"
        raise GatewayError(400, f"{model['name']} is an {profile} model (routing_profile "
                           f"{profile!r}); it serves {routes}, not {path}",
                           "invalid_request_error", "wrong_model_kind", "model")
