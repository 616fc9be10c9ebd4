"""The command lines of a split replica's engines (llama.cpp's RPC backend): a worker's
rpc-server, and the main engine's flags for its workers, on CPU or on cards. The relay
that carries their traffic is llmgw.agent.rpc_relay's; where a split goes,
control/_split.py's."""

from __future__ import annotations

import shutil

from llmgw.agent.replicas.process import ALL_LAYERS
from llmgw.agent.rpc_relay import LOOPBACK
from llmgw.model.engine_args import rpc_server_args


def rpc_server_command(binary: str, port: int, profile_args: list[str],
                       cards: int = 0) -> list[str]:
    """A worker's rpc-server: on 127.0.0.1:port only (the relay is its one way in), with
    the profile's rpc-server flags that engine_args allows (its threads), nothing else.
    On cards (its CUDA_VISIBLE_DEVICES holds it to them): --device names each, CUDA0..,
    since without it an rpc-server whose CUDA does not come up serves the CPU instead and
    the share would run there unseen; with it, it exits. Line-buffered where stdbuf is
    found, so its log says each connection as it comes."""
    stdbuf = shutil.which("stdbuf")
    devices = ["--device", ",".join(f"CUDA{i}" for i in range(cards))] if cards else []
    return [*([stdbuf, "-oL"] if stdbuf else []), binary, "--host", LOOPBACK,
            "--port", str(port), *devices, *rpc_server_args(profile_args)]


# The output layer's weights (token_embd's where the model ties them) stay on the main node.
OUTPUT_ON_MAIN = r"^(output|token_embd)\.weight$=CPU"


def main_flags(endpoints: str, worker_layers: int) -> list[str]:
    """The main engine's flags for its workers: their relayed endpoints, and the model's
    last worker_layers repeating layers on them (the rest stay on the main node).
    llama.cpp counts the output layer as the last of --n-gpu-layers (1 would offload only
    it), so it is asked for one more and the output's weights are kept on the main node,
    which the placement counts them against (control/_split.py)."""
    return ["--rpc", endpoints, "--n-gpu-layers", str(worker_layers + 1),
            "--override-tensor", OUTPUT_ON_MAIN]


def gpu_main_flags(endpoints: str, split: list[int]) -> list[str]:
    """A main engine on cards: every layer offloaded, layer by layer over its devices as
    llama.cpp lists them (the workers' RPC devices first, each worker's cards in order, then
    the main's own cards), split holding one count of layers a device. The output layer
    goes with the last layers, to the main's last card: kept off its CPU (no
    --override-tensor as main_flags has, which would put it there)."""
    return ["--rpc", endpoints, "--n-gpu-layers", ALL_LAYERS, "--split-mode", "layer",
            "--tensor-split", ",".join(str(n) for n in split)]


def even(layers: int, cards: int) -> list[int]:
    """layers shared over cards as evenly as whole layers go (the first take the rest)."""
    return [layers // cards + (i < layers % cards) for i in range(cards)]
