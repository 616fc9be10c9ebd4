"""Live cards: each heartbeat carries each card's free and used memory as NVML reads them
at that beat. With the stand-in NVML (tests/standin_nvml, two H100s), changed while the
agent runs through its state file: a card a foreign process fills is seen at the next
heartbeat and gets no new replica; a card that stops answering is named in the heartbeat
and the other is still listed and used. A real agent API and store, the real scheduler."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from llmgw.agent.agent import Agent
from llmgw.agent.engines.common import engine_status
from llmgw.agent.engines.cpu import LlamaCpp
from llmgw.agent.gpus import LiveCards, discover
from llmgw.config import AgentConfig, EngineConfig, TLSFiles
from llmgw.contract import CPU_ENGINE, CUDA_ENGINE, EngineState
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.control.nodes import node_view
from llmgw.control.scheduler import GIB, Scheduler
from llmgw.host import pki
from llmgw.store import Store

STANDIN = Path(__file__).resolve().parents[1] / "standin_nvml" / "pynvml.py"
TWO_H100 = "NVIDIA H100 80GB HBM3:81559:9.0;NVIDIA H100 80GB HBM3:81559:9.0"
CARD = "GPU-5ea1d1e0-0000-4000-8000-{:012d}"
# Qwen2.5-7B's shape and an 8 GiB file: one 8192-token slot needs about 10 GiB.
QWEN7 = {"block_count": 28, "context_length": 32768, "head_count": 28, "head_count_kv": 4,
         "embedding_length": 3584, "feed_forward_length": 18944}


def standin_nvml() -> ModuleType:
    """The stand-in pynvml as a module of its own (the real one stays importable)."""
    loader = SourceFileLoader("standin_pynvml", str(STANDIN))
    spec = spec_from_loader("standin_pynvml", loader)
    assert spec is not None
    module = module_from_spec(spec)
    loader.exec_module(module)
    return module


@dataclass
class Node:
    agent: Agent
    store: Store
    state: Path

    def nvml(self, **state: Any) -> None:
        """What the stand-in NVML answers from its next call on."""
        self.state.write_text(json.dumps(state))

    def stored_cards(self) -> list[dict[str, Any]]:
        return list(node_view(self.store.nodes()[0], self.store.clock(), 30)["gpus"])

    def warnings(self) -> list[str]:
        return list(node_view(self.store.nodes()[0], self.store.clock(), 30)["warnings"])


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    """Function: an agent on two stand-in H100s with both engines ready, beating to a real
    agent API whose catalog has a model with an H100 profile (and a CPU one)."""
    monkeypatch.setenv("LLMGW_STANDIN_GPUS", TWO_H100)
    state = tmp_path / "nvml.json"
    monkeypatch.setenv("LLMGW_STANDIN_NVML_STATE", str(state))
    nvml = standin_nvml()
    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, ["127.0.0.1"]).write(tmp_path, "server")
    cert, key = pki.issue_client(ca, "node-a").write(tmp_path, "agent")
    store = Store(tmp_path / "control.db")
    store.add_model({
        "name": "qwen", "aliases": [], "description": "", "source": "http://mirror/q.gguf",
        "sha256": "", "routing_profile": "chat", "context_length": 4096, "max_output": 1024,
        "scaling": {"min": 1, "max": 1}, "size_bytes": 8 * GIB, "geometry": dict(QWEN7),
        "profiles": [
            {"name": "gpu", "engine": "llamacpp", "gpu_class": "h100-80gb", "priority": 200,
             "min_memory_gb": 0, "node_selector": {}, "args": []},
            {"name": "cpu", "engine": "llamacpp", "gpu_class": "", "priority": 100,
             "min_memory_gb": 0, "node_selector": {}, "args": []}]})
    server = AgentAPIServer("127.0.0.1", 0, mtls_context(
        str(tmp_path / "ca.pem"), str(tmp_path / "server.pem"),
        str(tmp_path / "server-key.pem")), AgentAPI(store))
    server.start()
    config = AgentConfig(server=f"https://127.0.0.1:{server.port}", node_id="node-a",
                         state_dir=str(tmp_path), heartbeat_s=0.1,
                         tls=TLSFiles(ca=str(tmp_path / "ca.pem"), cert=str(cert), key=str(key)),
                         engine=EngineConfig(cache_dir=str(tmp_path / "cache")))
    found = discover(nvml=nvml)
    agent = Agent(config, engine=LlamaCpp(config.engine), discover=lambda: found,
                  cards=LiveCards(found.gpus, nvml).read)
    agent.engine._status = engine_status(CPU_ENGINE, "v", EngineState.READY)
    agent.cuda._status = engine_status(CUDA_ENGINE, "v", EngineState.READY)
    try:
        yield Node(agent, store, state)
    finally:
        agent.client.close()
        server.stop()
        store.close()


@pytest.mark.parametrize("filled", [True, False], ids=["card 0 filled", "control: not filled"])
def test_a_card_filled_at_run_time_is_seen_at_the_next_beat_and_gets_no_new_replica(
        node: Node, filled: bool) -> None:
    """Card 0 answers with 80,000 MiB used by someone else from one beat to the next: the
    heartbeat after says so, and the scheduler places the model on card 1. The control,
    card 0 left as it was, gets the replica (the first free card that fits)."""
    node.agent.beat()
    assert [c["memory_free_mb"] for c in node.stored_cards()] == [80_535, 80_535]
    if filled:
        node.nvml(used_mib={"0": 80_000})
    beats = 0
    while beats < 2 and node.stored_cards()[0]["memory_free_mb"] > 2_000:
        node.agent.beat()
        beats += 1
    card0 = node.stored_cards()[0]
    if filled:
        assert (card0["memory_free_mb"], card0["memory_used_mb"]) == (1_559, 80_000), card0
        assert beats == 1, "seen at the first heartbeat after the card filled"
    plan = Scheduler(node.store, 30.0).tick()
    assert [(r["profile"], r["gpus"]) for r in plan.add] == [
        ("gpu", [CARD.format(1 if filled else 0)])]


def test_a_card_that_stops_answering_is_named_and_the_other_still_serves(node: Node) -> None:
    """Card 0 lost: the heartbeat still lists both cards, card 0 with NVML's reason and no
    free memory, and a warning a person reads; the replica goes to card 1."""
    node.nvml(lost=[0])
    node.agent.beat()
    cards = node.stored_cards()
    assert [c["uuid"] for c in cards] == [CARD.format(0), CARD.format(1)]
    assert (cards[0]["error"], cards[0]["memory_free_mb"]) == ("GPU is lost", 0)
    assert (cards[1]["error"], cards[1]["memory_free_mb"]) == ("", 80_535)
    assert any("stopped answering NVML (GPU is lost)" in w for w in node.warnings())
    plan = Scheduler(node.store, 30.0).tick()
    assert [r["gpus"] for r in plan.add] == [[CARD.format(1)]]
    # Negative control: once it answers again, the next beat clears its error.
    node.nvml()
    node.agent.beat()
    assert node.stored_cards()[0]["error"] == "" and not any(
        "stopped answering" in w for w in node.warnings())


def test_both_cards_full_leaves_the_model_on_cpu_saying_why(node: Node) -> None:
    node.nvml(used_mib={"0": 80_000, "1": 79_000})
    node.agent.beat()
    plan = Scheduler(node.store, 30.0).tick()
    assert [r["profile"] for r in plan.add] == ["cpu"]
