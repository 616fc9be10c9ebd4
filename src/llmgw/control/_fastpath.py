"""The gateway's fast path: a whole answer relayed from the event loop's callbacks.

Most requests are the plain case: a body already in, an answer in one piece (no stream),
a key without rate limits, a replica with a free slot and an idle pooled connection to
it. The Gateway's coroutine path costs such a request a task, the ASGI messages and a
future per wait. In front of a scripted replica (issue 16, side by side) that path spent
0.06-0.08 ms of CPU a request at 16 in flight, this one 0.045-0.058 (nginx 0.02); with
the real engine the gateway served 1.02-1.13x the requests a second with it. So
Http1Server offers each request here first (`fast=`). What this path takes, it answers as the
coroutine path would, byte for byte but the Date header: the same checks, the same lease,
usage, metrics and rename. What it cannot do at once, it leaves to the coroutine path
before anything is sent: any error answer, a stream, a key with limits, a wait (a queue,
a connection to open). A pooled connection the replica had closed (nothing of an answer
came) goes back to the coroutine path too, which sends it once more, as it does itself.
"""

from __future__ import annotations

import json
import logging
import time

from llmgw._http1 import Cycle
from llmgw.control import _wire
from llmgw.control._relay import kept, whole_answer
from llmgw.control._upstream import ReplicaConnection
from llmgw.control.balancer import Lease, conversation
from llmgw.control.gateway import (
    FORWARDED,
    JSON_HEADERS,
    Caller,
    Gateway,
    GatewayError,
    replica_failed,
    serves,
)

log = logging.getLogger("llmgw.gateway")


class FastPath:
    """Http1Server's fast handler for one Gateway (see the module's docstring)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.taken = 0  # requests this path answered or handed back after sending

    def __call__(self, cycle: Cycle) -> bool:
        scope = cycle.scope
        path = scope["path"]
        kind = FORWARDED.get(path)
        if kind is None or scope["method"] != "POST":
            return False
        gw = self.gateway
        try:
            caller = gw.authorize(scope)
        except GatewayError:
            return False
        if caller.limits is not None:
            return False
        raw = cycle.body_bytes()
        if len(raw) > gw.max_body_bytes:
            return False
        try:
            body = json.loads(raw)
        except ValueError:
            return False
        if not isinstance(body, dict) or body.get("stream"):
            return False
        requested = body.get("model")
        if not isinstance(requested, str) or not requested:
            return False
        model = gw.router.resolve(requested)
        if model is None or not caller.may_use(model, gw.router.names()) or \
                not serves(model, kind):
            return False
        name = model["name"]
        replicas = gw.router.ready(name)
        conv = None
        if gw.balancer.routing == "balanced":
            gw.slots.ensure_running()
            if len(replicas) > 1:
                conv = conversation(scope["headers"], raw, body)
        lease = gw.balancer.try_now(name, replicas, conv)
        if lease is None:
            return False
        replica = lease.replica
        forward = _Forward(self, cycle, caller, lease, conv, name, requested)
        if gw.upstream.send_now(replica["endpoint"], path, raw, replica["api_key"],
                                forward.done) is None:
            lease.unused()
            return False
        self.taken += 1
        if gw.metrics:
            gw.metrics.in_flight += 1
        return True


class _Forward:
    """One request on the fast path, sent: what its answer needs once it is in."""

    __slots__ = ("fast", "cycle", "caller", "lease", "conv", "name", "requested", "started")

    def __init__(self, fast: FastPath, cycle: Cycle, caller: Caller, lease: Lease,
                 conv: object, name: str, requested: str) -> None:
        self.fast, self.cycle, self.caller, self.lease = fast, cycle, caller, lease
        self.conv, self.name, self.requested = conv, name, requested
        self.started = time.perf_counter()

    def done(self, conn: ReplicaConnection) -> None:
        """The replica's whole answer, or its failure: relayed, counted, the lease ended.
        Called from the replica connection's callbacks: nothing here may raise into them."""
        gw = self.fast.gateway
        self.lease.release()
        try:
            status, usage = self._relay(gw, conn)
        except Exception:
            log.exception("the fast path failed relaying an answer of %s", self.name)
            status, usage = 500, None
            if not self.cycle.started:
                self.cycle.answer(500, list(JSON_HEADERS), GatewayError(
                    500, "the gateway failed relaying the replica's answer; see its log",
                    "server_error", "gateway_error").body())
        if status == 0:  # handed back to the coroutine path
            if gw.metrics:
                gw.metrics.in_flight -= 1
            return
        gw.count_usage(self.caller, status, usage)
        if gw.metrics:
            gw.metrics.in_flight -= 1
            gw.metrics.observe(self.name, status, self.started, usage, self.caller.name)

    def _relay(self, gw: Gateway, conn: ReplicaConnection) -> tuple[int, tuple[int, int] | None]:
        upstream, replica = gw.upstream, self.lease.replica
        if conn.failed is not None:
            stale = upstream.stale(conn)
            upstream.finish(conn)
            if stale:
                self.cycle.fall_back()
                return 0, None
            gw.balancer.forget(self.conv, replica["id"])  # type: ignore[arg-type]
            why = upstream.failure(conn, replica["endpoint"])
            log.warning("replica %s of %s failed after the request was sent: %s",
                        replica["id"], self.name, why)
            self.cycle.answer(502, list(JSON_HEADERS), replica_failed(replica["id"], self.name,
                                                                why).body())
            return 502, None
        status, headers, data = conn.status, conn.headers, conn.take()
        upstream.finish(conn)
        data, usage = whole_answer(status, headers, data, _wire.model_value(self.requested))
        self.cycle.answer(status, kept(headers), data)
        return status, usage

