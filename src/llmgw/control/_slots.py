"""Polls each ready replica's `/slots` (llama-server) for the balancer, off the hot path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import httpx

from llmgw.control.balancer import Balancer

log = logging.getLogger("llmgw.gateway")

POLL_S = 0.5
POLL_TIMEOUT_S = 2.0


def slots_of(answer: Any) -> tuple[int, int] | None:
    """(slots, busy) from a `/slots` answer: a list with one object per slot."""
    if not isinstance(answer, list) or not answer:
        return None
    if not all(isinstance(s, dict) and "is_processing" in s for s in answer):
        return None
    return len(answer), sum(bool(s["is_processing"]) for s in answer)


class SlotPoller:
    """Every interval_s, each ready replica's slots and busy slots into the balancer. A
    replica that answers no slots (an engine started with --no-slots, an error) counts as
    not known: the balancer then sets it no limit."""

    def __init__(self, balancer: Balancer, ready: Callable[[], list[dict[str, Any]]],
                 interval_s: float = POLL_S) -> None:
        self.balancer, self.ready, self.interval_s = balancer, ready, interval_s
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None
        self._failing: set[str] = set()

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        self._client = httpx.AsyncClient(timeout=POLL_TIMEOUT_S)
        try:
            while True:
                await self.poll_once()
                await asyncio.sleep(self.interval_s)
        finally:
            await self._client.aclose()

    async def poll_once(self) -> None:
        replicas = self.ready()
        answers = await asyncio.gather(*(self._slots(r) for r in replicas))
        for replica, answer in zip(replicas, answers, strict=True):
            slots, busy = answer or (None, 0)
            self.balancer.observe(replica["id"], slots, busy)
        self.balancer.wake()

    async def _slots(self, replica: dict[str, Any]) -> tuple[int, int] | None:
        client = self._client or httpx.AsyncClient(timeout=POLL_TIMEOUT_S)
        try:
            r = await client.get(f"{replica['endpoint']}/slots",
                                 headers={"Authorization": f"Bearer {replica['api_key']}"})
            found = slots_of(r.json()) if r.status_code == 200 else None
            problem = f"HTTP {r.status_code}" if found is None else ""
        except (httpx.HTTPError, ValueError) as e:
            found, problem = None, repr(e)
        finally:
            if client is not self._client:
                await client.aclose()
        self._say(replica, problem)
        return found

    def _say(self, replica: dict[str, Any], problem: str) -> None:
        """Log a replica's slots going unknown once, not on every poll."""
        if problem and replica["id"] not in self._failing:
            self._failing.add(replica["id"])
            log.warning("replica %s: no slots from %s/slots (%s); it is balanced without a "
                        "limit until it answers", replica["id"], replica["endpoint"], problem)
        elif not problem:
            self._failing.discard(replica["id"])

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
