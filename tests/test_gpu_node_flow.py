"""A GPU host as these machines can show one: `pytest provision/` with a stand-in NVML
(tests/standin_nvml, one H100 80GB HBM3 on a 550 driver, CUDA 12.4) and engine.cuda left
at its default. The node answers at once on CPU, a `!!` line names the GPU engine and why
it is not ready, and the control plane lists the GPU with its class. Nothing is downloaded
for CUDA: a CUDA 12 toolkit cannot be assembled from wheels, so the GPU engine fails in
one line and the node keeps serving on CPU (a real CUDA build is scripts/gpu-check's)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.hosts import ThrowawayHost

pytestmark = pytest.mark.slow

STANDIN = Path(__file__).parent / "standin_nvml"


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_gguf):
    h = ThrowawayHost(tmp_path_factory.mktemp("gpu-node") / "state")
    h.first_run = h.provision(f"--starter-source={tiny_gguf[0].as_uri()}", "-rf",
                              env={"PYTHONPATH": str(STANDIN)})
    yield h
    h.down()


def test_the_starter_answers_on_cpu_while_the_gpu_engine_is_not_ready(host) -> None:
    assert host.first_run.returncode == 0, host.first_run.output[-3000:]
    answer = httpx.post(f"http://127.0.0.1:{host.ports['gateway']}/v1/chat/completions",
                        json={"model": "qwen-0.5b", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]},
                        headers={"Authorization": f"Bearer {host.gateway_key}"}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] > 0


def test_a_warning_line_names_the_gpu_engine_and_where_to_watch(host) -> None:
    warned = [line for line in host.first_run.output.splitlines()
              if line.lstrip().startswith("!!") and "llamacpp-cuda" in line]
    assert warned, host.first_run.output[-3000:]
    assert any("CUDA 12" in line or "being made" in line for line in warned), warned


def test_the_control_plane_lists_the_gpu_by_class_and_the_engines_apart(host) -> None:
    nodes = httpx.get(f"{host.admin_url}/api/v1/nodes", headers=host.auth, timeout=10).json()
    (node,) = nodes
    assert [g["class"] for g in node["gpus"]] == ["h100-80gb"]
    assert node["engines"] == ["llamacpp"]
    entries = {p["engine"]: p for p in node["provision"]}
    assert entries["llamacpp"]["state"] == "ready"
    assert entries["llamacpp-cuda"]["state"] in ("pending", "building", "failed")


def test_negative_control_without_the_standin_this_machine_has_no_gpu() -> None:
    """The GPU above is the stand-in's: this machine's own NVML sees none."""
    from llmgw.agent.gpus import discover

    assert discover().gpus == []
