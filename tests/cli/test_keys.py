"""`llmgw keys create|ls|rm` as processes against a real admin API, the keys they make
tried on a real gateway over the same store."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.config import ServerConfig
from llmgw.control.admin_api import make_admin_app
from llmgw.gateway._upstream import Upstream
from llmgw.gateway.app import make_gateway_app
from llmgw.host import admin_token
from llmgw.store import Store
from tests.cli.test_day2 import MODEL, write_server_yaml
from tests.servers import serve_asgi, serve_gateway


def llmgw(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", *args, "--mode=local",
                           f"--state-dir={state}"], capture_output=True, text=True, timeout=60)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[Path, Store, str]]:
    """Function: a state dir naming a live admin API, and a gateway (keys required) on the
    same store: (state dir, store, gateway URL)."""
    store = Store(tmp_path / "control.db")
    store.add_model(MODEL)
    hash_path = tmp_path / "state" / "etc" / admin_token.HASH_FILE
    gateway = make_gateway_app(store, ServerConfig(gateway_keys="required"), upstream=Upstream())
    with serve_asgi(make_admin_app(store, node_timeout_s=30.0, token_hash=hash_path)) as url, \
            serve_gateway(gateway) as gateway_url:
        write_server_yaml(tmp_path / "state", int(url.rsplit(":", 1)[1]))
        yield tmp_path / "state", store, gateway_url


def models(gateway: str, key: str) -> httpx.Response:
    return httpx.get(f"{gateway}/v1/models", headers={"Authorization": f"Bearer {key}"})


def test_create_prints_the_key_once_and_ls_shows_it_without_secrets(host) -> None:
    state, store, gateway = host
    made = llmgw(state, "keys", "create", "--name", "ci", "--models", "tiny-chat", "--rpm",
                 "60", "--tpm", "1000", "--expires", "30d")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.splitlines()[0]
    assert secret.startswith("sk-llmgw-") and "shown only now" in made.stdout
    assert [m["id"] for m in models(gateway, secret).json()["data"]] == ["tiny", "tiny-chat"]
    listed = llmgw(state, "keys", "ls")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "PREFIX", "MODELS"]
    assert row.split()[:4] == ["ci", secret[:17], "tiny-chat", "60"] and "never" in row
    assert secret[18:] not in listed.stdout and store.keys()[0]["hash"] not in listed.stdout


def test_rm_by_name_or_prefix_and_the_gateway_refuses_the_key_within_a_refresh(host) -> None:
    state, _, gateway = host
    first = llmgw(state, "keys", "create", "--name", "one").stdout.splitlines()[0]
    second = llmgw(state, "keys", "create").stdout.splitlines()[0]
    assert models(gateway, first).status_code == models(gateway, second).status_code == 200
    assert llmgw(state, "keys", "rm", "one").returncode == 0
    gone = llmgw(state, "keys", "rm", second[:17])
    assert gone.returncode == 0 and "revoked key-" in gone.stdout
    time.sleep(0.6)  # the gateway reads its keys every 0.5 s
    assert models(gateway, first).status_code == models(gateway, second).status_code == 401
    again = llmgw(state, "keys", "rm", "one")
    assert again.returncode != 0 and "no live key named 'one'" in again.stderr
    assert "no keys" in llmgw(state, "keys", "ls").stdout


@pytest.mark.parametrize(("args", "said"), [
    (["--models", "nope"], "nope names no model in the catalog"),
    (["--expires", "2001-01-01"], "in the past"),
    (["--expires", "soon"], "is not a date"),
    (["--name", "a b"], "not allowed"),
    (["--rpm", "-1"], "--rpm and --tpm"),
])
def test_create_refuses_what_cannot_work_saying_why(host, args, said) -> None:
    state, store, _ = host
    done = llmgw(state, "keys", "create", *args)
    assert done.returncode != 0 and said in done.stderr, done.stderr
    assert not store.keys()


def test_a_name_is_one_live_keys(host) -> None:
    state, _, _ = host
    assert llmgw(state, "keys", "create", "--name", "x").returncode == 0
    clash = llmgw(state, "keys", "create", "--name", "x")
    assert clash.returncode != 0 and "a key named 'x' exists" in clash.stderr
    assert llmgw(state, "keys", "rm", "x").returncode == 0
    assert llmgw(state, "keys", "create", "--name", "x").returncode == 0


def test_a_viewer_key_reads_the_admin_api_is_refused_writes_and_is_no_gateway_key(
        host) -> None:
    """`keys create --viewer` prints a key that GETs the admin API, is 403 on a write and
    401 at the gateway; `ls --viewer` lists it without the secret; `rm --viewer` ends it."""
    state, store, gateway = host
    made = llmgw(state, "keys", "create", "--viewer", "--name", "ops")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.splitlines()[0]
    assert secret.startswith("vk-llmgw-") and "changes nothing" in made.stdout
    admin_url = f"http://127.0.0.1:{yaml_admin_port(state)}"
    as_viewer = {"Authorization": f"Bearer {secret}"}
    assert httpx.get(f"{admin_url}/api/v1/models", headers=as_viewer).status_code == 200
    write = httpx.post(f"{admin_url}/api/v1/keys", headers=as_viewer, json={"name": "x"})
    assert write.status_code == 403 and "only reads" in write.json()["detail"]
    assert models(gateway, secret).status_code == 401
    listed = llmgw(state, "keys", "ls", "--viewer")
    assert listed.returncode == 0 and "ops" in listed.stdout and secret not in listed.stdout
    assert "ops" not in llmgw(state, "keys", "ls").stdout
    gone = llmgw(state, "keys", "rm", "--viewer", "ops")
    assert gone.returncode == 0, gone.stderr
    assert httpx.get(f"{admin_url}/api/v1/models", headers=as_viewer).status_code == 401


def test_a_viewer_key_takes_no_gateway_limits(host) -> None:
    state, _, _ = host
    refused = llmgw(state, "keys", "create", "--viewer", "--rpm", "5")
    assert refused.returncode != 0 and "--rpm limit a gateway key" in refused.stderr


def test_a_viewer_key_takes_expires_as_a_gateway_key_does_and_ls_shows_it(host) -> None:
    """`keys create --viewer --expires` parses the date as a gateway key's (through that
    day, UTC) and `ls --viewer` shows it. (The control: a viewer key without it, never.)"""
    state, store, _ = host
    made = llmgw(state, "keys", "create", "--viewer", "--name", "ops", "--expires", "2099-01-31")
    assert made.returncode == 0, made.stderr
    assert "expires 2099-02-01 00:00 UTC" in made.stdout
    assert llmgw(state, "keys", "create", "--viewer", "--name", "always").returncode == 0
    listed = llmgw(state, "keys", "ls", "--viewer")
    assert listed.returncode == 0, listed.stderr
    header, ops, always = listed.stdout.splitlines()
    assert header.split() == ["NAME", "PREFIX", "MADE", "EXPIRES"]
    assert ops.startswith("ops ") and ops.endswith("2099-02-01 00:00 UTC")
    assert always.startswith("always ") and always.endswith("never")
    for wrong, said in (("2001-01-01", "in the past"), ("soon", "is not a date")):
        refused = llmgw(state, "keys", "create", "--viewer", "--expires", wrong)
        assert refused.returncode != 0 and said in refused.stderr, refused.stderr
    assert len(store.viewers()) == 2


def yaml_admin_port(state: Path) -> int:
    import yaml

    config = yaml.safe_load((state / "etc" / "server.yaml").read_text())
    return int(config["admin_listen"].rsplit(":", 1)[1])
