"""Scheduling: keep each catalog model's `scaling.min` replicas on nodes that fit, on
specific GPUs where a GPU profile fits, and move a replica onto a better profile (a node's
GPU engine became ready) by starting the new one before stopping the old. A GPU placement
its node gave up on is stopped and the model placed on its next profile; GPU replicas go
only to cards that passed the GPU engine's check.

`plan` is pure (catalog, nodes, replicas in; changes out) so it is tested without
processes; `Scheduler` applies a plan to the store, in one transaction fenced by the
scheduler lease when several control planes share the store.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from llmgw.contract import (
    CPU_ENGINE,
    CUDA_ENGINE,
    GIVE_UP_FREE_GROWTH_MB,
    LIVE_REPLICA_STATES,
    NodeState,
    ReplicaState,
)
from llmgw.contract.catalog import cards_wanted, nodes_wanted
from llmgw.contract.records import (
    GivenUp,
    Gpu,
    ModelSpec,
    NodeView,
    ProfileSpec,
    ReplicaRecord,
    SplitWorker,
)
from llmgw.control import _cards, _demand, _split
from llmgw.control._cards import card_name as _card_name
from llmgw.control._cards import free_bytes as _free_bytes
from llmgw.control.nodes import gpu_engine_switched_off, node_view
from llmgw.model import kv_sizing
from llmgw.store import Lease, Store, Use

log = logging.getLogger("llmgw.scheduler")

# How long a stopped replica stays listed, so a person can still see why it stopped.
KEEP_STOPPED_S = 3600.0
MIB = kv_sizing.MIB
GIB = kv_sizing.GIB


@dataclass
class Plan:
    """What to change: replicas to add, replicas to stop (id → why), unplaced models' reasons."""

    add: list[ReplicaRecord] = field(default_factory=list)
    stop: dict[str, str] = field(default_factory=dict)
    # unplaced id → (node, profile, the GPUs it gets)
    place: dict[str, tuple[str, str, list[str]]] = field(default_factory=dict)
    # placed id → its workers, where place puts it over several nodes (node: its main)
    split: dict[str, list[SplitWorker]] = field(default_factory=dict)
    waiting: dict[str, str] = field(default_factory=dict)  # unplaced id → why
    # Replicas stopped to give memory back: idle, or to make room for a model requests wait
    # for (each also in stop).
    evicted: list[_demand.Eviction] = field(default_factory=list)


@dataclass(frozen=True)
class Placement:
    """Where a replica goes: node, profile and its GPUs (NVML UUIDs), or why it cannot.
    Split over nodes: node is its main node, workers the others with their layers."""

    node: str = ""
    profile: str = ""
    gpus: list[str] = field(default_factory=list)
    why: str = ""
    workers: list[SplitWorker] = field(default_factory=list)


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def needed_engine(profile: ProfileSpec) -> str:
    """The engine a profile runs on: a GPU profile needs llama.cpp built with CUDA."""
    if profile["gpu_class"] and profile["engine"] == CPU_ENGINE:
        return CUDA_ENGINE
    return profile["engine"]


# --- what a model takes on a GPU ---
# One formula, llmgw.model.kv_sizing's: the agent sizes a GPU replica's slots by it, and a card
# fits a model when it gives the model at least one slot.


def need(model: ModelSpec, profile: ProfileSpec, free: int) -> kv_sizing.Sizing | None:
    """How a replica of profile is sized on a card with `free` bytes (kv_sizing.size);
    None when the model's size or geometry is unknown (it is placed by min_memory_gb)."""
    if not model["size_bytes"]:
        return None
    return kv_sizing.size(model["geometry"], model["size_bytes"], free, profile["args"])


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


# --- where a profile can run ---


@dataclass
class _Used:
    """What a node's live replicas take: GPUs (by UUID, and by class for replicas placed
    before GPUs were assigned by UUID), and memory (MB) of CPU profiles."""

    uuids: set[str] = field(default_factory=set)
    by_class: dict[str, int] = field(default_factory=dict)
    memory_mb: float = 0.0
    # Which replica holds each card (uuid -> "replica r-1 of m"): its memory is its own.
    holders: dict[str, str] = field(default_factory=dict)


def _why_not(profile: ProfileSpec, node: NodeView, used: _Used,
             model: ModelSpec | None = None) -> str:
    """Why profile cannot run on node now for a reason other than its GPUs, or ''."""
    if node["state"] != NodeState.READY:
        return f"{node['id']} is {node['state']}"
    engine = needed_engine(profile)
    if engine not in node["engines"]:
        if engine == CUDA_ENGINE and gpu_engine_switched_off(node):
            # Never "not ready": nothing is being made, and nothing will be.
            return (f"{node['id']}'s GPU engine ({CUDA_ENGINE}) is switched off (engine.cuda: "
                    "off in its agent.yaml), so it serves on CPU")
        if engine == CUDA_ENGINE and node["gpus"]:
            return f"{node['id']}'s GPU engine ({CUDA_ENGINE}) is not ready"
        return f"{node['id']} has no {engine} engine"
    if not _labels_match(profile["node_selector"], node["labels"]):
        wanted = ", ".join(f"{k}={v}" for k, v in profile["node_selector"].items())
        return f"{node['id']} lacks the label {wanted}"
    need_mb = profile["min_memory_gb"] * 1024
    if not profile["gpu_class"] and node.get("memory_mb", 0) - used.memory_mb < need_mb:
        return f"{node['id']} has under {profile['min_memory_gb']} GB of memory free"
    whole = cpu_need_mb(model, profile) if model is not None else need_mb
    if not profile["gpu_class"] and node.get("memory_mb", 0) - used.memory_mb < whole:
        return (f"{node['id']} has {_gib((node.get('memory_mb', 0) - used.memory_mb) * MIB)} "
                f"of memory free and {model['name'] if model else 'it'} needs "
                f"{_gib(whole * MIB)} on one node")
    return ""


def cpu_need_mb(model: ModelSpec, profile: ProfileSpec) -> float:
    """The memory (MB) a CPU replica holds on its node: the profile's min_memory_gb; for a
    profile that may split over nodes, what the whole model takes (split_need) when more."""
    floor = profile["min_memory_gb"] * 1024
    if nodes_wanted(profile) < 2:
        return floor
    return max(floor, split_need(model, profile) / MIB)


def _free_cards(profile: ProfileSpec, node: NodeView, used: _Used) -> list[Gpu]:
    """The node's cards of the profile's class that answer NVML and that no live replica
    holds, in order (a MIG instance is a card of its own: one process each)."""
    cards = [g for g in node["gpus"] if g.get("class") == profile["gpu_class"]
             and g.get("uuid") not in used.uuids and not g.get("error")]
    return cards[used.by_class.get(profile["gpu_class"], 0):]


def _no_free_card(profile: ProfileSpec, node: NodeView, used: _Used) -> str:
    """Why no card of the profile's class is free on node: each one taken (by which
    replica) or lost (NVML's words), or none there."""
    mine = [g for g in node["gpus"] if g.get("class") == profile["gpu_class"]]
    if not mine:
        return f"{node['id']} has no {profile['gpu_class']} GPU"
    states = [_card_state(g, used) for g in mine]
    return f"{node['id']} has no free {profile['gpu_class']} GPU: {'; '.join(states)}"


def _card_state(card: Gpu, used: _Used) -> str:
    uuid = str(card.get("uuid"))
    if card.get("error"):
        return f"{_card_name(card)} stopped answering NVML ({card['error']})"
    if uuid in used.uuids and uuid not in used.holders:
        return f"{_card_name(card)} is held back"
    return f"{_card_name(card)} is taken by {used.holders.get(uuid, 'a replica')}"


def _gpus_for(model: ModelSpec, profile: ProfileSpec, node: NodeView,
              used: _Used) -> tuple[list[str], str]:
    """(the UUIDs of the free cards the model fits on, '') or ([], why none): one card
    when one holds it, else the fewest the profile's gpus allows (control._cards)."""
    gpus, why = _one_card(model, profile, node, used)
    # A profile's own --tensor-split names one proportion a card: it takes that many.
    own = len(kv_sizing.tensor_split(profile["args"]))
    if (gpus and own < 2) or cards_wanted(profile) < 2:
        return gpus, why
    free = _free_cards(profile, node, used)
    cards = [g for g in free if g.get("memory_mb", 0) >= profile["min_memory_gb"] * 1024]
    if len(cards) < max(own, 2):
        return [], why or (f"{node['id']} has {len(cards)} free {profile['gpu_class']} "
                           f"GPU(s), and {profile['name']}'s --tensor-split names {own}")
    others = [_card_state(g, used) for g in node["gpus"] if g.get("class") ==
              profile["gpu_class"] and not any(g is c for c in free)]
    split, too_small = _cards.fit(model, profile, node["id"], cards, others)
    return (split, "") if split else ([], too_small)


def _one_card(model: ModelSpec, profile: ProfileSpec, node: NodeView,
              used: _Used) -> tuple[list[str], str]:
    """(the UUIDs of one free card the model fits on, '') or ([], why none). A card fits
    when, by its free memory at the node's last heartbeat, the model gets at least one
    slot there (kv_sizing)."""
    cards = _free_cards(profile, node, used)
    if not cards:
        return [], _no_free_card(profile, node, used)
    if any(g.get("memory_mb", 0) < profile["min_memory_gb"] * 1024 for g in cards):
        cards = [g for g in cards if g.get("memory_mb", 0) >= profile["min_memory_gb"] * 1024]
        if not cards:
            return [], (f"{node['id']}'s {profile['gpu_class']} has under "
                        f"{profile['min_memory_gb']} GB")
    sizings = [(g, need(model, profile, _free_bytes(g))) for g in cards]
    fits = [g for g, sizing in sizings if sizing is None or sizing.fits()]
    if fits:
        return [str(fits[0].get("uuid", ""))], ""
    roomiest, sizing = max(sizings, key=lambda pair: _free_bytes(pair[0]))
    assert sizing is not None
    used_mb = roomiest.get("memory_used_mb")
    others = f", {_gib(used_mb * MIB)} used by other processes" if used_mb else ""
    return [], (f"node {node['id']}'s GPU {_card_name(roomiest)} has "
                f"{_gib(_free_bytes(roomiest))} free{others}; {model['name']} needs "
                f"{_gib(sizing.total)}: {sizing.explain()}")


# --- cards held back: failed the GPU engine's check, or given up for this model ---


def _checked_cards(node: NodeView) -> set[str] | None:
    """The UUIDs that passed the node's GPU engine check (None from an agent that does not
    say: every card)."""
    entry = next((p for p in node.get("provision") or [] if p.get("engine") == CUDA_ENGINE),
                 None)
    return None if entry is None or "gpus" not in entry else set(entry["gpus"])


def _grown(entry: GivenUp, uuid: str, node: NodeView) -> bool:
    """Whether the card's free memory grew by GIVE_UP_FREE_GROWTH_MB since it was given up."""
    was = (entry.get("free_mb") or {}).get(uuid)
    card = next((g for g in node["gpus"] if g.get("uuid") == uuid), None)
    return was is not None and card is not None and \
        _free_bytes(card) // MIB - was >= GIVE_UP_FREE_GROWTH_MB


def _held_back(model: ModelSpec, profile: ProfileSpec, node: NodeView) -> dict[str, str]:
    """The node's cards a replica of model on profile may not have now (UUID -> why): those
    the GPU engine's check left out, and those the node gave up this placement on (until
    it stops reporting that, or the card's free memory has grown)."""
    held: dict[str, str] = {}
    passed = _checked_cards(node)
    for g in node["gpus"]:
        uuid = str(g.get("uuid", ""))
        if passed is not None and g.get("class") == profile["gpu_class"] and uuid not in passed:
            held[uuid] = f"GPU {uuid} failed the GPU engine's check"
    for entry in node.get("given_up") or []:
        if entry.get("model") != model["name"] or entry.get("profile") != profile["name"]:
            continue
        for uuid in entry.get("gpus") or []:
            if not _grown(entry, uuid, node):
                held.setdefault(uuid, f"{node['id']} gave up on GPU {uuid} after "
                                      f"{entry.get('starts', 0)} failed starts: "
                                      f"{entry.get('reason', '')}")
    return held


def given_up(replica: ReplicaRecord, node: NodeView | None) -> GivenUp | None:
    """The node's report that it gave this replica up, or None."""
    entries = node.get("given_up") or [] if node is not None else []
    return next((e for e in entries if e.get("replica") == replica["id"]), None)


def _usage(node_id: str, replicas: list[ReplicaRecord], models: dict[str, ModelSpec]) -> _Used:
    used = _Used()
    for r in replicas:
        workers = r.get("workers")
        if r["state"] not in LIVE_REPLICA_STATES or (
                r["node"] != node_id and not any(w["node"] == node_id for w in workers or ())):
            continue
        model = models.get(r["model"])
        profile = _profile(model, r["profile"])
        if profile is None or model is None:
            continue
        if workers and profile["gpu_class"]:
            # A GPU split holds every card it lists, on its main node and on each worker.
            cards = split_cards(r, node_id)
            used.uuids.update(cards)
            used.holders.update({u: f"split replica {r['id']} of {r['model']}" for u in cards})
        elif workers:
            # A split replica holds its share on each node it uses, main and workers.
            used.memory_mb += _split_shares(r, model, profile).get(node_id, 0) / MIB
        elif profile["gpu_class"] and r.get("gpus"):
            used.uuids.update(r.get("gpus") or [])
            used.holders.update({u: f"replica {r['id']} of {r['model']}"
                                 for u in r.get("gpus") or []})
        elif profile["gpu_class"]:
            used.by_class[profile["gpu_class"]] = used.by_class.get(profile["gpu_class"], 0) + 1
        else:
            used.memory_mb += cpu_need_mb(model, profile)
    return used


def _profile(model: ModelSpec | None, name: str) -> ProfileSpec | None:
    if model is None:
        return None
    return next((p for p in model["profiles"] if p["name"] == name), None)


def _priority(model: ModelSpec, replica: ReplicaRecord) -> int:
    profile = _profile(model, replica["profile"])
    return profile["priority"] if profile else -1


def place(
    model: ModelSpec, nodes: list[NodeView], replicas: list[ReplicaRecord],
    models: dict[str, ModelSpec],
) -> Placement:
    """The best fit (node, profile, GPUs), or a Placement saying why none fits."""
    hosting = {r["node"] for r in replicas
               if r["model"] == model["name"] and r["state"] in LIVE_REPLICA_STATES}
    reasons: list[str] = []
    for profile in sorted(model["profiles"], key=lambda p: -p["priority"]):
        # Spread: nodes without a replica of this model first.
        for node in sorted(nodes, key=lambda n: (n["id"] in hosting, n["id"])):
            used = _usage(node["id"], replicas, models)
            why = _why_not(profile, node, used, model)
            gpus: list[str] = []
            if not why and profile["gpu_class"]:
                held = _held_back(model, profile, node)
                gpus, why = _gpus_for(model, profile, node, _Used(
                    used.uuids | set(held), used.by_class, used.memory_mb, used.holders))
                if why and held:
                    why += " (" + "; ".join(held.values()) + ")"
            if not why:
                return Placement(node["id"], profile["name"], gpus)
            reasons.append(f"{profile['name']}: {why}")
    if not nodes:
        return Placement(why="no node has joined this control plane yet")
    split, why = _place_split(model, nodes, replicas, models)
    if split is not None:
        return split
    return Placement(why="no ready node fits any profile (" + "; ".join(reasons) + ")"
                     + (f"; split over nodes: {why}" if why else ""))


# --- one replica over several nodes (control/_split.py places it) ---


def split_need(model: ModelSpec, profile: ProfileSpec) -> int:
    """The bytes a replica split over nodes takes in all (on CPU or cards): its weights,
    the KV cache of its whole context (the profile's --ctx-size, else the model's) and a
    batch's compute buffer; at least the profile's min_memory_gb. Each node keeps
    _split.RESERVE_BYTES besides (a GPU node, each of its cards)."""
    floor = int(profile["min_memory_gb"] * GIB)
    geometry, args = model["geometry"], profile["args"]
    given = kv_sizing.arg_value(args, kv_sizing.CTX_FLAGS)
    ctx = (int(given) if given.isdigit() else 0) or geometry.get("context_length", 0) \
        or kv_sizing.DEFAULT_CTX_PER_SLOT
    kv = int(kv_sizing.kv_bytes_per_token(geometry, args) * ctx)
    total = model["size_bytes"] + kv + kv_sizing.compute_bytes(geometry, ctx, args)
    return max(floor, total if model["size_bytes"] else 0)


def _split_shares(replica: ReplicaRecord, model: ModelSpec,
                  profile: ProfileSpec) -> dict[str, int]:
    """The bytes a split replica holds on each of its nodes: its need, shared by layers
    (the main node holds the layers its workers do not)."""
    workers = replica.get("workers") or []
    layers = max(model["geometry"].get("block_count", 0), 1)
    need = split_need(model, profile)
    held = sum(w["layers"] for w in workers)
    shares = {w["node"]: need * w["layers"] // layers for w in workers}
    shares[replica["node"]] = need * max(layers - held, 0) // layers
    return shares


def split_cards(replica: ReplicaRecord, node_id: str) -> list[str]:
    """The cards (UUIDs) a split replica holds on node_id: its own gpus on its main node,
    the worker's entry's on a worker; none on another node."""
    if replica["node"] == node_id:
        return list(replica.get("gpus") or [])
    return [u for w in replica.get("workers") or [] if w["node"] == node_id
            for u in w.get("gpus") or []]


def split_nodes(replica: ReplicaRecord) -> list[str]:
    """The nodes a replica runs on: its node (a split one's main) and then its workers."""
    return [replica["node"], *(w["node"] for w in replica.get("workers") or [])]


def _place_split(model: ModelSpec, nodes: list[NodeView], replicas: list[ReplicaRecord],
                 models: dict[str, ModelSpec]) -> tuple[Placement | None, str]:
    """The model over several nodes on its best profile that allows it (nodes > 1), when
    no single node holds it; (None, why not) for each profile that allows it, or '' for
    a model none of whose profiles does."""
    reasons: list[str] = []
    for profile in sorted(model["profiles"], key=lambda p: -p["priority"]):
        if nodes_wanted(profile) < 2:
            continue
        where, why = _split_on(model, profile, nodes, replicas, models)
        if where is not None:
            return where, ""
        reasons.append(f"{profile['name']}: {why}")
    return None, "; ".join(reasons)


def _split_on(model: ModelSpec, profile: ProfileSpec, nodes: list[NodeView],
              replicas: list[ReplicaRecord],
              models: dict[str, ModelSpec]) -> tuple[Placement | None, str]:
    layers = model["geometry"].get("block_count", 0)
    if not model["size_bytes"] or not layers:
        return None, (f"{model['name']}'s size and layer count were not read from its GGUF "
                      "header, so its layers cannot be shared out")
    gpu = bool(profile["gpu_class"])
    engine = CUDA_ENGINE if gpu else CPU_ENGINE
    able = [n for n in nodes if engine in (n.get("rpc_engines") or [])
            and n["state"] == NodeState.READY]
    if not able:
        return None, (f"no ready node's {'GPU' if gpu else 'CPU'} engine ({engine}) has "
                      "llama.cpp's RPC backend (the source build has it, GGML_RPC=ON: "
                      "engine.prebuilt: off in its agent.yaml; a GPU engine built before it "
                      "had it is rebuilt once its cache folder is removed)")
    candidates: list[_split.Candidate] = []
    cards: dict[str, list[Gpu]] = {}
    said: list[str] = []
    others: dict[str, list[str]] = {}
    for node in able:
        used = _usage(node["id"], replicas, models)
        others[node["id"]] = [_card_state(g, used) for g in node["gpus"]
                              if g.get("class") == profile["gpu_class"]
                              and str(g.get("uuid")) in used.uuids]
        if (why := _why_not({**profile, "min_memory_gb": 0}, node, used)):
            said.append(why)
            continue
        if gpu:
            cards[node["id"]], why = _split_cards(model, profile, node, used)
            if why:
                said.append(why)
                continue
            candidates.append(_split.Candidate(node["id"], _cards_give(cards[node["id"]])))
            continue
        free = int((node.get("memory_mb", 0) - used.memory_mb) * MIB)
        candidates.append(_split.Candidate(node["id"], free))
    if len(candidates) < 2:
        return None, (f"{len(candidates)} ready node(s) with llama.cpp's RPC backend take "
                      f"{profile['name']} (its engine, its node_selector"
                      f"{', a free ' + profile['gpu_class'] + ' GPU' if gpu else ''}); a "
                      f"split needs 2" + (f" ({'; '.join(said)})" if said else ""))
    found = _split.place_split(split_need(model, profile), layers, candidates,
                               nodes_wanted(profile), 0 if gpu else _split.RESERVE_BYTES)
    if not found.main:
        if gpu:
            said += [_cards_said(node, cards[node], others[node]) for node in sorted(cards)]
        return None, found.why + (f" ({'; '.join(said)})" if gpu else "")
    mine = {n: [str(g.get("uuid", "")) for g in c] for n, c in cards.items()}
    devices = sum(len(mine[n]) if gpu else 1 for n in found.nodes)
    if devices > _split.MAX_DEVICES:
        return None, (f"over {len(found.nodes)} nodes it takes {devices} cards, and llama.cpp "
                      f"splits one model over at most {_split.MAX_DEVICES} devices (its "
                      "--tensor-split): give the profile fewer gpus a node, or larger cards")
    workers: list[SplitWorker] = []
    for n, k in found.workers:
        worker: SplitWorker = {"node": n, "layers": k, "addr": "", "port": 0}
        if gpu:
            worker["gpus"] = mine[n]
        workers.append(worker)
    return Placement(found.main, profile["name"], mine.get(found.main, []),
                     workers=workers), ""


def _split_cards(model: ModelSpec, profile: ProfileSpec, node: NodeView,
                 used: _Used) -> tuple[list[Gpu], str]:
    """(the cards node gives a GPU replica split over nodes, '') or ([], why none): its
    free cards of the profile's class, less those held back (the GPU engine's check, a
    give-up) and those under min_memory_gb, the roomiest up to the profile's gpus
    (control._cards' rules)."""
    held = _held_back(model, profile, node)
    free = _free_cards(profile, node, _Used(used.uuids | set(held), used.by_class,
                                            used.memory_mb, used.holders))
    big = [g for g in free if g.get("memory_mb", 0) >= profile["min_memory_gb"] * 1024]
    if not big:
        why = _no_free_card(profile, node, used) if not free else (
            f"{node['id']}'s free {profile['gpu_class']} GPUs have under "
            f"{profile['min_memory_gb']} GB")
        return [], why + (" (" + "; ".join(held.values()) + ")" if held else "")
    return _cards.roomiest(big, min(cards_wanted(profile), len(big))), ""


def _cards_give(cards: list[Gpu]) -> int:
    """What a node's cards give a replica split over nodes: the node's layers are shared
    evenly over its cards, so each gives what the least free of them has, less
    _split.RESERVE_BYTES (CUDA's context and the card's compute buffer)."""
    least = min(_free_bytes(g) for g in cards)
    return len(cards) * max(least - _split.RESERVE_BYTES, 0)


def _cards_said(node_id: str, cards: list[Gpu], others: list[str]) -> str:
    """A node's cards as a split weighed them: each card's free memory, what they give, and
    its cards of the class a replica holds."""
    each = ", ".join(f"{_card_name(g)} {_gib(_free_bytes(g))} free" for g in cards)
    held = f"; not free: {', '.join(others)}" if others else ""
    return (f"{node_id}: {each}; {len(cards)} card(s) give {_gib(_cards_give(cards))} "
            f"(the least free of them each, less {_gib(_split.RESERVE_BYTES)} a card){held}")


def held_back(replica: ReplicaRecord, models: dict[str, ModelSpec], nodes: list[NodeView],
              replicas: list[ReplicaRecord]) -> str:
    """Why a live replica runs on its profile and not on a better one of its model on its
    node: for each better profile, why the node does not take it now (its card too full,
    taken, lost, its GPU engine not ready); '' on its best profile, where a better one
    fits (the move is due), or on a node without GPUs."""
    model = models.get(replica["model"])
    node = next((n for n in nodes if n["id"] == replica["node"]), None)
    if model is None or node is None or not node["gpus"] \
            or replica["state"] not in LIVE_REPLICA_STATES:
        return ""
    mine = _priority(model, replica)
    used = _usage(node["id"], replicas, models)
    reasons: list[str] = []
    for profile in sorted(model["profiles"], key=lambda p: -p["priority"]):
        if profile["priority"] <= mine:
            break
        why = _why_not(profile, node, used)
        if not why and profile["gpu_class"]:
            why = _gpus_for(model, profile, node, used)[1]
        if not why:
            return ""
        reasons.append(f"{profile['name']}: {why}")
    return "; ".join(reasons)


def _new_replica(model: ModelSpec, where: Placement) -> ReplicaRecord:
    new: ReplicaRecord = {"id": "r-" + secrets.token_hex(4), "model": model["name"],
                          "node": where.node, "profile": where.profile,
                          "state": ReplicaState.PENDING, "err": where.why, "gpus": where.gpus}
    if where.workers:
        new["workers"] = where.workers
    return new


def _moving(model: ModelSpec, mine: list[ReplicaRecord]) -> bool:
    """Whether a move is under way: a replica on a better profile than a ready one, not
    ready itself yet (the one it replaces serves until it is)."""
    ready = [_priority(model, r) for r in mine if r["state"] == ReplicaState.READY]
    return bool(ready) and any(r["state"] != ReplicaState.READY
                               and _priority(model, r) > min(ready) for r in mine)


def _surplus(model: ModelSpec, mine: list[ReplicaRecord], result: Plan) -> list[ReplicaRecord]:
    """Stop what is over scaling.max, worst first (lowest priority, then not ready); one
    over is kept while a move is under way."""
    limit = model["scaling"]["max"]
    if len(mine) == limit + 1 and _moving(model, mine):
        return mine
    # Stable over the newest first: of equals, the last placed goes.
    worst_first = sorted(reversed(mine), key=lambda r: (_priority(model, r),
                                                        r["state"] == ReplicaState.READY))
    best = worst_first[-1] if worst_first else None
    for r in worst_first[: max(len(mine) - limit, 0)]:
        moved = best is not None and _priority(model, best) > _priority(model, r)
        result.stop[r["id"]] = (
            f"moved to {best['profile']} on {best['node']} (replica {best['id']} is ready)"
            if moved and best is not None
            else f"{model['name']} has more than scaling.max replicas")
    return [r for r in mine if r["id"] not in result.stop]


def _move(model: ModelSpec, mine: list[ReplicaRecord], nodes: list[NodeView],
          everyone: list[ReplicaRecord], models: dict[str, ModelSpec]) -> ReplicaRecord | None:
    """A replica on a better profile than the worst of a model's ready replicas, when one
    now fits (a node's GPU engine became ready): it starts beside the one it replaces."""
    if not mine or len(mine) != model["scaling"]["max"] or any(
            r["state"] != ReplicaState.READY or not r["node"] for r in mine):
        return None
    where = place(model, nodes, everyone, models)
    worst = min(_priority(model, r) for r in mine)
    profile = _profile(model, where.profile)
    if not where.node or profile is None or profile["priority"] <= worst:
        return None
    return _new_replica(model, where)


def plan(
    models: list[ModelSpec], nodes: list[NodeView], replicas: list[ReplicaRecord],
    uses: Mapping[str, Use] | None = None, now: float = 0.0,
) -> Plan:
    """The changes that bring replicas in line with the catalog and the nodes' states; with
    uses (what the gateways saw of each model, at now), models on demand too (_demand):
    one replica for a model requests wait for, idle replicas removed, and an idle one of
    another model evicted when a waited-for model finds no room."""
    uses = uses or {}
    result = Plan()
    by_name = {m["name"]: m for m in models}
    by_id = {n["id"]: n for n in nodes}
    states = {n["id"]: n["state"] for n in nodes}
    ready = {n for n, state in states.items() if state == NodeState.READY}
    live = [r for r in replicas if r["state"] in LIVE_REPLICA_STATES]
    for r in live:
        gave_up = given_up(r, by_id.get(r["node"]))
        if r["model"] not in by_name:
            result.stop[r["id"]] = f"{r['model']} was deleted from the catalog"
        elif r.get("workers") and (fault := split_fault(r, ready)):
            result.stop[r["id"]] = fault
        elif gave_up is not None:
            # Its node stopped trying it: the model goes to its next profile meanwhile.
            result.stop[r["id"]] = (
                f"node {r['node']} gave up on {r['profile']} on GPU "
                f"{', '.join(gave_up.get('gpus') or [])} after {gave_up.get('starts', 0)} "
                f"failed starts: {gave_up.get('reason', '')}")
        elif r["node"] and states.get(r["node"], "gone") in (NodeState.NOT_READY, "gone"):
            # Only a silent node loses its replicas: one that restarted and is checking its
            # engine again still runs them (engines outlive their agent).
            result.stop[r["id"]] = f"node {r['node']} is {states.get(r['node'], 'gone')}"
    kept = [r for r in live if r["id"] not in result.stop]
    if uses:
        _retire_idle(models, kept, uses, now, result)
        kept = [r for r in kept if r["id"] not in result.stop]
    for model in models:
        use = uses.get(model["name"], _demand.NOBODY)
        mine = _surplus(model, [r for r in kept if r["model"] == model["name"]], result)
        placed = [r for r in mine if r["node"]]
        # Replicas to place: those without a node, then "" for each one to make.
        unplaced = [r["id"] for r in mine if not r["node"]]
        unplaced += [""] * max(_demand.floor(model, use) - len(mine), 0)
        taken = placed + result.add
        others = [r for r in kept if r["id"] not in result.stop and r["model"] != model["name"]]
        for rid in unplaced:
            where = place(model, nodes, others + taken, by_name)
            if not where.node and use.waiting:
                where, others = _evict(model, where, nodes, others, taken, by_name, uses,
                                       result)
            if rid and where.node:
                result.place[rid] = (where.node, where.profile, where.gpus)
                if where.workers:
                    result.split[rid] = where.workers
                    taken.append({**next(r for r in mine if r["id"] == rid),
                                  "node": where.node, "profile": where.profile,
                                  "gpus": where.gpus, "workers": where.workers})
            elif rid:
                result.waiting[rid] = where.why
            else:
                new = _new_replica(model, where)
                result.add.append(new)
                taken.append(new)
        moved = _move(model, mine, nodes, others + taken, by_name)
        if moved is not None:
            result.add.append(moved)
    return result


def split_fault(replica: ReplicaRecord, ready: set[str]) -> str:
    """Why a split replica cannot go on: its main node or a worker not ready, its main
    engine failed (a lost worker ends it at once), or a worker that reported its share
    failed; '' while it may. llama.cpp's RPC has no failover: such a replica is stopped,
    and a new one (a new id: no worker rejoins the old one) placed where it now fits."""
    why = _split.broken(split_nodes(replica), ready)
    if why:
        return why
    if replica["state"] == ReplicaState.FAILED:
        return (f"its main node {replica['node']}'s engine failed: "
                f"{replica.get('err') or 'no reason'}; llama.cpp's RPC has no failover, so "
                "the replica is stopped and placed again where it now fits")
    for w in replica.get("workers") or []:
        if w.get("state") == ReplicaState.FAILED:
            return (f"its worker {w['node']} failed its share: {w.get('err') or 'no reason'}; "
                    "llama.cpp's RPC has no failover, so the replica is stopped and placed "
                    "again where it now fits")
    return ""


# --- models on demand (control/_demand.py decides; these apply it to a plan) ---


def _retire_idle(models: list[ModelSpec], kept: list[ReplicaRecord],
                 uses: Mapping[str, Use], now: float, result: Plan) -> None:
    for model in models:
        mine = [r for r in kept if r["model"] == model["name"]]
        use = uses.get(model["name"], _demand.NOBODY)
        result.stop.update(_demand.unwanted(model, mine, use))
        placed = [r for r in mine if r["id"] not in result.stop]
        for retired in _demand.retire_idle(model, placed, use, now):
            result.stop[retired.replica] = retired.event()
            result.evicted.append(retired)


def _evict(model: ModelSpec, where: Placement, nodes: list[NodeView],
           others: list[ReplicaRecord], taken: list[ReplicaRecord],
           models: dict[str, ModelSpec], uses: Mapping[str, Use],
           result: Plan) -> tuple[Placement, list[ReplicaRecord]]:
    """Where model goes once the least recently used idle replica that makes room is
    evicted (named in result.evicted), and the replicas left; as it was when none does."""
    def fits(rest: list[ReplicaRecord]) -> str:
        return place(model, nodes, rest + taken, models).node

    found = _demand.evict_for(model, others, models, uses, fits, where.why)
    if found is None:
        return where, others
    eviction, rest = found
    result.stop[eviction.replica] = eviction.event()
    result.evicted.append(eviction)
    return place(model, nodes, rest + taken, models), rest


class Scheduler:
    """Applies plans to the store; run it after every change and on a timer."""

    def __init__(self, store: Store, node_timeout_s: float,
                 on_evict: Callable[[_demand.Eviction], None] | None = None) -> None:
        self.store = store
        self.node_timeout_s = node_timeout_s
        # Told of each eviction once it is written (the metrics count them).
        self.on_evict = on_evict

    def tick(self, lease: Lease | None = None) -> Plan:
        """Plan from what the store holds now and write the plan in one transaction: with a
        lease, only while it is still this holder's under its epoch (else LeaseLost, and
        nothing is written); without one, unfenced (the only control plane, a test)."""
        now = self.store.clock()
        hearing = self.store.hearing
        nodes = [node_view(n, now, self.node_timeout_s, hearing) for n in self.store.nodes()]
        p = plan(self.store.models(), nodes, self.store.replicas(), self.store.uses(), now)
        self.store.apply_plan(p, lease, keep_stopped_s=KEEP_STOPPED_S)
        for eviction in p.evicted:
            log.warning("%s", eviction.event())
            if self.on_evict is not None:
                self.on_evict(eviction)
        for rid, why in p.stop.items():
            log.info("stopping replica %s: %s", rid, why)
        for r in p.add:
            log.info("replica %s of %s: %s", r["id"], r["model"],
                     f"on {' + '.join(split_nodes(r))} ({r['profile']})" if r["node"]
                     else f"waiting: {r['err']}")
        self.store.checkpoint()
        return p
