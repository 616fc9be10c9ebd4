"""One replica over several nodes (llama.cpp's RPC backend, llmgw.agent.rpc_relay between
them): which main node and which workers, and how many of the model's layers each holds.

Only where no single node fits (the scheduler asks here after its own search found
none), and only for a profile that allows it (`nodes: N`, at most N nodes; `auto`, as
few as fit). Nodes are fitted by what each has free: RAM for a CPU profile (the node's
memory less what its live replicas take, split ones included), the free memory of its
cards for a GPU profile. The main node is the one with the most free (it also holds what
is not a layer: embeddings, output, the KV cache of its layers); workers follow, largest
first, until the layers fit; each node's layers are in proportion to what it gives.

A split replica is one thing: its record names its main node and workers, it counts
against every one of them, and it fails as a whole. A worker that goes away fails it
(broken() says why); when the worker comes back it joins a replica placed anew, never
the old one half-way (the old one is stopped, not resumed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.contract.catalog import MAX_NODES

GIB = 1024**3
# The most devices one split engine is given: llama.cpp's --tensor-split takes fewer values
# than its llama_max_devices() (16), and a GPU split names one value a card of every node.
MAX_DEVICES = 15
# What a node keeps for itself beside a share of a split model: the OS, the agent, and
# rpc-server's or llama-server's own buffers.
RESERVE_BYTES = 1 * GIB


@dataclass(frozen=True)
class Candidate:
    """A ready node that could hold part of a replica: its id and what it has free."""

    node: str
    free_bytes: int


@dataclass(frozen=True)
class SplitPlacement:
    """Where a split replica goes: main and workers with their layers, or why it cannot."""

    main: str = ""
    main_layers: int = 0
    workers: list[tuple[str, int]] = field(default_factory=list)
    why: str = ""

    @property
    def worker_layers(self) -> int:
        """The main engine's --n-gpu-layers: the layers its RPC devices hold."""
        return sum(n for _, n in self.workers)

    def tensor_split(self) -> str:
        """The main engine's --tensor-split over its RPC devices, in the workers' order."""
        return ",".join(str(n) for _, n in self.workers)

    @property
    def nodes(self) -> list[str]:
        return [self.main, *(w for w, _ in self.workers)] if self.main else []


def parse_nodes(value: str | int) -> int:
    """A profile's `nodes:`: 1 (the default: never split), N, or `auto` (as few as fit, at
    most MAX_NODES)."""
    if value == "auto":
        return MAX_NODES
    n = int(value)
    if not 1 <= n <= MAX_NODES:
        raise ValueError(f"nodes is {value!r}; it is 1 to {MAX_NODES}, or auto")
    return n


def place_split(need_bytes: int, layers: int, candidates: list[Candidate],
                max_nodes: int, reserve: int = RESERVE_BYTES) -> SplitPlacement:
    """The fewest nodes, largest free first, whose free memory (less reserve each: a GPU
    node's candidates are given with their cards' reserve already taken) holds need_bytes,
    with each node's layers in proportion to what it gives; or why none."""
    if max_nodes < 2:
        return SplitPlacement(why="the profile does not allow a split (nodes: 1)")
    if layers < 2:
        return SplitPlacement(why=f"the model has {layers} layer(s): nothing to split")
    usable = sorted((Candidate(c.node, c.free_bytes - reserve) for c in candidates
                     if c.free_bytes > reserve), key=lambda c: (-c.free_bytes, c.node))
    chosen: list[Candidate] = []
    for c in usable[:min(max_nodes, layers)]:
        chosen.append(c)
        if len(chosen) >= 2 and sum(x.free_bytes for x in chosen) >= need_bytes:
            return _layers(chosen, layers)
    have = sum(c.free_bytes for c in usable[:max_nodes])
    said = ", ".join(f"{c.node} {c.free_bytes / GIB:.1f} GiB" for c in usable[:max_nodes])
    kept = f", each less {reserve / GIB:.0f} GiB kept for itself" if reserve else ""
    return SplitPlacement(why=(
        f"split over at most {max_nodes} nodes it needs {need_bytes / GIB:.1f} GiB and they "
        f"give {have / GIB:.1f} GiB ({said or 'no node has memory free'}{kept})"))


def _layers(chosen: list[Candidate], layers: int) -> SplitPlacement:
    total = sum(c.free_bytes for c in chosen)
    shares = [max(1, c.free_bytes * layers // total) for c in chosen]
    # Rounding: the largest node (the main) takes what the floors left, or gives back.
    shares[0] += layers - sum(shares)
    return SplitPlacement(main=chosen[0].node, main_layers=shares[0],
                          workers=[(c.node, n) for c, n in zip(chosen[1:], shares[1:],
                                                               strict=True)])


def broken(nodes: list[str], ready: set[str]) -> str:
    """Why a split replica over nodes (main first) cannot go on: the first of them that is
    not ready; '' while all are. A broken replica is stopped and placed anew."""
    for i, node in enumerate(nodes):
        if node not in ready:
            role = "main node" if i == 0 else "worker"
            return (f"its {role} {node} is not ready: llama.cpp's RPC has no failover, so the "
                    "replica is stopped and placed again where it now fits")
    return ""
