"""The gateway's OpenAI surface, metrics and the day-2 commands on a live host: the
official openai client against `llmgw server` and `llmgw agent` with the real engine."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.livehost import TOKEN, LiveHost

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


def profile(*args: str) -> dict:
    return {"name": "cpu", "engine": "llamacpp", "args": ["--ctx-size", "512", *args]}


@pytest.fixture(scope="module")
def host(tmp_path_factory, llama_server, served_gguf) -> Iterator[LiveHost]:
    """Module: a live host serving the tiny GGUF as a chat model and as an embedding model."""
    live = LiveHost(tmp_path_factory.mktemp("live") / "state", llama_server)
    try:
        live.start()
        source = served_gguf[0]
        live.add_model({"name": "tiny", "aliases": ["tiny-chat"], "source": source,
                        "profiles": [profile("--threads", "1")]})
        live.add_model({"name": "tiny-embed", "source": source, "routing_profile": "embedding",
                        "profiles": [profile("--threads", "1")]})
        yield live
    finally:
        live.stop()


@pytest.fixture
def client(host) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{host.gateway}/v1", api_key=TOKEN, max_retries=0)


def test_embeddings_create_returns_a_vector_per_input(client) -> None:
    got = client.embeddings.create(model="tiny-embed", input=["hello", "world é"])
    assert [len(d.embedding) for d in got.data] == [64, 64]
    assert got.model == "tiny-embed" and got.data[0].embedding != got.data[1].embedding


def test_models_retrieve_by_alias_with_the_catalog_time(client) -> None:
    got = client.models.retrieve("tiny-chat")
    assert got.id == "tiny-chat" and got.created > 1_600_000_000
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_chat_and_stream_name_the_model_asked_for(client) -> None:
    chat = client.chat.completions.create(model="tiny-chat", max_tokens=4,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "tiny-chat" and chat.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(
        model="tiny", max_tokens=4, stream=True, messages=[{"role": "user", "content": "hi"}]))
    assert chunks and {c.model for c in chunks} == {"tiny"}


def test_a_wrong_key_is_refused_by_the_client(host) -> None:
    bad = openai.OpenAI(base_url=f"{host.gateway}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_an_unknown_route_is_404_in_openai_shape(host) -> None:
    r = httpx.get(f"{host.gateway}/v1/nope", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_metrics_count_requests_by_model_and_carry_engine_metrics_by_replica(host,
                                                                             client) -> None:
    client.chat.completions.create(model="tiny", max_tokens=2,
                                   messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(f"{host.admin}/metrics", timeout=10).status_code == 401
    text = httpx.get(f"{host.admin}/metrics", headers=host.auth, timeout=10).text
    assert 'llmgw_gateway_requests_total{key="server.yaml",model="tiny",status="200"}' in text
    assert 'llmgw_replicas{model="tiny",state="ready"} 1.0' in text
    assert 'llmgw_nodes{state="ready"} 1.0' in text
    engine = [line for line in text.splitlines() if line.startswith("llamacpp:")]
    assert engine and all('replica="' in line and 'node="node-a"' in line for line in engine)
    assert 'llmgw_replica_state_changes_total{' in text


def llmgw(host: LiveHost, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", *args, "--mode=local",
                           f"--state-dir={host.state}"], capture_output=True, text=True,
                          timeout=60)


def test_status_lists_the_ready_replicas_and_logs_shows_the_engine(host) -> None:
    status = llmgw(host, "status")
    assert status.returncode == 0, status.stderr
    rows = [line.split() for line in status.stdout.splitlines()]
    assert ["node-a", "ready", "llamacpp"] == rows[1][:3]
    replicas = {(r[1], r[2], r[3]) for r in rows[3:] if len(r) >= 5}
    assert {("tiny", "node-a", "ready"), ("tiny-embed", "node-a", "ready")} <= replicas
    replica = host.get("/api/v1/replicas?model=tiny")[0]["id"]
    host.until("a log tail", lambda: llmgw(host, "logs", replica, "-n", "500").stdout)
    logs = llmgw(host, "logs", replica, "-n", "500")
    assert logs.returncode == 0 and "llama" in logs.stdout.lower()
