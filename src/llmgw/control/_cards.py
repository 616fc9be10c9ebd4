"""One replica over several of a node's cards: which free cards a profile's `gpus` lets it
take (the fewest that fit, the roomiest first), fitted card by card by llama.cpp's layer
split (kv_sizing.size_split), or why even all of them together are too small."""

from __future__ import annotations

from llmgw.contract.catalog import cards_wanted
from llmgw.contract.records import Gpu, ModelSpec, ProfileSpec
from llmgw.model import kv_sizing

MIB = kv_sizing.MIB
GIB = kv_sizing.GIB


def free_bytes(gpu: Gpu) -> int:
    """What NVML reported free on the card at the node's last heartbeat (its total where
    NVML could not say, or from an agent that does not report free memory)."""
    free_mb = gpu.get("memory_free_mb")
    if free_mb is None or "memory_free_mb" in (gpu.get("unknown") or []):
        free_mb = gpu.get("memory_mb", 0)
    return int(free_mb * MIB)


def card_name(gpu: Gpu) -> str:
    return str(gpu.get("uuid") or gpu.get("index", "?"))


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def split(model: ModelSpec, profile: ProfileSpec, frees: list[int]) -> kv_sizing.Split | None:
    """How a replica of profile is sized over cards with `frees` bytes free, in order;
    None when the model's size or geometry is unknown."""
    if not model["size_bytes"]:
        return None
    return kv_sizing.size_split(model["geometry"], model["size_bytes"], frees, profile["args"])


def roomiest(cards: list[Gpu], k: int) -> list[Gpu]:
    """The k cards with the most free memory, in the node's order (the order the engine
    numbers them; of equals, the first)."""
    chosen = sorted(cards, key=lambda g: -free_bytes(g))[:k]
    return [g for g in cards if any(g is c for c in chosen)]


def fit(model: ModelSpec, profile: ProfileSpec, node_id: str, cards: list[Gpu],
        others: list[str]) -> tuple[list[str], str]:
    """(the UUIDs, in the node's order, of the fewest free cards from two (or as many as
    the profile's own --tensor-split names) up to the profile's gpus that one replica fits
    over, the roomiest preferred, ''), or ([], why:
    each of the roomiest cards' free memory against its share, and the cards not free).
    One card is the scheduler's to try first: a split is only for what no card holds."""
    most = min(cards_wanted(profile), len(cards))
    if most < 2:
        return [], ""
    # A profile's own --tensor-split names one proportion a card: that many, no fewer.
    least = max(2, len(kv_sizing.tensor_split(profile["args"])))
    for k in range(least, most + 1):
        chosen = roomiest(cards, k)
        sizing = split(model, profile, [free_bytes(g) for g in chosen])
        if sizing is None or sizing.fits():
            return [str(g.get("uuid", "")) for g in chosen], ""
    return [], _too_small(model, profile, node_id, roomiest(cards, most), others)


def _too_small(model: ModelSpec, profile: ProfileSpec, node_id: str, chosen: list[Gpu],
               others: list[str]) -> str:
    sizing = split(model, profile, [free_bytes(g) for g in chosen])
    assert sizing is not None
    names = []
    for g in chosen:
        used = g.get("memory_used_mb")
        names.append(card_name(g) + (f" ({_gib(used * MIB)} used by other processes)"
                                     if used else ""))
    need = sum(s.total for s in sizing.shares)
    have = sum(free_bytes(g) for g in chosen)
    wanted = profile.get("gpus", 1)
    rest = f"; not free: {'; '.join(others)}" if others else ""
    return (f"node {node_id}'s {len(chosen)} free {profile['gpu_class']} GPUs together are "
            f"too small for {model['name']} (gpus: {wanted}): they have {_gib(have)} free, "
            f"and split layer by layer one slot of {sizing.ctx_per_slot} tokens needs "
            f"{_gib(need)}: {sizing.explain(names)}{rest}")
