"""Two real nodes on one machine against one real control plane: each has its own state
dir, node name, agent and llama-server; the second gets its identity by joining."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.agent.join import JoinError, join
from llmgw.config import TLSFiles
from llmgw.control.client import AdminClient
from llmgw.host import pki
from tests.fleet.cluster import Agent, ControlPlane

pytestmark = pytest.mark.slow

BEAT_S = 1.0
NODE_TIMEOUT_S = 4.0
ASK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
       "temperature": 0}


def until(what: str, probe: Callable[[], Any], timeout_s: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


@pytest.fixture
def fleet(tmp_path: Path, llama_server: str) -> Iterator[dict[str, Any]]:
    """Function: a control plane, node n1 issued from its CA, node n2 joined with a token."""
    cp = ControlPlane(tmp_path / "a", node_timeout_s=NODE_TIMEOUT_S).start()
    admin = cp.admin_client()
    agents: dict[str, Agent] = {}
    try:
        n1 = Agent(tmp_path / "a" / "node", "n1", cp.agent_api, cp.issue("n1", tmp_path / "a"
                                                                         / "node" / "pki"),
                   llama_server=llama_server, heartbeat_s=BEAT_S)
        b = tmp_path / "b" / "pki"
        b.mkdir(parents=True)
        token = admin.create_token(600)["token"]
        join(cp.agent_api, token, pki.ca_hash(cp.ca.cert), "n2",
             b / "agent-key.pem", b / "agent.pem", b / "ca.pem")
        n2 = Agent(tmp_path / "b", "n2", cp.agent_api,
                   TLSFiles(ca=str(b / "ca.pem"), cert=str(b / "agent.pem"),
                            key=str(b / "agent-key.pem")),
                   llama_server=llama_server, heartbeat_s=BEAT_S)
        agents = {"n1": n1.start(), "n2": n2.start()}
        yield {"cp": cp, "admin": admin, "agents": agents, "token": token, "b": tmp_path / "b"}
    finally:
        for agent in agents.values():
            agent.stop()
            agent.stop_engines()
        admin.close()
        cp.stop()


def _ready_nodes(admin: AdminClient) -> dict[str, list[str]]:
    return {n["id"]: n["engines"] for n in admin.nodes() if n["state"] == "ready"}


def _live(admin: AdminClient) -> list[dict[str, Any]]:
    return [r for r in admin.replicas("tiny") if r["state"] != "stopped"]


def test_two_nodes_serve_a_min_two_model_and_survive_losing_one(
    fleet: dict[str, Any], served_gguf: tuple[str, str]
) -> None:
    admin, cp, agents = fleet["admin"], fleet["cp"], fleet["agents"]
    ready = until("both nodes ready with llamacpp",
                  lambda: len(_ready_nodes(admin)) == 2 and _ready_nodes(admin), 300)
    assert ready == {"n1": ["llamacpp"], "n2": ["llamacpp"]}
    # n2 holds no CA key, and its private key exists only in its own folder.
    assert not list(fleet["b"].rglob("ca-key.pem"))
    assert (fleet["b"] / "pki" / "agent-key.pem").stat().st_mode & 0o777 == 0o600

    source, digest = served_gguf
    admin.add_model({"name": "tiny", "source": source, "sha256": digest,
                     "scaling": {"min": 2, "max": 2},
                     "profiles": [{"name": "cpu", "engine": "llamacpp",
                                   "args": ["--ctx-size", "512", "--threads", "1"]}]})
    serving = until("two ready replicas", lambda: [
        r for r in _live(admin) if r["state"] == "ready"] if len(
        [r for r in _live(admin) if r["state"] == "ready"]) == 2 else None, 120)
    assert {r["node"] for r in serving} == {"n1", "n2"}

    with httpx.Client(base_url=cp.gateway, timeout=30) as gw:
        assert gw.post("/v1/chat/completions", json=ASK).status_code == 200
        agents["n2"].stop()
        agents["n2"].stop_engines()
        stopped = time.monotonic()
        statuses, moved_after = [], None
        # Bounded: at most 400 requests or 60 s, until the lost replica is replaced.
        while len(statuses) < 400 and time.monotonic() - stopped < 60:
            statuses.append(gw.post("/v1/chat/completions", json=ASK).status_code)
            live = _live(admin)
            if moved_after is None and live and all(r["node"] == "n1" for r in live):
                moved_after = time.monotonic() - stopped
            if moved_after is not None and sum(r["state"] == "ready" for r in live) == 2:
                break
            time.sleep(0.05)
    # The first request may meet n2's engine still dying from its SIGTERM (a request in
    # flight at the moment of the stop, which the issue allows); every later one gets 200.
    assert len(statuses) > 1 and set(statuses[1:]) == {200}, \
        f"{len(statuses)} requests: {statuses}"
    assert moved_after is not None, f"n2's replica was not placed elsewhere: {_live(admin)}"
    print(f"\n{len(statuses)} requests after n2 stopped, all 200; its replica was placed "
          f"on n1 {moved_after:.1f}s after the stop (node_timeout_s {NODE_TIMEOUT_S}, "
          f"beat {BEAT_S})")

    # n2 comes back: nothing exceeds scaling.max.
    agents["n2"].start()
    until("n2 ready again", lambda: "n2" in _ready_nodes(admin), 60)
    time.sleep(3 * BEAT_S)
    assert len(_live(admin)) <= 2, _live(admin)


def test_the_same_token_again_is_refused(fleet: dict[str, Any], tmp_path: Path) -> None:
    cp, d = fleet["cp"], tmp_path / "c"
    d.mkdir()
    with pytest.raises(JoinError, match="used by n2"):
        join(cp.agent_api, fleet["token"], pki.ca_hash(cp.ca.cert), "n3",
             d / "k.pem", d / "c.pem", d / "ca.pem")


def test_token_create_prints_the_join_line_last(fleet: dict[str, Any], tmp_path: Path) -> None:
    cp = fleet["cp"]
    out = subprocess.run([sys.executable, "-m", "llmgw", "token", "create", "--ttl", "10m",
                          "--mode", "local", "--state-dir", str(cp.root)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    words = last.split()
    assert words[:4] == ["pytest", "provision/", "--join", cp.agent_api]
    assert words[4] == "--token" and words[6] == "--ca-hash" and len(words) == 8
    assert words[7] == pki.ca_hash(cp.ca.cert)
    d = tmp_path / "n4"
    d.mkdir()
    joined = join(words[3], words[5], words[7], "n4", d / "k.pem", d / "c.pem", d / "ca.pem")
    assert joined.node_id == "n4"


def test_node_rm_removes_a_node(fleet: dict[str, Any]) -> None:
    cp, admin = fleet["cp"], fleet["admin"]
    until("n2 heard from", lambda: any(n["id"] == "n2" for n in admin.nodes()), 60)
    out = subprocess.run([sys.executable, "-m", "llmgw", "node", "rm", "n2", "--mode", "local",
                          "--state-dir", str(cp.root)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "removed n2" in out.stdout, out.stderr
    agent = fleet["agents"]["n2"]
    until("n2's agent to stop", lambda: agent.proc is not None and agent.proc.poll() is not None,
          30)
    assert "revoked" in agent.log() and "stopping this node's engines" in agent.log()
    assert "n2" not in {n["id"] for n in admin.nodes()}
