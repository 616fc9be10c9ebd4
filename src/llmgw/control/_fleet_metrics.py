"""Per-node metric families for the alert rules and the dashboard: each node's state, its
engines' states, its GPUs' memory and whether each card answers, and when certificates
expire."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from llmgw.contract import EngineState, NodeState
from llmgw.contract.records import NodeView
from llmgw.host import pki
from llmgw.store import Store, StoreError

_MIB = 1024 * 1024


def node_families(views: list[NodeView]) -> Iterator[GaugeMetricFamily]:
    """llmgw_node_state, llmgw_node_engine_state and the llmgw_gpu_* gauges of every node."""
    state = GaugeMetricFamily("llmgw_node_state", "1 for each node's state, 0 for the "
                              "others", labels=["node", "state"])
    engines = GaugeMetricFamily("llmgw_node_engine_state", "1 for the state each node's "
                                "engine is in as its agent provisions it, 0 for the others",
                                labels=["node", "engine", "state"])
    for v in views:
        for node_state in NodeState:
            state.add_metric([v["id"], node_state], int(v["state"] == node_state))
        for e in v["provision"]:
            for s in _states(e.get("state", "")):
                engines.add_metric([v["id"], e.get("engine", ""), s], int(e.get("state") == s))
    yield state
    yield engines
    yield from gpu_families(views)


def _states(current: str) -> list[str]:
    """Every engine state this release knows, and one a newer agent reported beside them."""
    known = [str(s) for s in EngineState]
    return known if current in known or not current else [*known, current]


def gpu_families(views: list[NodeView]) -> Iterator[GaugeMetricFamily]:
    """Each card's memory (total, free at the node's last heartbeat) and whether it answers."""
    labels = ["node", "gpu", "uuid", "class"]
    total = GaugeMetricFamily("llmgw_gpu_memory_total_bytes", "Each GPU's memory, as its "
                              "node's last heartbeat said", labels=labels)
    free = GaugeMetricFamily("llmgw_gpu_memory_free_bytes", "Each GPU's free memory at its "
                             "node's last heartbeat", labels=labels)
    up = GaugeMetricFamily("llmgw_gpu_up", "Whether each GPU answered NVML at its node's "
                           "last heartbeat (1), or is out: it stopped answering, or its memory "
                           "could not be read (0)", labels=labels)
    for v in views:
        for gpu in v["gpus"]:
            card: Mapping[str, Any] = gpu
            values = [v["id"], str(card.get("index", "")), str(card.get("uuid", "")),
                      str(card.get("class", ""))]
            total.add_metric(values, int(card.get("memory_mb") or 0) * _MIB)
            free.add_metric(values, int(card.get("memory_free_mb") or 0) * _MIB)
            up.add_metric(values, int(card_answers(card)))
    yield total
    yield free
    yield up


def card_answers(card: Mapping[str, Any]) -> bool:
    """False for a card that stopped answering NVML at its node's last heartbeat (`error`
    gives NVML's reason) or whose memory NVML could not read (named in `unknown`): nothing
    can be placed on it."""
    return not card.get("error") and "memory_mb" not in (card.get("unknown") or [])


def certificate_family(files: Mapping[str, str | Path],
                       nodes: Mapping[str, float]) -> GaugeMetricFamily:
    """llmgw_certificate_expiry_timestamp_seconds: when each certificate file the control
    plane serves with (by role: ca, server, gateway) and each node's newest certificate it
    signed expire; a file it cannot read is left out (its promise says why)."""
    family = GaugeMetricFamily(
        "llmgw_certificate_expiry_timestamp_seconds", "When each certificate expires (unix "
        "time): the control plane's own files by role, and each node's newest agent "
        "certificate the control plane signed", labels=["certificate", "node", "path"])
    for role, path in _files(files.items()):
        try:
            expires = pki.load_cert(path).not_valid_after_utc.timestamp()
        except pki.PKIError:
            continue
        family.add_metric([role, "", str(path)], expires)
    for node, expires in sorted(nodes.items()):
        family.add_metric(["agent", node, ""], expires)
    return family


def _files(items: Iterable[tuple[str, str | Path]]) -> Iterator[tuple[str, Path]]:
    """Each file named once, under its first role (the gateway often serves with the
    server certificate itself)."""
    seen: set[Path] = set()
    for role, path in items:
        if path and Path(path) not in seen:
            seen.add(Path(path))
            yield role, Path(path)


class CertificateCollector:
    """The certificate family at scrape time: files (role: path; '' for none) and the
    store's node certificates (left out while the store is away: llmgw_store_up says so)."""

    def __init__(self, files: Mapping[str, str | Path], store: Store) -> None:
        self.files, self.store = files, store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            nodes = self.store.cert_expiry()
        except StoreError:
            nodes = {}
        yield certificate_family(self.files, nodes)
