"""Which ready replica takes a request: least in flight within each one's slots, a
conversation back to the replica that holds its prompt cache, and a bounded queue beyond.

The rule, in full (what `choose` does):
- A replica is free while its requests in flight (this gateway's, plus what its engine
  reported busy for others at the last poll of `/slots`) are fewer than its slots. A replica
  whose slots are not known (not polled yet, or its engine answers no `/slots`) is always
  free: the engine then queues, as it would under round robin.
- A conversation goes back to the replica that served its longest known prefix while that
  replica is free, unless it is much busier than the idlest free one: more than
  BUSIER_BY_ABS requests above it AND more than BUSIER_BY_REL times its load (the guard of
  SGLang's cache-aware router, balance_abs_threshold and balance_rel_threshold, scaled to
  engines of a few slots). Otherwise the idlest free replica takes it, ties in turn.
- With no replica free, a request waits in its model's queue for a slot, at most
  queue_wait_s and behind at most queue_size others; past either it is refused (the
  gateway answers 503 with Retry-After). A slot that frees goes to the first waiter whose
  conversation's home it is, else to the first in line.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from llmgw.config import ServerConfig
from llmgw.contract.records import ReplicaRecord
from llmgw.errors import Error

# server.yaml's defaults, where each is spelled (the balancer's own defaults are these).
_SERVER = ServerConfig()

Routing = Literal["balanced", "round-robin"]

BUSIER_BY_ABS = 2
BUSIER_BY_REL = 1.5
# A session header names a conversation outright; without it, its messages do.
SESSION_HEADER = b"x-session-id"
MAX_SESSION_BYTES = 256
# A completions prompt is keyed at every PROMPT_CHUNK characters; the next turn of a
# conversation extends the prompt, so its chunks up to the old end match.
PROMPT_CHUNK = 512
MAX_PREFIXES = 64
AFFINITY_ENTRIES = 16384
RETRY_AFTER_S = 1


class Saturated(Error):
    """Every replica's slots stayed taken: the queue was full, or the wait ran out."""


@dataclass(frozen=True)
class Conversation:
    """Keys of a request's prefixes, longest first, and the key its replica is kept under."""

    lookups: tuple[bytes, ...]
    record: bytes


def conversation(headers: Iterable[tuple[bytes, bytes]], raw: bytes,
                 body: Any = None) -> Conversation | None:
    """A request's conversation: its X-Session-Id, else the prefixes of its messages (or of
    its prompt); None when it has neither. body: raw already parsed, when it was."""
    for name, value in headers:
        if name == SESSION_HEADER and value:
            key = b"s:" + value[:MAX_SESSION_BYTES]
            return Conversation((key,), key)
    if body is None:
        try:
            body = json.loads(raw)
        except ValueError:
            return None
    parts = _parts(body) if isinstance(body, dict) else []
    if not parts:
        return None
    running, keys = hashlib.blake2b(digest_size=16), []
    for part in parts:
        running.update(part)
        keys.append(running.digest())
    return Conversation(tuple(reversed(keys[-MAX_PREFIXES:])), keys[-1])


def _parts(body: Mapping[str, Any]) -> list[bytes]:
    messages = body.get("messages")
    if isinstance(messages, list):
        # repr, not a canonical JSON dump (2.5x its cost): a conversation's turns come from
        # one client, which sends its history the same way each time.
        return [repr(m).encode() + b"\0" for m in messages]
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return [prompt[i:i + PROMPT_CHUNK].encode()
                for i in range(0, len(prompt) - PROMPT_CHUNK + 1, PROMPT_CHUNK)] or \
            [prompt.encode()]
    return []


@dataclass
class Load:
    """One replica's load as the balancer sees it."""

    in_flight: int = 0
    # From the last poll: its engine's slots (None: not known), and requests busy there
    # that were not this gateway's.
    slots: int | None = None
    others: int = 0
    # The most of this gateway's requests in flight while a poll was out: the engine's
    # busy slots are counted at some moment then, so the rest are surely others'.
    peak: int = 0

    @property
    def total(self) -> int:
        return self.in_flight + self.others

    @property
    def free(self) -> bool:
        return self.slots is None or self.total < self.slots


def choose(replicas: list[ReplicaRecord], loads: dict[str, Load], affine: str | None,
           turn: int) -> ReplicaRecord | None:
    """The replica to take a request (the rule in the module's docstring), None if none is
    free."""
    for r in replicas:
        if r["id"] not in loads:
            loads[r["id"]] = Load()
    free = [r for r in replicas if loads[r["id"]].free]
    if not free:
        return None
    least = min(loads[r["id"]].total for r in free)
    idlest = [r for r in free if loads[r["id"]].total == least]
    pick = idlest[turn % len(idlest)]
    home = next((r for r in free if r["id"] == affine), None)
    if home is None:
        return pick
    load = loads[home["id"]].total
    if load - least > BUSIER_BY_ABS and load > BUSIER_BY_REL * least:
        return pick
    return home


class Lease:
    """A replica taken for one request; release() once its answer was relayed (or failed)."""

    def __init__(self, balancer: Balancer, model: str, replica: ReplicaRecord) -> None:
        self.balancer, self.model, self.replica = balancer, model, replica
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.balancer._release(self)

    def unused(self) -> None:
        """Released at once, nothing sent (Balancer.try_now's caller could not send): the
        turn it took is given back, so the request's next pick is the one it would have
        been (ties among the idlest go in turn)."""
        if self._held:
            self.release()
            self.balancer._turn -= 1


@dataclass
class _Waiter:
    replicas: list[ReplicaRecord]
    conv: Conversation | None
    exclude: set[str]
    future: asyncio.Future[Lease] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class Balancer:
    """Leases replicas to requests. `routing: round-robin` in server.yaml keeps the old way:
    each request to the next ready replica, no slots, no queue (the engine queues)."""

    def __init__(self, routing: Routing = _SERVER.gateway_routing, *,
                 queue_size: int = _SERVER.gateway_queue_size,
                 queue_wait_s: float = _SERVER.gateway_queue_wait_s,
                 affinity_entries: int = AFFINITY_ENTRIES) -> None:
        self.routing = routing
        self.queue_size, self.queue_wait_s = queue_size, queue_wait_s
        self.loads: dict[str, Load] = {}
        self._homes: OrderedDict[bytes, str] = OrderedDict()
        self._affinity_entries = affinity_entries
        self._queues: dict[str, deque[_Waiter]] = {}
        self._turn = 0

    async def acquire(self, model: str, replicas: list[ReplicaRecord],
                      conv: Conversation | None, exclude: set[str]) -> Lease | None:
        """A lease on a replica not in exclude; None when there is none such; Saturated
        when every one stayed busy."""
        candidates = [r for r in replicas if r["id"] not in exclude]
        if not candidates:
            return None
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = deque()
        if not queue:
            lease = self._try(model, candidates, conv)
            if lease is not None:
                return lease
        return await self._wait(model, queue, _Waiter(candidates, conv, exclude))

    def try_now(self, model: str, replicas: list[ReplicaRecord],
                conv: Conversation | None) -> Lease | None:
        """A lease at once, or None when none is free or requests already wait (acquire
        then queues the request behind them). Nothing may run between this and the lease's
        unused(), if it is not used."""
        if not replicas or self._queues.get(model):
            return None
        return self._try(model, replicas, conv)

    def _try(self, model: str, replicas: list[ReplicaRecord],
             conv: Conversation | None) -> Lease | None:
        turn = self._turn
        if self.routing == "round-robin":
            replica: ReplicaRecord | None = replicas[turn % len(replicas)]
        else:
            replica = choose(replicas, self.loads, self._home(conv), turn)
        if replica is None:
            return None  # no turn taken: the next try, or a freed slot's, gets this one
        self._turn += 1
        load = self.loads.get(replica["id"])
        if load is None:
            load = self.loads[replica["id"]] = Load()
        load.in_flight += 1
        load.peak = max(load.peak, load.in_flight)
        if conv is not None:
            self._remember(conv.record, replica["id"])
        return Lease(self, model, replica)

    async def _wait(self, model: str, queue: deque[_Waiter], waiter: _Waiter) -> Lease:
        if len(queue) >= self.queue_size:
            raise Saturated(f"every replica of {model} is at its slots and "
                            f"{len(queue)} requests already wait (gateway_queue_size in "
                            "server.yaml)")
        queue.append(waiter)
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.queue_wait_s):
                return await waiter.future
        except TimeoutError as e:
            if _handed(waiter.future):  # a slot came just as the wait ran out
                return waiter.future.result()
            raise Saturated(f"every replica of {model} stayed at its slots for "
                            f"{time.monotonic() - started:.1f} s (gateway_queue_wait_s in "
                            f"server.yaml); {self._describe(waiter.replicas)}") from e
        except BaseException:
            if _handed(waiter.future):  # the request went away: its slot goes on
                waiter.future.result().release()
            raise
        finally:
            if waiter in queue:
                queue.remove(waiter)

    def _home(self, conv: Conversation | None) -> str | None:
        if conv is None:
            return None
        for key in conv.lookups:
            if key in self._homes:
                return self._homes[key]
        return None

    def _remember(self, key: bytes, replica_id: str) -> None:
        self._homes[key] = replica_id
        self._homes.move_to_end(key)
        if len(self._homes) > self._affinity_entries:
            self._homes.popitem(last=False)

    def forget(self, conv: Conversation | None, replica_id: str) -> None:
        """A replica that failed a conversation's request is no longer its home."""
        for key in conv.lookups if conv is not None else ():
            if self._homes.get(key) == replica_id:
                del self._homes[key]

    def _release(self, lease: Lease) -> None:
        self.loads[lease.replica["id"]].in_flight -= 1
        self._hand_over(lease.model, lease.replica["id"])

    def _hand_over(self, model: str, freed: str | None = None) -> None:
        """Slots that freed go to waiters: first to one whose conversation's home is the
        replica that freed, else to the first in line (a slot never idles while some
        request waits)."""
        queue = self._queues.get(model)
        while queue:
            waiter = self._next(queue, freed)
            if waiter is None:
                return
            lease = self._try(model, waiter.replicas, waiter.conv)
            if lease is None:
                return
            queue.remove(waiter)
            waiter.future.set_result(lease)

    def _next(self, queue: deque[_Waiter], freed: str | None) -> _Waiter | None:
        while queue and queue[0].future.done():
            queue.popleft()
        if freed is not None:
            for waiter in queue:
                if not waiter.future.done() and self._home(waiter.conv) == freed:
                    return waiter
        return queue[0] if queue else None

    def polling(self, replica_id: str) -> None:
        """A poll of the replica goes out now."""
        load = self.loads.setdefault(replica_id, Load())
        load.peak = load.in_flight

    def observe(self, replica_id: str, slots: int | None, busy: int) -> None:
        """A poll's answer: the replica's slots and how many were busy (None: unknown).
        Busy slots beyond this gateway's peak in flight while the poll was out are others'
        (counting against the gateway's in flight now instead took requests that had just
        ended for others', and held slots that were free for a whole poll interval)."""
        load = self.loads.setdefault(replica_id, Load())
        load.slots = slots
        load.others = max(0, busy - max(load.peak, load.in_flight)) if slots is not None else 0

    def prune(self, ready: set[str]) -> None:
        """Forget the loads of replicas no longer ready (none of their requests left): one
        that comes back is polled afresh."""
        for rid in [r for r, load in self.loads.items() if r not in ready and not load.in_flight]:
            del self.loads[rid]

    def wake(self) -> None:
        """After polls: slots that other gateways freed go to waiters."""
        for model in list(self._queues):
            self._hand_over(model)

    def _describe(self, replicas: list[ReplicaRecord]) -> str:
        return "; ".join(
            f"{r['id']}: {self.loads[r['id']].total} in flight of "
            f"{self.loads[r['id']].slots} slots" for r in replicas if r["id"] in self.loads)



def _handed(future: asyncio.Future[Lease]) -> bool:
    return future.done() and not future.cancelled()
