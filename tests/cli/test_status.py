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
