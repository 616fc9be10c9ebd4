"""A GPU host as these machines can show one: `pytest provision/` with a stand-in NVML
(tests/standin_nvml, one H100 80GB HBM3 on a 550 driver, CUDA 12.4) and engine.cuda left
at its default. The node answers at once on CPU, a `!!` line names the GPU engine and why
it is not ready, and the control plane lists the GPU with its class. Nothing is downloaded
for CUDA: a CUDA 12 toolkit cannot be assembled from wheels, so the GPU engine fails in
one line and the node keeps serving on CPU (a real CUDA build is scripts/gpu-check's)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from llmgw.host.services._supervisor import Supervisor
from tests.hosts import ThrowawayHost
from tests.standin_cuda_server import standin_cuda_server

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


def test_a_warning_line_says_why_the_starter_is_not_on_the_gpu(host) -> None:
    """The starter serves on CPU on a node with a GPU: provision's starter step says why
    (here: the GPU engine is not ready), naming its GPU profile."""
    held = [line for line in host.first_run.output.splitlines()
            if line.lstrip().startswith("!!") and "serves on its cpu profile" in line]
    assert held, host.first_run.output[-3000:]
    assert "gpu-h100-80gb: " in held[0] and "(llamacpp-cuda) is not ready" in held[0], held


def test_llmgw_status_shows_the_gpu_engines_warning_under_its_node(host) -> None:
    import subprocess

    table = subprocess.run([sys.executable, "-m", "llmgw", "status", "--mode=local",
                            f"--state-dir={host.state_dir}"], capture_output=True, text=True,
                           timeout=60)
    assert table.returncode == 0, table.stderr
    assert "NVIDIA H100 80GB HBM3" in table.stdout
    assert any(line.startswith("!! ") and "llamacpp-cuda" in line
               for line in table.stdout.splitlines()), table.stdout
    # And why the starter is on its CPU profile, under the replica table.
    assert any(line.startswith("!! ") and "runs on cpu" in line and "not a better profile: "
               "gpu-h100-80gb" in line for line in table.stdout.splitlines()), table.stdout


def test_the_control_plane_lists_the_gpu_by_class_and_the_engines_apart(host) -> None:
    nodes = httpx.get(f"{host.admin_url}/api/v1/nodes", headers=host.auth, timeout=10).json()
    (node,) = nodes
    assert [g["class"] for g in node["gpus"]] == ["h100-80gb"]
    assert node["engines"] == ["llamacpp"]
    entries = {p["engine"]: p for p in node["provision"]}
    assert entries["llamacpp"]["state"] == "ready"
    assert entries["llamacpp-cuda"]["state"] in ("pending", "building", "failed")


def standin_gpu_engine(directory: Path, real: str) -> tuple[Path, Path]:
    """llamacpp-cuda stood in for by the CPU llama-server: --list-devices names the
    stand-in NVML's card as CUDA0; a replica's command line and CUDA_VISIBLE_DEVICES are
    logged, then --device and --n-gpu-layers (which a CPU build cannot honour) dropped and
    the real engine run in its place. Returns the engine and its log."""
    return standin_cuda_server(directory, real=real)


def _live(host: ThrowawayHost) -> list[dict]:
    replicas = httpx.get(f"{host.admin_url}/api/v1/replicas", headers=host.auth,
                         timeout=10).json()
    return [r for r in replicas if r["state"] not in ("stopped",)]


def test_replicas_move_onto_the_gpu_engine_under_load_with_no_failed_request(
        host, llama_server, tmp_path) -> None:
    """Once llamacpp-cuda passes its check, the starter moves to its GPU profile: the new
    replica is ready before the old one leaves, and no request through the gateway fails
    meanwhile (4 clients, bounded in count and time)."""
    engine, calls = standin_gpu_engine(tmp_path / "cuda", llama_server)
    agent_yaml = host.state_dir / "etc" / "agent.yaml"
    config = yaml.safe_load(agent_yaml.read_text())
    config.setdefault("engine", {})["cuda_server"] = str(engine)
    agent_yaml.write_text(yaml.safe_dump(config))
    (before,) = _live(host)
    assert before["profile"] == "cpu"

    url = f"http://127.0.0.1:{host.ports['gateway']}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {host.gateway_key}"}
    outcomes: list[int | str] = []
    moved = threading.Event()
    deadline = time.monotonic() + 240

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            after_move = 0
            while time.monotonic() < deadline and len(outcomes) < 20_000 and after_move < 20:
                try:
                    r = http.post(url, headers=headers, json={
                        "model": "qwen-0.5b", "max_tokens": 8,
                        "messages": [{"role": "user", "content": "hi"}]})
                    outcomes.append(r.status_code)
                except httpx.HTTPError as e:
                    outcomes.append(repr(e))
                after_move += moved.is_set()

    clients = [threading.Thread(target=client) for _ in range(4)]
    for c in clients:
        c.start()
    Supervisor(host.state_dir).restart("llmgw-agent")
    last: list[dict] = []
    while time.monotonic() < deadline:
        last = _live(host)
        if [(r["profile"], r["state"]) for r in last] == [("gpu-h100-80gb", "ready")]:
            moved.set()
            break
        time.sleep(0.5)
    for c in clients:
        c.join(timeout=300)
    assert moved.is_set(), f"no move onto the GPU profile within 240 s; replicas: {last}"
    failed = [o for o in outcomes if o != 200]
    assert outcomes and not failed, f"{len(failed)} of {len(outcomes)} failed: {failed[:5]}"
    launched = [json.loads(line) for line in calls.read_text().splitlines()]
    assert launched[-1]["cuda"].startswith("GPU-5ea1d1e0")
    argv = launched[-1]["argv"]
    assert argv[argv.index("--device") + 1] == "CUDA0"
    assert argv[argv.index("--n-gpu-layers") + 1] == "999"
    # Sized for the stand-in card's 80,535 MiB free: 64 slots of the tiny GGUF's 2048-token
    # training context (the starter's GPU profile asks 32768 a slot), its --ctx-size replaced.
    assert argv[argv.index("--parallel") + 1] == "64"
    assert argv.count("--ctx-size") == 1 and argv[argv.index("--ctx-size") + 1] == "131072"


def test_negative_control_without_the_standin_this_machine_has_no_gpu() -> None:
    """The GPU above is the stand-in's: this machine's own NVML sees none."""
    from llmgw.agent.gpus import discover

    assert discover().gpus == []
