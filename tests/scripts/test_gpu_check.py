"""scripts/gpu-check on machines without a GPU: it says so in one line and exits 3; with a
stand-in NVML it gets past that check (and stops, clearly, before any CUDA build); its
standard-library GGUF writer makes a model the CPU llama-server serves; --prepare trims
the pinned llama.cpp tree to what a CUDA build needs. The real run is on a lent GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"
STANDIN = ROOT / "tests" / "standin_nvml"


def run(*args: str, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_without_a_gpu_it_says_so_in_one_line_and_exits_3(tmp_path: Path) -> None:
    done = run("--out", str(tmp_path / "out"), env={"LLMGW_GPU_CHECK_DIR": str(tmp_path)})
    assert done.returncode == 3, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no NVIDIA GPU here: "), lines
    assert "needs a GPU machine" in lines[0] and done.stdout == ""


def test_negative_control_with_a_standin_nvml_it_passes_the_gpu_check(tmp_path: Path) -> None:
    """The same command where NVML reports an H100: NVML's view is written, and it stops
    at the build for want of the prepared tree (no CUDA build is started here)."""
    out = tmp_path / "out"
    done = run("--build", "--out", str(out), env={
        "LLMGW_GPU_CHECK_DIR": str(tmp_path), "PYTHONPATH": str(STANDIN)})
    assert done.returncode == 1 and "--prepare" in done.stderr, done
    view = json.loads((out / "nvml.json").read_text())
    assert [g["name"] for g in view["gpus"]] == ["NVIDIA H100 80GB HBM3"]
    assert view["gpus"][0]["compute_capability"] == "9.0"


def test_its_gguf_is_served_by_the_cpu_engine_with_device_none(tmp_path: Path,
                                                                llama_server: str) -> None:
    """The standard-library writer's model (small here) loads and answers 256 tokens."""
    done = run("--cpu-only", "--small", "--engine", llama_server, "--out", str(tmp_path),
               env={"LLMGW_GPU_CHECK_DIR": str(tmp_path), "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["cpu_tokens_per_s"] > 0
    served = json.loads((tmp_path / "serve.json").read_text())
    assert served["cpu"]["predicted"] == 256 and served["cpu"]["layers_offloaded"] == "0"


def test_prepare_keeps_what_a_cuda_build_needs_and_little_else(tmp_path: Path,
                                                               llama_server: str) -> None:
    """From the cached sdist (the llama_server fixture makes sure it is there when it
    builds): the CUDA backend and the server are in, the models' vocabularies and docs
    out, and the archive fits the device's 64 MiB with room."""
    done = run("--prepare", env={"LLMGW_GPU_CHECK_DIR": str(tmp_path)})
    if done.returncode != 0 and "is not there" in done.stderr:
        import pytest

        pytest.skip(f"no cached sdist on this machine: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    made = json.loads(done.stdout)
    assert made["bytes"] < 16 << 20
    with tarfile.open(tmp_path / "llama.cpp.tar.gz") as t:
        names = t.getnames()
    assert "llama.cpp/CMakeLists.txt" in names
    assert any(n.startswith("llama.cpp/ggml/src/ggml-cuda/") for n in names)
    assert any(n.startswith("llama.cpp/tools/server/") for n in names)
    assert not any(n.startswith(("llama.cpp/models/", "llama.cpp/docs/")) for n in names)
