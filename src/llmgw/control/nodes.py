"""A node's state, derived from its last heartbeat and how long ago that was."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.contract import NodeState
from llmgw.contract.records import NodeRecord, NodeView


def reported_state(inventory: Mapping[str, Any]) -> NodeState:
    """What the heartbeat says: ready with an engine, provisioning one, or just registered."""
    if inventory.get("engines"):
        return NodeState.READY
    if inventory.get("provision"):
        return NodeState.PROVISIONING
    return NodeState.REGISTERING


def node_view(node: NodeRecord, now: float, timeout_s: float) -> NodeView:
    """The admin API's view of a stored node (DESIGN.md wire contract)."""
    inv = node["inventory"]
    silent = now - node["last_seen"] > timeout_s
    return {
        "id": node["id"],
        "state": NodeState.NOT_READY if silent else reported_state(inv),
        "engines": list(inv.get("engines", [])),
        "provision": list(inv.get("provision", [])),
        "gpus": list(inv.get("gpus", [])),
        "labels": dict(inv.get("labels", {})),
        "addr": inv.get("addr", ""),
        "interface": inv.get("interface", ""),
        "cpus": inv.get("cpus", 0),
        "memory_mb": inv.get("memory_mb", 0),
        "warnings": list(inv.get("warnings", [])),
        "last_seen": node["last_seen"],
    }
