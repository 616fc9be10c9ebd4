"""A node's CPU engine, `llamacpp`, provisioned and reported on its own (the GPU engine,
`llamacpp-cuda`, is llmgw.agent.engines.cuda's; what both share, llmgw.agent.engines.common').

In its order of sources: `engine.llama_server` from agent.yaml; `llama-server` on PATH; a
build cached by version; else a CMake build of the pinned source (llmgw.agent.engines._build's
Driver, into the cache that llmgw.agent.engines.cache lays out). `engine.prebuilt` adds
xllamacpp's prebuilt CPU wheel (llmgw.agent.engines._prebuilt): `xllamacpp` takes it before the
cached build, `auto` where no build is cached and no engine.version is named (and builds
when the wheel cannot be had).

`<version>` is the pinned llama-cpp-python release whose vendored llama.cpp was built
(0.3.36 unless `engine.version` says otherwise). A configured or PATH binary is named by
what its `--version` says (`b1234` for a numbered build).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from llmgw.agent.engines import _build, _cmake, _prebuilt, cache
from llmgw.agent.engines._build import BuildError
from llmgw.agent.engines.common import (
    EngineUnavailable,
    Found,
    Reporting,
    configured_engine,
    engine_status,
    one_line,
    record,
    run_quietly,
    version_of,
)
from llmgw.config import EngineConfig
from llmgw.contract import CPU_ENGINE, EngineState
from llmgw.contract.records import EngineStatus
from llmgw.errors import Error

log = logging.getLogger("llmgw.agent.engine")

ENGINE = CPU_ENGINE
BINARY = cache.BINARY
PINNED_VERSION = "0.3.36"


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
            cache.user_root()
        )
        self.found: Found | None = None
        super().__init__(engine_status(ENGINE, self.source_version, EngineState.PENDING))
        self._thread: threading.Thread | None = None
        self._driver: _build.Driver | None = None

    def _say(self, state: str, detail: str = "", version: str | None = None) -> None:
        self._report(engine_status(ENGINE, version or self.status["version"], state, detail))

    # --- where the cache is ---

    @property
    def flavour(self) -> str:
        return self.source_version

    @property
    def cached_binary(self) -> Path:
        """Where this version's build is: the one with the RPC backend, else (until that is
        built) an earlier one without it."""
        rpc = cache.cpu_build(self.cache_dir, self.flavour, rpc=True) / BINARY
        old = cache.cpu_build(self.cache_dir, self.flavour) / BINARY
        return old if not rpc.is_file() and old.is_file() else rpc

    @property
    def rpc_server(self) -> Path | None:
        """rpc-server of this node's engine, None where it has no RPC backend (a
        configured, PATH or prebuilt llama-server, or a build from before it)."""
        return self.rpc_server_of(self.found) if self.found is not None else None

    @staticmethod
    def rpc_server_of(found: Found) -> Path | None:
        if found.origin not in ("cache", "built"):
            return None
        path = found.path.parent / cache.RPC_SERVER
        return path if path.is_file() and os.access(path, os.X_OK) else None

    # --- the order of sources ---

    def start(self) -> threading.Thread:
        """Provision in a background thread; read `status` to follow it."""
        self._thread = threading.Thread(target=self.provision, name="engine", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop a running build (the agent is going away); the next start builds again."""
        if self._driver is not None:
            self._driver.stop()

    def provision(self) -> EngineStatus:
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
            path = configured_engine(configured, "llama_server", "let the agent find or "
                                     "build one, then restart the agent")
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
        target = cache.cpu_build(self.cache_dir, self.flavour, rpc=True)
        self._driver = driver = _build.Driver(
            target, search_path=self.search_path,
            on_progress=lambda detail: self._say(EngineState.BUILDING, detail),
            binaries={BINARY: BINARY, _cmake.RPC_TARGET: cache.RPC_SERVER})
        try:
            built = driver.run(self.source_archive,
                               lambda tree, build: _cmake.cmake_configure_args(tree, build,
                                                                               rpc=True),
                               lambda: self.jobs)
        finally:
            self._driver = None
        return Found(target / BINARY, self.source_version, "built" if built else "cache")

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
        cached = cache.sdist(self.cache_dir, self.source_version)
        if cached.exists():
            return cached
        what = f"{_build.SOURCE_PACKAGE} {self.source_version} source from the package index"
        if say is not None:
            say(f"downloading {what}")
        else:
            self._say(EngineState.DOWNLOADING, what)
        return _build.download_sdist(self.source_version, cached)

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
        if self.state_dir is not None:
            record(self.state_dir, found)
