"""The mirror's Prometheus metrics: bytes served to nodes, downloads by state, its disk."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmgw.mirror._downloads import Manager

DOWNLOAD_STATES = ("downloading", "present", "failed")


class ServedCounter:
    """What the bytes server sent, by HTTP status; counted where it sends."""

    def __init__(self) -> None:
        self.bytes = 0
        self.responses: dict[int, int] = {}

    def sent(self, status: int, nbytes: int) -> None:
        self.bytes += nbytes
        self.responses[status] = self.responses.get(status, 0) + 1


class MirrorCollector:
    def __init__(self, manager: Manager, served: ServedCounter) -> None:
        self.manager, self.served = manager, served

    def collect(self) -> Iterator[Any]:
        sent = CounterMetricFamily("llmgw_mirror_served_bytes", "Bytes of model files the "
                                   "bytes server sent")
        sent.add_metric([], self.served.bytes)
        yield sent
        responses = CounterMetricFamily("llmgw_mirror_responses", "Bytes-server responses "
                                        "by HTTP status", labels=["status"])
        for status, n in sorted(self.served.responses.items()):
            responses.add_metric([str(status)], n)
        yield responses
        states = GaugeMetricFamily("llmgw_mirror_downloads", "Model versions by download "
                                   "state", labels=["state"])
        views = self.manager.views()
        for state in DOWNLOAD_STATES:
            states.add_metric([state], sum(v["status"]["state"] == state for v in views))
        yield states
        got = GaugeMetricFamily("llmgw_mirror_download_bytes", "Bytes each model version "
                                "holds so far", labels=["model", "version"])
        for v in views:
            got.add_metric([v["model"], v["version"]], v["status"].get("bytes") or 0)
        yield got
        yield from disk_families(self.manager.disk.root)


def disk_families(root: Path) -> Iterator[GaugeMetricFamily]:
    """The filesystem holding the models dir: its size and what is left (as statvfs says
    for an unprivileged writer); nothing when it cannot be read."""
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return
    yield GaugeMetricFamily("llmgw_mirror_disk_size_bytes", "Size of the filesystem "
                            "holding the models dir", value=usage.total)
    yield GaugeMetricFamily("llmgw_mirror_disk_free_bytes", "Bytes left for the mirror on "
                            "the filesystem holding the models dir", value=usage.free)


def registry(manager: Manager, served: ServedCounter) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(MirrorCollector(manager, served))
    return reg
