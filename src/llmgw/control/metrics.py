"""The control plane's Prometheus metrics: nodes, replicas, heartbeats, the gateway
process's metrics as scraped (its own are llmgw.gateway.metrics'), and each ready replica's
engine metrics relabelled with replica, model and node."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
)

from llmgw.contract import NodeState, ReplicaState
from llmgw.contract.records import NodeRecord, ReplicaRecord
from llmgw.control import _fleet_metrics as fleet
from llmgw.control._demand import IDLE, NO_ROOM, Eviction
from llmgw.control.leadership import control_plane_views
from llmgw.control.nodes import node_view
from llmgw.store import Store, StoreError

ENGINE_SCRAPE_TIMEOUT_S = 2.0


class StateCollector:
    """Nodes and replicas by state, each node's state, engines and GPUs, heartbeat age, and
    the agents' replica state changes, read from the store at scrape time; and whether the
    store answered (llmgw_store_up: 0 with nothing read from it when it did not)."""

    def __init__(self, store: Store, node_timeout_s: float) -> None:
        self.store, self.node_timeout_s = store, node_timeout_s

    def collect(self) -> Iterator[Any]:
        try:
            families, up = list(self._read()), 1
        except StoreError:
            families, up = [], 0
        yield GaugeMetricFamily("llmgw_store_up", "Whether the store answered this scrape "
                                "(1), or could not be reached (0)", value=up)
        yield from families

    def _read(self) -> Iterator[Any]:
        now = self.store.clock()
        nodes = self.store.nodes()
        views = [node_view(n, now, self.node_timeout_s, self.store.hearing) for n in nodes]
        by_state = GaugeMetricFamily("llmgw_nodes", "Nodes by state", labels=["state"])
        for state in NodeState:
            by_state.add_metric([state], sum(v["state"] == state for v in views))
        yield by_state
        yield from fleet.node_families(views)
        age = GaugeMetricFamily("llmgw_node_heartbeat_age_seconds", "Seconds since each "
                                "node's last heartbeat", labels=["node"])
        for n in nodes:
            age.add_metric([n["id"]], max(0.0, now - n["last_seen"]))
        yield age
        yield self._replicas()
        yield self._changes(nodes)
        yield from self._control_planes()

    def _control_planes(self) -> Iterator[GaugeMetricFamily]:
        scheduling = GaugeMetricFamily(
            "llmgw_control_plane_scheduling", "1 for the control plane holding the scheduler "
            "lease unexpired, 0 for every other sharing the store", labels=["control_plane"])
        epoch = 0
        for cp in control_plane_views(self.store):
            scheduling.add_metric([cp["id"]], int(cp["scheduling"]))
            epoch = max(epoch, cp["epoch"])
        yield scheduling
        yield GaugeMetricFamily("llmgw_scheduler_epoch", "The scheduler lease's epoch while "
                                "one holds it (0: no control plane schedules)", value=epoch)

    def _replicas(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily("llmgw_replicas", "Replicas by model and state",
                                   labels=["model", "state"])
        counts: dict[tuple[str, str], int] = {}
        for m in self.store.models():
            for state in ReplicaState:
                counts[(m["name"], state)] = 0
        for r in self.store.replicas():
            counts[(r["model"], r["state"])] = counts.get((r["model"], r["state"]), 0) + 1
        for (model, state_name), n in sorted(counts.items()):
            family.add_metric([model, state_name], n)
        return family

    @staticmethod
    def _changes(nodes: list[NodeRecord]) -> CounterMetricFamily:
        family = CounterMetricFamily(
            "llmgw_replica_state_changes", "Replica state changes the agents saw, by the "
            "state entered", labels=["replica", "model", "node", "to"])
        for n in nodes:
            changes = n["inventory"].get("replica_state_changes") or {}
            for rid, seen in sorted(changes.items()):
                for to, count in sorted((seen.get("to") or {}).items()):
                    family.add_metric([rid, str(seen.get("model", "")), n["id"], to], count)
        return family


class HeartbeatTimer:
    """Times the control plane's handling of each heartbeat."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram("llmgw_heartbeat_duration_seconds", "Time the control plane "
                                 "takes to handle one heartbeat", registry=registry,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1))


def relabel(text: str, labels: dict[str, str], seen_meta: set[str]) -> list[str]:
    """An engine's exposition text with labels added to every sample; HELP and TYPE lines
    only the first time a family is seen (one replica's engine is like another's)."""
    extra = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            if line not in seen_meta:
                seen_meta.add(line)
                out.append(line)
            continue
        name, brace, rest = line.partition("{")
        if brace:
            out.append(f"{name}{{{extra},{rest}" if not rest.startswith("}")
                       else f"{name}{{{extra}{rest}")
        else:
            metric, _, value = line.partition(" ")
            out.append(f"{metric}{{{extra}}} {value}")
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def engine_metrics(store: Store, client: httpx.AsyncClient) -> str:
    """Every ready replica's /metrics, fetched at once with its key and relabelled (none
    while the store is away: llmgw_store_up says so)."""
    try:
        replicas = store.replicas()
    except StoreError:
        replicas = []
    ready = [r for r in replicas if r["state"] == ReplicaState.READY and r["endpoint"]]

    async def one(r: ReplicaRecord) -> str:
        try:
            got = await client.get(f"{r['endpoint'].rstrip('/')}/metrics",
                                   headers={"Authorization": f"Bearer {r['api_key']}"},
                                   timeout=ENGINE_SCRAPE_TIMEOUT_S)
        except httpx.HTTPError:
            return ""
        return got.text if got.status_code == 200 else ""

    texts = await asyncio.gather(*(one(r) for r in ready))
    seen: set[str] = set()
    lines = []
    for r, text in zip(ready, texts, strict=True):
        lines += relabel(text, {"replica": r["id"], "model": r["model"], "node": r["node"]},
                         seen)
    return "\n".join(lines) + ("\n" if lines else "")


async def gateway_metrics(client: httpx.AsyncClient, url: str) -> str:
    """The gateway process's own metrics (its loopback listener, gateway_metrics_listen),
    then llmgw_gateway_metrics_up: 1 when they were read, 0 when the gateway did not answer
    (it is stopped or restarting; its families are missing from this scrape then)."""
    text = ""
    if url:
        try:
            got = await client.get(f"{url}/metrics", timeout=ENGINE_SCRAPE_TIMEOUT_S)
            text = got.text if got.status_code == 200 else ""
        except httpx.HTTPError:
            pass
    up = ("# HELP llmgw_gateway_metrics_up Whether the gateway process answered this scrape\n"
          f"# TYPE llmgw_gateway_metrics_up gauge\nllmgw_gateway_metrics_up {int(bool(text))}\n")
    return text + up


class ControlPlaneMetrics:
    """The control plane's registry (state, heartbeats, certificates' expiry) and the
    scrape, which appends the gateway's metrics read from gateway_url (http://HOST:PORT;
    '' for none)."""

    def __init__(self, store: Store, node_timeout_s: float, gateway_url: str = "",
                 certificates: Mapping[str, str] | None = None) -> None:
        self.store = store
        self.gateway_url = gateway_url
        self.registry = CollectorRegistry()
        self.heartbeats = HeartbeatTimer(self.registry)
        self.registry.register(StateCollector(store, node_timeout_s))
        # The certificate files it serves with, by role (ca, server, gateway).
        self.registry.register(fleet.CertificateCollector(certificates or {}, store))
        self.evictions = Counter(
            "llmgw_evictions", "Replicas the scheduler stopped to give memory back, by "
            "reason: idle (no request for scaling.idle_s) or no_room (evicted for a model "
            "requests wait for)", ["reason"], registry=self.registry)
        for reason in (IDLE, NO_ROOM):
            self.evictions.labels(reason)

    def evicted(self, eviction: Eviction) -> None:
        """Count one eviction (the scheduler tells each once it is written)."""
        self.evictions.labels(eviction.reason).inc()

    async def render(self, client: httpx.AsyncClient) -> bytes:
        own = await asyncio.to_thread(generate_latest, self.registry)
        gateway, engines = await asyncio.gather(gateway_metrics(client, self.gateway_url),
                                                engine_metrics(self.store, client))
        return own + gateway.encode() + engines.encode()
