"""The gateway's traffic per model, as the fleet page shows it: rates and latency
percentiles over the last minute, from the gateway's own metrics read a few seconds apart
(its counters and histogram, compared as Prometheus's rate() and histogram_quantile() do)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from typing_extensions import TypedDict

from llmgw.control.metrics import gateway_metrics

WINDOW_S = 60.0


@dataclass
class ModelCounts:
    """One model's counters at one scrape: requests by status class, tokens, and the
    request-duration histogram's cumulative buckets (upper bound, count)."""

    requests: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.requests.values())


@dataclass
class Scrape:
    at: float
    models: dict[str, ModelCounts]


class ModelTraffic(TypedDict):
    """A model's traffic: rates and percentiles over window_s (None before a second
    scrape, or with no request in it), totals since the gateway started."""

    model: str
    requests_per_s: float | None
    p50_s: float | None
    p99_s: float | None
    tokens_per_s: float | None
    requests: int
    status_4xx: int
    status_5xx: int
    window_s: float


class Traffic(TypedDict):
    gateway_up: bool
    models: list[ModelTraffic]


def parse(text: str, at: float) -> Scrape:
    """The gateway's llmgw_gateway_* families in exposition text, summed over keys."""
    models: dict[str, ModelCounts] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is None:
                continue
            counts = models.setdefault(model, ModelCounts())
            if sample.name == "llmgw_gateway_requests_total":
                kind = f"{sample.labels.get('status', '0')[:1]}xx"
                counts.requests[kind] = counts.requests.get(kind, 0.0) + sample.value
            elif sample.name == "llmgw_gateway_tokens_total":
                counts.tokens += sample.value
            elif sample.name == "llmgw_gateway_request_duration_seconds_bucket":
                le = float(sample.labels["le"])
                counts.buckets[le] = counts.buckets.get(le, 0.0) + sample.value
    return Scrape(at, models)


def increase(new: float, old: float) -> float:
    """What a counter grew by; a counter lower than before was reset (a gateway restart)."""
    return new - old if new >= old else new


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """histogram_quantile over cumulative buckets: linear within the bucket q falls in;
    the highest finite bound when it falls in +Inf; None with no observation."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower
            inside = buckets[le] - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, buckets[le]
    return lower


def compare(old: Scrape | None, new: Scrape) -> list[ModelTraffic]:
    """Each model's traffic between two scrapes (totals only, with no earlier one)."""
    out = []
    for model, now in sorted(new.models.items()):
        then = old.models.get(model, ModelCounts()) if old else None
        span = new.at - old.at if old else 0.0
        row: ModelTraffic = {
            "model": model, "requests_per_s": None, "p50_s": None, "p99_s": None,
            "tokens_per_s": None, "requests": int(now.total),
            "status_4xx": int(now.requests.get("4xx", 0)),
            "status_5xx": int(now.requests.get("5xx", 0)), "window_s": round(span, 1)}
        if then is not None and span > 0:
            row["requests_per_s"] = increase(now.total, then.total) / span
            row["tokens_per_s"] = increase(now.tokens, then.tokens) / span
            grown = {le: increase(n, then.buckets.get(le, 0.0))
                     for le, n in now.buckets.items()}
            row["p50_s"], row["p99_s"] = quantile(0.5, grown), quantile(0.99, grown)
        out.append(row)
    return out


class TrafficWatch:
    """Reads the gateway's metrics each time the page asks, and keeps a minute of
    scrapes to compare the newest with."""

    def __init__(self, gateway_url: str, client: httpx.AsyncClient,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.gateway_url, self.client, self.clock = gateway_url, client, clock
        self._scrapes: deque[Scrape] = deque()
        self._lock = asyncio.Lock()

    async def read(self) -> Traffic:
        text = await gateway_metrics(self.client, self.gateway_url)
        up = "llmgw_gateway_metrics_up 1" in text
        async with self._lock:
            new = parse(text, self.clock()) if up else None
            if new is None:
                return {"gateway_up": False, "models": []}
            # The oldest scrape kept is the newest one at least WINDOW_S old.
            while len(self._scrapes) > 1 and self._scrapes[1].at <= new.at - WINDOW_S:
                self._scrapes.popleft()
            old = self._scrapes[0] if self._scrapes else None
            self._scrapes.append(new)
            return {"gateway_up": True, "models": compare(old, new)}
