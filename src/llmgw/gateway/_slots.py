"""Polls each ready replica's `/slots` (llama-server) for the balancer, off the hot path."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from llmgw.contract.records import ReplicaRecord
from llmgw.gateway._upstream import Upstream, UpstreamError
from llmgw.gateway.balancer import Balancer

log = logging.getLogger("llmgw.gateway")

POLL_S = 0.5
POLL_TIMEOUT_S = 2.0


def slots_of(answer: Any) -> tuple[int, int] | None:
    """(slots, busy) from a `/slots` answer: a list with one object per slot."""
    seen = slot_states(answer)
    return None if seen is None else (len(seen), sum(busy for busy, _ in seen))


def slot_states(answer: Any) -> list[tuple[bool, int]] | None:
    """Each slot's (busy, tokens it holds) from a `/slots` answer, in the order of their
    ids (a slot that never ran lists no `n_prompt_tokens`: it holds none)."""
    if not isinstance(answer, list) or not answer:
        return None
    if not all(isinstance(s, dict) and "is_processing" in s for s in answer):
        return None
    if sorted(s.get("id", i) for i, s in enumerate(answer)) == list(range(len(answer))):
        answer = sorted(answer, key=lambda s: s.get("id", 0))
    return [(bool(s["is_processing"]), _count(s.get("n_prompt_tokens"))) for s in answer]


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value > 0 else 0


class SlotPoller:
    """Every interval_s, each ready replica's slots and busy slots into the balancer. A
    replica that answers no slots (an engine started with --no-slots, an error) counts as
    not known: the balancer then sets it no limit."""

    def __init__(self, balancer: Balancer, ready: Callable[[], list[ReplicaRecord]],
                 upstream: Upstream, interval_s: float = POLL_S) -> None:
        self.balancer, self.ready, self.interval_s = balancer, ready, interval_s
        self.upstream = upstream
        self._task: asyncio.Task[None] | None = None
        self._failing: set[str] = set()

    def ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    async def poll_once(self) -> None:
        replicas = self.ready()
        for replica in replicas:
            self.balancer.polling(replica["id"])
        answers = await asyncio.gather(*(self._slots(r) for r in replicas))
        for replica, seen in zip(replicas, answers, strict=True):
            if seen is None:
                self.balancer.observe(replica["id"], None, 0)
            else:
                self.balancer.observe(replica["id"], len(seen), sum(b for b, _ in seen), seen)
        self.balancer.prune({r["id"] for r in replicas})
        self.balancer.wake()

    async def _slots(self, replica: ReplicaRecord) -> list[tuple[bool, int]] | None:
        try:
            async with asyncio.timeout(POLL_TIMEOUT_S):
                status, body = await get_slots(self.upstream, replica["endpoint"],
                                               replica["api_key"])
            found = slot_states(json.loads(body)) if status == 200 else None
            problem = f"HTTP {status}" if found is None else ""
        except (UpstreamError, TimeoutError, ValueError) as e:
            found, problem = None, repr(e)
        self._say(replica, problem)
        return found

    def _say(self, replica: ReplicaRecord, problem: str) -> None:
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


# A replica's /slots answer is a few KiB a slot: anything near this is not one, and the
# gateway never buffers more of it.
MAX_ANSWER_BYTES = 1 << 20


async def get_slots(upstream: Upstream, endpoint: str, api_key: str) -> tuple[int, bytes]:
    """GET /slots through the data plane's client (its pooled connections; httpx cost the
    gateway about 5 ms of CPU a poll, what some 15 requests cost its hot path): the
    status and the body, de-chunked, refused past MAX_ANSWER_BYTES."""
    response = await upstream.get(endpoint, "/slots", api_key)
    return response.status, await response.read(MAX_ANSWER_BYTES)
