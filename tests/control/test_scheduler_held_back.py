"""Cards the scheduler holds back from a GPU profile: those a node gave up a placement on
(its replica stopped, the model placed on its next profile, the card tried again once the
node stops reporting it or its free memory has grown), and those that failed the node's GPU
engine check (the other cards still served)."""

from __future__ import annotations

from typing import Any

from llmgw.contract import GIVE_UP_FREE_GROWTH_MB
from llmgw.control.scheduler import place, plan
from tests.control.test_scheduler import model, node, replica
from tests.control.test_scheduler_gpus import gpu

OOM = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 15316.00 MiB on device 0: "
       "cudaMalloc failed: out of memory")


def gave_up(rid: str, uuid: str = "GPU-aaaa", free_mb: int = 80_000) -> dict[str, Any]:
    return {"replica": rid, "model": "m", "profile": "gpu-h100-80gb", "gpus": [uuid],
            "reason": OOM, "starts": 3, "free_mb": {uuid: free_mb}, "since": 0.0}


def gpu_node(*entries: dict[str, Any], free_mb: int = 80_000, cards: int = 1,
             passed: list[str] | None = None) -> dict[str, Any]:
    n = node("a", gpus=[gpu(f"GPU-{c * 4}", free_mb) for c in "ab"[:cards]])
    n["given_up"] = list(entries)
    n["provision"] = [{"engine": "llamacpp", "state": "ready"},
                      {"engine": "llamacpp-cuda", "state": "ready",
                       **({"gpus": passed} if passed is not None else {})}]
    return n


def test_a_given_up_replica_is_stopped_with_its_reason_and_the_model_goes_to_cpu() -> None:
    failed = replica("r1", "a", state="failed", profile="gpu-h100-80gb", gpus=["GPU-aaaa"])
    p = plan([model(gpu="h100-80gb")], [gpu_node(gave_up("r1"))], [failed])
    assert p.stop["r1"] == (f"node a gave up on gpu-h100-80gb on GPU GPU-aaaa after 3 failed "
                            f"starts: {OOM}")
    assert [(r["profile"], r["gpus"]) for r in p.add] == [("cpu", [])]


def test_negative_control_a_failed_replica_not_given_up_stays_on_its_gpu() -> None:
    """Without the node's give-up the scheduler leaves a failed replica to its agent's
    restarts: nothing stopped, nothing placed beside it."""
    failed = replica("r1", "a", state="failed", profile="gpu-h100-80gb", gpus=["GPU-aaaa"])
    p = plan([model(gpu="h100-80gb")], [gpu_node()], [failed])
    assert p.stop == {} and p.add == []


def test_the_card_is_held_back_while_reported_then_the_model_moves_back_to_it() -> None:
    on_cpu = replica("r2", "a", state="ready", profile="cpu")
    held = plan([model(gpu="h100-80gb")], [gpu_node(gave_up("r1"))], [on_cpu])
    assert held.add == [] and held.stop == {}, "no move onto the card given up"
    # The node no longer reports it (GIVE_UP_FOR_S passed): the GPU replica starts beside.
    again = plan([model(gpu="h100-80gb")], [gpu_node()], [on_cpu])
    assert [(r["profile"], r["gpus"]) for r in again.add] == [("gpu-h100-80gb", ["GPU-aaaa"])]


def test_a_card_whose_free_memory_grew_enough_is_tried_again_at_once() -> None:
    on_cpu = replica("r2", "a", state="ready", profile="cpu")
    little = gpu_node(gave_up("r1", free_mb=10_000), free_mb=10_000 + GIVE_UP_FREE_GROWTH_MB - 1)
    assert plan([model(gpu="h100-80gb")], [little], [on_cpu]).add == []
    grown = gpu_node(gave_up("r1", free_mb=10_000), free_mb=10_000 + GIVE_UP_FREE_GROWTH_MB)
    assert [r["profile"] for r in plan([model(gpu="h100-80gb")], [grown], [on_cpu]).add] == [
        "gpu-h100-80gb"]


def test_another_card_of_the_class_is_still_given() -> None:
    p = plan([model(gpu="h100-80gb")], [gpu_node(gave_up("r1"), cards=2)], [])
    assert [(r["profile"], r["gpus"]) for r in p.add] == [("gpu-h100-80gb", ["GPU-bbbb"])]


def test_a_model_with_only_gpu_profiles_waits_saying_the_card_was_given_up() -> None:
    only_gpu = model(gpu="h100-80gb")
    only_gpu["profiles"] = only_gpu["profiles"][:1]
    why = place(only_gpu, [gpu_node(gave_up("r1"))], [], {"m": only_gpu}).why
    assert "a gave up on GPU GPU-aaaa after 3 failed starts" in why and OOM in why


def test_gpu_replicas_go_only_to_cards_that_passed_the_engines_check() -> None:
    two = plan([model(min=2, max=2, gpu="h100-80gb")], [gpu_node(cards=2, passed=["GPU-bbbb"])],
               [])
    assert sorted((r["profile"], tuple(r["gpus"])) for r in two.add) == [
        ("cpu", ()), ("gpu-h100-80gb", ("GPU-bbbb",))]
    only_gpu = model(gpu="h100-80gb")
    only_gpu["profiles"] = only_gpu["profiles"][:1]
    why = place(only_gpu, [gpu_node(passed=[])], [], {"m": only_gpu}).why
    assert "GPU GPU-aaaa failed the GPU engine's check" in why


def test_negative_control_an_agent_that_does_not_say_which_passed_gets_every_card() -> None:
    p = plan([model(min=2, max=2, gpu="h100-80gb")], [gpu_node(cards=2)], [])
    assert sorted(tuple(r["gpus"]) for r in p.add) == [("GPU-aaaa",), ("GPU-bbbb",)]
