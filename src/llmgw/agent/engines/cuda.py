"""The GPU engine, `llamacpp-cuda`: llama.cpp built with CUDA, on a node with NVIDIA GPUs.

With `engine.cuda: auto` (the default) it is made after the CPU engine is ready, in the
background, while the CPU engine serves: `engine.cuda_server` from agent.yaml, else a CUDA
build (llmgw.agent.engines._build). It is ready once `--list-devices`, run with each GPU alone
visible, names that GPU; a card that fails its check is named and left out (the engine
serves the others, and the heartbeat says which passed). A build that fails, or a check
that no card passes, says why in one line and is not tried again until the agent restarts
or the cache changes.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.agent import gpus as gpu_discovery
from llmgw.agent.engines import _build, cache
from llmgw.agent.engines.common import (
    EngineUnavailable,
    Found,
    Reporting,
    configured_engine,
    engine_status,
    one_line,
    run_quietly,
)
from llmgw.agent.engines.cpu import ENGINE, LlamaCpp
from llmgw.config import EngineConfig
from llmgw.contract import CUDA_ENGINE, ENGINE_GAVE_UP, EngineState
from llmgw.contract.records import EngineStatus, Gpu
from llmgw.errors import Error

log = logging.getLogger("llmgw.agent.engine")


_CUDA_DEVICE_LINE = re.compile(r"^\s*CUDA(\d+):\s*(.*?)\s*(?:\(|$)", re.MULTILINE)
# How often a failed GPU engine looks whether its cache changed (a new try then).
RETRY_LOOK_S = 30.0


# A CUDA build: given a way to report progress (`40%`), the llama-server it made.
CudaBuild = Callable[[Callable[[str], None]], Path]


def cuda_devices(output: str) -> list[str]:
    """The CUDA devices `llama-server --list-devices` names, in order: their descriptions."""
    return [m.group(2) for m in _CUDA_DEVICE_LINE.finditer(output)]


class CudaEngine(Reporting):
    """llamacpp-cuda: made after the CPU engine is ready, in the background; `status` says
    how far it got (absent, switched_off, pending, building, checking, ready, failed)."""

    def __init__(
        self,
        config: EngineConfig,
        discovery: gpu_discovery.Discovery,
        *,
        cpu: LlamaCpp,
        build: CudaBuild | None = None,
    ) -> None:
        self.config = config
        self.discovery = discovery
        self.gpus: list[Gpu] = [g.as_dict() for g in discovery.gpus]
        self.cpu = cpu
        self.build_engine = build or self._build_with_cuda
        self.version = cpu.source_version
        self.cache_dir = cpu.cache_dir
        self.found: Found | None = None
        self._runner: _build.CudaBuild | None = None
        self._stopped = threading.Event()
        super().__init__(self._initial())
        self._thread: threading.Thread | None = None
        self._failed_at: tuple[float, ...] | None = None
        self._looked = 0.0

    def _initial(self) -> EngineStatus:
        if self.config.cuda == "off":
            return engine_status(CUDA_ENGINE, self.version, EngineState.SWITCHED_OFF,
                                 "engine.cuda: off in agent.yaml; this node serves on CPU")
        if not self.gpus:
            return engine_status(CUDA_ENGINE, self.version, EngineState.ABSENT,
                                 "no NVIDIA GPU here")
        return engine_status(CUDA_ENGINE, self.version, EngineState.PENDING,
                             f"made once the CPU engine ({ENGINE}) is ready")

    @property
    def rpc_server(self) -> Path | None:
        """rpc-server of this node's CUDA build, serving its GPUs to a main node; None
        where the engine has none (engine.cuda_server, a build from before the RPC
        backend, or no engine yet)."""
        return LlamaCpp.rpc_server_of(self.found) if self.found is not None else None

    def wanted(self) -> bool:
        return self.config.cuda != "off" and bool(self.gpus)

    def _say(self, state: str, detail: str = "") -> None:
        self._report(engine_status(CUDA_ENGINE, self.version, state, detail))

    def start(self) -> threading.Thread | None:
        """Make the engine in a background thread (nothing where it is not wanted)."""
        if not self.wanted():
            return None
        self._thread = threading.Thread(target=self._after_cpu, name="engine-cuda",
                                        daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop a running build (the agent is going away)."""
        self._stopped.set()
        if self._runner is not None:
            self._runner.stop()

    def _after_cpu(self) -> None:
        # One build at a time: a CUDA build beside the CPU one would slow the first answer.
        while not self._stopped.is_set() and self.cpu.status["state"] \
                not in (EngineState.READY, *ENGINE_GAVE_UP):
            self._stopped.wait(0.25)
        if not self._stopped.is_set():
            self.provision()

    def provision(self) -> EngineStatus:
        """Find or build the engine, check it; end in ready or failed (one line why)."""
        try:
            found = self._obtain()
            self._say(EngineState.CHECKING, f"{found.path} ({found.origin})")
            left_out = self.check(found)
        except Exception as e:  # noqa: BLE001 - every failure is the node's to show, once
            if not isinstance(e, Error):
                log.exception("provisioning %s", CUDA_ENGINE)
            self._failed_at = self._cache_stamp()
            self._say(EngineState.FAILED, one_line(str(e))[:500]
                      + "; the node serves on CPU meanwhile")
            return self.status
        self.found = found
        passed = [str(g.get("uuid", "")) for g in self.gpus
                  if str(g.get("uuid", "")) not in left_out]
        out = f"; {len(left_out)} left out: {', '.join(left_out)}" if left_out else ""
        self._report(engine_status(CUDA_ENGINE, self.version, EngineState.READY,
                                   f"{found.path} ({found.origin}), {len(passed)} of "
                                   f"{len(self.gpus)} GPU(s) passed its check{out}",
                                   gpus=passed, left_out=left_out))
        return self.status

    def _obtain(self) -> Found:
        configured = self.config.cuda_server
        if configured:
            path = configured_engine(configured, "cuda_server", "have one built")
            return Found(path, self.version, "configured")
        self._say(EngineState.BUILDING, "finding a CUDA toolchain")
        built = self.build_engine(lambda detail: self._say(EngineState.BUILDING, detail))
        return Found(built, self.version, "built")

    def _build_with_cuda(self, on_progress: Callable[[str], None]) -> Path:
        """llama.cpp built with CUDA for this node's GPUs into the cache (or found there)."""
        def source() -> Path:  # fetched only once the driver and toolchain allow a build
            return self.cpu.source_archive(on_progress)

        self._runner = _build.CudaBuild(self.version, source, self.cache_dir, self.discovery,
                            on_progress=on_progress, search_path=self.cpu.search_path)
        try:
            return Path(self._runner.run())
        finally:
            self._runner = None

    def check(self, found: Found) -> dict[str, str]:
        """`--list-devices`, with each GPU alone visible (CUDA_VISIBLE_DEVICES=its UUID),
        names a CUDA device, and that device is the GPU NVML named. A card that fails is
        left out (returned: UUID -> why) and the engine serves the others; EngineUnavailable
        when none passed."""
        left_out = {str(g.get("uuid", "")): why for g in self.gpus
                    if (why := self._card_fails(found, g))}
        if len(left_out) == len(self.gpus):
            raise EngineUnavailable(EngineState.FAILED, "; ".join(left_out.values()))
        return left_out

    def _card_fails(self, found: Found, gpu: Gpu) -> str:
        """Why one card fails the check ('' when it passes)."""
        uuid, name = str(gpu.get("uuid", "")), str(gpu.get("name", ""))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid}
        rc, out = run_quietly([str(found.path), "--list-devices"], env=env)
        devices = cuda_devices(out)
        if rc != 0 or not devices:
            return (f"{found.path} --list-devices with CUDA_VISIBLE_DEVICES={uuid} names no "
                    f"CUDA device ({rc}: {one_line(out)[-300:] or 'no output'}); it was not "
                    "built with CUDA, or the CUDA driver cannot run it")
        if not _same_card(devices[0], name):
            return (f"{found.path} --list-devices with CUDA_VISIBLE_DEVICES={uuid} names "
                    f"{devices[0]!r}, but NVML names that GPU {name!r}")
        return ""

    def retry_if_cache_changed(self) -> bool:
        """A failed engine is made again when its cache changed since it failed (someone
        removed a broken build or put a toolkit there); looked at every RETRY_LOOK_S."""
        if self.status["state"] != EngineState.FAILED or self._failed_at is None:
            return False
        now = time.monotonic()
        if now - self._looked < RETRY_LOOK_S:
            return False
        self._looked = now
        if self._cache_stamp() == self._failed_at:
            return False
        log.info("%s: the cache %s changed since it failed; trying again", CUDA_ENGINE,
                 self.cache_dir)
        self._say(EngineState.PENDING, "the cache changed; trying again")
        self.start()
        return True

    def _cache_stamp(self) -> tuple[float, ...]:
        """The modification times of the cache's engine and toolchain folders."""
        stamps = []
        for folder in cache.watched(self.cache_dir):
            try:
                stamps.append(folder.stat().st_mtime)
            except OSError:
                stamps.append(0.0)
        return tuple(stamps)


def _same_card(cuda_name: str, nvml_name: str) -> bool:
    a, b = cuda_name.lower().strip(), nvml_name.lower().strip()
    return bool(a) and (not b or a in b or b in a)
