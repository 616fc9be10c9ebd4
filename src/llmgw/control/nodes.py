"""A node's state, derived from its last heartbeat and how long ago that was."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from llmgw.contract import CPU_ENGINE, CUDA_ENGINE, EngineState, NodeState
from llmgw.contract.records import NodeRecord, NodeView

# Kept by the store (which counts silence from it); said here with the rest of a node's state.
from llmgw.store.nodes import ALWAYS_HEARD, Hearing


def silence_s(last_seen: float, now: float, timeout_s: float,
              hearing: Hearing = ALWAYS_HEARD) -> float:
    """How long a node has been silent while someone was listening."""
    if last_seen >= hearing.since or hearing.last_before - last_seen > timeout_s:
        return now - last_seen
    return now - hearing.since


def reported_state(inventory: Mapping[str, Any]) -> NodeState:
    """What the heartbeat says: ready with an engine, provisioning one, or just registered."""
    if inventory.get("engines"):
        return NodeState.READY
    if inventory.get("provision"):
        return NodeState.PROVISIONING
    return NodeState.REGISTERING


def node_view(node: NodeRecord, now: float, timeout_s: float,
              hearing: Hearing = ALWAYS_HEARD) -> NodeView:
    """The admin API's view of a stored node (contract.records.NodeView); the scheduler, the
    metrics and the agent API read the same view. Its lists and dicts are shared by every
    view of the same stored inventory: read them, never change them."""
    inv = node["inventory"]
    silent = silence_s(node["last_seen"], now, timeout_s, hearing) > timeout_s
    return cast(NodeView, {
        **_inventory_view(node["id"], inv),
        "id": node["id"],
        "state": NodeState.NOT_READY if silent else reported_state(inv),
        "last_seen": node["last_seen"],
    })


# The scheduler views every node every second: what a view takes from an inventory is
# made once per inventory the store parsed (it hands the same object until the text
# changes), not once per node and tick.
_VIEWS: dict[str, tuple[Mapping[str, Any], Mapping[str, object]]] = {}


def _inventory_view(node_id: str, inv: Mapping[str, Any]) -> Mapping[str, object]:
    held = _VIEWS.get(node_id)
    if held is not None and held[0] is inv:
        return held[1]
    view = {
        "engines": list(inv.get("engines", [])),
        "provision": list(inv.get("provision", [])),
        "gpus": list(inv.get("gpus", [])),
        "labels": dict(inv.get("labels", {})),
        "addr": inv.get("addr", ""),
        "interface": inv.get("interface", ""),
        "cpus": inv.get("cpus", 0),
        "memory_mb": inv.get("memory_mb", 0),
        "warnings": list(inv.get("warnings", [])),
        "control_plane": inv.get("control_plane", ""),
        "given_up": list(inv.get("given_up", [])),
        "rpc": inv.get("rpc") is True,
        # An older agent says `rpc` alone, of its CPU engine.
        "rpc_engines": list(inv.get("rpc_engines") or
                            ([CPU_ENGINE] if inv.get("rpc") is True else [])),
    }
    if len(_VIEWS) > 2 * _MOST_VIEWS:  # nodes removed long ago: start again
        _VIEWS.clear()
    _VIEWS[node_id] = (inv, view)
    return view


_MOST_VIEWS = 100_000


def gpu_engine_switched_off(node: NodeView) -> bool:
    """Whether the node's last heartbeat says its GPU engine is switched off (engine.cuda:
    off in its agent.yaml): a node that serves on CPU on purpose, whatever GPUs it lists."""
    return any(p.get("engine") == CUDA_ENGINE and p.get("state") == EngineState.SWITCHED_OFF
               for p in node.get("provision") or [])
