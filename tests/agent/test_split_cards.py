"""A model larger than one card, split over several cards of one node: four stand-in 24 GB
cards (tests/standin_nvml), a real agent API over mTLS with its store and scheduler, and
the agent launching the GPU engine (tests/standin_cuda_server.py, which logs its command
line and CUDA_VISIBLE_DEVICES and runs the real CPU llama-server in its place). The
catalog says the model is 40 GB with a 70B model's shape (the file it serves is the tiny
GGUF: the scheduler fits by the catalog, the engine runs what it downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.replicas.supervisor import GPU_START_ATTEMPTS
from llmgw.contract.catalog import CATALOG_MODEL
from tests.agent.gpu_node import cluster
from tests.standin_cuda_server import standin_cuda_server

pytestmark = pytest.mark.slow

FOUR_24GB = ";".join(["NVIDIA GeForce RTX 4090:24564:8.9"] * 4)
CARD = "GPU-5ea1d1e0-0000-4000-8000-{:012d}"
# What the stand-in NVML says a 24 GB card has free: its 24,564 MiB less 1 GiB used.
FREE_MB = 24_564 - 1_024
# As llama.cpp's CUDA build lists a card by itself (--list-devices).
RTX_4090 = "NVIDIA GeForce RTX 4090 (24564 MiB, 23540 MiB free)"
SEVENTY_B = {"block_count": 80, "context_length": 8192, "head_count": 64, "head_count_kv": 8,
             "embedding_length": 8192, "feed_forward_length": 28672}


def split_spec(source: str, sha256: str, *, gb: int, gpus: int | str,
               cpu: bool = True) -> dict[str, Any]:
    """`big`: gb GB as the catalog read it, a 70B shape; its rtx-4090 profile takes gpus,
    and (cpu) a CPU profile beside it."""
    profiles: list[dict[str, Any]] = [
        {"name": "gpu", "engine": "llamacpp", "gpu_class": "rtx-4090", "priority": 200,
         "gpus": gpus, "args": ["--ctx-size", "512"]}]
    if cpu:
        profiles.append({"name": "cpu", "engine": "llamacpp", "priority": 100,
                         "args": ["--ctx-size", "512", "--threads", "1"]})
    return CATALOG_MODEL.validate_python({
        "name": "big", "source": source, "sha256": sha256, "size_bytes": gb * 10**9,
        "geometry": SEVENTY_B, "profiles": profiles})  # type: ignore[return-value]


def launched(starts: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in starts.read_text().splitlines()] \
        if starts.exists() else []


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} given {argv.count(name)} times: {argv}"
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(("gpus", "used_mib", "cards"), [
    ("auto", {}, [0, 1]),
    # Card 0 filled by another process at run time, cards 2 and 3 a little: the two
    # roomiest are 1 and 2, card 2 giving 1,000 MiB less than card 1.
    ("auto", {"0": 20_000, "2": 2_024, "3": 3_024}, [1, 2]),
    # Negative control: one card at most (the default), which no card holds.
    (1, {}, []),
], ids=["four 24GB cards, 40GB model: two cards", "card 0 filled: the split moves",
        "control: gpus 1 does not split"])
def test_a_40gb_model_runs_on_two_24gb_cards_with_their_uuids_and_a_layer_split(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
        served_gguf: tuple[str, str], gpus: int | str, used_mib: dict[str, int],
        cards: list[int]) -> None:
    """One replica, on two cards: the engine as the agent launched it sees exactly those
    two (CUDA_VISIBLE_DEVICES, their UUIDs in order), splits layer by layer, and its
    --tensor-split is what each card gives (their free memory less the same margin and
    compute buffer: the split differs between cards as their free memory does). It
    becomes ready. With gpus: 1 no GPU engine starts; the model serves on its CPU."""
    state = tmp_path / "nvml.json"
    monkeypatch.setenv("LLMGW_STANDIN_NVML_STATE", str(state))
    engine, starts = standin_cuda_server(tmp_path / "cuda", real=llama_server, card=RTX_4090)
    spec = split_spec(*served_gguf, gb=40, gpus=gpus)
    with cluster(tmp_path, monkeypatch, llama_server, served_gguf, cuda_server=engine,
                 starts=starts, cards=FOUR_24GB, spec=spec) as c:
        state.write_text(json.dumps({"used_mib": used_mib}))  # from the next NVML call on
        c.until("the model to be ready", lambda: [s for _, s in c.live()] == ["ready"], 90)
        (replica,) = [r for r in c.store.replicas() if r["state"] != "stopped"]
        assert replica["gpus"] == [CARD.format(i) for i in cards], replica
        if not cards:
            assert replica["profile"] == "cpu" and launched(starts) == []
            return
        (start,) = launched(starts)
        argv = start["argv"]
        assert start["cuda"] == ",".join(CARD.format(i) for i in cards)
        assert flag(argv, "--device") == "CUDA0,CUDA1"
        assert flag(argv, "--split-mode") == "layer"
        gives = [int(v) for v in flag(argv, "--tensor-split").split(",")]
        free = [FREE_MB + 1_024 - used_mib.get(str(i), 1_024) for i in cards]
        assert gives[0] - gives[1] == free[0] - free[1], (gives, free)
        assert all(free[i] - 1_100 < gives[i] < free[i] - 1_024 for i in range(2)), (gives, free)


def test_all_cards_together_too_small_is_said_card_by_card(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
        served_gguf: tuple[str, str]) -> None:
    """A 100 GB model, GPU profile only, gpus: auto: it waits, and its reason gives each of
    the four cards' free memory as NVML reported it against its share; no engine starts.
    Negative control: the same node, a 40 GB model, is placed on two cards."""
    engine, starts = standin_cuda_server(tmp_path / "cuda", real=llama_server, card=RTX_4090)
    spec = split_spec(*served_gguf, gb=100, gpus="auto", cpu=False)
    with cluster(tmp_path, monkeypatch, llama_server, served_gguf, cuda_server=engine,
                 starts=starts, cards=FOUR_24GB, spec=spec,
                 gpu_start_attempts=GPU_START_ATTEMPTS) as c:
        for _ in range(3):
            c.round()
        (waiting,) = c.store.replicas()
        assert waiting["node"] == "" and waiting["gpus"] == [], waiting
        why = waiting.get("err", "")
        assert "gpu-node's 4 free rtx-4090 GPUs together are too small for big" in why, why
        for i in range(4):
            assert f"{CARD.format(i)} (1.0 GiB used by other processes) has 23.0 GiB free; " \
                "its share (" in why, why
        assert launched(starts) == []
        c.store.delete_model("big")
        c.store.add_model(split_spec(*served_gguf, gb=40, gpus="auto", cpu=False))
        c.until("the 40 GB model to be placed", lambda: any(
            r["node"] for r in c.store.replicas() if r["model"] == "big"
            and r["state"] != "stopped"), 30)
        placed = [r for r in c.store.replicas() if r["node"]]
        assert placed[-1]["gpus"] == [CARD.format(0), CARD.format(1)]


@pytest.mark.parametrize("filled", [True, False], ids=["card 0 filled", "control: not filled"])
def test_a_split_whose_card_fills_at_run_time_moves_to_cards_that_fit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
        served_gguf: tuple[str, str], filled: bool) -> None:
    """The replica runs on cards 0 and 1; its engine dies, and meanwhile another process
    fills card 0 (500 MiB left, less than its share's margin). Each start is refused for
    want of memory, naming each card; after GPU_START_ATTEMPTS the node gives the
    placement up and the model is placed again on cards 2 and 3, where it becomes ready.
    Control: card 0 left as it was, the engine is started again on cards 0 and 1."""
    state = tmp_path / "nvml.json"
    monkeypatch.setenv("LLMGW_STANDIN_NVML_STATE", str(state))
    engine, starts = standin_cuda_server(tmp_path / "cuda", real=llama_server, card=RTX_4090)
    spec = split_spec(*served_gguf, gb=40, gpus="auto", cpu=False)
    with cluster(tmp_path, monkeypatch, llama_server, served_gguf, cuda_server=engine,
                 starts=starts, cards=FOUR_24GB, spec=spec) as c:
        c.until("the split replica to be ready", lambda: c.live() == [("gpu", "ready")], 90)
        (first,) = c.store.replicas()
        assert first["gpus"] == [CARD.format(0), CARD.format(1)]
        if filled:
            state.write_text(json.dumps({"used_mib": {"0": 24_064}}))
        c.supervisor.replicas[first["id"]].proc.kill()  # type: ignore[union-attr]
        c.until("a split replica ready after the engine died", lambda: len(launched(starts))
                > 1 and [s for _, s in c.live()] == ["ready"], 120)
        (now,) = [r for r in c.store.replicas() if r["state"] != "stopped"]
        last = launched(starts)[-1]
        if not filled:
            assert now["id"] == first["id"] and last["cuda"] == ",".join(first["gpus"])
            return
        (gone,) = [r for r in c.store.replicas() if r["state"] == "stopped"]
        assert gone["id"] == first["id"] and "after 3 failed starts" in gone["err"]
        assert f"{CARD.format(0)} has 0.5 GiB free; its share (" in gone["err"], gone["err"]
        assert now["gpus"] == [CARD.format(2), CARD.format(3)]
        assert last["cuda"] == f"{CARD.format(2)},{CARD.format(3)}"
        assert len(launched(starts)) == 2, "refused starts never launched the engine"
