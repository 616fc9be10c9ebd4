"""One replica over several cards of a node (a profile's `gpus: N|auto`): the scheduler
takes one card when one holds the model, else the fewest of the roomiest free cards that
hold it split layer by layer as llama.cpp splits it, each card's share against its free
memory; a split replica holds every card it runs on; and where even the node's free
cards together are too small, it says so card by card. Pure plan(), no processes."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from llmgw.contract.catalog import CATALOG_MODEL
from llmgw.control.scheduler import GIB, held_back, place, plan
from llmgw.model import kv_sizing
from tests.control.test_scheduler import model, node, replica

CLASS = "rtx-4090-24gb"
# A 70B model's shape (Llama 3 70B: 80 layers, 8 KV heads of 128, width 8192).
SEVENTY_B = {"block_count": 80, "context_length": 8192, "head_count": 64, "head_count_kv": 8,
             "embedding_length": 8192, "feed_forward_length": 28672}
GB = 10**9


def card(i: int, free_mb: int = 23_552, used_mb: int = 1_024) -> dict[str, Any]:
    """A 24 GB card as a heartbeat lists it (1 GiB used by the driver)."""
    return {"index": i, "name": "NVIDIA GeForce RTX 4090", "class": CLASS, "memory_mb": 24_564,
            "memory_free_mb": free_mb, "memory_used_mb": used_mb, "uuid": f"GPU-{i}"}


def four(**free: int) -> list[dict[str, Any]]:
    """Four 24 GB cards; free={"c1": MB} gives card 1 that much free (the rest used)."""
    cards = []
    for i in range(4):
        mb = free.get(f"c{i}", 23_552)
        cards.append(card(i, mb, 24_576 - mb))
    return cards


def split_model(size: float, gpus: int | str = "auto", name: str = "big",
                gpu_only: bool = True, args: list[str] | None = None) -> dict[str, Any]:
    m = model(name, gpu=CLASS)
    if gpu_only:
        m["profiles"] = m["profiles"][:1]
    m["profiles"][0].update(gpus=gpus, args=list(args or []), min_memory_gb=0)
    return {**m, "size_bytes": int(size), "geometry": dict(SEVENTY_B)}


def gpus_of(m: dict[str, Any], cards: list[dict[str, Any]],
            replicas: list[dict[str, Any]] | None = None) -> list[str]:
    return place(m, [node("a", gpus=cards)], replicas or [], {m["name"]: m}).gpus


def test_a_40gb_model_on_four_24gb_cards_takes_two_of_them() -> None:
    """gpus: auto: no card holds 40 GB, two do (about 20 GB each, a slot's KV cache and a
    compute buffer and margin on each); the replica is one, on the first two cards."""
    m = split_model(40 * GB)
    p = plan([m], [node("a", gpus=four())], [])
    assert [(r["profile"], r["gpus"]) for r in p.add] == [(f"gpu-{CLASS}", ["GPU-0", "GPU-1"])]
    # Negative control: gpus: 1 (the default) keeps it to one card, which it does not fit.
    one = split_model(40 * GB, gpus=1)
    where = place(one, [node("a", gpus=four())], [], {"big": one})
    assert where.gpus == [] and "GPU-0 has 23.0 GiB free" in where.why, where.why


def test_one_card_when_one_holds_the_model() -> None:
    assert gpus_of(split_model(10 * GB), four()) == ["GPU-0"]
    # Negative control: a model one card cannot hold is split.
    assert len(gpus_of(split_model(30 * GB), four())) == 2


def test_as_few_cards_as_hold_it_and_at_most_the_profiles_gpus() -> None:
    """60 GB needs three 24 GB cards: auto takes three, gpus: 4 three (the fewest), and
    gpus: 2 none, saying its two cards together are too small."""
    assert gpus_of(split_model(60 * GB), four()) == ["GPU-0", "GPU-1", "GPU-2"]
    assert gpus_of(split_model(60 * GB, gpus=4), four()) == ["GPU-0", "GPU-1", "GPU-2"]
    two = split_model(60 * GB, gpus=2)
    where = place(two, [node("a", gpus=four())], [], {"big": two})
    assert where.gpus == [] and "a's 2 free" in where.why and "(gpus: 2)" in where.why


def test_the_cards_with_the_most_free_memory_are_taken() -> None:
    """Card 0 is mostly filled by another process: the split goes to cards 1 and 2, and
    card 2 before card 3 only because, of equals, the first is taken."""
    assert gpus_of(split_model(40 * GB), four(c0=8_000)) == ["GPU-1", "GPU-2"]
    # Card 3 the roomiest of all (the others have a little used): it is one of the two.
    assert gpus_of(split_model(40 * GB), four(c0=23_000, c1=23_000, c2=23_100)) == \
        ["GPU-2", "GPU-3"]
    # Negative control: none filled, the first two.
    assert gpus_of(split_model(40 * GB), four()) == ["GPU-0", "GPU-1"]


def test_a_split_replica_holds_every_card_it_runs_on() -> None:
    """A live replica on cards 0 and 1: a second 40 GB model gets cards 2 and 3, and a
    third finds none free, naming who holds each card."""
    first = replica("r-1", "a", model="big", profile=f"gpu-{CLASS}", gpus=["GPU-0", "GPU-1"])
    second, third = split_model(40 * GB, name="second"), split_model(40 * GB, name="third")
    models = {"big": split_model(40 * GB), "second": second, "third": third}
    on = [node("a", gpus=four())]
    where = place(second, on, [first], models)
    assert where.gpus == ["GPU-2", "GPU-3"]
    taken = replica("r-2", "a", model="second", profile=f"gpu-{CLASS}", gpus=where.gpus)
    why = place(third, on, [first, taken], models).why
    assert "GPU-1 is taken by replica r-1 of big" in why and \
        "GPU-3 is taken by replica r-2 of second" in why, why
    # Negative control: once the first replica stops, its cards are free again.
    first["state"] = "stopped"
    assert place(third, on, [first, taken], models).gpus == ["GPU-0", "GPU-1"]


def test_all_free_cards_together_too_small_is_said_card_by_card() -> None:
    """A 100 GB model on four 24 GB cards (92 GiB free in all): held back, and the reason
    gives each card's free memory against its share of the layers."""
    m = split_model(100 * GB)
    where = place(m, [node("a", gpus=four(c3=20_000))], [], {"big": m})
    assert where.gpus == []
    assert "a's 4 free rtx-4090-24gb GPUs together are too small for big" in where.why
    for i in range(3):
        assert f"GPU-{i} (1.0 GiB used by other processes) has 23.0 GiB free; its share (" \
            in where.why, where.why
    assert "GPU-3 (4.5 GiB used by other processes) has 19.5 GiB free; its share (" in where.why
    assert "layers and the output layer)" in where.why
    # Negative control: a 40 GB model on the same cards is placed, with nothing to say.
    assert place(split_model(40 * GB), [node("a", gpus=four(c3=20_000))], [],
                 {"big": split_model(40 * GB)}).why == ""


def test_held_back_names_each_card_for_a_replica_left_on_cpu() -> None:
    """A replica on the CPU profile; its split GPU profile does not fit: held_back says
    why card by card. Control: where the cards hold it, nothing is held back."""
    m = split_model(100 * GB, gpu_only=False)
    on_cpu = replica("r-1", "a", model="big")
    why = held_back(on_cpu, {"big": m}, [node("a", gpus=four())], [on_cpu])
    assert why.startswith(f"gpu-{CLASS}: node a's 4 free"), why
    assert why.count("its share (") == 4, why
    small = split_model(40 * GB, gpu_only=False)
    assert held_back(on_cpu, {"big": small}, [node("a", gpus=four())], [on_cpu]) == ""


def test_a_profiles_own_tensor_split_is_what_the_cards_are_fitted_by() -> None:
    """--tensor-split 3,1 on two cards puts three quarters of a 40 GB model on card 0,
    more than its 23 GiB: it does not fit, where the even split does."""
    lopsided = split_model(40 * GB, gpus=2, args=["--tensor-split", "3,1"])
    where = place(lopsided, [node("a", gpus=four())], [], {"big": lopsided})
    assert where.gpus == [] and "GPU-0 (1.0 GiB used by other processes) has 23.0 GiB free; " \
        "its share (61 layers)" in where.why, where.why
    even = split_model(40 * GB, gpus=2, args=["--tensor-split", "1,1"])
    assert gpus_of(even, four()) == ["GPU-0", "GPU-1"]


# --- llama.cpp's layer split, as kv_sizing models it ---


@pytest.mark.parametrize(("proportions", "units", "expected"), [
    # 80 layers + output over two equal cards: unit il goes to the first card whose split
    # point exceeds il / 81; 0.5 x 81 = 40.5, so units 0..40 on card 0.
    ([1, 1], 81, [41, 40]),
    ([3, 1], 81, [61, 20]),
    # 4 layers + output over four equal cards: points .25 .5 .75 1 at il/5 = 0 .2 .4 .6 .8.
    ([1, 1, 1, 1], 5, [2, 1, 1, 1]),
    # A card with no share gets no layer.
    ([1, 0, 1], 9, [5, 0, 4]),
])
def test_layers_are_split_as_llama_cpp_splits_them(proportions: list[float], units: int,
                                                   expected: list[int]) -> None:
    assert kv_sizing.layer_units(proportions, units) == expected


def test_a_split_over_one_card_is_the_one_card_sizing() -> None:
    """The one formula: a 'split' over one card gives the slots size() gives (that card
    holds every layer and the output), and two cards hold more slots than either alone."""
    for size in (8, 10, 12):
        one = kv_sizing.size(SEVENTY_B, size * GB, 23_552 << 20, [])
        alone = kv_sizing.size_split(SEVENTY_B, size * GB, [23_552 << 20], [])
        assert one is not None and alone is not None
        assert (alone.slots, alone.ctx_per_slot) == (one.slots, one.ctx_per_slot)
        assert alone.shares[0].output and alone.shares[0].layers == 80
    two = kv_sizing.size_split(SEVENTY_B, 10 * GB, [23_552 << 20] * 2, [])
    assert two is not None and two.slots > alone.slots
    # Each card's share of the weights is its layers' part of the file.
    assert [s.layers for s in two.shares] == [41, 39] and two.shares[1].output
    assert sum(s.weights for s in two.shares) == pytest.approx(10 * GB, abs=2)


def test_the_engine_gets_a_layer_split_by_what_each_card_gives() -> None:
    """--split-mode layer and --tensor-split of each card's room (its free memory less
    the margin and one compute buffer, MiB); a profile's own flags win."""
    split = kv_sizing.size_split(SEVENTY_B, 40 * GB, [23_552 << 20, 20_000 << 20], [])
    assert split is not None
    args = split.args([])
    ts = [int(v) for v in args[args.index("--tensor-split") + 1].split(",")]
    assert args[args.index("--split-mode") + 1] == "layer"
    assert ts[0] - ts[1] == 3_552 and ts[0] < 23_552 - 1024
    own = split.args(["--tensor-split", "1,1", "--split-mode", "layer"])
    assert own.count("--tensor-split") == 1 and own[own.index("--tensor-split") + 1] == "1,1"


# --- the catalog's rules for a profile's gpus ---


def _profile(**given: Any) -> dict[str, Any]:
    return {"name": "m", "source": "hf:o/m", "profiles": [
        {"name": "g", "engine": "llamacpp", "gpu_class": CLASS, **given}]}


@pytest.mark.parametrize(("given", "said"), [
    ({"gpus": "many"}, "gpus must be a number of cards from 1 to 16"),
    ({"gpus": 0}, "gpus must be a number of cards from 1 to 16"),
    ({"gpus": 2, "gpu_class": ""}, "names no gpu_class"),
    ({"gpus": 2, "args": ["--split-mode", "row"]}, "llmgw fits and runs a split layer by layer"),
    ({"gpus": "auto", "args": ["-ts", "1,1"]}, "write gpus: 2 beside it"),
    ({"gpus": 3, "args": ["--tensor-split", "1,1"]}, "write gpus: 2 beside it"),
])
def test_the_catalog_refuses_a_split_it_cannot_place(given: dict[str, Any], said: str) -> None:
    with pytest.raises(ValidationError) as refused:
        CATALOG_MODEL.validate_python(_profile(**given))
    assert said in str(refused.value)


def test_the_catalog_takes_gpus_n_and_auto_and_defaults_to_one() -> None:
    """The control for the refusals above: what a split profile may say."""
    assert CATALOG_MODEL.validate_python(_profile())["profiles"][0]["gpus"] == 1
    for gpus in (2, 16, "auto"):
        assert CATALOG_MODEL.validate_python(_profile(gpus=gpus))["profiles"][0]["gpus"] == gpus
    taken = CATALOG_MODEL.validate_python(_profile(gpus=2, args=["-ts", "3,1", "-sm", "layer"]))
    assert taken["profiles"][0]["args"] == ["-ts", "3,1", "-sm", "layer"]


def test_a_row_stored_before_profiles_said_gpus_takes_one_card() -> None:
    m = split_model(40 * GB)
    del m["profiles"][0]["gpus"]
    assert gpus_of(m, four()) == []
    assert GIB == kv_sizing.GIB


def test_a_profiles_own_tensor_split_takes_as_many_cards_as_it_names() -> None:
    """A 10 GB model one card holds, with gpus: 2 and --tensor-split 1,1: two cards (the
    flag would mean nothing on one). Control: without the flag, one card."""
    own = split_model(10 * GB, gpus=2, args=["--tensor-split", "1,1"])
    assert gpus_of(own, four()) == ["GPU-0", "GPU-1"]
    assert gpus_of(split_model(10 * GB, gpus=2), four()) == ["GPU-0"]
    # With one free card only, it waits, saying why.
    taken = [replica(f"r-{i}", "a", model="o", profile=f"gpu-{CLASS}", gpus=[f"GPU-{i}"])
             for i in range(3)]
    where = place(own, [node("a", gpus=four())], taken, {"big": own, "o": split_model(1)})
    assert where.gpus == [] and "has 1 free rtx-4090-24gb GPU(s)" in where.why, where.why
