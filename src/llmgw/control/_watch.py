"""Nodes' held watches: each answered as soon as its node's assignments differ from the
revision it last got, so a node learns a new replica within a check, not a heartbeat later.

One task on the agent API's loop looks at the store's replica cache (store.nodes: every
node's replicas, re-read at once after this process's own writes, else once a second)
every CHECK_EVERY_S while any watch is held, and recomputes a node's revision only when
the cache was re-read and that node's rows differ from the ones it last looked at."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence

from llmgw.contract.records import Assignment, NodeReplica, WatchAnswer
from llmgw.store import StoreError

log = logging.getLogger("llmgw.agent_api")

# A watch is answered unchanged after this long: under the agent client's read timeout
# (agent.client.WATCH_TIMEOUT_S) and any proxy's idle cut, and often enough that a watch
# lost on the way is found.
HOLD_S = 55.0
# How often the store's replica cache is looked at while watches are held: a placement by
# this process's scheduler is seen within this, one by another control plane within this
# and store.nodes.REPLICAS_FRESH_S.
CHECK_EVERY_S = 0.25


def revision(assignments: Sequence[Assignment]) -> str:
    """A digest of exactly these assignments (a heartbeat answer's replicas)."""
    text = json.dumps(assignments, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class Watches:
    """The watches held on one event loop.

    replicas() is every node's live replicas (the store's cache, cheap when unchanged);
    revision_of(rows) the revision of a node's answer for those rows."""

    def __init__(self, replicas: Callable[[], Mapping[str, list[NodeReplica]]],
                 revision_of: Callable[[list[NodeReplica]], str], *,
                 hold_s: float = HOLD_S, every_s: float = CHECK_EVERY_S) -> None:
        self.replicas, self.revision_of = replicas, revision_of
        self.hold_s, self.every_s = hold_s, every_s
        # node → (the revision it sent, its answer to be) for each watch held
        self.held: dict[str, list[tuple[str, asyncio.Future[WatchAnswer]]]] = {}
        # What was last looked at: the cache's mapping, and each watched node's rows and
        # their revision.
        self._seen: Mapping[str, list[NodeReplica]] | None = None
        self._known: dict[str, tuple[list[NodeReplica], str]] = {}
        self._checker: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return sum(len(w) for w in self.held.values())

    async def watch(self, node_id: str, since: str) -> WatchAnswer:
        """Until node_id's revision differs from since (changed), or hold_s (unchanged);
        cancelled when its client leaves."""
        now = self._revision(node_id, self.replicas())
        if now != since:
            return {"changed": True, "revision": now}
        answer: asyncio.Future[WatchAnswer] = asyncio.get_running_loop().create_future()
        entry = (since, answer)
        self.held.setdefault(node_id, []).append(entry)
        if self._checker is None or self._checker.done():
            self._checker = asyncio.ensure_future(self._check_every())
        try:
            return await asyncio.wait_for(answer, self.hold_s)
        except TimeoutError:
            return {"changed": False, "revision": since}
        finally:
            self._drop(node_id, entry)

    def _drop(self, node_id: str, entry: tuple[str, asyncio.Future[WatchAnswer]]) -> None:
        held = self.held.get(node_id)
        if held is not None and entry in held:
            held.remove(entry)
            if not held:
                del self.held[node_id]
                self._known.pop(node_id, None)

    async def _check_every(self) -> None:
        while self.held:
            await asyncio.sleep(self.every_s)
            try:
                self.check()
            except StoreError as e:  # the store is away: the beats say so to the agents
                log.debug("watches not checked: %s", e)

    def check(self) -> None:
        """Answer every watch whose node's revision moved (only nodes whose rows changed
        since the last look are recomputed)."""
        by_node = self.replicas()
        if by_node is self._seen:
            return
        self._seen = by_node
        for node_id, held in list(self.held.items()):
            now = self._revision(node_id, by_node)
            for since, answer in list(held):
                if now != since and not answer.done():
                    answer.set_result({"changed": True, "revision": now})

    def _revision(self, node_id: str, by_node: Mapping[str, list[NodeReplica]]) -> str:
        rows = by_node.get(node_id, [])
        known = self._known.get(node_id)
        if known is not None and known[0] == rows:
            return known[1]
        now = self.revision_of(rows)
        self._known[node_id] = (rows, now)
        return now

    def close(self) -> None:
        """Answer every held watch unchanged now (the server stops: agents watch again
        where they beat next)."""
        for held in list(self.held.values()):
            for since, answer in list(held):
                if not answer.done():
                    answer.set_result({"changed": False, "revision": since})
        if self._checker is not None:
            self._checker.cancel()
            self._checker = None
