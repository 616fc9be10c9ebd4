"""A GPU replica's slots, sized at its start for its card's free memory then: the engine
is started with --parallel and --ctx-size from llmgw.model.kv_sizing on the weights file's own
geometry; a profile's --parallel wins; a CPU replica keeps llama-server's default slots;
a card filled since the placement fails the start, saying free against needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.replicas.process import Record
from llmgw.agent.replicas.supervisor import Replica, ReplicaSupervisor
from llmgw.agent.sizing import DoesNotFit, gpu_args
from llmgw.contract import CUDA_ENGINE
from llmgw.model import kv_sizing
from llmgw.model.ggufmeta import geometry
from tests.tiny_gguf import write_tiny_gguf

MIB = 1 << 20
CARD = {"index": 0, "uuid": "GPU-a", "class": "h100-80gb", "memory_mb": 81_559,
        "memory_free_mb": 80_535, "memory_used_mb": 1_024, "error": ""}


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def test_a_gpu_replica_gets_the_formulas_slots_for_its_cards_free_memory(tiny: Path) -> None:
    """The tiny GGUF on an H100 with 80,535 MiB free: 64 slots of its 2048-token training
    context (kv_sizing; tests/model/test_kv_sizing.py works the sums out), the profile's other
    args kept and its --ctx-size read as each slot's."""
    sized = gpu_args(["--ctx-size", "32768", "--temp", "0.2"], tiny, ["GPU-a"], [CARD])
    assert sized.args == ["--temp", "0.2", "--parallel", "64", "--ctx-size", str(64 * 2048)]
    assert sized.note.startswith("64 slots of 2048 tokens for 80535 MiB free")
    # The same as the scheduler's estimate: one formula.
    expected = kv_sizing.size(geometry(tiny), tiny.stat().st_size, 80_535 * MIB,
                              ["--ctx-size", "32768"])
    assert expected is not None and sized.args[-4:] == expected.args()


def test_the_profiles_own_parallel_wins_and_an_unread_card_is_not_sized(tiny: Path) -> None:
    given = ["-np", "2", "-c", "4096"]
    assert gpu_args(given, tiny, ["GPU-a"], [CARD]).args == given
    lost = {**CARD, "error": "GPU is lost", "memory_free_mb": 0}
    assert gpu_args(["-c", "512"], tiny, ["GPU-a"], [lost]).args == ["-c", "512"]


def test_a_card_filled_since_the_placement_fails_the_start_saying_why(tiny: Path) -> None:
    full = {**CARD, "memory_free_mb": 900}
    with pytest.raises(DoesNotFit, match=r"GPU-a has 900 MiB free now, and one slot of 2048 "
                                          r"tokens needs 102\d MiB"):
        gpu_args([], tiny, ["GPU-a"], [full])


def _engine(tmp_path: Path) -> Path:
    """A stand-in llama-server that only waits: the test reads its command line."""
    path = tmp_path / "bin" / "llama-server"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\nexec sleep 30\n")
    path.chmod(0o755)
    return path


def _started(tmp_path: Path, tiny: Path, gpus: list[str], free_mb: int) -> list[str]:
    engine = _engine(tmp_path)
    card = {**CARD, "memory_free_mb": free_mb}
    sup = ReplicaSupervisor(state_dir=tmp_path / "agent", weights_dir=tmp_path / "w",
                            engine=lambda kind: str(engine), bind_host="127.0.0.1",
                            gpus=[CARD], cards=lambda: [card])
    record = Record(id="r-1", model="tiny", profile="p", source="http://x/tiny.gguf",
                    sha256="", args=["--ctx-size", "1024"], weights=str(tiny),
                    engine=CUDA_ENGINE if gpus else "llamacpp", gpus=gpus)
    replica = Replica(record)
    sup.start_engine(replica)
    assert replica.proc is not None
    argv: Any = replica.proc.args
    replica.proc.kill()
    replica.proc.wait(timeout=10)
    return [str(a) for a in argv]


def test_the_supervisor_starts_a_gpu_replica_sized_and_a_cpu_one_with_default_slots(
        tmp_path: Path, tiny: Path) -> None:
    on_gpu = _started(tmp_path / "gpu", tiny, ["GPU-a"], 80_535)
    assert on_gpu[on_gpu.index("--parallel") + 1] == "64"
    assert on_gpu[on_gpu.index("--ctx-size") + 1] == str(64 * 1024)
    # Negative control: the CPU profile's replica is not sized (llama-server's 4 slots).
    on_cpu = _started(tmp_path / "cpu", tiny, [], 80_535)
    assert "--parallel" not in on_cpu and on_cpu[on_cpu.index("--ctx-size") + 1] == "1024"


# --- a replica over several cards ---

CARD_B = {**CARD, "index": 1, "uuid": "GPU-b", "memory_free_mb": 70_535, "memory_used_mb": 11_024}


def test_a_replica_on_two_cards_splits_layers_by_what_each_gives_in_the_uuids_order(
        tiny: Path) -> None:
    """Numbered as CUDA_VISIBLE_DEVICES names them (GPU-b first here): --split-mode layer,
    a --tensor-split of each card's room (10,000 MiB apart, as their free memory is),
    the slots every card holds its share of."""
    sized = gpu_args(["--ctx-size", "512"], tiny, ["GPU-b", "GPU-a"], [CARD, CARD_B])
    args = sized.args
    assert args[args.index("--split-mode") + 1] == "layer"
    b, a = (int(v) for v in args[args.index("--tensor-split") + 1].split(","))
    assert a - b == 10_000 and a < 80_535 - 1024
    assert args[args.index("--parallel") + 1] == "64" and "-c" not in args
    assert sized.note.startswith("split over 2 GPUs (")
    # Negative control: one card is not split.
    assert "--split-mode" not in gpu_args(["--ctx-size", "512"], tiny, ["GPU-a"], [CARD]).args


def test_a_profiles_own_split_flags_win_and_an_unread_card_leaves_llama_cpp_to_split(
        tiny: Path) -> None:
    own = ["--tensor-split", "1,3", "--split-mode", "layer", "-c", "512"]
    args = gpu_args(own, tiny, ["GPU-a", "GPU-b"], [CARD, CARD_B]).args
    assert args.count("--tensor-split") == 1 and args[args.index("--tensor-split") + 1] == "1,3"
    assert args.count("--split-mode") == 1
    lost = {**CARD_B, "error": "GPU is lost", "memory_free_mb": 0}
    plain = gpu_args(["-c", "512"], tiny, ["GPU-a", "GPU-b"], [CARD, lost])
    assert plain.args == ["-c", "512", "--split-mode", "layer"]
    assert "llama.cpp splits them by their free memory" in plain.note


def test_a_split_whose_card_filled_since_the_placement_fails_naming_each_card(
        tiny: Path) -> None:
    full = {**CARD_B, "memory_free_mb": 600}
    with pytest.raises(DoesNotFit) as refused:
        gpu_args([], tiny, ["GPU-a", "GPU-b"], [CARD, full])
    said = str(refused.value)
    assert "GPU-a, GPU-b together have 81135 MiB free now" in said
    assert "GPU-b has 0.6 GiB free; its share (" in said and "GPU-a has 78.6 GiB free" in said
