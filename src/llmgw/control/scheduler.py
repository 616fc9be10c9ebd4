"""Scheduling: keep each catalog model's `scaling.min` replicas on nodes that fit.

`plan` is pure (catalog, nodes, replicas in; changes out) so it is tested without
processes; `Scheduler` applies a plan to the store.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from llmgw.contract import LIVE_REPLICA_STATES, NodeState, ReplicaState
from llmgw.contract.records import ModelSpec, NodeView, ProfileSpec, ReplicaRecord
from llmgw.control.nodes import node_view
from llmgw.control.store import Store

log = logging.getLogger("llmgw.scheduler")

# How long a stopped replica stays listed, so a person can still see why it stopped.
KEEP_STOPPED_S = 3600.0


@dataclass
class Plan:
    """What to change: replicas to add, replicas to stop (id → why), unplaced models' reasons."""

    add: list[ReplicaRecord] = field(default_factory=list)
    stop: dict[str, str] = field(default_factory=dict)
    place: dict[str, tuple[str, str]] = field(default_factory=dict)  # unplaced id → (node, profile)
    waiting: dict[str, str] = field(default_factory=dict)  # unplaced id → why


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@dataclass
class _Used:
    """What a node's live replicas take: GPUs by class, and memory (MB) of CPU profiles."""

    gpus: dict[str, int] = field(default_factory=dict)
    memory_mb: float = 0.0


def _why_not(profile: ProfileSpec, node: NodeView, used: _Used) -> str:
    """Why profile cannot run on node now, or '' when it can."""
    if node["state"] != NodeState.READY:
        return f"{node['id']} is {node['state']}"
    if profile["engine"] not in node["engines"]:
        return f"{node['id']} has no {profile['engine']} engine"
    if not _labels_match(profile["node_selector"], node["labels"]):
        wanted = ", ".join(f"{k}={v}" for k, v in profile["node_selector"].items())
        return f"{node['id']} lacks the label {wanted}"
    need_mb = profile["min_memory_gb"] * 1024
    if profile["gpu_class"]:
        cards = [g for g in node["gpus"] if g.get("class") == profile["gpu_class"]]
        free = cards[used.gpus.get(profile["gpu_class"], 0):]
        if not free:
            return f"{node['id']} has no free {profile['gpu_class']} GPU"
        if free[0].get("memory_mb", 0) < need_mb:
            return f"{node['id']}'s {profile['gpu_class']} has under {profile['min_memory_gb']} GB"
        return ""
    if node.get("memory_mb", 0) - used.memory_mb < need_mb:
        return f"{node['id']} has under {profile['min_memory_gb']} GB of memory free"
    return ""


def _usage(node_id: str, replicas: list[ReplicaRecord], models: dict[str, ModelSpec]) -> _Used:
    used = _Used()
    for r in replicas:
        if r["node"] != node_id or r["state"] not in LIVE_REPLICA_STATES:
            continue
        profile = _profile(models.get(r["model"]), r["profile"])
        if profile is None:
            continue
        if profile["gpu_class"]:
            used.gpus[profile["gpu_class"]] = used.gpus.get(profile["gpu_class"], 0) + 1
        else:
            used.memory_mb += profile["min_memory_gb"] * 1024
    return used


def _profile(model: ModelSpec | None, name: str) -> ProfileSpec | None:
    if model is None:
        return None
    return next((p for p in model["profiles"] if p["name"] == name), None)


def place(
    model: ModelSpec, nodes: list[NodeView], replicas: list[ReplicaRecord],
    models: dict[str, ModelSpec],
) -> tuple[str, str, str]:
    """(node, profile, '') for the best fit, or ('', '', why none fits)."""
    hosting = {r["node"] for r in replicas
               if r["model"] == model["name"] and r["state"] in LIVE_REPLICA_STATES}
    reasons: list[str] = []
    for profile in sorted(model["profiles"], key=lambda p: -p["priority"]):
        # Spread: nodes without a replica of this model first.
        for node in sorted(nodes, key=lambda n: (n["id"] in hosting, n["id"])):
            why = _why_not(profile, node, _usage(node["id"], replicas, models))
            if not why:
                return node["id"], profile["name"], ""
            reasons.append(f"{profile['name']}: {why}")
    if not nodes:
        return "", "", "no node has joined this control plane yet"
    return "", "", "no ready node fits any profile (" + "; ".join(reasons) + ")"


def plan(
    models: list[ModelSpec], nodes: list[NodeView], replicas: list[ReplicaRecord]
) -> Plan:
    """The changes that bring replicas in line with the catalog and the nodes' states."""
    result = Plan()
    by_name = {m["name"]: m for m in models}
    states = {n["id"]: n["state"] for n in nodes}
    live = [r for r in replicas if r["state"] in LIVE_REPLICA_STATES]
    for r in live:
        if r["model"] not in by_name:
            result.stop[r["id"]] = f"{r['model']} was deleted from the catalog"
        elif r["node"] and states.get(r["node"], "gone") in (NodeState.NOT_READY, "gone"):
            # Only a silent node loses its replicas: one that restarted and is checking its
            # engine again still runs them (engines outlive their agent).
            result.stop[r["id"]] = f"node {r['node']} is {states.get(r['node'], 'gone')}"
    kept = [r for r in live if r["id"] not in result.stop]
    for model in models:
        mine = [r for r in kept if r["model"] == model["name"]]
        for r in mine[model["scaling"]["max"]:]:
            result.stop[r["id"]] = f"{model['name']} has more than scaling.max replicas"
        mine = mine[: model["scaling"]["max"]]
        placed = [r for r in mine if r["node"]]
        unplaced = [r for r in mine if not r["node"]]
        missing = model["scaling"]["min"] - len(mine)
        unplaced += [{"id": "", "model": model["name"]} for _ in range(max(missing, 0))]
        taken = placed + result.add
        for r in unplaced:
            node, profile, why = place(model, nodes, kept + taken, by_name)
            if r["id"] and node:
                result.place[r["id"]] = (node, profile)
            elif r["id"]:
                result.waiting[r["id"]] = why
            else:
                new = {"id": "r-" + secrets.token_hex(4), "model": model["name"],
                       "node": node, "profile": profile, "state": ReplicaState.PENDING, "err": why}
                result.add.append(new)
                taken.append(new)
    return result


class Scheduler:
    """Applies plans to the store; run it after every change and on a timer."""

    def __init__(self, store: Store, node_timeout_s: float) -> None:
        self.store = store
        self.node_timeout_s = node_timeout_s

    def tick(self) -> Plan:
        now = self.store.clock()
        hearing = self.store.hearing
        nodes = [node_view(n, now, self.node_timeout_s, hearing) for n in self.store.nodes()]
        p = plan(self.store.models(), nodes, self.store.replicas())
        for rid, why in p.stop.items():
            log.info("stopping replica %s: %s", rid, why)
            self.store.update_replica(rid, state=ReplicaState.STOPPED, err=why)
        for r in p.add:
            log.info("replica %s of %s: %s", r["id"], r["model"],
                     f"on {r['node']} ({r['profile']})" if r["node"] else f"waiting: {r['err']}")
            self.store.put_replica(r)
        for rid, (node, profile) in p.place.items():
            self.store.update_replica(rid, node=node, profile=profile,
                                      state=ReplicaState.PENDING, err="")
        for rid, why in p.waiting.items():
            self.store.update_replica(rid, err=why)
        self.store.prune_stopped(KEEP_STOPPED_S)
        self.store.checkpoint()
        return p
