"""The gateway's shares of every limited key's minute, claimed from and settled with the
store off the request path (a request waits for it only when its key's share is empty)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time

from llmgw.gateway._shares import Ask, KeyShares
from llmgw.store import Grant, Settled, Store, StoreError, Want

log = logging.getLogger("llmgw.gateway")

# The most a request waits for the store to grant its key a share; past it the store counts
# as away, and the request is judged by this gateway's fraction of the limit.
CLAIM_WAIT_S = 0.5
# Claims used up or past their time are settled, debts counted and an absent store tried
# again this often ...
TICK_S = 1.0
# ... and the gateways that share the store counted this often.
CENSUS_S = 5.0


def gateway_id() -> str:
    """This gateway's name in the store: host, process and a random part (two gateways of
    one process, as in tests, are two)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Budgets:
    """This gateway's shares (KeyShares per key id), their claims in flight, and whether the
    store answers. gateways: how many took shares in the last minute as the store last said
    (this one included), which sizes claims and, while the store is away, the fraction."""

    def __init__(self, store: Store, *, claim_wait_s: float = CLAIM_WAIT_S,
                 tick_s: float = TICK_S) -> None:
        self.store = store
        self.id = gateway_id()
        self.claim_wait_s, self.tick_s = claim_wait_s, tick_s
        self.keys: dict[str, KeyShares] = {}
        self.gateways = 1
        self.away_since: float | None = None
        self._claiming: dict[str, asyncio.Future[None]] = {}
        self._unsettled: list[Settled] = []
        self._ticker: asyncio.Task[None] | None = None
        self._census_at = 0.0  # monotonic: when the gateways are next counted

    def shares(self, key_id: str, rpm: int, tpm: int) -> KeyShares:
        found = self.keys.get(key_id)
        if found is None or (found.rpm, found.tpm) != (rpm, tpm):
            found = self.keys[key_id] = KeyShares(key_id, rpm, tpm)
        return found

    def admit(self, key: KeyShares, deadline: float
              ) -> tuple[str, float] | asyncio.Future[None] | None:
        """None when the request may go (counted); (what ran out, seconds to wait); or a
        future that is done once the store answered the claim the request waits on (then
        ask again), at most claim_wait_s after it was made. Past deadline, or with the
        store away, the request is judged by this gateway's fraction of the limit."""
        self.ensure_running()
        now = time.monotonic()
        away = self.away_since is not None or now >= deadline
        verdict = key.admit(now, time.time(), self.gateways, away)
        if isinstance(verdict, Ask):
            return self._claim(key)
        if verdict is None and not away:
            self._refill(key, now)
        return verdict

    def spend(self, key: KeyShares, tokens: int) -> None:
        """An answer's tokens, counted against its key's share (beyond it, a debt)."""
        if key.tokens is not None and tokens > 0:
            now = time.monotonic()
            key.tokens.take(now, time.time(), tokens)
            if self.away_since is None:
                self._refill(key, now)

    def _refill(self, key: KeyShares, now: float) -> None:
        if key.key_id not in self._claiming and key.low(now):
            self._claim(key)

    def _claim(self, key: KeyShares) -> asyncio.Future[None]:
        """The claim in flight for key (one at a time), made now if there is none."""
        found = self._claiming.get(key.key_id)
        if found is None:
            found = self._claiming[key.key_id] = asyncio.get_running_loop().create_future()
            asyncio.ensure_future(self._ask(key, found))
        return found

    async def _ask(self, key: KeyShares, answered: asyncio.Future[None]) -> None:
        now = time.monotonic()
        wants = key.wants(now, self.gateways)
        settled = [*self._unsettled, *key.done(now)]
        self._unsettled = []
        timer = asyncio.get_running_loop().call_later(self.claim_wait_s, self._slow, answered)
        try:
            grants = await self._trade(wants, settled)
            if grants is None:
                key.put_back(wants)
            else:
                key.granted(grants, wants, time.monotonic())
        finally:
            timer.cancel()
            self._claiming.pop(key.key_id, None)
            if not answered.done():
                answered.set_result(None)

    def _slow(self, answered: asyncio.Future[None]) -> None:
        """A claim that took claim_wait_s: the store counts as away until it answers (the
        claim goes on, and what it grants is kept)."""
        self._went_away(f"it did not answer a claim within {self.claim_wait_s:.1f} s")
        if not answered.done():
            answered.set_result(None)

    async def _trade(self, wants: list[Want], settled: list[Settled], census: bool = False
                     ) -> list[Grant] | None:
        """One call to the store: its grants, or None (the settlements kept for the next
        call) when it failed. With census, the gateways seen are counted again."""
        try:
            grants, seen = await asyncio.to_thread(self.store.claim_budget, self.id, wants,
                                                   settled, census=census)
        except (StoreError, OSError) as e:
            self._unsettled = [*settled, *self._unsettled]
            self._went_away(self.store.why(e) if isinstance(e, StoreError) else str(e))
            return None
        if seen is not None:
            self.gateways = max(1, seen)
        if self.away_since is not None:
            log.info("the store answers claims of key shares again, after %.1f s; limits "
                     "are shared across the gateways again",
                     time.monotonic() - self.away_since)
            self.away_since = None
        return grants

    def _went_away(self, why: str) -> None:
        if self.away_since is None:
            self.away_since = time.monotonic()
            log.warning("cannot take shares of gateway keys' limits from the store: %s; "
                        "until it answers, each key gets at most 1/%d of its rpm and tpm "
                        "here (this gateway's fraction), and the store is tried every "
                        "%.0f s: see that it runs and that this machine reaches it",
                        why, max(2, self.gateways), self.tick_s)

    # --- off the request path ---

    def ensure_running(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._tick_every())

    async def _tick_every(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            await self.tick()

    async def tick(self) -> None:
        """Settle the claims used up or past their time, count debts and the gateways that
        share the store (and, with the store away, try it again)."""
        now = time.monotonic()
        settled = [*self._unsettled, *(s for k in self.keys.values() for s in k.done(now))]
        self._unsettled = []
        owing = [k for k in self.keys.values() if k.key_id not in self._claiming
                 and any(s.debt for s in k.shares)]
        wants = [Want(k.key_id, s.kind, 0, s.debt) for k in owing for s in k.shares if s.debt]
        for k in owing:
            for s in k.shares:
                s.debt = 0
        census = bool(self.keys) and now >= self._census_at
        if census:
            self._census_at = now + CENSUS_S
        if settled or wants or census or self.away_since is not None:
            if await self._trade(wants, settled, census=census) is None:
                for k in owing:
                    k.put_back([w for w in wants if w.key_id == k.key_id])

    async def close(self) -> None:
        """Every claim settled (what was not spent goes back to the other gateways)."""
        if self._ticker is not None:
            self._ticker.cancel()
        now = time.monotonic()
        settled = [*self._unsettled, *(s for k in self.keys.values() for s in k.done(now, True))]
        wants = [Want(k.key_id, s.kind, 0, s.debt) for k in self.keys.values()
                 for s in k.shares if s.debt]
        if settled or wants:
            await self._trade(wants, settled)

