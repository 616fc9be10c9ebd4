"""Fixtures for the mirror's tests: real `llmgw mirror serve` processes on free ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.contract.records import MirrorVersion
from llmgw.host import admin_token
from llmgw.host.waiting import Probe, wait_until
from llmgw.mirror import MirrorClient, MirrorError
from tests.hosts import free_port


@dataclass
class MirrorProcess:
    """One `llmgw mirror serve` over dir, with its bytes and API ports."""

    dir: Path
    bytes_port: int
    api_port: int
    import_dirs: tuple[Path, ...] = ()
    proc: subprocess.Popen | None = None

    @property
    def token_path(self) -> Path:
        return self.dir.parent / admin_token.TOKEN_FILE

    @property
    def token(self) -> str:
        return admin_token.read_token(self.token_path)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.bytes_port}"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def client(self) -> MirrorClient:
        return MirrorClient(self.api_url, timeout=5.0, token=self.token)

    def start(self) -> MirrorProcess:
        log = (self.dir.parent / "mirror.log").open("ab")
        admin_token.ensure(self.token_path)
        imports = [f"--import-dir={d}" for d in self.import_dirs]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "mirror", "serve", "--dir", str(self.dir),
             "--listen", f"127.0.0.1:{self.bytes_port}",
             "--api-listen", f"127.0.0.1:{self.api_port}",
             "--admin-token-hash", str(admin_token.hash_path_for(self.token_path)), *imports],
            stdout=log, stderr=subprocess.STDOUT,
        )
        wait_until(f"the mirror on {self.api_url}", self._healthy, timeout_s=30, interval_s=0.1)
        return self

    def _healthy(self) -> Probe:
        assert self.proc is not None and self.proc.poll() is None, self.log()
        try:
            with self.client() as c:
                c.health()
        except MirrorError as e:
            return Probe(False, str(e))
        return Probe(True, "ok")

    def log(self) -> str:
        path = self.dir.parent / "mirror.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        return self.proc.wait(timeout_s)

    def wait_for(self, model: str, version: str, state: str,
                 timeout_s: float = 60) -> MirrorVersion:
        seen: list[MirrorVersion] = []

        def look() -> Probe:
            with self.client() as c:
                seen.append(c.status(model, version))
            return Probe(seen[-1]["status"]["state"] == state, repr(seen[-1]["status"]))

        wait_until(f"{model}/{version} to be {state}", look, timeout_s=timeout_s, interval_s=0.05)
        return seen[-1]


@pytest.fixture
def start_mirror(tmp_path: Path) -> Iterator[Callable[..., MirrorProcess]]:
    """Function: starts mirrors (default over tmp_path/models, with an admin token beside
    it, import dirs as given); all are stopped afterwards."""
    started: list[MirrorProcess] = []

    def start(models: Path | None = None, *, ports: tuple[int, int] | None = None,
              import_dirs: tuple[Path, ...] = ()) -> MirrorProcess:
        bytes_port, api_port = ports or (free_port(), free_port())
        m = MirrorProcess(models or tmp_path / "models", bytes_port, api_port,
                          import_dirs).start()
        started.append(m)
        return m

    yield start
    for m in started:
        if m.proc is not None and m.proc.poll() is None:
            m.stop(signal.SIGKILL)
