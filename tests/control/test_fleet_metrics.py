"""The per-node families the alert rules read (node and engine states, GPUs, certificates'
expiry) and llmgw_store_up, from a real store; a real PostgreSQL stopped for the last."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.control._fleet_metrics import card_answers
from llmgw.control.metrics import ControlPlaneMetrics
from llmgw.host import pki
from llmgw.store import Store
from tests.postgres import PostgresServer

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mb": 81559, "uuid": "GPU-a",
        "class": "h100-80gb", "memory_free_mb": 80000, "unknown": []}
MIB = 1024 * 1024


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def scrape(store: Store, **kwargs: object) -> str:
    return generate_latest(ControlPlaneMetrics(store, 30.0, **kwargs).registry).decode()


def test_each_nodes_state_engines_and_gpus_are_gauges_by_node(tmp_path: Path) -> None:
    """A ready node with a failed GPU engine: its state 1 under ready (0 under the others),
    each engine 1 under its state; each card's memory in bytes and up 1. Silent past the
    node timeout, the same node is 1 under not_ready and 0 under ready."""
    now = [1000.0]
    store = Store(tmp_path / "db", clock=lambda: now[0])
    store.record_heartbeat("n1", {"engines": ["llamacpp"], "gpus": [H100], "provision": [
        {"engine": "llamacpp", "state": "ready"},
        {"engine": "llamacpp-cuda", "state": "failed", "detail": "no toolkit"}]})
    text = scrape(store)
    assert value(text, "llmgw_node_state", node="n1", state="ready") == 1
    assert value(text, "llmgw_node_state", node="n1", state="not_ready") == 0
    assert value(text, "llmgw_node_engine_state", node="n1", engine="llamacpp-cuda",
                 state="failed") == 1
    assert value(text, "llmgw_node_engine_state", node="n1", engine="llamacpp-cuda",
                 state="ready") == 0
    assert value(text, "llmgw_node_engine_state", node="n1", engine="llamacpp",
                 state="ready") == 1
    card = {"node": "n1", "gpu": "0", "uuid": "GPU-a", "class": "h100-80gb"}
    assert value(text, "llmgw_gpu_memory_total_bytes", **card) == 81559 * MIB
    assert value(text, "llmgw_gpu_memory_free_bytes", **card) == 80000 * MIB
    assert value(text, "llmgw_gpu_up", **card) == 1
    now[0] += 31
    silent = scrape(store)
    assert value(silent, "llmgw_node_state", node="n1", state="not_ready") == 1
    assert value(silent, "llmgw_node_state", node="n1", state="ready") == 0


def test_an_engine_state_this_release_does_not_know_is_exported_beside_the_known_ones(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    store.record_heartbeat("n1", {"engines": [], "provision": [
        {"engine": "vllm", "state": "warming"}]})
    text = scrape(store)
    assert value(text, "llmgw_node_engine_state", node="n1", engine="vllm", state="warming") == 1
    assert value(text, "llmgw_node_engine_state", node="n1", engine="vllm", state="ready") == 0


def test_a_card_is_out_when_it_stopped_answering_or_its_memory_is_unreadable(
        tmp_path: Path) -> None:
    """A heartbeat says a card stopped answering NVML with its `error` (NVML's reason)."""
    assert card_answers(H100) and card_answers({**H100, "error": ""})
    assert not card_answers({**H100, "error": "GPU is lost"})
    assert not card_answers({**H100, "unknown": ["memory_mb", "memory_free_mb"]})
    assert card_answers({**H100, "unknown": ["compute_capability"]}), \
        "control: a property other than memory unread leaves the card in service"
    store = Store(tmp_path / "db")
    store.record_heartbeat("n1", {"engines": ["llamacpp"], "gpus": [
        H100, {**H100, "index": 1, "uuid": "GPU-b", "memory_free_mb": 0,
               "error": "GPU is lost"}]})
    text = scrape(store)
    up = {dict(labels)["uuid"]: v for (name, labels), v in samples(text).items()
          if name == "llmgw_gpu_up"}
    assert up == {"GPU-a": 1, "GPU-b": 0}


def test_certificates_expiry_from_the_files_served_and_the_nodes_signed(tmp_path: Path) -> None:
    """The CA and a server certificate by role and path (the gateway serving with the same
    file adds nothing); each node's newest certificate not revoked; a file that cannot be
    read, and a removed node's (revoked) one, are left out."""
    ca = pki.create_ca()
    ca_pem, _ = ca.write(tmp_path, "ca")
    server = pki.issue_server(ca, ["127.0.0.1"], days=10)
    server_pem, _ = server.write(tmp_path, "server")
    store = Store(tmp_path / "db")
    store.add_cert("01", "n1", 1000.0)
    store.add_cert("02", "n1", 2000.0)
    store.add_cert("03", "n2", 3000.0)
    store.record_heartbeat("n2", {"engines": ["llamacpp"]})
    assert store.remove_node("n2", "removed") is not None
    text = scrape(store, certificates={"ca": str(ca_pem), "server": str(server_pem),
                                       "gateway": str(server_pem),
                                       "other": str(tmp_path / "missing.pem"), "none": ""})
    name = "llmgw_certificate_expiry_timestamp_seconds"
    assert value(text, name, certificate="server", node="", path=str(server_pem)) == \
        server.cert.not_valid_after_utc.timestamp()
    assert value(text, name, certificate="ca", node="", path=str(ca_pem)) == \
        ca.cert.not_valid_after_utc.timestamp()
    assert value(text, name, certificate="agent", node="n1", path="") == 2000.0
    found = {dict(labels)["certificate"] + dict(labels)["node"]
             for (n, labels) in samples(text) if n == name}
    assert found == {"ca", "server", "agentn1"}


def test_while_postgresql_is_away_the_scrape_says_store_up_0_and_answers(
        postgres_server: PostgresServer, tmp_path: Path) -> None:
    """The store stopped: /metrics still renders (the gateway's and the certificate files'
    families with it), llmgw_store_up 0 and nothing read from the store; back, 1 again."""
    store = Store(postgres_server.create_database())
    ca_pem, _ = pki.create_ca().write(tmp_path, "ca")
    store.record_heartbeat("n1", {"engines": ["llamacpp"]})
    metrics = ControlPlaneMetrics(store, 30.0, certificates={"ca": str(ca_pem)})

    def render() -> str:
        async def go() -> bytes:
            async with httpx.AsyncClient() as client:
                return await metrics.render(client)
        return asyncio.run(go()).decode()

    assert value(render(), "llmgw_store_up") == 1
    postgres_server.stop()
    try:
        away = render()
    finally:
        postgres_server.start()
    assert value(away, "llmgw_store_up") == 0
    assert "llmgw_nodes" not in away and "llmgw_node_state" not in away
    assert "llmgw_certificate_expiry_timestamp_seconds{" in away
    back = render()
    assert value(back, "llmgw_store_up") == 1
    assert value(back, "llmgw_node_state", node="n1", state="ready") == 1
    store.close()

