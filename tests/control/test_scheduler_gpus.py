"""Scheduling on GPUs: GPU profiles wait for the node's CUDA engine, each replica gets its
own cards by NVML UUID after a memory-fit check, and a replica moves from CPU to GPU with
the new one ready before the old one stops."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.control.scheduler import GIB, held_back, place, plan
from tests.control.test_scheduler import PIN, model, node, replica

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "class": "h100-80gb",
        "memory_mb": 81_559, "memory_free_mb": 80_000, "uuid": "GPU-aaaa"}
# Qwen2.5-7B's shape: 28 layers, 28 heads, 4 KV heads, width 3584 (head 128).
QWEN7 = {"block_count": 28, "context_length": 32768, "head_count": 28, "head_count_kv": 4,
         "embedding_length": 3584}


def gpu(uuid: str, free_mb: int = 80_000, **extra: Any) -> dict[str, Any]:
    return {**H100, "uuid": uuid, "memory_free_mb": free_mb, **extra}


def sized(m: dict[str, Any], size_gib: float, geometry: dict[str, int] | None = None,
          ctx: int = 32768) -> dict[str, Any]:
    """m with a file size and geometry (as read when it was added) and -c ctx everywhere."""
    for p in m["profiles"]:
        p["args"] = ["--ctx-size", str(ctx)]
    return {**m, "size_bytes": int(size_gib * GIB), "geometry": geometry or dict(QWEN7),
            "context_length": 4096}


def test_a_gpu_profile_waits_for_the_cuda_engine_and_the_cpu_profile_serves_meanwhile() -> None:
    gpu_node = node("a", gpus=[gpu("GPU-aaaa")], engines=("llamacpp",))
    p = plan([model(gpu="h100-80gb")], [gpu_node], [])
    assert [(r["profile"], r["gpus"]) for r in p.add] == [("cpu", [])]
    only_gpu = model(gpu="h100-80gb")
    only_gpu["profiles"] = only_gpu["profiles"][:1]
    why = place(only_gpu, [gpu_node], [], {"m": only_gpu}).why
    assert "a's GPU engine (llamacpp-cuda) is not ready" in why
    # Negative control: with the engine ready, the GPU profile is placed.
    ready = node("a", gpus=[gpu("GPU-aaaa")])
    assert plan([model(gpu="h100-80gb")], [ready], []).add[0]["profile"] == "gpu-h100-80gb"


def test_each_replica_gets_its_own_card_by_uuid() -> None:
    cards = [gpu("GPU-aaaa"), gpu("GPU-bbbb")]
    p = plan([model(min=2, max=2, gpu="h100-80gb")], [node("a", gpus=cards)], [])
    assert [(r["profile"], r["gpus"]) for r in p.add] == [
        ("gpu-h100-80gb", ["GPU-aaaa"]), ("gpu-h100-80gb", ["GPU-bbbb"])]


def test_a_card_a_live_replica_holds_is_not_given_again() -> None:
    cards = [gpu("GPU-aaaa"), gpu("GPU-bbbb")]
    other = replica("x", "a", model="other", profile="gpu-h100-80gb", gpus=["GPU-aaaa"])
    p = plan([model(gpu="h100-80gb"), model("other", gpu="h100-80gb")],
             [node("a", gpus=cards)], [other])
    assert [(r["model"], r["gpus"]) for r in p.add] == [("m", ["GPU-bbbb"])]
    # Negative control: a stopped replica holds nothing.
    other["state"] = "stopped"
    p = plan([model(gpu="h100-80gb"), model("other", gpu="h100-80gb")],
             [node("a", gpus=cards)], [other])
    assert [(r["model"], r["gpus"]) for r in p.add] == [("m", ["GPU-aaaa"]),
                                                        ("other", ["GPU-bbbb"])]


def test_mig_instances_are_assigned_one_per_replica() -> None:
    # As discovery lists them: the instances, each with its own UUID, not the parent.
    slices = [{"index": 0, "class": "a100-40gb", "memory_mb": 4864, "memory_free_mb": 4800,
               "uuid": f"MIG-{i}", "mig_parent": "GPU-parent", "name": "NVIDIA A100-SXM4-40GB"}
              for i in range(2)]
    p = plan([model(min=2, max=2, gpu="a100-40gb")], [node("a", gpus=slices)], [])
    assert [r["gpus"] for r in p.add] == [["MIG-0"], ["MIG-1"]]


def test_a_model_that_does_not_fit_the_free_memory_says_what_it_needs() -> None:
    """qwen, one slot of 32768 tokens: 1.75 GiB of KV cache (2 x 28 x 32768 x 512 x 2 B),
    4 GiB of weights, 1 GiB margin and a compute buffer of 512 x (4 x (3 x 14336 + 4 x
    3584) + 2 x 32768) B (144 MiB; its feed-forward width unsaid, so 4 x 3584): 6.9 GiB,
    more than the 3.2 GiB free."""
    small = node("n1", gpus=[gpu("GPU-aaaa", free_mb=int(3.2 * 1024), memory_used_mb=78_000)])
    m = sized(model("qwen", gpu="h100-80gb"), 4.0)
    m["profiles"] = m["profiles"][:1]
    why = place(m, [small], [], {"qwen": m}).why
    assert ("node n1's GPU GPU-aaaa has 3.2 GiB free, 76.2 GiB used by other processes; "
            "qwen needs 6.9 GiB: 4.0 GiB weights + 0.1 GiB compute + 1.8 GiB KV cache for "
            "32768 tokens + 1.0 GiB margin") in why
    # Negative controls: a card with room takes it; so does a shorter context.
    roomy = node("n1", gpus=[gpu("GPU-aaaa", free_mb=8 * 1024)])
    assert place(m, [roomy], [], {"qwen": m}).gpus == ["GPU-aaaa"]
    short = sized(model("qwen", gpu="h100-80gb"), 1.5, ctx=2048)
    assert place(short, [small], [], {"qwen": short}).gpus == ["GPU-aaaa"]


def test_a_full_card_is_passed_over_for_one_that_fits() -> None:
    cards = [gpu("GPU-full", free_mb=1024), gpu("GPU-room", free_mb=40_000)]
    m = sized(model("qwen", gpu="h100-80gb"), 4.0)
    p = plan([m], [node("a", gpus=cards)], [])
    assert p.add[0]["gpus"] == ["GPU-room"]


def test_a_card_that_stopped_answering_gets_nothing_and_is_named() -> None:
    """A card whose heartbeat entry carries NVML's error is left out; the others serve."""
    m = sized(model("qwen", gpu="h100-80gb"), 4.0)
    cards = [gpu("GPU-lost", error="GPU is lost"), gpu("GPU-ok")]
    assert plan([m], [node("a", gpus=cards)], []).add[0]["gpus"] == ["GPU-ok"]
    only_lost = {**m, "profiles": m["profiles"][:1]}
    why = place(only_lost, [node("a", gpus=cards[:1])], [], {"qwen": only_lost}).why
    assert "GPU-lost stopped answering NVML (GPU is lost)" in why
    # Negative control: the same card answering takes the replica.
    assert plan([m], [node("a", gpus=[gpu("GPU-lost")])], []).add[0]["gpus"] == ["GPU-lost"]


def test_free_memory_nvml_could_not_read_counts_as_the_cards_total() -> None:
    m = sized(model("qwen", gpu="h100-80gb"), 4.0)
    unread = gpu("GPU-aaaa", free_mb=0, unknown=["memory_free_mb"])
    assert plan([m], [node("a", gpus=[unread])], []).add[0]["gpus"] == ["GPU-aaaa"]
    # Negative control: a card NVML says is full is not taken.
    full = gpu("GPU-aaaa", free_mb=0)
    assert plan([m], [node("a", gpus=[full])], []).add[0]["profile"] == "cpu"


def test_a_cards_own_replica_never_pushes_itself_off() -> None:
    """A card whose free memory is low because llmgw's own replica fills it: that memory is
    the replica's, so nothing moves, stops or is added; a second model does not go there
    (the card is taken, and says by whom)."""
    m = sized(model("qwen", gpu="h100-80gb"), 4.0)
    full_of_itself = node("a", gpus=[gpu("GPU-aaaa", free_mb=900, memory_used_mb=80_600)])
    mine = replica("r", "a", model="qwen", profile="gpu-h100-80gb", gpus=["GPU-aaaa"])
    p = plan([m], [full_of_itself], [mine])
    assert not (p.add or p.stop or p.place)
    assert held_back(mine, {"qwen": m}, [full_of_itself], [mine]) == ""
    other = {**sized(model("other", gpu="h100-80gb"), 4.0)}
    other["profiles"] = other["profiles"][:1]
    why = place(other, [full_of_itself], [mine], {"qwen": m, "other": other}).why
    assert "GPU-aaaa is taken by replica r of qwen" in why


def test_why_a_replica_is_on_cpu_names_the_card_and_free_versus_needed() -> None:
    m = sized(model("qwen", gpu="h100-80gb"), 4.0)
    on_cpu = replica("r", "a", model="qwen", profile="cpu")
    busy = node("a", gpus=[gpu("GPU-aaaa", free_mb=2048)])
    why = held_back(on_cpu, {"qwen": m}, [busy], [on_cpu])
    assert why.startswith("gpu-h100-80gb: node a's GPU GPU-aaaa has 2.0 GiB free; "
                          "qwen needs 6.9 GiB"), why
    not_ready = node("a", gpus=[gpu("GPU-aaaa")], engines=("llamacpp",))
    assert "a's GPU engine (llamacpp-cuda) is not ready" in held_back(
        on_cpu, {"qwen": m}, [not_ready], [on_cpu])
    # Negative control: with room on the card there is nothing to explain (the move is due).
    assert held_back(on_cpu, {"qwen": m}, [node("a", gpus=[gpu("GPU-aaaa")])], [on_cpu]) == ""


def test_a_model_of_unknown_size_is_placed_by_min_memory_only() -> None:
    m = model(gpu="h100-80gb")  # added before sizes were read: no size_bytes
    p = plan([m], [node("a", gpus=[gpu("GPU-aaaa", free_mb=1)])], [])
    assert p.add[0]["gpus"] == ["GPU-aaaa"]


# --- the move from CPU to GPU ---


def _gpu_node(engines: tuple[str, ...] = ("llamacpp", "llamacpp-cuda")) -> dict[str, Any]:
    return node("a", gpus=[gpu("GPU-aaaa")], engines=engines)


def test_a_cpu_replica_gets_a_gpu_successor_once_the_cuda_engine_is_ready() -> None:
    cpu = replica("old", "a", profile="cpu")
    p = plan([model(gpu="h100-80gb")], [_gpu_node()], [cpu])
    assert not p.stop, "the CPU replica serves until its successor is ready"
    assert [(r["profile"], r["gpus"], r["node"]) for r in p.add] == [
        ("gpu-h100-80gb", ["GPU-aaaa"], "a")]
    # Negative control: no CUDA engine, no move.
    assert not plan([model(gpu="h100-80gb")], [_gpu_node(("llamacpp",))], [cpu]).add


def test_a_move_under_way_keeps_both_and_starts_no_third() -> None:
    old = replica("old", "a", profile="cpu")
    new = replica("new", "a", state="starting", profile="gpu-h100-80gb", gpus=["GPU-aaaa"])
    p = plan([model(gpu="h100-80gb")], [_gpu_node()], [old, new])
    assert not (p.add or p.stop), "scaling.max is exceeded by one while the move is under way"


def test_the_old_replica_stops_once_its_successor_is_ready() -> None:
    old = replica("old", "a", profile="cpu")
    new = replica("new", "a", profile="gpu-h100-80gb", gpus=["GPU-aaaa"])
    p = plan([model(gpu="h100-80gb")], [_gpu_node()], [old, new])
    assert p.stop == {"old": "moved to gpu-h100-80gb on a (replica new is ready)"}
    assert not p.add


def test_a_replica_already_on_its_best_profile_does_not_move() -> None:
    on_gpu = replica("r", "a", profile="gpu-h100-80gb", gpus=["GPU-aaaa"])
    p = plan([model(gpu="h100-80gb")], [_gpu_node()], [on_gpu])
    assert not (p.add or p.stop or p.place)


def test_only_ready_models_move() -> None:
    """A model still starting on CPU moves after it serves, not while it loads."""
    starting = replica("old", "a", state="starting", profile="cpu")
    assert not plan([model(gpu="h100-80gb")], [_gpu_node()], [starting]).add


@pytest.mark.parametrize("gpus", [["GPU-aaaa"], []])
def test_tick_stores_the_assigned_gpus(tmp_path, gpus: list[str]) -> None:
    """The UUIDs reach the replica row (what the agent API hands the agent); a CPU
    profile's row has none."""
    from llmgw.control.scheduler import Scheduler
    from llmgw.store import Store

    store = Store(tmp_path / "db")
    engines = ["llamacpp", "llamacpp-cuda"] if gpus else ["llamacpp"]
    store.record_heartbeat("a", {"engines": engines, "labels": PIN, "memory_mb": 16_000,
                                 "gpus": [gpu("GPU-aaaa")]})
    store.add_model(model(gpu="h100-80gb"))
    Scheduler(store, node_timeout_s=30).tick()
    (r,) = store.replicas()
    assert r["gpus"] == gpus
    (row,) = store.heartbeat("a", {"engines": engines}, "", {})
    assert row["gpus"] == gpus
