"""Which ready replica takes a request, and which of its slots: least in flight within each
one's slots, a conversation back to the slot (or else the replica) that holds its prompt
cache, and a bounded queue beyond.

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
- Within its replica, a conversation goes to the slot that holds its prefix (the request
  carries llama-server's `id_slot`) when that slot is idle. When it is busy the request does
  not wait for it: it takes the idle slot that shares the longest prefix with it, if one
  shares as much as the busy slot holds; else it goes to its replica unpinned (or, past
  the guard or with its replica full, to the idlest). When the slot holds another
  conversation since, the request goes to its replica without `id_slot`, and the engine
  loads the conversation from its prompt cache (`_slottable`'s docstring says why). Each
  decision is counted by its reason.
- With no replica free, a request waits in its model's queue for a slot, at most
  queue_wait_s and behind at most queue_size others; past either it is refused (the
  gateway answers 503 with Retry-After). A slot that frees goes to the first in line of
  the waiters it belongs to: those whose conversation lives on its replica and those
  whose conversation lives on no ready one (new ones among them), in their order, so a
  new conversation is not passed over for as long as conversations keep coming back;
  with none such, to the first in line (a slot never idles while a request waits).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from llmgw.config import ServerConfig
from llmgw.contract.records import ReplicaRecord
from llmgw.errors import Error
from llmgw.gateway import _slottable as st
from llmgw.gateway._slottable import Homes, Slot

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
    # Each slot as this gateway sees it (none until a poll listed them), and the endpoint
    # they are of: an engine restarted on another port has empty slots.
    states: list[Slot] = field(default_factory=list)
    endpoint: str = ""

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
    found = route(replicas, loads, (b"", affine, None) if affine else None, (), turn)
    return found.replica if found else None


@dataclass(frozen=True)
class Route:
    """Where a request goes: its replica, the slot it is pinned to (id_slot) or None, and
    why (one of _slottable.REASONS)."""

    replica: ReplicaRecord
    slot: int | None
    reason: str


def route(replicas: list[ReplicaRecord], loads: dict[str, Load],
          home: tuple[bytes, str, int | None] | None, lookups: tuple[bytes, ...],
          turn: int) -> Route | None:
    """The replica and slot to take a request (the rule in the module's docstring), None if
    no replica is free. home: (key, replica, slot) its longest known prefix was last
    sent to; lookups: its prefix keys, longest first."""
    for r in replicas:
        seen = loads.get(r["id"])
        if seen is None:
            seen = loads[r["id"]] = Load()
        endpoint = r.get("endpoint", "")
        if seen.endpoint != endpoint:
            # Another engine behind this replica (restarted, moved): its slots hold nothing.
            seen.endpoint, seen.states = endpoint, [Slot() for _ in seen.states]
    free = [r for r in replicas if loads[r["id"]].free]
    if not free:
        return None
    least = min(loads[r["id"]].total for r in free)
    idlest = [r for r in free if loads[r["id"]].total == least]
    pick = idlest[turn % len(idlest)]
    if home is None:
        return Route(pick, None, st.NEW)
    key, rid, slot = home
    at = next((r for r in free if r["id"] == rid), None)
    if at is None:
        return Route(pick, None, st.HOME_FULL)
    load = loads[rid].total
    if load - least > BUSIER_BY_ABS and load > BUSIER_BY_REL * least:
        return Route(pick, None, st.GUARD)
    states = loads[rid].states
    if slot is None or slot >= len(states) or key not in states[slot].holder:
        return Route(at, None, st.REPLICA)
    if states[slot].idle:
        return Route(at, slot, st.SLOT)
    return busy_slot(free, loads, lookups, st.shared(frozenset((key,)), lookups)) or \
        Route(at, None, st.SLOT_BUSY)


def busy_slot(free: list[ReplicaRecord], loads: dict[str, Load],
              lookups: tuple[bytes, ...], least: int) -> Route | None:
    """For a request whose slot is busy: the idle slot, of a free replica, that shares the
    longest prefix with it (the first of equals), at least `least` long (as long as what
    the busy one holds); None if none does."""
    best: tuple[int, ReplicaRecord, int] | None = None
    for r in free:
        for i, state in enumerate(loads[r["id"]].states):
            if state.idle:
                depth = st.shared(state.holder, lookups)
                if depth >= least and (best is None or depth > best[0]):
                    best = (depth, r, i)
    return Route(best[1], best[2], st.SLOT_BUSY_PREFIX) if best else None


class Lease:
    """A replica taken for one request; release() once its answer was relayed (or failed).
    slot: the slot of it the request is pinned to (sent as id_slot), or None; tracked: the
    slot the gateway counts it on (the pinned one, or the one the engine will take)."""

    def __init__(self, balancer: Balancer, model: str, replica: ReplicaRecord,
                 reason: str = st.NEW) -> None:
        self.balancer, self.model, self.replica, self.reason = balancer, model, replica, reason
        self.slot: int | None = None
        self.tracked: int | None = None
        self._held = True

    def body(self, raw: bytes) -> bytes:
        """The request's body as the replica gets it: with `"id_slot"` when pinned."""
        return raw if self.slot is None else with_slot(raw, self.slot)

    def release(self) -> None:
        if self._held:
            self._held = False
            self.balancer._release(self)


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
        self.homes = Homes(affinity_entries)
        # Requests routed, by reason (_slottable.REASONS): llmgw_route_decisions_total.
        self.decisions: dict[str, int] = dict.fromkeys(st.REASONS, 0)
        self._clock = 0
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
        then queues the request behind them)."""
        if not replicas or self._queues.get(model):
            return None
        return self._try(model, replicas, conv)

    def _try(self, model: str, replicas: list[ReplicaRecord],
             conv: Conversation | None) -> Lease | None:
        turn = self._turn
        if self.routing == "round-robin":
            found: Route | None = Route(replicas[turn % len(replicas)], None, st.ROUND_ROBIN)
        else:
            home = self.homes.find(conv.lookups) if conv is not None else None
            found = route(replicas, self.loads, home, conv.lookups if conv else (), turn)
        if found is None:
            return None  # no turn taken: the next try, or a freed slot's, gets this one
        self._turn += 1
        self.decisions[found.reason] += 1
        replica = found.replica
        load = self.loads.get(replica["id"])
        if load is None:
            load = self.loads[replica["id"]] = Load()
        load.in_flight += 1
        load.peak = max(load.peak, load.in_flight)
        lease = Lease(self, model, replica, found.reason)
        if self.routing == "balanced":
            self._take_slot(lease, load, found.slot, conv)
        return lease

    def _take_slot(self, lease: Lease, load: Load, slot: int | None,
                   conv: Conversation | None) -> None:
        """Count the lease on its slot (pinned, or the one the engine will take), which
        holds the conversation from now on."""
        tracked = slot if slot is not None else st.engine_pick(load.states)
        lease.slot, lease.tracked = slot, tracked
        state = load.states[tracked] if tracked is not None else None
        if state is not None:
            state.leased += 1
            state.touched = True
            state.holder = frozenset(conv.lookups) if conv is not None else frozenset()
        if conv is not None:
            self.homes.remember(conv.record, lease.replica["id"], tracked)

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
        found = self.homes.find(conv.lookups) if conv is not None else None
        return found[1] if found else None

    def forget(self, conv: Conversation | None, replica_id: str) -> None:
        """A replica that failed a conversation's request is no longer its home."""
        if conv is not None:
            self.homes.forget(conv.lookups, replica_id)

    def _release(self, lease: Lease) -> None:
        load = self.loads[lease.replica["id"]]
        load.in_flight -= 1
        if lease.tracked is not None and lease.tracked < len(load.states):
            state = load.states[lease.tracked]
            state.leased = max(0, state.leased - 1)
            state.touched = True
            self._clock += 1  # the engine's slot was used now: last in its LRU order
            state.used = self._clock
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
        if not queue:
            return None
        if freed is not None:
            for waiter in queue:
                if not waiter.future.done() and self._belongs(waiter, freed):
                    return waiter
        return queue[0]

    def _belongs(self, waiter: _Waiter, freed: str) -> bool:
        """Whether a slot of replica `freed` is the waiter's to take in its turn: its
        conversation lives there, or nowhere ready (a new one goes anywhere)."""
        home = self._home(waiter.conv)
        return home is None or home == freed or all(r["id"] != home for r in waiter.replicas)

    def polling(self, replica_id: str) -> None:
        """A poll of the replica goes out now."""
        load = self.loads.setdefault(replica_id, Load())
        load.peak = load.in_flight
        for state in load.states:
            state.touched = bool(state.leased)

    def observe(self, replica_id: str, slots: int | None, busy: int,
                seen: list[tuple[bool, int]] | None = None) -> None:
        """A poll's answer: the replica's slots and how many were busy (None: unknown), and
        each slot's (busy, tokens it holds) where the answer said. Busy slots beyond this
        gateway's peak in flight while the poll was out are others' (counting against the
        gateway's in flight now instead took requests that had just ended for others', and
        held slots that were free for a whole poll interval)."""
        load = self.loads.setdefault(replica_id, Load())
        load.slots = slots
        load.others = max(0, busy - max(load.peak, load.in_flight)) if slots is not None else 0
        if seen is None or len(seen) != len(load.states):
            # A first poll, or another engine: slots the gateway knows nothing of.
            load.states = [Slot() for _ in seen or ()]
        for state, (processing, tokens) in zip(load.states, seen or (), strict=True):
            if not state.touched:
                state.others = processing and not state.leased
                if not tokens and not processing:
                    state.holder = frozenset()  # cleared (a restart, or purged for room)

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


def with_slot(raw: bytes, slot: int) -> bytes:
    """A JSON object's bytes (UTF-8, with a member: Exchange._check saw its "model") with
    `"id_slot": slot` as its first member; the rest byte for byte."""
    at = raw.index(b"{")
    return b"%s{\"id_slot\":%d,%s" % (raw[:at], slot, raw[at + 1:])
