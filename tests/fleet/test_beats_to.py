"""`llmgw server` records itself, by its id, in each node whose heartbeat it hears: what
`llmgw status` and the fleet page show as the control plane the node beats to."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx

from llmgw.contract import AgentPaths
from tests.fleet.cluster import ControlPlane
from tests.loadgen import until


def test_the_control_plane_that_hears_a_beat_is_recorded_in_the_node(tmp_path: Path) -> None:
    cp = ControlPlane(tmp_path / "cp").start()
    try:
        tls = cp.issue("n1", tmp_path / "n1")
        ctx = ssl.create_default_context(cafile=tls.ca)
        ctx.load_cert_chain(tls.cert, tls.key)
        with httpx.Client(verify=ctx, timeout=30) as node:
            # The body claims another control plane: the one that hears it decides.
            beat = node.post(f"{cp.agent_api}{AgentPaths.HEARTBEAT}",
                             json={"node_id": "n1", "control_plane": "forged"})
        assert beat.status_code == 200, beat.text
        with cp.admin_client() as admin:
            until("the control plane to beat its row", lambda: admin.control_planes(),
                  timeout_s=30, interval_s=0.2)
            [plane] = admin.control_planes()
            [view] = admin.nodes()
        assert plane["agent_url"] == cp.agent_api
        assert view["control_plane"] == plane["id"] != "forged", (view, plane)
    finally:
        cp.stop()
