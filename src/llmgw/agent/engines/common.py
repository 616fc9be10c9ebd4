"""What the CPU and GPU engines share: the status each reports while a thread of its own
sets it, the binary found, the quiet run of a check, and engine.json, the record of the
ready engine that the node's checks read."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from llmgw.contract import CPU_ENGINE, EngineState
from llmgw.contract.records import EngineStatus
from llmgw.errors import Error
from llmgw.host.files import atomic_write

log = logging.getLogger("llmgw.agent.engine")

CHECK_TIMEOUT_S = 60
_VERSION_LINE = re.compile(r"version:\s*(\S+)")


class EngineUnavailable(Error):
    """No engine: state is `failed` (something broke) or `unsupported` (cannot be had here)."""

    def __init__(self, state: str, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


def configured_engine(configured: str, key: str, remedy: str) -> Path:
    """The engine agent.yaml's engine.KEY names (~ expanded); EngineUnavailable (failed)
    when it is no executable file, saying to fix it or remove the key to remedy."""
    path = Path(configured).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EngineUnavailable(
            EngineState.FAILED,
            f"engine.{key} in agent.yaml names {path}, which is not an executable file; fix "
            f"the path or remove the key to {remedy}")
    return path


def engine_status(engine: str, version: str, state: str, detail: str = "", *,
                  gpus: list[str] | None = None,
                  left_out: dict[str, str] | None = None) -> EngineStatus:
    """An engine's status as the heartbeat sends it. gpus and left_out are the GPU engine's
    cards: those that passed its check, and those left out with why; both absent where
    it did not check card by card (the CPU engine)."""
    status: EngineStatus = {"engine": engine, "version": version, "state": state,
                            "detail": detail}
    if gpus is not None:
        status["gpus"] = list(gpus)
        status["left_out"] = dict(left_out or {})
    return status


@dataclass(frozen=True)
class Found:
    """An engine binary, where it came from (configured, path, cache, built) and its version."""

    path: Path
    version: str
    origin: str


def version_of(output: str) -> str:
    """A name for a binary's version from its `--version` output: `b1234`, `0.5.0-dev`."""
    m = _VERSION_LINE.search(output)
    if not m:
        return "unknown"
    return f"b{m.group(1)}" if m.group(1).isdigit() else m.group(1)


def one_line(text: str) -> str:
    """text with its lines joined by ' / ' and runs of blanks as one: a reason the
    heartbeat, `llmgw status` and provision's output show on one line."""
    return " / ".join(" ".join(line.split()) for line in text.strip().splitlines()
                      if line.strip())


def run_quietly(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Exit status and the whole output (llama-server writes --version to stderr)."""
    try:
        proc = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
            stdin=subprocess.DEVNULL, env=env,
        )
    except subprocess.TimeoutExpired:
        return 124, f"no answer within {CHECK_TIMEOUT_S}s"
    except OSError as e:
        return 126, str(e)
    return proc.returncode, proc.stdout + proc.stderr


class Reporting:
    """An engine's status, read by the heartbeat while a thread of the engine's own sets it."""

    def __init__(self, status: EngineStatus) -> None:
        self._status = status
        self._lock = threading.Lock()

    @property
    def status(self) -> EngineStatus:
        """A copy: what a reader holds does not change under it."""
        with self._lock:
            return self._status.copy()

    def ready(self) -> bool:
        return self.status.get("state") == EngineState.READY

    def _report(self, status: EngineStatus) -> None:
        with self._lock:
            self._status = status
        log.info("%s %s: %s %s", status.get("engine"), status.get("version"),
                 status.get("state"), status.get("detail"))


class EngineRecord(TypedDict):
    """engine.json in the agent's state: its ready engine, for the node's checks."""

    engine: str
    version: str
    path: str
    origin: str


def recorded_engine(state_dir: Path) -> EngineRecord | None:
    """What the agent recorded about its ready engine, or None when it has not."""
    try:
        return json.loads((state_dir / "engine.json").read_text())
    except (OSError, ValueError):
        return None


def record(state_dir: Path, found: Found) -> None:
    """engine.json in state_dir: the CPU engine that is ready, for the node's checks."""
    entry: EngineRecord = {"engine": CPU_ENGINE, "version": found.version,
                           "path": str(found.path), "origin": found.origin}
    atomic_write(state_dir / "engine.json", json.dumps(entry, indent=2) + "\n")
