"""`llmgw status`: nodes with their engines and GPUs, models with their state (idle, loading,
serving), replicas with model, node, state and uptime, each host's drift, and the control
planes sharing the store with the one that schedules, as tables like `ollama ps`, or JSON."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from llmgw.cli.commands import _admin
from llmgw.cli.commands._table import ago, table
from llmgw.contract import ReplicaState
from llmgw.contract.records import ControlPlaneView, Gpu, HostDrift, NodeView, PublicReplica
from llmgw.control.client import AdminClient, NotFound


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="what this host runs: nodes and replicas")
    _admin.add_host_options(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with _admin.admin(args) as client:
        try:
            nodes, replicas, drift = client.nodes(), client.replicas(), client.drift()
            planes = _control_planes(client)
            models = client.models()
        except _admin.Error as e:
            if getattr(e, "status", 0) is None:
                raise _admin.unreachable(client, e) from None
            raise
    if args.json:
        print(json.dumps({"nodes": nodes, "models": models, "replicas": replicas,
                          "drift": drift, "control_planes": planes}, indent=2))
    else:
        print(render(nodes, replicas, time.time(), drift, planes, models))
    return 0


def _control_planes(client: AdminClient) -> list[ControlPlaneView] | None:
    """The control planes, or None from one older than the listing (404)."""
    try:
        return client.control_planes()
    except NotFound:
        return None


def render(nodes: list[NodeView], replicas: list[PublicReplica], now: float,
           drift: list[HostDrift] | None = None,
           control_planes: list[ControlPlaneView] | None = None,
           models: Sequence[Mapping[str, Any]] | None = None) -> str:
    node_rows = [[n["id"], n["state"], ",".join(n["engines"]) or "-", _gpus(n["gpus"]),
                  ago(now - n["last_seen"]), n.get("control_plane") or "-"] for n in nodes]
    replica_rows = [[r["id"], r["model"], placed_on(r), r["state"], _uptime(r, now),
                     r["err"][:60]] for r in replicas if r["state"] != ReplicaState.STOPPED]
    # What a person must act on or wait for (a GPU engine being made or failed, a card
    # without its driver), as the agent says it: under the table, one line each.
    warnings = [f"!! {n['id']}: {w}" for n in nodes for w in n.get("warnings", [])]
    return "\n".join([
        # BEATS TO: the control plane (its id, as listed below) that heard the last beat.
        table(["NODE", "STATE", "ENGINES", "GPUS", "LAST SEEN", "BEATS TO"], node_rows,
              "no nodes"),
        *warnings, "",
        *([render_models(models), ""] if models else []),
        table(["REPLICA", "MODEL", "NODE", "STATE", "UPTIME", "ERROR"], replica_rows,
              "no replicas"),
        *held_back_lines(replicas),
        *split_down_lines(replicas, now),
        *(["", render_drift(drift, now)] if drift is not None else []),
        *(["", render_control_planes(control_planes, now)] if control_planes is not None
          else []),
    ])


def render_models(models: Sequence[Mapping[str, Any]]) -> str:
    """Each catalog model with its state (idle, loading, serving) and scaling."""
    rows = [[m["name"], str(m.get("state", "-")),
             f"{m['scaling']['min']}-{m['scaling']['max']}",
             f"{m['scaling'].get('idle_s', 0)} s" if m["scaling"].get("idle_s") else "never"]
            for m in models]
    return table(["MODEL", "STATE", "REPLICAS", "IDLE AFTER"], rows, "no models")


def placed_on(replica: Mapping[str, Any]) -> str:
    """Where a replica runs: its node, or a split one's main node + its workers
    (`node-a + node-b, node-c`); '-' before it is placed."""
    workers = [w["node"] for w in replica.get("workers") or []]
    main = replica.get("node") or "-"
    return f"{main} + {', '.join(workers)}" if workers else main


# How long a split replica stopped for a fault stays said under the table.
SPLIT_DOWN_SHOWN_S = 600.0


def split_down_lines(replicas: list[PublicReplica], now: float) -> list[str]:
    """A `!!` line for each split replica stopped in the last SPLIT_DOWN_SHOWN_S: which
    nodes it was on and why it stopped (a lost worker, a failed share); the scheduler
    places a new one (a new id) where it now fits."""
    return [f"!! {r['model']}: split replica {r['id']} on {placed_on(r)} stopped "
            f"{ago(now - r['updated'])}: {r['err']}" for r in replicas
            if r.get("workers") and r["state"] == ReplicaState.STOPPED
            and now - r["updated"] <= SPLIT_DOWN_SHOWN_S]


def held_back_lines(replicas: list[PublicReplica]) -> list[str]:
    """A `!!` line for each live replica held back from a better profile on a GPU node
    (which card, free against needed, or the card taken, lost, the engine not ready)."""
    return [held_back_line(r) for r in replicas
            if r.get("held_back") and r["state"] != ReplicaState.STOPPED]


def held_back_line(replica: PublicReplica) -> str:
    return (f"!! {replica['model']} runs on {replica['profile']} on {replica['node']} "
            f"(replica {replica['id']}), not a better profile: {replica.get('held_back')}")


def render_control_planes(planes: list[ControlPlaneView], now: float) -> str:
    """One row a control plane sharing the store; SCHEDULES says which one does."""
    rows = [[p["id"], f"yes (epoch {p['epoch']})" if p["scheduling"] else "-",
             p["admin_url"], p["agent_url"], ago(now - p["last_seen"])] for p in planes]
    listed = table(["CONTROL PLANE", "SCHEDULES", "ADMIN", "AGENT API", "LAST SEEN"], rows,
                   "no control plane has beaten its row in the store yet")
    if rows and not any(p["scheduling"] for p in planes):
        listed += ("\n!! no control plane holds the scheduler lease: nothing schedules "
                   "until one takes it (within seconds of a holder's stop)")
    return listed


def render_drift(drift: list[HostDrift], now: float) -> str:
    """Each host's promises that fail (one row each, since when), or that all hold."""
    rows = []
    for report in drift:
        checked = ago(now - report["checked"])
        if not report["failing"]:
            rows.append([report["host"], checked, f"all {report['promises']} hold", "-", ""])
        rows += [[report["host"], checked, f["promise"], ago(now - f["since"]),
                  f["message"][:60]] for f in report["failing"]]
    return table(["HOST", "CHECKED", "DRIFT", "SINCE", "WHY"], rows,
                 "no host reports its checks: `pytest provision/` runs them as llmgw-check "
                 "(left out by --no-check-serve); by hand, `llmgw check --serve HOST:PORT`")


def _gpus(gpus: list[Gpu]) -> str:
    if not gpus:
        return "none (CPU)"
    return ", ".join(f"{g['name']} {g['memory_mb'] // 1024} GB{_free(g)}" for g in gpus)


def _free(gpu: Gpu) -> str:
    """A card's state at the node's last heartbeat: not answering, or its free memory (from
    an agent that reads it at each beat)."""
    if gpu.get("error"):
        return " (not answering NVML)"
    if "memory_used_mb" in gpu:
        return f" ({gpu.get('memory_free_mb', 0) / 1024:.1f} GB free)"
    return ""


def _uptime(replica: PublicReplica, now: float) -> str:
    """How long it has been in its state: the agent reports it only when it changes."""
    updated = replica.get("updated")
    return ago(now - updated, suffix="") if updated else "-"
