"""Removing a node: its replicas drain, its serial is refused at the handshake, its open
connections close, and its agent stops its engines saying why."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmgw.agent.agent import Agent
from llmgw.agent.client import AgentClient, NodeRemoved
from llmgw.agent.engines.cpu import LlamaCpp
from llmgw.agent.gpus import Discovery
from llmgw.agent.workload import NoReplicas
from llmgw.config import AgentConfig, EngineConfig, TLSFiles
from llmgw.errors import Unreachable


def _tls(cp, cn: str) -> TLSFiles:
    cert, key = cp.client_cert(cn)
    return TLSFiles(ca=str(cp.pki_dir / "ca.pem"), cert=cert, key=key)


def _replica(cp, rid: str, node: str) -> None:
    cp.store.put_replica({"id": rid, "model": "m", "node": node, "profile": "cpu",
                          "state": "ready"})


def test_removal_drains_replicas_and_refuses_the_serial(live_control_plane) -> None:
    cp = live_control_plane
    client = AgentClient(cp.url, _tls(cp, "n2"))
    client.heartbeat({"engines": ["llamacpp"]})
    _replica(cp, "r-1", "n2")
    r = cp.admin.delete("/api/v1/nodes/n2")
    assert r.status_code == 200 and r.json()["revoked"]
    [rep] = cp.store.replicas()
    assert rep["state"] == "stopped" and "n2 was removed" in rep["err"]
    with pytest.raises(NodeRemoved, match="revoked.*Join it again"):
        client.heartbeat({"engines": ["llamacpp"]})
    client.close()
    assert [n["id"] for n in cp.admin.get("/api/v1/nodes").json()] == []


def test_negative_control_another_node_is_still_served(live_control_plane) -> None:
    """Only the removed node's serial is refused: the revocation list is not a wall."""
    cp = live_control_plane
    n2, n3 = AgentClient(cp.url, _tls(cp, "n2")), AgentClient(cp.url, _tls(cp, "n3"))
    n2.heartbeat({}), n3.heartbeat({})
    cp.admin.delete("/api/v1/nodes/n2")
    assert n3.heartbeat({})["node_id"] == "n3"
    n2.close(), n3.close()


def test_removal_closes_the_open_connection(live_control_plane) -> None:
    cp = live_control_plane
    client = AgentClient(cp.url, _tls(cp, "n2"))
    client.heartbeat({})
    assert cp.server.connections() == 1
    cp.admin.delete("/api/v1/nodes/n2")
    deadline = time.monotonic() + 5
    while cp.server.connections() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cp.server.connections() == 0
    client.close()


def test_unknown_node_is_404(live_control_plane) -> None:
    r = live_control_plane.admin.delete("/api/v1/nodes/nope")
    assert r.status_code == 404 and "GET /api/v1/nodes" in r.json()["detail"]


class _Recording(NoReplicas):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list] = []

    def reconcile(self, assignments: list) -> None:
        self.calls.append(list(assignments))


def test_a_removed_agent_stops_its_engines_and_says_why(
    live_control_plane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cp = live_control_plane
    tls = _tls(cp, "n2")
    workload = _Recording()
    agent = Agent(AgentConfig(server=cp.url, node_id="n2", state_dir=str(tmp_path), tls=tls),
                  engine=LlamaCpp(EngineConfig(cache_dir=str(tmp_path))),
                  workload=workload, discover=lambda: Discovery())
    agent.beat()
    assert agent.registered and not agent.removed
    cp.admin.delete("/api/v1/nodes/n2")
    agent.beat()
    agent.client.close()
    assert "revoked" in agent.removed and workload.calls[-1] == []
    assert any("stopping this node's engines" in r.getMessage() for r in caplog.records)


def test_a_network_failure_is_not_taken_for_removal(tmp_path: Path, live_control_plane) -> None:
    """Negative control: a control plane that is away is no reason to stop engines."""
    cp = live_control_plane
    client = AgentClient("https://127.0.0.1:1", _tls(cp, "n2"), timeout=2)
    with pytest.raises(Unreachable) as e:
        client.heartbeat({})
    assert not isinstance(e.value, NodeRemoved)
    client.close()


def test_a_second_removal_in_the_same_second_is_refused_too(live_control_plane) -> None:
    """Each revocation list is strictly newer than the last, so the handshake uses it."""
    cp = live_control_plane
    n2, n3 = AgentClient(cp.url, _tls(cp, "n2")), AgentClient(cp.url, _tls(cp, "n3"))
    n2.heartbeat({}), n3.heartbeat({})
    cp.admin.delete("/api/v1/nodes/n2")
    cp.admin.delete("/api/v1/nodes/n3")
    for client in (n2, n3):
        with pytest.raises(NodeRemoved):
            client.heartbeat({})
        client.close()
