"""Models on demand, the scheduler's part: how many replicas a model needs now that
requests wait for it, which replicas went idle past scaling.idle_s, and which idle replica
of another model to evict when a waited-for model finds no room.

Pure (catalog, replicas, what the gateways saw in; decisions out), so that it is tested
without processes; scheduler.plan calls it at three places, and nothing else of the
scheduler changes for it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from llmgw.contract.records import ModelSpec, ReplicaRecord
from llmgw.store import Use

NOBODY = Use()


@dataclass(frozen=True)
class Eviction:
    """A replica stopped to give its memory back: whose (replica, model, node), for which
    model ("" when it was only idle), and why; reason is the metrics' label (IDLE, NO_ROOM)."""

    replica: str
    model: str
    node: str
    wanted_by: str
    why: str
    reason: str

    def event(self) -> str:
        if not self.wanted_by:
            return f"removed idle replica {self.replica} of {self.model} on {self.node}: {self.why}"
        return (f"evicted replica {self.replica} of {self.model} on {self.node} for "
                f"{self.wanted_by}: {self.why}")


IDLE = "idle"
NO_ROOM = "no_room"


def floor(model: ModelSpec, use: Use) -> int:
    """The replicas model needs now: its scaling.min, and one while requests wait for it
    (more come only from the balancing rules, up to scaling.max)."""
    waited = 1 if use.waiting > 0 and model["scaling"]["max"] > 0 else 0
    return max(model["scaling"]["min"], waited)


def idle_since(replica: ReplicaRecord, use: Use) -> float:
    """When the replica last had work: its model's last request, or when it last changed
    state (it became ready, say) if that came later."""
    return max(use.last_used, replica.get("updated", 0.0))


def retire_idle(model: ModelSpec, mine: list[ReplicaRecord], use: Use,
                now: float) -> list[Eviction]:
    """The replicas of model above scaling.min that had no request for scaling.idle_s,
    most idle first; none while a request is in flight or waits, or with idle_s 0."""
    idle_s = model["scaling"]["idle_s"]
    if idle_s <= 0 or use.in_flight or use.waiting:
        return []
    idle = sorted((r for r in mine if now - idle_since(r, use) >= idle_s),
                  key=lambda r: idle_since(r, use))
    over = max(len(mine) - model["scaling"]["min"], 0)
    return [Eviction(r["id"], model["name"], r["node"], "",
                     f"{model['name']} had no request for {now - idle_since(r, use):.0f} s "
                     f"(scaling.idle_s {idle_s}): its memory is given back", IDLE)
            for r in idle[:over]]


def unwanted(model: ModelSpec, mine: list[ReplicaRecord], use: Use) -> dict[str, str]:
    """Replicas of model above scaling.min that no node had room for, once no request
    waits for them (replica id -> why): they hold nothing, and the next request asks
    again (else the model would show loading for ever)."""
    if use.waiting:
        return {}
    over = max(len(mine) - model["scaling"]["min"], 0)
    return {r["id"]: f"no request waits for {model['name']} any more, and no node had room "
                     f"for it ({r.get('err') or 'not placed'})"
            for r in [r for r in mine if not r["node"]][:over]}


def evictable(live: list[ReplicaRecord], models: Mapping[str, ModelSpec],
              uses: Mapping[str, Use], wanted_by: str) -> list[ReplicaRecord]:
    """Placed replicas of other models that may be evicted, least recently used first: of
    a model above its scaling.min with no request in flight or waiting."""
    counts: dict[str, int] = {}
    for r in live:
        counts[r["model"]] = counts.get(r["model"], 0) + 1
    found = []
    for r in live:
        model = models.get(r["model"])
        use = uses.get(r["model"], NOBODY)
        if model is None or r["model"] == wanted_by or not r["node"]:
            continue
        if use.in_flight or use.waiting or counts[r["model"]] <= model["scaling"]["min"]:
            continue
        found.append(r)
    return sorted(found, key=lambda r: (idle_since(r, uses.get(r["model"], NOBODY)), r["id"]))


def evict_for(model: ModelSpec, live: list[ReplicaRecord], models: Mapping[str, ModelSpec],
              uses: Mapping[str, Use], fits: Callable[[list[ReplicaRecord]], str],
              no_room: str) -> tuple[Eviction, list[ReplicaRecord]] | None:
    """The least recently used evictable replica whose going makes room for model (fits:
    the node model would go to among these replicas, '' for none), with the replicas
    left; None when no single eviction makes room."""
    for victim in evictable(live, models, uses, model["name"]):
        rest = [r for r in live if r["id"] != victim["id"]]
        if fits(rest):
            use = uses.get(victim["model"], NOBODY)
            why = (f"requests wait for {model['name']} and no node had room ({no_room}); "
                   f"{victim['model']} was the least recently used idle model above its "
                   f"scaling.min (last request at {idle_since(victim, use):.0f})")
            return Eviction(victim["id"], victim["model"], victim["node"], model["name"],
                            why, NO_ROOM), rest
    return None
