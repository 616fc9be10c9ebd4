"""A GPU replica's slots, sized at each start for its cards' free memory at that moment
(llmgw.model.kv_sizing's formula, on the geometry of the weights file it runs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.contract.records import Gpu
from llmgw.errors import Error
from llmgw.model import kv_sizing
from llmgw.model.ggufmeta import GGUFError, geometry

MIB = kv_sizing.MIB


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
    if not kv_sizing.sized(given):
        return Sized(given, "the profile names --parallel")
    mine = [c for c in cards if c.get("uuid") in uuids]
    if len(mine) != len(uuids) or any(c.get("error") for c in mine):
        return Sized(given, "NVML does not answer for its GPUs now, so llama-server's "
                            "default slots")
    try:
        shape = geometry(weights)
        size = weights.stat().st_size
    except (OSError, GGUFError) as e:
        return Sized(given, f"its file's geometry cannot be read ({e})")
    free_mb = sum(int(c.get("memory_free_mb", 0)) for c in mine)
    sizing = kv_sizing.size(shape, size, free_mb * MIB, given)
    if sizing is None:
        return Sized(given, "its file does not say its KV geometry")
    if not sizing.fits():
        raise DoesNotFit(f"{', '.join(uuids)} has {free_mb} MiB free now, and one slot of "
                         f"{sizing.ctx_per_slot} tokens needs {sizing.total // MIB} MiB "
                         f"({sizing.explain()}); another process took the card since "
                         "this replica was placed")
    return Sized(kv_sizing.engine_args(given, sizing),
                 f"{sizing.slots} slots of {sizing.ctx_per_slot} tokens for {free_mb} MiB "
                 f"free ({sizing.explain()})")
