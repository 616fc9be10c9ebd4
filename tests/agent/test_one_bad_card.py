"""One bad card is one card: on a node with two H100s (the stand-in NVML) whose GPU engine's
`--list-devices` names only the second, the first is named and left out, the engine is
ready for the second, the heartbeat says which passed, and the model's GPU replica serves
from the second card (the real llama-server behind a stand-in that logs its placement)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.contract import CUDA_ENGINE, EngineState
from tests.agent.gpu_node import H100, cluster
from tests.standin_cuda_server import standin_cuda_server

pytestmark = pytest.mark.slow

TWO_H100 = f"{H100};{H100}"
# The stand-in NVML's UUIDs for cards 0 and 1.
CARD = [f"GPU-5ea1d1e0-0000-4000-8000-{i:012d}" for i in range(2)]


def listing_engine(directory: Path, real: str, names: list[str]) -> tuple[Path, Path]:
    """A GPU engine whose --list-devices names an H100 as CUDA0 only when
    CUDA_VISIBLE_DEVICES is one of names (for another card it lists none, as a card the
    driver cannot run does); a replica it starts is logged (argv, CUDA_VISIBLE_DEVICES)
    and run by the real CPU llama-server, without the GPU flags a CPU build cannot honour."""
    return standin_cuda_server(directory, real=real, visible=names)


def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
          served_gguf: tuple[str, str], names: list[str]) -> tuple[list[str], dict, list[str]]:
    """The GPU replica's cards, the node's GPU engine entry and its warnings, once the
    model serves on its GPU profile."""
    engine, starts = listing_engine(tmp_path / "cuda", llama_server, names)
    with cluster(tmp_path, monkeypatch, llama_server, served_gguf, cuda_server=engine,
                 starts=starts, cards=TWO_H100) as c:
        assert c.agent.cuda.status["state"] == EngineState.READY, c.agent.cuda.status
        c.until("the model to serve on a GPU", lambda: c.live() == [("gpu-h100-80gb", "ready")],
                90)
        (replica,) = [r for r in c.store.replicas() if r["state"] == "ready"]
        launched = [json.loads(line) for line in starts.read_text().splitlines()]
        assert [run["cuda"] for run in launched] == replica["gpus"], "held to its card"
        inventory = c.store.node("gpu-node")["inventory"]  # type: ignore[index]
        (entry,) = [p for p in inventory["provision"] if p["engine"] == CUDA_ENGINE]
        return replica["gpus"], dict(entry), list(inventory["warnings"])


def test_one_of_two_cards_failing_its_check_leaves_the_other_serving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
        served_gguf: tuple[str, str]) -> None:
    gpus, entry, warnings = serve(tmp_path, monkeypatch, llama_server, served_gguf, [CARD[1]])
    assert gpus == [CARD[1]]
    assert entry["state"] == "ready" and entry["gpus"] == [CARD[1]]
    assert list(entry["left_out"]) == [CARD[0]]
    assert "names no CUDA device" in entry["left_out"][CARD[0]]
    assert "1 of 2 GPU(s) passed its check" in entry["detail"]
    assert any(w.startswith(f"GPU {CARD[0]} is left out of the GPU engine") for w in warnings), \
        warnings


def test_control_with_both_cards_passing_the_replica_takes_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
        served_gguf: tuple[str, str]) -> None:
    """The first card is passed over above because it failed its check, not by chance."""
    gpus, entry, warnings = serve(tmp_path, monkeypatch, llama_server, served_gguf, CARD)
    assert gpus == [CARD[0]]
    assert entry["gpus"] == CARD and entry["left_out"] == {}
    assert not any("left out" in w for w in warnings)
