"""The page's gateway traffic: rates and percentiles between two reads of the gateway's
real metrics (GatewayMetrics' exposition, served over loopback), totals before a second
read, a gateway restart taken as a counter reset, and a gateway that does not answer."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from llmgw.control.ui.traffic import TrafficWatch, compare, parse, quantile
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.host.netaddr import free_port
from tests.servers import serve_asgi


def observed(gateway: GatewayMetrics, model: str, status: int, seconds: float,
             n: int, tokens: tuple[int, int] | None = None) -> None:
    """n requests of model, each as long as seconds, counted as the gateway counts them."""
    import time

    for _ in range(n):
        gateway.observe(model, status, time.perf_counter() - seconds, tokens, key="k")


def test_rates_and_percentiles_come_from_what_grew_between_two_reads() -> None:
    registry = CollectorRegistry()
    gateway = GatewayMetrics(registry)
    observed(gateway, "tiny", 200, 3.0, 50)  # before the first read: not in the window
    first = parse(generate_latest(registry).decode(), at=100.0)
    observed(gateway, "tiny", 200, 0.03, 98, tokens=(10, 5))
    observed(gateway, "tiny", 500, 7.0, 2)
    observed(gateway, "tiny", 429, 0.001, 4)
    (row,) = compare(first, parse(generate_latest(registry).decode(), at=110.0))
    assert row["requests_per_s"] == pytest.approx(104 / 10)
    assert row["tokens_per_s"] == pytest.approx(98 * 15 / 10)
    # 4 under 5 ms, 98 in (25 ms, 50 ms], 2 in (5 s, 10 s]: the median falls among the 98.
    assert 0.025 < row["p50_s"] <= 0.05
    assert 5 < row["p99_s"] <= 10
    assert (row["status_4xx"], row["status_5xx"], row["requests"]) == (4, 2, 154)
    assert row["window_s"] == 10.0


def test_a_first_read_has_totals_and_no_rates() -> None:
    registry = CollectorRegistry()
    observed(GatewayMetrics(registry), "tiny", 200, 0.01, 3)
    (row,) = compare(None, parse(generate_latest(registry).decode(), at=1.0))
    assert row["requests"] == 3
    assert row["requests_per_s"] is None and row["p99_s"] is None


def test_a_restarted_gateway_counts_from_zero_not_below_it() -> None:
    before, after = CollectorRegistry(), CollectorRegistry()
    observed(GatewayMetrics(before), "tiny", 200, 0.01, 100)
    observed(GatewayMetrics(after), "tiny", 200, 0.01, 5)
    (row,) = compare(parse(generate_latest(before).decode(), 0.0),
                     parse(generate_latest(after).decode(), 5.0))
    assert row["requests_per_s"] == pytest.approx(1.0)


def test_quantile_interpolates_within_a_bucket_as_prometheus_does() -> None:
    buckets = {0.1: 0.0, 0.2: 10.0, 0.4: 20.0, math.inf: 20.0}
    assert quantile(0.25, buckets) == pytest.approx(0.15)
    assert quantile(0.75, buckets) == pytest.approx(0.3)
    assert quantile(0.99, {0.1: 0.0, 1.0: 0.0, math.inf: 3.0}) == 1.0
    assert quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None


def test_the_watch_reads_the_gateway_over_http_and_says_when_it_is_away() -> None:
    registry = CollectorRegistry()
    gateway = GatewayMetrics(registry)
    observed(gateway, "tiny", 200, 0.01, 2)

    async def metrics(request: object) -> Response:
        return Response(generate_latest(registry))

    clock = [0.0]

    async def read(url: str) -> list:
        async with httpx.AsyncClient() as client:
            watch = TrafficWatch(url, client, clock=lambda: clock[0])
            first = await watch.read()
            observed(gateway, "tiny", 200, 0.01, 6)
            clock[0] = 3.0
            return [first, await watch.read()]

    with serve_asgi(Starlette(routes=[Route("/metrics", metrics)])) as url:
        first, second = asyncio.run(read(url))
    assert first["gateway_up"] and first["models"][0]["requests_per_s"] is None
    assert second["models"][0]["requests_per_s"] == pytest.approx(2.0)
    away = asyncio.run(read(f"http://127.0.0.1:{free_port()}"))
    assert away == [{"gateway_up": False, "models": []}] * 2
