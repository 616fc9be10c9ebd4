"""One GPU replica over several nodes' cards (a GPU profile's `nodes: N|auto`, llama.cpp's
RPC backend): where no single node's cards hold the model, the scheduler places it over
ready nodes with the RPC backend and their GPU engine ready, each giving its free cards of
the profile's class (the roomiest, up to the profile's gpus); the record lists the main's
cards in gpus and each worker's in its entry, and the replica holds every one of them.
Pure plan(), no processes."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from llmgw.contract.catalog import CATALOG_MODEL
from llmgw.control.scheduler import place, plan
from tests.control.test_scheduler import model, node
from tests.control.test_scheduler_split import GEOMETRY

CLASS = "rtx-4090"
# A 24 GB card as NVML reports it: 24 GiB, 23.5 GiB free (the driver's own use).
CARD_MB, FREE_MB = 24_576, 24_064


def card(node_id: str, i: int, cls: str = CLASS, memory_mb: int = CARD_MB,
         free_mb: int | None = None) -> dict[str, Any]:
    free = free_mb if free_mb is not None else memory_mb - (CARD_MB - FREE_MB)
    return {"index": i, "class": cls, "memory_mb": memory_mb, "memory_free_mb": free,
            "uuid": f"GPU-{node_id}-{i}"}


def gpu_node(id: str, cards: list[dict[str, Any]] | None = None, able: bool = True,
             engines: tuple[str, ...] | None = None,
             rpc_engines: tuple[str, ...] = ("llamacpp", "llamacpp-cuda")) -> dict[str, Any]:
    """A ready node with two 24 GB cards (unless cards says), its GPU engine ready and both
    engines with llama.cpp's RPC backend (unless able=False, or rpc_engines says which)."""
    cards = cards if cards is not None else [card(id, 0), card(id, 1)]
    return {**node(id, gpus=cards, memory_mb=64_000, engines=engines), "rpc": able,
            "rpc_engines": list(rpc_engines) if able else []}


def seventy(nodes: int | str = "auto", gpus: int | str = 2, size_gb: float = 70,
            name: str = "big", args: list[str] | None = None) -> dict[str, Any]:
    """A model of size_gb GB (with its KV cache at 4,096 tokens about 66 GiB for 70 GB) on
    a GPU profile alone, taking up to gpus cards a node, over up to nodes nodes."""
    m = model(name, gpu=CLASS)
    m["profiles"] = m["profiles"][:1]
    m["profiles"][0].update(nodes=nodes, gpus=gpus, min_memory_gb=0,
                            args=args if args is not None else ["--ctx-size", "4096"])
    return {**m, "size_bytes": int(size_gb * 10**9), "geometry": dict(GEOMETRY)}


def small(name: str = "small") -> dict[str, Any]:
    """A 10 GB model one 24 GB card holds, on a one-card GPU profile."""
    return seventy(nodes=1, gpus=1, size_gb=10, name=name)


def cards_of(r: dict[str, Any]) -> dict[str, list[str]]:
    return {r["node"]: r["gpus"], **{w["node"]: w["gpus"] for w in r.get("workers") or []}}


def test_a_70gb_model_is_split_over_two_nodes_two_24gb_cards_each() -> None:
    """No node's two cards (47 GiB free) hold 66 GiB: one replica, main a with its two
    cards in gpus, worker b with its two in its entry and half the layers. The control:
    nodes: 1 places nothing, and says what one node's cards lack."""
    (r,) = plan([seventy()], [gpu_node("a"), gpu_node("b")], []).add
    assert (r["node"], r["profile"], r["err"]) == ("a", f"gpu-{CLASS}", "")
    assert r["gpus"] == ["GPU-a-0", "GPU-a-1"]
    assert r["workers"] == [{"node": "b", "layers": 20, "addr": "", "port": 0,
                             "gpus": ["GPU-b-0", "GPU-b-1"]}]
    (r,) = plan([seventy(nodes=1)], [gpu_node("a"), gpu_node("b")], []).add
    assert r["node"] == "" and "together are too small for big" in r["err"], r["err"]
    assert "split over nodes" not in r["err"]


def test_one_node_whose_cards_hold_it_takes_it_alone() -> None:
    """Node c's two 48 GB cards hold it: no split, its two cards. The control: without c,
    a split over a and b."""
    big_cards = [card("c", 0, memory_mb=49_152), card("c", 1, memory_mb=49_152)]
    nodes = [gpu_node("a"), gpu_node("b"), gpu_node("c", big_cards)]
    (r,) = plan([seventy()], nodes, []).add
    assert (r["node"], r["gpus"], r.get("workers")) == ("c", ["GPU-c-0", "GPU-c-1"], None)
    (r,) = plan([seventy()], nodes[:2], []).add
    assert r["node"] == "a" and [w["node"] for w in r["workers"]] == ["b"]


def test_cards_of_another_class_are_not_counted() -> None:
    """Node b's 80 GB card is another class: the split uses a's and c's 24 GB cards and no
    record lists b's. The control: with b's card of the profile's class, b alone takes it."""
    other = gpu_node("b", [card("b", 0, cls="a100", memory_mb=81_920)])
    (r,) = plan([seventy()], [gpu_node("a"), other, gpu_node("c")], []).add
    assert cards_of(r) == {"a": ["GPU-a-0", "GPU-a-1"], "c": ["GPU-c-0", "GPU-c-1"]}
    mine = gpu_node("b", [card("b", 0, memory_mb=81_920)])
    (r,) = plan([seventy()], [gpu_node("a"), mine, gpu_node("c")], []).add
    assert (r["node"], r["gpus"], r.get("workers")) == ("b", ["GPU-b-0"], None)


def test_only_rpc_nodes_whose_gpu_engine_is_ready_take_part() -> None:
    """b without the RPC backend and c's GPU engine not ready: only a and d split it. The
    control: b, c and d alone cannot, and the reason says c's engine and that b lacks RPC."""
    nodes = [gpu_node("a"), gpu_node("b", able=False),
             gpu_node("c", engines=("llamacpp",)), gpu_node("d")]
    (r,) = plan([seventy()], nodes, []).add
    assert sorted(cards_of(r)) == ["a", "d"]
    (r,) = plan([seventy()], nodes[1:3], []).add
    assert r["node"] == "" and "c's GPU engine (llamacpp-cuda) is not ready" in r["err"], \
        r["err"]


def test_a_node_whose_gpu_engine_lacks_the_rpc_backend_takes_no_part_in_a_gpu_split() -> None:
    """b's CPU build has rpc-server and its GPU build (made before GGML_RPC) has none: a
    GPU split goes over a and d, never b, and without a and d it waits saying no node's
    GPU engine has the backend. The control: with its GPU engine's backend, b takes part."""
    nodes = [gpu_node("a"), gpu_node("b", rpc_engines=("llamacpp",)), gpu_node("d")]
    (r,) = plan([seventy()], nodes, []).add
    assert "b" not in cards_of(r) and sorted(cards_of(r)) == ["a", "d"]
    (r,) = plan([seventy()], nodes[1:2], []).add
    assert r["node"] == "" and "no ready node's GPU engine (llamacpp-cuda) has" in r["err"], \
        r["err"]
    (r,) = plan([seventy()], [gpu_node("b"), gpu_node("d")], []).add
    assert sorted(cards_of(r)) == ["b", "d"]


def test_a_split_replica_holds_every_card_it_lists_on_every_node() -> None:
    """With the split over a and b holding their four cards, a one-card model goes to c's
    card, and a second split of big waits, naming the cards taken. The control: without
    the split, the small model goes to a's first card."""
    nodes = [gpu_node("a"), gpu_node("b"), gpu_node("c", [card("c", 0)])]
    (held,) = plan([seventy()], nodes[:2], []).add
    held = {**held, "state": "ready"}
    by_name = {"big": seventy(), "small": small()}
    where = place(small(), nodes, [held], by_name)
    assert (where.node, where.gpus) == ("c", ["GPU-c-0"])
    assert place(small(), nodes, [], by_name).gpus == ["GPU-a-0"]
    second = place(seventy(name="big2"), nodes[:2], [held], {**by_name, "big2": seventy()})
    assert second.node == "" and f"split replica {held['id']} of big" in second.why, second.why


def test_a_node_giving_too_little_says_card_by_card_what_it_has() -> None:
    """a's card 1 taken by another replica, b's card 0 filled by another process: over
    a's card 0 and b's card 1 (22.5 GiB each) 66 GiB does not fit, and the reason names
    each card's free memory and the one taken. The control: both free, it is placed."""
    other = {"id": "r9", "model": "small", "node": "a", "profile": f"gpu-{CLASS}",
             "state": "ready", "gpus": ["GPU-a-1"]}
    b = gpu_node("b", [card("b", 0, free_mb=2_000), card("b", 1)])
    m = seventy(gpus=1)
    (r,) = plan([m, small()], [gpu_node("a"), b], [other]).add
    assert r["node"] == "", r
    for said in ("GPU-a-0 23.5 GiB free", "GPU-a-1 is taken by replica r9 of small",
                 "GPU-b-1 23.5 GiB free"):
        assert said in r["err"], r["err"]
    (r,) = plan([seventy(gpus=1, size_gb=40)], [gpu_node("a"), b], [other]).add
    assert cards_of(r) == {"a": ["GPU-a-0"], "b": ["GPU-b-1"]}


def test_the_catalog_takes_nodes_on_a_gpu_profile_and_refuses_what_cannot_split() -> None:
    """nodes on a GPU profile is taken; with --split-mode row, or its own --tensor-split,
    refused saying why. The control: --split-mode layer is taken."""
    def spec(*args: str) -> dict[str, Any]:
        return {"name": "m", "source": "https://mirror/m.gguf",
                "profiles": [{"name": "p", "engine": "llamacpp", "gpu_class": CLASS,
                              "nodes": 2, "gpus": 2, "args": list(args)}]}

    assert CATALOG_MODEL.validate_python(spec())["profiles"][0]["nodes"] == 2
    CATALOG_MODEL.validate_python(spec("--split-mode", "layer"))
    with pytest.raises(ValidationError, match="RPC backend shares a model over nodes layer"):
        CATALOG_MODEL.validate_python(spec("--split-mode", "row"))
    with pytest.raises(ValidationError, match="with its own --tensor-split"):
        CATALOG_MODEL.validate_python(spec("--tensor-split", "1,1"))


def test_a_split_over_more_cards_than_llama_cpp_takes_waits_saying_so() -> None:
    """A 350 GB model over eight nodes of two cards would take 16 cards, one more than
    llama.cpp's --tensor-split takes: it waits, saying so. The control: 300 GB takes seven
    nodes, 14 cards, and is placed."""
    nodes = [gpu_node(f"n{i}") for i in range(8)]
    (r,) = plan([seventy(size_gb=350)], nodes, []).add
    assert r["node"] == "" and "it takes 16 cards" in r["err"] and "at most 15" in r["err"], \
        r["err"]
    (r,) = plan([seventy(size_gb=300)], nodes, []).add
    assert sum(len(c) for c in cards_of(r).values()) == 14, r
