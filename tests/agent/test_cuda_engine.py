"""The GPU engine (llamacpp-cuda): made after the CPU engine, in the background, checked by
`--list-devices` with each GPU alone visible, and failing in one line that says why.

The builds here are stand-ins (a CUDA build takes far too long on these machines); the
binaries they hand back are real executables that list CUDA devices as llama-server does,
by the CUDA_VISIBLE_DEVICES they are run with. The real build is checked on a lent GPU
machine (scripts/gpu-check)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from llmgw.agent.engines import cache
from llmgw.agent.engines._build import BuildError
from llmgw.agent.engines.common import engine_status
from llmgw.agent.engines.cpu import LlamaCpp
from llmgw.agent.engines.cuda import CudaEngine, cuda_devices
from llmgw.agent.gpus import GPU, Discovery
from llmgw.config import EngineConfig
from llmgw.contract import CPU_ENGINE, CUDA_ENGINE, EngineState

H100 = GPU(0, "NVIDIA H100 80GB HBM3", 81559, "GPU-aaaa", "h100-80gb",
           compute_capability="9.0")
L4 = GPU(1, "NVIDIA L4", 23034, "GPU-bbbb", "l4", compute_capability="8.9")


def lister(directory: Path, names: dict[str, str], log: Path | None = None) -> Path:
    """A llama-server whose --list-devices names, as CUDA0, the card of the UUID in
    CUDA_VISIBLE_DEVICES (names: UUID -> what CUDA calls it); none for another UUID."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "llama-server"
    cases = "".join(f'  {uuid}) echo "  CUDA0: {name} (81000 MiB, 80000 MiB free)" ;;\n'
                    for uuid, name in names.items())
    record = f'echo "$CUDA_VISIBLE_DEVICES" >> {log}\n' if log else ""
    path.write_text("#!/bin/sh\n"
                    '[ "$1" = --list-devices ] || exit 2\n'
                    f"{record}"
                    'echo "Available devices:"\n'
                    f'case "$CUDA_VISIBLE_DEVICES" in\n{cases}esac\n')
    path.chmod(0o755)
    return path


def ready_cpu(tmp_path: Path) -> LlamaCpp:
    cpu = LlamaCpp(EngineConfig(cache_dir=str(tmp_path / "cache")),
                   search_path=str(tmp_path / "empty"))
    cpu._status = engine_status(CPU_ENGINE, cpu.source_version, EngineState.READY)
    return cpu


def cuda_engine(tmp_path: Path, build: Callable[[Callable[[str], None]], Path] | None,
                gpus: list[GPU], **config: str) -> CudaEngine:
    cpu = ready_cpu(tmp_path)
    cfg = EngineConfig(cache_dir=str(tmp_path / "cache"), **config)  # type: ignore[arg-type]
    return CudaEngine(cfg, Discovery(gpus), cpu=cpu, build=build)


def never(on_progress: Callable[[str], None]) -> Path:
    raise AssertionError("nothing may be built here")


def test_llama_servers_device_list_is_read_as_cuda_names() -> None:
    out = ("Available devices:\n  CUDA0: NVIDIA H200 (143771 MiB, 143000 MiB free)\n"
           "  CUDA1: NVIDIA L4 (22000 MiB, 21000 MiB free)\n")
    assert cuda_devices(out) == ["NVIDIA H200", "NVIDIA L4"]
    assert cuda_devices("Available devices:\n") == []


def test_switched_off_builds_nothing_and_says_so(tmp_path: Path) -> None:
    e = cuda_engine(tmp_path, never, [H100], cuda="off")
    status = e.status
    assert status["state"] == EngineState.SWITCHED_OFF and "engine.cuda: off" in status["detail"]
    assert e.start() is None and not e.wanted()


def test_a_node_without_gpus_has_no_gpu_engine(tmp_path: Path) -> None:
    e = cuda_engine(tmp_path, never, [])
    assert e.status["state"] == EngineState.ABSENT and e.start() is None


def test_a_built_engine_is_ready_once_each_gpu_alone_is_listed(tmp_path: Path) -> None:
    """The check runs --list-devices once per GPU with only that GPU visible."""
    seen = tmp_path / "seen"
    built = lister(tmp_path / "built", {"GPU-aaaa": "NVIDIA H100 80GB HBM3",
                                        "GPU-bbbb": "NVIDIA L4"}, log=seen)
    progress: list[str] = []

    def build(on_progress: Callable[[str], None]) -> Path:
        on_progress("40%")
        progress.append("called")
        return built

    e = cuda_engine(tmp_path, build, [H100, L4])
    status = e.provision()
    assert status["state"] == EngineState.READY, status
    assert e.found is not None and e.found.path == built and e.ready()
    assert seen.read_text().split() == ["GPU-aaaa", "GPU-bbbb"]
    assert progress == ["called"]


def test_negative_control_a_cpu_build_lists_no_cuda_device_and_fails_in_one_line(
        tmp_path: Path) -> None:
    cpu_only = lister(tmp_path / "cpu", {})
    e = cuda_engine(tmp_path, lambda on_progress: cpu_only, [H100])
    status = e.provision()
    assert status["state"] == EngineState.FAILED
    assert "names no CUDA device" in status["detail"] and "GPU-aaaa" in status["detail"]
    assert "the node serves on CPU meanwhile" in status["detail"]
    assert "\n" not in status["detail"]


def test_a_device_that_is_not_the_card_nvml_named_fails(tmp_path: Path) -> None:
    wrong = lister(tmp_path / "wrong", {"GPU-aaaa": "NVIDIA L4"})
    status = cuda_engine(tmp_path, lambda on_progress: wrong, [H100]).provision()
    assert status["state"] == EngineState.FAILED
    assert "'NVIDIA L4'" in status["detail"] and "NVIDIA H100" in status["detail"]


def test_a_failed_build_is_one_line_and_leaves_the_cpu_engine_serving(tmp_path: Path) -> None:
    def fails(on_progress: Callable[[str], None]) -> Path:
        raise BuildError("cmake failed (1):\n  * An ALIAS target is missing\n\nsee build.log")

    e = cuda_engine(tmp_path, fails, [H100])
    status = e.provision()
    assert status["state"] == EngineState.FAILED
    assert status["detail"].startswith("cmake failed (1): / * An ALIAS target is missing / see")
    assert e.cpu.status["state"] == EngineState.READY


def test_a_configured_cuda_server_is_checked_and_used_without_a_build(tmp_path: Path) -> None:
    given = lister(tmp_path / "given", {"GPU-aaaa": "NVIDIA H100 80GB HBM3"})
    e = cuda_engine(tmp_path, never, [H100], cuda_server=str(given))
    assert e.provision()["state"] == EngineState.READY
    assert e.found is not None and e.found.origin == "configured"


def test_the_cuda_builds_rpc_server_is_the_engines_and_a_configured_one_has_none(
        tmp_path: Path) -> None:
    """A built engine with rpc-server beside its llama-server offers it (the node's GPUs
    for a main node's --rpc); the controls: the same build without rpc-server (one from
    before the RPC backend) offers none, nor does a configured cuda_server with an
    rpc-server beside it (llmgw cannot know what that binary was built with)."""
    built = lister(tmp_path / "built-rpc", {"GPU-aaaa": "NVIDIA H100 80GB HBM3"})
    e = cuda_engine(tmp_path, lambda on_progress: built, [H100])
    assert e.provision()["state"] == EngineState.READY and e.rpc_server is None
    rpc = built.parent / cache.RPC_SERVER
    rpc.write_text("#!/bin/sh\n")
    rpc.chmod(0o755)
    assert e.provision()["state"] == EngineState.READY and e.rpc_server == rpc
    configured = cuda_engine(tmp_path, never, [H100], cuda_server=str(built))
    assert configured.provision()["state"] == EngineState.READY
    assert configured.rpc_server is None


def test_a_configured_cuda_server_that_is_not_there_says_which_key(tmp_path: Path) -> None:
    e = cuda_engine(tmp_path, never, [H100], cuda_server=str(tmp_path / "nope"))
    status = e.provision()
    assert status["state"] == EngineState.FAILED
    assert status["detail"] == (
        f"engine.cuda_server in agent.yaml names {tmp_path / 'nope'}, which is not an "
        "executable file; fix the path or remove the key to have one built; the node serves "
        "on CPU meanwhile")


def test_the_build_waits_for_the_cpu_engine(tmp_path: Path) -> None:
    """One build at a time: the GPU engine starts only once the CPU engine is ready."""
    built = lister(tmp_path / "built", {"GPU-aaaa": "NVIDIA H100 80GB HBM3"})
    started = threading.Event()

    def build(on_progress: Callable[[str], None]) -> Path:
        started.set()
        return built

    e = cuda_engine(tmp_path, build, [H100])
    e.cpu._status = engine_status(CPU_ENGINE, "v", EngineState.BUILDING, "40%")
    thread = e.start()
    assert thread is not None
    assert not started.wait(1.0), "the GPU build began while the CPU engine was building"
    assert e.status["state"] == EngineState.PENDING
    e.cpu._status = engine_status(CPU_ENGINE, "v", EngineState.READY)
    thread.join(timeout=30)
    assert started.is_set() and e.status["state"] == EngineState.READY


def test_a_failed_engine_is_tried_again_only_when_its_cache_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    built = lister(tmp_path / "built", {"GPU-aaaa": "NVIDIA H100 80GB HBM3"})

    def flaky(on_progress: Callable[[str], None]) -> Path:
        calls.append(1)
        if len(calls) == 1:
            raise BuildError("no CUDA toolkit")
        return built

    monkeypatch.setattr("llmgw.agent.engines.cuda.RETRY_LOOK_S", 0.0)
    e = cuda_engine(tmp_path, flaky, [H100])
    assert e.provision()["state"] == EngineState.FAILED
    assert not e.retry_if_cache_changed(), "tried again with nothing changed"
    stamp = time.time() + 5
    elsewhere = e.cache_dir / "toolchains"  # a folder of the cache that nothing makes
    elsewhere.mkdir(parents=True, exist_ok=True)
    os.utime(elsewhere, (stamp, stamp))
    assert not e.retry_if_cache_changed(), "tried again for a folder no build reads"
    toolchains = cache.toolchains(e.cache_dir)
    toolchains.mkdir(parents=True, exist_ok=True)
    os.utime(toolchains, (stamp, stamp))
    assert e.retry_if_cache_changed()
    assert e._thread is not None
    e._thread.join(timeout=30)
    assert e.status["state"] == EngineState.READY and len(calls) == 2
    assert e.status["engine"] == CUDA_ENGINE


def _standin_nvml() -> object:
    from importlib.machinery import SourceFileLoader
    from importlib.util import module_from_spec, spec_from_loader

    path = Path(__file__).resolve().parents[1] / "standin_nvml" / "pynvml.py"
    loader = SourceFileLoader("standin_pynvml", str(path))
    spec = spec_from_loader("standin_pynvml", loader)
    assert spec is not None
    module = module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("driver", ["11080", "12040"], ids=["CUDA 11.8", "control: CUDA 12.4"])
def test_a_driver_too_old_for_any_toolkit_says_so_before_any_download(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: str) -> None:
    """The stand-in NVML on a driver that runs CUDA 11.8: the GPU engine fails in one line
    naming the driver and what to install, and neither the llama.cpp source nor a toolkit
    is fetched. The control, a 12.4 driver, fails further on (no CUDA 12 toolkit can be
    had here), not for the driver."""
    from llmgw.agent.engines import _build, _toolchain
    from llmgw.agent.gpus import discover

    monkeypatch.setenv("LLMGW_STANDIN_CUDA_DRIVER", driver)
    fetched: list[str] = []

    def no_download(*args: object) -> Path:
        fetched.append(repr(args))
        raise BuildError("nothing is downloaded in this test")

    monkeypatch.setattr(_build, "download_sdist", no_download)
    monkeypatch.setattr(_toolchain, "pip_install", lambda req, target: fetched.append(repr(req)))
    found = discover(nvml=_standin_nvml())
    cpu = LlamaCpp(EngineConfig(cache_dir=str(tmp_path / "cache")))
    cpu._status = engine_status(CPU_ENGINE, cpu.source_version, EngineState.READY)
    status = CudaEngine(EngineConfig(cache_dir=str(tmp_path / "cache")), found, cpu=cpu
                        ).provision()
    assert status["state"] == EngineState.FAILED and "\n" not in status["detail"]
    said_driver = "runs CUDA 11.8" in status["detail"] and "update the driver" in status["detail"]
    assert said_driver == (driver == "11080"), status["detail"]
    if driver == "11080":
        assert fetched == [], "nothing may be fetched before the driver's reason"


def test_a_card_that_fails_its_check_is_left_out_and_the_engine_serves_the_others(
        tmp_path: Path) -> None:
    only_l4 = lister(tmp_path / "l4", {"GPU-bbbb": "NVIDIA L4"})
    status = cuda_engine(tmp_path, lambda on_progress: only_l4, [H100, L4]).provision()
    assert status["state"] == EngineState.READY, status
    assert status["gpus"] == ["GPU-bbbb"]
    assert list(status["left_out"]) == ["GPU-aaaa"]
    assert "names no CUDA device" in status["left_out"]["GPU-aaaa"]
    assert "1 of 2 GPU(s) passed its check; 1 left out: GPU-aaaa" in status["detail"]


def test_negative_control_every_card_failing_its_check_fails_the_engine_naming_each(
        tmp_path: Path) -> None:
    none = lister(tmp_path / "none", {})
    status = cuda_engine(tmp_path, lambda on_progress: none, [H100, L4]).provision()
    assert status["state"] == EngineState.FAILED
    assert "GPU-aaaa" in status["detail"] and "GPU-bbbb" in status["detail"]
    assert "gpus" not in status
