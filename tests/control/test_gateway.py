"""The gateway's own answers: model listing, unknown model, no ready replica, tokens."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from llmgw.control.gateway import make_gateway_app, upstream_client
from llmgw.control.store import Store

MODEL = {"name": "tiny", "aliases": ["tiny-chat"], "source": "http://m/tiny.gguf", "sha256": "",
         "scaling": {"min": 1, "max": 1},
         "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "", "priority": 100,
                       "min_memory_gb": 0, "node_selector": {}, "args": []}]}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def store(tmp_path) -> Store:
    s = Store(tmp_path / "db.sqlite")
    s.add_model(MODEL)
    return s


def gateway(store: Store, tokens: list[str] | None = None,
            transport: httpx.AsyncBaseTransport | None = None) -> TestClient:
    return TestClient(make_gateway_app(store, tokens=tokens or [],
                                       upstream=upstream_client(transport)))


def test_models_lists_names_and_aliases(store) -> None:
    data = gateway(store).get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny", "tiny-chat"]


def test_unknown_model_is_404_in_openai_shape(store) -> None:
    r = gateway(store).post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "nope" in r.json()["error"]["message"]


def test_no_ready_replica_is_503_naming_the_states(store) -> None:
    store.put_replica({"id": "r1", "model": "tiny", "node": "n1", "profile": "cpu",
                       "state": "downloading", "err": ""})
    r = gateway(store).post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert "r1 on n1: downloading" in r.json()["error"]["message"]


def test_wrong_or_missing_token_is_401_and_a_listed_one_passes(store) -> None:
    gw = gateway(store, tokens=["t0ken"])
    assert gw.get("/v1/models").status_code == 401
    wrong = gw.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert gw.get("/v1/models", headers={"Authorization": "Bearer t0ken"}).status_code == 200


def test_alias_routes_with_the_replica_key_which_never_leaves(store) -> None:
    """The upstream sees the replica's own key; the client never does."""
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"message": {"content": "hello"}}],
                                         "model": "whatever"})

    store.put_replica({"id": "r1", "model": "tiny", "node": "n1", "profile": "cpu",
                       "state": "ready", "endpoint": "http://10.9.9.9:1234", "api_key": "k3y"})
    r = gateway(store, transport=httpx.MockTransport(upstream)).post(
        "/v1/chat/completions", json={**CHAT, "model": "tiny-chat"})
    assert r.status_code == 200 and r.json()["model"] == "tiny-chat"
    assert seen[0].headers["authorization"] == "Bearer k3y"
    assert str(seen[0].url) == "http://10.9.9.9:1234/v1/chat/completions"
    assert "k3y" not in r.text


def test_a_dead_replica_is_skipped_for_a_live_one(store) -> None:
    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.port == 1:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"choices": []})

    for rid, port in (("r1", 1), ("r2", 2)):
        store.put_replica({"id": rid, "model": "tiny", "node": "n", "profile": "cpu",
                           "state": "ready", "endpoint": f"http://127.0.0.1:{port}",
                           "api_key": "k"})
    gw = gateway(store, transport=httpx.MockTransport(upstream))
    assert all(gw.post("/v1/completions", json=CHAT).status_code == 200 for _ in range(4))
