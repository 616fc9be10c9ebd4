"""`llmgw status` shows, for each node, the control plane its last heartbeat went to."""

from __future__ import annotations

import time

from llmgw.cli.commands.status import render
from llmgw.contract import NodeState
from llmgw.contract.records import NodeView


def _node(node_id: str, control_plane: str | None) -> NodeView:
    node: NodeView = {"id": node_id, "state": NodeState.READY, "engines": ["llamacpp"],
                      "provision": [], "gpus": [], "labels": {}, "addr": "10.0.0.1",
                      "interface": "eth0", "cpus": 2, "memory_mb": 4096, "warnings": [],
                      "last_seen": time.time()}
    if control_plane is not None:
        node["control_plane"] = control_plane
    return node


def test_each_node_s_row_names_the_control_plane_it_beats_to() -> None:
    shown = render([_node("n1", "cp1-3fa1c29d"), _node("n2", "cp2-9d0e7b11")], [],
                   time.time())
    head, *rows = shown.splitlines()[:3]
    assert head.split()[-2:] == ["BEATS", "TO"], head
    assert rows[0].split()[0] == "n1" and rows[0].split()[-1] == "cp1-3fa1c29d", rows
    assert rows[1].split()[0] == "n2" and rows[1].split()[-1] == "cp2-9d0e7b11", rows
    # Negative control: a node recorded by an older control plane says none, as "-".
    older = render([_node("n3", None)], [], time.time()).splitlines()[1]
    assert older.split()[-1] == "-" and "cp1" not in older, older


def _replica(rid: str, state: str, workers: list[str], err: str = "",
             updated: float = 0.0) -> dict:
    return {"id": rid, "model": "big", "node": "node-a", "profile": "cpu", "state": state,
            "err": err, "endpoint": "", "updated": updated or time.time(), "gpus": [],
            **({"workers": [{"node": w, "layers": 10, "addr": "", "port": 0}
                            for w in workers]} if workers else {})}


def test_a_split_replica_shows_its_main_node_and_workers_and_why_it_stopped() -> None:
    """A split replica's NODE is `main + workers`; one stopped for a lost worker says so
    under the table for ten minutes, with the nodes it was on. The controls: a replica on
    one node shows its node alone, and a split one stopped an hour ago is not said."""
    now = time.time()
    why = "its worker node-c is not ready: llama.cpp's RPC has no failover"
    shown = render([], [_replica("r2", "starting", ["node-b"]),
                        _replica("r1", "stopped", ["node-b", "node-c"], why, now - 30),
                        _replica("r0", "ready", [])], now)
    rows = {line.split()[0]: line for line in shown.splitlines() if line.startswith("r")}
    assert "node-a + node-b " in rows["r2"] and "node-a + node-b," not in rows["r2"]
    assert rows["r0"].split()[2] == "node-a"
    assert "r1" not in rows, "a stopped replica has no row"
    assert f"!! big: split replica r1 on node-a + node-b, node-c stopped 30s ago: {why}" \
        in shown.splitlines(), shown
    old = render([], [_replica("r1", "stopped", ["node-b"], why, now - 3600)], now)
    assert "split replica r1" not in old
