"""The GPU placements a node gave up on: each entry made from its record and the engine's
reason, reported in the heartbeat (and warned of) for a window, then forgotten, so the
control plane may try those cards again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from llmgw.agent.replicas.process import Record
from llmgw.contract import GIVE_UP_FREE_GROWTH_MB
from llmgw.contract.records import GivenUp, Gpu

# How long a given-up placement is reported: the control plane places no replica of that
# model and profile on those cards meanwhile (unless a card's free memory grows by
# contract GIVE_UP_FREE_GROWTH_MB), then may try them again. An agent that restarts
# forgets its give-ups and tries again.
GIVE_UP_FOR_S = 600.0


def given_up(record: Record, reason: str, starts: int, cards: list[Gpu]) -> GivenUp:
    """What the heartbeat says of a placement given up after starts failed starts: its
    cards' free memory now, so a card that frees more may be tried again sooner."""
    free = {str(g.get("uuid")): int(g.get("memory_free_mb", g.get("memory_mb", 0)))
            for g in cards if g.get("uuid") in record.gpus}
    return {"replica": record.id, "model": record.model, "profile": record.profile,
            "gpus": list(record.gpus), "reason": reason, "starts": starts, "free_mb": free,
            "since": time.time()}


class GiveUps:
    """The placements given up, each reported for for_s after it was given up."""

    def __init__(self, for_s: float = GIVE_UP_FOR_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.for_s = for_s
        self.clock = clock
        # replica id -> what the heartbeat says, and since when (by clock).
        self.entries: dict[str, tuple[GivenUp, float]] = {}
        self._lock = threading.Lock()

    def add(self, entry: GivenUp) -> None:
        with self._lock:
            self.entries[entry["replica"]] = (entry, self.clock())

    def current(self) -> list[GivenUp]:
        """The placements given up within for_s (older ones forgotten)."""
        with self._lock:
            now = self.clock()
            for rid in [rid for rid, (_, at) in self.entries.items() if now - at >= self.for_s]:
                del self.entries[rid]
            return [entry for entry, _ in self.entries.values()]

    def warnings(self) -> list[str]:
        """A line per placement given up: which replica, which cards, why, and what then."""
        return [f"replica {e['replica']} of {e['model']} ({e['profile']}) was given up on "
                f"GPU {', '.join(e['gpus'])} after {e['starts']} failed starts: {e['reason']}; "
                f"{e['model']} goes to its next profile, and this card is tried again after "
                f"{self.for_s / 60:.0f} min or once it has "
                f"{GIVE_UP_FREE_GROWTH_MB} MiB more free" for e in self.current()]
