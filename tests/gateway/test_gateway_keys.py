"""Gateway keys against a real gateway on loopback and the official openai client: 401s,
model lists per key, 429s with Retry-After, revocation within a refresh, usage in the
store and in metrics, and HTTPS with the cluster CA."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.config import ServerConfig
from llmgw.control.admin_api import KeyRequest, create_key
from llmgw.gateway._upstream import Upstream
from llmgw.gateway.app import make_gateway_app
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.host import pki
from llmgw.store import Store
from tests.gateway.test_gateway import CHAT, json_answer, ready, store  # noqa: F401
from tests.servers import scripted_upstream, serve_gateway

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def replica(store: Store) -> Iterator[None]:  # noqa: F811
    """A ready replica of tiny answering 3 prompt and 5 completion tokens."""
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        yield


def key(store: Store, **request: Any) -> str:  # noqa: F811
    """A key made as the admin API makes it; its secret."""
    return create_key(store, KeyRequest(**request))["key"]


@contextmanager
def gateway(store: Store, *, required: bool = True, tokens: list[str] | None = None,  # noqa: F811
            metrics: GatewayMetrics | None = None, flush_s: float = 0.2,
            certfile: str = "", keyfile: str = "") -> Iterator[str]:
    settings = ServerConfig(tokens=tokens or [], gateway_keys="required" if required else "")
    app = make_gateway_app(store, settings, upstream=Upstream(), metrics=metrics,
                           usage_flush_s=flush_s)
    with serve_gateway(app, certfile, keyfile) as url:
        yield url


def client(url: str, api_key: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, **kw)


def chat(c: openai.OpenAI, model: str = "tiny") -> Any:
    return c.chat.completions.create(model=model, messages=HI, max_tokens=4)  # type: ignore[arg-type]


def until(what: str, predicate: Any, timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)
    return value


def test_keys_required_401_without_a_key_and_200_with_one(store, replica) -> None:  # noqa: F811
    secret = key(store, name="owner")
    with gateway(store) as url:
        with pytest.raises(openai.AuthenticationError) as no_key:
            chat(client(url, "unused"))
        answer = chat(client(url, secret))
        listed = [m.id for m in client(url, secret).models.list()]
        anonymous = httpx.get(f"{url}/v1/models")
    assert no_key.value.status_code == 401
    assert answer.choices[0].message.content == "hello" and listed[:2] == ["tiny", "tiny-chat"]
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"]
    assert anonymous.json()["error"]["code"] == "invalid_api_key"


def test_an_open_gateway_still_lets_anyone_in_but_checks_a_key_shaped_credential(
        store, replica) -> None:  # noqa: F811
    with gateway(store, required=False) as url:
        assert chat(client(url, "anything")).choices
        with pytest.raises(openai.AuthenticationError):
            chat(client(url, "sk-llmgw-0123abcd-" + "a" * 43))


@pytest.mark.parametrize("header", [
    "Bearer sk-llmgw-0123abcd-" + "a" * 43, "Bearer sk-llmgw-short", "Bearer Bearer", "Bearer",
    "Basic sk-llmgw-0123abcd-" + "a" * 43, "Bearer \u00e9t\u00e9",
    "Bearer sk-llmgw-0123abcd-" + "a" * 42 + "\u00e9",
])
def test_unknown_malformed_and_non_ascii_keys_are_401_never_naming_other_keys(
        store, replica, header) -> None:  # noqa: F811
    key(store, name="secret-team")
    with gateway(store) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT,
                       headers={"Authorization": header.encode()})
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    stored = store.keys()[0]
    assert "secret-team" not in r.text and stored["prefix"] not in r.text


def test_an_expired_key_is_401_saying_when(store, replica) -> None:  # noqa: F811
    secret = key(store, expires=time.time() + 0.5)
    with gateway(store) as url:
        assert chat(client(url, secret)).choices
        time.sleep(0.6)
        with pytest.raises(openai.AuthenticationError) as err:
            chat(client(url, secret))
    assert "expired at" in str(err.value)


def test_server_yaml_tokens_are_still_accepted_beside_keys(store, replica) -> None:  # noqa: F811
    with gateway(store, tokens=["sk-test-token"]) as url:
        assert chat(client(url, "sk-test-token")).choices
        with pytest.raises(openai.AuthenticationError):
            chat(client(url, "sk-test-tokeN"))


def test_a_model_outside_a_keys_list_is_404_as_if_absent_and_not_listed(
        store, replica) -> None:  # noqa: F811
    narrow = key(store, models=["tiny-chat"])
    with gateway(store) as url:
        c = client(url, narrow)
        assert chat(c, "tiny").choices and chat(c, "tiny-chat").choices
        listed = [m.id for m in c.models.list()]
        hidden = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny-embed", "input": "x"},
                            headers={"Authorization": f"Bearer {narrow}"})
        absent = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny-embex", "input": "x"},
                            headers={"Authorization": f"Bearer {narrow}"})
        one = httpx.get(f"{url}/v1/models/tiny-embed",
                        headers={"Authorization": f"Bearer {narrow}"})
        with pytest.raises(openai.NotFoundError):
            chat(c, "tiny-embed")
    assert listed == ["tiny", "tiny-chat"]
    assert hidden.status_code == absent.status_code == one.status_code == 404
    assert hidden.text == absent.text.replace("tiny-embex", "tiny-embed")


def test_past_its_rpm_a_key_gets_429_in_openai_shape_with_retry_after(store, replica) -> None:  # noqa: F811
    limited, other = key(store, name="slow", rpm=3), key(store, name="free")
    with gateway(store) as url:
        c = client(url, limited)
        for _ in range(3):
            assert chat(c).choices
        with pytest.raises(openai.RateLimitError) as err:
            chat(c)
        assert chat(client(url, other)).choices, "another key has its own limit"
    response = err.value.response
    assert response.status_code == 429 and 55 <= int(response.headers["retry-after"]) <= 60
    assert response.headers["x-ratelimit-limit-requests"] == "3"
    body = response.json()["error"]
    assert body["code"] == "rate_limit_exceeded" and body["type"] == "requests"
    assert "'slow'" in body["message"] and "limit 3" in body["message"]


def test_past_its_tpm_a_key_gets_429_for_tokens(store, replica) -> None:  # noqa: F811
    secret = key(store, tpm=10)  # each answer is 3 + 5 tokens
    with gateway(store) as url:
        c = client(url, secret)
        assert chat(c).choices and chat(c).choices  # 8 spent, so one more goes
        with pytest.raises(openai.RateLimitError) as err:
            chat(c)
    assert err.value.response.json()["error"]["type"] == "tokens"
    assert int(err.value.response.headers["retry-after"]) >= 55


def test_a_revoked_key_is_401_within_one_routing_refresh(store, replica) -> None:  # noqa: F811
    secret = key(store, name="leaving")
    with gateway(store) as url:
        c = client(url, secret)
        assert chat(c).choices
        store.revoke_key("leaving")
        revoked_at = time.monotonic()

        def refused() -> bool:
            try:
                chat(c)
            except openai.AuthenticationError:
                return True
            return False

        until("the revoked key to be refused", refused, 2.0)
        assert time.monotonic() - revoked_at < 1.0  # the router reads the keys every 0.5 s


def test_usage_reaches_the_store_in_batches_and_metrics_count_tokens_per_key(
        store, replica) -> None:  # noqa: F811
    secret = key(store, name="metered")
    registry = CollectorRegistry()
    with gateway(store, metrics=GatewayMetrics(registry)) as url:
        c = client(url, secret)
        for _ in range(3):
            chat(c)
        stored = until("the usage in the store", lambda: next(
            (k for k in store.keys() if k["requests"] == 3), None))
    assert (stored["prompt_tokens"], stored["completion_tokens"]) == (9, 15)
    assert stored["last_used"] > time.time() - 60
    text = generate_latest(registry).decode()
    assert 'llmgw_gateway_tokens_total{key="metered",kind="completion",model="tiny"} 15.0' \
        in text
    assert 'llmgw_gateway_requests_total{key="metered",model="tiny",status="200"} 3.0' in text


def test_usage_waits_in_memory_while_the_store_is_busy(store, replica, tmp_path) -> None:  # noqa: F811
    """Another process holds the write lock past the store's busy timeout: the batch is
    kept, and written once the lock is gone."""
    secret = key(store, name="patient")
    app = make_gateway_app(store, ServerConfig(gateway_keys="required"), upstream=Upstream())
    with serve_gateway(app) as url:
        chat(client(url, secret))
    other = sqlite3.connect(tmp_path / "db.sqlite", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        asyncio.run(app.flush_usage())  # the shutdown flush ran; nothing left, no wait
        app.usage.add(store.keys()[0]["id"], time.time(), 1, 1)
        asyncio.run(app.flush_usage())  # busy past 5 s: kept
        assert app.usage.counts
    finally:
        other.execute("ROLLBACK")
        other.close()
    asyncio.run(app.flush_usage())
    assert not app.usage.counts
    assert store.keys()[0]["requests"] == 2


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A cluster CA and a server certificate for 127.0.0.1 under it, made now."""
    d = tmp_path_factory.mktemp("pki")
    ca = pki.create_ca()
    ca.write(d, "ca")
    pki.issue_server(ca, ["127.0.0.1", "localhost"]).write(d, "server")
    return d / "ca.pem", d / "server.pem", d / "server-key.pem"


def test_over_https_the_client_with_the_ca_bundle_succeeds_and_without_it_fails(
        store, replica, tls_files) -> None:  # noqa: F811
    ca, cert, cert_key = tls_files
    secret = key(store)
    with gateway(store, certfile=str(cert), keyfile=str(cert_key)) as url:
        assert url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=ca)) as trusting:
            assert chat(client(url, secret, http_client=trusting)).choices
        with pytest.raises(openai.APIConnectionError) as err:
            chat(client(url, secret))  # the system's roots do not know the cluster CA
        with pytest.raises(httpx.RemoteProtocolError):  # no plain HTTP beside it
            httpx.get(url.replace("https", "http") + "/healthz")
    assert "CERTIFICATE_VERIFY_FAILED" in repr(err.value.__cause__)


def test_the_admin_api_answers_without_secrets(store) -> None:  # noqa: F811
    made = create_key(store, KeyRequest(name="a", models=["tiny"], rpm=5))
    assert made["key"].startswith(made["prefix"] + "-") and "hash" not in made
    assert json.dumps(store.keys()).count(made["key"]) == 0
