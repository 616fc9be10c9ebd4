"""The one driver of the gateway's forwarded requests: gateway.Exchange's steps, run from
the event loop's callbacks.

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
import logging
from collections.abc import Callable

from llmgw.gateway import _wire
from llmgw.gateway._relay import kept
from llmgw.gateway._upstream import Call, ConnectFailed, UpstreamError
from llmgw.gateway.app import FORWARDED, JSON_HEADERS, Exchange, Gateway, GatewayError
from llmgw.gateway.balancer import Lease
from llmgw.http1.server import Cycle

log = logging.getLogger("llmgw.gateway")


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
        _Forward(self.gateway, cycle, kind).start()
        return True


class _Forward:
    """One forwarded request, from its body to its counting (Exchange.done, once). Every
    entry from a callback goes through _safely: nothing raises into the server's or the
    replica connection's callbacks."""

    __slots__ = ("gw", "cycle", "ex", "tried", "refused", "lease", "call", "buffer",
                 "streaming", "failure", "finished", "waiting")

    def __init__(self, gw: Gateway, cycle: Cycle, kind: str) -> None:
        self.gw, self.cycle = gw, cycle
        self.ex = Exchange(gw, cycle.scope, kind)
        self.tried: set[str] = set()
        self.refused = ""
        self.lease: Lease | None = None
        self.call: Call | None = None
        self.buffer = b""  # a stream's bytes short of a whole event
        self.streaming = False
        self.failure: UpstreamError | None = None  # a stream's, told after what came
        self.finished = False
        self.waiting = False  # for the client to take what was written

    def start(self) -> None:
        ex = self.ex
        try:  # _safely's, written out: this runs for every request
            ex.authorize()
            pending = ex.check(self.cycle.body_bytes())
            if pending is None:
                self._lease()
            else:
                self._wait_for_share(pending)
        except Exception as e:
            self._failing(e)

    # --- the key's share of its minute, when it must come from the store first ---

    def _wait_for_share(self, pending: asyncio.Future[None]) -> None:
        pending.add_done_callback(lambda _: self._safely(self._shared))

    def _shared(self) -> None:
        pending = self.ex.admitted()  # a 429 is answered by _safely
        if pending is None:
            self._lease()
        else:
            self._wait_for_share(pending)

    # --- a replica ---

    def _lease(self) -> None:
        lease = self.ex.lease_now()
        if lease is None:
            self._wait_for_lease()
        else:
            self._send(lease)

    def _wait_for_lease(self) -> None:
        """The balancer's queue (or a fresh read of the ready replicas): one task for that
        one wait, and on from its callback."""
        ex = self.ex
        waiting = asyncio.ensure_future(self.gw.lease(ex.name, ex.conv, self.tried))
        waiting.add_done_callback(lambda _: self._safely(self._leased, waiting))

    def _leased(self, waiting: asyncio.Future[Lease | None]) -> None:
        lease = waiting.result()  # a GatewayError (503) is answered by _safely
        if lease is None:
            raise self.gw.no_replica(self.ex.name, self.refused)
        self._send(lease)

    def _send(self, lease: Lease) -> None:
        self.lease = lease
        replica = lease.replica
        raw = self.ex.raw
        assert raw is not None, "an exchange is sent once check() has taken its body"
        # A request that is no stream gets its answer whole: only its end is told.
        self.call = self.gw.upstream.call(self, replica["endpoint"], self.ex.scope["path"],
                                          replica["api_key"], lease.body(raw),
                                          whole=not self.ex.stream)

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
            data, headers = self.ex.relayed(conn.status, conn.headers, conn.take())
            self._end_call()
            self.cycle.answer(self.ex.status, headers, data)
            self._finish()
        except Exception as e:
            self._failing(e)

    def answer_failed(self, call: Call, error: UpstreamError) -> None:
        self._safely(self._failed, error)

    def _head(self, call: Call) -> None:
        """A stream's head (a request that is none is told only its end)."""
        self.ex.status = call.status
        if call.status != 200:
            call.gather()
            return
        self.streaming = True
        self.cycle.when_gone(lambda: self._safely(self._client_left))
        self.cycle.start(200, kept(call.headers))

    def _failed(self, error: UpstreamError) -> None:
        replica = self.lease.replica if self.lease is not None else None
        if isinstance(error, ConnectFailed) and replica is not None:
            self._end_call()
            log.warning("replica %s of %s could not take the request, trying the next: %s",
                        replica["id"], self.ex.name, error)
            self.tried.add(replica["id"])
            self.refused = f"; the last one tried: {error}"
            self._wait_for_lease()
            return
        if self.streaming:
            self.failure = error
            self._relay()
            return
        self._end_call()
        raise self.ex.broke(replica["id"] if replica else "", error)

    # --- a stream ---

    def _relay(self) -> None:
        """What came, event by event with the model renamed, as fast as the client takes
        it; what it does not take waits in the replica's connection, whose read pauses."""
        call, cycle, member = self.call, self.cycle, self.ex.member
        if self.finished or call is None or self.waiting:
            return
        while not cycle.paused:
            data = call.take()
            if not data:
                break
            events, self.buffer = _wire.split_events(self.buffer + data)
            for event in events:
                self.ex.usage = _wire.usage(event) or self.ex.usage
                cycle.write(_wire.rename_model(event, member))
        if cycle.paused and not cycle.gone:
            self.waiting = True
            cycle.when_writable(lambda: self._safely(self._writable))
        elif self.failure is not None:
            # The status is sent: what is left to say is an event, after any whole one.
            replica = self.lease.replica["id"] if self.lease is not None else ""
            self._end_stream(b"data: " + self.ex.broke(replica, self.failure).body() + b"\n\n")
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
        if not self.finished:
            self.finished = True
            self.ex.done()

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
        log.error("the gateway failed forwarding a request for %s", self.ex.name or
                  self.ex.requested or self.ex.scope["path"], exc_info=e)
        self._answer(GatewayError(500, "the gateway failed forwarding the request; see its "
                                  "log", "server_error", "gateway_error"))

    def _answer(self, error: GatewayError) -> None:
        if self.finished:
            return
        self._end_call()
        self.ex.status = error.status
        if self.streaming:
            self.cycle.end(b"data: " + error.body() + b"\n\n")
        else:
            self.cycle.answer(error.status, [*JSON_HEADERS, *error.headers], error.body())
        self._finish()
