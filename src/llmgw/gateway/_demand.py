"""Models on demand, the gateway's part: a request for a model with no ready replica waits
in that model's load queue (bounded in count and time) while the scheduler starts one, and
what this gateway sees of each model (waiting, in flight, the last request's time) is
written to the store for the scheduler every few seconds, at once when a wait begins.

One poller per model with waiters reads the store every POLL_S: the first ready replica
ends the wait of every waiter, in order of arrival; a replica that failed, or a placement
that found no room, after a waiter came answers every waiter 503 with that reason at once.
A control plane that holds no scheduler lease cannot start anything: a cold model is then
refused at once, and its waiters are answered as soon as the lease lapses."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.contract import ReplicaState
from llmgw.contract.records import ModelSpec, ReplicaRecord
from llmgw.errors import Error
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.store import Store, StoreError, Use

log = logging.getLogger("llmgw.gateway")

POLL_S = 0.25
# Each model's use reaches the store this often (the scheduler reads rows younger than
# store.demand.DEMAND_FRESH_S), and at once when a wait begins.
DEMAND_FLUSH_S = 2.0
# Whether a control plane schedules is read again after this long, not per request.
SCHEDULER_CHECK_S = 1.0


class LoadFailed(Error):
    """A waiter's answer: why no replica came (the gateway answers 503 with it)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Model:
    """One model's use as this gateway sees it, and its waiters in order of arrival."""

    in_flight: int = 0
    last_used: float = 0.0
    waiters: list[tuple[float, asyncio.Future[None]]] = field(default_factory=list)
    load_started: float = 0.0  # perf_counter of the first waiter of this load, 0 if none
    poller: asyncio.Task[None] | None = None


class Loads:
    """This gateway's load queues and its report of each model's use to the store."""

    def __init__(self, store: Store, gateway: str, *, wait_s: float, queue_size: int,
                 metrics: GatewayMetrics | None = None,
                 ready: Callable[[str], list[ReplicaRecord]] | None = None) -> None:
        self.store, self.gateway = store, gateway
        self.wait_s, self.queue_size = wait_s, queue_size
        self.metrics = metrics
        # model -> its ready replicas read afresh from the store (the router's).
        self.ready = ready or (lambda model: [])
        self.models: dict[str, _Model] = {}
        self._dirty: set[str] = set()
        self._kick = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._scheduler_checked: tuple[float, str] = (-float("inf"), "")

    # --- use, counted on the hot path ---

    def began(self, model: str) -> None:
        m = self.models.get(model)
        if m is None:
            m = self.models[model] = _Model()
        m.in_flight += 1
        m.last_used = time.time()
        self._dirty.add(model)

    def ended(self, model: str) -> None:
        m = self.models[model]
        m.in_flight -= 1
        m.last_used = time.time()
        self._dirty.add(model)

    def waiting(self, model: str) -> int:
        m = self.models.get(model)
        return len(m.waiters) if m is not None else 0

    # --- the wait ---

    async def wait(self, model: ModelSpec) -> None:
        """Until a replica of model is ready (None), or LoadFailed saying why not: no
        control plane schedules, the queue is full, the load failed, or load_wait_s ran
        out. Cancelled (the client left), it leaves the queue at once."""
        name = model["name"]
        m = self.models.setdefault(name, _Model())
        if len(m.waiters) >= self.queue_size:
            raise LoadFailed(f"{name} is loading and {len(m.waiters)} requests already wait "
                             f"for it (load_queue_size in server.yaml); try again shortly",
                             "load_queue_full")
        why = await self._scheduler_away()
        if why:
            states = await asyncio.to_thread(self._states, name)
            raise LoadFailed(f"{name} has no ready replica ({states}) and {why}, so none "
                             "can be started now; try again once a control plane runs",
                             "control_plane_away")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (time.time(), done)
        m.waiters.append(entry)
        if m.load_started == 0.0:
            m.load_started = time.perf_counter()
        self._changed(name)
        if m.poller is None or m.poller.done():
            m.poller = asyncio.ensure_future(self._poll(name))
        try:
            await asyncio.wait_for(asyncio.shield(done), self.wait_s)
        except TimeoutError:
            raise LoadFailed(f"no replica of {name} became ready within {self.wait_s:.0f} s "
                             f"(load_wait_s in server.yaml); {self._states(name)}",
                             "load_timeout") from None
        finally:
            if entry in m.waiters:
                m.waiters.remove(entry)
                self._changed(name)

    def _changed(self, model: str) -> None:
        self._dirty.add(model)
        self._kick.set()
        if self.metrics is not None:
            self.metrics.waiting_for_load[model] = self.waiting(model)

    async def _poll(self, name: str) -> None:
        """While the model has waiters: end every wait at the first ready replica, or fail
        every one at the first failure that came after the oldest of them."""
        m = self.models[name]
        while m.waiters:
            await asyncio.sleep(POLL_S)
            try:
                ready = self.ready(name)
                failure = "" if ready else await asyncio.to_thread(
                    self._failure, name, m.waiters[0][0] if m.waiters else time.time())
            except (StoreError, OSError) as e:
                log.warning("cannot read %s's replicas while requests wait for it: %s", name, e)
                continue
            if ready:
                self._end(name, "ready", None)
            elif failure:
                self._end(name, "failed", LoadFailed(failure, "load_failed"))
            elif why := await self._scheduler_away():
                # The control plane went away while they waited (killed: its lease lapsed).
                self._end(name, "failed", LoadFailed(
                    f"no replica of {name} became ready and {why}, so none can be started "
                    "now; try again once a control plane runs", "control_plane_away"))

    def _end(self, name: str, outcome: str, error: LoadFailed | None) -> None:
        m = self.models[name]
        if self.metrics is not None and m.load_started:
            self.metrics.load(name, outcome, time.perf_counter() - m.load_started)
        m.load_started = 0.0
        # In order of arrival: each continues to the balancer in this order.
        for _, done in list(m.waiters):
            if not done.done():
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)

    def _failure(self, name: str, since: float) -> str:
        """Why a load of name failed after since (unix time), or '': a replica reported
        failed, or a replica the scheduler could not place, since then."""
        for r in self.store.replicas(name):
            if r.get("updated", 0.0) < since or not r.get("err"):
                continue
            if r["state"] == ReplicaState.FAILED:
                return f"replica {r['id']} of {name} on {r['node']} failed to load: {r['err']}"
            if r["state"] == ReplicaState.PENDING and not r["node"]:
                return f"{name} cannot be placed: {r['err']}"
        return ""

    async def _scheduler_away(self) -> str:
        """_no_scheduler's answer, read at most every SCHEDULER_CHECK_S (each first request
        of a burst would read it otherwise)."""
        at, why = self._scheduler_checked
        if time.monotonic() - at >= SCHEDULER_CHECK_S:
            why = await asyncio.to_thread(self._no_scheduler)
            self._scheduler_checked = (time.monotonic(), why)
        return why

    def _no_scheduler(self) -> str:
        """Why no control plane schedules now ('' when one holds the scheduler lease)."""
        try:
            lease = self.store.lease()
        except StoreError as e:
            return f"the control plane's store cannot be read ({self.store.why(e)})"
        if lease is None or lease.expires <= self.store.clock():
            return "no control plane is scheduling (none holds the scheduler lease)"
        return ""

    def _states(self, name: str) -> str:
        try:
            reps = [r for r in self.store.replicas(name) if r["state"] != ReplicaState.STOPPED]
        except StoreError as e:
            return f"its replicas cannot be read ({e})"
        if not reps:
            return "no replica of it is scheduled"
        return "its replicas: " + "; ".join(
            f"{r['id']} on {r['node'] or '(no node)'}: {r['state']}"
            + (f" ({r['err']})" if r.get("err") else "") for r in reps)

    # --- the report to the store ---

    def ensure_running(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_every())

    async def _write_every(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), DEMAND_FLUSH_S)
            except TimeoutError:
                pass
            self._kick.clear()
            await self.flush()

    async def flush(self) -> None:
        """Write what changed, and every model with requests waiting or in flight (so its
        row stays fresh); kept for the next write when the store cannot be written."""
        busy = {n for n, m in self.models.items() if m.in_flight or m.waiters}
        names, self._dirty = self._dirty | busy, set()
        if not names:
            return
        uses = {n: Use(len(self.models[n].waiters), self.models[n].in_flight,
                       self.models[n].last_used) for n in names}
        try:
            await asyncio.to_thread(self.store.report_use, self.gateway, uses)
        except StoreError as e:
            self._dirty |= names
            log.warning("could not write what this gateway saw of %d models to the store "
                        "(%s); trying again in %.0f s", len(names), e, DEMAND_FLUSH_S)

    async def close(self) -> None:
        tasks = [t for t in (self._writer, *(m.poller for m in self.models.values()))
                 if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._writer = None
