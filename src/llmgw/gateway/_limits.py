"""A gateway key's use in the gateway: the sliding window of a per-minute limit, Retry-After,
and the usage gathered between two writes to the store. (The key itself, its format and
hash: llmgw.contract.keys; the shares of a limit across gateways: _shares and _budgets.)"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 60.0


@dataclass
class Window:
    """What was spent in the last span_s seconds against a limit (a sliding log).

    Entries older than the span fall out; the log holds at most one entry per request."""

    limit: int
    span_s: float = WINDOW_S
    spent: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0

    def _expire(self, now: float) -> None:
        while self.spent and self.spent[0][0] <= now - self.span_s:
            self.total -= self.spent.popleft()[1]

    def wait_s(self, now: float, amount: int = 1, limit: int | None = None) -> float:
        """0 when amount more fits under the limit (or the limit given) now; else the
        seconds until enough of what was spent falls out of the window (at least one entry
        must go)."""
        self._expire(now)
        limit = self.limit if limit is None else limit
        if self.total + amount <= limit or not self.spent:
            return 0.0
        over, freed = self.total + amount - limit, 0
        for at, n in self.spent:
            freed += n
            if freed >= over:
                return max(at + self.span_s - now, 0.001)
        return self.spent[-1][0] + self.span_s - now

    def add(self, now: float, amount: int) -> None:
        if amount > 0:
            self._expire(now)
            self.spent.append((now, amount))
            self.total += amount

    def since(self, t: float) -> int:
        """What was spent after t (newest entries first: cheap for a recent t)."""
        found = 0
        for at, n in reversed(self.spent):
            if at <= t:
                break
            found += n
        return found


def retry_after(wait_s: float) -> str:
    """Retry-After's value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait_s)))


@dataclass
class Usage:
    """Requests and tokens per key id, gathered in memory between two writes to the store."""

    counts: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key_id: str, now: float, prompt: int, completion: int) -> None:
        got = self.counts.get(key_id)
        if got is None:
            self.counts[key_id] = [1, prompt, completion, now]
            return
        got[0] += 1
        got[1] += prompt
        got[2] += completion
        got[3] = max(got[3], now)

    def take(self) -> dict[str, tuple[int, int, int, float]]:
        """Everything gathered, leaving none."""
        taken = {k: (int(v[0]), int(v[1]), int(v[2]), v[3]) for k, v in self.counts.items()}
        self.counts = {}
        return taken

    def put_back(self, taken: dict[str, tuple[int, int, int, float]]) -> None:
        """Gathered counts that could not be written, merged with what came since."""
        for key_id, (requests, prompt, completion, last) in taken.items():
            got = self.counts.setdefault(key_id, [0, 0, 0, 0.0])
            got[0] += requests
            got[1] += prompt
            got[2] += completion
            got[3] = max(got[3], last)
