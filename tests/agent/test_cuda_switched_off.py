"""engine.cuda: off on a GPU host (the stand-in NVML's H100, tests/standin_nvml) is a CPU
node in every line: the node step's GPU line, the starter's line (and no `!!` line about
its GPU profile), and why the scheduler keeps a model with a GPU profile on CPU there. Each
with its negative control: the same host with engine.cuda: auto says GPUs, as before."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.agent import Agent
from llmgw.agent.engines.common import engine_status
from llmgw.agent.engines.cpu import ENGINE
from llmgw.agent.gpus import LiveCards, discover
from llmgw.config import AgentConfig, EngineConfig, TLSFiles
from llmgw.contract import EngineState
from llmgw.contract.catalog import CATALOG_MODEL
from llmgw.contract.records import NodeView
from llmgw.control.admin_api import public_replicas
from llmgw.control.agent_api import AgentAPI
from llmgw.control.nodes import node_view
from llmgw.control.scheduler import Scheduler
from llmgw.store import Store
from llmgw_harness import node as node_step
from llmgw_harness import starter
from llmgw_harness._changes import apply_fix
from tests.agent.gpu_node import H100, model_spec, standin_nvml
from tests.llmgw_harness.hosts import local_host, with_server_yaml

NODE = "gpu-node"


class _ReadyCpuEngine:
    """The node's CPU engine, ready (what the GPU engine and the heartbeat read of it)."""

    source_version = "0.3.36"
    found = None
    # The prebuilt engine's case: no RPC backend.
    rpc_server = None

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.status = engine_status(ENGINE, self.source_version, EngineState.READY, "ready")

    def ready(self) -> bool:
        return True


def _beat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: str) -> tuple[Store, Agent]:
    """A store that has had the first heartbeat of an agent with the stand-in NVML's H100
    and engine.cuda as given, sent through the agent API's own handling; and the agent."""
    nvml = standin_nvml(monkeypatch, H100)
    found = discover(nvml)
    config = AgentConfig(server="https://127.0.0.1:1", node_id=NODE, state_dir=str(
        tmp_path / "agent"), tls=TLSFiles(ca="ca.pem", cert="agent.pem", key="agent-key.pem"),
        engine=EngineConfig(cuda=cuda, cache_dir=str(tmp_path / "cache")),
        labels=dict([node_step.LOCAL_LABEL]))  # the control plane's own node, as provisioned
    agent = Agent(config, client=object(),  # type: ignore[arg-type]  # never sent
                  engine=_ReadyCpuEngine(tmp_path / "cache"),  # type: ignore[arg-type]
                  discover=lambda: found, cards=LiveCards(found.gpus, nvml).read)
    store = Store(tmp_path / "control.db")
    AgentAPI(store).heartbeat(NODE, agent.inventory())
    return store, agent


def _view(store: Store) -> NodeView:
    row = store.node(NODE)
    assert row is not None
    return node_view(row, store.clock(), 30.0, store.hearing)


@pytest.mark.parametrize("cuda", ["off", "auto"])
def test_a_model_with_a_gpu_profile_is_held_on_cpu_saying_cuda_is_off_not_not_ready(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: str) -> None:
    """Placed on its CPU profile either way; held back because the GPU engine is switched
    off (off), never "not ready" beside the node's own "no GPU engine: engine.cuda: off";
    the control (auto): not ready, as it is while the engine is made."""
    store, _ = _beat(tmp_path, monkeypatch, cuda)
    try:
        assert [g["class"] for g in _view(store)["gpus"]] == ["h100-80gb"], "NVML's card"
        store.add_model(model_spec("http://127.0.0.1:1/tiny.gguf", ""))  # type: ignore[arg-type]
        Scheduler(store, node_timeout_s=30.0).tick()
        (replica,) = public_replicas(store, 30.0)
    finally:
        store.close()
    assert (replica["node"], replica["profile"]) == (NODE, "cpu")
    held = replica["held_back"]
    if cuda == "off":
        assert held == (f"gpu-h100-80gb: {NODE}'s GPU engine (llamacpp-cuda) is switched off "
                        "(engine.cuda: off in its agent.yaml), so it serves on CPU")
    else:
        assert held == f"gpu-h100-80gb: {NODE}'s GPU engine (llamacpp-cuda) is not ready"


class _Admin:
    """The admin API of the store, as far as the starter's promises ask it."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def node(self, node_id: str) -> NodeView | None:
        return _view(self.store) if node_id == NODE else None

    def nodes(self) -> list[NodeView]:
        return [_view(self.store)]

    def models(self) -> list[Any]:
        return list(self.store.models())

    def replicas(self, model: str | None = None) -> list[Any]:
        return list(public_replicas(self.store, 30.0, model))

    def add_model(self, model: dict[str, Any]) -> None:
        self.store.add_model(CATALOG_MODEL.validate_python(model))  # as the admin API does


@pytest.mark.parametrize("cuda", ["off", "auto"])
def test_the_starter_says_it_serves_on_cpu_where_cuda_is_switched_off_and_warns_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: str) -> None:
    """Off: "served here on CPU (engine.cuda: off; …)", and once ready on its CPU profile no
    `!!` line says why it is not on the GPU (the node step's line says it). Its GPU profile
    stays in the catalog, written once: engine.cuda is agent.yaml's, switched back by a
    person (bench/gpu_fleet.py --dry-run does), and the starter then moves onto the GPU.
    The control (auto): "served here on h100-80gb", and the `!!` line while the GPU engine
    is made."""
    store, agent = _beat(tmp_path, monkeypatch, cuda)

    @contextmanager
    def admin(h: object) -> Any:
        yield _Admin(store)

    monkeypatch.setattr(starter.facts, "admin", admin)
    monkeypatch.setattr(starter.facts, "node_id", lambda h: NODE)
    monkeypatch.setattr(starter, "_status", lambda h: {
        "model": starter.NAME, "version": starter.VERSION, "url": "http://127.0.0.1:1/q.gguf",
        "status": {"state": "present", "sha256": None}})
    h = with_server_yaml(local_host(tmp_path / "host"))
    assert starter.catalog.fixer is not None
    try:
        line = apply_fix(starter.catalog.fixer, h, starter.catalog(h))
        Scheduler(store, node_timeout_s=30.0).tick()
        (placed,) = public_replicas(store, 30.0)
        AgentAPI(store).heartbeat(NODE, {**agent.inventory(), "replicas": [
            {"id": placed["id"], "state": "ready", "endpoint": "http://127.0.0.1:1"}]})
        (model,) = store.models()
        (replica,) = public_replicas(store, 30.0)
        assert starter.replicas_ready(h) is None
    finally:
        store.close()
    warned = [o.message for o in h.recorder.outcomes if o.status == "warn"]
    assert [p["name"] for p in model["profiles"]] == ["gpu-h100-80gb", "cpu"]
    assert (replica["profile"], replica["state"]) == ("cpu", "ready")
    if cuda == "off":
        assert line == (f"{starter.NAME} in the catalog, served here on CPU (engine.cuda: off; "
                        "on h100-80gb once it is auto)")
        assert "is switched off" in replica["held_back"] and warned == []
    else:
        assert line == (f"{starter.NAME} in the catalog, served here on h100-80gb, or CPU if "
                        "the card is busy")
        assert warned == [f"{starter.NAME} serves on its cpu profile on {NODE}, not on a "
                          f"better one: gpu-h100-80gb: {NODE}'s GPU engine (llamacpp-cuda) "
                          "is not ready"]


@pytest.mark.parametrize("cuda", ["off", "auto"])
def test_the_node_step_says_the_gpus_are_not_used_where_cuda_is_switched_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: str) -> None:
    """The node step's GPU line, from NVML (the stand-in's H100) and agent.yaml's
    engine.cuda; before agent.yaml is written, from --engine-cuda. The control (auto):
    "the node will use them"."""
    nvml = standin_nvml(monkeypatch, H100)
    monkeypatch.setattr(node_step, "discover", lambda: discover(nvml))
    fresh = local_host(tmp_path / "fresh")
    fresh = replace(fresh, settings=replace(fresh.settings, engine_cuda=cuda))
    assert not fresh.layout.agent_yaml.exists()
    h = local_host(tmp_path / "written")  # as a person edits it: `cuda: off`, unquoted
    h.layout.agent_yaml.parent.mkdir(parents=True, exist_ok=True)
    h.layout.agent_yaml.write_text(f"server: https://127.0.0.1:1\nengine:\n  cuda: {cuda}\n")
    for host in (fresh, h):
        line = node_step.gpus_usable.kept_line(host)
        if cuda == "off":
            assert line == ("1 NVIDIA GPU(s) here: h100-80gb — engine.cuda: off, so the node "
                            "serves on CPU")
        else:
            assert line == "1 NVIDIA GPU(s) here: h100-80gb — the node will use them"
