"""A replica that cannot start on its GPU does not loop: an agent (with the stand-in NVML's
H100) and a real control plane (agent API over mTLS, store, scheduler) on loopback, the
GPU engine a stand-in that prints llama.cpp's real out-of-memory lines and exits 1. After
GPU_START_ATTEMPTS failed starts the agent gives the placement up, the scheduler stops it
and places the model on its CPU profile (the real llama-server), and the reason stands in
the stopped replica's record, the node's record and `llmgw status`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmgw.agent.replicas.supervisor import GIVE_UP_FOR_S, GPU_START_ATTEMPTS, ReplicaSupervisor
from llmgw.cli.commands.status import render
from llmgw.contract import EngineState
from llmgw.control.admin_api import public_replica
from llmgw.control.nodes import node_view
from tests.agent.gpu_node import cluster
from tests.agent.test_engine_log import OOM_LOG
from tests.standin_cuda_server import standin_cuda_server

pytestmark = pytest.mark.slow

OOM = ("cudaMalloc failed: out of memory", "error loading model: unable to allocate CUDA0")


def oom_engine(directory: Path) -> tuple[Path, Path]:
    """A GPU engine whose --list-devices names the stand-in's H100 as CUDA0, and which
    otherwise prints llama.cpp's out-of-memory lines and exits 1, counting its starts."""
    return standin_cuda_server(directory, fails_with=OOM_LOG)


def test_an_engine_out_of_memory_on_its_gpu_is_given_up_and_the_model_serves_on_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_server: str,
        served_gguf: tuple[str, str]) -> None:
    engine, starts = oom_engine(tmp_path / "cuda")
    with cluster(tmp_path, monkeypatch, llama_server, served_gguf, cuda_server=engine,
                 starts=starts) as c:
        assert c.agent.cuda.status["state"] == EngineState.READY, c.agent.cuda.status
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
    engine, starts = oom_engine(tmp_path / "cuda")
    with cluster(tmp_path, monkeypatch, llama_server, served_gguf, cuda_server=engine,
                 starts=starts, gpu_start_attempts=0) as c:
        c.until(f"more than {GPU_START_ATTEMPTS} starts",
                lambda: c.starts_seen() > GPU_START_ATTEMPTS, 60)
        assert [profile for profile, _ in c.live()] == ["gpu-h100-80gb"]
        assert c.store.node("gpu-node")["inventory"].get("given_up") == []  # type: ignore[index]



def test_a_given_up_placement_is_reported_for_its_window_then_forgotten(tmp_path: Path) -> None:
    """GIVE_UP_FOR_S after the give-up the node stops reporting it (and its warning), so the
    control plane may try that card again; until then it is reported on every beat."""
    now = [1000.0]
    sup = ReplicaSupervisor(state_dir=tmp_path / "agent", weights_dir=tmp_path / "weights",
                            engine=lambda kind: None, bind_host="127.0.0.1",
                            clock=lambda: now[0])
    entry = {"replica": "r-1", "model": "m", "profile": "gpu-h100-80gb", "gpus": ["GPU-a"],
             "reason": OOM[0], "starts": GPU_START_ATTEMPTS, "free_mb": {"GPU-a": 100},
             "since": 0.0}
    sup.give_ups.entries["r-1"] = (entry, now[0])  # type: ignore[assignment]
    now[0] += GIVE_UP_FOR_S - 1
    assert sup.facts()["given_up"] == [entry]
    assert len(sup.warnings()) == 1 and "tried again after 10 min" in sup.warnings()[0]
    now[0] += 1
    assert sup.facts()["given_up"] == [] and sup.warnings() == []
