"""A GPU node and its control plane on loopback, for the agent's GPU tests: the agent with
the stand-in NVML's cards (tests/standin_nvml), a real agent API over mTLS with its store,
and the scheduler, driven one heartbeat and one scheduling pass at a time."""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from llmgw.agent.agent import Agent, replica_supervisor
from llmgw.agent.engines.cpu import LlamaCpp
from llmgw.agent.gpus import LiveCards, discover
from llmgw.agent.replicas.process import stop_engines
from llmgw.agent.replicas.supervisor import GPU_START_ATTEMPTS, ReplicaSupervisor
from llmgw.config import AgentConfig, EngineConfig, TLSFiles
from llmgw.contract import EngineState
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.control.scheduler import Scheduler
from llmgw.host import pki
from llmgw.store import Store

STANDIN = Path(__file__).parents[1] / "standin_nvml" / "pynvml.py"
H100 = "NVIDIA H100 80GB HBM3:81559:9.0"


def standin_nvml(monkeypatch: pytest.MonkeyPatch, cards: str) -> ModuleType:
    """tests/standin_nvml's pynvml, answering for cards: the driver's library alone."""
    monkeypatch.setenv("LLMGW_STANDIN_GPUS", cards)
    spec = importlib.util.spec_from_file_location("standin_pynvml", STANDIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_spec(source: str, sha256: str) -> dict[str, Any]:
    profile = {"engine": "llamacpp", "min_memory_gb": 0.5, "node_selector": {}}
    return {"name": "tiny", "aliases": [], "description": "", "source": source,
            "sha256": sha256, "routing_profile": "chat", "context_length": 512,
            "max_output": 16, "scaling": {"min": 1, "max": 1}, "size_bytes": 0,
            "geometry": {},
            "profiles": [
                {**profile, "name": "gpu-h100-80gb", "gpu_class": "h100-80gb",
                 "priority": 200, "args": ["--ctx-size", "512"]},
                {**profile, "name": "cpu", "gpu_class": "", "priority": 100,
                 "args": ["--ctx-size", "512", "--threads", "1"]}]}


@dataclass
class Cluster:
    """A control plane (store, agent API, scheduler) and one GPU node's agent."""

    store: Store
    scheduler: Scheduler
    agent: Agent
    supervisor: ReplicaSupervisor
    starts: Path

    def starts_seen(self) -> int:
        return len(self.starts.read_text().splitlines()) if self.starts.exists() else 0

    def round(self) -> None:
        """One heartbeat and one scheduling pass."""
        self.agent.beat()
        self.scheduler.tick()

    def until(self, what: str, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            seen = [(r["id"], r["profile"], r["state"], r.get("err"))
                    for r in self.store.replicas()]
            assert time.monotonic() < deadline, (
                f"timed out after {timeout_s:.0f}s waiting for {what}; replicas: {seen}, "
                f"engine starts: {self.starts_seen()}")
            self.round()
            time.sleep(0.2)

    def live(self) -> list[tuple[str, str]]:
        return [(r["profile"], r["state"]) for r in self.store.replicas()
                if r["state"] != "stopped"]


@contextlib.contextmanager
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
            served_gguf: tuple[str, str], *, cuda_server: Path, starts: Path,
            cards: str = H100, gpu_start_attempts: int = GPU_START_ATTEMPTS,
            spec: dict[str, Any] | None = None) -> Iterator[Cluster]:
    """A control plane on loopback and a GPU node's agent: the stand-in NVML's cards, the
    real llama-server as its CPU engine, cuda_server as its GPU engine (provisioned: its
    check run), and the model `tiny` (GPU profile first, then CPU; spec in its place
    where given) in the catalog. starts: the file where cuda_server writes a line per
    replica it starts."""
    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, ["127.0.0.1"]).write(tmp_path, "server")
    cert, key = pki.issue_client(ca, "gpu-node").write(tmp_path, "agent")
    store = Store(tmp_path / "control.db")
    store.add_model(spec or model_spec(*served_gguf))  # type: ignore[arg-type]
    server = AgentAPIServer("127.0.0.1", 0, mtls_context(
        str(tmp_path / "ca.pem"), str(tmp_path / "server.pem"),
        str(tmp_path / "server-key.pem")), AgentAPI(store))
    server.start()
    engine_config = EngineConfig(llama_server=llama_server, cache_dir=str(tmp_path / "cache"),
                                 cuda_server=str(cuda_server))
    config = AgentConfig(server=f"https://127.0.0.1:{server.port}", node_id="gpu-node",
                         tls=TLSFiles(ca=str(tmp_path / "ca.pem"), cert=str(cert),
                                      key=str(key)),
                         state_dir=str(tmp_path / "agent"), heartbeat_s=0.2,
                         engine=engine_config)
    nvml = standin_nvml(monkeypatch, cards)
    found = discover(nvml)
    agent = Agent(config, engine=LlamaCpp(engine_config), discover=lambda: found,
                  cards=LiveCards(found.gpus, nvml).read)
    assert agent.engine.provision()["state"] == EngineState.READY
    agent.cuda.provision()
    supervisor = replica_supervisor(agent, gpu_start_attempts=gpu_start_attempts)
    agent.workload = supervisor
    try:
        yield Cluster(store, Scheduler(store, node_timeout_s=30.0), agent, supervisor, starts)
    finally:
        supervisor.reconcile([])
        for thread in list(supervisor.retiring.values()):
            thread.join(30)
        stop_engines(tmp_path / "agent")
        agent.client.close()
        server.stop()
        store.close()
