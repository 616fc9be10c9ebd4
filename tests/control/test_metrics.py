"""The control plane's metrics: state gauges from the store, engine text relabelled, the
gateway process's own metrics appended."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.control.metrics import ControlPlaneMetrics, relabel
from llmgw.gateway.dataplane import metrics_app
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.store import Store
from tests.servers import refused_endpoint, serve_asgi

ENGINE = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12
llamacpp:requests_processing{slot="0"} 1
"""


def test_engine_samples_get_the_replica_labels_and_meta_lines_come_once() -> None:
    seen: set[str] = set()
    first = relabel(ENGINE, {"replica": "r1", "model": "m", "node": "n"}, seen)
    second = relabel(ENGINE, {"replica": "r2", "model": "m", "node": "n"}, seen)
    assert 'llamacpp:prompt_tokens_total{replica="r1",model="m",node="n"} 12' in first
    assert 'llamacpp:requests_processing{replica="r1",model="m",node="n",slot="0"} 1' in first
    assert sum(line.startswith("#") for line in first) == 2
    assert not any(line.startswith("#") for line in second)


def test_nodes_replicas_and_reported_state_changes_are_exported(tmp_path) -> None:
    store = Store(tmp_path / "db")
    store.add_model({"name": "m", "aliases": [], "source": "http://x/m.gguf", "profiles": []})
    store.record_heartbeat("n1", {"engines": ["llamacpp"], "replica_state_changes": {
        "r1": {"model": "m", "to": {"ready": 2, "starting": 1}}}})
    store.put_replica({"id": "r1", "model": "m", "node": "n1", "profile": "cpu",
                       "state": "ready", "endpoint": "http://127.0.0.1:1", "api_key": "k"})
    text = generate_latest(ControlPlaneMetrics(store, 30.0).registry).decode()
    assert 'llmgw_nodes{state="ready"} 1.0' in text
    assert 'llmgw_replicas{model="m",state="ready"} 1.0' in text
    assert 'llmgw_replicas{model="m",state="failed"} 0.0' in text
    assert ('llmgw_replica_state_changes_total{model="m",node="n1",replica="r1",to="ready"} 2.0'
            in text)
    assert 'llmgw_node_heartbeat_age_seconds{node="n1"}' in text


def test_the_scrape_appends_the_gateway_process_metrics_and_says_when_it_is_down(
        tmp_path) -> None:
    """The gateway runs apart: its families reach the admin API's /metrics through its
    loopback listener (served as `llmgw gateway` serves it); a stopped gateway shows as
    llmgw_gateway_metrics_up 0, not as an error."""
    registry = CollectorRegistry()
    GatewayMetrics(registry).observe("m", 200, time.perf_counter(), (3, 5))
    store = Store(tmp_path / "db")

    def scrape(url: str) -> str:
        async def render() -> bytes:
            async with httpx.AsyncClient() as client:
                return await ControlPlaneMetrics(store, 30.0, gateway_url=url).render(client)
        return asyncio.run(render()).decode()

    with serve_asgi(metrics_app(registry)) as url:
        text = scrape(url)
    assert 'llmgw_gateway_requests_total{key="",model="m",status="200"} 1.0' in text
    assert 'llmgw_gateway_tokens_total{key="",kind="completion",model="m"} 5.0' in text
    assert "llmgw_gateway_requests_in_flight 0.0" in text
    assert "llmgw_gateway_metrics_up 1" in text
    text = scrape(refused_endpoint())
    assert "llmgw_gateway_requests_total" not in text
    assert "llmgw_gateway_metrics_up 0" in text
    assert 'llmgw_nodes{state="ready"} 0.0' in text


def test_the_gateways_plain_counts_expose_as_prometheus_client_metrics_would() -> None:
    """The gateway counts in plain ints and makes samples at scrape time: the histogram's
    buckets (le as prometheus_client writes them), counts and tokens are what its Counter
    and Histogram gave for the same requests."""
    from prometheus_client import Counter, Histogram

    from llmgw.gateway.metrics import DURATION_BUCKETS

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    metrics = GatewayMetrics(ours)
    duration = Histogram("llmgw_gateway_request_duration_seconds", "d", ["model"],
                         registry=theirs, buckets=DURATION_BUCKETS)
    requests = Counter("llmgw_gateway_requests", "r", ["model", "status", "key"],
                       registry=theirs)
    for seconds, status in ((0.003, 200), (0.03, 200), (0.7, 502), (400.0, 200)):
        metrics.observe("m", status, time.perf_counter() - seconds, (1, 2), "k")
        duration.labels("m").observe(seconds)
        requests.labels("m", str(status), "k").inc()
    metrics.in_flight = 1

    def samples(registry: CollectorRegistry, prefix: str) -> dict[tuple[str, str], float]:
        return {(s.name, str(sorted(s.labels.items()))): s.value
                for family in registry.collect() for s in family.samples
                if s.name.startswith(prefix) and not s.name.endswith("_created")}

    for prefix in ("llmgw_gateway_request_duration_seconds_bucket",
                   "llmgw_gateway_request_duration_seconds_count", "llmgw_gateway_requests_total"):
        assert samples(ours, prefix) == samples(theirs, prefix), prefix
    assert ours.get_sample_value("llmgw_gateway_request_duration_seconds_sum", {"model": "m"}) \
        == pytest.approx(400.733, abs=0.01)
    assert ours.get_sample_value("llmgw_gateway_tokens_total",
                                 {"model": "m", "kind": "completion", "key": "k"}) == 8
    assert ours.get_sample_value("llmgw_gateway_requests_in_flight") == 1


def test_which_control_plane_schedules_is_exported_until_its_lease_lapses(tmp_path) -> None:
    """The lease's holder is 1 under its epoch, another sharing the store 0; the control,
    the same lease expired, is no control plane scheduling (epoch 0)."""
    now = [1000.0]
    store = Store(tmp_path / "db", clock=lambda: now[0])
    store.beat_control_plane("cp-a", "https://a:7443", "http://a:9090")
    store.beat_control_plane("cp-b", "https://b:7443", "http://b:9090")
    assert store.acquire_lease("cp-a", 10.0) is not None
    text = generate_latest(ControlPlaneMetrics(store, 30.0).registry).decode()
    assert 'llmgw_control_plane_scheduling{control_plane="cp-a"} 1.0' in text
    assert 'llmgw_control_plane_scheduling{control_plane="cp-b"} 0.0' in text
    assert "llmgw_scheduler_epoch 1.0" in text
    now[0] += 11
    text = generate_latest(ControlPlaneMetrics(store, 30.0).registry).decode()
    assert 'llmgw_control_plane_scheduling{control_plane="cp-a"} 0.0' in text
    assert "llmgw_scheduler_epoch 0.0" in text
