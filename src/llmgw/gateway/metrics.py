"""The gateway process's own Prometheus metrics: requests, tokens and their time, counted
on the hot path (the control plane scrapes them for the fleet page: llmgw.control.metrics)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.utils import floatToGoString

# The request-duration buckets, in seconds.
DURATION_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# A model's load, from the first request that waited for it to its first ready replica.
LOAD_BUCKETS = (.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class GatewayMetrics:
    """What the gateway counts on its hot path, a registry per gateway process: plain
    counts, made Prometheus samples only when /metrics is read. (A prometheus_client
    Counter takes a lock and several calls each inc: seven a request were a tenth of the
    hot path's Python, profiled. The event loop's one thread counts and scrapes.)"""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.in_flight = 0
        # (model, status, key name): [requests, prompt tokens, completion tokens]
        self._counts: dict[tuple[str, int, str], list[int]] = {}
        # model: [count per bucket (the last is +Inf)..., seconds in all]
        self._durations: dict[str, list[float]] = {}
        # Models on demand (gateway/_demand.py): requests waiting for a load, per model;
        # loads by (model, outcome) and every load's seconds, first waiter to its end.
        self.waiting_for_load: dict[str, int] = {}
        self._loads: dict[tuple[str, str], int] = {}
        self._load_seconds: list[float] = [0.0] * (len(LOAD_BUCKETS) + 2)
        registry.register(self)

    def load(self, model: str, outcome: str, seconds: float) -> None:
        """One load ended: ready (a replica came) or failed (it could not load)."""
        self._loads[(model, outcome)] = self._loads.get((model, outcome), 0) + 1
        self._load_seconds[bisect.bisect_left(LOAD_BUCKETS, seconds)] += 1
        self._load_seconds[-1] += seconds

    def observe(self, model: str, status: int, started: float,
                usage: tuple[int, int] | None, key: str = "") -> None:
        elapsed = time.perf_counter() - started
        counts = self._counts.get((model, status, key))
        if counts is None:
            counts = self._counts[(model, status, key)] = [0, 0, 0]
        counts[0] += 1
        if usage:
            counts[1] += usage[0]
            counts[2] += usage[1]
        durations = self._durations.get(model)
        if durations is None:
            durations = self._durations[model] = [0.0] * (len(DURATION_BUCKETS) + 2)
        durations[bisect.bisect_left(DURATION_BUCKETS, elapsed)] += 1
        durations[-1] += elapsed

    def collect(self) -> Iterator[Any]:
        requests = CounterMetricFamily(
            "llmgw_gateway_requests", "Gateway requests by catalog model, HTTP status and "
            "gateway key name ('' for none)", labels=["model", "status", "key"])
        tokens = CounterMetricFamily(
            "llmgw_gateway_tokens", "Tokens by model, kind (prompt, completion) and gateway "
            "key name, from the engines' usage", labels=["model", "kind", "key"])
        spent: dict[tuple[str, str], list[int]] = {}
        for (model, status, key), (n, prompt, completion) in self._counts.items():
            requests.add_metric([model, str(status), key], n)
            both = spent.setdefault((model, key), [0, 0])
            both[0] += prompt
            both[1] += completion
        for (model, key), (prompt, completion) in spent.items():
            tokens.add_metric([model, "prompt", key], prompt)
            tokens.add_metric([model, "completion", key], completion)
        duration = HistogramMetricFamily(
            "llmgw_gateway_request_duration_seconds", "Gateway request time, first byte in "
            "to last byte out", labels=["model"])
        for model, durations in self._durations.items():
            cumulative, buckets = 0.0, []
            for le, count in zip([*map(floatToGoString, DURATION_BUCKETS), "+Inf"],
                                 durations[:-1], strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            duration.add_metric([model], buckets, sum_value=durations[-1])
        yield requests
        yield tokens
        yield duration
        yield from self._demand()
        yield GaugeMetricFamily("llmgw_gateway_requests_in_flight",
                                "Gateway requests being served now", value=self.in_flight)

    def _demand(self) -> Iterator[Any]:
        waiting = GaugeMetricFamily(
            "llmgw_requests_waiting_for_load", "Requests waiting for a replica of their "
            "model to load (scaling.min 0, or none ready)", labels=["model"])
        for model, n in self.waiting_for_load.items():
            waiting.add_metric([model], n)
        loads = CounterMetricFamily(
            "llmgw_model_loads", "Loads of a model that requests waited for, by outcome: "
            "ready, or failed (answered 503 with why)", labels=["model", "outcome"])
        for (model, outcome), n in self._loads.items():
            loads.add_metric([model, outcome], n)
        seconds = HistogramMetricFamily(
            "llmgw_model_load_seconds", "A load's time, from the first request that waited "
            "for it to its first ready replica (or its failure)")
        cumulative, buckets = 0.0, []
        for le, count in zip([*map(floatToGoString, LOAD_BUCKETS), "+Inf"],
                             self._load_seconds[:-1], strict=True):
            cumulative += count
            buckets.append((le, cumulative))
        seconds.add_metric([], buckets, sum_value=self._load_seconds[-1])
        yield waiting
        yield loads
        yield seconds
