"""GET /api/v1/control-planes and `llmgw status`: every control plane sharing the store,
`scheduling` (with the lease's epoch) for the one holding the scheduler lease unexpired."""

from __future__ import annotations

import json
from pathlib import Path

from llmgw.cli.commands.status import render
from llmgw.control.admin_api import make_admin_app
from llmgw.host import admin_token
from llmgw.store import Store
from tests.cli.test_day2 import llmgw, write_server_yaml
from tests.servers import admin_test_client, serve_asgi


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _two_planes(tmp_path: Path) -> tuple[Store, Clock]:
    clock = Clock()
    store = Store(tmp_path / "control.db", clock=clock)
    store.beat_control_plane("cp-a", "https://a:7443", "http://a:9090", started=990.0)
    store.beat_control_plane("cp-b", "https://b:7443", "http://b:9090", started=995.0)
    assert store.acquire_lease("cp-b", 10) is not None
    return store, clock


_client = admin_test_client


def test_the_lease_holder_is_listed_as_scheduling_with_its_epoch(tmp_path: Path) -> None:
    store, clock = _two_planes(tmp_path)
    client = _client(store, tmp_path)
    listed = client.get("/api/v1/control-planes")
    assert listed.status_code == 200, listed.text
    assert listed.json() == [
        {"id": "cp-a", "agent_url": "https://a:7443", "admin_url": "http://a:9090",
         "started": 990.0, "last_seen": 1000.0, "scheduling": False, "epoch": 0},
        {"id": "cp-b", "agent_url": "https://b:7443", "admin_url": "http://b:9090",
         "started": 995.0, "last_seen": 1000.0, "scheduling": True, "epoch": 1}]
    clock.now = 1010.0  # cp-b's lease lapsed: nobody schedules until another takes it
    assert [p["scheduling"] for p in client.get("/api/v1/control-planes").json()] == [
        False, False]
    assert store.acquire_lease("cp-a", 10) is not None
    assert [(p["scheduling"], p["epoch"]) for p in
            client.get("/api/v1/control-planes").json()] == [(True, 2), (False, 0)]
    store.close()


def test_the_listing_needs_the_admin_token(tmp_path: Path) -> None:
    store, _ = _two_planes(tmp_path)
    client = _client(store, tmp_path)
    assert client.get("/api/v1/control-planes", headers={"Authorization": ""}
                      ).status_code == 401
    assert client.get("/api/v1/control-planes").status_code == 200, "control: with it"
    store.close()


def test_status_renders_which_control_plane_schedules(tmp_path: Path) -> None:
    store, _ = _two_planes(tmp_path)
    views = _client(store, tmp_path).get("/api/v1/control-planes").json()
    text = render([], [], 1003.0, None, views)
    lines = text.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("CONTROL PLANE")))
    assert lines[header + 1].split() == ["cp-a", "-", "http://a:9090", "https://a:7443",
                                         "3s", "ago"]
    assert lines[header + 2].split()[:3] == ["cp-b", "yes", "(epoch"]
    assert "none schedules" not in text and "no control plane holds" not in text
    nobody = render([], [], 1003.0, None, [{**v, "scheduling": False} for v in views])
    assert "!! no control plane holds the scheduler lease" in nobody
    assert "CONTROL PLANE" not in render([], [], 1003.0), "an older control plane: no table"
    store.close()


def test_llmgw_status_shows_the_control_planes_after_what_it_showed(tmp_path: Path) -> None:
    """The node and replica tables stay first (tests/cli/test_day2.py reads them there);
    the control planes come last, and in --json under control_planes."""
    store = Store(tmp_path / "control.db")
    store.record_heartbeat("node-a", {"engines": ["llamacpp"], "gpus": []})
    store.beat_control_plane("cp-a", "https://a:7443", "http://a:9090")
    assert store.acquire_lease("cp-a", 10) is not None
    hash_path = tmp_path / "state" / "etc" / admin_token.HASH_FILE
    with serve_asgi(make_admin_app(store, node_timeout_s=30.0, token_hash=hash_path)) as url:
        write_server_yaml(tmp_path / "state", int(url.rsplit(":", 1)[1]))
        shown = llmgw("status", "--mode=local", f"--state-dir={tmp_path / 'state'}")
        as_json = json.loads(llmgw("status", "--mode=local", "--json",
                                   f"--state-dir={tmp_path / 'state'}").stdout)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split()[:2] == ["NODE", "STATE"]
    assert lines[-2].startswith("CONTROL PLANE") and lines[-1].split()[:3] == [
        "cp-a", "yes", "(epoch"]
    assert [(p["id"], p["scheduling"]) for p in as_json["control_planes"]] == [("cp-a", True)]
    store.close()
