"""A control plane restarted under a live agent: its node keeps its state through the
restart and the grace after it, and beats again before the grace runs out."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.fleet.cluster import Agent, ControlPlane

pytestmark = pytest.mark.slow

BEAT_S = 1.0
NODE_TIMEOUT_S = 5.0
DOWN_S = NODE_TIMEOUT_S + 1.5


def _node(cp: ControlPlane) -> dict:
    with cp.admin_client() as admin:
        [node] = admin.nodes()
    return node


def _not_ready_gauge(cp: ControlPlane) -> float:
    with cp.admin_client() as admin:
        text = admin.metrics()
    for line in text.splitlines():
        if line.startswith('llmgw_nodes{state="not_ready"}'):
            return float(line.split()[-1])
    raise AssertionError("no llmgw_nodes{state=\"not_ready\"} in the control plane's /metrics")


def _wait_ready(cp: ControlPlane, agent: Agent, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    node: dict = {}
    while time.monotonic() < deadline:
        with cp.admin_client() as admin:
            nodes = admin.nodes()
        node = nodes[0] if nodes else {}
        if node.get("state") == "ready":
            return node
        time.sleep(0.2)
    raise AssertionError(f"node n1 not ready in {timeout_s:.0f}s; last seen {node}; "
                         f"agent log: {agent.log()[-1500:]}")


def test_a_restart_longer_than_the_node_timeout_leaves_the_node_ready(
    tmp_path: Path, llama_server: str
) -> None:
    cp = ControlPlane(tmp_path / "cp", node_timeout_s=NODE_TIMEOUT_S).start()
    (tmp_path / "node").mkdir()
    agent = Agent(tmp_path / "node", "n1", cp.agent_api, cp.issue("n1", tmp_path / "pki"),
                  llama_server=llama_server, heartbeat_s=BEAT_S)
    try:
        agent.start()
        _wait_ready(cp, agent)
        cp.stop()
        time.sleep(DOWN_S)
        # The agent is held still across the start, so that the first reads below come
        # before its first beat: its retries are drawn, and one can land while the admin
        # API is still coming up.
        assert agent.proc is not None
        agent.proc.send_signal(signal.SIGSTOP)
        try:
            cp.start()
            restarted = time.time()
            first = _node(cp)
            gauges = [_not_ready_gauge(cp)]
        finally:
            agent.proc.send_signal(signal.SIGCONT)
        # The precondition: by its last beat alone, the node would be not_ready now.
        assert restarted - first["last_seen"] > NODE_TIMEOUT_S, first
        seen = [first["state"]]
        while (node := _node(cp))["last_seen"] < restarted:
            assert time.time() - restarted < NODE_TIMEOUT_S, (
                f"n1 did not beat again within the grace ({NODE_TIMEOUT_S:g} s) after the "
                f"restart; states seen {seen}; agent log: {agent.log()[-1500:]}")
            seen.append(node["state"])
            gauges.append(_not_ready_gauge(cp))
            time.sleep(0.1)
        back_s = node["last_seen"] - restarted
        assert set(seen) == {"ready"} and set(gauges) == {0.0}, (seen, gauges, back_s)
        assert node["state"] == "ready"
    finally:
        agent.stop()
        agent.stop_engines()
        cp.stop()
