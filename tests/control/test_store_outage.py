"""PostgreSQL stopped under a running control plane and gateway (a real server, restarted by
the test): admin writes are 503 saying the store cannot be reached (never 401), readiness
says so, and the gateway serves from its last table with every key it knew; once the
server is back everything answers again by itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from llmgw.store import Store
from tests.gateway.test_gateway import MODEL, json_answer, ready
from tests.gateway.test_gateway_keys import chat, client, gateway, key
from tests.postgres import PostgresServer
from tests.servers import admin_test_client, scripted_upstream


@pytest.fixture
def pg_store(postgres_server: PostgresServer) -> Iterator[Store]:
    store = Store(postgres_server.create_database())
    store.add_model(MODEL)
    yield store
    store.close()


def test_admin_writes_are_503_while_postgresql_is_away_and_answer_once_it_is_back(
        pg_store: Store, postgres_server: PostgresServer, tmp_path: Path) -> None:
    admin = admin_test_client(pg_store, tmp_path)
    assert admin.get("/healthz").status_code == 200
    assert admin.post("/api/v1/keys", json={"name": "before"}).status_code == 201
    postgres_server.stop()
    try:
        made = admin.post("/api/v1/keys", json={"name": "during"})
        assert made.status_code == 503, made.text
        assert "cannot be reached" in made.json()["detail"] and \
            "nothing was changed" in made.json()["detail"]
        assert made.headers["retry-after"] == "5"
        health = admin.get("/healthz")
        assert health.status_code == 503 and "cannot be reached" in health.json()["detail"]
        anonymous = TestClient(admin.app).post("/api/v1/keys", json={"name": "x"})
        assert anonymous.status_code == 401, "control: a missing token is still refused"
    finally:
        postgres_server.start()
    assert admin.get("/healthz").status_code == 200
    again = admin.post("/api/v1/keys", json={"name": "during"})
    assert again.status_code == 201, again.text
    assert [k["name"] for k in admin.get("/api/v1/keys").json()] == ["before", "during"]


def test_the_gateway_serves_every_known_key_while_postgresql_is_away(
        pg_store: Store, postgres_server: PostgresServer) -> None:
    secret = key(pg_store, name="kept")
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(pg_store, "r1", up.endpoint)
        with gateway(pg_store, flush_s=3600) as url:
            c = client(url, secret)
            assert chat(c).usage.completion_tokens == 5  # the table is read
            postgres_server.stop()
            try:
                for _ in range(5):
                    assert chat(c).usage.completion_tokens == 5
                with pytest.raises(openai.AuthenticationError):  # the control
                    chat(client(url, "sk-llmgw-" + "x" * 40))
            finally:
                postgres_server.start()
            assert chat(c).usage.completion_tokens == 5
