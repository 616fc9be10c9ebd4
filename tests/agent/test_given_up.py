"""A replica that cannot start on its GPU does not loop: an agent (with the stand-in NVML's
H100) and a real control plane (agent API over mTLS, store, scheduler) on loopback, the
GPU engine a stand-in that prints llama.cpp's real out-of-memory lines and exits 1. After
GPU_START_ATTEMPTS failed starts the agent gives the placement up, the scheduler stops it
and places the model on its CPU profile (the real llama-server), and the reason stands in
the stopped replica's record, the node's record and `llmgw status`."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from llmgw import pki
from llmgw.agent.agent import Agent, replica_supervisor
from llmgw.agent.engine import LlamaCpp
from llmgw.agent.gpus import discover
from llmgw.agent.replicas import GPU_START_ATTEMPTS, ReplicaSupervisor, stop_engines
from llmgw.commands.status import render
from llmgw.config import AgentConfig, EngineConfig, TLSFiles
from llmgw.contract import EngineState
from llmgw.control.admin_api import public_replica
from llmgw.control.agent_api import AgentAPI, AgentAPIServer, mtls_context
from llmgw.control.nodes import node_view
from llmgw.control.scheduler import Scheduler
from llmgw.control.store import Store

pytestmark = pytest.mark.slow

STANDIN = Path(__file__).parents[1] / "standin_nvml" / "pynvml.py"
H100 = "NVIDIA H100 80GB HBM3:81559:9.0"
# What llama-server b7xxx prints when the model's weights do not fit the card (the lines
# of ggml-cuda.cu, ggml-alloc.c, llama.cpp, common.cpp and server.cpp, in that order).
OOM_LINES = """\
load_tensors: loading model tensors, this can take a while... (mmap = true)
load_tensors: offloading 1 repeating layers to GPU
ggml_backend_cuda_buffer_type_alloc_buffer: allocating 15316.00 MiB on device 0: cudaMalloc failed: out of memory
alloc_tensor_range: failed to allocate CUDA0 buffer of size 16060055552
llama_model_load: error loading model: unable to allocate CUDA0 buffer
llama_model_load_from_file_impl: failed to load model
common_init_from_params: failed to load model '{model}'
srv    load_model: failed to load model, '{model}'
main: exiting due to model loading error
"""
OOM = ("cudaMalloc failed: out of memory", "error loading model: unable to allocate CUDA0")


def standin_nvml(monkeypatch: pytest.MonkeyPatch, cards: str) -> ModuleType:
    """tests/standin_nvml's pynvml, answering for cards: the driver's library alone."""
    monkeypatch.setenv("LLMGW_STANDIN_GPUS", cards)
    spec = importlib.util.spec_from_file_location("standin_pynvml", STANDIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def oom_engine(directory: Path) -> tuple[Path, Path]:
    """A GPU engine whose --list-devices names the stand-in's H100 as CUDA0, and which
    otherwise prints llama.cpp's out-of-memory lines and exits 1, counting its starts."""
    directory.mkdir(parents=True, exist_ok=True)
    engine, starts = directory / "llama-server", directory / "starts"
    engine.write_text(f"""#!{sys.executable}
import sys
argv = sys.argv[1:]
if argv[:1] == ["--list-devices"]:
    print("Available devices:")
    print("  CUDA0: NVIDIA H100 80GB HBM3 (81559 MiB, 80535 MiB free)")
    sys.exit(0)
with open({str(starts)!r}, "a") as f:
    f.write("start\\n")
model = argv[argv.index("-m") + 1]
sys.stderr.write({OOM_LINES!r}.format(model=model))
sys.exit(1)
""")
    engine.chmod(0o755)
    return engine, starts


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
            assert time.monotonic() < deadline, (
                f"timed out after {timeout_s:.0f}s waiting for {what}; replicas: "
                f"{[(r['id'], r['profile'], r['state'], r.get('err')) for r in self.store.replicas()]}"
                f", engine starts: {self.starts_seen()}")
            self.round()
            time.sleep(0.2)

    def live(self) -> list[tuple[str, str]]:
        return [(r["profile"], r["state"]) for r in self.store.replicas()
                if r["state"] != "stopped"]


@contextlib.contextmanager
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
            served_gguf: tuple[str, str], gpu_start_attempts: int) -> Iterator[Cluster]:
    ca = pki.create_ca()
    ca.write(tmp_path, "ca")
    pki.issue_server(ca, ["127.0.0.1"]).write(tmp_path, "server")
    cert, key = pki.issue_client(ca, "gpu-node").write(tmp_path, "agent")
    store = Store(tmp_path / "control.db")
    store.add_model(model_spec(*served_gguf))  # type: ignore[arg-type]
    server = AgentAPIServer("127.0.0.1", 0, mtls_context(
        str(tmp_path / "ca.pem"), str(tmp_path / "server.pem"),
        str(tmp_path / "server-key.pem")), AgentAPI(store))
    server.start()
    engine, starts = oom_engine(tmp_path / "cuda")
    engine_config = EngineConfig(llama_server=llama_server, cache_dir=str(tmp_path / "cache"),
                                 cuda_server=str(engine))
    config = AgentConfig(server=f"https://127.0.0.1:{server.port}", node_id="gpu-node",
                         tls=TLSFiles(ca=str(tmp_path / "ca.pem"), cert=str(cert),
                                      key=str(key)),
                         state_dir=str(tmp_path / "agent"), heartbeat_s=0.2,
                         engine=engine_config)
    nvml = standin_nvml(monkeypatch, H100)
    agent = Agent(config, engine=LlamaCpp(engine_config), discover=lambda: discover(nvml))
    assert agent.engine.provision().state == EngineState.READY
    assert agent.cuda.provision().state == EngineState.READY, agent.cuda.status
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


def test_an_engine_out_of_memory_on_its_gpu_is_given_up_and_the_model_serves_on_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
        served_gguf: tuple[str, str]) -> None:
    with cluster(tmp_path, monkeypatch, llama_server, served_gguf, GPU_START_ATTEMPTS) as c:
        c.until("the GPU profile to be placed first", lambda: bool(c.live()), 30)
        assert c.live()[0][0] == "gpu-h100-80gb", "the GPU profile is tried first"
        c.until("the model to serve on its CPU profile",
                lambda: c.live() == [("cpu", "ready")], 90)
        for _ in range(10):  # and stays there: the GPU engine is not started again
            c.round()
            time.sleep(0.2)
        assert c.starts_seen() == GPU_START_ATTEMPTS
        assert c.live() == [("cpu", "ready")]

        (stopped,) = [r for r in c.store.replicas() if r["state"] == "stopped"]
        assert stopped["profile"] == "gpu-h100-80gb"
        assert f"after {GPU_START_ATTEMPTS} failed starts" in stopped["err"]
        assert all(line in stopped["err"] for line in OOM), stopped["err"]

        node = node_view(c.store.node("gpu-node"), c.store.clock(), 30.0)  # type: ignore[arg-type]
        (entry,) = node["given_up"]
        assert entry["replica"] == stopped["id"] and entry["gpus"] == stopped["gpus"]
        assert entry["free_mb"] == {stopped["gpus"][0]: 81559 - 1024}, "as NVML said"
        table = render([node], [public_replica(r) for r in c.store.replicas()], time.time())
        warned = [line for line in table.splitlines() if line.startswith("!! gpu-node:")]
        assert any(OOM[0] in line and "tried again after 10 min" in line for line in warned), \
            table


def test_negative_control_without_the_give_up_rule_the_gpu_engine_is_started_again_and_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
        served_gguf: tuple[str, str]) -> None:
    """gpu_start_attempts=0: the seed's rule, restarts with backoff for ever. The starts
    pass the give-up count and the model never leaves its GPU profile."""
    with cluster(tmp_path, monkeypatch, llama_server, served_gguf, 0) as c:
        c.until(f"more than {GPU_START_ATTEMPTS} starts",
                lambda: c.starts_seen() > GPU_START_ATTEMPTS, 60)
        assert [profile for profile, _ in c.live()] == ["gpu-h100-80gb"]
        assert c.store.node("gpu-node")["inventory"].get("given_up") == []  # type: ignore[index]

