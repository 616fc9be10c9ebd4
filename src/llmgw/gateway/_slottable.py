"""Which slot of which replica holds which conversation: the gateway's view of the engines'
slots, so a continuing conversation goes back to the very slot that holds its prefix.

A conversation is known by hashes of its message prefixes (balancer.conversation), not of
the prompt text: the gateway has the messages, not the text the engine's chat template makes
of them, and a message prefix is a prompt-text prefix whatever the template. A slot's
holder is the set of prefix keys of the last request that went to it.

The engine (llama-server) takes a request's `id_slot` and then runs it in that slot whatever
the slot holds, and with `id_slot` it neither saves what the slot held to its prompt cache in
RAM nor loads the request's best match from it. Without `id_slot`, under
`--slot-prompt-similarity 0` (which the control plane gives replicas, engine_args),
it takes the least recently used idle slot, saves that slot's state to its cache and loads
the request's best cached state. So the gateway pins a request to a slot only where that
slot holds the request's own prefix; anywhere else the engine's own cache does better, and
the gateway notes the slot the engine will take (the least recently used idle one, as the
engine counts) as the one that now holds the conversation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily

# The reasons a request went where it did (llmgw_route_decisions_total{reason}).
SLOT = "slot"                      # back to the idle slot that holds its prefix (id_slot)
SLOT_BUSY_PREFIX = "slot_busy_prefix"  # its slot busy: the idle slot sharing the most
SLOT_BUSY = "slot_busy"            # its slot busy, no idle one shares as much: its replica
REPLICA = "replica"                # its slot holds another since: its replica's cache has it
NEW = "new"                        # no known prefix: the least loaded replica
GUARD = "guard"                    # its replica much busier than the idlest: the idlest
HOME_FULL = "home_full"            # its replica not free (or not ready): the least loaded
ROUND_ROBIN = "round_robin"        # gateway_routing: round-robin
REASONS = (SLOT, SLOT_BUSY_PREFIX, SLOT_BUSY, REPLICA, NEW, GUARD, HOME_FULL,
           ROUND_ROBIN)


@dataclass
class Slot:
    """One engine slot as this gateway sees it."""

    leased: int = 0          # this gateway's requests on it now
    others: bool = False     # busy for someone else at the last poll
    # The prefix keys of the last request it took (empty: nothing known, or cleared).
    holder: frozenset[bytes] = frozenset()
    used: int = -1           # when its last request ended (the table's clock), as the
    #                          engine's least-recently-used order counts
    touched: bool = False    # leased or released while a poll was out

    @property
    def idle(self) -> bool:
        return not self.leased and not self.others


def shared(holder: frozenset[bytes], lookups: tuple[bytes, ...]) -> int:
    """How long a prefix the holder shares with a conversation whose prefix keys are
    lookups (longest first): the number of its prefixes the holder has, 0 for none."""
    for i, key in enumerate(lookups):
        if key in holder:
            return len(lookups) - i
    return 0


def engine_pick(slots: list[Slot]) -> int | None:
    """The idle slot llama-server takes for a request without id_slot under
    --slot-prompt-similarity 0: the least recently used, the last of equals
    (`get_available_slot`: `t_last_used <= t_last`)."""
    best: int | None = None
    for i, slot in enumerate(slots):
        if slot.idle and (best is None or slot.used <= slots[best].used):
            best = i
    return best


@dataclass
class Homes:
    """Prefix key -> (replica, slot) of the request that last had that prefix: a table of at
    most `entries`, the least recently used out first."""

    entries: int
    table: OrderedDict[bytes, tuple[str, int | None]] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self.table)

    def find(self, lookups: tuple[bytes, ...]) -> tuple[bytes, str, int | None] | None:
        """(key, replica, slot) of the longest of lookups known, None if none is."""
        for key in lookups:
            found = self.table.get(key)
            if found is not None:
                return key, found[0], found[1]
        return None

    def remember(self, key: bytes, replica_id: str, slot: int | None) -> None:
        self.table[key] = (replica_id, slot)
        self.table.move_to_end(key)
        if len(self.table) > self.entries:
            self.table.popitem(last=False)

    def forget(self, lookups: tuple[bytes, ...], replica_id: str) -> None:
        for key in lookups:
            found = self.table.get(key)
            if found is not None and found[0] == replica_id:
                del self.table[key]


class RouteDecisions:
    """A Prometheus collector: llmgw_route_decisions_total{reason}, from the balancer's
    counts (plain ints on the hot path, samples only when /metrics is read)."""

    def __init__(self, decisions: dict[str, int]) -> None:
        self.decisions = decisions

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "llmgw_route_decisions", "Requests the gateway routed, by why they went where "
            "they did (slot: back to the slot holding the conversation, sent with id_slot)",
            labels=["reason"])
        for reason, count in self.decisions.items():
            family.add_metric([reason], count)
        yield family
