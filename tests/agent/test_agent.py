"""The agent's heartbeat: its inventory, the replica seam, backoff logged once."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent import agent as agent_mod
from llmgw.agent.agent import LOADING_BEAT_S, MAX_BACKOFF_S, Agent, backoff_s
from llmgw.agent.client import AgentAPIError, AgentClient
from llmgw.agent.engines.common import Found, engine_status
from llmgw.agent.engines.cpu import LlamaCpp
from llmgw.agent.gpus import GPU, Discovery
from llmgw.config import AgentConfig, EngineConfig, TLSFiles
from llmgw.contract import CPU_ENGINE, CUDA_ENGINE, EngineState
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.control.nodes import node_view
from llmgw.host import pki
from llmgw.model.engine_args import HTTP_THREADS
from llmgw.store import Store
from tests.agent.conftest import FakeBinary


class Recorder:
    """A workload that remembers what it was told, and reports one replica."""

    def __init__(self) -> None:
        self.told: list[list[dict[str, Any]]] = []

    def report(self) -> list[dict[str, Any]]:
        return [{"id": "r1", "state": "ready"}]

    def facts(self) -> dict[str, Any]:
        return {}

    def reconcile(self, assignments: list[dict[str, Any]]) -> None:
        self.told.append(assignments)

    def warnings(self) -> list[str]:
        return []

    def loading(self) -> bool:
        return False


@pytest.fixture
def control_plane(tmp_path: Path) -> Any:
    """Function: a real agent API whose catalog assigns one replica to node-a."""
    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, ["127.0.0.1"]).write(tmp_path, "server")
    cert, key = pki.issue_client(ca, "node-a").write(tmp_path, "agent")
    store = Store(tmp_path / "control.db")
    store.add_model({"name": "m", "source": "http://mirror/m.gguf", "sha256": "",
                     "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "",
                                   "args": ["-c", "512"]}]})
    store.put_replica({"id": "r1", "model": "m", "node": "node-a", "profile": "cpu",
                       "state": "pending"})
    server = AgentAPIServer(
        "127.0.0.1", 0,
        mtls_context(str(tmp_path / "ca.pem"), str(tmp_path / "server.pem"),
                     str(tmp_path / "server-key.pem")),
        AgentAPI(store),
    )
    server.start()
    tls = TLSFiles(ca=str(tmp_path / "ca.pem"), cert=str(cert), key=str(key))
    yield server, store, tls
    server.stop()
    store.close()


def test_heartbeat_carries_the_inventory_and_hands_assignments_to_the_workload(
    tmp_path: Path, control_plane: Any, fake_llama_server: FakeBinary
) -> None:
    server, store, tls = control_plane
    config = AgentConfig(
        server=f"https://127.0.0.1:{server.port}", node_id="node-a", state_dir=str(tmp_path),
        tls=tls, labels={"llmgw.control-plane": "true"}, heartbeat_s=0.1,
        engine=EngineConfig(cache_dir=str(tmp_path / "cache")),
    )
    engine = LlamaCpp(config.engine, search_path=str(tmp_path / "empty"))
    fake_llama_server(engine.cached_binary.parent)
    workload = Recorder()
    gpu = GPU(0, "NVIDIA L4", 23034, "GPU-x", "l4")
    agent = Agent(config, engine=engine, workload=workload,
                  discover=lambda: Discovery([gpu], ["a warning"]),
                  cards=lambda: [gpu.as_dict()])
    assert agent.beat() == 0.1
    view = node_view(store.nodes()[0], store.clock(), 30)
    assert (view["id"], view["state"]) == ("node-a", "provisioning")
    assert view["provision"][0]["state"] == "pending"
    engine.provision()
    agent.beat()
    view = node_view(store.nodes()[0], store.clock(), 30)
    assert view["state"] == "ready" and view["engines"] == ["llamacpp"]
    assert view["gpus"] == [gpu.as_dict()]
    assert view["labels"] == {"llmgw.control-plane": "true"}
    assert view["interface"] == "lo" and view["addr"] == "127.0.0.1"
    assert view["cpus"] >= 1 and view["memory_mb"] > 0
    assert "a warning" in view["warnings"]
    assert store.replicas()[0]["state"] == "ready", "the workload's report reached the store"
    told = workload.told[-1]
    # The profile's args, and what the control plane adds to every engine's.
    assert [(a["id"], a["model"], a["args"]) for a in told] == [
        ("r1", "m", ["-c", "512", "--slot-prompt-similarity", "0", "--no-cache-idle-slots",
                     "--threads-http", str(HTTP_THREADS)])]


class _DownClient:
    def __init__(self) -> None:
        self.up = False
        self.sent = 0

    def heartbeat(self, inventory: dict[str, Any]) -> dict[str, Any]:
        self.sent += 1
        if not self.up:
            raise AgentAPIError("the control plane at https://x did not answer: refused")
        return {"node_id": "node-a", "replicas": []}

    def close(self) -> None:
        pass


def test_control_plane_away_is_logged_once_and_backs_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = _DownClient()
    config = AgentConfig(heartbeat_s=1.0, state_dir=str(tmp_path))
    agent = Agent(config, client=client,  # type: ignore[arg-type]
                  engine=LlamaCpp(EngineConfig(cache_dir=str(tmp_path))),
                  discover=lambda: Discovery())
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    delays = [agent.beat() for _ in range(8)]
    ceilings = [1.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]  # three beats at most
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True)), delays
    away = [r for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(away) == 1, caplog.text
    client.up = True
    assert agent.beat() == 1.0 and agent.beat() == 1.0
    back = [r for r in caplog.records if "answers again" in r.getMessage()]
    assert len(back) == 1, caplog.text


def test_while_a_replica_loads_the_agent_beats_sooner_unless_the_control_plane_is_away(
        tmp_path: Path) -> None:
    """A ready engine is reported within LOADING_BEAT_S of its readiness, not heartbeat_s
    later (a request may wait for it); with nothing loading (the control), or with the
    control plane away (its backoff), the wait is as it was."""
    client = _DownClient()
    client.up = True
    config = AgentConfig(heartbeat_s=5.0, state_dir=str(tmp_path))
    workload = Recorder()
    agent = Agent(config, client=client,  # type: ignore[arg-type]
                  engine=LlamaCpp(EngineConfig(cache_dir=str(tmp_path))),
                  discover=lambda: Discovery(), workload=workload)  # type: ignore[arg-type]
    assert agent._sooner_while_loading(5.0) == 5.0
    workload.loading = lambda: True  # type: ignore[method-assign]
    assert agent._sooner_while_loading(5.0) == LOADING_BEAT_S
    agent.failures = 2
    assert agent._sooner_while_loading(10.0) == 10.0


def test_backoff_starts_at_the_heartbeat_and_is_capped() -> None:
    assert backoff_s(5.0, 0) == 5.0
    assert backoff_s(5.0, 1, lambda: 1.0) == 5.0
    assert backoff_s(5.0, 2, lambda: 1.0) == 10.0
    assert backoff_s(5.0, 50, lambda: 1.0) == MAX_BACKOFF_S
    assert backoff_s(1.0, 50, lambda: 1.0) == 3.0, "three heartbeats when that is less"


def test_backoff_is_drawn_between_half_and_all_of_its_ceiling() -> None:
    """Nodes dropped together by a restart come back spread over the window, not at once."""
    assert backoff_s(5.0, 1, lambda: 0.0) == 2.5
    assert backoff_s(5.0, 50, lambda: 0.0) == MAX_BACKOFF_S / 2
    drawn = {round(backoff_s(5.0, 2), 3) for _ in range(50)}
    assert len(drawn) > 10 and min(drawn) >= 5.0 and max(drawn) <= 10.0


def _gpu_agent(tmp_path: Path, cuda: str = "auto") -> Agent:
    gpu = GPU(0, "NVIDIA L4", 23034, "GPU-x", "l4", compute_capability="8.9")
    config = AgentConfig(engine=EngineConfig(cache_dir=str(tmp_path), cuda=cuda))
    return Agent(config, client=_DownClient(),  # type: ignore[arg-type]
                 engine=LlamaCpp(config.engine), discover=lambda: Discovery([gpu]))


def test_a_gpu_node_reports_both_engines_and_serves_only_on_the_ready_ones(
        tmp_path: Path) -> None:
    """The heartbeat carries each engine's provision state; `engines` names only the
    ready ones, so the scheduler places nothing on a GPU engine still being made."""
    agent = _gpu_agent(tmp_path)
    agent.engine._status = engine_status(CPU_ENGINE, "v", EngineState.READY)
    beat = agent.inventory()
    assert [p["engine"] for p in beat["provision"]] == [CPU_ENGINE, CUDA_ENGINE]
    # As sent before, to the key: a CPU engine's entry has no gpus or left_out.
    assert beat["provision"][0] == {"engine": CPU_ENGINE, "version": "v",
                                    "state": EngineState.READY, "detail": ""}
    assert beat["engines"] == [CPU_ENGINE]
    agent.cuda._status = engine_status(CUDA_ENGINE, "v", EngineState.READY)
    assert agent.inventory()["engines"] == [CPU_ENGINE, CUDA_ENGINE]


def test_the_gpu_engine_being_made_or_failed_is_a_warning_and_ready_is_none(
        tmp_path: Path) -> None:
    agent = _gpu_agent(tmp_path)
    agent.cuda._status = engine_status(CUDA_ENGINE, "v", EngineState.BUILDING, "40%")
    assert any("being made (building: 40%)" in w and "llmgw status" in w
               for w in agent.warnings())
    agent.cuda._status = engine_status(CUDA_ENGINE, "v", EngineState.FAILED, "no cmake")
    assert any("failed: no cmake" in w for w in agent.warnings())
    agent.cuda._status = engine_status(CUDA_ENGINE, "v", EngineState.READY)
    assert agent.warnings() == []


def test_negative_control_cuda_off_and_cpu_nodes_warn_of_no_gpu_engine(tmp_path: Path) -> None:
    assert _gpu_agent(tmp_path, cuda="off").warnings() == []
    cpu_node = Agent(AgentConfig(), client=_DownClient(),  # type: ignore[arg-type]
                     engine=LlamaCpp(EngineConfig(cache_dir=str(tmp_path))),
                     discover=lambda: Discovery())
    assert cpu_node.warnings() == []
    assert cpu_node.inventory()["provision"][1]["state"] == EngineState.ABSENT


def test_default_workload_runs_nothing(tmp_path: Path) -> None:
    agent = Agent(AgentConfig(), client=_DownClient(),  # type: ignore[arg-type]
                  engine=LlamaCpp(EngineConfig(cache_dir=str(tmp_path))),
                  discover=lambda: Discovery())
    assert isinstance(agent.workload, agent_mod.NoReplicas)
    assert agent.workload.report() == []


def test_client_with_missing_tls_files_says_how_to_fix(tmp_path: Path) -> None:
    tls = TLSFiles(ca=str(tmp_path / "ca.pem"), cert="x", key="y")
    with pytest.raises(AgentAPIError, match="pytest provision/"):
        AgentClient("https://127.0.0.1:1", tls)


def test_the_heartbeat_says_rpc_where_the_ready_engine_has_rpc_server_beside_it(
        tmp_path: Path, rpc_engine: tuple[str, str]) -> None:
    """`rpc` is true where the ready CPU engine is the source build with rpc-server beside
    its llama-server (the real one the tests use), and false where the engine is not ready
    yet, where it is the prebuilt wheel (which carries no rpc-server: even one placed
    beside its launcher is not taken), or a configured llama-server (llmgw cannot know
    what it was built with)."""
    agent = Agent(AgentConfig(), client=_DownClient(),  # type: ignore[arg-type]
                  engine=LlamaCpp(EngineConfig(cache_dir=str(tmp_path))),
                  discover=lambda: Discovery())
    agent.engine.found = Found(Path(rpc_engine[0]), "v", "cache")
    assert agent.inventory()["rpc"] is False, "the engine is not ready yet"
    agent.engine._status = engine_status(CPU_ENGINE, "v", EngineState.READY)
    assert agent.inventory()["rpc"] is True
    # Which engine has it: the CPU one here, not the GPU engine (none on this node).
    assert agent.inventory()["rpc_engines"] == [CPU_ENGINE]
    assert agent.rpc_server(CPU_ENGINE) == Path(rpc_engine[1])

    launcher = tmp_path / "prebuilt" / "llama-server"
    launcher.parent.mkdir()
    for binary in (launcher, launcher.parent / "rpc-server"):
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o755)
    agent.engine.found = Found(launcher, "v", "prebuilt cache")
    assert agent.inventory()["rpc"] is False and agent.inventory()["rpc_engines"] == []
    agent.engine.found = Found(Path(rpc_engine[0]), "v", "configured")
    assert agent.inventory()["rpc"] is False, "llmgw cannot know what a configured one has"
    agent.engine.found = Found(Path(rpc_engine[0]), "v", "cache")
    assert agent.inventory()["rpc"] is True
