"""Where a split replica goes (llmgw.control._split): pure logic over nodes' free memory."""

from __future__ import annotations

import itertools

import pytest

from llmgw.control._split import GIB, RESERVE_BYTES, Candidate, broken, parse_nodes, place_split


def _nodes(**free_gib: float) -> list[Candidate]:
    return [Candidate(n, int(g * GIB) + RESERVE_BYTES) for n, g in free_gib.items()]


def test_a_model_no_node_holds_is_split_over_the_fewest_largest_nodes() -> None:
    """40 GiB over nodes giving 24, 20 and 8: main a (the largest), one worker b; layers in
    proportion (24:20 of 40 layers). The control: with nodes: 1 nothing is split."""
    p = place_split(40 * GIB, 40, _nodes(c=8, a=24, b=20), max_nodes=parse_nodes("auto"))
    assert (p.main, p.workers, p.why) == ("a", [("b", 18)], "")
    assert p.main_layers == 22 and p.worker_layers == 18 and p.tensor_split() == "18"
    assert p.nodes == ["a", "b"]
    assert place_split(40 * GIB, 40, _nodes(a=24, b=20), max_nodes=1).why.startswith(
        "the profile does not allow")


def test_nodes_n_caps_the_split_and_the_refusal_says_what_they_give() -> None:
    """With nodes: 2, three nodes of 16 GiB cannot hold 40 GiB: the reason names the need,
    what the two largest give and the reserve each keeps. The control: nodes: 3 fits."""
    p = place_split(40 * GIB, 30, _nodes(a=16, b=16, c=16), max_nodes=2)
    assert p.main == "" and "needs 40.0 GiB and they give 32.0 GiB" in p.why, p.why
    assert "kept for itself" in p.why
    p = place_split(40 * GIB, 30, _nodes(a=16, b=16, c=16), max_nodes=3)
    assert p.nodes == ["a", "b", "c"] and [p.main_layers, *(n for _, n in p.workers)] == \
        [10, 10, 10]


@pytest.mark.parametrize("layers, frees", list(itertools.product(
    [2, 3, 7, 40], [(30, 1, 1), (5, 5, 5, 5), (100, 3), (9, 8, 1, 1, 1)])))
def test_every_node_of_a_split_holds_a_layer_and_the_layers_add_up(
        layers: int, frees: tuple[int, ...]) -> None:
    """However the memory falls, each chosen node holds at least one layer and the layers
    sum to the model's (a model of N layers goes on N nodes at most)."""
    nodes = _nodes(**{f"n{i}": g for i, g in enumerate(frees)})
    p = place_split(sum(sorted(frees)[-2:]) * GIB, layers, nodes, max_nodes=8)
    assert not p.why, p.why
    held = [p.main_layers, *(n for _, n in p.workers)]
    assert sum(held) == layers and min(held) >= 1, held


def test_a_lost_node_breaks_the_replica_and_names_its_role() -> None:
    """A worker not ready breaks the split replica (it is stopped and placed anew, never
    rejoined); the control: all ready, nothing to say."""
    assert broken(["a", "b"], {"a", "b"}) == ""
    assert broken(["a", "b"], {"a"}).startswith("its worker b is not ready")
    assert broken(["a", "b"], {"b"}).startswith("its main node a is not ready")


def test_nodes_is_one_to_eight_or_auto() -> None:
    assert parse_nodes("auto") == 8 and parse_nodes(2) == 2
    with pytest.raises(ValueError, match="1 to 8"):
        parse_nodes(0)
