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
        registry.register(self)

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
        yield GaugeMetricFamily("llmgw_gateway_requests_in_flight",
                                "Gateway requests being served now", value=self.in_flight)
