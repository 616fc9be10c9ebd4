"""A node's CPU engine, `llamacpp`, provisioned and reported on its own (the GPU engine,
`llamacpp-cuda`, is llmgw.agent.cuda_engine's), and what both engines share: their status,
the binary found, the quiet run of a check.

The CPU engine, in its order of sources: `engine.llama_server` from agent.yaml;
`llama-server` on PATH; a build cached by version; else a CMake build of the pinned source.
`engine.prebuilt` adds xllamacpp's prebuilt CPU wheel (llmgw.agent._prebuilt): `xllamacpp`
takes it before the cached build, `auto` where no build is cached and no engine.version is
named (and builds when the wheel cannot be had).

The cache lives outside any checkout, under `engine.cache_dir` (default
`${XDG_CACHE_HOME:-~/.cache}/llmgw`):

    <cache_dir>/engines/llamacpp/<version>[-cuda]/llama-server   the build, one static file
    <cache_dir>/engines/llamacpp/<version>[-cuda]/build.log      how it was built
    <cache_dir>/sources/llama_cpp_python-<version>.tar.gz         the downloaded source

`<version>` is the pinned llama-cpp-python release whose vendored llama.cpp was built
(0.3.36 unless `engine.version` says otherwise). A configured or PATH binary is named by
what its `--version` says (`b1234` for a numbered build).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from llmgw._files import atomic_write
from llmgw.agent import _build, _prebuilt
from llmgw.agent._build import BuildError
from llmgw.config import EngineConfig
from llmgw.contract import CPU_ENGINE, EngineState
from llmgw.contract.records import EngineStatus
from llmgw.errors import Error

log = logging.getLogger("llmgw.agent.engine")

ENGINE = CPU_ENGINE
BINARY = "llama-server"
PINNED_VERSION = "0.3.36"
CHECK_TIMEOUT_S = 60
_VERSION_LINE = re.compile(r"version:\s*(\S+)")


class EngineUnavailable(Error):
    """No engine: state is `failed` (something broke) or `unsupported` (cannot be had here)."""

    def __init__(self, state: str, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


@dataclass(frozen=True)
class Status:
    engine: str
    version: str
    state: str
    detail: str = ""
    # The GPU engine's cards: those that passed its check, and those left out with why
    # (None: not checked card by card, as the CPU engine).
    gpus: tuple[str, ...] | None = None
    left_out: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> EngineStatus:
        status: EngineStatus = {"engine": self.engine, "version": self.version,
                                "state": self.state, "detail": self.detail}
        if self.gpus is not None:
            status["gpus"] = list(self.gpus)
            status["left_out"] = dict(self.left_out)
        return status


@dataclass(frozen=True)
class Found:
    """An engine binary, where it came from (configured, path, cache, built) and its version."""

    path: Path
    version: str
    origin: str


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmgw"


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

    def __init__(self, status: Status) -> None:
        self._status = status
        self._lock = threading.Lock()

    @property
    def status(self) -> Status:
        with self._lock:
            return self._status

    def ready(self) -> bool:
        return self.status.state == EngineState.READY

    def _report(self, status: Status) -> None:
        with self._lock:
            self._status = status
        log.info("%s %s: %s %s", status.engine, status.version, status.state, status.detail)


class LlamaCpp(Reporting):
    """Provisions llama-server for this node; `status` says how far it got, at any time."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        state_dir: Path | None = None,
        search_path: str | None = None,
        jobs: int | None = None,
    ) -> None:
        self.config = config
        self.state_dir = state_dir
        # None means this process's PATH; tests pass their own.
        self.search_path = search_path
        self.jobs = jobs or os.cpu_count() or 1
        self.source_version = config.version or PINNED_VERSION
        self.cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else (
            default_cache_dir()
        )
        self.found: Found | None = None
        super().__init__(Status(ENGINE, self.source_version, EngineState.PENDING, ""))
        self._thread: threading.Thread | None = None
        self._runner: _build.Runner | None = None

    def _say(self, state: str, detail: str = "", version: str | None = None) -> None:
        self._report(Status(ENGINE, version or self.status.version, state, detail))

    # --- where the cache is ---

    @property
    def flavour(self) -> str:
        return self.source_version

    @property
    def cached_binary(self) -> Path:
        return self.cache_dir / "engines" / ENGINE / self.flavour / BINARY

    @property
    def sources_dir(self) -> Path:
        return self.cache_dir / "sources"

    # --- the order of sources ---

    def start(self) -> threading.Thread:
        """Provision in a background thread; read `status` to follow it."""
        self._thread = threading.Thread(target=self.provision, name="engine", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop a running build (the agent is going away); the next start builds again."""
        if self._runner is not None:
            self._runner.stop()

    def provision(self) -> Status:
        """Find or build the engine, check it, and end in ready, failed or unsupported."""
        try:
            found = self._obtain()
            self._say(EngineState.CHECKING, f"{found.path} ({found.origin})",
                      version=found.version)
            self.check(found)
        except EngineUnavailable as e:
            self._say(e.state, e.detail)
            return self.status
        except Error as e:
            self._say(EngineState.FAILED, str(e))
            return self.status
        except Exception as e:  # a bug must show in the node's state, not kill the thread quietly
            log.exception("provisioning %s", ENGINE)
            self._say(EngineState.FAILED,
                      f"unexpected {type(e).__name__}: {e}; see the agent's log")
            return self.status
        self.found = found
        self._record(found)
        self._say(EngineState.READY, f"{found.path} ({found.origin})", version=found.version)
        return self.status

    def locate(self) -> Found | None:
        """An engine that needs no build: configured, on PATH, or cached; None when none."""
        configured = self.config.llama_server
        if configured:
            path = Path(configured).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise EngineUnavailable(
                    EngineState.FAILED,
                    f"engine.llama_server in agent.yaml names {path}, which is not an executable "
                    "file; fix the path or remove the key to let the agent find or build one, "
                    "then restart the agent",
                )
            return Found(path, self._binary_version(path), "configured")
        on_path = shutil.which(BINARY, path=self.search_path)
        if on_path:
            return Found(Path(on_path), self._binary_version(Path(on_path)), "path")
        if self.config.prebuilt == _prebuilt.ENGINE:
            return self._prebuilt_cached()
        if self.cached_binary.is_file() and os.access(self.cached_binary, os.X_OK):
            return Found(self.cached_binary, self.source_version, "cache")
        return self._prebuilt_cached() if self._prebuilt_allowed() else None

    # --- the prebuilt wheel ---

    def _prebuilt_allowed(self) -> bool:
        # auto leaves a version asked for by name to the source build.
        return self.config.prebuilt == _prebuilt.ENGINE or (
            self.config.prebuilt == "auto" and not self.config.version
        )

    def _prebuilt_cached(self) -> Found | None:
        if not _prebuilt.installed(self.cache_dir):
            return None
        return self._prebuilt_found(_prebuilt.write_launcher(self.cache_dir), "cache")

    @staticmethod
    def _prebuilt_found(path: Path, how: str) -> Found:
        return Found(path, f"{_prebuilt.ENGINE}-{_prebuilt.VERSION}", f"prebuilt {how}")

    def install_prebuilt(self) -> Found:
        """The prebuilt CPU wheel into the cache's venv (a GPU node's GPU engine is
        llamacpp-cuda, made on its own)."""
        self._say(EngineState.DOWNLOADING,
                  f"{_prebuilt.ENGINE} {_prebuilt.VERSION} prebuilt wheel from the package index")
        return self._prebuilt_found(_prebuilt.install(self.cache_dir), "installed")

    def _obtain(self) -> Found:
        """The engine to check: located, else the prebuilt wheel where allowed, else built."""
        found = self.locate()
        if found:
            return found
        if self.config.prebuilt == _prebuilt.ENGINE:
            return self.install_prebuilt()
        if self._prebuilt_allowed():
            try:
                return self.install_prebuilt()
            except BuildError as e:
                log.warning("no prebuilt engine, building the pinned source instead: %s", e)
        return self.build()

    def _binary_version(self, path: Path) -> str:
        rc, out = run_quietly([str(path), "--version"])
        return version_of(out) if rc == 0 else "unknown"

    # --- building ---

    def build(self) -> Found:
        """Build the pinned source into the cache; one build per version at a time."""
        missing = _build.missing_tools(self.search_path)
        if missing:
            raise EngineUnavailable(
                EngineState.UNSUPPORTED,
                f"no {BINARY} here and no way to build one: this machine lacks "
                f"{' and '.join(missing)}. Install them (e.g. `apt-get install cmake g++`) or "
                f"set engine.llama_server in agent.yaml to a {BINARY} binary, then restart "
                "the agent",
            )
        target_dir = self.cached_binary.parent
        target_dir.mkdir(parents=True, exist_ok=True)
        with open(target_dir.parent / f".{self.flavour}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._say(EngineState.BUILDING,
                          "waiting for another build of this version to finish")
                fcntl.flock(lock, fcntl.LOCK_EX)
            if self.cached_binary.is_file():  # the other build made it
                return Found(self.cached_binary, self.source_version, "cache")
            self._build_locked(target_dir)
        return Found(self.cached_binary, self.source_version, "built")

    def source_archive(self, say: Callable[[str], None] | None = None) -> Path:
        """The pinned source: engine.source, else the cached sdist, else downloaded (said
        through say, else as this engine's state)."""
        if self.config.source:
            source = Path(self.config.source).expanduser()
            if not source.exists():
                raise BuildError(
                    f"engine.source in agent.yaml names {source}, which does not exist; fix it "
                    "or remove the key to download the pinned source"
                )
            return source
        cached = self.sources_dir / _build.sdist_name(self.source_version)
        if cached.exists():
            return cached
        what = f"{_build.SOURCE_PACKAGE} {self.source_version} source from the package index"
        if say is not None:
            say(f"downloading {what}")
        else:
            self._say(EngineState.DOWNLOADING, what)
        return _build.download_sdist(self.source_version, self.sources_dir)

    def _build_locked(self, target_dir: Path) -> None:
        archive = self.source_archive()
        work = Path(tempfile.mkdtemp(prefix=f"build-{self.flavour}-", dir=target_dir.parent))
        build_log = target_dir / "build.log"
        build_log.write_text("")
        self._runner = _build.Runner(build_log, self.search_path)
        try:
            self._say(EngineState.BUILDING, f"unpacking {archive.name}")
            tree = _build.unpack(archive, work / "src")
            build = work / "build"
            self._say(EngineState.BUILDING, "configuring")
            self._runner.run(_build.cmake_configure_args(tree, build, cuda_compiler=None))
            self._say(EngineState.BUILDING, "0%")
            self._runner.run(_build.cmake_build_args(build, self.jobs), self._on_build_line)
            self._install(build / "bin" / BINARY, target_dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            self._runner = None

    def _on_build_line(self, line: str) -> None:
        percent = _build.build_percent(line)
        if percent is not None and f"{percent}%" != self.status.detail:
            self._say(EngineState.BUILDING, f"{percent}%")

    def _install(self, built: Path, target_dir: Path) -> None:
        if not built.is_file():
            raise BuildError(
                f"the build finished without {built}; see {target_dir / 'build.log'}"
            )
        tmp = target_dir / f".{BINARY}.tmp"
        shutil.copy2(built, tmp)
        tmp.replace(self.cached_binary)

    # --- the check before ready ---

    def check(self, found: Found) -> None:
        """`--version` answers (the CPU engine's devices are not its business: a GPU is
        llamacpp-cuda's)."""
        rc, out = run_quietly([str(found.path), "--version"])
        if rc != 0 or "version" not in out:
            raise EngineUnavailable(
                EngineState.FAILED,
                f"{found.path} --version did not answer ({rc}: {one_line(out)[-300:]}); "
                + self._fix_hint(found),
            )

    def _fix_hint(self, found: Found) -> str:
        if found.origin.startswith("prebuilt"):
            return (f"remove {found.path.parent} and restart the agent to install it again, "
                    "or set engine.prebuilt: off in agent.yaml")
        if found.origin in ("cache", "built"):
            return f"remove {found.path.parent} and restart the agent to build it again"
        if found.origin == "path":
            return f"remove or fix {found.path} on PATH, or set engine.llama_server in agent.yaml"
        return "fix engine.llama_server in agent.yaml, or remove it, and restart the agent"

    # --- what the node's checks read ---

    def _record(self, found: Found) -> None:
        if self.state_dir is None:
            return
        record: EngineRecord = {"engine": ENGINE, "version": found.version, "path": str(found.path),
                  "origin": found.origin}
        atomic_write(self.state_dir / "engine.json", json.dumps(record, indent=2) + "\n")


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
