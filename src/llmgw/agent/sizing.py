"""A GPU replica's slots, sized at each start for its cards' free memory at that moment
(llmgw.model.kv_sizing's formula, on the geometry of the weights file it runs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from llmgw.contract.records import Geometry, Gpu
from llmgw.errors import Error
from llmgw.model import kv_sizing
from llmgw.model.ggufmeta import GGUFError, geometry

MIB = kv_sizing.MIB

T = TypeVar("T")


class DoesNotFit(Error):
    """The replica's cards have too little free memory for one slot now; the message says
    which, free against needed."""


@dataclass(frozen=True)
class Sized:
    """The engine's args, and a line saying how they were sized (or why they were not)."""

    args: list[str]
    note: str


def gpu_args(args: Sequence[str], weights: Path, uuids: Sequence[str],
             cards: Sequence[Gpu]) -> Sized:
    """args for a replica on the GPUs `uuids`: with --parallel and --ctx-size for the free
    memory NVML reports of those cards now, where the profile names no --parallel. As they
    are where there is nothing to size by (the profile's own --parallel, a file whose
    geometry cannot be read, a card NVML does not answer for); DoesNotFit where one slot
    does not fit."""
    given = list(args)
    if len(uuids) > 1:
        return _split_args(given, weights, uuids, cards)
    if not kv_sizing.sized(given):
        return Sized(given, "the profile names --parallel")
    mine = [c for c in cards if c.get("uuid") in uuids]
    if len(mine) != len(uuids) or any(c.get("error") for c in mine):
        return Sized(given, "NVML does not answer for its GPUs now, so llama-server's "
                            "default slots")
    free_mb = sum(int(c.get("memory_free_mb", 0)) for c in mine)
    sizing = _sized(weights, lambda shape, size: kv_sizing.size(shape, size, free_mb * MIB,
                                                                given))
    if isinstance(sizing, str):
        return Sized(given, sizing)
    if not sizing.fits():
        raise _taken(f"{', '.join(uuids)} has {free_mb} MiB free now, and one slot of "
                     f"{sizing.ctx_per_slot} tokens needs {sizing.total // MIB} MiB "
                     f"({sizing.explain()})", "the card")
    return Sized(kv_sizing.engine_args(given, sizing),
                 f"{sizing.slots} slots of {sizing.ctx_per_slot} tokens for {free_mb} MiB "
                 f"free ({sizing.explain()})")


def _split_args(given: list[str], weights: Path, uuids: Sequence[str],
                cards: Sequence[Gpu]) -> Sized:
    """args for a replica split over several cards, numbered in the order of uuids:
    --split-mode layer and a --tensor-split of what each card gives now (its free memory
    less llama.cpp's margin and a compute buffer), with the slots every card holds its
    share of (kv_sizing.size_split); a profile's own split flags and --parallel win.
    Where there is nothing to size by, --split-mode layer alone: llama.cpp then splits
    by each card's free memory itself."""
    by_uuid = {c.get("uuid"): c for c in cards}
    mine = [by_uuid.get(u) for u in uuids]
    plain = [*given, *([] if any(a in kv_sizing.SPLIT_MODE_FLAGS for a in given)
                       else ["--split-mode", "layer"])]
    if any(c is None or c.get("error") for c in mine):
        return Sized(plain, "NVML does not answer for its GPUs now, so llama.cpp splits "
                            "them by their free memory")
    frees = [int(c.get("memory_free_mb", 0)) * MIB for c in mine if c is not None]
    split = _sized(weights, lambda shape, size: kv_sizing.size_split(shape, size, frees, given))
    if isinstance(split, str):
        return Sized(plain, split)
    if not split.fits():
        raise _taken(f"{', '.join(uuids)} together have {sum(frees) // MIB} MiB free now, "
                     f"too little for one slot of {split.ctx_per_slot} tokens split layer "
                     f"by layer: {split.explain(list(uuids))}", "memory")
    layers = "/".join(str(s.layers) for s in split.shares)
    return Sized(split.args(given),
                 f"split over {len(uuids)} GPUs ({layers} layers, the output on the last), "
                 f"{split.slots} slot{'s' if split.slots != 1 else ''} of "
                 f"{split.ctx_per_slot} tokens")


def _sized(weights: Path, size: Callable[[Geometry, int], T | None]) -> T | str:
    """size(the weights file's KV geometry, its size in bytes), or why there is nothing to
    size by."""
    try:
        shape, length = geometry(weights), weights.stat().st_size
    except (OSError, GGUFError) as e:
        return f"its file's geometry cannot be read ({e})"
    sized = size(shape, length)
    return "its file does not say its KV geometry" if sized is None else sized


def _taken(found: str, what: str) -> DoesNotFit:
    """What was found, and why it changed since the replica was placed."""
    return DoesNotFit(f"{found}; another process took {what} since this replica was placed")
