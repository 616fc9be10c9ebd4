"""The gateway's fast path: its one request sequence (gateway.Exchange) run at once.

Most requests are the plain case: a body already in, an answer in one piece (no stream),
a replica with a free slot and an idle pooled connection to it. Awaited, such a request
costs a task, the ASGI messages and a future per wait. In front of a scripted replica
(both measured side by side) that path spent 0.06-0.08 ms of CPU a request at 16 in flight,
this one 0.045-0.058 (nginx 0.02); with the real engine the gateway served 1.02-1.13x
the requests a second with it. So Http1Server offers each request here first (`fast=`):
the Exchange's steps run from the event loop's callbacks, and an error answer is written
at once. Where a step would wait (a stream, a queue, a connection to open, or a pooled
connection the replica had closed, which is sent once more), the exchange goes to the
coroutine path as it stands, before anything is sent to the client, and that path goes
on from that step: no step runs twice, and no step is written twice.
"""

from __future__ import annotations

import logging

from llmgw._http1 import Cycle
from llmgw.control._upstream import ReplicaConnection
from llmgw.control.balancer import Lease
from llmgw.control.gateway import FORWARDED, HANDED, JSON_HEADERS, Exchange, Gateway, GatewayError

log = logging.getLogger("llmgw.gateway")


class FastPath:
    """Http1Server's fast handler for one Gateway (see the module's docstring)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.taken = 0  # requests this path answered (or sent, then handed over)

    def __call__(self, cycle: Cycle) -> bool:
        scope = cycle.scope
        kind = FORWARDED.get(scope["path"])
        if kind is None or scope["method"] != "POST":
            return False
        ex = Exchange(self.gateway, scope, kind)
        try:
            ex.authorize()
            ex.check(cycle.body_bytes())
        except GatewayError as e:
            ex.status = e.status
            cycle.answer(e.status, [*JSON_HEADERS, *e.headers], e.body())
            ex.done()
            self.taken += 1
            return True
        except Exception:
            # The server logs it and gives the request to the app, which tries these
            # steps again and counts the request once.
            scope[HANDED] = ex
            raise
        if ex.stream or not self._send(cycle, ex):
            scope[HANDED] = ex  # the coroutine path goes on from the lease
            return False
        self.taken += 1
        return True

    def _send(self, cycle: Cycle, ex: Exchange) -> bool:
        """Leased and sent at once, or nothing done (the lease's turn given back)."""
        lease = ex.lease_now()
        if lease is None:
            return False
        replica = lease.replica
        assert ex.raw is not None, "an exchange is sent once check() has taken its body"
        if self.gateway.upstream.send_now(replica["endpoint"], ex.scope["path"],
                                          lease.body(ex.raw), replica["api_key"],
                                          _Relay(self.gateway, cycle, ex, lease).done) is None:
            lease.unused()
            return False
        return True


class _Relay:
    """A request the fast path sent: its answer, once the replica's is in."""

    __slots__ = ("gateway", "cycle", "ex", "lease")

    def __init__(self, gateway: Gateway, cycle: Cycle, ex: Exchange, lease: Lease) -> None:
        self.gateway, self.cycle, self.ex, self.lease = gateway, cycle, ex, lease

    def done(self, conn: ReplicaConnection) -> None:
        """The replica's whole answer, or its failure: relayed, counted, the lease ended.
        Called from the replica connection's callbacks: nothing here may raise into them."""
        self.lease.release()
        try:
            if self._relay(conn):
                return  # handed over
        except Exception:
            log.exception("the fast path failed relaying an answer of %s", self.ex.name)
            self.ex.status = 500
            if not self.cycle.started:
                self.cycle.answer(500, list(JSON_HEADERS), GatewayError(
                    500, "the gateway failed relaying the replica's answer; see its log",
                    "server_error", "gateway_error").body())
        self.ex.done()

    def _relay(self, conn: ReplicaConnection) -> bool:
        """Answer the client; True when the request went to the coroutine path instead."""
        upstream, ex, replica = self.gateway.upstream, self.ex, self.lease.replica
        if conn.failed is None:
            data, headers = ex.relayed(conn.status, conn.headers, conn.take())
            upstream.finish(conn)
            self.cycle.answer(ex.status, headers, data)
            return False
        stale = upstream.stale(conn)
        why = upstream.failure(conn, replica["endpoint"])
        upstream.finish(conn)
        if stale:  # nothing reached a live engine: sent once more, as post() does
            self.cycle.scope[HANDED] = ex
            self.cycle.fall_back()
            return True
        self.cycle.answer(502, list(JSON_HEADERS), ex.broke(replica["id"], why).body())
        return False
